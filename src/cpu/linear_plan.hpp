// How the CPU linear ops (docs/semantics.md §2, §4) split their rows into chunks and lay out their
// workspace. Shared with src/api, which validates budgets and workspaces against it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xent/types.hpp"

namespace xent::cpu {

// Sizes of one linear call. teacher_hidden > 0 means a teacher given as hidden·weightᵀ;
// teacher_logits a teacher given as logits (distillation only).
struct LinearShape {
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
  DType dtype = DType::f32;  // dtype of hidden and weight
  bool distill = false;
  int64_t teacher_hidden = 0;
  bool with_gradients = false;
  // ∂W added chunk by chunk into a 16-bit output (WeightGradAccumulation::weight_dtype): a staging
  // block of kWeightGradBlockRows rows of ∂W in the compute type instead of a V×H accumulator.
  bool weight_dtype_accumulation = false;
};

constexpr int64_t kWeightGradBlockRows = 128;

// Every buffer is placed at a 64-byte boundary; `alignment` bytes of slack per buffer are counted
// so a caller's workspace need not be aligned.
struct LinearPlan {
  static constexpr std::size_t alignment = 64;
  std::size_t compute_size = 4;  // bytes of the compute type (4, or 8 for fp64)
  int64_t chunk_rows = 0;        // rows per chunk (0 when rows = 0)
  std::size_t row_bytes = 0;     // chunk-buffer bytes per row: the smallest budget is this
  // Fixed buffers (not part of the chunk budget).
  std::size_t weight_copy = 0;              // V·H weight in the compute type (non-fp32 inputs)
  std::size_t bias_copy = 0;                // V
  std::size_t teacher_weight_copy = 0;      // V·H_t
  std::size_t grad_weight_accumulator = 0;  // V·H (non-fp32 weight gradients), or a staging block
  std::size_t grad_bias_accumulator = 0;    // V
  // Chunk buffers: logits (and their gradient, in place), hidden copy, hidden gradient, and for
  // distillation teacher logits and teacher hidden copy.
  std::size_t logits = 0, hidden_copy = 0, grad_hidden = 0, teacher_logits = 0,
              teacher_hidden_copy = 0;

  std::size_t total_bytes() const;
};

// Bytes of chunk buffers one row needs; a budget below this cannot hold a single row.
std::size_t linear_row_bytes(const LinearShape& shape);

// The plan for a budget (which must be at least linear_row_bytes).
LinearPlan plan_linear(const LinearShape& shape, std::size_t budget);

}  // namespace xent::cpu
