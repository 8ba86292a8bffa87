// Chunk planner of the fused linear losses on CUDA: how many rows of logits are formed at once so
// that the workspace stays within the caller's budget while the matrix products stay efficient.
// Plain C++ (no CUDA headers): unit-tested on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>

namespace xent::cuda {

// What the planner needs to know about one call.
struct ChunkRequest {
  int64_t rows = 0;             // N
  int64_t hidden = 0;           // H (the student's for distillation)
  int64_t vocab = 0;            // V
  std::size_t logits_element_bytes = 2;  // bytes of one chunk logit (input dtype, or 4 for fp32)
  int logits_buffers_per_row = 1;        // 2 when teacher chunk logits are formed as well
  std::size_t budget_bytes = std::size_t{512} << 20;  // options.workspace_budget
  std::size_t fixed_bytes = 0;           // O(N) scratch of the row kernels, part of the budget
  // fp32 accumulators that sit on top of the budget (linear_ce.hpp: the budget is for chunk
  // buffers; a non-fp32 ∂W / ∂bias needs V×H / V floats to accumulate across chunks exactly).
  std::size_t accumulator_bytes = 0;
  bool overlap = false;  // two chunk buffers, so one chunk's row kernel runs beside the products
};

struct ChunkPlan {
  int64_t chunk_rows = 0;   // rows per chunk (the last chunk may be shorter)
  int64_t chunk_count = 0;  // ceil(N / chunk_rows); 0 when N = 0
  int buffer_count = 1;     // 1, or 2 when overlapping
  std::size_t logits_buffer_bytes = 0;  // one buffer: chunk_rows × V × element × buffers_per_row
  std::size_t gemm_workspace_bytes = 0; // scratch handed to cuBLASLt
  std::size_t fixed_bytes = 0;
  std::size_t accumulator_bytes = 0;
  std::size_t total_bytes = 0;          // everything above, with alignment padding
  bool fits_budget = false;             // false when even the smallest chunk exceeds the budget
};

// The smallest row block any plan uses, and the budget it needs: below it the op cannot run.
constexpr int64_t kMinimumChunkRows = 1;
std::size_t minimum_budget_bytes(const ChunkRequest& request);

// Chooses the chunk shape; never fails (a budget below the minimum gives the minimal plan with
// fits_budget = false, which the API layer reports as an invalid workspace_budget).
ChunkPlan plan_chunks(const ChunkRequest& request);

// Alignment of every workspace region (cuBLASLt picks its fastest kernels for 256-byte
// aligned operands; the row kernels want 16-byte vector loads).
constexpr std::size_t kWorkspaceAlignment = 256;
constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

}  // namespace xent::cuda
