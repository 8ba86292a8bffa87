// What linear_distill.cu (planning, the row-chunk schedules, the entry points) and
// linear_distill_blocks.cu (the vocabulary-blocked passes) share of one call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/plan/chunk_plan.hpp"
#include "cuda/rows/distill_rows.cuh"
#include "cuda/core/gemm.hpp"
#include "cuda/linear/linear_support.hpp"
#include "xent/linear_distill.hpp"

namespace xent::cuda {

struct LinearDistillPlan {
  ChunkPlan chunks;
  DType logits_dtype = DType::bf16;
  bool teacher_buffer = false;  // teacher rows are formed (or converted) into the workspace
};

// One call of the op: the forward (loss, optional gradients) or the backward (gradients only).
struct LinearDistillCall {
  TensorView student_hidden, student_weight;
  const Teacher& teacher;
  TensorView target;
  const LinearDistillOptions& options;
  TensorView grad_output{};
  const TensorView* loss = nullptr;
  LinearGradients grads{};
  OpCode op = OpCode::linear_distill_forward;
};

// What the passes of one call share.
struct DistillPasses {
  const LinearDistillCall& call;
  const LinearDistillPlan& plan;
  GemmScratch scratch;
  const CeBatchTotals* totals;
  DistillRowOptions row_options;
  bool per_row_upstream;
};

// The teacher rows [first, first + count) and columns [first_column, first_column + columns):
// formed as h_t·W_tᵀ into `buffer`, converted into `buffer`, or read where the caller's teacher
// logits sit. Returns the rows and sets their row stride.
const void* teacher_rows(const DistillPasses& pass, int64_t first, int64_t count,
                         int64_t first_column, int64_t columns, void* buffer, int64_t& stride,
                         cudaStream_t stream);

// Pass 2 of the vocabulary-blocked schedules (linear_block_pass.hpp): per block of vocabulary
// columns, the student (and teacher) logits of the block again and the block's gradient
// elementwise from the row statistics of pass 1, then ∂W of the block, and in schedule (d) its
// share of ∂h summed in fp32 at `hidden_sums` (null: ∂h formed in pass 1, or not wanted).
void run_block_pass(const DistillPasses& pass, void* region, const DistillRowStatistics* statistics,
                    float* hidden_sums, cudaStream_t stream);

// The per-row loss parts of sum/mean (fp32 [N]); the hard term's are read only with a target.
struct DistillRowLosses {
  float* soft = nullptr;
  float* hard_loss = nullptr;
  float* hard_z = nullptr;
};

// The batch totals and the row loss parts, first in every schedule's workspace (their bytes are
// the plan's fixed bytes, row_scratch_bytes).
DistillRowLosses carve_row_losses(WorkspaceCarver& carver, int64_t rows, CeBatchTotals*& totals);

// The scalar loss of sum/mean from the row parts, when the call wants a loss (distill_reduce).
void reduce_distill_loss(const DistillPasses& pass, const DistillRowLosses& losses,
                         cudaStream_t stream);

// Schedule (d) (chunk_plan.hpp), the whole call: no row chunk at all.
void run_statistics_blocks(const LinearDistillCall& call, const LinearDistillPlan& plan,
                           Workspace workspace, cudaStream_t stream);

}  // namespace xent::cuda
