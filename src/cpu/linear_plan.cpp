#include "cpu/linear_plan.hpp"

#include <algorithm>

namespace xent::cpu {
namespace {

std::size_t compute_size_of(DType dtype) { return dtype == DType::f64 ? 8 : 4; }

// Inputs already in the compute type are used in place; others get a converted copy.
bool needs_copy(DType dtype) { return dtype != DType::f32 && dtype != DType::f64; }

std::size_t padded(std::size_t bytes) { return bytes == 0 ? 0 : bytes + LinearPlan::alignment; }

}  // namespace

std::size_t linear_row_bytes(const LinearShape& shape) {
  const std::size_t t = compute_size_of(shape.dtype);
  const std::size_t h = static_cast<std::size_t>(shape.hidden);
  const std::size_t v = static_cast<std::size_t>(shape.vocab);
  std::size_t bytes = v * t + h * t + (shape.with_gradients ? h * t : 0);
  if (shape.distill) {
    bytes += v * t + static_cast<std::size_t>(shape.teacher_hidden) * t;
  }
  return bytes;
}

std::size_t LinearPlan::total_bytes() const {
  return padded(weight_copy) + padded(bias_copy) + padded(teacher_weight_copy) +
         padded(grad_weight_accumulator) + padded(grad_bias_accumulator) + padded(logits) +
         padded(hidden_copy) + padded(grad_hidden) + padded(teacher_logits) +
         padded(teacher_hidden_copy);
}

LinearPlan plan_linear(const LinearShape& shape, std::size_t budget) {
  LinearPlan plan;
  const std::size_t t = compute_size_of(shape.dtype);
  const std::size_t h = static_cast<std::size_t>(shape.hidden);
  const std::size_t v = static_cast<std::size_t>(shape.vocab);
  const std::size_t th = static_cast<std::size_t>(shape.teacher_hidden);
  plan.compute_size = t;
  plan.row_bytes = linear_row_bytes(shape);
  const int64_t fitting = static_cast<int64_t>(budget / std::max<std::size_t>(plan.row_bytes, 1));
  plan.chunk_rows = std::min(shape.rows, fitting);
  const std::size_t c = static_cast<std::size_t>(plan.chunk_rows);

  const bool copy = needs_copy(shape.dtype);
  if (copy) {
    plan.weight_copy = v * h * t;
    plan.bias_copy = shape.distill ? 0 : v * t;
    plan.teacher_weight_copy = v * th * t;
  }
  if (shape.with_gradients && copy) {
    const std::size_t accumulated_rows =
        shape.weight_dtype_accumulation
            ? std::min(v, static_cast<std::size_t>(kWeightGradBlockRows))
            : v;
    plan.grad_weight_accumulator = accumulated_rows * h * t;
    plan.grad_bias_accumulator = shape.distill ? 0 : v * t;
  }
  // The buffers are sized by the plan's row_bytes whatever the input dtype, so the chunk buffers
  // of a plan never exceed the budget it was made for.
  plan.logits = c * v * t;
  plan.hidden_copy = c * h * t;
  plan.grad_hidden = shape.with_gradients ? c * h * t : 0;
  if (shape.distill) {
    plan.teacher_logits = c * v * t;
    plan.teacher_hidden_copy = c * th * t;
  }
  return plan;
}

}  // namespace xent::cpu
