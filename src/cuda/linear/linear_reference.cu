// linear_ce's chunk gradient against a per-row reference (linear_reference.cuh).
#include "cuda/linear/linear_reference.cuh"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "cuda/rows/ce_device.cuh"
#include "cuda/sm90/fused_grad.cuh"
#include "cuda/sm90/fused_stats.hpp"
#include "cuda/plan/linear_ce_plan.hpp"
#include "cuda/linear/weighted_row_sum.cuh"
#include "cuda/test_hook.hpp"

namespace xent::cuda {
namespace {

std::atomic<int64_t> reference_chunks{0};

constexpr int kWarpsPerBlock = 8;
constexpr int kBlockThreads = 32 * kWarpsPerBlock;

int warp_blocks(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, (rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % 32); }

// Σ over a warp; every lane gets the same sum (butterfly, a fixed order).
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(~0u, x, offset);
  return x;
}

// x rounded to the 16-bit dtype S (the fallback's logits: the operands' dtype, as 16-bit logits
// are stored).
template <class S>
__device__ __forceinline__ float rounded(float x) {
  return load_float(store_float<S>(x));
}

// The dtype the fused product stages x in for this path (fused_grad.cuh, decision 114): f16, 11
// significant bits where bf16 keeps 8. The reference r is rounded so too, so that the target's
// own term e^(x̃_y − r) is 1 but for the products' different orders of summation.
using StagedLogit = f16_t;

// Eight consecutive values as floats from 16-byte aligned storage: one 16-byte load of a 16-bit
// row, two of an fp32 one.
template <class T>
__device__ __forceinline__ void load_eight(const T* p, float (&out)[8]) {
  const Vector<T> v = unpack<T>(*reinterpret_cast<const uint4*>(p));
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = v.value[j];
}
template <>
__device__ __forceinline__ void load_eight<float>(const float* p, float (&out)[8]) {
  const float4 lo = *reinterpret_cast<const float4*>(p);
  const float4 hi = *reinterpret_cast<const float4*>(p + 4);
  out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
  out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}

// a·b over `length` columns of a 16-bit row and a 16-bit or fp32 one, in fp32, by one warp (all
// lanes get it); 16-byte loads when both rows and the length allow them.
template <class A, class B>
__device__ float warp_dot(const A* a, const B* b, int64_t length, bool vectors) {
  float sum = 0.0f;
  const int lane = lane_id();
  if (vectors) {
    for (int64_t k = 8 * lane; k < length; k += 8 * 32) {
      float x[8], y[8];
      load_eight(a + k, x);
      load_eight(b + k, y);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum = fmaf(x[j], y[j], sum);
    }
  } else {
    for (int64_t k = lane; k < length; k += 32) sum = fmaf(load_float(a[k]), load_float(b[k]), sum);
  }
  return warp_sum(sum);
}

// The chunk's operands for the kernels that form logits themselves.
struct Operands {
  const void* hidden = nullptr;
  int64_t hidden_stride = 0;
  const void* weight = nullptr;
  int64_t weight_stride = 0;
  int64_t hidden_size = 0;
  bool vectors = false;
};

template <class S>
__device__ __forceinline__ float logit_of(const Operands& o, int64_t row, int64_t column) {
  return warp_dot(static_cast<const S*>(o.hidden) + row * o.hidden_stride,
                  static_cast<const S*>(o.weight) + column * o.weight_stride, o.hidden_size,
                  o.vectors);
}

// What the finish and the fallback read and write (ReferenceChunk, less the products).
struct RowParams {
  CeRowsArgs rows;
  CeGradRecord* records = nullptr;
  const float* partials = nullptr;  // [rows, tiles]
  int64_t tiles = 0;
  // The statistics form's (FusedGradProduct::statistic_partials): [rows, tiles] each, or null.
  const float* shift_partials = nullptr;
  const float* max_partials = nullptr;
  const int32_t* argmax_partials = nullptr;
  // The fallback's: [rows, kSliceFields · kReferenceFallbackSplit].
  float* slice_stats = nullptr;
  float* target_logits = nullptr;
  float* scale = nullptr;
  int32_t* fallback = nullptr;
  // Label smoothing (ReferenceChunk's; null without it).
  const float* weight_sum = nullptr;
  float* uniform = nullptr;
  float* smoothing_sums = nullptr;
};

// Step 1: each row's record: the reference r = x̃ of its target (rounded as the product stages
// x: StagedLogit) in place of the lse, coefficients (1, 0, 0), its target and state. Also
// empties the fallback list of the chunk.
template <class S>
__global__ void __launch_bounds__(kBlockThreads)
    reference_records_kernel(const Operands o, const RowParams p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) p.fallback[0] = 0;
  const CeRowsArgs& a = p.rows;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= a.rows) return;  // per warp
  const int64_t target = read_target(a.target, a.target_dtype, row);
  CeBlockRow r;
  r.valid = target != a.options.ignore_index;
  r.in_range = target >= 0 && target < a.vocab;
  r.grad.prob_coef = 1.0f;
  r.grad.target_coef = 0.0f;
  r.grad.smoothing_coef = 0.0f;
  // +∞ for a row outside the path: the product's p = e^(x̃ − r) is then 0 over the row (NaN
  // only where x̃ is NaN or +∞), with no per-value fill in its epilogue (decision 88).
  r.grad.lse = INFINITY;
  r.target_column = target;
  if (r.valid && r.in_range) {
    common::Transform<float> transform;
    transform.scale = a.options.logit_scale;
    transform.softcap = a.options.softcap;
    r.grad.lse = transform.value(rounded<StagedLogit>(logit_of<S>(o, row, target)));
  }
  if (lane_id() == 0) p.records[row] = grad_record_of(r);
}

// A row's loss parts and statistics as the ce row kernel writes them (ignored rows: IgnoredRow).
__device__ void write_row_outputs(const CeRowsArgs& a, int64_t row, float loss, float z, float lse,
                                  float logprob) {
  if (a.row_loss) a.row_loss[row] = loss;
  if (a.row_z_loss) a.row_z_loss[row] = z;
  if (a.row_total) a.row_total[row] = loss + z;
  if (a.lse) a.lse[row] = lse;
  if (a.logprob) a.logprob[row] = logprob;
}

// The entropy, argmax and accuracy outputs of a row, where asked for.
__device__ void write_row_statistics(const CeRowsArgs& a, int64_t row, float entropy,
                                     int64_t argmax, bool correct) {
  if (a.entropy) a.entropy[row] = entropy;
  if (a.argmax) a.argmax[row] = argmax;
  if (a.row_correct) a.row_correct[row] = correct ? 1.0f : 0.0f;
}

// The §1 loss parts of a valid row with an in-range target from its lse, target logit x̃_y and,
// with label smoothing, Σ_i w_i·x̃_i, written out (as the ce row kernel writes them).
__device__ void write_valid_row(const CeRowsArgs& a, const common::CeConstants<float>& c,
                                int64_t row, int64_t target, float lse, float target_logit,
                                float smoothing_sum) {
  const float row_weight = a.row_weight ? a.row_weight[row] : 1.0f;
  const float target_weight = a.options.class_weight ? a.options.class_weight[target] : 1.0f;
  common::RowStats<float> sums;
  sums.sum_logits = smoothing_sum;
  sums.sum_weighted_logits = smoothing_sum;
  const auto parts = common::ce_row_loss(c, sums, lse, target_logit, target_weight);
  write_row_outputs(a, row, row_weight * parts.loss, row_weight * parts.z_loss, lse,
                    target_logit - lse);
}

// The gradient coefficients of that row (the row kernel's, from the same totals).
__device__ common::CeGradRow<float> row_gradient(const CeRowsArgs& a,
                                                 const common::CeConstants<float>& c, int64_t row,
                                                 int64_t target, float lse) {
  const float row_weight = a.row_weight ? a.row_weight[row] : 1.0f;
  const float target_weight = a.options.class_weight ? a.options.class_weight[target] : 1.0f;
  const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  const float base = upstream * row_weight;
  return common::ce_grad_row(c, lse, target, target_weight,
                             base * a.totals->loss_factor * a.grad_scale,
                             base * a.totals->z_factor * a.grad_scale);
}

// A row's s_n and, with label smoothing, k_n.
__device__ void set_row_scales(const RowParams& p, int64_t row, float scale, float uniform) {
  p.scale[row] = scale;
  if (p.uniform) p.uniform[row] = uniform;
}

// `scale`: 1, the fallback writing the exact gradient (label smoothing's term with it, so k_n is
// 0); 0 for an ignored row, whose E row it writes as zeros.
__device__ void to_fallback(const RowParams& p, int64_t row, float scale = 1.0f) {
  const int slot = atomicAdd(p.fallback, 1);
  p.fallback[1 + slot] = static_cast<int32_t>(row);
  set_row_scales(p, row, scale, 0.0f);
}

// Step 3, one warp per row: Σ of the tile sums (a fixed order), lse = r + ln Σ, the row's
// outputs, s_n (and k_n) and E'_y = g_y / s_n over the target's column; rows outside the path's
// range to the fallback list. With label smoothing the row's Σ_i w_i·x̃_i = a·(h_n·w̄), kept for
// the fallback too.
template <class S>
__global__ void __launch_bounds__(kBlockThreads)
    reference_finish_kernel(const Operands o, const RowParams p) {
  const CeRowsArgs& a = p.rows;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= a.rows) return;  // per warp
  const int64_t target = read_target(a.target, a.target_dtype, row);
  const bool valid = target != a.options.ignore_index;
  const bool in_range = target >= 0 && target < a.vocab;
  float sum = 0.0f;
  const float* partials = p.partials + row * p.tiles;
  for (int64_t t = lane_id(); t < p.tiles; t += 32) sum += partials[t];
  sum = warp_sum(sum);
  // The statistics form's tiles: Σ e^(x̃ − r)·(x̃ − r) (a fixed order) and the largest x̃ with
  // its column (a total order, so any order of merging gives the same).
  const bool statistics = p.shift_partials != nullptr;
  float shift = 0.0f, best = 0.0f;
  int best_column = -1;
  if (statistics) {  // per warp
    const int64_t at = row * p.tiles;
    for (int64_t t = lane_id(); t < p.tiles; t += 32) {
      shift += p.shift_partials[at + t];
      const float other = p.max_partials[at + t];
      const int other_column = p.argmax_partials[at + t];
      if (common::argmax_wins(other, other_column, best, best_column)) {
        best = other, best_column = other_column;
      }
    }
    shift = warp_sum(shift);
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(~0u, best, offset);
      const int other_column = __shfl_xor_sync(~0u, best_column, offset);
      if (common::argmax_wins(other, other_column, best, best_column)) {
        best = other, best_column = other_column;
      }
    }
  }
  float smoothing_sum = 0.0f;
  if (p.weight_sum != nullptr && valid && in_range) {  // per warp
    smoothing_sum =
        a.options.logit_scale * warp_dot(static_cast<const S*>(o.hidden) + row * o.hidden_stride,
                                         p.weight_sum, o.hidden_size, o.vectors);
  }
  if (lane_id() != 0) return;
  if (p.smoothing_sums) p.smoothing_sums[row] = smoothing_sum;
  if (!valid) {
    using Ignored = common::IgnoredRow<float>;
    write_row_outputs(a, row, Ignored::loss, Ignored::loss, Ignored::lse, Ignored::logprob);
    write_row_statistics(a, row, Ignored::entropy, Ignored::argmax, false);
    // Its reference is +∞: its E row is 0 unless a logit was NaN or +∞ (then so is Σ), which
    // the fallback writes as zeros, the gradient of an ignored row (docs/semantics.md §1).
    if (sum == 0.0f) {
      set_row_scales(p, row, 0.0f, 0.0f);
    } else {
      to_fallback(p, row, 0.0f);
    }
    return;
  }
  // NaN fails the comparisons too. A target outside [0, V) leaves an E row of NaN and no sum;
  // the fallback gives it the row kernel's statistics. A Σ below kMinReferenceSum lacks even the
  // target's own term (≈ 1): its logit staged as −∞ beyond f16's range (the fallback's bf16
  // logits hold it).
  if (!in_range || !(sum < kMaxReferenceSum) || !(sum >= kMinReferenceSum)) {
    to_fallback(p, row);
    return;
  }
  const common::CeConstants<float> c = make_ce_constants(a.options, a.vocab, a.totals);
  const float reference = p.records[row].coefs.x;
  const float lse = reference + logf(sum);
  const float x_target = p.target_logits[row];
  const float target_logit = c.transform.value(x_target);
  write_valid_row(a, c, row, target, lse, target_logit, smoothing_sum);
  const common::CeGradRow<float> grad = row_gradient(a, c, row, target, lse);
  // The target term subtracted in fp32 from p_y formed in fp32, as the row kernel keeps p_y − 1;
  // label smoothing's uniform term is k_n's (over every column, the target's included).
  common::CeGradRow<float> without_uniform = grad;
  without_uniform.smoothing_coef = 0.0f;
  const float slope = c.transform.slope(x_target);
  const float p_target = expf(target_logit - lse);
  const float g_target = common::ce_grad_from_prob(without_uniform, p_target, slope, true, 1.0f);
  const float s = grad.prob_coef * expf(reference - lse);
  const float e_target = s != 0.0f ? g_target / s : 0.0f;
  const bool representable = s != 0.0f ? fabsf(e_target) < 1e37f : g_target == 0.0f;
  if (!representable) {
    to_fallback(p, row);
    return;
  }
  set_row_scales(p, row, s, grad.smoothing_coef * slope);
  // H = lse − Σ p·x̃ = ln Σ − Σ e^(x̃ − r)·(x̃ − r) / Σ, in the reference's frame as RowStats keeps
  // it in the max's (no cancellation against lse).
  if (statistics)
    write_row_statistics(a, row, logf(sum) - shift / sum, best_column, best_column == target);
  static_cast<S*>(const_cast<void*>(a.logits))[row * a.row_stride + target] =
      store_float<S>(e_target);
}

// Columns [begin, end) of split `split` of a row of V columns.
__device__ __forceinline__ void split_columns(int64_t vocab, int split, int64_t& begin,
                                              int64_t& end) {
  begin = vocab * split / kReferenceFallbackSplit;
  end = vocab * (split + 1) / kReferenceFallbackSplit;
}

// Fallback, pass 1 (work items: listed row × split, over a fixed grid; none: the grid exits):
// the split's logits by warp dot products, rounded to the operands' dtype, written raw over
// the row's E, and the split's (max, Σ e^(x̃ − max)) into slice_stats; the target's raw logit.
template <class S>
__global__ void __launch_bounds__(kBlockThreads)
    fallback_logits_kernel(const Operands o, const RowParams p) {
  __shared__ common::RowStats<float> warp_stats[kWarpsPerBlock];
  const CeRowsArgs& a = p.rows;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int64_t items = static_cast<int64_t>(p.fallback[0]) * kReferenceFallbackSplit;
  const common::CeConstants<float> c = make_ce_constants(a.options, a.vocab, nullptr);
  S* exps = static_cast<S*>(const_cast<void*>(a.logits));
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t row = p.fallback[1 + item / kReferenceFallbackSplit];
    const int split = static_cast<int>(item % kReferenceFallbackSplit);
    const int64_t target = read_target(a.target, a.target_dtype, row);
    if (target == a.options.ignore_index) continue;  // its gradient is 0: no logits (the block)
    int64_t begin, end;
    split_columns(a.vocab, split, begin, end);
    common::RowStats<float> stats;
    for (int64_t column = begin + warp; column < end; column += kWarpsPerBlock) {
      const float x = rounded<S>(logit_of<S>(o, row, column));
      if (lane_id() == 0) {
        exps[row * a.row_stride + column] = store_float<S>(x);
        stats.add(c.transform.value(x), column, 1.0f);
        if (column == target) p.target_logits[row] = x;
      }
    }
    if (lane_id() == 0) warp_stats[warp] = stats;
    __syncthreads();
    if (threadIdx.x == 0) {
      common::RowStats<float> merged = warp_stats[0];
      for (int w = 1; w < kWarpsPerBlock; ++w) merged.merge(warp_stats[w]);
      float* out = p.slice_stats + (row * kReferenceFallbackSplit + split) * kSliceFields;
      out[0] = merged.max;
      out[1] = merged.sum_exp;
      out[2] = merged.sum_exp_shift;
      out[3] = __int_as_float(static_cast<int32_t>(merged.argmax));
    }
    __syncthreads();  // warp_stats is rewritten by the next item
  }
}

// Fallback, pass 2: the row's lse from its splits' statistics (in split order, so every item of
// the row forms the same value), its outputs (split 0), and the split's exact gradient from the
// raw logits over them; s_n is 1 (set by the finish).
template <class S>
__global__ void __launch_bounds__(kBlockThreads) fallback_grad_kernel(const RowParams p) {
  __shared__ common::CeGradRow<float> row_grad;
  __shared__ float row_lse;
  const CeRowsArgs& a = p.rows;
  const int64_t items = static_cast<int64_t>(p.fallback[0]) * kReferenceFallbackSplit;
  const common::CeConstants<float> c = make_ce_constants(a.options, a.vocab, a.totals);
  S* exps = static_cast<S*>(const_cast<void*>(a.logits));
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t row = p.fallback[1 + item / kReferenceFallbackSplit];
    const int split = static_cast<int>(item % kReferenceFallbackSplit);
    const int64_t target = read_target(a.target, a.target_dtype, row);
    // An ignored row (its outputs written by the finish) only has its E row set to 0.
    const bool valid = target != a.options.ignore_index;
    const bool in_range = valid && target >= 0 && target < a.vocab;
    if (threadIdx.x == 0 && valid) {
      // The splits' statistics merged in split order (a NaN max stays NaN).
      const float* slices = p.slice_stats + row * kReferenceFallbackSplit * kSliceFields;
      common::RowStats<float> stats;
      for (int j = 0; j < kReferenceFallbackSplit; ++j) {
        common::RowStats<float> slice;
        slice.max = slices[kSliceFields * j];
        slice.sum_exp = slices[kSliceFields * j + 1];
        slice.sum_exp_shift = slices[kSliceFields * j + 2];
        slice.argmax = __float_as_int(slices[kSliceFields * j + 3]);
        stats.merge(slice);
      }
      const float lse = stats.lse();
      row_lse = lse;
      if (split == 0) {
        write_row_statistics(a, row, stats.entropy(), stats.argmax, stats.argmax == target);
      }
      if (in_range) {
        const float target_logit = c.transform.value(p.target_logits[row]);
        const float smoothing_sum = p.smoothing_sums ? p.smoothing_sums[row] : 0.0f;
        if (split == 0) write_valid_row(a, c, row, target, lse, target_logit, smoothing_sum);
        row_grad = row_gradient(a, c, row, target, lse);
      } else if (split == 0) {
        // As the row kernel: the row's lse, a NaN loss and logprob.
        write_row_outputs(a, row, quiet_nan(), quiet_nan(), lse, quiet_nan());
      }
    }
    __syncthreads();
    int64_t begin, end;
    split_columns(a.vocab, split, begin, end);
    S* out = exps + row * a.row_stride;
    for (int64_t column = begin + threadIdx.x; column < end; column += kBlockThreads) {
      float g = valid ? quiet_nan() : 0.0f;
      if (in_range) {
        const float x = load_float(out[column]);
        const float prob = expf(c.transform.value(x) - row_lse);
        const float weight = a.options.class_weight ? a.options.class_weight[column] : 1.0f;
        g = common::ce_grad_from_prob(row_grad, prob, c.transform.slope(x), column == target,
                                      weight);
      }
      out[column] = store_float<S>(g);
    }
    __syncthreads();  // row_grad and row_lse are rewritten by the next item
  }
}

// ∂h rows = s ⊙ D − k ⊗ w̄, D the fp32 product E'·W of the chunk (the second term with label
// smoothing only: uniform and weight_sum null without it).
template <class Out>
__global__ void scale_product_rows_kernel(const float* product, int64_t rows, int64_t cols,
                                          const float* scale, const float* uniform,
                                          const float* weight_sum, Out* out, int64_t out_stride) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / cols, col = i % cols;
    float value = scale[row] * product[i];
    if (uniform != nullptr) value = fmaf(-uniform[row], weight_sum[col], value);
    out[row * out_stride + col] = store_float<Out>(value);
  }
}

// The 16-bit copy s ⊙ h of the chunk's hidden rows (the B operand of its ∂W product).
template <class S>
__global__ void scale_hidden_rows_kernel(const S* hidden, int64_t stride, int64_t rows,
                                         int64_t cols, const float* scale, S* out) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / cols, col = i % cols;
    out[i] = store_float<S>(scale[row] * load_float(hidden[row * stride + col]));
  }
}

void scale_product_rows(const float* product, int64_t rows, int64_t cols, const float* scale,
                        const float* uniform, const float* weight_sum, const TensorView& out,
                        cudaStream_t stream) {
  const int blocks = elementwise_blocks(rows * cols);
  auto launch = [&](auto* typed) {
    scale_product_rows_kernel<<<blocks, kElementwiseThreads, 0, stream>>>(
        product, rows, cols, scale, uniform, weight_sum, typed, out.row_stride);
  };
  switch (out.dtype) {
    case DType::f32:
      launch(static_cast<float*>(out.data));
      break;
    case DType::bf16:
      launch(static_cast<bf16_t*>(out.data));
      break;
    default:
      launch(static_cast<f16_t*>(out.data));
  }
  XENT_CUDA_CHECK_LAUNCH();
}

// Label smoothing's kUniformRows rows of the chunk's ∂W product (linear_reference.cuh): after the
// chunk's E rows, (w_hi, w_hi, w_lo, 0, …) over V columns; after its scaled h rows, (−U_hi, −U_lo,
// −U_hi, 0, …) over H columns. Their product adds −w_i·U to ∂W_i but for w_lo·U_lo (2^-16 of it).
template <class S>
__global__ void uniform_rows_kernel(const float* class_weight, int64_t vocab, S* exps,
                                    int64_t exps_stride, const float* hidden_sum, int64_t hidden,
                                    S* scaled) {
  const int64_t total = kUniformRows * (vocab + hidden);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < kUniformRows * vocab) {
      const int64_t row = i / vocab, column = i % vocab;
      const float w = class_weight ? class_weight[column] : 1.0f;
      const float high = load_float(store_float<S>(w));
      const float value = row < 2 ? high : (row == 2 ? w - high : 0.0f);
      exps[row * exps_stride + column] = store_float<S>(value);
    } else {
      const int64_t j = i - kUniformRows * vocab;
      const int64_t row = j / hidden, column = j % hidden;
      const float u = -hidden_sum[column];
      const float high = load_float(store_float<S>(u));
      const float value = row == 0 || row == 2 ? high : (row == 1 ? u - high : 0.0f);
      scaled[row * hidden + column] = store_float<S>(value);
    }
  }
}

template <class S>
bool run_chunk(const ReferenceChunk& chunk, cudaStream_t stream) {
  const CeRowsArgs& a = chunk.rows;
  const int64_t rows = a.rows, vocab = a.vocab, hidden = chunk.hidden_rows.cols;
  Operands operands;
  operands.hidden = chunk.hidden_rows.data;
  operands.hidden_stride = chunk.hidden_rows.stride;
  operands.weight = chunk.weight.data;
  operands.weight_stride = chunk.weight.stride;
  operands.hidden_size = hidden;
  operands.vectors = hidden % 8 == 0 &&
                     rows_are_vector_aligned(operands.hidden, operands.hidden_stride, sizeof(S)) &&
                     rows_are_vector_aligned(operands.weight, operands.weight_stride, sizeof(S));
  RowParams params;
  params.rows = a;
  params.records = chunk.records;
  params.tiles = (vocab + kFusedTileColumns - 1) / kFusedTileColumns;
  params.partials = static_cast<const float*>(chunk.scratch);
  // The statistics form's partials after the sums (reference_chunk_row_bytes).
  float* statistic_partials = nullptr;
  if (a.entropy != nullptr || a.argmax != nullptr || a.row_correct != nullptr) {
    statistic_partials = static_cast<float*>(chunk.scratch) + rows * params.tiles;
    const int64_t plane = rows * params.tiles;
    params.shift_partials = statistic_partials;
    params.max_partials = statistic_partials + plane;
    params.argmax_partials = reinterpret_cast<const int32_t*>(statistic_partials + 2 * plane);
  }
  params.slice_stats = static_cast<float*>(chunk.scratch);
  params.target_logits = chunk.target_logits;
  params.scale = chunk.scale;
  params.fallback = chunk.fallback;
  const bool smoothing = chunk.uniform != nullptr;
  if (smoothing) {
    params.weight_sum = chunk.weight_sum;
    params.uniform = chunk.uniform;
    params.smoothing_sums = chunk.smoothing_sums;
    // w̄ = Σ_i w_i·W_i, once per call, before the first finish reads it.
    if (chunk.first_chunk) {
      weighted_row_sum(chunk.weight.data, chunk.weight.dtype, vocab, hidden, chunk.weight.stride,
                       a.options.class_weight, chunk.sum_partials, chunk.weight_sum, stream);
    }
  }

  const int row_blocks = warp_blocks(rows);
  reference_records_kernel<S><<<row_blocks, kBlockThreads, 0, stream>>>(operands, params);
  XENT_CUDA_CHECK_LAUNCH();

  FusedGradProduct product;
  product.hidden = chunk.hidden_rows.data;
  product.hidden_stride = chunk.hidden_rows.stride;
  product.weight = chunk.weight.data;
  product.weight_stride = chunk.weight.stride;
  product.dtype = chunk.hidden_rows.dtype;
  product.rows = rows;
  product.columns = vocab;
  product.hidden_size = hidden;
  product.first_column = 0;
  product.records = chunk.records;
  product.logit_scale = a.options.logit_scale;
  product.softcap = a.options.softcap;
  product.grad = const_cast<void*>(a.logits);
  product.grad_stride = a.row_stride;
  product.rounded_logits = true;
  product.partials = static_cast<float*>(chunk.scratch);
  product.partial_stride = params.tiles;
  product.target_logits = chunk.target_logits;
  product.statistic_partials = statistic_partials;
  if (!fused_grad_product(product, stream)) return false;

  reference_finish_kernel<S><<<row_blocks, kBlockThreads, 0, stream>>>(operands, params);
  XENT_CUDA_CHECK_LAUNCH();
  int device = 0;
  XENT_CUDA_CHECK(cudaGetDevice(&device));
  const int fallback_blocks = 2 * multiprocessor_count(device);
  fallback_logits_kernel<S><<<fallback_blocks, kBlockThreads, 0, stream>>>(operands, params);
  XENT_CUDA_CHECK_LAUNCH();
  fallback_grad_kernel<S><<<fallback_blocks, kBlockThreads, 0, stream>>>(params);
  XENT_CUDA_CHECK_LAUNCH();

  const GemmMatrix exps{a.logits, chunk.hidden_rows.dtype, rows, vocab, a.row_stride};
  const LinearGradients& grads = *chunk.grads;
  if (grads.hidden.present()) {
    GemmProduct hidden_product;
    hidden_product.a = exps;
    hidden_product.b = chunk.weight;
    hidden_product.c = GemmMatrix{chunk.hidden_product, DType::f32, rows, hidden, hidden};
    gemm(hidden_product, chunk.gemm_scratch, stream);
    scale_product_rows(chunk.hidden_product, rows, hidden, chunk.scale, chunk.uniform,
                       chunk.weight_sum, view_rows(grads.hidden, chunk.first_row, rows), stream);
  }
  const GradientSums& sums = *chunk.sums;
  if (sums.weight) {
    S* scaled = static_cast<S*>(chunk.scratch);
    scale_hidden_rows_kernel<<<elementwise_blocks(rows * hidden), kElementwiseThreads, 0, stream>>>(
        static_cast<const S*>(chunk.hidden_rows.data), chunk.hidden_rows.stride, rows, hidden,
        chunk.scale, scaled);
    XENT_CUDA_CHECK_LAUNCH();
    // With label smoothing, K grows by its kUniformRows rows (after the scaled rows, which the ∂h
    // product's fp32 rows in the scratch no longer need).
    const int64_t k_rows = smoothing ? rows + kUniformRows : rows;
    if (smoothing) {
      weighted_row_sum(chunk.hidden_rows.data, chunk.hidden_rows.dtype, rows, hidden,
                       chunk.hidden_rows.stride, chunk.uniform, chunk.sum_partials,
                       chunk.hidden_sum, stream);
      S* exps_rows = static_cast<S*>(const_cast<void*>(a.logits)) + rows * a.row_stride;
      uniform_rows_kernel<<<elementwise_blocks(kUniformRows * (vocab + hidden)),
                            kElementwiseThreads, 0, stream>>>(
          a.options.class_weight, vocab, exps_rows, a.row_stride, chunk.hidden_sum, hidden,
          scaled + rows * hidden);
      XENT_CUDA_CHECK_LAUNCH();
    }
    GemmProduct weight_product;
    weight_product.a = GemmMatrix{a.logits, chunk.hidden_rows.dtype, k_rows, vocab, a.row_stride};
    weight_product.a_transposed = true;
    weight_product.b = GemmMatrix{scaled, chunk.hidden_rows.dtype, k_rows, hidden, hidden};
    weight_product.c = GemmMatrix{sums.weight, sums.weight_dtype, chunk.weight.rows,
                                  chunk.weight.cols, sums.weight_stride};
    weight_product.beta = chunk.first_chunk && !sums.weight_added ? 0.0f : 1.0f;
    gemm(weight_product, chunk.gemm_scratch, stream);
  }
  return true;
}

}  // namespace

bool reference_options_eligible(const CeOptions& options) {
  // With a softcap smoothing's uniform term carries each element's slope: not rank 1.
  return options.label_smoothing == 0 || !options.softcap.has_value();
}

bool reference_statistics_wanted(const CeStats* stats) {
  return stats != nullptr &&
         (stats->entropy.present() || stats->argmax.present() || stats->accuracy.present());
}

// The path's products are the fused sm_90a kernels: Hopper paths only.
bool reference_path_enabled() {
  return test_hook().reference_path != Forced::off && hopper_paths();
}

bool reference_statistics_preferred(int64_t hidden) {
  return hidden >= kReferenceStatisticsMinHidden || test_hook().reference_path == Forced::on;
}

std::size_t reference_chunk_row_bytes(int64_t vocab, int64_t hidden, bool hidden_product_in_scratch,
                                      bool statistics) {
  const std::size_t tiles =
      static_cast<std::size_t>((vocab + kFusedTileColumns - 1) / kFusedTileColumns);
  const std::size_t tile_sums = statistics ? 4 : 1;  // Σ; and Σ·(x̃ − r), max, argmax
  std::size_t row = std::max<std::size_t>(tile_sums * tiles * sizeof(float),
                                          static_cast<std::size_t>(hidden) * 2);
  row = std::max<std::size_t>(row, kSliceFields * kReferenceFallbackSplit * sizeof(float));
  if (hidden_product_in_scratch) {
    row = std::max<std::size_t>(row, static_cast<std::size_t>(hidden) * sizeof(float));
  }
  return row + kWorkspaceAlignment;
}

std::size_t reference_fixed_bytes(int64_t rows, int64_t hidden, bool smoothing) {
  const std::size_t n = static_cast<std::size_t>(std::max<int64_t>(rows, 0));
  const std::size_t row_floats = align_up(n * sizeof(float));
  std::size_t bytes = 2 * row_floats + align_up((n + 1) * sizeof(int32_t));
  if (smoothing) {  // k_n and Σ w·x̃ per row; w̄, U and their partials
    const std::size_t h = static_cast<std::size_t>(std::max<int64_t>(hidden, 0));
    bytes +=
        2 * row_floats + 2 * align_up(h * sizeof(float)) + weighted_row_sum_scratch_bytes(hidden);
  }
  return bytes;
}

std::size_t reference_buffer_extra_bytes(int64_t vocab, int64_t hidden, bool smoothing) {
  if (!smoothing) return 0;
  const std::size_t element = 2;  // the path's 16-bit operands
  return align_up(static_cast<std::size_t>(kUniformRows * vocab) * element) +
         align_up(static_cast<std::size_t>(kUniformRows * hidden) * element) +
         2 * kWorkspaceAlignment;
}

std::size_t reference_scratch_offset(int64_t chunk_rows, int64_t vocab, std::size_t element,
                                     bool smoothing) {
  const int64_t rows = chunk_rows + (smoothing ? kUniformRows : 0);
  return align_up(static_cast<std::size_t>(rows) * static_cast<std::size_t>(vocab) * element);
}

bool reference_chunk(const ReferenceChunk& chunk, cudaStream_t stream) {
  if (chunk.rows.rows <= 0) return true;
  bool ran = false;
  switch (chunk.hidden_rows.dtype) {
    case DType::bf16:
      ran = run_chunk<bf16_t>(chunk, stream);
      break;
    default:
      return false;  // f16 holds e^(x̃ − r) only up to a loss of 11 nats
  }
  if (ran) reference_chunks.fetch_add(1, std::memory_order_relaxed);
  return ran;
}

int64_t reference_chunk_count() { return reference_chunks.load(std::memory_order_relaxed); }

}  // namespace xent::cuda
