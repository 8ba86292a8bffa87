// Chunk planner of the fused linear losses on CUDA: which schedule runs and how many rows (and
// vocabulary columns) of logits are formed at once, so that ALL extra memory of the op (chunk
// buffers, fp32 gradient accumulators, row scratch, product scratch) stays within the caller's
// budget while the matrix products stay efficient. Plain C++ (no CUDA headers): unit-tested on the
// CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace xent::cuda {

// Where schedule (d) keeps its fp32 N×H ∂h sums: in the workspace, or in the last rows of the ∂W
// output, whose blocks then write their ∂W only after ∂h is formed (their gradient formed a
// second time); `planned`: whichever the cost model prefers among those that fit.
enum class HiddenSums { planned, workspace, weight_grad };
// Whether (d), with its ∂h sums in ∂W, keeps the first rows' sums in the ∂h output: where the
// planner finds it cheaper, never, or wherever the ∂h output can hold them (tests).
enum class HiddenSumsHead { planned, never, always };

// What the planner needs to know about one call.
struct ChunkRequest {
  int64_t rows = 0;                      // N
  int64_t hidden = 0;                    // H (the student's for distillation)
  int64_t vocab = 0;                     // V
  std::size_t logits_element_bytes = 2;  // bytes of one chunk logit (input dtype, or 4 for fp32)
  int logits_buffers_per_row = 1;        // 2 when teacher chunk logits are formed as well
  std::size_t budget_bytes = std::size_t{512} << 20;  // options.workspace_budget
  std::size_t fixed_bytes = 0;  // O(N) scratch of the row kernels, part of the budget
  // Bytes per chunk row beside its logits in the chunk buffer (linear_ce's per-row reference
  // path: its tile sums and scaled rows, linear_reference.cuh), in every buffer.
  std::size_t chunk_row_scratch_bytes = 0;
  // Bytes of every chunk buffer beyond its rows (the reference path's rank-1 rows of label
  // smoothing); row-chunk schedules only.
  std::size_t chunk_buffer_extra_bytes = 0;
  // The row chunks' gradient is formed in the logits product's epilogue (linear_ce's per-row
  // reference path, linear_reference.cuh): no row kernel reads and rewrites the chunk logits, and
  // the row-chunk schedules are priced with the epilogue's cost instead (kReferenceEpiloguePasses).
  bool gradient_in_product = false;
  // ∂W is wanted (any dtype): over several row chunks it is re-read and re-written per chunk.
  bool weight_gradient = false;
  // ∂W is wanted in a 16-bit dtype: accumulating it over several row chunks needs fp32 (V×H, or
  // block×H in the vocabulary-blocked schedule). Not set for fp32 ∂W (accumulated in place).
  bool weight_accumulator = false;
  // A 16-bit ∂W added chunk by chunk straight into its output (WeightGradAccumulation::
  // weight_dtype; weight_accumulator is then false): row chunks without an accumulator whatever
  // their count, each re-reading and re-writing V×H 16-bit values. The vocabulary-blocked
  // schedules, which would sum row tiles in an fp32 block accumulator, are not taken.
  bool weight_sums_in_output = false;
  std::size_t bias_accumulator_bytes = 0;  // fp32 ∂bias of a 16-bit bias (V floats)
  // Bytes per row that the first pass of the vocabulary-blocked schedule saves for the block
  // gradients: the lse for cross-entropy; lse of student and teacher, the row sums and the hard
  // term's lse for distillation (32).
  std::size_t saved_row_bytes = 4;
  int products_per_logits_chunk = 1;  // 2 when the teacher's logits are a product too
  // Schedule (d), statistics_blocks: the call may form its row statistics with the fused
  // statistics product (fused_stats.hpp, no logits written), or already has them (the forward's
  // lse with an entropy gradient: statistics_bytes 0). statistics_bytes: the least workspace that
  // product needs (one 128-row tile of partials, every row's record, the finish's scratch).
  bool statistics_product = false;
  std::size_t statistics_bytes = 0;
  // (d)'s first pass where it is not that one fused product: distillation forms its records block
  // by block from cuBLASLt logits (linear_distill_records.cuh). Its cost, in full products and in
  // reads of N×V chunk logits (the fused product: 1 and 0), and the bytes it keeps beside the
  // chunk region for the whole pass (its running records; part of the plan's total).
  double statistics_products = 1;
  double statistics_passes = 0;
  std::size_t statistics_records_bytes = 0;
  bool hidden_gradient = false;    // ∂h is wanted: (d) sums it over blocks in fp32 (N×H)
  bool prefer_statistics = false;  // take (d) whenever it fits (tests, measurements)
  // The ∂W output as (d)'s scratch: its bytes when ∂W is written over (not added into) as one
  // contiguous, 16-byte aligned buffer, else 0; and the bytes of one of its rows. Until a row of
  // ∂W is written it holds nothing, so (d) may keep its fp32 ∂h sums in the last rows of ∂W
  // instead of the workspace (HiddenSums).
  std::size_t weight_grad_bytes = 0;
  std::size_t weight_grad_row_bytes = 0;
  // The ∂h output as scratch for the first rows' sums: its bytes when it is one contiguous,
  // 16-byte aligned 16-bit buffer (N·H·2 bytes hold the fp32 sums of N/2 rows), else 0. With the
  // sums in ∂W, those rows' sums then stay out of ∂W, which halves the deferred blocks.
  std::size_t hidden_grad_bytes = 0;
  HiddenSums hidden_sums = HiddenSums::planned;
  HiddenSumsHead hidden_sums_head = HiddenSumsHead::planned;
  // Where (d)'s blocks form their gradient with the fused gradient product (linear_ce on Hopper):
  // its tile (rows × columns) and the device's multiprocessors. Each launch (a block's row tile)
  // runs in waves of one tile per multiprocessor, so a block whose tiles leave its last wave
  // part-empty pays for the whole wave; the planner prices that and tries every block width on
  // the tile's column grid. 0: not priced (cuBLASLt products pick their own tiles).
  int64_t gradient_tile_rows = 0;
  int64_t gradient_tile_columns = 0;
  int multiprocessors = 0;

  bool operator==(const ChunkRequest&) const = default;  // plan_chunks keeps recent plans
};

enum class Schedule {
  // (a) row chunks, no V×H accumulator: one chunk, fp32 ∂W accumulated in place, a 16-bit ∂W
  // added into its output (weight_sums_in_output), or no ∂W.
  row_chunks,
  // (b) row chunks and an fp32 V×H ∂W accumulator in the workspace.
  row_chunks_accumulated,
  // (c) row chunks for the loss, ∂h (and ∂bias); then ∂W per vocabulary block.
  vocabulary_blocks,
  // (d) the fused statistics product for the loss and lse of all rows (no logits), then per
  // vocabulary block the block's logits, its gradient from the lse, ∂W of the block and ∂h summed
  // over blocks in an fp32 N×H accumulator: four products, one elementwise pass. Distillation
  // forms its row statistics block by block instead (ChunkRequest::statistics_products).
  statistics_blocks,
};

struct ChunkPlan {
  Schedule schedule = Schedule::row_chunks;
  int64_t chunk_rows = 0;   // rows per full-vocabulary chunk (the last chunk may be shorter)
  int64_t chunk_count = 0;  // ceil(N / chunk_rows); 0 when N = 0
  // One buffer: chunk_rows × (V × element × buffers_per_row + per-row scratch), plus the
  // request's chunk_buffer_extra_bytes in the row-chunk schedules.
  std::size_t logits_buffer_bytes = 0;
  // vocabulary_blocks only. A block is block_columns columns of ∂W; its gradient is formed in
  // tiles of tile_rows rows (all N rows when they fit, then ∂W of the block is one product
  // written straight into the output).
  int64_t block_columns = 0;
  int64_t block_count = 0;
  int64_t tile_rows = 0;
  int64_t tile_count = 0;
  // tile_rows × block_columns × element per logits buffer of a row (shares the chunk region;
  // a teacher tile starts at the next kWorkspaceAlignment boundary after the student tile)
  std::size_t tile_buffer_bytes = 0;
  std::size_t lse_bytes = 0;             // N × saved_row_bytes saved by the first pass
  std::size_t gemm_workspace_bytes = 0;  // scratch handed to cuBLASLt
  std::size_t fixed_bytes = 0;
  std::size_t accumulator_bytes = 0;         // fp32 ∂W: V×H (b), block_columns×H (c, d), or 0
  std::size_t hidden_accumulator_bytes = 0;  // (d): fp32 ∂h, N×H, after the block accumulator
  // (d) with its ∂h sums in the ∂W output (HiddenSums::weight_grad; hidden_accumulator_bytes is
  // then 0): they start hidden_sums_offset bytes into ∂W, and the blocks from
  // deferred_first_block on reach those rows, so their ∂W products wait until ∂h is written.
  // The sums of rows [0, hidden_sums_head_rows) are then in the ∂h output itself, as fp32 rows
  // from its start, narrowed in place at the end (in_place_narrowing_ranges); those of the other
  // rows start at hidden_sums_offset.
  bool hidden_sums_in_weight_grad = false;
  std::size_t hidden_sums_offset = 0;
  int64_t hidden_sums_head_rows = 0;
  int64_t deferred_first_block = 0;
  std::size_t statistics_bytes = 0;          // (d): pass 1's share of the chunk region
  std::size_t statistics_records_bytes = 0;  // (d): pass 1's records beside the region
  std::size_t bias_accumulator_bytes = 0;
  std::size_t total_bytes = 0;  // everything above, with alignment padding
  double predicted_ms = 0;      // cost model (chunk_plan.cpp), H200-class figures
  bool fits_budget = false;     // false when even the smallest plan exceeds the budget
};

// The smallest row block any plan uses, and the budget it needs: below it the op cannot run.
constexpr int64_t kMinimumChunkRows = 1;
std::size_t minimum_budget_bytes(const ChunkRequest& request);

// Chooses the schedule and chunk shape; never fails (a budget below the minimum gives the smallest
// plan with fits_budget = false: its total_bytes is what the op then needs).
ChunkPlan plan_chunks(const ChunkRequest& request);

// Alignment of every workspace region (cuBLASLt picks its fastest kernels for 256-byte
// aligned operands; the row kernels want 16-byte vector loads).
constexpr std::size_t kWorkspaceAlignment = 256;
constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// The row ranges [first, last) in which fp32 rows [0, rows) of H values each, kept from the start
// of a 16-bit buffer of the same rows, are narrowed in place once rows [0, staged) have been
// narrowed from a copy elsewhere (0 < staged ≤ rows): a range reads fp32 rows [a, b) (bytes
// 4aH to 4bH) and writes 16-bit rows [a, b) (bytes 2aH to 2bH), which with b ≤ 2a lie below
// what it reads and above nothing not yet narrowed; so the ranges double from `staged`.
std::vector<std::pair<int64_t, int64_t>> in_place_narrowing_ranges(int64_t staged, int64_t rows);

// Bytes of the one region that holds the chunk buffers, and in the vocabulary-blocked schedules
// (which never need both at once) the tile buffer followed by the block accumulator (and in (d)
// the ∂h accumulator; its pass 1 uses the region for the fused product's partials).
std::size_t chunk_region_bytes(const ChunkPlan& plan);

}  // namespace xent::cuda
