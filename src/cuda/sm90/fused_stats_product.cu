// The fused statistics product (fused_stats.hpp): x = h·Wᵀ by the persistent, warp-specialised
// CUTLASS sm_90a kernel of fused_product.cuh, whose epilogue reduces each tile to per-row tile
// partials: the logits never leave the SM. Statistics of x rounded to the operands' dtype (the
// default) take the epilogue warps of fused_epilogue_kernel.cuh (StatsWarpsEpilogue), those of
// the fp32 products the consumers' registers and quad shuffles (StatsEpilogue).
//
// This translation unit alone is compiled for sm_90a (wgmma has no sm_90 or portable form; see
// CMakeLists.txt); built for anything else, or without the CUTLASS headers, it is a stub whose
// fused_stats_product_built() is false. Eight kernels: the two epilogues for bf16 and f16, each
// plain and with per-column terms (a bias, class weights); softcap, scale and the target are
// runtime values.
#include "cuda/sm90/fused_stats.hpp"

#if defined(XENT_FUSED_SM90A)

#include <cfloat>

#include "common/ce_row.hpp"
#include "cuda/sm90/fused_epilogue_kernel.cuh"
#include "cuda/sm90/fused_product.cuh"
#include "cuda/rows/row_slice.cuh"
#include "cuda/rows/row_stats.cuh"

namespace xent::cuda {
namespace {

static_assert(fused::kTileColumns == kFusedTileColumns, "fused_stats.hpp tile width");

struct StatsEpilogueParams {
  float* partials = nullptr;
  int64_t tiles = 0;
  const void* target = nullptr;
  bool target_int64 = true;
  float logit_scale = 1, softcap = 0;
  bool extras = false;  // Σe·d, Σx̃ and the argmax too (entropy, smoothing, argmax, accuracy)
  const float* class_weight = nullptr;  // with extras: Σ w·x̃ in place of Σx̃
  fused::HalfVector bias;               // added to x (fused_product.cuh), or none
  // FusedStatsProduct::rounded_logits: x rounded to the operands' dtype first (1 bf16, 2 f16).
  int round_to = 0;
};

// Statistics of the kN values one thread holds of a row in a tile whose columns all lie inside
// the vocabulary, when they are ordinary (finite max and sums): the max by four fmaxf chains,
// e^(v−m) as 2^(v·log2(e) − m·log2(e)) on the ex2 unit (the row kernels' form, row_stats.cuh),
// four partial sums. kExtras also forms Σe·(v−m), Σv (entropy, label smoothing) and `where`, the
// index of the first value equal to the max (argmax, accuracy). About 4 instructions per value
// without extras, 8 with, against ~30 for the exact per-element path, whose code for 64 values
// per row, unrolled, also overflowed the instruction cache (decision 41, docs/archive/perf-notes.md).
// kWeighted (with kExtras): Σ weight_of(k)·v in place of Σv, the weight read per value (it
// differs per column, and a thread's 64 columns' weights would take 64 registers).
// False when something is not ordinary (NaN, ±Inf, or a part that is all -inf): the caller then
// runs exact_row_stats, which defines those cases as RowStats::add does.
template <bool kExtras, bool kWeighted, int kN, class WeightOf>
CUTLASS_DEVICE bool lean_row_stats(const float (&v)[kN], common::RowStats<float>& stats, int& where,
                                   WeightOf&& weight_of) {
  static_assert(kExtras || !kWeighted, "weighted sums are extras");
  static_assert(kN % 4 == 0, "four chains");
  float max4[4] = {-common::infinity<float>(), -common::infinity<float>(),
                   -common::infinity<float>(), -common::infinity<float>()};
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kN; ++k) max4[k % 4] = fmaxf(max4[k % 4], v[k]);  // fmaxf drops NaN
  const float m = fmaxf(fmaxf(max4[0], max4[1]), fmaxf(max4[2], max4[3]));
  if (!(m > -common::infinity<float>() && m < common::infinity<float>())) return false;
  const float m_log2e = m * kLog2e;
  float sum4[4] = {0, 0, 0, 0}, shift4[4] = {0, 0, 0, 0}, logits4[4] = {0, 0, 0, 0};
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kN; ++k) {
    const float e = fast_exp2(fmaf(v[k], kLog2e, -m_log2e));
    sum4[k % 4] += e;
    if constexpr (kExtras) {
      // A -inf value gives 0·-inf = NaN here, caught below.
      shift4[k % 4] = fmaf(e, v[k] - m, shift4[k % 4]);
      if constexpr (kWeighted) {
        logits4[k % 4] = fmaf(weight_of(k), v[k], logits4[k % 4]);
      } else {
        logits4[k % 4] += v[k];
      }
    }
  }
  stats.max = m;
  stats.sum_exp = (sum4[0] + sum4[1]) + (sum4[2] + sum4[3]);
  if (!(stats.sum_exp <= FLT_MAX)) return false;  // a NaN value (dropped by fmaxf) or overflow
  if constexpr (kExtras) {
    stats.sum_exp_shift = (shift4[0] + shift4[1]) + (shift4[2] + shift4[3]);
    if (stats.sum_exp_shift != stats.sum_exp_shift) return false;  // a -inf value
    stats.sum_logits = (logits4[0] + logits4[1]) + (logits4[2] + logits4[3]);
    stats.sum_weighted_logits = stats.sum_logits;
    where = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int k = kN - 1; k >= 0; --k) {
      if (v[k] == m) where = k;
    }
  }
  return true;
}

// The exact per-element statistics (RowStats::add's cases: NaN takes the argmax, -inf adds
// nothing), for the vocabulary's last, partial tile and for values lean_row_stats declines.
// Columns ≥ V enter no statistic. With class_weight, Σx̃ is Σ w·x̃ (as lean_row_stats<·, true>).
template <int kN, class ForEachValue>
CUTLASS_DEVICE void exact_row_stats(const float (&value)[kN], ForEachValue&& for_each_value,
                                    int cols, const float* class_weight,
                                    common::RowStats<float>& stats) {
  float max = -common::infinity<float>();
  int argmax = -1;
  for_each_value([&](int k, int col, float) {
    const float v = value[k];
    if (col < cols && (v > max || argmax < 0 || (v != v && max == max))) {
      max = v;
      argmax = col;
    }
  });
  stats = common::RowStats<float>();
  stats.max = max;
  stats.argmax = argmax;
  for_each_value([&](int k, int col, float) {
    const float v = value[k];
    if (col >= cols) return;
    stats.sum_logits += class_weight != nullptr ? __ldg(class_weight + col) * v : v;
    if (v != -common::infinity<float>()) {  // e^-inf = 0; v − max would be NaN
      const float d = v - max;
      const float e = ::exp2f(d * kLog2e);
      stats.sum_exp += e;
      stats.sum_exp_shift += e * d;
    }
  });
  stats.sum_weighted_logits = stats.sum_logits;
}

// The quad merge of lean statistics without extras: the quad's max, each lane's sum rescaled to
// it with one ex2, two shuffled sums (RowStats::merge would form two precise exponentials per
// round). Valid in every lane.
CUTLASS_DEVICE void quad_merge_lean(common::RowStats<float>& stats) {
  constexpr unsigned kAll = 0xffffffffu;
  float m = stats.max;
  m = fmaxf(m, __shfl_xor_sync(kAll, m, 1));
  m = fmaxf(m, __shfl_xor_sync(kAll, m, 2));
  float sum = stats.sum_exp * fast_exp2((stats.max - m) * kLog2e);
  sum += __shfl_xor_sync(kAll, sum, 1);
  sum += __shfl_xor_sync(kAll, sum, 2);
  stats.max = m;
  stats.sum_exp = sum;
}

// A tile partial of row `row` (kTilePartialWidth floats, FusedTileColumn's order), as 24 bytes on
// a 256-byte aligned base: three aligned 8-byte stores.
CUTLASS_DEVICE void store_partial(const StatsEpilogueParams& p, int row, int n_block,
                                  const common::RowStats<float>& stats, float target_logit) {
  float* record = p.partials + (static_cast<int64_t>(row) * p.tiles + n_block) * kTilePartialWidth;
  reinterpret_cast<float2*>(record)[0] = make_float2(stats.max, stats.sum_exp);
  reinterpret_cast<float2*>(record)[1] = make_float2(stats.sum_exp_shift, stats.sum_logits);
  reinterpret_cast<float2*>(record)[2] =
      make_float2(common::bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(stats.argmax))),
                  target_logit);
}

// The statistics epilogue: called once per output tile by each consumer thread with its
// accumulators (fused::OperatorEpilogue).
// kColumns: the kernel that takes per-column terms (a bias, class weights in the smoothing sum);
// the plain kernel's code carries neither (as the gradient product's forms, decision 100).
template <bool kColumns>
class StatsEpilogue : public fused::OperatorEpilogue<StatsEpilogueParams> {
 public:
  using OperatorEpilogue::OperatorEpilogue;

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK block_shape,
                                 BlockCoordMNKL block_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    // One row of a tile lives in the 4 lanes of a quad (fused::AccumulatorRows): the per-row
    // reduction is in registers, then two xor-shuffles.
    using Rows = fused::AccumulatorRows<FrgLayout, TiledMma>;
    constexpr int kValues = Rows::kValues;

    const int rows = static_cast<int>(get<0>(problem_shape_mnkl));
    const int cols = static_cast<int>(get<1>(problem_shape_mnkl));
    const int m_block = static_cast<int>(get<0>(block_coord_mnkl));
    const int n_block = static_cast<int>(get<1>(block_coord_mnkl));
    // The scheduler pads the tile grid to whole swizzle groups and clusters: tiles past the last
    // column tile (or past the last row: their rows fail `row < rows` below) hold no columns of
    // x and must write nothing (their partial would land in the next row's).
    if (n_block >= params_.tiles) return;
    const int row0 = m_block * size<0>(block_shape);
    const int col0 = n_block * size<1>(block_shape);
    // The last column tile of a vocabulary that is not a multiple of the tile holds columns ≥ V
    // (TMA fills them with zeros); only that tile checks columns per element.
    const bool whole_tile = col0 + static_cast<int>(size<1>(block_shape)) <= cols;

    // (m, n) of every accumulator value inside the tile, partitioned exactly like the values.
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thr_mma.partition_C(make_identity_tensor(take<0, 2>(block_shape)));
    CUTE_STATIC_ASSERT_V(size(coords) == size(accumulators));

    common::Transform<float> row_transform;
    row_transform.scale = params_.logit_scale;
    row_transform.softcap = params_.softcap;
    const bool quad_leader = (thread_idx & 3) == 0;

    // The softcap and the scale are resolved once per tile (row_stats.cuh's with_transform), so
    // each element's code holds only the transform it needs.
    with_transform(row_transform, [&](const auto& transform) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < Rows::kRows; ++r) {
        const int row = row0 + Rows::row_of(coords, r);
        int64_t y = -1;
        if (row < rows) {
          y = params_.target_int64 ? static_cast<const int64_t*>(params_.target)[row]
                                   : static_cast<const int32_t*>(params_.target)[row];
        }
        // Every value of this row the thread holds, in increasing column order: f(k, column, x).
        auto for_each_value = [&](auto&& f) {
          Rows::for_each_value(coords, accumulators, r,
                               [&](int k, int col, float x) { f(k, col0 + col, x); });
        };
        auto column_of = [&](int k) { return col0 + Rows::column_of(coords, k); };
        float value[kValues];
        for_each_value([&](int k, int, float x) { value[k] = x; });
        // A bias before the one rounding (fused_product.cuh's HalfVector).
        if (kColumns && params_.bias.values != nullptr) {
          CUTLASS_PRAGMA_UNROLL
          for (int k = 0; k < kValues; ++k) {
            const int col = column_of(k);
            value[k] += col < cols ? params_.bias[col] : 0.0f;
          }
        }
        fused::round_logits(value, params_.round_to);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kValues; ++k) value[k] = transform.value(value[k]);

        common::RowStats<float> stats;
        bool lean = false;
        // Null in the plain kernel, where the weighted sums then compile away.
        const float* class_weight = kColumns ? params_.class_weight : nullptr;
        if (whole_tile) {
          int where = 0;
          auto weight_of = [&](int k) { return __ldg(class_weight + column_of(k)); };
          if (!params_.extras) {
            lean = lean_row_stats<false, false>(value, stats, where, weight_of);
          } else if (class_weight != nullptr) {
            lean = lean_row_stats<true, true>(value, stats, where, weight_of);
          } else {
            lean = lean_row_stats<true, false>(value, stats, where, weight_of);
          }
          stats.argmax = params_.extras ? column_of(where) : col0;  // col0: never read
        }
        if (!lean) exact_row_stats(value, for_each_value, cols, class_weight, stats);
        float target_logit = 0;  // x̃_y in the one lane holding column y, else 0
        if (y >= col0 && y < col0 + static_cast<int64_t>(size<1>(block_shape)) && y < cols) {
          for_each_value([&](int k, int col, float) {
            if (col == y) target_logit = value[k];
          });
        }
        // The quad's four column quarters, merged into its first lane.
        if (__all_sync(0xffffffffu, lean) && !params_.extras) {
          quad_merge_lean(stats);
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int offset = 2; offset > 0; offset >>= 1) stats.merge(shuffle_down(stats, offset));
        }
        CUTLASS_PRAGMA_UNROLL
        for (int offset = 2; offset > 0; offset >>= 1) {
          target_logit += __shfl_down_sync(0xffffffffu, target_logit, offset);
        }
        if (quad_leader && row < rows) store_partial(params_, row, n_block, stats, target_logit);
      }
    });
  }
};
// The statistics epilogue on warps of their own (fused_epilogue_kernel.cuh), for statistics of x
// rounded to the operands' dtype (FusedStatsProduct::rounded_logits, which the staged tile is):
// the consumers stage each tile (a bias added before its one rounding) and go on to the next
// tile's mainloop, while the three epilogue warps reduce the staged rows to tile partials.
// StatsEpilogue runs the same reduction on the consumers after each mainloop, while the tensor
// cores wait, a large share of the product's time at small H (decision 109). A quarter-warp per
// row, two rows a quarter and eight a warp per pass: lane q of a row's eight reads chunks q,
// q + 8, q + 16 and q + 24 (32 values), the lean or exact per-value code of StatsEpilogue runs on
// them, and three levels of xor-shuffles merge the row, each shuffle serving four rows; a row per
// warp needed five levels per merge and was slower than the consumers (decisions 111 and 112).
// Unrounded statistics keep StatsEpilogue.
template <class S, bool kColumns>
class StatsWarpsEpilogue : public fused::OperatorEpilogue<StatsEpilogueParams> {
 public:
  using OperatorEpilogue::OperatorEpilogue;
  using Element = S;
  using Tile = fused::StagedTile<S>;
  struct SharedStorage {
    Tile tile;
  };
  using TensorStorage = SharedStorage;
  static constexpr int kLanesPerRow = 8, kRowsAtOnce = 32 / kLanesPerRow, kRowsPerLane = 2;
  static constexpr int kChunksPerLane = Tile::kColumns / 8 / kLanesPerRow;  // 16-byte chunks
  static constexpr int kValues = 8 * kChunksPerLane;                        // a lane's, per row
  // Each epilogue warp's rows of a tile: a third, rounded up to whole groups of four (at most 64:
  // the two prefetched targets a lane holds). Passes start at multiples of 8 entries, so none
  // straddles the two halves.
  static constexpr int kRowsPerWarp =
      ((Tile::kRows + fused::kEpilogueWarps - 1) / fused::kEpilogueWarps + kRowsAtOnce - 1) /
      kRowsAtOnce * kRowsAtOnce;
  static_assert(kRowsPerWarp <= 64 && 32 % (kRowsAtOnce * kRowsPerLane) == 0,
                "two targets per lane; a pass's entries in one half");

  // A bias joins each value before the consumers round it (x rounded once, fused_product.cuh);
  // the product spans the vocabulary from column 0.
  CUTLASS_DEVICE fused::HalfVector staged_bias(int64_t& first) const {
    first = 0;
    return kColumns ? params_.bias : fused::HalfVector{};
  }
  // The consumers form no rows themselves.
  CUTLASS_DEVICE bool shares(const fused::TileAt&) const { return false; }
  CUTLASS_DEVICE void prepare_own(const fused::TileAt&) {}
  CUTLASS_DEVICE void own_rows(const fused::TileAt&, SharedStorage&) const {}

  // The targets of the warp's rows, before the tile is waited for: lane i holds those of its
  // entries i and 32 + i, as a column of this product or −1 (none: ignored, or out of range).
  CUTLASS_DEVICE void prepare(const fused::TileAt& at) {
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int row = at.row0 + kRowsPerWarp * at.warp + 32 * half + at.lane;
      int64_t y = -1;
      if (32 * half + at.lane < kRowsPerWarp && row < at.rows) {
        y = params_.target_int64 ? __ldg(static_cast<const int64_t*>(params_.target) + row)
                                 : __ldg(static_cast<const int32_t*>(params_.target) + row);
      }
      target_[half] = y >= 0 && y < at.cols ? static_cast<int>(y) : -1;
    }
  }

  CUTLASS_DEVICE void rows(const fused::TileAt& at, SharedStorage& shared) const {
    const int first = kRowsPerWarp * at.warp;  // the warp's first row of the tile
    const int count = max(0, min(kRowsPerWarp, min(at.rows - at.row0, Tile::kRows) - first));
    common::Transform<float> row_transform;
    row_transform.scale = params_.logit_scale;
    row_transform.softcap = params_.softcap;
    with_transform(row_transform, [&](const auto& transform) {
      for (int i = 0; i < count; i += kRowsAtOnce * kRowsPerLane) {
        form_rows(at, shared.tile, transform, first, i, count);
      }
    });
  }

 private:
  // Entries i .. i + 7 of the warp's list, two per quarter-warp (entries i + g and i + 4 + g for
  // quarter g; those past count repeat the last, unstored): their chains of latencies interleave
  // on a warp that is alone on its scheduler.
  template <class Transform>
  CUTLASS_DEVICE void form_rows(const fused::TileAt& at, const Tile& tile,
                                const Transform& transform, int first, int i, int count) const {
    const StatsEpilogueParams& p = params_;
    const int group = at.lane / kLanesPerRow, q = at.lane % kLanesPerRow;
    // Value k of the lane is column 8·(q + 8·(k / 8)) + k % 8 of the tile.
    auto column_of = [&](int k) { return at.col0 + 8 * (q + kLanesPerRow * (k / 8)) + k % 8; };
    // The vocabulary's last, partial tile checks columns per value (exact_row_stats).
    const bool whole_tile = at.col0 + Tile::kColumns <= at.cols;
    const float* class_weight = kColumns ? p.class_weight : nullptr;
    int entry[kRowsPerLane];
    float value[kRowsPerLane][kValues];
    common::RowStats<float> stats[kRowsPerLane];
    bool lean[kRowsPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j) {
      entry[j] = min(i + kRowsAtOnce * j + group, count - 1);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChunksPerLane; ++c) {
        float part[8];
        fused::unpack_chunk<S>(tile.chunk(first + entry[j], q + kLanesPerRow * c), part);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; ++k) value[j][8 * c + k] = transform.value(part[k]);
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j) {
      lean[j] = false;
      if (whole_tile) {
        int where = 0;
        auto weight_of = [&](int k) { return __ldg(class_weight + column_of(k)); };
        if (!p.extras) {
          lean[j] = lean_row_stats<false, false>(value[j], stats[j], where, weight_of);
        } else if (class_weight != nullptr) {
          lean[j] = lean_row_stats<true, true>(value[j], stats[j], where, weight_of);
        } else {
          lean[j] = lean_row_stats<true, false>(value[j], stats[j], where, weight_of);
        }
        stats[j].argmax = p.extras ? column_of(where) : at.col0;  // col0: never read
      }
      if (!lean[j]) {
        auto for_each_value = [&](auto&& f) {
          CUTLASS_PRAGMA_UNROLL
          for (int k = 0; k < kValues; ++k) f(k, column_of(k), value[j][k]);
        };
        exact_row_stats(value[j], for_each_value, at.cols, class_weight, stats[j]);
      }
    }
    // Each row's eight parts, merged within its quarter-warp: lean parts without extras by the
    // butterflies of their max and rescaled sums (one ex2 a lane), any other by RowStats's merge
    // (its NaN, ±Inf and argmax rules) into the quarter's first lane.
    if (__all_sync(~0u, lean[0] && lean[kRowsPerLane - 1]) && !p.extras) {
      float m[kRowsPerLane], sum[kRowsPerLane];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerLane; ++j) m[j] = stats[j].max;
      CUTLASS_PRAGMA_UNROLL
      for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kRowsPerLane; ++j)
          m[j] = fmaxf(m[j], __shfl_xor_sync(~0u, m[j], offset));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerLane; ++j) {
        sum[j] = stats[j].sum_exp * fast_exp2((stats[j].max - m[j]) * kLog2e);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kRowsPerLane; ++j) sum[j] += __shfl_xor_sync(~0u, sum[j], offset);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerLane; ++j) stats[j].max = m[j], stats[j].sum_exp = sum[j];
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kRowsPerLane; ++j) stats[j].merge(shuffle_down(stats[j], offset));
      }
    }
    // Each row's target, from the lane that prefetched it (the pass's entries lie in one half),
    // and its value read back from the staged tile (x̃_y where y is one of the tile's columns).
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j) {
      const int y = __shfl_sync(~0u, i < 32 ? target_[0] : target_[1], entry[j] % 32) - at.col0;
      if (q != 0 || i + kRowsAtOnce * j + group >= count) continue;
      float target_logit = 0.0f;
      if (y >= 0 && y < Tile::kColumns) {
        target_logit =
            transform.value(static_cast<float>(tile.values[Tile::offset(first + entry[j], y)]));
      }
      store_partial(p, at.row0 + first + entry[j], at.col0 / Tile::kColumns, stats[j],
                    target_logit);
    }
  }

  int target_[2] = {-1, -1};
};

static_assert(kTileMax == 0 && kTileSumExp == 1 && kTileSumExpShift == 2 && kTileSumLogits == 3 &&
                  kTileArgmax == 4 && kTileTargetLogit == 5 && kTilePartialWidth == 6,
              "the epilogue's stores follow the FusedTileColumn order");

template <class Element>
bool launch(const FusedStatsProduct& p, cudaStream_t stream) {
  StatsEpilogueParams epilogue;
  epilogue.partials = p.partials;
  epilogue.tiles = p.tiles;
  epilogue.target = p.target;
  epilogue.target_int64 = p.target_int64;
  epilogue.logit_scale = p.logit_scale;
  epilogue.softcap = p.softcap;
  epilogue.extras = p.extras;
  epilogue.class_weight = p.extras ? p.class_weight : nullptr;
  epilogue.bias = fused::HalfVector{static_cast<const uint16_t*>(p.bias), p.dtype == DType::f16};
  epilogue.round_to = !p.rounded_logits ? 0 : p.dtype == DType::bf16 ? 1 : 2;
  const fused::Operands operands{p.hidden, p.hidden_stride, p.weight,     p.weight_stride,
                                 p.rows,   p.vocab,         p.hidden_size};
  const bool columns = epilogue.class_weight != nullptr || epilogue.bias.values != nullptr;
  // The staged tile is x rounded as these statistics ask.
  if (p.rounded_logits) {
    return columns ? fused::launch<Element, StatsWarpsEpilogue<Element, true>,
                                   fused::EpilogueWarpsKernel>(operands, epilogue,
                                                               "linear_ce_forward", stream)
                   : fused::launch<Element, StatsWarpsEpilogue<Element, false>,
                                   fused::EpilogueWarpsKernel>(operands, epilogue,
                                                               "linear_ce_forward", stream);
  }
  if (columns) {
    return fused::launch<Element, StatsEpilogue<true>>(operands, epilogue, "linear_ce_forward",
                                                       stream);
  }
  return fused::launch<Element, StatsEpilogue<false>>(operands, epilogue, "linear_ce_forward",
                                                      stream);
}

}  // namespace

bool fused_stats_product_built() { return true; }

bool fused_stats_product(const FusedStatsProduct& product, cudaStream_t stream) {
  switch (product.dtype) {
    case DType::bf16:
      return launch<cutlass::bfloat16_t>(product, stream);
    case DType::f16:
      return launch<cutlass::half_t>(product, stream);
    default:
      return false;
  }
}

}  // namespace xent::cuda

#else  // not built for sm_90a, or no CUTLASS headers

namespace xent::cuda {

bool fused_stats_product_built() { return false; }

bool fused_stats_product(const FusedStatsProduct&, cudaStream_t) { return false; }

}  // namespace xent::cuda

#endif
