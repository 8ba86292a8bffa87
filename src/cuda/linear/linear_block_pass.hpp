// Pass 2 of the vocabulary-blocked schedule of the fused linear losses (chunk_plan.hpp, schedule
// (c)), written once for linear_ce.cu and linear_distill.cu: ∂W one block of vocabulary columns
// at a time, tiled over rows. Per tile: the block's logits again (h·Wᵀ (+ bias) by cuBLASLt into
// the tile buffer, or read from a logits cache), the loss's elementwise block gradient (the one
// step that differs between the losses, passed in), fp32 gradients narrowed to the operand dtype
// in place, then ∂W_block (+)= Gᵀ·h_tile. One tile of all N rows writes ∂W of the block straight
// into the output; several tiles accumulate in place (fp32 ∂W) or in the fp32 block accumulator,
// written back once per block (16-bit ∂W). An accumulated ∂W (fp32) is added to in place. In
// schedule (d) each tile also adds G·W_block to its rows of an fp32 ∂h accumulator, which may sit
// in ∂W rows not yet written (their blocks' ∂W then comes after ∂h), and its column sums to ∂bias.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

#include "cuda/linear/block_grad_tile.cuh"
#include "cuda/plan/chunk_plan.hpp"
#include "cuda/core/gemm.hpp"
#include "xent/types.hpp"

namespace xent::cuda {

// One tile of one block, as the block-gradient step sees it.
struct BlockTile {
  // Where the step writes the tile's gradient (the tile buffer, row stride `columns`, which may
  // be where the logits are), its columns of V and its dtype (the logits dtype).
  BlockGradTile gradient;
  int64_t first_row = 0;         // gradient.rows rows of the batch from here
  const void* logits = nullptr;  // the tile's logits: row 0 is first_row
  int64_t logits_stride = 0;
  // The tile region's second logits buffer (distillation's teacher rows), free for the step when
  // the plan has two logits buffers per row; it starts on the workspace alignment after the first.
  void* second_buffer = nullptr;
};

// Writes the gradient of `tile` into tile.gradient.grad on `stream`, after its logits are formed.
using BlockGradientStep = std::function<void(const BlockTile& tile, cudaStream_t stream)>;

// Forms the gradient of `tile` straight from h and W (a fused product, fused_grad.cuh) into
// tile.gradient.grad, in the operand dtype with row stride tile.gradient.columns, in place of the
// logits product, the block-gradient step and the narrowing; false, having launched nothing, when
// it cannot (the tile then takes those steps).
using FusedGradientStep = std::function<bool(const BlockTile& tile, cudaStream_t stream)>;

struct BlockPassInputs {
  TensorView hidden;        // h [N, H]: the product operand dtype
  TensorView weight;        // W [V, H]
  TensorView bias;          // [V] added to recomputed logits, or absent
  TensorView logits_cache;  // [N, V] logits read instead of recomputed, or absent
  TensorView weight_grad;   // ∂W [V, H], written
  // accumulate_weight (linear_ce.hpp): ∂W is added into weight_grad, an fp32 buffer, so every
  // block product adds (beta 1) and no block accumulator is ever used.
  bool add_to_weight_grad = false;
  ChunkPlan chunks;
  DType logits_dtype = DType::bf16;
  void* region = nullptr;  // the chunk region (chunk_region_bytes): tile buffers, then accumulator
  GemmScratch scratch;
  // Schedule (d) (chunk_plan.hpp): ∂h [N, H] summed over the blocks in fp32 here, each tile's
  // G·W_block added to its rows (the first block writes), then written to hidden_grad. Null: ∂h
  // is not formed in this pass. When the sums live in the last rows of weight_grad
  // (chunks.hidden_sums_in_weight_grad), the blocks from chunks.deferred_first_block on form
  // their gradient once for ∂h and once more for ∂W, after ∂h is written; the sums of rows
  // [0, chunks.hidden_sums_head_rows) are then in hidden_grad itself (fp32 rows from its start,
  // narrowed in place), and hidden_accumulator holds those of the rows after them.
  float* hidden_accumulator = nullptr;
  TensorView hidden_grad;
  // Tried first for every tile whose logits are not read from a cache, when set.
  FusedGradientStep fused_gradient;
  // ∂bias [V] in fp32, formed here as the column sums of every tile's gradient (schedule (d),
  // whose first pass forms no gradient), or null: (c) forms it in its first pass.
  float* bias_sums = nullptr;
};

void weight_gradient_by_blocks(const BlockPassInputs& pass, const BlockGradientStep& block_gradient,
                               cudaStream_t stream);

}  // namespace xent::cuda
