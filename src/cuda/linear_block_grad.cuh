// The cross-entropy gradient of one vocabulary block of logits, elementwise from a saved lse: the
// second pass of the vocabulary-blocked linear_ce schedule (chunk_plan.hpp, schedule (c)). The same
// per-row coefficients and element formula as the ce row kernel (common::ce_grad_row,
// common::ce_grad_from_prob), so both passes form one gradient.
#pragma once

#include "cuda/block_grad_tile.cuh"
#include "cuda/ce_rows.cuh"

namespace xent::cuda {

// The tile's gradient and geometry (BlockGradTile; grad may alias logits), and what it is
// formed of.
struct BlockGradArgs : BlockGradTile {
  const void* logits = nullptr;  // tile: [rows, columns] with logits_stride (row 0 = first row)
  int64_t logits_stride = 0;
  const void* target = nullptr;  // tile rows
  DType target_dtype = DType::i64;
  const float* lse = nullptr;               // tile rows, from the first pass
  const float* row_weight = nullptr;        // tile rows or null
  const float* grad_output_rows = nullptr;  // tile rows (reduction none) or null
  // Tile rows of the entropy term (ce.hpp EntropyGradient), or null: the forward's H and g_H.
  const float* entropy = nullptr;
  const float* grad_entropy = nullptr;
  CeRowOptions options;
  const CeBatchTotals* totals = nullptr;
};

void block_grad_from_lse(const BlockGradArgs& args, cudaStream_t stream);

}  // namespace xent::cuda
