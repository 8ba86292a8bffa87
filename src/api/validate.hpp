// Validation of every public entry point (docs/semantics.md §1–§4 errors). Each function throws
// xent::Error(invalid_argument) with the project's message format before anything is written, so
// backends receive only arguments they can process.
#pragma once

#include <cstddef>

#include "xent/xent.hpp"

namespace xent::api {

void validate_ce_forward(const TensorView& logits, const TensorView& target,
                         const CeOptions& options, const CeOutputs& out,
                         const TensorView& grad_output, const Workspace& workspace);
void validate_ce_backward(const TensorView& logits, const TensorView& target, const TensorView& lse,
                          const TensorView& grad_output, const CeOptions& options,
                          const TensorView& grad_logits, const Workspace& workspace);
// The entropy term of a backward (ce.hpp EntropyGradient): reduction none, lse present, and
// entropy and grad [N] fp32 on the op's device. Nothing is checked when it is absent.
void validate_entropy_gradient(const char* function, Device device, DType input,
                               const EntropyGradient& entropy, const TensorView& lse,
                               Reduction reduction, int64_t rows);

void validate_distill_forward(const TensorView& student, const TensorView& teacher,
                              const TensorView& target, const DistillOptions& options,
                              const DistillOutputs& out, const TensorView& grad_output,
                              const Workspace& workspace);
void validate_distill_backward(const TensorView& student, const TensorView& teacher,
                               const TensorView& target, const TensorView& grad_output,
                               const DistillOptions& options, const TensorView& grad_student,
                               const Workspace& workspace);

void validate_distill_topk_forward(const TensorView& student, const TopKTeacher& teacher,
                                   const TensorView& target, const DistillOptions& options,
                                   const DistillOutputs& out, const TensorView& grad_output,
                                   const Workspace& workspace);
void validate_distill_topk_backward(const TensorView& student, const TopKTeacher& teacher,
                                    const TensorView& target, const TensorView& grad_output,
                                    const DistillOptions& options, const TensorView& grad_student,
                                    const Workspace& workspace);

void validate_linear_ce_forward(const TensorView& hidden, const TensorView& weight,
                                const TensorView& bias, const TensorView& target,
                                const LinearCeOptions& options, const LinearCeOutputs& out,
                                const TensorView& grad_output, const Workspace& workspace);
void validate_linear_ce_backward(const TensorView& hidden, const TensorView& weight,
                                 const TensorView& bias, const TensorView& target,
                                 const TensorView& lse, const TensorView& grad_output,
                                 const LinearCeOptions& options, const LinearGradients& grads,
                                 const Workspace& workspace);

void validate_linear_policy_forward(const TensorView& hidden, const TensorView& weight,
                                    const TensorView& bias, const TensorView& target,
                                    const PolicyTokens& tokens, const LinearPolicyOptions& options,
                                    const LinearPolicyOutputs& out, const Workspace& workspace);

void validate_linear_distill_forward(const TensorView& student_hidden,
                                     const TensorView& student_weight, const Teacher& teacher,
                                     const TensorView& target, const LinearDistillOptions& options,
                                     const LinearDistillOutputs& out, const TensorView& grad_output,
                                     const Workspace& workspace);
void validate_linear_distill_backward(const TensorView& student_hidden,
                                      const TensorView& student_weight, const Teacher& teacher,
                                      const TensorView& target, const TensorView& grad_output,
                                      const LinearDistillOptions& options,
                                      const LinearGradients& grads, const Workspace& workspace);

}  // namespace xent::api
