// Forward and reverse KL without a hard-label term in two passes over HBM (docs/perf-notes.md,
// decision 70), instead of the staged row kernel's one pass with a cluster exchange between its
// sweeps (distill_rows.cu):
//   pass 1  distill_pair_statistics_kernel: a cluster of CTAs per row, each streaming its slice of
//           the student and teacher rows (nothing staged, so many CTAs share a multiprocessor and
//           none waits inside its row). Each forms both sides' max and sum of exponentials and the
//           cross sum C = Σ e^(w−m_w)·(w−z) of the weighing side w: the teacher for forward KL
//           (z the student), the student for reverse KL. One exchange at the end gives the row's
//           two lse and its divergence, Σ p_w·(log p_w − log p_z) = C / Z_w − (lse_w − lse_z)
//           (Σ p_w = 1; the loss sweep's per-element form differs by the rounding of Σ p_w,
//           ≈ 1e-7 × |lse_w − lse_z|). The row's statistics land in DistillRowStatistics.
//   pass 2  distill_block_grad (linear_distill_block_grad.cu) over the whole row: the gradient
//           elementwise from those statistics, with the row kernel's own per-element code.
// The row kernel's loss sweep forms the same values from the same transformed logits; rows with
// NaN or +Inf come out NaN in loss and gradient on both paths (their sums are NaN).
#include "cuda/distill_two_pass.cuh"

#include <atomic>
#include <cstdlib>

#include "cuda/ce_device.cuh"
#include "cuda/linear_distill_block_grad.cuh"
#include "cuda/row_kernel_counts.hpp"
#include "cuda/row_slice.cuh"

namespace xent::cuda {
namespace {

using common::DistillKindCode;

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
  into.cross = into.cross * rescale(into_weigh, weigh_max) +
               other.cross * rescale(other_weigh, weigh_max);
  into.student_max = student_max;
  into.teacher_max = teacher_max;
}

// A thread's running sums over its columns. Each exponential of the weighing side serves both
// its sum and the cross sum (two ex2 per column pair, plus two per vector for the rescale).
template <bool kTeacherWeighs>
struct PairAccumulator {
  PairPartial part = empty_partial();

  // Sums of e^(x − max) over N values into `sum` (moved to the new max first); returns the new max.
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
      total += e > 0.0f ? e * (w - z) : 0.0f;  // -inf weights add 0, not 0·inf
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
};

// This thread's sums over its columns of the slice [begin, begin + length) of both rows.
template <bool kTeacherWeighs, class S, class Transform>
__device__ __forceinline__ PairPartial thread_partial(const S* student, const S* teacher,
                                                      int64_t length, bool vector_ok,
                                                      const Transform& transform) {
  constexpr int kVec = kVectorElements<S>;
  PairAccumulator<kTeacherWeighs> acc;
  auto add_vector = [&](const Vector<S>& s, const Vector<S>& t) {
    float u[kVec], v[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      u[k] = transform.value(s.value[k]);
      v[k] = transform.value(t.value[k]);
    }
    acc.add(u, v);
  };
  auto add_element = [&](int64_t i) {
    const float u[1] = {transform.value(load_float(student[i]))};
    const float v[1] = {transform.value(load_float(teacher[i]))};
    acc.add(u, v);
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
    for (int d = 0; d < kDepth; ++d) add_vector(unpack<S>(s_raw[d]), unpack<S>(t_raw[d]));
  }
  for (; j < full_vectors; j += stride) {
    add_vector(unpack<S>(__ldg(s_words + j)), unpack<S>(__ldg(t_words + j)));
  }
  // The columns past the last whole vector, one thread each.
  const int64_t tail = int64_t{full_vectors} * kVec + threadIdx.x;
  if (tail < length) add_element(tail);
  return acc.part;
}

template <bool kTeacherWeighs>
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
    const PairPartial other = shuffle_down<kTeacherWeighs>(p, offset);
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

template <class S, bool kTeacherWeighs>
__global__ void __launch_bounds__(kMaxThreads)
    distill_pair_statistics_kernel(const PairStatsParams p) {
  __shared__ PairPartial scratch[kMaxThreads / 32];
  __shared__ PairPartial slot, merged;
  const DistillRowsArgs& a = p.args;
  const DistillRowOptions& o = a.options;
  const int rank = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.cluster));
  const int64_t row = blockIdx.x / static_cast<unsigned>(p.cluster);
  const int64_t begin = rank * p.slice_elements;
  const int64_t length =
      begin < a.vocab ? (a.vocab - begin < p.slice_elements ? a.vocab - begin : p.slice_elements)
                      : 0;
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
  PairPartial mine = empty_partial();
  with_distill_transform(dc.transform, [&](const auto& transform) {
    mine = thread_partial<kTeacherWeighs>(student, teacher, length, p.vector_ok, transform);
  });
  mine = block_partial<kTeacherWeighs>(mine, scratch);
  cluster_exchange_pull(mine, &slot, &merged, p.cluster,
                        [](PairPartial& into, const PairPartial& other) {
                          merge_partial<kTeacherWeighs>(into, other);
                        });
  if (leader) {
    const float lse_s = merged.student_max + logf(merged.student_sum);
    const float lse_t = merged.teacher_max + logf(merged.teacher_sum);
    const float divergence =
        kTeacherWeighs ? merged.cross / merged.teacher_sum - (lse_t - lse_s)
                       : merged.cross / merged.student_sum - (lse_s - lse_t);
    DistillRowStatistics stats;
    stats.lse_student = lse_s;
    stats.lse_teacher = lse_t;
    stats.sum_prob_u = kTeacherWeighs ? 0.0f : divergence;  // reverse KL: Σ p_s·u is the loss
    p.statistics[row] = stats;
    if (a.row_soft) a.row_soft[row] = divergence;
    if (a.row_hard_loss) a.row_hard_loss[row] = 0.0f;
    if (a.row_hard_z) a.row_hard_z[row] = 0.0f;
    if (a.row_total) {
      a.row_total[row] =
          o.soft_weight != 0.0 ? static_cast<float>(o.soft_weight * divergence) : 0.0f;
    }
  }
  cluster_finish(p.cluster);
}

template <class S>
void launch_pair_statistics(const PairStatsParams& p, const SlicePlan& plan, bool teacher_weighs,
                            cudaStream_t stream) {
  if (teacher_weighs) {
    launch_row_kernel(distill_pair_statistics_kernel<S, true>, p, p.args.rows, plan, stream);
  } else {
    launch_row_kernel(distill_pair_statistics_kernel<S, false>, p, p.args.rows, plan, stream);
  }
}

// XENT_CUDA_DISTILL_TWO_PASS=0 keeps every row on the row kernel (measurements and the tests
// that run both paths, decision 70); read per call, as the other path switches are.
bool two_pass_enabled() {
  const char* knob = std::getenv("XENT_CUDA_DISTILL_TWO_PASS");
  return !(knob && knob[0] == '0');
}

std::atomic<int64_t> two_pass_launches{0};

}  // namespace

int64_t distill_two_pass_launches() { return two_pass_launches.load(); }

bool distill_two_pass_applies(const DistillRowsArgs& args) {
  const DistillKindCode kind = args.options.kind;
  const bool kl = kind == DistillKindCode::forward_kl || kind == DistillKindCode::reverse_kl;
  const bool hard = args.options.hard_weight != 0.0 && args.target != nullptr;
  const bool room = args.statistics != nullptr || args.scratch_statistics != nullptr;
  return kl && !hard && room && two_pass_enabled();
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
  const bool teacher_weighs = args.options.kind == DistillKindCode::forward_kl;
  switch (args.dtype) {
    case DType::f32: launch_pair_statistics<float>(p, plan, teacher_weighs, stream); break;
    case DType::bf16: launch_pair_statistics<bf16_t>(p, plan, teacher_weighs, stream); break;
    case DType::f16: launch_pair_statistics<f16_t>(p, plan, teacher_weighs, stream); break;
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
