// Chunk planner. Cost model (bf16 operands, H100 SXM / H200 figures measured on this project's
// devices: dense bf16 products P ≈ 650–790 TFLOP/s, HBM B ≈ 3.0–4.2 TB/s; ridge P/B ≈ 200 FLOP/B):
//
// Per row chunk of R rows the op runs three products and one memory-bound row kernel:
//   logits  L = h·Wᵀ       2·R·V·H FLOP, writes R·V logits (2 B each)   intensity ≈ H FLOP/B
//   ∂h      = G·W          2·R·V·H FLOP, reads R·V gradients            intensity ≈ H FLOP/B
//   ∂W     += Gᵀ·h         2·R·V·H FLOP, reads AND writes the fp32 V×H accumulator: 8·V·H bytes
//   row kernel             reads and writes R·V logits: 4·R·V bytes, no matrix work
// The first two are compute-bound for any H ≥ 256 whatever R is. The ∂W product is the one chunking
// can ruin: its accumulator traffic does not shrink with R, so its intensity is 2·R·V·H / 8·V·H =
// R/4 FLOP/B, and it is compute-bound only for R ≥ 4·P/B ≈ 4·200 = 800 rows. At R = 128 (the chunk
// size of libraries that chunk by a fixed small count) the ∂W product runs at ~1/6 of the tensor
// rate, which is where their 4–7× slowdowns against the bare products come from. Hence: the planner
// takes the largest R the budget allows (never a fixed small count), balances the chunks so the last
// one is not a sliver, and rounds R to the 128-row tile of the products when that still fits. With
// the 512 MiB default, bf16 logits and N = 8192: V = 128256 gives R = 1664 in 5 chunks (2× over the
// balance point), V = 256000 gives R = 912 in 9 chunks (just above it); 64 MiB budgets give
// R ≈ 125–250, where ∂W is accumulator-bound by design (the caller chose memory over time).
// Measured on an H200 (docs/perf-notes.md): cuBLASLt hides the accumulator traffic only in part,
// so the cost is closer to additive, 2·R·V·H / P + 8·V·H / B per chunk: at R = 912, V = 256000 the
// ∂W product took 2.56 ms, 1.5 ms of arithmetic plus 1.1 ms of accumulator traffic. Larger R is
// therefore always better, which is what the planner does; the 800-row balance point is where the
// traffic equals the arithmetic, not where it disappears.
//
// The row kernel costs 4·R·V / B against 6·R·V·H / P for the products: 0.67·(P/B)/H, i.e. ≈ 18 % of
// the product time at H = 768, 6 % at H = 2304, 3 % at H = 4096 when run back to back; running it on
// a second stream beside the next chunk's products hides it, at the price of a second chunk buffer
// (half the rows under the same budget). The planner only grants the overlap when it is asked to
// (linear_streams.hpp: off by default, it measured −5 % to +2 %) and the halved chunk still sits
// above the balance point (kEfficientRows), since losing ∂W efficiency costs more than the row
// kernel it hides.
#include "cuda/chunk_plan.hpp"

#include <algorithm>
#include <initializer_list>

namespace xent::cuda {

namespace {

// Rows per chunk below which the ∂W accumulation stops being compute-bound (4·P/B, see above).
constexpr int64_t kEfficientRows = 1024;
// Row tile of the products: chunk boundaries on multiples of it keep every tile full.
constexpr int64_t kTileRows = 128;
// cuBLASLt scratch: the 32 MiB NVIDIA recommends on Hopper, or a sixteenth of a smaller budget.
// The ∂h product of a chunk is short and deep (H × R output, K = V), where split-K kernels that
// need scratch of H·R floats per split are the fast ones; starving them costs more than the rows
// the scratch takes from the chunk (32 MiB = 64 rows of V = 128256 logits).
constexpr std::size_t kGemmWorkspaceBytes = std::size_t{32} << 20;

std::size_t gemm_workspace_for(std::size_t budget) {
  const std::size_t share = std::min(kGemmWorkspaceBytes, budget / 16);
  return share / kWorkspaceAlignment * kWorkspaceAlignment;
}

std::size_t bytes_per_chunk_row(const ChunkRequest& request) {
  return static_cast<std::size_t>(request.vocab) * request.logits_element_bytes *
         static_cast<std::size_t>(std::max(1, request.logits_buffers_per_row));
}

// Workspace of a plan with `rows` rows per chunk and `buffers` chunk buffers.
std::size_t total_for(const ChunkRequest& request, int64_t rows, int buffers,
                      std::size_t gemm_bytes) {
  const std::size_t buffer = align_up(static_cast<std::size_t>(rows) * bytes_per_chunk_row(request));
  return buffer * buffers + gemm_bytes + align_up(request.fixed_bytes) +
         align_up(request.accumulator_bytes);
}

// Rows per chunk: the fewest chunks the row limit allows, evened out, on the tile grid when
// chunks are large enough for tiles to matter.
int64_t balanced_rows(int64_t total_rows, int64_t max_rows) {
  const int64_t count = (total_rows + max_rows - 1) / max_rows;
  int64_t rows = (total_rows + count - 1) / count;
  for (const int64_t grid : {rows >= kTileRows ? kTileRows : int64_t{8}, int64_t{8}}) {
    const int64_t rounded = (rows + grid - 1) / grid * grid;
    if (rounded <= max_rows) return std::min(rounded, total_rows);
  }
  return rows;
}

}  // namespace

std::size_t minimum_budget_bytes(const ChunkRequest& request) {
  const std::size_t gemm = gemm_workspace_for(request.budget_bytes);
  return total_for(request, kMinimumChunkRows, 1, gemm) - align_up(request.accumulator_bytes);
}

ChunkPlan plan_chunks(const ChunkRequest& request) {
  ChunkPlan plan;
  plan.gemm_workspace_bytes = gemm_workspace_for(request.budget_bytes);
  plan.fixed_bytes = request.fixed_bytes;
  plan.accumulator_bytes = request.accumulator_bytes;
  plan.fits_budget = minimum_budget_bytes(request) <= request.budget_bytes;

  const int64_t rows = std::max<int64_t>(request.rows, 0);
  const std::size_t per_row = std::max<std::size_t>(bytes_per_chunk_row(request), 1);
  const std::size_t reserved = plan.gemm_workspace_bytes + align_up(request.fixed_bytes) +
                               2 * kWorkspaceAlignment;  // padding of up to two buffers
  const std::size_t available =
      request.budget_bytes > reserved ? request.budget_bytes - reserved : 0;
  const int64_t max_rows_one_buffer =
      std::max<int64_t>(kMinimumChunkRows, static_cast<int64_t>(available / per_row));

  // Overlap only pays when both halves still keep ∂W compute-bound and there are two chunks.
  const int64_t max_rows_two_buffers = max_rows_one_buffer / 2;
  const bool overlap = request.overlap && max_rows_two_buffers >= kEfficientRows &&
                       rows > max_rows_two_buffers;
  plan.buffer_count = overlap ? 2 : 1;
  const int64_t max_rows = overlap ? max_rows_two_buffers : max_rows_one_buffer;

  if (rows == 0) {
    plan.chunk_rows = 0;
    plan.chunk_count = 0;
  } else {
    plan.chunk_rows = balanced_rows(rows, max_rows);
    plan.chunk_count = (rows + plan.chunk_rows - 1) / plan.chunk_rows;
  }
  const int64_t buffer_rows = std::max<int64_t>(plan.chunk_rows, kMinimumChunkRows);
  plan.logits_buffer_bytes = static_cast<std::size_t>(buffer_rows) * per_row;
  plan.total_bytes =
      total_for(request, buffer_rows, plan.buffer_count, plan.gemm_workspace_bytes);
  return plan;
}

}  // namespace xent::cuda
