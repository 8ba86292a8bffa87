// The CUDA cross-entropy kernel for short rows, as templates (SPEC.md §1, docs/perf-notes.md
// decision 30): one warp per row (a pair of warps for rows up to twice as long), four warps per CTA. Each lane
// issues every 16-byte load of its part of the row before any arithmetic, so the warp has its
// whole row in flight at once; the row then stays in registers: statistics per lane
// (VectorRowStats, as the cluster kernel), merged with warp shuffles (warp_merge), the gradient
// formed from the same registers and written with 16-byte stores. No shared-memory staging, no
// CTA barrier, no cluster: the fixed per-row cost of ce_rows_kernel (staging, three barriers,
// thread 0's serial section) is what held short rows to half of copy bandwidth.
// Semantics come from src/common/ce_row.hpp through ce_rows_device.cuh, as for ce_rows.cu.
// One translation unit per logits dtype instantiates them (ce_short_rows_{f32,bf16,f16}.cu): the
// unrolled instances of one dtype take minutes of one core to compile, and apart they build in
// parallel. ce_short_rows.cu holds the dispatch.
#pragma once

#include "cuda/ce_rows_device.cuh"
#include "cuda/ce_short_rows.cuh"

namespace xent::cuda {
namespace short_rows {


using common::CeConstants;
using common::CeGradRow;
using common::RowStats;

constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;  // 128 threads: 4 rows (2 pairs), fine-grained for the tail
constexpr int kMaxVectors = 16;    // 16-byte vectors per lane: 64 registers of row at most

struct ShortRowsParams {
  CeRowsArgs args;
  bool logits_vector_ok;
  bool grad_vector_ok;
};

// What one warp of a pair contributes to its row.
struct WarpPartial {
  RowStats<float> stats;
  float target_logit;
};

__device__ __forceinline__ uint32_t storage_bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t storage_bits(bf16_t v) { return v.bits; }
__device__ __forceinline__ uint32_t storage_bits(f16_t v) { return v.bits; }

// Vector j of a row as its raw 16-byte word (what unpack<S> takes): one 16-byte load, or
// element loads on unaligned rows and the ragged tail; zeros past `vocab` (masked by column
// later). Holding the raw words, not floats, halves the registers of a 16-bit row.
template <class S>
__device__ __forceinline__ uint4 load_row_vector(const S* row, int j, int vocab,
                                                 bool vector_ok) {
  constexpr int kVec = kVectorElements<S>;
  constexpr int kPerWord = kVec / 4;  // elements per 32-bit word: 2 (16-bit types) or 1 (fp32)
  const int first = j * kVec;
  if (vector_ok && first + kVec <= vocab) return __ldg(reinterpret_cast<const uint4*>(row) + j);
  uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if (first + k < vocab) {
      words[k / kPerWord] |= storage_bits(row[first + k]) << (32 / kPerWord * (k % kPerWord));
    }
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// The lane's statistics over its vectors (group_lane, + kLanes, ...), in column order, as
// slice_row_stats forms them. Two rare paths re-read logits (L1/L2-hot, not yet overwritten by an
// in-place gradient) instead of picking registers by a runtime index, which keeps them out of
// the unrolled register code (per vector they were most of its 2 million lines of PTX): the
// ragged tail, the row's last vector and so the lane's last, goes element by element through
// RowStats::add; rows with NaN or +Inf redo every element that way (the exact path).
template <bool kFull, bool kArgmax, int kLanes, class S, int kVectors, class Transform>
__device__ __forceinline__ RowStats<float> lane_row_stats(const uint4 (&raw)[kVectors],
                                                          int group_lane, const S* row,
                                                          int vocab, bool vector_ok,
                                                          const Transform& transform,
                                                          const float* class_weight) {
  constexpr int kVec = kVectorElements<S>;
  const int full_vectors = vocab / kVec;
  VectorRowStats<kFull, kArgmax> acc;
  // The first column this lane sees is its argmax until a value beats -inf (RowStats::add).
  if (group_lane < full_vectors) acc.stats.argmax = group_lane * kVec;
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    const int j = group_lane + kLanes * u;
    if (j < full_vectors) {
      add_vector_stats(acc, unpack<S>(raw[u]), j * kVec, true, kVec, transform, class_weight);
    }
  }
  const int tail = full_vectors * kVec;  // first column of the ragged tail
  if (tail < vocab && full_vectors >= group_lane && (full_vectors - group_lane) % kLanes == 0) {
    add_vector_stats(acc, unpack<S>(load_row_vector(row, full_vectors, vocab, vector_ok)), tail,
                     false, vocab - tail, transform, class_weight);
  }
  if (!acc.needs_exact_path()) return acc.stats;
  RowStats<float> exact;
  for (int j = group_lane; j * kVec < vocab; j += kLanes) {
    add_vector_exact(exact, unpack<S>(load_row_vector(row, j, vocab, vector_ok)), j * kVec,
                     vocab - j * kVec, transform, class_weight);
  }
  return exact;
}

// x̃_y if this lane holds column y (target_vector = y / kVec), else 0; with the precise
// common::Transform, as ce_rows_kernel reads it.
template <int kLanes, class S, int kVectors>
__device__ __forceinline__ float lane_target_logit(const uint4 (&raw)[kVectors], int group_lane,
                                                   int target,
                                                   const common::Transform<float>& transform) {
  constexpr int kVec = kVectorElements<S>;
  const int target_vector = target / kVec;
  const int target_k = static_cast<int>(target % kVec);
  float value = 0.0f;
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    if (group_lane + kLanes * u == target_vector) {
      const Vector<S> x = unpack<S>(raw[u]);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (k == target_k) value = transform.value(x.value[k]);
      }
    }
  }
  return value;
}

// The lane's part of ∂loss/∂x from the registers (ce_grad_vector), 16-byte stores.
template <bool kWeighted, int kLanes, class S, int kVectors, class Transform>
__device__ __forceinline__ void lane_gradient(const uint4 (&raw)[kVectors], int group_lane,
                                              int vocab, const Transform& transform,
                                              const CeGradRow<float>& row, int target,
                                              const float* class_weight, S* grad,
                                              bool grad_vector_ok) {
  constexpr int kVec = kVectorElements<S>;
  const float scaled_lse = row.lse * kLog2e;
  const int target_vector = target / kVec;
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    const int j = group_lane + kLanes * u;
    const int column = j * kVec;
    if (column < vocab) {
      const int target_k = j == target_vector ? static_cast<int>(target - column) : -1;
      const Vector<S> g =
          ce_grad_vector<kWeighted>(unpack<S>(raw[u]), transform, row, scaled_lse, target_k,
                                    class_weight, column, column + kVec <= vocab, vocab - column);
      store_vector(grad, j, vocab, grad_vector_ok, g);
    }
  }
}

__device__ __forceinline__ CeGradRow<float> broadcast(const CeGradRow<float>& row, int64_t target) {
  CeGradRow<float> all;
  all.lse = __shfl_sync(kAllLanes, row.lse, 0);
  all.target_coef = __shfl_sync(kAllLanes, row.target_coef, 0);
  all.smoothing_coef = __shfl_sync(kAllLanes, row.smoothing_coef, 0);
  all.prob_coef = __shfl_sync(kAllLanes, row.prob_coef, 0);
  all.target = target;
  return all;
}

// Registers: bounded so that the largest rows (64 registers of row) still run 16 warps per
// multiprocessor (128 registers), 8 vectors a lane 24 warps (80), 4 vectors 32 warps (64). The
// spills this leaves (docs/perf-notes.md decision 30) are in the every-option bodies; the plain
// statistics sweep has none and the plain gradient sweep reloads ≤ 14 4-byte values a row.
template <int kVectors>
inline constexpr int kMinBlocks = kVectors >= 16 ? 4 : kVectors >= 8 ? 6 : 8;

// kVectors: 16-byte vectors per lane; kWarps: warps per row (1, or 2 for the longest rows).
template <class S, int kVectors, int kWarps>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, kMinBlocks<kVectors>)
    ce_short_rows_kernel(const ShortRowsParams p) {
  constexpr int kLanes = 32 * kWarps;  // lanes of one row
  static_assert(kWarpsPerBlock % kWarps == 0, "whole rows per CTA");
  const CeRowsArgs& a = p.args;
  const CeRowOptions& o = a.options;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int group_warp = warp % kWarps;  // this warp's place in its row's pair
  const int group_lane = group_warp * 32 + lane;
  const int64_t row = int64_t{blockIdx.x} * (kWarpsPerBlock / kWarps) + warp / kWarps;
  if (row >= a.rows) return;  // the whole group leaves together
  const int64_t target = read_target(a.target, a.target_dtype, row);
  const bool valid = target != o.ignore_index;
  const bool in_range = target >= 0 && target < a.vocab;
  // Columns of a short row fit 32 bits (V ≤ 8192). With 64-bit column arithmetic the 16-bit
  // 16-vector instances spilled 700 / 1068 bytes (bf16 / fp16), with 32-bit 448 / 528; the fp32
  // and 4-vector instances moved the other way (20 → 340, 400 → 548), all in every-option bodies.
  const int vocab = static_cast<int>(a.vocab);
  const int y = in_range ? static_cast<int>(target) : -1;
  const bool want_gradient = a.grad != nullptr;
  S* grad = want_gradient ? static_cast<S*>(a.grad) + row * a.grad_row_stride : nullptr;

  // An ignored row reads nothing (common::IgnoredRow), a zero gradient.
  if (!valid) {
    if (group_lane == 0) write_ignored_row_outputs(a, row);
    if (want_gradient) {
      write_constant_row(grad, vocab, p.grad_vector_ok, 0.0f, group_lane, kLanes);
    }
    return;
  }

  // Every load of the row first (kVectors × 16 bytes per lane in flight), then the row's scalars.
  const S* row_logits = static_cast<const S*>(a.logits) + row * a.row_stride;
  uint4 raw[kVectors];
#pragma unroll
  for (int u = 0; u < kVectors; ++u) {
    raw[u] = load_row_vector(row_logits, group_lane + kLanes * u, vocab, p.logits_vector_ok);
  }
  const CeRowScalars scalars = load_ce_row_scalars(a, row, target, in_range);

  const CeConstants<float> c = make_ce_constants(o, a.vocab, a.totals);
  const float* class_weight = o.class_weight;
  // Entropy and label smoothing need the extra sums; the argmax only the outputs that report it.
  const bool full = a.entropy != nullptr || c.smoothing > 0;
  const bool want_argmax = a.row_correct != nullptr || a.argmax != nullptr;
  RowStats<float> stats;
  with_transform(c.transform, [&](const auto& transform) {
    const S* r = row_logits;
    const bool ok = p.logits_vector_ok;
    if (want_argmax) {
      stats = full ? lane_row_stats<true, true, kLanes>(raw, group_lane, r, vocab, ok,
                                                        transform, class_weight)
                   : lane_row_stats<false, true, kLanes>(raw, group_lane, r, vocab, ok,
                                                         transform, class_weight);
    } else {
      stats = full ? lane_row_stats<true, false, kLanes>(raw, group_lane, r, vocab, ok,
                                                         transform, class_weight)
                   : lane_row_stats<false, false, kLanes>(raw, group_lane, r, vocab, ok,
                                                          transform, class_weight);
    }
  });
  float target_logit = 0.0f;
  if (in_range) {
    const float mine = lane_target_logit<kLanes, S>(raw, group_lane, y, c.transform);
    // The lane of this warp at y's position (in the other warp of a pair it holds 0).
    target_logit = __shfl_sync(kAllLanes, mine, (y / kVectorElements<S>) % 32);
  }
  stats = warp_merge(stats);  // valid in lane 0

  if constexpr (kWarps > 1) {
    // The pair meets once: lane 0 of each warp publishes its partial, a named barrier of the
    // pair's 64 threads (ids 1, 2; 0 is __syncthreads'), then both merge the partials in warp
    // order (the same bits in both warps, as the cluster kernel's rank order).
    __shared__ SharedStorage<WarpPartial[kWarpsPerBlock]> partial_storage;
    WarpPartial* partials = partial_storage.get();
    if (lane == 0) partials[warp] = WarpPartial{stats, target_logit};
    asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / kWarps), "r"(kLanes) : "memory");
    if (lane == 0) {
      WarpPartial merged = partials[warp - group_warp];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        merged.stats.merge(partials[warp - group_warp + w].stats);
        merged.target_logit += partials[warp - group_warp + w].target_logit;  // one holds y
      }
      stats = merged.stats;
      target_logit = merged.target_logit;
    }
  }

  CeGradRow<float> grad_row{};
  if (lane == 0) {
    const float lse = stats.lse();
    if (group_lane == 0) {
      write_ce_row_outputs(a, c, row, target, in_range, scalars, stats, lse, target_logit);
    }
    if (want_gradient && in_range) grad_row = ce_row_gradient(a, c, lse, target, scalars);
  }
  if (!want_gradient) return;
  if (!in_range) {
    write_constant_row(grad, vocab, p.grad_vector_ok, quiet_nan(), group_lane, kLanes);
    return;
  }
  grad_row = broadcast(grad_row, target);
  const bool weighted = class_weight != nullptr && c.smoothing > 0;
  with_transform(c.transform, [&](const auto& transform) {
    if (weighted) {
      lane_gradient<true, kLanes>(raw, group_lane, vocab, transform, grad_row, y,
                                  class_weight, grad, p.grad_vector_ok);
    } else {
      lane_gradient<false, kLanes>(raw, group_lane, vocab, transform, grad_row, y,
                                   nullptr, grad, p.grad_vector_ok);
    }
  });
}

template <class S, int kVectors, int kWarps>
void launch(const ShortRowsParams& p, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kWarpsPerBlock / kWarps;
  const int64_t blocks = (p.args.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  ce_short_rows_kernel<S, kVectors, kWarps>
      <<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(p);
  XENT_CUDA_CHECK_LAUNCH();
}

// The smallest register array that holds the row: 4, 8 or 16 vectors per lane. Arrays of 1 and 2
// would save registers the 64-register bound of kMinBlocks<4> does not give back as warps, and
// each instance costs the build minutes (18 instances took 15 min of one core, 12 take ~2/3).
template <class S>
void launch_for_vocab(const ShortRowsParams& p, cudaStream_t stream) {
  constexpr int64_t kVec = kVectorElements<S>;
  const int64_t per_lane = ((p.args.vocab + kVec - 1) / kVec + 31) / 32;
  if (per_lane <= 4) return launch<S, 4, 1>(p, stream);
  if (per_lane <= 8) return launch<S, 8, 1>(p, stream);
  if (per_lane <= kMaxVectors) return launch<S, kMaxVectors, 1>(p, stream);
  launch<S, kMaxVectors, 2>(p, stream);
}

}  // namespace short_rows

// The launches for one logits dtype, each defined in its own translation unit.
void ce_short_rows_f32(const short_rows::ShortRowsParams& p, cudaStream_t stream);
void ce_short_rows_bf16(const short_rows::ShortRowsParams& p, cudaStream_t stream);
void ce_short_rows_f16(const short_rows::ShortRowsParams& p, cudaStream_t stream);

}  // namespace xent::cuda
