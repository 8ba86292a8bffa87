// The chunk plan the CUDA linear_ce takes for a call (linear_ce.cu). Plain C++, so the GPU test
// suite can assert which schedule (chunk_plan.hpp) its workspace budgets force.
#pragma once

#include <cstdint>

#include "cuda/plan/chunk_plan.hpp"
#include "xent/linear_ce.hpp"

namespace xent::cuda {

// Of `grads` only which gradients are present and their dtypes are read. statistics_product:
// the call can take the fused statistics product (fused_stats_eligible: sm_90, bf16/f16, no
// bias, ...), so schedule (d) is among the candidates.
ChunkPlan linear_ce_chunk_plan(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                               const LinearCeOptions& options, const LinearGradients& grads,
                               bool statistics_product = false);

// How many linear_ce calls (forward with gradients or backward) of this process ran each
// schedule: tests assert which one ran.
int64_t linear_ce_runs(Schedule schedule);

// How many fused gradient products (fused_grad.cuh) this process launched: tests assert the path
// ran.
int64_t fused_grad_count();

// How many row chunks took the per-row reference path (linear_reference.cuh) in this process:
// tests assert the path ran.
int64_t reference_chunk_count();

// The hidden size from which a call that asks for entropy, argmax or accuracy takes the reference
// path's statistics form. Its epilogue (three more sums per row, four rows at a time where the
// plain form takes eight) sets the product's pace at small H, where cuBLASLt logits and the row
// kernel are faster (docs/archive/perf-notes.md, decision 104). The test hook's reference_path
// = on takes it at every H.
constexpr int64_t kReferenceStatisticsMinHidden = 4096;

}  // namespace xent::cuda
