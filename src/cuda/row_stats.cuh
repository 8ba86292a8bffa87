// Per-thread accumulation of common::RowStats on the GPU, a vector of columns at a time.
//
// RowStats::add is exact but costs a data-dependent branch, a precise expf and int64 index work
// per element; at 8 bf16 columns per 16-byte load that made the first ce kernel issue-bound at
// ~0.2 of copy bandwidth (docs/perf-notes.md). Here the same fields are accumulated per vector:
// the vector's max by an fmaxf tree, one rescale branch per vector (taken a
// handful of times per row), the shifted exponentials on the ex2 unit, and the vector's sums
// added pairwise. The fields keep RowStats' meaning, so RowStats::add (for ragged tails and for
// rows with NaN or ±Inf, where the exact path is re-run) and RowStats::merge apply unchanged.
#pragma once

#include <cfloat>

#include "common/ce_row.hpp"

namespace xent::cuda {

// x̃ = x (logit_scale 1, no softcap) resolved at compile time: the plain case then skips a
// multiply per element in every sweep. Same values as common::Transform with scale 1.
struct IdentityTransform {
  __device__ __forceinline__ float value(float x) const { return x; }
  __device__ __forceinline__ float slope(float) const { return 1.0f; }
};

template <int N>
__device__ __forceinline__ float pairwise_sum(const float (&v)[N]) {
  float partial[N];
#pragma unroll
  for (int k = 0; k < N; ++k) partial[k] = v[k];
#pragma unroll
  for (int width = N; width > 1; width /= 2) {
#pragma unroll
    for (int k = 0; k < width / 2; ++k) partial[k] = partial[2 * k] + partial[2 * k + 1];
  }
  return partial[0];
}

// kFull: also Σ e·d (entropy) and the logit sums of label smoothing; without it those fields
// stay 0 and cost nothing.
// kArgmax: also track the first column of the max (accuracy, argmax outputs); without it the
// argmax field is left at the thread's first column and must not be read.
template <bool kFull, bool kArgmax>
struct VectorRowStats {
  common::RowStats<float> stats;

  // Adds N transformed values of consecutive columns column, column+1, ... (all finite or -inf;
  // NaN and +Inf are caught by needs_exact_path()). `weights` are their class weights (kFull).
  template <int N>
  __device__ __forceinline__ void add(const float (&v)[N], int64_t column, const float (&w)[N]) {
    // The vector's max by an fmaxf tree. fmaxf drops NaN, which then shows in the sums below.
    float best[N];
#pragma unroll
    for (int k = 0; k < N; ++k) best[k] = v[k];
#pragma unroll
    for (int width = N; width > 1; width /= 2) {
#pragma unroll
      for (int k = 0; k < width / 2; ++k) best[k] = fmaxf(best[2 * k], best[2 * k + 1]);
    }
    // RowStats keeps the first column as argmax even at -inf: the caller sets it before the
    // first vector (slice_row_stats), so no per-vector check here. The search for the column
    // runs only when the running max moves.
    if (kArgmax && best[0] > stats.max) {
      int where = 0;
#pragma unroll
      for (int k = N - 1; k >= 0; --k) {
        if (v[k] == best[0]) where = k;  // the lowest column holding the max
      }
      stats.argmax = column + where;
    }
    if (kFull) {
      float weighted[N];
#pragma unroll
      for (int k = 0; k < N; ++k) weighted[k] = w[k] * v[k];
      stats.sum_logits += pairwise_sum(v);
      stats.sum_weighted_logits += pairwise_sum(weighted);
    }
    const float new_max = fmaxf(stats.max, best[0]);
    if (new_max == -common::infinity<float>()) {
      // Everything so far is -inf, so e^(v−m) would be NaN: nothing to add, except that a NaN
      // hiding here (NaN loses every comparison) must still reach needs_exact_path().
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (v[k] != v[k]) stats.sum_exp = v[k];
      }
      return;
    }
    // The sums so far move to the new max without a branch: in random rows the max moves in
    // most warps' first vectors, and a divergent rescale branch (~30 instructions, run by the
    // warp whenever one lane takes it) cost more than this ex2 on every vector. alpha is exactly
    // 1 when the max stays, 0 while nothing has been summed (stats.max = -inf).
    const float shift = stats.max - new_max;
    const float alpha = fast_exp2(shift * kLog2e);
    if (kFull) {
      const float moved = stats.sum_exp > 0 ? shift * stats.sum_exp : 0.0f;  // not -inf·0
      stats.sum_exp_shift = alpha * (stats.sum_exp_shift + moved);
    }
    stats.sum_exp *= alpha;
    stats.max = new_max;
    float e[N], ed[N];
    const float scaled_max = new_max * kLog2e;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (kFull) {
        const float d = v[k] - new_max;
        e[k] = fast_exp(d);
        ed[k] = e[k] > 0.0f ? e[k] * d : 0.0f;  // -inf columns add 0, not 0·(-inf)
      } else {
        e[k] = fast_exp2(fmaf(v[k], kLog2e, -scaled_max));  // -inf columns give 0
      }
    }
    stats.sum_exp += pairwise_sum(e);
    if (kFull) stats.sum_exp_shift += pairwise_sum(ed);
  }

  // NaN or +Inf reached the sums: the caller re-runs its elements through RowStats::add, which
  // defines those rows (first NaN as argmax, NaN statistics).
  __device__ __forceinline__ bool needs_exact_path() const {
    return !(stats.sum_exp <= FLT_MAX) || stats.max != stats.max;
  }
};

}  // namespace xent::cuda

#include "cuda/row_slice.cuh"

namespace xent::cuda {

// The statistics sweep of one CTA over its slice: RowStats of transform(x) for the columns this
// thread owns (vectors threadIdx.x, +blockDim.x, ...), exact on rows with NaN or +Inf.
// `class_weight` is read only when kFull (the weighted logit sum of label smoothing).
template <bool kFull, bool kArgmax, class S, class Transform>
__device__ __forceinline__ common::RowStats<float> slice_row_stats(const RowSlice<S>& slice,
                                                   const Transform& transform,
                                                   const float* class_weight) {
  constexpr int kVec = kVectorElements<S>;
  const int vectors = static_cast<int>(slice.vectors());
  const int full_vectors = static_cast<int>(slice.length / kVec);
  VectorRowStats<kFull, kArgmax> acc;
  // The first column this thread sees is its argmax until a value beats -inf (RowStats::add).
  if (static_cast<int>(threadIdx.x) < full_vectors) {
    acc.stats.argmax = slice.begin + int64_t{threadIdx.x} * kVec;
  }
  int piece = 0;
  for (int j = threadIdx.x; j < vectors; j += blockDim.x, ++piece) {
    const Vector<S> x = slice.load(j, piece);
    const int64_t column = slice.begin + int64_t{j} * kVec;
    float v[kVec], w[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      v[k] = transform.value(x.value[k]);
      w[k] = 1.0f;
    }
    if (kFull && class_weight) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        w[k] = j < full_vectors || j * kVec + k < slice.length ? class_weight[column + k] : 1.0f;
      }
    }
    if (j < full_vectors) {
      acc.add(v, column, w);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (j * kVec + k < slice.length) acc.stats.add(v[k], column + k, w[k]);
      }
    }
  }
  if (!acc.needs_exact_path()) return acc.stats;
  common::RowStats<float> exact;  // NaN / +Inf present: RowStats::add decides, element by element
  for (int j = threadIdx.x; j < vectors; j += blockDim.x) {
    const Vector<S> x = slice.reload(j);
    const int64_t column = slice.begin + int64_t{j} * kVec;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (j * kVec + k < slice.length) {
        const float w = class_weight ? class_weight[column + k] : 1.0f;
        exact.add(transform.value(x.value[k]), column + k, w);
      }
    }
  }
  return exact;
}

// Calls f(transform) with the softcap branch resolved at compile time: without a softcap the
// transform is a multiply (the tanh path would otherwise sit in every element's code).
template <class F>
__device__ __forceinline__ void with_transform(const common::Transform<float>& transform, F&& f) {
  if (transform.softcap > 0) {
    f(transform);
  } else if (transform.scale == 1.0f) {
    f(IdentityTransform{});
  } else {
    common::Transform<float> plain;
    plain.scale = transform.scale;
    plain.softcap = 0.0f;
    f(plain);
  }
}

}  // namespace xent::cuda
