// Fused linear distillation (docs/semantics.md §4): student logits s = h_s·W_sᵀ, teacher given as logits or
// as t = h_t·W_tᵀ computed chunk by chunk, never holding N×V.
#pragma once

#include "xent/distill.hpp"
#include "xent/linear_ce.hpp"

namespace xent {

// Either logits [N, V], or hidden [N, H_t] with weight [V, H_t]; never both.
struct Teacher {
  TensorView logits;
  TensorView hidden;
  TensorView weight;
};

struct LinearDistillOptions {
  DistillOptions distill;
  std::size_t workspace_budget = std::size_t{512} << 20;  // as in LinearCeOptions
  bool fp32_logits = false;
};

struct LinearDistillOutputs {
  TensorView loss;        // required: scalar (sum, mean) or [N] (none), result dtype (ce.hpp)
  LinearGradients grads;  // student hidden and weight; bias must be absent
};

std::size_t linear_distill_workspace_size(int64_t rows, int64_t student_hidden,
                                          int64_t teacher_hidden, int64_t vocab, DType dtype,
                                          const LinearDistillOptions& options, Device device,
                                          bool with_gradients);

void linear_distill_forward(TensorView student_hidden, TensorView student_weight,
                            const Teacher& teacher, TensorView target,
                            const LinearDistillOptions& options, const LinearDistillOutputs& out,
                            TensorView grad_output = {}, Workspace workspace = {},
                            Stream stream = {});

void linear_distill_backward(TensorView student_hidden, TensorView student_weight,
                             const Teacher& teacher, TensorView target, TensorView grad_output,
                             const LinearDistillOptions& options, const LinearGradients& grads,
                             Workspace workspace = {}, Stream stream = {});

}  // namespace xent
