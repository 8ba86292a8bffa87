// Distillation from a top-k teacher, CUDA backend (docs/semantics.md §3.1): one portable CTA per
// row (no clusters or TMA, sm_80 and up). The row's ids and log-probabilities are staged in shared
// memory with a membership bitmap of the V columns; one vectorised sweep over the student forms
// the logsumexp of the whole row and of the columns outside the ids (none for renormalize); one
// warp forms the categories' terms (common/distill_topk_row.hpp); the gradient sweep writes every
// column, then the id columns from the shared category gradients. The hard-label ce term takes
// its own statistics sweep. The per-row losses go through distill_reduce as distill's do.
#include "api/backend.hpp"
#include "common/distill_topk_row.hpp"
#include "cuda/rows/distill_rows.cuh"

namespace xent::cuda {
namespace {

constexpr int kTopKThreads = 256;
constexpr int kTopKMaxK = kDistillTopKMaxK;  // the entries staged in shared memory (10 KB)

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

// Online (max, Σ e^(v − max)) pairs, merged.
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

// Calls f(i, v) for the n values of a row: 16-byte loads over the 16-byte-aligned middle, scalar
// loads for the head and tail (rows of odd V start anywhere). 32-bit columns (V < 2^31).
template <class S, class F>
__device__ __forceinline__ void sweep_row(const S* s, int n, F&& f) {
  constexpr int kVec = kVectorElements<S>;
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(s) % 16);
  const int head = min(n, ((16 - misalign) % 16) / static_cast<int>(sizeof(S)));
  for (int i = threadIdx.x; i < head; i += kTopKThreads) f(i, load_float(s[i]));
  const int vectors = (n - head) / kVec;
  const auto* words = reinterpret_cast<const uint4*>(s + head);
  for (int q = threadIdx.x; q < vectors; q += kTopKThreads) {
    const Vector<S> v = unpack<S>(__ldg(words + q));
#pragma unroll
    for (int u = 0; u < kVec; ++u) f(head + q * kVec + u, v.value[u]);
  }
  for (int i = head + vectors * kVec + threadIdx.x; i < n; i += kTopKThreads) {
    f(i, load_float(s[i]));
  }
}

// g[i] = f(i, s[i]) over a row, 16-byte vectors when s and g share their alignment (the usual
// case, in-place included), scalar otherwise.
template <class S, class F>
__device__ __forceinline__ void map_row(const S* s, S* g, int n, F&& f) {
  constexpr int kVec = kVectorElements<S>;
  const int misalign = static_cast<int>(reinterpret_cast<uintptr_t>(s) % 16);
  const bool together = misalign == static_cast<int>(reinterpret_cast<uintptr_t>(g) % 16);
  const int head = together ? min(n, ((16 - misalign) % 16) / static_cast<int>(sizeof(S))) : n;
  for (int i = threadIdx.x; i < head; i += kTopKThreads)
    g[i] = store_float<S>(f(i, load_float(s[i])));
  if (!together) return;
  const int vectors = (n - head) / kVec;
  const auto* in = reinterpret_cast<const uint4*>(s + head);
  auto* out = reinterpret_cast<uint4*>(g + head);
  for (int q = threadIdx.x; q < vectors; q += kTopKThreads) {
    Vector<S> v = unpack<S>(in[q]);
#pragma unroll
    for (int u = 0; u < kVec; ++u) v.value[u] = f(head + q * kVec + u, v.value[u]);
    out[q] = pack<S>(v);
  }
  for (int i = head + vectors * kVec + threadIdx.x; i < n; i += kTopKThreads) {
    g[i] = store_float<S>(f(i, load_float(s[i])));
  }
}

// Shared state of one row: the staged entries and the category results.
struct TopKShared {
  int64_t id[kTopKMaxK];
  float x[kTopKMaxK];    // raw student logit at the id
  float ell[kTopKMaxK];  // teacher log-probability
  float grad[kTopKMaxK + 1];
  float all_max[kTopKThreads / 32], all_sum[kTopKThreads / 32];  // per warp (LseState)
  float out_max[kTopKThreads / 32], out_sum[kTopKThreads / 32];
  float lse_all, out_lse, a_tail, coef;
  float hard_loss, hard_z;
  int bad;  // an id out of range or twice: the row becomes NaN (the CPU reports it)
};

// The hard term's target and shared room; scratch is null for a row without the term.
struct TopKHard {
  int64_t target = -1;
  common::RowStats<float>* scratch = nullptr;  // one entry a warp
  common::CeGradRow<float>* row = nullptr;
};

template <class S, class Transform>
__device__ void topk_row(const TopKArgs& a, const Transform& transform, TopKShared& sh,
                         uint32_t* bitmap, int64_t row, const TopKHard& hard) {
  const int tid = threadIdx.x;
  const S* s = static_cast<const S*>(a.student) + row * a.row_stride;
  const int64_t vocab = a.vocab, k = a.k;
  const auto& dc_in = a.options;
  for (int64_t w = tid; w < (vocab + 31) / 32; w += kTopKThreads) bitmap[w] = 0;
  if (tid == 0) sh.bad = 0;
  __syncthreads();
  for (int64_t j = tid; j < k; j += kTopKThreads) {
    const int64_t at_id = row * a.ids_stride + j, at_lp = row * a.logprobs_stride + j;
    int64_t id = a.id_dtype == DType::i32 ? static_cast<const int32_t*>(a.ids)[at_id]
                                          : static_cast<const int64_t*>(a.ids)[at_id];
    const float ell = a.logprob_dtype == DType::f32
                          ? static_cast<const float*>(a.logprobs)[at_lp]
                          : static_cast<float>(static_cast<const double*>(a.logprobs)[at_lp]);
    if (id < -1 || id >= vocab) {
      sh.bad = 1;
      id = -1;
    }
    if (id >= 0) {
      const uint32_t bit = 1u << (id % 32);
      if (atomicOr(&bitmap[id / 32], bit) & bit) sh.bad = 1;
      sh.x[j] = load_float(s[id]);
    }
    sh.id[j] = id;
    sh.ell[j] = ell;
  }
  __syncthreads();

  // One sweep, one exp a column: the row's logsumexp, and the columns outside the ids summed
  // against the same running max with their own max tracked by compares. renormalize needs
  // neither (its normaliser is over the ids, and no column outside them gets a gradient).
  const bool renormalize_row = a.mass == common::TopKMassCode::renormalize;
  const int n = static_cast<int>(vocab);
  if (!renormalize_row) {
    float m = -INFINITY, sum = 0, out_sum = 0, out_max = -INFINITY;
    sweep_row(s, n, [&](int i, float x) {
      const float v = transform.value(x);
      const bool outside = !((bitmap[i >> 5] >> (i & 31)) & 1u);
      if (v > m) {
        const float r = __expf(m - v);  // 0 on the first finite value (m = −inf)
        sum *= r;
        out_sum *= r;
        m = v;
      }
      const float e = v == -INFINITY ? 0.0f : (v == m ? 1.0f : __expf(v - m));
      sum += e;
      if (outside) {
        out_sum += e;
        out_max = fmaxf(out_max, v);
      }
    });
    LseState all, out;
    all.merge(m, sum);
    out.merge(m, out_sum);  // relative to the row's max, not the outside max
    all = warp_lse(all);
    out = warp_lse(out);
    for (int offset = 16; offset > 0; offset /= 2)
      out_max = fmaxf(out_max, __shfl_xor_sync(0xffffffffu, out_max, offset));
    if (tid % 32 == 0) {
      sh.all_max[tid / 32] = all.max;
      sh.all_sum[tid / 32] = all.sum;
      sh.out_max[tid / 32] = out_max;
      sh.out_sum[tid / 32] = out.sum;  // out.max is all.max: both merged the same maxima
    }
    __syncthreads();
    if (tid < 32) {
      LseState ra, ro;
      float om = -INFINITY;
      if (tid < kTopKThreads / 32) {
        ra.merge(sh.all_max[tid], sh.all_sum[tid]);
        ro.merge(sh.all_max[tid], sh.out_sum[tid]);
        om = sh.out_max[tid];
      }
      ra = warp_lse(ra);
      ro = warp_lse(ro);
      for (int offset = 16; offset > 0; offset /= 2)
        om = fmaxf(om, __shfl_xor_sync(0xffffffffu, om, offset));
      if (tid == 0) {
        sh.lse_all = ra.lse();
        // Outside mass far below the row's max may have lost digits against it: the rare row
        // sweeps again for the outside logsumexp alone (never 1 − Σ_S p_s, docs/semantics.md §3.1).
        sh.out_lse = ro.max == -INFINITY || ro.sum == 0 || om < ra.max - 60.0f ? NAN : ro.lse();
        if (om == -INFINITY) sh.out_lse = -INFINITY;
      }
    }
    __syncthreads();
    if (sh.out_lse != sh.out_lse) {
      LseState o;
      sweep_row(s, n, [&](int i, float x) {
        if (!((bitmap[i >> 5] >> (i & 31)) & 1u)) o.add(transform.value(x));
      });
      o = warp_lse(o);
      __syncthreads();  // every thread has read out_lse before it is rewritten
      if (tid % 32 == 0) {
        sh.out_max[tid / 32] = o.max;
        sh.out_sum[tid / 32] = o.sum;
      }
      __syncthreads();
      if (tid < 32) {
        LseState ro;
        if (tid < kTopKThreads / 32) ro.merge(sh.out_max[tid], sh.out_sum[tid]);
        ro = warp_lse(ro);
        if (tid == 0) sh.out_lse = ro.lse();
      }
    }
  } else if (tid == 0) {
    sh.lse_all = 0;
    sh.out_lse = -INFINITY;
  }
  __syncthreads();

  // The hard-label ce term (docs/semantics.md §3) at its own options: its statistics sweep, the
  // row's loss parts and the gradient coefficients.
  const auto& o = a.options;
  const bool with_hard = hard.scratch != nullptr;
  const common::CeConstants<float> hc = make_ce_constants(o.ce, vocab, a.totals);
  const float* class_weight = o.ce.class_weight;
  if (with_hard) {
    const bool in_range = hard.target >= 0 && hard.target < vocab;
    const RowSlice<S> slice =
        stream_slice(s, 0, vocab, reinterpret_cast<uintptr_t>(s) % 16 == 0, /*deep=*/true);
    common::RowStats<float> h;
    with_transform(hc.transform, [&](const auto& tr) {
      h = hc.smoothing > 0 ? slice_row_stats<true, false>(slice, tr, class_weight)
                           : slice_row_stats<false, false>(slice, tr, class_weight);
    });
    h = block_merge(h, hard.scratch);
    if (tid == 0) {
      const float r = a.row_weight ? a.row_weight[row] : 1.0f;
      const float target_weight = class_weight && in_range ? class_weight[hard.target] : 1.0f;
      const float target_logit =
          in_range ? hc.transform.value(load_float(s[hard.target])) : quiet_nan();
      const auto parts = common::ce_row_loss(hc, h, h.lse(), target_logit, target_weight);
      sh.hard_loss = r * parts.loss;
      sh.hard_z = r * parts.z_loss;
      const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
      *hard.row =
          distill_hard_grad_row(o, hc, a.totals, h.lse(), hard.target, target_weight, upstream, r);
      if (!in_range) hard.row->lse = quiet_nan();  // flagged by the pre-pass: NaN, visibly
    }
    __syncthreads();
  }

  if (tid < 32) {
    const int lane = tid;
    const float lse_all = sh.lse_all, a_tail = sh.out_lse;
    const bool renormalize = a.mass == common::TopKMassCode::renormalize;
    const float inv_t = 1.0f / dc_in.temperature;
    // Teacher: logsumexp of ℓ (scaled by 1/T for renormalize); student: over the ids.
    LseState teacher, student_ids;
    int present = 0;
    for (int64_t j = lane; j < k; j += 32) {
      if (sh.id[j] < 0) continue;
      ++present;
      teacher.add(sh.ell[j] * (renormalize ? inv_t : 1.0f));
      student_ids.add(transform.value(sh.x[j]));
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
    const auto dc = common::make_distill_constants<float>(dc_in.kind, dc_in.temperature,
                                                          dc_in.softcap, dc_in.beta);
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
      if (sh.id[j] < 0) continue;
      category(transform.value(sh.x[j]) - z, renormalize ? sh.ell[j] * inv_t - shift : sh.ell[j]);
    }
    if (lane == 0 && with_tail) category(a_tail - z, log_tail);
    loss = warp_sum(loss);
    prob_u = warp_sum(prob_u);
    weight = warp_sum(weight);
    for (int64_t j = lane; j < k; j += 32) {
      if (sh.id[j] < 0) continue;
      const float log_ps = transform.value(sh.x[j]) - z;
      const float log_pt = renormalize ? sh.ell[j] * inv_t - shift : sh.ell[j];
      sh.grad[j] = common::topk_category_grad(dc, log_ps, log_pt, static_cast<float>(prob_u),
                                              static_cast<float>(weight));
    }
    if (lane == 0) {
      sh.grad[k] = with_tail ? common::topk_category_grad(dc, a_tail - z, log_tail,
                                                          static_cast<float>(prob_u),
                                                          static_cast<float>(weight))
                             : 0.0f;
      sh.lse_all = lse_all;
      sh.a_tail = with_tail && a_tail > -INFINITY ? a_tail : INFINITY;  // +inf: no tail share
      const float soft = sh.bad ? NAN : static_cast<float>(loss);
      if (a.row_soft) a.row_soft[row] = soft;
      const float hard_loss = with_hard ? sh.hard_loss : 0.0f;
      const float hard_z = with_hard ? sh.hard_z : 0.0f;
      if (a.row_hard_loss) a.row_hard_loss[row] = hard_loss;
      if (a.row_hard_z) a.row_hard_z[row] = hard_z;
      if (a.row_total) {
        double total = dc_in.soft_weight * soft;
        if (with_hard) total += dc_in.hard_weight * (double{hard_loss} + hard_z);
        a.row_total[row] = static_cast<float>(total);
      }
      const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
      sh.coef = distill_soft_coef(dc_in, a.totals, upstream) * (sh.bad ? NAN : 1.0f);
    }
  }
  __syncthreads();
  if (!a.grad) return;
  S* g = reinterpret_cast<S*>(static_cast<char*>(a.grad) +
                              row * a.grad_row_stride * static_cast<int64_t>(sizeof(S)));
  const float coef = sh.coef, tail_grad = sh.grad[k], a_tail = sh.a_tail;
  // Every column, the id columns included (rewritten below once all have been read: in place,
  // g may be the student).
  const common::CeGradRow<float> hard_row = with_hard ? *hard.row : common::CeGradRow<float>{};
  const bool weighed = with_hard && class_weight && hc.smoothing > 0;
  auto hard_part = [&](int i, float x) {
    const float w = weighed ? class_weight[i] : 1.0f;
    const float p = __expf(hc.transform.value(x) - hard_row.lse);
    return common::ce_grad_from_prob(hard_row, p, hc.transform.slope(x), i == hard.target, w);
  };
  map_row(s, g, n, [&](int i, float x) {
    const float share = a_tail == INFINITY ? 0.0f : __expf(transform.value(x) - a_tail);
    const float soft = coef * tail_grad * share * transform.slope(x);
    return with_hard ? soft + hard_part(i, x) : soft;
  });
  __syncthreads();
  for (int j = tid; j < k; j += kTopKThreads) {
    const int64_t id = sh.id[j];
    if (id < 0) continue;
    const float x = sh.x[j];
    const float soft = coef * sh.grad[j] * transform.slope(x);
    g[id] = store_float<S>(with_hard ? soft + hard_part(static_cast<int>(id), x) : soft);
  }
}

template <class S>
__global__ void __launch_bounds__(kTopKThreads) distill_topk_kernel(const TopKArgs a) {
  extern __shared__ uint32_t bitmap[];
  __shared__ TopKShared sh;
  __shared__ SharedStorage<common::RowStats<float>[kTopKThreads / 32]> hard_scratch;
  __shared__ SharedStorage<common::CeGradRow<float>> hard_row;
  const int64_t row = blockIdx.x;
  const bool has_target = a.target != nullptr;
  const int64_t target = has_target ? read_target(a.target, a.target_dtype, row) : 0;
  if (has_target && target == a.options.ce.ignore_index) {
    if (threadIdx.x == 0) {
      if (a.row_soft) a.row_soft[row] = 0;
      if (a.row_total) a.row_total[row] = 0;
      if (a.row_hard_loss) a.row_hard_loss[row] = 0;
      if (a.row_hard_z) a.row_hard_z[row] = 0;
    }
    if (a.grad) {
      S* g = reinterpret_cast<S*>(static_cast<char*>(a.grad) +
                                  row * a.grad_row_stride * static_cast<int64_t>(sizeof(S)));
      for (int64_t i = threadIdx.x; i < a.vocab; i += kTopKThreads) g[i] = store_float<S>(0.0f);
    }
    return;
  }
  common::DistillTransform<float> transform;
  transform.inv_temperature = 1.0f / a.options.temperature;
  transform.softcap = a.options.softcap;
  TopKHard hard;
  if (has_target && a.options.hard_weight != 0.0) {
    hard.target = target;
    hard.scratch = hard_scratch.get();
    hard.row = &hard_row.get();
  }
  with_distill_transform(transform,
                         [&](const auto& t) { topk_row<S>(a, t, sh, bitmap, row, hard); });
}

template <class S>
void launch_topk(const TopKArgs& a, cudaStream_t stream) {
  const std::size_t bitmap_bytes = static_cast<std::size_t>((a.vocab + 31) / 32) * 4;
  XENT_CUDA_CHECK(cudaFuncSetAttribute(distill_topk_kernel<S>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bitmap_bytes)));
  distill_topk_kernel<S><<<static_cast<unsigned>(a.rows), kTopKThreads, bitmap_bytes, stream>>>(a);
  XENT_CUDA_CHECK_LAUNCH();
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
