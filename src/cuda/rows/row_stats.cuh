// Per-thread accumulation of common::RowStats on the GPU, a vector of columns at a time.
//
// RowStats::add is exact but costs a data-dependent branch, a precise expf and int64 index work
// per element; at 8 bf16 columns per 16-byte load that made the first ce kernel issue-bound at
// ~0.2 of copy bandwidth (docs/archive/perf-notes.md). Here the same fields are accumulated per vector:
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

// tanh for the softcap, with 1 − tanh² formed alongside (the slope of the chain rule).
// The precise tanhf plus an IEEE division by s per element, twice per element (statistics and
// gradient sweeps), made the every-option ce row issue-bound (docs/archive/perf-notes.md, decision 12).
// |x| < 0.6: x + x³·P(x²), P of degree 4 fitted (Lawson minimax) on [0, 0.6]; fp32 Horner
//   evaluation measured over 2·10⁶ points: ≤ 7.3e-8 relative (< 1 ulp).
// |x| ≥ 0.6: 1 − 2r with r = 1/(e^(2|x|) + 1) from ex2.approx (≤ 2^-22 relative) and
//   rcp.approx (≤ 1 ulp); worst case of both errors: ≤ 4.5e-7 relative, ≤ 2.4e-7 absolute on tanh
//   (below 0.6 the subtraction would cancel, hence the polynomial). 1 − tanh² = 4r(1 − r) there,
//   which keeps its relative precision where tanh rounds to 1 (1 − t·t would be 0 or noise).
// NaN stays NaN; ±Inf gives ±1 and a slope of 0. Against docs/semantics.md §6 (1e-5 norm-wise on fp32): with a
// softcap s the value s·tanh moves by ≤ 2.4e-7·s absolute, e.g. 7e-6 on one logit at s = 30,
// i.e. ~7e-6 relative on that p_i before averaging over the row — inside the contract, and the
// size of the fp32 rounding of s·tanh itself (0.5 ulp of 15 is 1e-6).
__device__ __forceinline__ void fast_tanh_and_sech2(float x, float& t, float& sech2) {
  const float a = fabsf(x);
  if (a < 0.6f) {
    const float s = x * x;
    float p = -5.895155947655439e-3f;
    p = fmaf(p, s, 2.0795969292521477e-2f);
    p = fmaf(p, s, -5.3783830255270004e-2f);
    p = fmaf(p, s, 1.3331924378871918e-1f);
    p = fmaf(p, s, -3.3333298563957214e-1f);
    t = fmaf(p * s, x, x);
    sech2 = fmaf(-t, t, 1.0f);
  } else {
    const float e = fast_exp2(a * (2.0f * kLog2e));  // +Inf past |x| ≈ 44: r = 0, t = ±1
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.0f));
    t = copysignf(fmaf(-2.0f, r, 1.0f), x);
    const float four_r = 4.0f * r;
    sech2 = fmaf(-four_r, r, four_r);
  }
}

// x̃ = s·tanh(a·x / s) of common::Transform with a/s formed once per call (one rounding of the
// argument, ≤ 1.5 ulp instead of 1) and tanh from fast_tanh_and_sech2 (error bound there).
struct SoftcapTransform {
  float scale = 1;               // a
  float softcap = 0;             // s > 0
  float scale_over_softcap = 0;  // a / s

  __device__ __forceinline__ float value(float x) const {
    float t, sech2;
    fast_tanh_and_sech2(x * scale_over_softcap, t, sech2);
    return softcap * t;
  }
  __device__ __forceinline__ float slope(float x) const {
    float t, sech2;
    fast_tanh_and_sech2(x * scale_over_softcap, t, sech2);
    return scale * sech2;
  }
  // Both from one tanh (the gradient sweeps need x̃ for p and the slope for the chain rule).
  __device__ __forceinline__ void value_and_slope(float x, float& value, float& slope) const {
    float t, sech2;
    fast_tanh_and_sech2(x * scale_over_softcap, t, sech2);
    value = softcap * t;
    slope = scale * sech2;
  }
};

template <class Transform>
__device__ __forceinline__ void value_and_slope(const Transform& transform, float x, float& value,
                                                float& slope) {
  value = transform.value(x);
  slope = transform.slope(x);
}
__device__ __forceinline__ void value_and_slope(const SoftcapTransform& transform, float x,
                                                float& value, float& slope) {
  transform.value_and_slope(x, value, slope);
}

// N consecutive class weights from `column` on (1 past `length` columns of the slice). The
// every-option sweeps read 8 weights per bf16 vector: as scalar loads they were 8 dependent
// address computations and 8 load instructions per vector; 16-byte loads make them N/4
// (the weights of a vector are 16-byte aligned when the array is: slices and vectors start at
// multiples of N ≥ 4 columns).
template <int N>
__device__ __forceinline__ void load_class_weights(const float* class_weight, int64_t column,
                                                   bool full_vector, int64_t valid, float (&w)[N]) {
  static_assert(N % 4 == 0, "16-byte weight loads");
  if (full_vector && (reinterpret_cast<uintptr_t>(class_weight) & 15) == 0) {
    const float4* from = reinterpret_cast<const float4*>(class_weight + column);
#pragma unroll
    for (int q = 0; q < N / 4; ++q) {
      const float4 f = __ldg(from + q);
      w[4 * q] = f.x;
      w[4 * q + 1] = f.y;
      w[4 * q + 2] = f.z;
      w[4 * q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) w[k] = k < valid ? class_weight[column + k] : 1.0f;
  }
}

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
// stay 0 and cost nothing. Within kFull, `entropy_sum` and `weighted_sum` (uniform per CTA,
// tested once per vector) skip Σ e·d when no entropy is asked for and Σ w·x̃ without class
// weights: label smoothing alone then costs one sum per element instead of five operations more
// (decision 37, docs/archive/perf-notes.md). The skipped fields stay 0.
// kArgmax: also track the first column of the max (accuracy, argmax outputs); without it the
// argmax field is left at the thread's first column and must not be read.
template <bool kFull, bool kArgmax>
struct VectorRowStats {
  common::RowStats<float> stats;
  bool entropy_sum = kFull;
  bool weighted_sum = kFull;

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
      stats.sum_logits += pairwise_sum(v);
      if (weighted_sum) {
        float weighted[N];
#pragma unroll
        for (int k = 0; k < N; ++k) weighted[k] = w[k] * v[k];
        stats.sum_weighted_logits += pairwise_sum(weighted);
      }
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
    const bool with_entropy = kFull && entropy_sum;
    if (with_entropy) {
      const float moved = stats.sum_exp > 0 ? shift * stats.sum_exp : 0.0f;  // not -inf·0
      stats.sum_exp_shift = alpha * (stats.sum_exp_shift + moved);
    }
    stats.sum_exp *= alpha;
    stats.max = new_max;
    float e[N];
    if (with_entropy) {
      float ed[N];
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float d = v[k] - new_max;
        e[k] = fast_exp(d);
        ed[k] = e[k] > 0.0f ? e[k] * d : 0.0f;  // -inf columns add 0, not 0·(-inf)
      }
      stats.sum_exp_shift += pairwise_sum(ed);
    } else {
      const float scaled_max = new_max * kLog2e;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        e[k] = fast_exp2(fmaf(v[k], kLog2e, -scaled_max));  // -inf columns give 0
      }
    }
    stats.sum_exp += pairwise_sum(e);
  }

  // NaN or +Inf reached the sums: the caller re-runs its elements through RowStats::add, which
  // defines those rows (first NaN as argmax, NaN statistics).
  __device__ __forceinline__ bool needs_exact_path() const {
    return !(stats.sum_exp <= FLT_MAX) || stats.max != stats.max;
  }
};

}  // namespace xent::cuda

#include "cuda/rows/row_slice.cuh"

namespace xent::cuda {

// RowStats::add element by element (NaN / +Inf present: it decides argmax and the NaN
// statistics). Call after a sweep that waited on every piece of the slice.
template <class S, class Transform>
__device__ common::RowStats<float> exact_slice_row_stats(const RowSlice<S>& slice,
                                                         const Transform& transform,
                                                         const float* class_weight) {
  constexpr int kVec = kVectorElements<S>;
  const int vectors = static_cast<int>(slice.vectors());
  common::RowStats<float> exact;
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

// The statistics sweep of one CTA over its slice: RowStats of transform(x) for the columns this
// thread owns (vectors threadIdx.x, +blockDim.x, ...), exact on rows with NaN or +Inf.
// `class_weight` is read only when kFull (the weighted logit sum of label smoothing); with
// kFull, `entropy` false leaves sum_exp_shift at 0 (the entropy is not asked for); `lean` false
// forms both optional sums regardless (the A/B switch of decision 37).
template <bool kFull, bool kArgmax, bool kPrefix = false, class S, class Transform>
__device__ __forceinline__ common::RowStats<float> slice_row_stats(const RowSlice<S>& slice,
                                                                   const Transform& transform,
                                                                   const float* class_weight,
                                                                   bool entropy = true,
                                                                   bool lean = true) {
  constexpr int kVec = kVectorElements<S>;
  const int vectors = static_cast<int>(slice.vectors());
  const int full_vectors = static_cast<int>(slice.length / kVec);
  VectorRowStats<kFull, kArgmax> acc;
  acc.entropy_sum = kFull && (entropy || !lean);
  acc.weighted_sum = kFull && (class_weight != nullptr || !lean);
  // The first column this thread sees is its argmax until a value beats -inf (RowStats::add).
  if (static_cast<int>(threadIdx.x) < full_vectors) {
    acc.stats.argmax = slice.begin + int64_t{threadIdx.x} * kVec;
  }
  // Adds vector j (columns begin + j·kVec ...) to this thread's statistics.
  auto add_vector = [&](const Vector<S>& x, int j) {
    const int64_t column = slice.begin + int64_t{j} * kVec;
    float v[kVec], w[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      v[k] = transform.value(x.value[k]);
      w[k] = 1.0f;
    }
    if (kFull && class_weight) {
      load_class_weights(class_weight, column, j < full_vectors, slice.length - j * kVec, w);
    }
    if (j < full_vectors) {
      acc.add(v, column, w);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (j * kVec + k < slice.length) acc.stats.add(v[k], column + k, w[k]);
      }
    }
  };
  // Streamed slices (a forward without gradient, a prefix's tail): four 16-byte loads in flight
  // per thread instead of one, from vector j on while four fit. By Little's law a multiprocessor
  // needs ~48 KB in flight to draw its share of HBM bandwidth (~32 GB/s × ~1.5 µs under load);
  // 1280 threads × 16 B is only 20 KB. Eight loads need 64 registers (4 CTAs instead of 5) and
  // were no faster than four (docs/archive/perf-notes.md, v6). The raw words are held and
  // unpacked at use, so the depth costs 4 registers a load.
  auto stream_deep = [&](int& j) {
    constexpr int kStreamDepth = 4;
    const uint4* words = reinterpret_cast<const uint4*>(slice.global);
    const int stride = static_cast<int>(blockDim.x);
    for (; j + (kStreamDepth - 1) * stride < full_vectors; j += kStreamDepth * stride) {
      uint4 raw[kStreamDepth];
#pragma unroll
      for (int u = 0; u < kStreamDepth; ++u) raw[u] = __ldg(words + j + u * stride);
#pragma unroll
      for (int u = 0; u < kStreamDepth; ++u) add_vector(unpack<S>(raw[u]), j + u * stride);
    }
  };
  if constexpr (!kPrefix) {
    int first = threadIdx.x;
    if (slice.deep_stream && !slice.staged && slice.vector_ok) stream_deep(first);
    // Staged slices start here with first == threadIdx.x, so iteration p reads piece p; the
    // deep streamed loop above leaves only a streamed tail, which waits on no piece.
    int piece = 0;
    for (int j = first; j < vectors; j += blockDim.x, ++piece) add_vector(slice.load(j, piece), j);
  } else {
    // A slice of stage_prefix: pass 0 reads the staged prefix piece by piece as it lands, pass 1
    // the streamed rest. One loop serves both passes: with a separate prefix loop (a sixth call
    // site of add_vector) nvcc spilled ~600 bytes.
    int j = threadIdx.x;
    int piece = 0;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
      if (pass == 1) stream_deep(j);
      const int end = pass == 0 ? slice.staged_vectors : vectors;
      for (; j < end; j += blockDim.x, ++piece) add_vector(slice.load(j, piece), j);
    }
  }
  if (!acc.needs_exact_path()) return acc.stats;
  return exact_slice_row_stats(slice, transform, class_weight);
}

// Statistics of two slices over the same columns (distill: student and teacher rows) in one
// sweep. Two separate sweeps each had one ex2 chain and one piece wait per vector; here every
// iteration carries two independent chains (student and teacher), which the latency-bound
// sweep (ncu on v4: no eligible warp 45 % of the time) can overlap. Each side falls back to
// exact_slice_row_stats on its own when it holds NaN or +Inf.
template <class S, class Transform>
__device__ __forceinline__ void slice_pair_row_stats(const RowSlice<S>& first,
                                                     const RowSlice<S>& second,
                                                     const Transform& transform,
                                                     common::RowStats<float>& first_stats,
                                                     common::RowStats<float>& second_stats) {
  constexpr int kVec = kVectorElements<S>;
  const int vectors = static_cast<int>(first.vectors());
  const int full_vectors = static_cast<int>(first.length / kVec);
  VectorRowStats<false, false> a, b;
  if (static_cast<int>(threadIdx.x) < full_vectors) {
    a.stats.argmax = first.begin + int64_t{threadIdx.x} * kVec;
    b.stats.argmax = a.stats.argmax;
  }
  float ones[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) ones[k] = 1.0f;
  int piece = 0;
  for (int j = threadIdx.x; j < vectors; j += blockDim.x, ++piece) {
    const Vector<S> x = first.load(j, piece);
    const Vector<S> y = second.load(j, piece);
    const int64_t column = first.begin + int64_t{j} * kVec;
    float u[kVec], v[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      u[k] = transform.value(x.value[k]);
      v[k] = transform.value(y.value[k]);
    }
    if (j < full_vectors) {
      a.add(u, column, ones);
      b.add(v, column, ones);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (j * kVec + k < first.length) {
          a.stats.add(u[k], column + k, 1.0f);
          b.stats.add(v[k], column + k, 1.0f);
        }
      }
    }
  }
  first_stats = a.needs_exact_path()
                    ? exact_slice_row_stats(first, transform, static_cast<const float*>(nullptr))
                    : a.stats;
  second_stats = b.needs_exact_path()
                     ? exact_slice_row_stats(second, transform, static_cast<const float*>(nullptr))
                     : b.stats;
}

// Calls f(transform) with the softcap branch resolved at compile time: without a softcap the
// transform is a multiply (the tanh path would otherwise sit in every element's code); with one
// it is SoftcapTransform (fast tanh, error bound at fast_tanh_and_sech2).
template <class F>
__device__ __forceinline__ void with_transform(const common::Transform<float>& transform, F&& f) {
  if (transform.softcap > 0) {
    SoftcapTransform capped;
    capped.scale = transform.scale;
    capped.softcap = transform.softcap;
    capped.scale_over_softcap = transform.scale / transform.softcap;
    f(capped);
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
