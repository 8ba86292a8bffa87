// The fused gradient product (fused_grad.cuh): x = h·W_blockᵀ by the persistent, warp-specialised
// CUTLASS sm_90a mainloop of fused_product.cuh in the kernel of fused_epilogue_kernel.cuh, whose
// epilogue warps form ∂loss/∂x of each value of the staged tile from its row's lse and store the
// gradient in the operands' dtype: the block's logits never leave the SM.
//
// Compiled for sm_90a with the CUTLASS headers only (CMakeLists.txt); elsewhere a stub whose
// fused_grad_product_built() is false. Kernels for bf16 and f16, each in the gradient form plain
// and with per-column terms (GradForm), and the reference form in bf16, plain and with the row
// statistics; the options, the transform and the entropy term are run-time values resolved once
// per tile.
#include "cuda/sm90/fused_grad.cuh"
#include "cuda/plan/linear_ce_plan.hpp"
#include "cuda/test_hook.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace xent::cuda {
namespace {
std::atomic<int64_t> fused_grad_launches{0};
}  // namespace
}  // namespace xent::cuda

#if defined(XENT_FUSED_SM90A)

#include "cuda/sm90/fused_epilogue_kernel.cuh"
#include "cuda/sm90/fused_product.cuh"
#include "cuda/rows/row_stats.cuh"

namespace xent::cuda {
namespace {

struct GradEpilogueParams {
  const CeGradRecord* records = nullptr;
  void* grad = nullptr;
  int64_t grad_stride = 0;
  int64_t first_column = 0;
  float logit_scale = 1, softcap = 0;
  bool entropy = false;
  // Per column of V, where the smoothing term carries class weights (FusedGradProduct), or null.
  const float* class_weight = nullptr;
  fused::HalfVector bias;  // per column of V, added by the consumers as they stage x, or none
  bool pairs = false;    // every pair of columns (2k, 2k+1) of every row is one aligned 4-byte word
  bool vectors = false;  // every row starts 16-byte aligned (8 columns of S)
  // Rows of each consumer warp's 16 that the consumer warp forms itself (0, 4 or 8; the
  // epilogue warps take the others): fused_grad_own_rows.
  int own_rows = 0;
  // The reference form's sums and target logits (FusedGradProduct), or null.
  float* partials = nullptr;
  int64_t partial_stride = 0;
  float* target_logits = nullptr;
  // Its statistics form's Σ e^(x̃ − r)·(x̃ − r), max x̃ and that column, beside `partials`.
  float* shift_partials = nullptr;
  float* max_partials = nullptr;
  int32_t* argmax_partials = nullptr;
};

// The gradient epilogue on the epilogue warps (fused_epilogue_kernel.cuh): the consumers stage
// each tile's x, rounded to S, in shared memory. The tile's rows are split: each consumer warp
// forms the first own_of(tile) of the 16 rows it staged (own_rows, 0 unless forced; most of them
// on the CTA's last tile, which no mainloop follows),
// and the epilogue warps the others, as one list in row order of which each warp takes a run of
// rows_per_warp(own) (a multiple of kRowsAtOnce, so that rows formed together lie in one consumer
// warp's 16). Each lane holds 8 adjacent columns (one 16-byte chunk), forms
// their gradient (ce_block_grad, as the block kernel does) and stores it in one 16-byte vector
// wherever the rows are aligned. The records of a warp's rows are prefetched by its lanes before
// the tile is waited for and stored to the warp's slots in shared memory once it has arrived;
// each row's record is then one broadcast load.
// Each form is a kernel of its own (GradForm). The reference form (FusedGradProduct::partials):
// in one kernel with the gradient form, ptxas allocated registers for the union of both
// epilogues and spilled (176 bytes of stack), which doubled the product's time at H = 768. The
// gradient form with per-column terms (class weights under smoothing, a bias): in the plain
// kernel as compile-time variants they left its code unchanged, yet slowed it (decision 100). The
// reference form with the row statistics (entropy, argmax) likewise, so the plain one carries
// none of their registers.
enum class GradForm { gradient, gradient_columns, reference, reference_statistics };

template <class S, GradForm kForm>
class GradEpilogue : public fused::OperatorEpilogue<GradEpilogueParams> {
  static constexpr bool kStatistics = kForm == GradForm::reference_statistics;
  static constexpr bool kReference = kForm == GradForm::reference || kStatistics;
  static constexpr bool kColumns = kForm == GradForm::gradient_columns;

 public:
  using OperatorEpilogue::OperatorEpilogue;
  // The staged tile's type (the consumers' hand-over, not an output): f16 for the reference
  // forms, whose every value comes from it (11 significant bits of x where bf16 keeps 8, at the
  // same cost; decision 114), S for the gradient forms, whose records' lse came from logits
  // rounded to S (the cuBLASLt path's or the statistics product's).
  using Element = std::conditional_t<kReference, cutlass::half_t, S>;
  using Tile = fused::StagedTile<Element>;
  static constexpr int kConsumerWarps = 8, kWarpRows = Tile::kRows / kConsumerWarps;
  // On a CTA's last tile no mainloop follows, so the consumers take 12 of their 16 rows (the
  // epilogue warps 32 rows, as many groups of kRowsAtOnce each as a consumer warp's 12).
  static constexpr int kLastTileOwnRows = 12;
  static constexpr int kMaxOwnRows = kLastTileOwnRows;
  // Rows formed together: their loads, exponentials and stores interleave, where one row at a
  // time left each row's chain of latencies (shuffle, shared load, ex2, store) exposed on a
  // warp that is alone on its scheduler.
  static constexpr int kRowsAtOnce = 4;
  static constexpr int kMaxRowsPerWarp =
      ((Tile::kRows + fused::kEpilogueWarps - 1) / fused::kEpilogueWarps + kRowsAtOnce - 1) /
      kRowsAtOnce * kRowsAtOnce;
  static_assert(kMaxRowsPerWarp <= 64, "two records per lane");
  struct SharedStorage {
    Tile tile;
    CeGradRecord records[fused::kEpilogueWarps][kMaxRowsPerWarp];  // each epilogue warp's rows
    CeGradRecord own_records[kConsumerWarps][kMaxOwnRows];         // each consumer warp's share
  };
  using TensorStorage = SharedStorage;

  // The bias the consumers add before they round the tile (fused_epilogue_kernel.cuh): only in
  // the kernel with per-column terms, whose plain code then carries none of it.
  CUTLASS_DEVICE fused::HalfVector staged_bias(int64_t& first) const {
    first = params_.first_column;
    return kColumns ? params_.bias : fused::HalfVector{};
  }
  // Rows of each consumer warp's 16 that it forms itself on this tile (both sides ask).
  CUTLASS_DEVICE int own_of(const fused::TileAt& at) const {
    return at.last ? kLastTileOwnRows : params_.own_rows;
  }
  CUTLASS_DEVICE bool shares(const fused::TileAt& at) const { return own_of(at) > 0; }

  CUTLASS_DEVICE void prepare(const fused::TileAt& at) {
    // Lanes past the warp's rows load its last row again (unconditional loads keep record_ in
    // registers; those lanes' records are never stored).
    const int own = own_of(at), per_warp = rows_per_warp(own);
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int within = min(32 * half + at.lane, per_warp - 1);
      const int row = min(at.row0 + others_row(own, per_warp * at.warp + within), at.rows - 1);
      load_record(row, record_[half]);
    }
  }

  CUTLASS_DEVICE void rows(const fused::TileAt& at, SharedStorage& shared) const {
    const int own = own_of(at), per_warp = rows_per_warp(own);
    const int first = per_warp * at.warp;  // the warp's first row in the epilogue warps' list
    const int count = max(0, min(per_warp, others_in(own, at.rows - at.row0) - first));
    form_prefetched<kReference && !kStatistics ? kReferenceRows : kGradientRows>(
        at, shared.tile, shared.records[at.warp], count, others_row(own, first), own);
  }

  CUTLASS_DEVICE void prepare_own(const fused::TileAt& at) {
    if (at.lane < own_of(at)) {
      load_record(min(at.row0 + kWarpRows * at.warp + at.lane, at.rows - 1), record_[0]);
    }
  }

  // The consumer warp's own rows, 16·warp .. 16·warp + own_of(at) − 1: staged by this warp, so a
  // __syncwarp orders them; the epilogue warps never read them.
  CUTLASS_DEVICE void own_rows(const fused::TileAt& at, SharedStorage& shared) const {
    const int first = kWarpRows * at.warp;
    const int count = max(0, min(own_of(at), at.rows - at.row0 - first));
    form_prefetched<kRowsAtOnce>(at, shared.tile, shared.own_records[at.warp], count, first, 0);
  }

 private:
  // The epilogue warps' rows per warp: their share of the tile, rounded up to kRowsAtOnce.
  CUTLASS_DEVICE static int rows_per_warp(int own) {
    const int others = kConsumerWarps * (kWarpRows - own);
    const int per_warp = (others + fused::kEpilogueWarps - 1) / fused::kEpilogueWarps;
    return (per_warp + kRowsAtOnce - 1) / kRowsAtOnce * kRowsAtOnce;
  }
  // Row of the tile of entry j of the epilogue warps' list (each consumer warp's 16 rows but its
  // first `own`).
  CUTLASS_DEVICE static int others_row(int own, int j) {
    const int others = kWarpRows - own;
    return kWarpRows * (j / others) + own + j % others;
  }
  // How many entries of that list lie in the first `valid` rows of the tile.
  CUTLASS_DEVICE static int others_in(int own, int valid) {
    valid = min(valid, Tile::kRows);
    const int others = kWarpRows - own;
    return valid / kWarpRows * others + max(0, valid % kWarpRows - own);
  }

  CUTLASS_DEVICE void load_record(int row, CeGradRecord& record) const {
    const float4* from = reinterpret_cast<const float4*>(params_.records + row);
    record.coefs = __ldg(from);
    record.more = __ldg(from + 1);
  }

  // The prefetched records of the warp's `count` rows (lane i holds those of entries i and
  // 32 + i) into its slots in shared memory, then the rows' gradient (form_rows).
  template <int kMostRows>
  CUTLASS_DEVICE void form_prefetched(const fused::TileAt& at, const Tile& tile,
                                      CeGradRecord* slots, int count, int first_row,
                                      int skipped) const {
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int within = 32 * half + at.lane;
      if (within < count) slots[within] = record_[half];
    }
    __syncwarp();
    form_rows<kMostRows>(at, tile, slots, count, first_row, skipped);
    __syncwarp();  // the rows and slots are rewritten for the next tile
  }

  // The gradient of `count` rows with their records at records[i]: entry 0 is row first_row of
  // the tile, and the rows go on in groups of kRowsAtOnce consecutive rows, stepping over the
  // first `skipped` rows of each consumer warp's 16 (the rows that warp forms itself: 0 for a
  // consumer warp's own list, which never leaves its 16). Walked by adding, where each group's
  // row by others_row cost a division by a run-time divisor (≈ 25 instructions a group).
  CUTLASS_DEVICE static int next_group_row(int row, int skipped) {
    row += kRowsAtOnce;
    return row % kWarpRows == 0 ? row + skipped : row;
  }
  // The tile row of entry r of a group: row_i + r for the first four, second + r − 4 after.
  CUTLASS_DEVICE static int group_row(int r, int row_i, int second) {
    return r < kRowsAtOnce ? row_i + r : second + r - kRowsAtOnce;
  }
  // kMostRows: the largest group (kReferenceRows or kGradientRows on the epilogue warps; the
  // consumers' own rows go in groups of kRowsAtOnce).
  template <int kMostRows>
  CUTLASS_DEVICE void form_rows(const fused::TileAt& at, const Tile& tile,
                                const CeGradRecord* records, int count, int first_row,
                                int skipped) const {
    const GradEpilogueParams& a = params_;
    // 16-byte stores where every lane's chunk lies in the block (all but a block's last tile).
    const bool vectors = a.vectors && __all_sync(~0u, at.col0 + 8 * at.lane + 8 <= at.cols);
    common::Transform<float> row_transform;
    row_transform.scale = a.logit_scale;
    row_transform.softcap = a.softcap;
    with_transform(row_transform, [&](const auto& transform) {
      // form(rows, row, second, i) for each group of the list: entries i .. i + rows − 1, tile
      // rows row .. row + 3 and (eight rows) second .. second + 3. Groups of kMostRows while
      // the list has them, then of four (rows past count repeat the last, unstored).
      auto walk = [&](auto form) {
        int row = first_row, i = 0;
        auto groups = [&](auto rows, int end) {
          constexpr int kRows = decltype(rows)::value;
          for (; i + kRows <= end; i += kRows) {
            const int second = next_group_row(row, skipped);
            form(rows, row, second, i);
            row = kRows == kRowsAtOnce ? second : next_group_row(second, skipped);
          }
        };
        if constexpr (kMostRows != kRowsAtOnce) {
          groups(std::integral_constant<int, kMostRows>{}, count);
        }
        groups(std::integral_constant<int, kRowsAtOnce>{},
               (count + kRowsAtOnce - 1) / kRowsAtOnce * kRowsAtOnce);
      };
      if constexpr (kReference) {
        walk([&](auto rows, int row, int second, int i) {
          constexpr int kRows = decltype(rows)::value;
          auto form = [&](auto full) {
            constexpr bool kFull = decltype(full)::value;
            if (vectors) {
              reference_rows_at_once<true, kRows, kFull>(at, tile, records, transform, row, second,
                                                         i, count);
            } else {
              reference_rows_at_once<false, kRows, kFull>(at, tile, records, transform, row, second,
                                                          i, count);
            }
          };
          // Groups of eight lie within the list (walk takes them while it has eight); a group
          // of four does unless it is the list's last and runs past it.
          if constexpr (kRows != kRowsAtOnce) {
            form(std::true_type{});
          } else if (i + kRows <= count) {
            form(std::true_type{});
          } else {
            form(std::false_type{});
          }
        });
      } else {
        // Each run-time switch as a compile-time one, so the common code carries none of them.
        auto dispatch = [](bool on, auto then) {
          if (on) {
            then(std::true_type{});
          } else {
            then(std::false_type{});
          }
        };
        // The class weights of the lane's 8 columns (1 unless the smoothing term carries them),
        // the same for every row of the tile: loaded once per tile, in the kernel with
        // per-column terms only. (Its bias is in the staged tile already: staged_bias.)
        float weight[8];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; ++k) {
          weight[k] = 1.0f;
          if constexpr (kColumns) {
            const int column = at.col0 + 8 * at.lane + k;
            if (column < at.cols && a.class_weight != nullptr) {
              weight[k] = __ldg(a.class_weight + a.first_column + column);
            }
          }
        }
        dispatch(a.entropy, [&](auto entropy) {
          dispatch(vectors, [&](auto vector_stores) {
            walk([&](auto rows, int row, int second, int i) {
              rows_at_once<decltype(entropy)::value, decltype(vector_stores)::value,
                           decltype(rows)::value>(at, tile, records, transform, weight, row, second,
                                                  i, count);
            });
          });
        });
      }
    });
  }

  // Entries i + r (r < kRows, those < count): rows row_i + r of the tile (r < 4) and second +
  // r − 4. With kColumns the smoothing term takes `weight`, the lane's columns' class weights
  // (each 1 where the call has none).
  template <bool kEntropy, bool kVectors, int kRows, class Transform>
  CUTLASS_DEVICE void rows_at_once(const fused::TileAt& at, const Tile& tile,
                                   const CeGradRecord* records, const Transform& transform,
                                   const float (&weight)[8], int row_i, int second, int i,
                                   int count) const {
    static_assert(kRows == kRowsAtOnce || kRows == 2 * kRowsAtOnce, "one or two groups");
    const GradEpilogueParams& a = params_;
    auto tile_row = [&](int r) { return group_row(r, row_i, second); };
    float value[kRows][8];
    CeBlockRow block_row[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int within = min(i + r, count - 1);  // a row past the last repeats it, unstored
      block_row[r] = block_row_of(records[within], a.first_column + at.col0);
      fused::unpack_chunk<Element>(tile.chunk(tile_row(within - i), at.lane), value[r]);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Everything but the target's lane is uniform across the warp (one row per r). A row's
      // target lies in one of V / 256 tiles: its value is formed again with the target term
      // only there, by the lane holding it; the common path has no compare.
      const CeBlockRow& row = block_row[r];
      const int64_t target = row.target_column;
      const bool tile_holds_target = target >= 0 && target < Tile::kColumns;
      const int target_k =
          tile_holds_target && (target >> 3) == at.lane ? static_cast<int>(target & 7) : -1;
      float target_logit = 0, target_weight = 1.0f;
      if (tile_holds_target) {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; ++k) {
          if (k == target_k) {
            target_logit = value[r][k];
            if constexpr (kColumns) target_weight = weight[k];
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 8; ++k) {
        value[r][k] = ce_block_grad<kEntropy>(row, transform, value[r][k], false,
                                              kColumns ? weight[k] : 1.0f);
      }
      if (tile_holds_target) {
        const float target_grad =
            ce_block_grad<kEntropy>(row, transform, target_logit, true, target_weight);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; ++k) {
          if (k == target_k) value[r][k] = target_grad;
        }
      }
      // An ignored row's gradient is 0, a row with its target outside [0, V) NaN (docs/semantics.md §1).
      if (!row.valid || !row.in_range) {
        const float fill = row.valid ? quiet_nan() : 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; ++k) value[r][k] = fill;
      }
    }
    store_rows<kVectors, kRows>(at, value, row_i, i, count, second);
  }

  // The reference form (FusedGradProduct::partials): entries i + r (r < kReferenceRows, those <
  // count), rows row_i + r of the tile, as rows_at_once with a record of coefficients (1, 0, 0),
  // whose gradient is p·slope with p = e^(x̃ − r) (ce_block_grad with those coefficients, the
  // common path without its target or smoothing terms); besides, each row's Σ p over the tile's
  // columns and, by the lane holding the row's target, its raw logit. No fill and no test of
  // the row's state per value: a row outside the path (ignored, or its target outside [0, V))
  // has the reference +∞ (reference_records_kernel), so its p is 0 wherever x̃ is finite or
  // −∞, and NaN (in its Σ too) only where x̃ is NaN or +∞; the finish sends such rows to the
  // fallback, which writes them again (linear_reference.cu). The per-value select of the fill
  // was 36 of the 420 instructions of a four-row group (decision 88).
  // Eight rows at once where the warp has them (two groups of next_group_row: rows row_i ..
  // row_i + 3 and second .. second + 3), else four: with the registers of decision 92 the
  // eight rows' chains of latencies interleave on a warp that is alone on its scheduler.
  static constexpr int kReferenceRows = 2 * kRowsAtOnce;
  // The gradient form keeps four: eight were slower (decision 92), its rows' records being twice
  // the reference's. So does
  // the statistics form, whose three more sums per row would not fit eight rows' registers.
  static constexpr int kGradientRows = kRowsAtOnce;
  // kFull: entries i .. i + kRows − 1 all lie in the list (i + kRows <= count), so no row
  // repeats the last and none goes unstored: each row's record, tile row and staged chunk are
  // then a constant offset from its group's (StagedTile::group_chunk), where the general form
  // spent ≈ 15 instructions a row on them (decision 107).
  template <bool kVectors, int kRows, bool kFull = false, class Transform>
  CUTLASS_DEVICE void reference_rows_at_once(const fused::TileAt& at, const Tile& tile,
                                             const CeGradRecord* records,
                                             const Transform& transform, int row_i, int second,
                                             int i, int count) const {
    static_assert(kRows == kRowsAtOnce || kRows == 2 * kRowsAtOnce, "one or two groups");
    const GradEpilogueParams& a = params_;
    auto tile_row = [&](int r) { return group_row(r, row_i, second); };
    auto in_list = [&](int r) { return kFull || i + r < count; };
    float value[kRows][8];
    float sum[kRows];
    // The statistics form's per-row Σ p·(x̃ − r), largest x̃ and its column (V's).
    float shift[kRows], best[kRows];
    int best_column[kRows];
    const int column = at.col0 + 8 * at.lane;  // the lane's first column within the block
    // In 32 bits: a record's target is a 32-bit integer (CeGradRecord), and so is a column.
    const int first_column = static_cast<int>(a.first_column) + at.col0;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // A row past the last repeats it, unstored.
      const int within = kFull ? i + r : min(i + r, count - 1);
      const CeGradRecord& record = records[within];
      if constexpr (kFull) {
        fused::unpack_chunk<Element>(r < kRowsAtOnce
                                         ? tile.group_chunk(row_i, r, at.lane)
                                         : tile.group_chunk(second, r - kRowsAtOnce, at.lane),
                                     value[r]);
      } else {
        fused::unpack_chunk<Element>(tile.chunk(tile_row(within - i), at.lane), value[r]);
      }
      // The target's logit read back from the staged tile by the lane that holds it: picking it
      // out of value[r] by a run-time index put the array in local memory (spills, decision 85).
      // Rows outside the path may store theirs too: the finish reads it only for rows inside.
      // The lane's columns are 8·lane .. 8·lane + 7 of the tile, so one unsigned compare tests
      // both that the target lies in the tile and that it is the lane's.
      const int target = __float_as_int(record.more.x) - first_column;
      if (static_cast<unsigned>(target) - 8u * static_cast<unsigned>(at.lane) < 8u && in_list(r)) {
        a.target_logits[at.row0 + tile_row(r)] =
            static_cast<float>(tile.values[Tile::offset(tile_row(r), target)]);
      }
      const float scaled_reference = record.coefs.x * kLog2e;  // the record's lse slot
      sum[r] = 0.0f;
      if constexpr (kStatistics) {
        shift[r] = 0.0f;
        best[r] = -INFINITY;
        best_column[r] = -1;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 8; ++k) {
        const float x = value[r][k];
        const float v = transform.value(x);
        const float p = fast_exp2(fmaf(v, kLog2e, -scaled_reference));
        // Columns past the product's last (a ragged last tile) hold x of zero-filled W rows.
        if (kVectors || column + k < at.cols) {
          sum[r] += p;
          if constexpr (kStatistics) {
            // p = 0 where v is −∞ or the reference +∞: no term (0·∞ would be NaN).
            if (p > 0.0f) shift[r] = fmaf(p, v - record.coefs.x, shift[r]);
            // The lane's columns ascend: the first NaN, else the first of the largest.
            if (best_column[r] < 0 || v > best[r] || (v != v && best[r] == best[r])) {
              best[r] = v;
              best_column[r] = first_column + 8 * at.lane + k;
            }
          }
        }
        value[r][k] = p * transform.slope(x);
      }
    }
    // The warp's Σ of each row: lanes kLanesPerRow·r .. of row r end with it (sum_of_rows).
    constexpr int kLanesPerRow = 32 / kRows;
    const float row_sum = sum_of_rows(sum, at.lane);
    float row_shift = 0.0f, row_best = 0.0f;
    int row_best_column = -1;
    if constexpr (kStatistics) {
      row_shift = sum_of_rows(shift, at.lane);
      best_of_rows(best, best_column, at.lane, row_best, row_best_column);
    }
    const int r = at.lane / kLanesPerRow;
    if (at.lane % kLanesPerRow == 0 && in_list(r)) {
      const int64_t tile_index = (a.first_column + at.col0) / Tile::kColumns;
      const int64_t at_row =
          static_cast<int64_t>(at.row0 + tile_row(r)) * a.partial_stride + tile_index;
      a.partials[at_row] = row_sum;
      if constexpr (kStatistics) {
        a.shift_partials[at_row] = row_shift;
        a.max_partials[at_row] = row_best;
        a.argmax_partials[at_row] = row_best_column;
      }
    }
    store_rows<kVectors, kRows>(at, value, row_i, kFull ? 0 : i, kFull ? kRows : count, second);
  }

  // The warp's largest value of each row and its column, in the lanes sum_of_rows leaves each
  // row's sum in, by the same exchanges.
  template <int kRows>
  CUTLASS_DEVICE static void best_of_rows(const float (&best)[kRows], const int (&column)[kRows],
                                          int lane, float& row_best, int& row_column) {
    float part[kRows];
    int part_column[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) part[r] = best[r], part_column[r] = column[r];
    auto take = [](float& into, int& into_column, float other, int other_column) {
      if (common::argmax_wins(other, other_column, into, into_column)) {
        into = other, into_column = other_column;
      }
    };
    int offset = 16;
    CUTLASS_PRAGMA_UNROLL
    for (int kept = kRows / 2; kept >= 1; kept /= 2, offset /= 2) {
      const bool upper = (lane & offset) != 0;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kept; ++j) {
        float keep = upper ? part[j + kept] : part[j];
        int keep_column = upper ? part_column[j + kept] : part_column[j];
        const float give = upper ? part[j] : part[j + kept];
        const int give_column = upper ? part_column[j] : part_column[j + kept];
        take(keep, keep_column, __shfl_xor_sync(~0u, give, offset),
             __shfl_xor_sync(~0u, give_column, offset));
        part[j] = keep, part_column[j] = keep_column;
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (; offset > 0; offset /= 2) {
      take(part[0], part_column[0], __shfl_xor_sync(~0u, part[0], offset),
           __shfl_xor_sync(~0u, part_column[0], offset));
    }
    row_best = part[0];
    row_column = part_column[0];
  }

  // The warp's Σ of each of 2, 4 or 8 rows in 5, 6 or 9 shuffles where butterflies take 10, 20
  // or 40: the halves of the warp 16 lanes apart swap the rows they do not keep, then lanes 8
  // apart (with four rows or more), then 4 apart (eight), then a butterfly over the lanes left.
  // Lanes (32 / rows)·r .. end with row r's.
  template <int kRows>
  CUTLASS_DEVICE static float sum_of_rows(const float (&sum)[kRows], int lane) {
    static_assert(kRows == 2 || kRows == 4 || kRows == 8, "two, four or eight rows");
    float part[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) part[r] = sum[r];
    int offset = 16;
    CUTLASS_PRAGMA_UNROLL
    for (int kept = kRows / 2; kept >= 1; kept /= 2, offset /= 2) {
      const bool upper = (lane & offset) != 0;  // keeps rows kept .. 2·kept − 1 of part
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kept; ++j) {
        const float keep = upper ? part[j + kept] : part[j];
        const float give = upper ? part[j] : part[j + kept];
        part[j] = keep + __shfl_xor_sync(~0u, give, offset);
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (; offset > 0; offset /= 2) part[0] += __shfl_xor_sync(~0u, part[0], offset);
    return part[0];
  }

  // Stores entries i + r (r < kRows, those < count), rows row_i + r of the tile (r < 4) and
  // second + r − 4 (eight rows of the reference form): the lane's 8 columns.
  template <bool kVectors, int kRows = kRowsAtOnce>
  CUTLASS_DEVICE void store_rows(const fused::TileAt& at, const float (&value)[kRows][8], int row_i,
                                 int i, int count, int second = 0) const {
    using P = fused::Packed<S>;
    const GradEpilogueParams& a = params_;
    const int column = at.col0 + 8 * at.lane;  // the lane's first column within the block
    // Each group's first row once; its rows at constant multiples of the stride after it.
    auto* const grad = static_cast<typename P::One*>(a.grad) + column;
    auto* const group_i = grad + static_cast<int64_t>(at.row0 + row_i) * a.grad_stride;
    auto* const group_second = kRows > kRowsAtOnce
                                   ? grad + static_cast<int64_t>(at.row0 + second) * a.grad_stride
                                   : group_i;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      if (i + r >= count) break;
      auto* out = r < kRowsAtOnce ? group_i + r * a.grad_stride
                                  : group_second + (r - kRowsAtOnce) * a.grad_stride;
      if constexpr (kVectors) {
        uint32_t w[4];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k) {
          const typename P::Pair pair = P::pair(value[r][2 * k], value[r][2 * k + 1]);
          memcpy(&w[k], &pair, sizeof pair);
        }
        *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
      } else if (a.pairs && column + 8 <= at.cols) {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; k += 2) {
          *reinterpret_cast<typename P::Pair*>(out + k) = P::pair(value[r][k], value[r][k + 1]);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 8; ++k) {
          if (column + k < at.cols) out[k] = P::one(value[r][k]);
        }
      }
    }
  }

  // Epilogue warps: lane i holds the records of the warp's rows i and 32 + i; consumer warps:
  // lane i that of its own row i.
  CeGradRecord record_[2] = {};
};

// The kernel (fused_epilogue_kernel.cuh) may start before the grid ahead of it ends: its producer
// warpgroup, the epilogue warps included, waits for that grid before its first load or store, and
// the consumers touch global memory only after the data those loads bring.
constexpr bool kDependentLaunch = true;

template <class Element>
bool launch(const FusedGradProduct& p, cudaStream_t stream) {
  GradEpilogueParams epilogue;
  epilogue.records = p.records;
  epilogue.grad = p.grad;
  epilogue.grad_stride = p.grad_stride;
  epilogue.first_column = p.first_column;
  epilogue.logit_scale = p.logit_scale;
  epilogue.softcap = p.softcap;
  epilogue.entropy = p.entropy;
  epilogue.class_weight = p.class_weight;
  epilogue.bias = fused::HalfVector{static_cast<const uint16_t*>(p.bias), p.dtype == DType::f16};
  epilogue.pairs = reinterpret_cast<std::uintptr_t>(p.grad) % 4 == 0 && p.grad_stride % 2 == 0;
  epilogue.vectors = reinterpret_cast<std::uintptr_t>(p.grad) % 16 == 0 && p.grad_stride % 8 == 0;
  epilogue.own_rows = fused_grad_own_rows();
  epilogue.partials = p.partials;
  epilogue.partial_stride = p.partial_stride;
  epilogue.target_logits = p.target_logits;
  if (p.statistic_partials != nullptr) {
    const int64_t plane = p.rows * p.partial_stride;
    epilogue.shift_partials = p.statistic_partials;
    epilogue.max_partials = p.statistic_partials + plane;
    epilogue.argmax_partials = reinterpret_cast<int32_t*>(p.statistic_partials + 2 * plane);
  }
  if (p.partials != nullptr &&
      (p.entropy || p.target_logits == nullptr || p.class_weight != nullptr || p.bias != nullptr)) {
    return false;
  }
  const fused::Operands operands{p.hidden, p.hidden_stride, p.weight,     p.weight_stride,
                                 p.rows,   p.columns,       p.hidden_size};
  // A 16-bit staged tile would round fp32 chunk logits: the caller's cuBLASLt path takes those.
  if (!p.rounded_logits) return false;
  // Each form a kernel of its own (GradForm), launched alike.
  auto launch_form = [&](auto form) {
    return fused::launch<Element, GradEpilogue<Element, decltype(form)::value>,
                         fused::EpilogueWarpsKernel>(operands, epilogue, "linear_ce", stream,
                                                     kDependentLaunch);
  };
  using Form = GradForm;
  if (p.partials != nullptr) {
    // The reference path takes bf16 only (linear_reference.cuh): no f16 kernel is built for it.
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      if (p.statistic_partials != nullptr) {
        return launch_form(std::integral_constant<Form, Form::reference_statistics>{});
      }
      return launch_form(std::integral_constant<Form, Form::reference>{});
    }
    return false;
  }
  if (p.class_weight != nullptr || p.bias != nullptr) {
    return launch_form(std::integral_constant<Form, Form::gradient_columns>{});
  }
  return launch_form(std::integral_constant<Form, Form::gradient>{});
}

}  // namespace

bool fused_grad_product_built() { return true; }

bool fused_grad_product(const FusedGradProduct& product, cudaStream_t stream) {
  if (product.rows <= 0 || product.columns <= 0) return true;  // nothing to form
  bool launched = false;
  switch (product.dtype) {
    case DType::bf16:
      launched = launch<cutlass::bfloat16_t>(product, stream);
      break;
    case DType::f16:
      launched = launch<cutlass::half_t>(product, stream);
      break;
    default:
      break;
  }
  // The reference form is counted by its own path (reference_chunk_count).
  if (launched && product.partials == nullptr) {
    fused_grad_launches.fetch_add(1, std::memory_order_relaxed);
  }
  return launched;
}

}  // namespace xent::cuda

#else  // not built for sm_90a, or no CUTLASS headers

namespace xent::cuda {

bool fused_grad_product_built() { return false; }

bool fused_grad_product(const FusedGradProduct&, cudaStream_t) { return false; }

}  // namespace xent::cuda

#endif

namespace xent::cuda {

int64_t fused_grad_count() { return fused_grad_launches.load(std::memory_order_relaxed); }

bool fused_grad_preferred(int64_t hidden_size) {
  const Forced forced = test_hook().fused_gradient;
  if (forced != Forced::planned) return forced == Forced::on;
  return hidden_size <= kFusedGradMaxHidden;
}

int fused_grad_own_rows() {
  const int rows = test_hook().fused_own_rows;
  return rows == 4 || rows == 8 ? rows : 0;
}

}  // namespace xent::cuda
