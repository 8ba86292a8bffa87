// The fused statistics product of linear_ce on Hopper: x = h·Wᵀ on tensor cores
// whose epilogue never writes the logits; it leaves, per row and per column tile of the product,
// a tile partial of the row's statistics of x̃ (docs/semantics.md §1 transform). fused_stats.cu merges each
// row's tile partials into the vocabulary-shard record of common/ce_shard.hpp and finishes them
// with the vocabulary-parallel merge (ce_shard.cu), so the loss and every statistic come from the
// code that already turns shard records into outputs.
//
//   fused_stats_product.cu  the CUTLASS sm_90a kernel (TMA + wgmma, warp-specialised, persistent)
//                           with the statistics epilogue; a stub elsewhere (not built for sm_90a,
//                           or no CUTLASS headers), where fused_stats_product_built() is false.
//   fused_stats.cu          eligibility, workspace, the tile merge kernel and the finish.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "xent/linear_ce.hpp"

namespace xent::cuda {

enum class OpCode : int32_t;  // device.cuh: the op an error is reported for

// Columns of one tile partial (fp32; the argmax is the global column bit-cast to int32).
enum FusedTileColumn : int64_t {
  kTileMax = 0,      // max of x̃ over the tile's columns of the row
  kTileSumExp,       // Σ e^(x̃−max)
  kTileSumExpShift,  // Σ e^(x̃−max)·(x̃−max)  (entropy)
  kTileSumLogits,    // Σ x̃, or Σ w·x̃ under class weights  (label smoothing)
  kTileArgmax,       // lowest column of the max
  kTileTargetLogit,  // x̃_y when y is one of the tile's columns, else 0
  kTilePartialWidth
};

// Columns of x per tile of the product (its N tile); the partials of a row number
// ceil(V / kFusedTileColumns).
constexpr int64_t kFusedTileColumns = 256;
// Rows of x per tile (its M tile; fused_product.cuh's TileShape, for the planner's waves).
constexpr int64_t kFusedTileRows = 128;

struct FusedStatsProduct {
  const void* hidden = nullptr;  // [rows, hidden_size], row stride hidden_stride (elements)
  int64_t hidden_stride = 0;
  const void* weight = nullptr;  // [vocab, hidden_size]
  int64_t weight_stride = 0;
  DType dtype = DType::bf16;  // of both operands: bf16 or f16
  int64_t rows = 0, vocab = 0, hidden_size = 0;
  const void* target = nullptr;  // [rows]
  bool target_int64 = true;
  float logit_scale = 1, softcap = 0;
  // Also the tile partials' Σe·(x̃−max), Σx̃ and argmax (entropy, label smoothing, argmax,
  // accuracy); without, those fields are 0, 0 and the tile's first column, and must not be read.
  bool extras = true;
  // [vocab] class weights where label smoothing carries them: the extras' Σx̃ is then Σ w·x̃
  // (the only sum of the logits the loss reads under class weights); null otherwise.
  const float* class_weight = nullptr;
  const void* bias = nullptr;  // [vocab] in `dtype`, added to x, or null
  // The statistics of x rounded to the operands' dtype (as the cuBLASLt path stores its logits)
  // instead of the fp32 products: a gradient formed later from 16-bit logits of the same product
  // and this lse is then a softmax that sums to one (linear_ce's statistics_blocks schedule, and
  // the no-gradient forward unless fp32_logits, whose lse a backward may read).
  bool rounded_logits = false;
  float* partials = nullptr;  // [rows, tiles, kTilePartialWidth]
  int64_t tiles = 0;
};

// Whether this build holds the sm_90a kernel (false: the stub; callers take the cuBLASLt path).
bool fused_stats_product_built();

// Launches the product on `stream`. False (nothing launched) when the kernel cannot take these
// operands (alignment, sizes) or is not built: the caller falls back.
bool fused_stats_product(const FusedStatsProduct& product, cudaStream_t stream);

// ---- fused_stats.cu ----------------------------------------------------------------------------

// Bytes of workspace the fused no-gradient forward needs for these sizes within `budget`: one row
// chunk's tile partials (all rows when they fit, else whole 128-row tiles), every row's merged
// record, the finishing merge's scratch. 0 when the budget holds not even one row tile.
std::size_t fused_stats_workspace_bytes(int64_t rows, int64_t vocab, std::size_t budget);

// Whether a no-gradient linear_ce forward with these options may take the fused path, from what
// the size query sees (dtype, options; not the device, bias, alignment or the outputs asked
// for), unless the test hook forces the path off.
bool fused_stats_candidate(DType dtype, const LinearCeOptions& options);

// Forced on by the test hook: every eligible call takes the fused path (linear_ce's training step
// included: its statistics_blocks schedule whenever that fits the budget).
bool fused_stats_forced();

// Whether the tile partials must carry the extras (Σe·d, Σx̃, argmax) for these options and
// requested statistics: label smoothing, entropy, argmax or accuracy.
bool fused_stats_needs_extras(const CeOptions& options, const CeStats& stats);

// Whether an eligible call takes the fused path (docs/archive/perf-notes.md, decisions 41 and 43):
// - always when the cuBLASLt path would split the rows into several logits chunks (a budget
//   below N × V logits): the fused product reads W once per large chunk instead of once per few
//   hundred rows;
// - otherwise when its epilogue is the lean one (no entropy, argmax, accuracy, label smoothing
//   or softcap), where it is as fast or faster; with the extras or a softcap the epilogue is
//   bound by its exponentials and the cuBLASLt path stays.
// The test hook forces it whenever eligible, or never.
bool fused_stats_preferred(const LinearCeOptions& options, const LinearCeOutputs& out,
                           bool logits_chunked);

// Whether this call's operands can take the fused product: sm_90 device, built kernel, bf16/f16
// of one dtype (a bias too), no logits cache to fill, TMA-aligned rows, N and V
// within int32. Not the policy (fused_stats_preferred) nor the workspace.
bool fused_stats_eligible(TensorView hidden, TensorView weight, TensorView bias,
                          const LinearCeOptions& options);

// The part of that which every fused product of fused_product.cuh needs of its operands
// (fused_grad.cuh's too): bf16/f16 of one dtype (a bias of it too), TMA-aligned rows, 0 < N and V within
// int32, an sm_90 device, the sm_90a kernels built. No switch, option or policy.
bool fused_operands_eligible(TensorView hidden, TensorView weight, TensorView bias);

// The least workspace fused_statistics runs in: one 128-row tile of partials beside every row's
// record and the finish's scratch (more workspace: more rows per product, fewer reads of W).
std::size_t fused_stats_minimum_bytes(int64_t rows, int64_t vocab);

// One run of the fused statistics over all rows of an eligible call: the products in row chunks
// within `workspace` (all of it may be used), the tile merge, and the finish that writes `out`
// (loss, statistics, lse; the loss may be absent). `extras`: the tile partials also carry Σe·d,
// Σx̃ and the argmax (entropy, label smoothing, argmax, accuracy); `rounded_logits`: see
// FusedStatsProduct. False, having launched
// nothing, when the product declines or the workspace holds less than the minimum.
struct FusedStatistics {
  TensorView hidden, weight, target;
  const CeOptions& options;
  TensorView bias{};  // [V] in the operands' dtype, or absent
  CeOutputs out{};
  bool extras = true;
  bool rounded_logits = false;  // FusedStatsProduct::rounded_logits
  Workspace workspace{};
  OpCode op{};
};
bool fused_statistics(const FusedStatistics& call, cudaStream_t stream);

// The no-gradient forward through the fused product, when this call is eligible and
// fused_stats_preferred says so, within options.workspace_budget; `logits_chunked`: whether the
// cuBLASLt path's plan has several row chunks. Returns false, having launched nothing, otherwise.
bool linear_ce_forward_fused_stats(TensorView hidden, TensorView weight, TensorView bias,
                                   TensorView target, const LinearCeOptions& options,
                                   const LinearCeOutputs& out, bool logits_chunked,
                                   Workspace workspace, cudaStream_t stream);

// How many runs of fused_statistics (the no-gradient forward, and pass 1 of linear_ce's
// statistics_blocks schedule) this process made: tests assert the path ran.
int64_t fused_stats_forward_count();

}  // namespace xent::cuda
