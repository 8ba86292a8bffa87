// Device pieces of the two cross-entropy row kernel families: ce_rows.cu (a row per CTA or
// thread-block cluster, staged in shared memory) and ce_short_rows_kernel.cuh (a row per warp or pair of
// warps, held in registers). What a row reports once its statistics are merged, its gradient
// coefficients, and the gradient of one 16-byte vector are written here once, so the two
// families cannot drift apart; the math itself is common::ce_row_loss, ce_grad_row and
// ce_grad_from_prob (src/common/ce_row.hpp).
#pragma once

#include "cuda/ce_device.cuh"
#include "cuda/row_stats.cuh"

namespace xent::cuda {

// The per-row scalars a valid row needs besides its logits. The short-row kernel loads them
// while the row is in flight; the cluster kernel after its statistics (as before).
struct CeRowScalars {
  float row_weight = 1;     // r_n
  float target_weight = 1;  // w_y (read only for an in-range target)
  float upstream = 1;       // g_n of reduction none, else the batch's scalar (gradient only)
};

__device__ __forceinline__ CeRowScalars load_ce_row_scalars(const CeRowsArgs& a, int64_t row,
                                                            int64_t target, bool in_range) {
  CeRowScalars s;
  if (a.row_weight) s.row_weight = a.row_weight[row];
  if (a.options.class_weight && in_range) s.target_weight = a.options.class_weight[target];
  if (a.grad) s.upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  return s;
}

// What an ignored row (target == ignore_index) reports: common::IgnoredRow.
__device__ __forceinline__ void write_ignored_row_outputs(const CeRowsArgs& a, int64_t row) {
  using Ignored = common::IgnoredRow<float>;
  if (a.row_loss) a.row_loss[row] = Ignored::loss;
  if (a.row_z_loss) a.row_z_loss[row] = Ignored::loss;
  if (a.row_total) a.row_total[row] = Ignored::loss;
  if (a.row_correct) a.row_correct[row] = 0.0f;
  if (a.lse) a.lse[row] = Ignored::lse;
  if (a.logprob) a.logprob[row] = Ignored::logprob;
  if (a.entropy) a.entropy[row] = Ignored::entropy;
  if (a.argmax) a.argmax[row] = Ignored::argmax;
}

// The outputs of a valid row from its merged statistics; a target outside [0, V) gives a NaN
// loss, z-loss and logprob (SPEC §1), the statistics are still reported.
__device__ __forceinline__ void write_ce_row_outputs(const CeRowsArgs& a,
                                                     const common::CeConstants<float>& c,
                                                     int64_t row, int64_t target, bool in_range,
                                                     const CeRowScalars& s,
                                                     const common::RowStats<float>& stats,
                                                     float lse, float target_logit) {
  if (a.entropy) a.entropy[row] = stats.entropy();
  float loss = quiet_nan(), z = quiet_nan(), logprob = quiet_nan();
  if (in_range) {
    const auto parts = common::ce_row_loss(c, stats, lse, target_logit, s.target_weight);
    loss = s.row_weight * parts.loss;
    z = s.row_weight * parts.z_loss;
    logprob = target_logit - lse;
  }
  if (a.row_loss) a.row_loss[row] = loss;
  if (a.row_z_loss) a.row_z_loss[row] = z;
  if (a.row_total) a.row_total[row] = loss + z;
  if (a.row_correct) a.row_correct[row] = stats.argmax == target ? 1.0f : 0.0f;
  if (a.lse) a.lse[row] = lse;
  if (a.logprob) a.logprob[row] = logprob;
  if (a.argmax) a.argmax[row] = stats.argmax;
}

// Gradient coefficients of an in-range row: c_n = upstream·r_n·loss_factor (z part: z_factor),
// times the call's grad_scale (CeRowsArgs).
__device__ __forceinline__ common::CeGradRow<float> ce_row_gradient(
    const CeRowsArgs& a, const common::CeConstants<float>& c, float lse, int64_t target,
    const CeRowScalars& s) {
  const float base = s.upstream * s.row_weight;
  return common::ce_grad_row(c, lse, target, s.target_weight,
                             base * a.totals->loss_factor * a.grad_scale,
                             base * a.totals->z_factor * a.grad_scale);
}

// ∂loss/∂x of one 16-byte vector x of logits (columns column, column + 1, ...; `valid` of them
// in the row, all of them when `full`). `target_k` is the element holding y, or −1: only that
// vector pays the per-column comparison. p = 2^(x̃·log2(e) − lse·log2(e)) with scaled_lse =
// lse·log2(e): one fused multiply-add per element (see fast_exp2). The class weight of a column
// enters only through label smoothing (kWeighted: weighted and ε > 0).
template <bool kWeighted, class S, class Transform>
__device__ __forceinline__ Vector<S> ce_grad_vector(const Vector<S>& x, const Transform& transform,
                                                    const common::CeGradRow<float>& row,
                                                    float scaled_lse, int target_k,
                                                    const float* class_weight, int64_t column,
                                                    bool full, int64_t valid) {
  constexpr int kVec = kVectorElements<S>;
  float w[kVec];
  if (kWeighted) {
    load_class_weights(class_weight, column, full, valid, w);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) w[k] = 1.0f;
  }
  auto element = [&](int k, bool is_target) {
    float value, slope;
    value_and_slope(transform, x.value[k], value, slope);
    const float p = fast_exp2(fmaf(value, kLog2e, -scaled_lse));
    return common::ce_grad_from_prob(row, p, slope, is_target, w[k]);
  };
  Vector<S> g;
#pragma unroll
  for (int k = 0; k < kVec; ++k) g.value[k] = element(k, false);
  if (target_k >= 0) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (k == target_k) g.value[k] = element(k, true);
    }
  }
  return g;
}

// Fills `length` gradient columns with `value` (0 for an ignored row, NaN for an out-of-range
// target), vectors first, first + step, ... of the caller's threads.
template <class S>
__device__ void write_constant_row(S* grad, int64_t length, bool vector_ok, float value,
                                   int first, int step) {
  constexpr int kVec = kVectorElements<S>;
  Vector<S> v;
#pragma unroll
  for (int k = 0; k < kVec; ++k) v.value[k] = value;
  const int64_t vectors = (length + kVec - 1) / kVec;
  for (int64_t j = first; j < vectors; j += step) store_vector(grad, j, length, vector_ok, v);
}

}  // namespace xent::cuda
