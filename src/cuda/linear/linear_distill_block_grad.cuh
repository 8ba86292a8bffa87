// The distillation gradient of one vocabulary block of logits, elementwise from the per-row
// statistics the distill row kernel exported in a first pass over whole rows (lse of student and
// teacher, Σ p_s·u, tvd's side sums, the hard term's lse): the second pass of the
// vocabulary-blocked linear_distill schedule (chunk_plan.hpp, schedule (c)). The per-row constants
// and the element formula are the row kernel's own (distill_rows.cuh: DistillGradRow,
// distill_element_grad), so both passes form one gradient.
#pragma once

#include "cuda/linear/block_grad_tile.cuh"
#include "cuda/rows/distill_rows.cuh"

namespace xent::cuda {

// The tile's gradient and geometry (BlockGradTile; grad may alias student), and what it is
// formed of.
struct DistillBlockGradArgs : BlockGradTile {
  const void* student = nullptr;  // tile: [rows, columns] with student_stride (row 0 = first row)
  int64_t student_stride = 0;
  const void* teacher = nullptr;  // the same rows and columns of the teacher, same dtype
  int64_t teacher_stride = 0;
  const void* target = nullptr;  // tile rows, or null (every row valid, no hard term)
  DType target_dtype = DType::i64;
  const DistillRowStatistics* statistics = nullptr;  // tile rows, from the first pass
  const float* row_weight = nullptr;                 // tile rows or null (hard term)
  const float* grad_output_rows = nullptr;           // tile rows (reduction none) or null
  DistillRowOptions options;
  const CeBatchTotals* totals = nullptr;
  // Vocabulary-parallel distill (distill_shard.cu): options.ce.class_weight holds the columns
  // from class_weight_first_column on (the local slice), and w_y of each row comes merged from
  // every rank (tile rows); null: w_y = class_weight[target].
  int64_t class_weight_first_column = 0;
  const float* target_weight = nullptr;
};

void distill_block_grad(const DistillBlockGradArgs& args, cudaStream_t stream);

}  // namespace xent::cuda
