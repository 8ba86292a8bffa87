// What the runners of the CUDA linear_ce share of one call (linear_ce.cu dispatches,
// linear_ce_row_chunks.cu runs schedules (a)-(c)'s row chunks, linear_ce_blocks.cu the
// vocabulary-blocked pass and schedule (d)).
#pragma once

#include <cuda_runtime.h>

#include "api/backend.hpp"
#include "cuda/linear/linear_block_grad.cuh"
#include "cuda/linear/linear_block_pass.hpp"
#include "cuda/plan/linear_ce_planning.hpp"
#include "cuda/rows/ce_rows.cuh"

namespace xent::cuda {

// One call of the op: the forward (loss, statistics, optional gradients) or the backward
// (gradients only, per-row or scalar upstream gradient).
struct LinearCeCall {
  TensorView hidden, weight, bias, target;
  const LinearCeOptions& options;
  TensorView grad_output{};
  const TensorView* loss = nullptr;
  const CeStats* stats = nullptr;
  LinearGradients grads{};
  OpCode op = OpCode::linear_ce_forward;
  // Backward with the entropy term (ce.hpp EntropyGradient): the forward's lse and H make every
  // chunk's gradient elementwise (ce_grad.cuh, block_grad_from_lse), one pass, no row statistics.
  TensorView lse{};
  EntropyGradient entropy{};
};

// What pass 2 of the vocabulary-blocked schedule (linear_block_pass.hpp) needs of the call.
struct CeBlockPass {
  const LinearCeCall& call;
  const LinearCePlan& plan;
  void* region;      // tile buffer, then the block accumulator
  const float* lse;  // [N] from pass 1
  GemmScratch scratch;
  const CeBatchTotals* totals;
  CeRowOptions row_options;
  bool per_row_upstream;
  bool read_cache;
  float* hidden_accumulator = nullptr;  // schedule (d)
  CeGradRecord* records = nullptr;      // [N], for the fused gradient product
  bool records_formed = false;          // pass 1 formed them already, from the same lse
};

// How a call's row chunks take the per-row reference path (linear_reference.cuh).
struct ReferenceUse {
  bool on = false;
  // The ∂h product's fp32 rows in the memory of the 16-bit ∂W output (which holds nothing until
  // the chunk's ∂W product, or the end, writes it) instead of the chunk's scratch.
  bool hidden_product_in_weight_grad = false;
};

// ∂W block by block; each block's gradient comes from the lse of pass 1, through the fused
// gradient product where eligible, else elementwise over cuBLASLt logits.
void run_block_pass(const CeBlockPass& pass, cudaStream_t stream, float* bias_sums = nullptr);

// Whether the blocks of this call form their gradients with the fused gradient product
// (fused_grad.cuh) instead of cuBLASLt logits and the elementwise block kernel (all_cached: every
// row's logits are read from a cache, so none is formed).
bool fused_gradient_eligible(const LinearCeCall& call, bool all_cached);

// The gradient of `tile` by the fused gradient product; false, having launched nothing, if it
// declines.
bool fused_tile_gradient(const CeBlockPass& pass, const BlockTile& tile, cudaStream_t stream);

// The gradient records of all rows (ce_grad_records) into pass.records, from pass.lse.
void form_grad_records(const CeBlockPass& pass, cudaStream_t stream);

// The batch pre-pass of every schedule: N_valid, D and the scalar upstream gradient.
void batch_totals(const LinearCeCall& call, CeBatchTotals* totals, cudaStream_t stream);

// Schedule (d); false, having launched nothing, when the fused product declines.
bool run_statistics_blocks(const LinearCeCall& call, const LinearCePlan& plan, Workspace workspace,
                           cudaStream_t stream);

// Schedules (a)-(c): row chunks of logits by cuBLASLt and the ce row kernel, or (a) and (b)
// through the per-row reference path where `reference` says so.
void run_row_chunks(const LinearCeCall& call, const LinearCePlan& plan, Workspace workspace,
                    cudaStream_t stream, const ReferenceUse& reference);

}  // namespace xent::cuda
