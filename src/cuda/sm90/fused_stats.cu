// The no-gradient linear_ce forward through the fused statistics product (fused_stats.hpp):
//   1. fused_stats_product   x = h·Wᵀ with the statistics epilogue: tile partials
//                            [N, ceil(V/256), kTilePartialWidth], no logits anywhere;
//   2. fused_tile_merge      one warp per row merges its tile partials (common::RowStats::merge,
//                            the merge of the row kernels and of vocabulary shards) into the
//                            shard record of common/ce_shard.hpp: the whole vocabulary as one
//                            shard;
//   3. ce_shard_finish       the vocabulary-parallel finish (ce_shard.cu) turns the records into
//                            the loss, the statistics and the batch totals, with P = 1.
// Workspace: [tile partials | records | the finish's scratch], each 256-byte aligned; for
// (8192, ·, 128256) that is 8192 · 501 · 24 B ≈ 94 MiB of partials, against 2 GiB of bf16 logits.
#include <algorithm>
#include <atomic>
#include <cstdlib>

#include <cub/block/block_reduce.cuh>

#include "api/shard_backend.hpp"
#include "common/ce_shard.hpp"
#include "cuda/rows/ce_device.cuh"
#include "cuda/shard/ce_shard.cuh"
#include "cuda/plan/chunk_plan.hpp"
#include "cuda/core/device.cuh"
#include "cuda/sm90/fused_stats.hpp"
#include "cuda/rows/row_slice.cuh"
#include "cuda/sm90/tile_grid.hpp"
#include "cuda/test_hook.hpp"

namespace xent::cuda {
namespace {

using common::RowStats;

constexpr int kMergeWarps = 8;

std::atomic<int64_t> fused_forwards{0};

int64_t tile_count(int64_t vocab) { return (vocab + kFusedTileColumns - 1) / kFusedTileColumns; }

struct TileMergeParams {
  const float* partials;
  int64_t rows, tiles, vocab;
  const void* target;
  DType target_dtype;
  float* records;  // [rows, kCeShardStatsWidth]
  // Class weights, or null; with them W = Σ_i w_i, formed once (class_weight_total_kernel).
  const float* class_weight;
  const float* class_weight_total;
};

constexpr int kWeightTotalThreads = 512;

// W = Σ_i w_i of the class weights into *total, by one CTA, in double as the batch totals form
// it (ce_totals.cu): every row's record carries it (the finish's smoothing term and its D).
__global__ void __launch_bounds__(kWeightTotalThreads)
    class_weight_total_kernel(const float* class_weight, int64_t vocab, float* total) {
  using Reduce = cub::BlockReduce<double, kWeightTotalThreads>;
  __shared__ typename Reduce::TempStorage storage;
  double sum = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += kWeightTotalThreads) sum += class_weight[i];
  sum = Reduce(storage).Sum(sum);
  if (threadIdx.x == 0) *total = static_cast<float>(sum);
}

// A tile's partial as RowStats. Its Σx̃ slot holds Σ w·x̃ under class weights (the product's
// class_weight), the one sum the loss then reads (ce_row_loss), so both sums take the slot.
__device__ RowStats<float> read_tile_partial(const float* partial) {
  RowStats<float> s;
  s.max = partial[kTileMax];
  s.sum_exp = partial[kTileSumExp];
  s.sum_exp_shift = partial[kTileSumExpShift];
  s.sum_logits = partial[kTileSumLogits];
  s.sum_weighted_logits = s.sum_logits;
  s.argmax = static_cast<int32_t>(common::float_to_bits(partial[kTileArgmax]));
  return s;
}

__global__ void __launch_bounds__(kMergeWarps * 32)
    fused_tile_merge_kernel(const TileMergeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= p.rows) return;  // the whole warp
  const float* partials = p.partials + row * p.tiles * kTilePartialWidth;
  RowStats<float> stats;
  float target_logit = 0;  // one tile holds y; the others add +0
  for (int64_t tile = lane; tile < p.tiles; tile += 32) {
    const float* partial = partials + tile * kTilePartialWidth;
    stats.merge(read_tile_partial(partial));
    target_logit += partial[kTileTargetLogit];
  }
  stats = warp_merge(stats);  // valid in lane 0
  for (int offset = 16; offset > 0; offset >>= 1) {
    target_logit += __shfl_down_sync(0xffffffffu, target_logit, offset);
  }
  if (lane != 0) return;
  const int64_t y = read_target(p.target, p.target_dtype, row);
  common::ShardPartial<float> record;
  record.stats = stats;
  record.target_logit = target_logit;
  // The finish reads w_y only for valid in-range rows; an out-of-range one is its NaN + error.
  const bool in_range = y >= 0 && y < p.vocab;
  record.target_weight = !in_range ? 0.0f : p.class_weight ? p.class_weight[y] : 1.0f;
  record.class_weight_sum = p.class_weight ? *p.class_weight_total : static_cast<float>(p.vocab);
  common::write_shard_record(p.records + row * kCeShardStatsWidth, record);
}

struct FusedWorkspace {
  float* partials;
  float* records;
  float* class_weight_total;  // W, where there are class weights
  Workspace finish;
};

std::size_t partial_bytes(int64_t rows, int64_t vocab) {
  return align_up(static_cast<std::size_t>(rows) * static_cast<std::size_t>(tile_count(vocab)) *
                  kTilePartialWidth * sizeof(float));
}

std::size_t record_bytes(int64_t rows) {
  return align_up(static_cast<std::size_t>(rows) * kCeShardStatsWidth * sizeof(float));
}

// What the whole call keeps besides one chunk's partials: every row's record, W and the finish.
std::size_t fixed_bytes(int64_t rows) {
  return record_bytes(rows) + align_up(sizeof(float)) + align_up(ce_shard_workspace_size(rows));
}

// Rows per fused product: all of them when their tile partials fit the budget beside the fixed
// part, else chunks of whole 128-row tiles that do (each chunk re-reads W once: at 64 MiB and
// V = 128256 a chunk holds ≈ 5,400 rows), evened out and on whole swizzle groups where they fit
// (tile_grid.hpp: a chunk of 35 row tiles ran 48, decision 50). 0 when not even one row tile
// fits.
int64_t chunk_rows(int64_t rows, int64_t vocab, std::size_t budget) {
  constexpr TileGrid kShape;  // the fused product's tile and cluster
  constexpr int64_t kRowTile = kShape.tile_rows;
  const std::size_t fixed = fixed_bytes(rows);
  if (fixed + partial_bytes(rows, vocab) <= budget) return rows;
  if (fixed >= budget) return 0;
  const std::size_t per_row =
      static_cast<std::size_t>(tile_count(vocab)) * kTilePartialWidth * sizeof(float);
  // align_up rounds partial_bytes up by < 256 bytes: keep that much aside.
  const std::size_t room = budget - fixed;
  const int64_t fit = room > 256 ? static_cast<int64_t>((room - 256) / per_row) : 0;
  return balanced_row_chunks(rows, fit / kRowTile * kRowTile, kRowTile,
                             swizzle_group_row_tiles(kShape));
}

FusedWorkspace carve(Workspace workspace, int64_t rows, int64_t vocab, int64_t chunk) {
  char* base = static_cast<char*>(workspace.data);
  FusedWorkspace ws;
  ws.partials = reinterpret_cast<float*>(base);
  ws.records = reinterpret_cast<float*>(base + partial_bytes(chunk, vocab));
  ws.class_weight_total =
      reinterpret_cast<float*>(base + partial_bytes(chunk, vocab) + record_bytes(rows));
  ws.finish.data =
      base + partial_bytes(chunk, vocab) + record_bytes(rows) + align_up(sizeof(float));
  ws.finish.bytes = ce_shard_workspace_size(rows);
  return ws;
}

bool tma_aligned(const TensorView& matrix) {
  // TMA wants 16-byte aligned bases and row strides: 8 bf16/f16 elements.
  return reinterpret_cast<std::uintptr_t>(matrix.data) % 16 == 0 && matrix.row_stride % 8 == 0 &&
         matrix.cols % 8 == 0;
}

}  // namespace

std::size_t fused_stats_workspace_bytes(int64_t rows, int64_t vocab, std::size_t budget) {
  const int64_t chunk = chunk_rows(rows, vocab, budget);
  return chunk > 0 ? partial_bytes(chunk, vocab) + fixed_bytes(rows) : 0;
}

namespace {
// Forced off or on (whenever the call is eligible) by the tests; else fused_stats_preferred.
char fused_switch() {
  const Forced forced = test_hook().fused_statistics;
  return forced == Forced::on ? '1' : forced == Forced::off ? '0' : 'p';
}
}  // namespace

bool fused_stats_forced() { return fused_switch() == '1'; }

bool fused_stats_needs_extras(const CeOptions& options, const CeStats& stats) {
  return options.label_smoothing != 0 || stats.entropy.present() || stats.argmax.present() ||
         stats.accuracy.present();
}

bool fused_stats_preferred(const LinearCeOptions& options, const LinearCeOutputs& out,
                           bool logits_chunked) {
  switch (fused_switch()) {
    case '0':
      return false;
    case '1':
      return true;
    default:
      return logits_chunked ||
             (!fused_stats_needs_extras(options.ce, out.stats) && !options.ce.softcap);
  }
}

bool fused_stats_candidate(DType dtype, const LinearCeOptions& options) {
  if (fused_switch() == '0') return false;
  // A forward that fills the logits cache stays on the cuBLASLt path (it must write the logits).
  return (dtype == DType::bf16 || dtype == DType::f16) && !options.logits_cache.present();
}

bool fused_operands_eligible(TensorView hidden, TensorView weight, TensorView bias) {
  return (hidden.dtype == DType::bf16 || hidden.dtype == DType::f16) &&
         (!bias.present() || (bias.dtype == hidden.dtype && bias.rows == weight.rows)) &&
         weight.dtype == hidden.dtype && hidden.rows > 0 && hidden.rows <= INT32_MAX &&
         weight.rows <= INT32_MAX && fused_stats_product_built() && tma_aligned(hidden) &&
         tma_aligned(weight) && hopper_paths(hidden.device.index);
}

bool fused_stats_eligible(TensorView hidden, TensorView weight, TensorView bias,
                          const LinearCeOptions& options) {
  return fused_stats_candidate(hidden.dtype, options) &&
         fused_operands_eligible(hidden, weight, bias);
}

std::size_t fused_stats_minimum_bytes(int64_t rows, int64_t vocab) {
  return partial_bytes(std::min<int64_t>(rows, 128), vocab) + fixed_bytes(rows);
}

bool fused_statistics(const FusedStatistics& call, cudaStream_t stream) {
  const TensorView &hidden = call.hidden, &weight = call.weight, &target = call.target;
  const int64_t rows = hidden.rows, vocab = weight.rows;
  const int64_t chunk = chunk_rows(rows, vocab, call.workspace.bytes);
  if (chunk == 0 || call.workspace.data == nullptr) return false;
  const FusedWorkspace ws = carve(call.workspace, rows, vocab, chunk);
  const std::size_t hidden_row_bytes =
      static_cast<std::size_t>(hidden.row_stride) * dtype_size(hidden.dtype);
  const std::size_t target_bytes = dtype_size(target.dtype);
  const float* class_weight = call.options.class_weight.present()
                                  ? static_cast<const float*>(call.options.class_weight.data)
                                  : nullptr;
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t count = std::min(chunk, rows - first);
    const void* chunk_target = static_cast<const char*>(target.data) + first * target_bytes;
    FusedStatsProduct product;
    product.hidden = static_cast<const char*>(hidden.data) + first * hidden_row_bytes;
    product.hidden_stride = hidden.row_stride;
    product.weight = weight.data;
    product.weight_stride = weight.row_stride;
    product.dtype = hidden.dtype;
    product.rows = count;
    product.vocab = vocab;
    product.hidden_size = hidden.cols;
    product.target = chunk_target;
    product.target_int64 = target.dtype == DType::i64;
    product.logit_scale = static_cast<float>(call.options.logit_scale);
    product.softcap = call.options.softcap ? static_cast<float>(*call.options.softcap) : 0.0f;
    product.extras = call.extras;
    product.bias = call.bias.present() ? call.bias.data : nullptr;
    if (call.options.label_smoothing != 0) product.class_weight = class_weight;
    product.rounded_logits = call.rounded_logits;
    product.partials = ws.partials;
    product.tiles = tile_count(vocab);
    if (!fused_stats_product(product, stream)) {
      // Only the first chunk can decline (the later ones have the same shapes and alignment).
      if (first == 0) return false;
      throw Error(ErrorKind::runtime, std::string(op_name(call.op)) +
                                          ": the fused statistics product declined a later "
                                          "row chunk");
    }
    if (first == 0 && class_weight) {  // after the first product: a decline launches nothing
      class_weight_total_kernel<<<1, kWeightTotalThreads, 0, stream>>>(class_weight, vocab,
                                                                       ws.class_weight_total);
      XENT_CUDA_CHECK_LAUNCH();
    }
    TileMergeParams merge{ws.partials,
                          count,
                          product.tiles,
                          vocab,
                          chunk_target,
                          target.dtype,
                          ws.records + first * kCeShardStatsWidth,
                          class_weight,
                          ws.class_weight_total};
    const unsigned blocks = static_cast<unsigned>((count + kMergeWarps - 1) / kMergeWarps);
    fused_tile_merge_kernel<<<blocks, kMergeWarps * 32, 0, stream>>>(merge);
    XENT_CUDA_CHECK_LAUNCH();
  }

  const TensorView records =
      matrix(ws.records, DType::f32, rows, kCeShardStatsWidth, kCeShardStatsWidth, hidden.device);
  ce_shard_finish(records, target, VocabShard{0, vocab}, call.options, call.out, ws.finish, call.op,
                  stream);
  fused_forwards.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool linear_ce_forward_fused_stats(TensorView hidden, TensorView weight, TensorView bias,
                                   TensorView target, const LinearCeOptions& options,
                                   const LinearCeOutputs& out, bool logits_chunked,
                                   Workspace workspace, cudaStream_t stream) {
  if (!fused_stats_eligible(hidden, weight, bias, options) ||
      !fused_stats_preferred(options, out, logits_chunked)) {
    return false;
  }
  const int64_t rows = hidden.rows, vocab = weight.rows;
  // Within the budget, however large the caller's workspace is.
  const std::size_t needed = fused_stats_workspace_bytes(rows, vocab, options.workspace_budget);
  if (needed == 0 || needed > workspace.bytes) return false;
  FusedStatistics call{hidden, weight, target, options.ce};
  call.bias = bias;
  call.out.loss = out.loss;
  call.out.stats = out.stats;
  call.extras = fused_stats_needs_extras(options.ce, out.stats);
  // The statistics of x as the cuBLASLt path sees it (16-bit logits unless fp32_logits): a
  // backward that forms its gradient from this lse and 16-bit logits of the same product (the
  // fused gradient product, the entropy term) then has a softmax that sums to one.
  call.rounded_logits = !options.fp32_logits;
  call.workspace = Workspace{workspace.data, needed};
  call.op = OpCode::linear_ce_forward;
  return fused_statistics(call, stream);
}

int64_t fused_stats_forward_count() { return fused_forwards.load(std::memory_order_relaxed); }

}  // namespace xent::cuda
