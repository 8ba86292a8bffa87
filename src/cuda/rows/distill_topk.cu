// Distillation from a top-k teacher, CUDA backend (docs/semantics.md §3.1), on the row-slice plan
// of the ce kernel (row_slice.cuh): the row split in slices over a cluster of CTAs (Hopper) or
// one CTA (portable), each slice staged in shared memory once (or streamed where the plan says).
// Every CTA reads the row's k entries and their student logits x_j from HBM before the exchange
// (so an in-place gradient never overwrites a logit another CTA still reads) and keeps the
// membership bits of its own slice; one sweep of the slice forms (row max, Σ e, Σ e outside the
// ids, outside max), exchanged over the cluster in rank order with the hard-label term's
// statistics and the NaN flag. Each CTA then forms the categories' terms from the k entries
// (common/distill_topk_row.hpp), sweeps its slice for the gradient and rewrites the id columns it
// owns. renormalize without the hard term reads no column outside the ids: its gradient is a
// zero fill and the id columns. The per-row losses go through distill_reduce as distill's do.
#include "api/backend.hpp"
#include "common/distill_topk_row.hpp"
#include "cuda/rows/distill_rows.cuh"
#include "cuda/rows/row_slice.cuh"
#include "cuda/rows/row_stats.cuh"

namespace xent::cuda {
namespace {

using common::CeGradRow;
using common::RowStats;

struct TopKArgs {
  int64_t rows = 0;
  const void* student = nullptr;
  int64_t row_stride = 0;
  int64_t vocab = 0;
  const void* ids = nullptr;
  DType id_dtype = DType::i64;
  const void* logprobs = nullptr;
  DType logprob_dtype = DType::f32;
  int64_t k = 0;
  int64_t ids_stride = 0, logprobs_stride = 0;
  const void* target = nullptr;
  DType target_dtype = DType::i64;
  const float* row_weight = nullptr;  // r_n of the hard term, or null
  common::TopKMassCode mass = common::TopKMassCode::renormalize;
  DistillRowOptions options;
  const CeBatchTotals* totals = nullptr;
  const float* grad_output_rows = nullptr;  // g_n of reduction none, or null
  float* row_soft = nullptr;
  float* row_total = nullptr;
  float* row_hard_loss = nullptr;  // r_n·ℓ_n and r_n·ζ_n of the hard term (null without one)
  float* row_hard_z = nullptr;
  void* grad = nullptr;
  int64_t grad_row_stride = 0;
};

struct TopKKernelParams {
  TopKArgs args;
  int cluster;
  int64_t slice_elements;
  bool staged;      // the slice held in shared memory (else streamed)
  bool bulk;        // staged by bulk copies (Hopper paths), else by cp.async
  bool read_slice;  // false: renormalize without the hard term reads only the id columns
  bool student_vector_ok;
  bool grad_vector_ok;
};

// Dynamic shared memory of a CTA, carved alike on the host (sizes) and in the kernel:
// [staged slice | membership bits of the slice | id (int32) | x_j | ℓ_j, then ∂loss/∂a_j].
struct TopKLayout {
  std::size_t bits = 0, ids = 0, x = 0, ell = 0, total = 0;
};
__host__ __device__ constexpr std::size_t round16(std::size_t bytes) {
  return (bytes + 15) / 16 * 16;
}
__host__ __device__ inline TopKLayout topk_layout(int64_t slice_elements, std::size_t element,
                                                  bool staged, int64_t k) {
  TopKLayout l;
  const auto entries = round16(static_cast<std::size_t>(k) * 4);
  l.bits = staged ? static_cast<std::size_t>(slice_elements) * element : 0;  // 16-byte multiple
  l.ids = l.bits + round16(static_cast<std::size_t>((slice_elements + 31) / 32) * 4);
  l.x = l.ids + entries;
  l.ell = l.x + entries;
  l.total = l.ell + entries;
  return l;
}

// Σ e^(v − max) over the columns of a slice and over those outside the ids, both against the
// row's running max, and the max of the outside columns.
struct TopKStats {
  float max = -INFINITY;
  float sum = 0;
  float out_sum = 0;
  float out_max = -INFINITY;

  __device__ __forceinline__ void merge(const TopKStats& o) {
    const float m = fmaxf(max, o.max);
    const float a = max == m ? 1.0f : __expf(max - m);  // equal maxima (±inf included): 1
    const float b = o.max == m ? 1.0f : __expf(o.max - m);
    sum = sum * a + o.sum * b;
    out_sum = out_sum * a + o.out_sum * b;
    max = m;
    out_max = fmaxf(out_max, o.out_max);
  }

  // N columns; bit k of `members` set for a column among the ids. One rescale a vector, one
  // exponential a column; the exact form only while the max is not finite.
  template <int N>
  __device__ __forceinline__ void add(const float (&v)[N], uint32_t members) {
    float vm = v[0];
#pragma unroll
    for (int k = 1; k < N; ++k) vm = fmaxf(vm, v[k]);
    if (vm > max) {
      const float r = __expf(max - vm);  // 0 on the first finite value (max = −inf)
      sum *= r;
      out_sum *= r;
      max = vm;
    }
    float e[N];
    if (max > -INFINITY && max < INFINITY) {  // a branch, not a select: one exponential a column
      const float shift = max * kLog2e;
#pragma unroll
      for (int k = 0; k < N; ++k) e[k] = fast_exp2(fmaf(v[k], kLog2e, -shift));
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        e[k] = v[k] == -INFINITY ? 0.0f : (v[k] == max ? 1.0f : __expf(v[k] - max));
      }
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      sum += e[k];
      if (!((members >> k) & 1u)) {
        out_sum += e[k];
        out_max = fmaxf(out_max, v[k]);
      }
    }
  }

  __device__ float lse() const { return max == -INFINITY ? max : max + logf(sum); }
};

__device__ __forceinline__ TopKStats shuffle_xor(const TopKStats& s, int offset) {
  TopKStats o;
  o.max = __shfl_xor_sync(0xffffffffu, s.max, offset);
  o.sum = __shfl_xor_sync(0xffffffffu, s.sum, offset);
  o.out_sum = __shfl_xor_sync(0xffffffffu, s.out_sum, offset);
  o.out_max = __shfl_xor_sync(0xffffffffu, s.out_max, offset);
  return o;
}

// Merged over the CTA in a fixed order; valid in thread 0. `scratch`: one entry a warp.
__device__ TopKStats block_merge_topk(TopKStats s, TopKStats* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) s.merge(shuffle_xor(s, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < static_cast<int>((blockDim.x + 31) / 32) ? scratch[lane] : TopKStats{};
    for (int offset = 16; offset > 0; offset /= 2) s.merge(shuffle_xor(s, offset));
  }
  return s;
}

// The statistics sweep of a slice. kOutsideOnly: the id columns count as −inf (the re-sweep for
// the outside logsumexp, whose max is then the outside max).
template <bool kOutsideOnly, class S, class Transform>
__device__ __forceinline__ TopKStats topk_slice_stats(const RowSlice<S>& slice,
                                                      const Transform& transform,
                                                      const uint32_t* bits) {
  constexpr int kVec = kVectorElements<S>;
  TopKStats st;
  const int vectors = static_cast<int>(slice.vectors());
  for (int j = threadIdx.x; j < vectors; j += blockDim.x) {
    const Vector<S> x = kOutsideOnly ? slice.reload(j) : slice.load(j, j / blockDim.x);
    const int c0 = j * kVec;  // kVec divides 32: a vector's bits share one word
    const uint32_t members = bits[c0 >> 5] >> (c0 & 31);
    const bool whole = c0 + kVec <= slice.length;
    float v[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const bool column = whole || c0 + k < slice.length;
      const bool skip = !column || (kOutsideOnly && ((members >> k) & 1u));
      v[k] = skip ? -INFINITY : transform.value(x.value[k]);
    }
    st.add(v, members);
  }
  return st;
}

// What a CTA contributes to its row.
struct TopKPartial {
  TopKStats soft;
  RowStats<float> hard;  // ce statistics of the slice (hard term only)
  float hard_target_logit;
  int bad;  // an id out of range or twice: the row becomes NaN (the CPU reports it)
};

// The row-wide values every thread of the CTA needs after the exchange.
struct TopKRowShared {
  TopKPartial merged;
  TopKStats outside;  // the re-sweep's merge
  CeGradRow<float> hard_row;
  float out_lse, a_tail, tail_grad, coef;
  float hard_loss, hard_z;
  int bad;
};

// Online (max, Σ e^(v − max)) of a few values (the categories).
struct LseState {
  float max = -INFINITY;
  float sum = 0;
  __device__ void add(float v) {
    if (v == -INFINITY) return;
    if (v > max) {
      sum = sum * __expf(max - v) + 1.0f;
      max = v;
    } else {
      sum += __expf(v - max);
    }
  }
  __device__ void merge(float m, float s) {
    if (m == -INFINITY) return;
    if (m > max) {
      sum = sum * __expf(max - m) + s;
      max = m;
    } else {
      sum += s * __expf(m - max);
    }
  }
  __device__ float lse() const { return max == -INFINITY ? max : max + logf(sum); }
};

__device__ LseState warp_lse(LseState s) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float m = __shfl_xor_sync(0xffffffffu, s.max, offset);
    const float v = __shfl_xor_sync(0xffffffffu, s.sum, offset);
    s.merge(m, v);
  }
  return s;
}

__device__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The row's k entries in shared memory (topk_layout).
struct TopKEntries {
  int* id;     // −1: absent (or out of range, flagged)
  float* x;    // raw student logit at the id
  float* ell;  // teacher log-probability, then the category's ∂loss/∂a_j
};

// Warp 0: the categories' loss and gradients from the k entries and the merged sums (every CTA
// of the row alike); lane 0 writes the row's outputs (rank 0) and the row constants.
template <class Transform>
__device__ void topk_categories(const TopKArgs& a, const Transform& transform, const TopKEntries& e,
                                TopKRowShared& rs, float lse_all, int64_t row, bool write_row,
                                bool with_hard) {
  const int lane = threadIdx.x;
  const int64_t k = a.k, vocab = a.vocab;
  const auto& o = a.options;
  const float a_tail = rs.out_lse;
  const bool renormalize = a.mass == common::TopKMassCode::renormalize;
  const float inv_t = 1.0f / o.temperature;
  // Teacher: logsumexp of ℓ (scaled by 1/T for renormalize); student: over the ids.
  LseState teacher, student_ids;
  int present = 0;
  for (int64_t j = lane; j < k; j += 32) {
    if (e.id[j] < 0) continue;
    ++present;
    teacher.add(e.ell[j] * (renormalize ? inv_t : 1.0f));
    student_ids.add(transform.value(e.x[j]));
  }
  teacher = warp_lse(teacher);
  student_ids = warp_lse(student_ids);
  for (int offset = 16; offset > 0; offset /= 2)
    present += __shfl_xor_sync(0xffffffffu, present, offset);
  const float t_lse = teacher.lse();
  const float shift = renormalize ? t_lse : 0.0f;
  float log_tail = -INFINITY;
  if (!renormalize && a.mass == common::TopKMassCode::tail) {
    const float rest = -expm1f(t_lse);
    log_tail = rest > 0 ? logf(rest) : (rest != rest ? rest : -INFINITY);
  }
  const float z = renormalize ? (present == 0 ? 0.0f : student_ids.lse()) : lse_all;
  const bool with_tail = !renormalize && present < vocab;
  const auto dc = common::make_distill_constants<float>(o.kind, o.temperature, o.softcap, o.beta);
  // Loss, Σ p·u and W over the categories (the tail category by lane 0).
  double loss = 0, prob_u = 0, weight = 0;
  auto category = [&](float log_ps, float log_pt) {
    const auto term =
        common::distill_term_from_probs(dc, log_ps, log_pt, expf(log_ps), expf(log_pt));
    loss += term.loss;
    prob_u += term.prob_u;
    weight += expf(log_pt);
  };
  for (int64_t j = lane; j < k; j += 32) {
    if (e.id[j] < 0) continue;
    category(transform.value(e.x[j]) - z, renormalize ? e.ell[j] * inv_t - shift : e.ell[j]);
  }
  if (lane == 0 && with_tail) category(a_tail - z, log_tail);
  loss = warp_sum(loss);
  prob_u = warp_sum(prob_u);
  weight = warp_sum(weight);
  for (int64_t j = lane; j < k; j += 32) {  // ℓ_j becomes the category's gradient
    if (e.id[j] < 0) continue;
    const float log_ps = transform.value(e.x[j]) - z;
    const float log_pt = renormalize ? e.ell[j] * inv_t - shift : e.ell[j];
    e.ell[j] = common::topk_category_grad(dc, log_ps, log_pt, static_cast<float>(prob_u),
                                          static_cast<float>(weight));
  }
  if (lane != 0) return;
  rs.tail_grad =
      with_tail ? common::topk_category_grad(dc, a_tail - z, log_tail, static_cast<float>(prob_u),
                                             static_cast<float>(weight))
                : 0.0f;
  rs.a_tail = with_tail && a_tail > -INFINITY ? a_tail : INFINITY;  // +inf: no tail share
  const bool bad = rs.bad != 0;
  if (write_row) {
    const float soft = bad ? NAN : static_cast<float>(loss);
    if (a.row_soft) a.row_soft[row] = soft;
    const float hard_loss = with_hard ? rs.hard_loss : 0.0f;
    const float hard_z = with_hard ? rs.hard_z : 0.0f;
    if (a.row_hard_loss) a.row_hard_loss[row] = hard_loss;
    if (a.row_hard_z) a.row_hard_z[row] = hard_z;
    if (a.row_total) {
      double total = o.soft_weight * soft;
      if (with_hard) total += o.hard_weight * (double{hard_loss} + hard_z);
      a.row_total[row] = static_cast<float>(total);
    }
  }
  const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  rs.coef = distill_soft_coef(o, a.totals, upstream) * (bad ? NAN : 1.0f);
}

// Stages the row's k entries: x_j from HBM (any slice), the membership bits of this CTA's slice
// [begin, begin + length); flags an id out of range or twice in `bad`. Ends synchronised.
template <class S>
__device__ void stage_entries(const TopKArgs& a, const S* student_row, int64_t row, int64_t begin,
                              int64_t length, const TopKEntries& e, uint32_t* bits, int& bad) {
  const int64_t words = (length + 31) / 32;
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) {
    const int64_t at_id = row * a.ids_stride + j, at_lp = row * a.logprobs_stride + j;
    int64_t id = a.id_dtype == DType::i32 ? static_cast<const int32_t*>(a.ids)[at_id]
                                          : static_cast<const int64_t*>(a.ids)[at_id];
    const float ell = a.logprob_dtype == DType::f32
                          ? static_cast<const float*>(a.logprobs)[at_lp]
                          : static_cast<float>(static_cast<const double*>(a.logprobs)[at_lp]);
    if (id < -1 || id >= a.vocab) {
      bad = 1;
      id = -1;
    }
    if (id >= 0) {
      e.x[j] = load_float(student_row[id]);
      const int64_t c = id - begin;
      if (c >= 0 && c < length) {
        const uint32_t bit = 1u << (c % 32);
        if (atomicOr(&bits[c / 32], bit) & bit) bad = 1;
      }
    }
    e.id[j] = static_cast<int>(id);
    e.ell[j] = ell;
  }
  __syncthreads();
}

// The hard-label ce term's ∂/∂x of column i (row column) at x.
struct TopKHardPart {
  common::CeConstants<float> hc;
  CeGradRow<float> row;
  const float* class_weight;  // read only when weighed
  bool weighed;               // class weights and label smoothing
  int64_t target;
  __device__ __forceinline__ float operator()(int64_t i, float x) const {
    const float w = weighed ? class_weight[i] : 1.0f;
    const float p = __expf(hc.transform.value(x) - row.lse);
    return common::ce_grad_from_prob(row, p, hc.transform.slope(x), i == target, w);
  }
};

// The gradient of a slice: the tail share outside the ids (all columns here; the id columns are
// rewritten after), plus the hard term.
template <bool kHard, class S, class Transform>
__device__ __forceinline__ void topk_grad_sweep(const RowSlice<S>& slice,
                                                const Transform& transform, float coef_tail,
                                                float a_tail, const TopKHardPart& hard, S* grad,
                                                bool grad_vector_ok) {
  constexpr int kVec = kVectorElements<S>;
  const int vectors = static_cast<int>(slice.vectors());
  const bool no_tail = a_tail == INFINITY;
  const float scaled_tail = no_tail ? 0.0f : a_tail * kLog2e;
  for (int j = threadIdx.x; j < vectors; j += blockDim.x) {
    const Vector<S> x = slice.reload(j);  // this thread waited on its piece in the first sweep
    Vector<S> g;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float value, slope;
      value_and_slope(transform, x.value[k], value, slope);
      const float share = no_tail ? 0.0f : fast_exp2(fmaf(value, kLog2e, -scaled_tail));
      g.value[k] = coef_tail * share * slope;
      // Columns past the slice are not stored; their class weights must not be read.
      if (kHard && j * kVec + k < slice.length) {
        g.value[k] += hard(slice.begin + j * kVec + k, x.value[k]);
      }
    }
    store_vector(grad, j, slice.length, grad_vector_ok, g);
  }
}

// At most 80 registers: three CTAs of 256 threads share a multiprocessor (64 KiB slices).
template <class S>
__global__ void __launch_bounds__(kMaxThreads, 3) distill_topk_kernel(const TopKKernelParams p) {
  extern __shared__ __align__(128) unsigned char dynamic_shared[];
  __shared__ uint64_t barriers[kMaxPieces];
  __shared__ SharedStorage<RowStats<float>[kMaxThreads / 32]> hard_scratch_storage;
  __shared__ SharedStorage<TopKStats[kMaxThreads / 32]> scratch_storage;
  __shared__ SharedStorage<TopKPartial[kMaxCluster]> slot_storage;
  __shared__ SharedStorage<TopKStats[kMaxCluster]> outside_slot_storage;
  __shared__ SharedStorage<TopKRowShared> row_shared_storage;
  TopKRowShared& rs = row_shared_storage.get();

  cluster_arrive_started(p.cluster);
  const TopKArgs& a = p.args;
  const DistillRowOptions& o = a.options;
  const ClusterSlice cs = cluster_slice(p.cluster, p.slice_elements, a.vocab);
  const int rank = cs.rank;
  const int64_t row = cs.row, begin = cs.begin, length = cs.length;
  S* grad = a.grad ? static_cast<S*>(a.grad) + row * a.grad_row_stride + begin : nullptr;
  const bool has_target = a.target != nullptr;
  const int64_t target = has_target ? read_target(a.target, a.target_dtype, row) : 0;
  // An ignored row: zero loss and gradient. Every CTA of its cluster leaves here alike.
  if (has_target && target == o.ce.ignore_index) {
    if (rank == 0 && threadIdx.x == 0) {
      if (a.row_soft) a.row_soft[row] = 0;
      if (a.row_total) a.row_total[row] = 0;
      if (a.row_hard_loss) a.row_hard_loss[row] = 0;
      if (a.row_hard_z) a.row_hard_z[row] = 0;
    }
    if (grad) write_constant_row(grad, length, p.grad_vector_ok, 0.0f);
    return;
  }

  const S* student_row = static_cast<const S*>(a.student) + row * a.row_stride;
  const TopKLayout layout = topk_layout(p.slice_elements, sizeof(S), p.staged, a.k);
  auto* bits = reinterpret_cast<uint32_t*>(dynamic_shared + layout.bits);
  const TopKEntries e{reinterpret_cast<int*>(dynamic_shared + layout.ids),
                      reinterpret_cast<float*>(dynamic_shared + layout.x),
                      reinterpret_cast<float*>(dynamic_shared + layout.ell)};
  RowSlice<S> slice;
  if (p.read_slice) {
    slice = p.staged ? stage_slice(student_row + begin, begin, length, p.student_vector_ok,
                                   reinterpret_cast<S*>(dynamic_shared), barriers, p.bulk)
                     : stream_slice(student_row + begin, begin, length, p.student_vector_ok);
  }
  stage_entries(a, student_row, row, begin, length, e, bits, rs.bad);

  common::DistillTransform<float> dt;
  dt.inv_temperature = 1.0f / o.temperature;
  dt.softcap = o.softcap;
  const bool with_hard = has_target && o.hard_weight != 0.0;
  const common::CeConstants<float> hc = make_ce_constants(o.ce, a.vocab, a.totals);
  const float* class_weight = o.ce.class_weight;
  const bool in_range = target >= 0 && target < a.vocab;

  // The statistics sweep: renormalize needs none (its normaliser is over the ids, and no column
  // outside them gets a gradient); the hard term its own RowStats.
  const bool soft_sweep = p.read_slice && a.mass != common::TopKMassCode::renormalize;
  TopKPartial mine;
  TopKStats soft;
  if (soft_sweep) {
    with_distill_transform(dt,
                           [&](const auto& t) { soft = topk_slice_stats<false>(slice, t, bits); });
  }
  mine.soft = block_merge_topk(soft, scratch_storage.get());
  mine.hard = RowStats<float>{};
  mine.hard_target_logit = 0.0f;
  if (with_hard) {
    RowStats<float> h;
    with_transform(hc.transform, [&](const auto& tr) {
      h = hc.smoothing > 0 ? slice_row_stats<true, false>(slice, tr, class_weight)
                           : slice_row_stats<false, false>(slice, tr, class_weight);
    });
    mine.hard = block_merge(h, hard_scratch_storage.get());
    if (threadIdx.x == 0 && in_range && target >= begin && target < begin + length) {
      mine.hard_target_logit = hc.transform.value(slice.element(target - begin));
    }
  }
  mine.bad = rs.bad;
  cluster_exchange(mine, slot_storage.get(), &rs.merged, p.cluster, ClusterPhase::first_exchange,
                   [](TopKPartial& into, const TopKPartial& other) {
                     into.soft.merge(other.soft);
                     into.hard.merge(other.hard);
                     into.hard_target_logit += other.hard_target_logit;  // one rank holds y
                     into.bad |= other.bad;
                   });

  // Outside mass far below the row's max may have lost digits against it: the rare row sweeps
  // its slices again for the outside logsumexp alone (never 1 − Σ_S p_s, docs/semantics.md §3.1).
  // The test reads merged values, alike in every CTA of the row.
  const TopKStats& m = rs.merged.soft;
  float out_lse = m.max == -INFINITY || m.out_sum == 0 || m.out_max < m.max - 60.0f
                      ? NAN
                      : m.max + logf(m.out_sum);
  if (m.out_max == -INFINITY) out_lse = -INFINITY;
  if (!soft_sweep) out_lse = -INFINITY;
  if (out_lse != out_lse) {
    TopKStats outside;
    with_distill_transform(
        dt, [&](const auto& t) { outside = topk_slice_stats<true>(slice, t, bits); });
    outside = block_merge_topk(outside, scratch_storage.get());
    cluster_exchange(outside, outside_slot_storage.get(), &rs.outside, p.cluster,
                     ClusterPhase::later_exchange,
                     [](TopKStats& into, const TopKStats& other) { into.merge(other); });
    out_lse = rs.outside.lse();
  }

  // The hard term's loss parts and gradient coefficients, then the categories (warp 0).
  const float r = a.row_weight ? a.row_weight[row] : 1.0f;
  const float target_weight = with_hard && class_weight && in_range ? class_weight[target] : 1.0f;
  if (threadIdx.x == 0) {
    rs.bad = rs.merged.bad;
    rs.out_lse = out_lse;
    if (with_hard) {
      const RowStats<float>& h = rs.merged.hard;
      const float target_logit = in_range ? rs.merged.hard_target_logit : quiet_nan();
      const auto parts = common::ce_row_loss(hc, h, h.lse(), target_logit, target_weight);
      rs.hard_loss = r * parts.loss;
      rs.hard_z = r * parts.z_loss;
      const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
      rs.hard_row =
          distill_hard_grad_row(o, hc, a.totals, h.lse(), target, target_weight, upstream, r);
      if (!in_range) rs.hard_row.lse = quiet_nan();  // flagged by the pre-pass: NaN, visibly
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    with_distill_transform(dt, [&](const auto& t) {
      topk_categories(a, t, e, rs, m.lse(), row, rank == 0, with_hard);
    });
  }
  __syncthreads();
  if (!grad) return;

  // Every column of the slice, the id columns included (rewritten below once all have been
  // written); then the id columns this CTA owns.
  TopKHardPart hard;
  hard.hc = hc;
  hard.row = with_hard ? rs.hard_row : CeGradRow<float>{};
  hard.class_weight = class_weight;
  hard.weighed = with_hard && class_weight && hc.smoothing > 0;
  hard.target = with_hard ? target : -1;
  const float coef = rs.coef;
  if (!p.read_slice) {
    write_constant_row(grad, length, p.grad_vector_ok, coef * 0.0f);  // NaN for a NaN row
  } else {
    const float coef_tail = coef * rs.tail_grad, a_tail = rs.a_tail;
    with_distill_transform(dt, [&](const auto& t) {
      if (with_hard) {
        topk_grad_sweep<true>(slice, t, coef_tail, a_tail, hard, grad, p.grad_vector_ok);
      } else {
        topk_grad_sweep<false>(slice, t, coef_tail, a_tail, hard, grad, p.grad_vector_ok);
      }
    });
  }
  __syncthreads();
  with_distill_transform(dt, [&](const auto& t) {
    for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) {
      const int64_t c = int64_t{e.id[j]} - begin;
      if (e.id[j] < 0 || c < 0 || c >= length) continue;
      const float x = e.x[j];
      const float soft = coef * e.ell[j] * t.slope(x);
      grad[c] = store_float<S>(with_hard ? soft + hard(e.id[j], x) : soft);
    }
  });
}

template <class S>
void launch_topk(const TopKArgs& a, cudaStream_t stream) {
  const std::size_t element = sizeof(S);
  const bool with_hard = a.target != nullptr && a.options.hard_weight != 0.0;
  SlicePlan plan = plan_row_slices(a.vocab, element, 1);
  TopKKernelParams p{};
  p.read_slice = with_hard || a.mass != common::TopKMassCode::renormalize;
  if (!p.read_slice) plan.staged = false;
  // The slice's bits and the k entries share the CTA's shared memory with the staged slice.
  if (plan.staged &&
      topk_layout(plan.slice_elements, element, true, a.k).total > row_slice_shared_limit()) {
    plan.staged = false;
  }
  plan.shared_bytes = topk_layout(plan.slice_elements, element, plan.staged, a.k).total;
  p.args = a;
  p.cluster = plan.cluster;
  p.slice_elements = plan.slice_elements;
  p.staged = plan.staged;
  p.bulk = plan.hopper;
  p.student_vector_ok = rows_are_vector_aligned(a.student, a.row_stride, element);
  p.grad_vector_ok =
      a.grad != nullptr && rows_are_vector_aligned(a.grad, a.grad_row_stride, element);
  launch_row_kernel(distill_topk_kernel<S>, p, a.rows, plan, stream);
}

float* f32_or_null(TensorView view) {
  return view.present() ? static_cast<float*>(view.data) : nullptr;
}

}  // namespace

void distill_topk(TensorView student, const TopKTeacher& teacher, TensorView target,
                  const DistillOptions& options, TensorView loss, TensorView grad,
                  TensorView grad_output, Workspace workspace, Stream stream) {
  const OpCode op =
      grad.present() && !loss.present() ? OpCode::distill_backward : OpCode::distill_forward;
  DeviceGuard guard(student.device.index);
  const cudaStream_t s = stream_of(stream);
  const int64_t rows = student.rows;
  char* base = static_cast<char*>(workspace.data);
  auto* totals = reinterpret_cast<CeBatchTotals*>(base);
  // distill.cu's layout: [totals | row_soft[N] | row_hard_loss[N] | row_hard_z[N] | ...]
  const std::size_t array = (static_cast<std::size_t>(rows) * sizeof(float) + 255) / 256 * 256;
  auto* row_soft = reinterpret_cast<float*>(base + 256);
  auto* row_hard_loss = reinterpret_cast<float*>(base + 256 + array);
  auto* row_hard_z = reinterpret_cast<float*>(base + 256 + 2 * array);
  const bool with_hard = options.hard_weight != 0.0 && target.present();
  const bool none = options.ce.reduction == Reduction::none;

  const CeBatchRequest request =
      distill_batch_request(target, rows, student.cols, options, grad_output, op);
  ce_batch_totals(request, totals, s);
  if (rows == 0) {
    if (loss.present() && !none) XENT_CUDA_CHECK(cudaMemsetAsync(loss.data, 0, sizeof(float), s));
    return;
  }

  TopKArgs a;
  a.rows = rows;
  a.student = student.data;
  a.row_stride = student.row_stride;
  a.vocab = student.cols;
  a.ids = teacher.ids.data;
  a.id_dtype = teacher.ids.dtype;
  a.ids_stride = teacher.ids.row_stride;
  a.logprobs = teacher.logprobs.data;
  a.logprob_dtype = teacher.logprobs.dtype;
  a.logprobs_stride = teacher.logprobs.row_stride;
  a.k = teacher.ids.cols;
  a.target = request.target;
  a.target_dtype = target.dtype;
  a.row_weight = f32_or_null(options.ce.row_weight);
  a.mass = static_cast<common::TopKMassCode>(teacher.mass);
  a.options = distill_row_options(options);
  a.totals = totals;
  a.grad_output_rows = none ? f32_or_null(grad_output) : nullptr;
  if (loss.present()) {
    a.row_soft = row_soft;
    a.row_total = none ? f32_or_null(loss) : nullptr;
    a.row_hard_loss = with_hard ? row_hard_loss : nullptr;
    a.row_hard_z = with_hard ? row_hard_z : nullptr;
  }
  if (grad.present()) {
    a.grad = grad.data;
    a.grad_row_stride = grad.row_stride;
  }
  switch (student.dtype) {
    case DType::f32:
      launch_topk<float>(a, s);
      break;
    case DType::bf16:
      launch_topk<bf16_t>(a, s);
      break;
    default:
      launch_topk<f16_t>(a, s);
      break;
  }
  if (loss.present() && !none) {
    DistillReduceArgs r;
    r.rows = rows;
    r.reduction = options.ce.reduction;
    r.soft_weight = options.soft_weight;
    r.hard_weight = options.hard_weight;
    r.row_hard_loss = a.row_hard_loss;
    r.row_hard_z = a.row_hard_z;
    r.row_soft = row_soft;
    r.totals = totals;
    r.loss = f32_or_null(loss);
    distill_reduce(r, s);
  }
}

}  // namespace xent::cuda
