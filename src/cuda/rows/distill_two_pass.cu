// Distillation in two or three passes over HBM (docs/archive/perf-notes.md, decisions 70–72), instead
// of the staged row kernel's one pass with a cluster exchange between its sweeps
// (distill_rows.cu):
//   pass 1  distill_pair_statistics_kernel: a cluster of CTAs per row, each streaming its slice of
//           the student and teacher rows (nothing staged, so many CTAs share a multiprocessor and
//           none waits inside its row). Each forms both sides' max and sum of exponentials and a
//           cross sum of the teacher's or the student's exponentials; one exchange at the end
//           gives the row's two lse and, for three kinds, its loss:
//             forward KL  C = Σ e^(t−m_t)·(t−s): KL = C / Z_t − (lse_t − lse_s)
//             reverse KL  C = Σ e^(s−m_s)·(s−t): KL = C / Z_s − (lse_s − lse_t)
//             soft ce     C = Σ e^(t−m_t)·(−s):  −Σ p_t·log p_s = lse_s + C / Z_t
//           (Σ p_w = 1; the loss sweep's per-element form differs by the rounding of Σ p_w, and
//           its terms round two log-probabilities each at |lse|, where these round t − s).
//   sums    distill_pair_sums_kernel (jsd, tvd): the row kernel's loss sweep, streamed, with the
//           lse of pass 1: the loss and the row sums the gradient needs (Σ p_s·u, tvd's sides).
//   pass 2  distill_block_grad (linear_distill_block_grad.cu) over the whole row: the gradient
//           elementwise from the row statistics, with the row kernel's own per-element code.
// The hard-label term (α·CE(s, y)) of forward KL, reverse KL and soft ce rides in pass 1: the ce
// statistics of the student beside the pair's, in the same read (decision 72); jsd and tvd with
// it keep the row kernel. Rows with NaN or +Inf come out NaN in loss and gradient on both paths
// (their sums are NaN).
#include "cuda/rows/distill_two_pass.cuh"

#include <atomic>
#include <cstdlib>
#include <type_traits>

#include "cuda/rows/ce_device.cuh"
#include "cuda/linear/linear_distill_block_grad.cuh"
#include "cuda/rows/row_kernel_counts.hpp"
#include "cuda/rows/row_slice.cuh"
#include "cuda/test_hook.hpp"

namespace xent::cuda {
namespace {

using common::DistillKindCode;

// Rows with the hard-label ce term (docs/semantics.md §3: α·CE(s, y) beside σ·distill).
bool with_hard_term(const DistillRowsArgs& args) {
  return args.options.hard_weight != 0.0 && args.target != nullptr;
}

// One part of a row: both sides' running max and sum of exponentials relative to it, and the
// cross sum relative to the weighing side's max. The empty part is {-inf, 0, -inf, 0, 0}.
struct PairPartial {
  float student_max, student_sum, teacher_max, teacher_sum, cross;
};

__device__ __forceinline__ PairPartial empty_partial() {
  return {-INFINITY, 0.0f, -INFINITY, 0.0f, 0.0f};
}

// e^(max − to), 0 for a part that holds nothing (max = -inf, where max − to may be NaN).
__device__ __forceinline__ float rescale(float max, float to) {
  return max == -INFINITY ? 0.0f : expf(max - to);
}

template <bool kTeacherWeighs>
__device__ __forceinline__ void merge_partial(PairPartial& into, const PairPartial& other) {
  const float student_max = fmaxf(into.student_max, other.student_max);
  const float teacher_max = fmaxf(into.teacher_max, other.teacher_max);
  const float weigh_max = kTeacherWeighs ? teacher_max : student_max;
  const float into_weigh = kTeacherWeighs ? into.teacher_max : into.student_max;
  const float other_weigh = kTeacherWeighs ? other.teacher_max : other.student_max;
  into.student_sum = into.student_sum * rescale(into.student_max, student_max) +
                     other.student_sum * rescale(other.student_max, student_max);
  into.teacher_sum = into.teacher_sum * rescale(into.teacher_max, teacher_max) +
                     other.teacher_sum * rescale(other.teacher_max, teacher_max);
  into.cross =
      into.cross * rescale(into_weigh, weigh_max) + other.cross * rescale(other_weigh, weigh_max);
  into.student_max = student_max;
  into.teacher_max = teacher_max;
}

// A thread's running sums over its columns. Each exponential of the weighing side serves both
// its sum and the cross sum (two ex2 per column pair, plus two per vector for the rescale). The
// cross term of a column is e_w·(w − z), or e_w·(−z) with kNegativeOther (soft ce).
template <bool kTeacherWeighs, bool kNegativeOther>
struct PairAccumulator {
  PairPartial part = empty_partial();

  // Sums of e^(x − max) over N values into `sum` (moved to the new max first); returns the new
  // max.
  // Values holding NaN or +Inf leave the sum NaN.
  template <int N>
  __device__ __forceinline__ static float add_side(const float (&x)[N], float& max, float& sum,
                                                   float (&e)[N]) {
    float best = x[0];
#pragma unroll
    for (int k = 1; k < N; ++k) best = fmaxf(best, x[k]);
    const float new_max = fmaxf(max, best);
    if (new_max == -INFINITY) {
      // Nothing but -inf (or NaN, which fmaxf drops) so far: no exponential to add.
#pragma unroll
      for (int k = 0; k < N; ++k) {
        e[k] = 0.0f;
        if (x[k] != x[k]) sum = x[k];
      }
      return new_max;
    }
    sum *= fast_exp2((max - new_max) * kLog2e);  // 0 while max is -inf; 1 when it stays
    const float scaled_max = new_max * kLog2e;
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      e[k] = fast_exp2(fmaf(x[k], kLog2e, -scaled_max));
      total += e[k];
    }
    sum += total;
    max = new_max;
    return new_max;
  }

  template <int N>
  __device__ __forceinline__ void add(const float (&student)[N], const float (&teacher)[N]) {
    float es[N], et[N];
    const float weigh_before = kTeacherWeighs ? part.teacher_max : part.student_max;
    add_side(student, part.student_max, part.student_sum, es);
    add_side(teacher, part.teacher_max, part.teacher_sum, et);
    const float weigh_after = kTeacherWeighs ? part.teacher_max : part.student_max;
    if (weigh_after == -INFINITY) return;
    part.cross *= fast_exp2((weigh_before - weigh_after) * kLog2e);
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float e = kTeacherWeighs ? et[k] : es[k];
      const float w = kTeacherWeighs ? teacher[k] : student[k];
      const float z = kTeacherWeighs ? student[k] : teacher[k];
      const float term = kNegativeOther ? -z : w - z;
      total += e > 0.0f ? e * term : 0.0f;  // -inf weights add 0, not 0·inf
    }
    part.cross += total;
  }
};

struct PairStatsParams {
  DistillRowsArgs args;
  DistillRowStatistics* statistics;  // args.statistics, or the caller's scratch
  int cluster;
  int64_t slice_elements;
  bool vector_ok;  // student and teacher rows both 16-byte aligned
  bool with_loss;  // the kind's loss follows from the cross sum (else the sums pass forms it)
};

// How pass 1 forms the cross sum, and the row loss from it, for each kind.
enum class CrossForm { forward_kl, reverse_kl, soft_ce };

constexpr bool teacher_weighs(CrossForm form) { return form != CrossForm::reverse_kl; }

// No hard-label term: nothing to add beside the pair.
struct NoHardTerm {
  template <class S>
  __device__ __forceinline__ void add_vector(const Vector<S>&, int) {}
  __device__ __forceinline__ void add_element(int64_t, float) {}
};

// The hard-label ce term's statistics of the student slice (docs/semantics.md §3: α·CE at the §1 options,
// its own transform), formed in the same loop as the pair's, so the student is read once. The
// columns of `class_weight` (smoothing with class weights) are the row's, from `begin`.
template <bool kSmoothing, class HardTransform>
struct HardTermStats {
  VectorRowStats<kSmoothing, false> acc;
  HardTransform transform;
  const float* class_weight = nullptr;
  int64_t begin = 0;

  template <class S>
  __device__ __forceinline__ void add_vector(const Vector<S>& x, int j) {
    constexpr int kVec = kVectorElements<S>;
    const int64_t column = begin + int64_t{j} * kVec;
    float v[kVec], w[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      v[k] = transform.value(x.value[k]);
      w[k] = 1.0f;
    }
    if (kSmoothing && class_weight) load_class_weights(class_weight, column, true, kVec, w);
    if (acc.stats.argmax < 0) acc.stats.argmax = column;  // RowStats::add's first-column rule
    acc.add(v, column, w);
  }
  __device__ __forceinline__ void add_element(int64_t i, float x) {
    const float w = kSmoothing && class_weight ? class_weight[begin + i] : 1.0f;
    acc.stats.add(transform.value(x), begin + i, w);
  }
};

// This thread's sums over its columns of the slice (`length` columns from `student` and
// `teacher`), and the hard term's statistics of the same student columns into `hard`.
template <CrossForm kForm, class S, class Transform, class Hard>
__device__ __forceinline__ PairPartial thread_partial(const S* student, const S* teacher,
                                                      int64_t length, bool vector_ok,
                                                      const Transform& transform, Hard& hard) {
  constexpr int kVec = kVectorElements<S>;
  PairAccumulator<teacher_weighs(kForm), kForm == CrossForm::soft_ce> acc;
  auto add_vector = [&](const Vector<S>& s, const Vector<S>& t, int j) {
    float u[kVec], v[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      u[k] = transform.value(s.value[k]);
      v[k] = transform.value(t.value[k]);
    }
    acc.add(u, v);
    hard.add_vector(s, j);
  };
  auto add_element = [&](int64_t i) {
    const float x = load_float(student[i]);
    const float u[1] = {transform.value(x)};
    const float v[1] = {transform.value(load_float(teacher[i]))};
    acc.add(u, v);
    hard.add_element(i, x);
  };
  if (!vector_ok) {
    for (int64_t i = threadIdx.x; i < length; i += blockDim.x) add_element(i);
    return acc.part;
  }
  // Four 16-byte loads of each row in flight per thread, as the ce forward's streamed sweep
  // (row_stats.cuh: one in flight held it to ~0.6 of copy bandwidth).
  constexpr int kDepth = 4;
  const uint4* s_words = reinterpret_cast<const uint4*>(student);
  const uint4* t_words = reinterpret_cast<const uint4*>(teacher);
  const int full_vectors = static_cast<int>(length / kVec);
  const int stride = static_cast<int>(blockDim.x);
  int j = threadIdx.x;
  for (; j + (kDepth - 1) * stride < full_vectors; j += kDepth * stride) {
    uint4 s_raw[kDepth], t_raw[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      s_raw[d] = __ldg(s_words + j + d * stride);
      t_raw[d] = __ldg(t_words + j + d * stride);
    }
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      add_vector(unpack<S>(s_raw[d]), unpack<S>(t_raw[d]), j + d * stride);
    }
  }
  for (; j < full_vectors; j += stride) {
    add_vector(unpack<S>(__ldg(s_words + j)), unpack<S>(__ldg(t_words + j)), j);
  }
  // The columns past the last whole vector, one thread each.
  const int64_t tail = int64_t{full_vectors} * kVec + threadIdx.x;
  if (tail < length) add_element(tail);
  return acc.part;
}

__device__ __forceinline__ PairPartial shuffle_down(const PairPartial& p, int offset) {
  PairPartial other;
  other.student_max = __shfl_down_sync(0xffffffffu, p.student_max, offset);
  other.student_sum = __shfl_down_sync(0xffffffffu, p.student_sum, offset);
  other.teacher_max = __shfl_down_sync(0xffffffffu, p.teacher_max, offset);
  other.teacher_sum = __shfl_down_sync(0xffffffffu, p.teacher_sum, offset);
  other.cross = __shfl_down_sync(0xffffffffu, p.cross, offset);
  return other;
}

// The CTA's merge of every thread's part, valid in thread 0 (fixed order: runs repeat exactly).
template <bool kTeacherWeighs>
__device__ __forceinline__ PairPartial block_partial(PairPartial p, PairPartial* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const PairPartial other = shuffle_down(p, offset);
    if (static_cast<int>(threadIdx.x % 32) + offset < 32) merge_partial<kTeacherWeighs>(p, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = p;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int warps = (blockDim.x + 31) / 32;
    for (int w = 1; w < warps; ++w) merge_partial<kTeacherWeighs>(p, scratch[w]);
  }
  return p;
}

// The row's loss outputs, as the row kernel writes them: d_n, the hard term's r_n·ℓ_n and
// r_n·ζ_n, and σ·d_n + α·r_n·(ℓ_n + ζ_n) for `none`.
__device__ __forceinline__ void write_row_loss(const DistillRowsArgs& a, int64_t row, float soft,
                                               float hard_loss = 0.0f, float hard_z = 0.0f) {
  if (a.row_soft) a.row_soft[row] = soft;
  if (a.row_hard_loss) a.row_hard_loss[row] = hard_loss;
  if (a.row_hard_z) a.row_hard_z[row] = hard_z;
  if (a.row_total) {
    const DistillRowOptions& o = a.options;
    double total = 0;
    if (o.soft_weight != 0.0) total += o.soft_weight * soft;
    if (o.hard_weight != 0.0) total += o.hard_weight * (double{hard_loss} + hard_z);
    a.row_total[row] = static_cast<float>(total);
  }
}

// What a CTA hands to the row's exchange: the pair's part and, with the hard term, its ce
// statistics and the transformed target logit (from the CTA that holds the target column).
struct RowPartial {
  PairPartial pair;
  common::RowStats<float> hard;
  float hard_target_logit;
};

struct DistillSumsRecord {
  float value[kDistillSums];
};

template <class S, CrossForm kForm, bool kHard>
__global__ void __launch_bounds__(kMaxThreads)
    distill_pair_statistics_kernel(const PairStatsParams p) {
  constexpr bool kTeacherWeighs = teacher_weighs(kForm);
  __shared__ PairPartial scratch[kMaxThreads / 32];
  __shared__ SharedStorage<common::RowStats<float>[kMaxThreads / 32]> hard_scratch;
  __shared__ SharedStorage<RowPartial> slot_storage, merged_storage;
  RowPartial& slot = slot_storage.get();
  RowPartial& merged = merged_storage.get();
  const DistillRowsArgs& a = p.args;
  const DistillRowOptions& o = a.options;
  const ClusterSlice slice = cluster_slice(p.cluster, p.slice_elements, a.vocab);
  const int rank = slice.rank;
  const int64_t row = slice.row, begin = slice.begin, length = slice.length;
  const bool has_target = a.target != nullptr;
  const int64_t target = has_target ? read_target(a.target, a.target_dtype, row) : 0;
  const bool valid = !has_target || target != o.ce.ignore_index;
  const bool in_range = !has_target || (target >= 0 && target < a.vocab);
  const bool leader = rank == 0 && threadIdx.x == 0;
  if (!valid || !in_range) {
    // The row kernel's fill: zero loss for an ignored row, NaN for an out-of-range target; the
    // gradient pass fills their gradient the same way. No CTA of the row takes part in an exchange.
    if (leader) {
      const float fill = valid ? quiet_nan() : 0.0f;
      if (a.row_soft) a.row_soft[row] = fill;
      if (a.row_hard_loss) a.row_hard_loss[row] = fill;
      if (a.row_hard_z) a.row_hard_z[row] = fill;
      if (a.row_total) a.row_total[row] = fill;
      p.statistics[row] = DistillRowStatistics{};
    }
    return;
  }
  const S* student = static_cast<const S*>(a.student) + row * a.student_row_stride + begin;
  const S* teacher = static_cast<const S*>(a.teacher) + row * a.teacher_row_stride + begin;
  const common::DistillConstants<float> dc =
      common::make_distill_constants(o.kind, o.temperature, o.softcap, o.beta);
  RowPartial mine;
  mine.pair = empty_partial();
  mine.hard_target_logit = 0.0f;
  const common::CeConstants<float> hc = make_ce_constants(o.ce, a.vocab, a.totals);
  if constexpr (kHard) {
    const float* class_weight = o.ce.class_weight;
    with_transform(hc.transform, [&](const auto& hard_transform) {
      auto pair_and_hard = [&](auto hard) {
        hard.transform = hard_transform;
        hard.class_weight = class_weight;
        hard.begin = begin;
        with_distill_transform(dc.transform, [&](const auto& transform) {
          mine.pair = thread_partial<kForm>(student, teacher, length, p.vector_ok, transform, hard);
        });
        // NaN or +Inf: RowStats::add element by element decides the row's NaN statistics. Its
        // columns per thread are not quite the fast loop's (whole last vectors, not one tail
        // element per thread), which matters only on such rows, whose statistics come out NaN
        // whichever thread holds which column.
        mine.hard = hard.acc.needs_exact_path()
                        ? exact_slice_row_stats(stream_slice(student, begin, length, false),
                                                hard_transform, class_weight)
                        : hard.acc.stats;
      };
      using HardTransform = std::decay_t<decltype(hard_transform)>;
      if (hc.smoothing > 0) {
        pair_and_hard(HardTermStats<true, HardTransform>{});
      } else {
        pair_and_hard(HardTermStats<false, HardTransform>{});
      }
      if (threadIdx.x == 0 && target >= begin && target < begin + length) {
        mine.hard_target_logit = hard_transform.value(load_float(student[target - begin]));
      }
    });
    mine.hard = block_merge(mine.hard, hard_scratch.get());
  } else {
    NoHardTerm none;
    with_distill_transform(dc.transform, [&](const auto& transform) {
      mine.pair = thread_partial<kForm>(student, teacher, length, p.vector_ok, transform, none);
    });
  }
  mine.pair = block_partial<kTeacherWeighs>(mine.pair, scratch);
  cluster_exchange_pull(mine, &slot, &merged, p.cluster,
                        [](RowPartial& into, const RowPartial& other) {
                          merge_partial<kTeacherWeighs>(into.pair, other.pair);
                          if constexpr (kHard) {
                            into.hard.merge(other.hard);
                            into.hard_target_logit += other.hard_target_logit;
                          }
                        });
  if (leader) {
    const PairPartial& row_pair = merged.pair;
    const float lse_s = row_pair.student_max + logf(row_pair.student_sum);
    const float lse_t = row_pair.teacher_max + logf(row_pair.teacher_sum);
    float loss = 0.0f;
    if constexpr (kForm == CrossForm::forward_kl) {
      loss = row_pair.cross / row_pair.teacher_sum - (lse_t - lse_s);
    } else if constexpr (kForm == CrossForm::reverse_kl) {
      loss = row_pair.cross / row_pair.student_sum - (lse_s - lse_t);
    } else {
      loss = lse_s + row_pair.cross / row_pair.teacher_sum;
    }
    DistillRowStatistics stats;
    stats.lse_student = lse_s;
    stats.lse_teacher = lse_t;
    // Reverse KL's Σ p_s·u is its loss; jsd's and tvd's sums come from the sums pass.
    stats.sum_prob_u = kForm == CrossForm::reverse_kl ? loss : 0.0f;
    float hard_loss = 0.0f, hard_z = 0.0f;
    if constexpr (kHard) {
      const common::RowStats<float>& hs = merged.hard;
      stats.hard_lse = hs.lse();
      const float target_weight = o.ce.class_weight ? o.ce.class_weight[target] : 1.0f;
      const float r = a.row_weight ? a.row_weight[row] : 1.0f;
      const auto parts =
          common::ce_row_loss(hc, hs, stats.hard_lse, merged.hard_target_logit, target_weight);
      hard_loss = r * parts.loss;
      hard_z = r * parts.z_loss;
    }
    p.statistics[row] = stats;
    if (p.with_loss) write_row_loss(a, row, loss, hard_loss, hard_z);
  }
  cluster_finish(p.cluster);
}

// ---- the sums pass (jsd, tvd) ------------------------------------------------------------------

// The row kernel's loss sweep over a streamed slice, with the row's lse from pass 1: Σ of the
// loss terms, Σ p_s·u (jsd) and tvd's per-side sums (add_distill_sums, kind fixed).
template <class S, DistillKindCode kKind>
__global__ void __launch_bounds__(kMaxThreads) distill_pair_sums_kernel(const PairStatsParams p) {
  constexpr int kVec = kVectorElements<S>;
  __shared__ float scratch[kDistillSums * kMaxThreads / 32];
  __shared__ DistillSumsRecord slot, merged;
  const DistillRowsArgs& a = p.args;
  const DistillRowOptions& o = a.options;
  const ClusterSlice slice = cluster_slice(p.cluster, p.slice_elements, a.vocab);
  const int rank = slice.rank;
  const int64_t row = slice.row, begin = slice.begin, length = slice.length;
  if (a.target) {
    const int64_t target = read_target(a.target, a.target_dtype, row);
    // Pass 1 wrote what these rows report.
    if (target == o.ce.ignore_index || target < 0 || target >= a.vocab) return;
  }
  const DistillRowStatistics stats = p.statistics[row];
  const S* student = static_cast<const S*>(a.student) + row * a.student_row_stride + begin;
  const S* teacher = static_cast<const S*>(a.teacher) + row * a.teacher_row_stride + begin;
  const common::DistillConstants<float> dc =
      common::make_distill_constants(o.kind, o.temperature, o.softcap, o.beta);
  DistillSumsRecord mine{};
  with_distill_transform(dc.transform, [&](const auto& transform) {
    auto add = [&](float x, float t) {
      add_distill_sums<kKind>(dc,
                              element_probs(transform.value(x), transform.value(t),
                                            stats.lse_student, stats.lse_teacher),
                              mine.value);
    };
    if (p.vector_ok) {
      const uint4* s_words = reinterpret_cast<const uint4*>(student);
      const uint4* t_words = reinterpret_cast<const uint4*>(teacher);
      const int full_vectors = static_cast<int>(length / kVec);
      for (int j = threadIdx.x; j < full_vectors; j += blockDim.x) {
        const Vector<S> sv = unpack<S>(__ldg(s_words + j));
        const Vector<S> tv = unpack<S>(__ldg(t_words + j));
#pragma unroll
        for (int k = 0; k < kVec; ++k) add(sv.value[k], tv.value[k]);
      }
      const int64_t tail = int64_t{full_vectors} * kVec + threadIdx.x;
      if (tail < length) add(load_float(student[tail]), load_float(teacher[tail]));
    } else {
      for (int64_t i = threadIdx.x; i < length; i += blockDim.x) {
        add(load_float(student[i]), load_float(teacher[i]));
      }
    }
  });
  block_sum(mine.value, scratch);
  cluster_exchange_pull(mine, &slot, &merged, p.cluster,
                        [](DistillSumsRecord& into, const DistillSumsRecord& other) {
#pragma unroll
                          for (int k = 0; k < kDistillSums; ++k) into.value[k] += other.value[k];
                        });
  if (rank == 0 && threadIdx.x == 0) {
    DistillRowStatistics out = stats;
    out.sum_prob_u = merged.value[1];
    out.tvd_above = merged.value[2];
    out.tvd_below = merged.value[3];
    out.tvd_equal = merged.value[4];
    p.statistics[row] = out;
    write_row_loss(a, row, merged.value[0]);
  }
  cluster_finish(p.cluster);
}

template <class S, CrossForm kForm>
void launch_statistics(const PairStatsParams& p, const SlicePlan& plan, bool hard,
                       cudaStream_t stream) {
  if (hard) {
    launch_row_kernel(distill_pair_statistics_kernel<S, kForm, true>, p, p.args.rows, plan, stream);
  } else {
    launch_row_kernel(distill_pair_statistics_kernel<S, kForm, false>, p, p.args.rows, plan,
                      stream);
  }
}

template <class S>
void launch_passes(const PairStatsParams& p, const SlicePlan& plan, cudaStream_t stream) {
  const int64_t rows = p.args.rows;
  const bool hard = with_hard_term(p.args);
  switch (p.args.options.kind) {
    case DistillKindCode::reverse_kl:
      launch_statistics<S, CrossForm::reverse_kl>(p, plan, hard, stream);
      return;
    case DistillKindCode::soft_ce:
      launch_statistics<S, CrossForm::soft_ce>(p, plan, hard, stream);
      return;
    default:
      // forward KL; jsd and tvd (never with the hard term) take its lse, then their sums.
      launch_statistics<S, CrossForm::forward_kl>(p, plan, hard, stream);
      break;
  }
  if (p.args.options.kind == DistillKindCode::jsd) {
    launch_row_kernel(distill_pair_sums_kernel<S, DistillKindCode::jsd>, p, rows, plan, stream);
  } else if (p.args.options.kind == DistillKindCode::tvd) {
    launch_row_kernel(distill_pair_sums_kernel<S, DistillKindCode::tvd>, p, rows, plan, stream);
  }
}

// The tests that run both paths keep every row on the row kernel through the test hook.
bool two_pass_enabled() { return test_hook().distill_two_pass != Forced::off; }

std::atomic<int64_t> two_pass_launches{0};

}  // namespace

int64_t distill_two_pass_launches() { return two_pass_launches.load(); }

bool distill_two_pass_applies(const DistillRowsArgs& args) {
  // jsd and tvd form their loss in the sums pass, which does not carry the hard term's parts.
  const DistillKindCode kind = args.options.kind;
  const bool three_passes = kind == DistillKindCode::jsd || kind == DistillKindCode::tvd;
  const bool room = args.statistics != nullptr || args.scratch_statistics != nullptr;
  return !(three_passes && with_hard_term(args)) && room && two_pass_enabled();
}

void distill_rows_two_pass(const DistillRowsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return;
  const std::size_t element = dtype_size(args.dtype);
  // The streamed forward's slices (row_slice.cu: 128 KiB of each row per CTA; fewer CTAs per
  // row, fewer exchanges), read from HBM once.
  const SlicePlan plan = plan_streamed_row_slices(args.vocab, element);
  PairStatsParams p{};
  p.args = args;
  p.statistics = args.statistics ? args.statistics : args.scratch_statistics;
  p.cluster = plan.cluster;
  p.slice_elements = plan.slice_elements;
  p.vector_ok = rows_are_vector_aligned(args.student, args.student_row_stride, element) &&
                rows_are_vector_aligned(args.teacher, args.teacher_row_stride, element);
  const DistillKindCode kind = args.options.kind;
  p.with_loss = kind != DistillKindCode::jsd && kind != DistillKindCode::tvd;
  switch (args.dtype) {
    case DType::f32:
      launch_passes<float>(p, plan, stream);
      break;
    case DType::bf16:
      launch_passes<bf16_t>(p, plan, stream);
      break;
    case DType::f16:
      launch_passes<f16_t>(p, plan, stream);
      break;
    default:
      throw Error(ErrorKind::invalid_argument,
                  std::string("distill_rows: student dtype unsupported on CUDA: got ") +
                      dtype_name(args.dtype) + "; expected float32, bfloat16 or float16");
  }
  XENT_CUDA_CHECK_LAUNCH();
  two_pass_launches.fetch_add(1, std::memory_order_relaxed);
  if (!args.grad) return;

  DistillBlockGradArgs g;
  g.grad = args.grad;
  g.grad_stride = args.grad_row_stride;
  g.dtype = args.dtype;
  g.rows = args.rows;
  g.columns = args.vocab;
  g.first_column = 0;
  g.vocab = args.vocab;
  g.student = args.student;
  g.student_stride = args.student_row_stride;
  g.teacher = args.teacher;
  g.teacher_stride = args.teacher_row_stride;
  g.target = args.target;
  g.target_dtype = args.target_dtype;
  g.statistics = p.statistics;
  g.row_weight = args.row_weight;
  g.grad_output_rows = args.grad_output_rows;
  g.options = args.options;
  g.totals = args.totals;
  distill_block_grad(g, stream);
}

}  // namespace xent::cuda
