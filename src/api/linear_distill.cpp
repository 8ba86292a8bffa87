// Public entry points of fused linear distillation: validate, then dispatch by device.
#include "xent/linear_distill.hpp"

#include "api/argument_checker.hpp"
#include "api/backend.hpp"
#include "api/validate.hpp"

namespace xent {

std::size_t linear_distill_workspace_size(int64_t rows, int64_t student_hidden,
                                          int64_t teacher_hidden, int64_t vocab, DType dtype,
                                          const LinearDistillOptions& options, Device device,
                                          bool with_gradients) {
  api::require_backend("linear_distill_workspace_size", device);
#if defined(XENT_WITH_CUDA)
  if (device.kind == DeviceKind::cuda) {
    return cuda::linear_distill_workspace_size(rows, student_hidden, teacher_hidden, vocab, dtype,
                                               options, with_gradients);
  }
#endif
  return cpu::linear_distill_workspace_size(rows, student_hidden, teacher_hidden, vocab, dtype,
                                            options, with_gradients);
}

void linear_distill_forward(TensorView student_hidden, TensorView student_weight,
                            const Teacher& teacher, TensorView target,
                            const LinearDistillOptions& options, const LinearDistillOutputs& out,
                            TensorView grad_output, Workspace workspace, Stream stream) {
  api::validate_linear_distill_forward(student_hidden, student_weight, teacher, target, options,
                                       out, grad_output, workspace);
  api::require_backend("linear_distill_forward", student_hidden.device);
#if defined(XENT_WITH_CUDA)
  if (student_hidden.device.kind == DeviceKind::cuda) {
    return cuda::linear_distill_forward(student_hidden, student_weight, teacher, target, options,
                                        out, grad_output, workspace, stream);
  }
#endif
  cpu::linear_distill_forward(student_hidden, student_weight, teacher, target, options, out,
                              grad_output, workspace, stream);
}

void linear_distill_backward(TensorView student_hidden, TensorView student_weight,
                             const Teacher& teacher, TensorView target, TensorView grad_output,
                             const LinearDistillOptions& options, const LinearGradients& grads,
                             Workspace workspace, Stream stream) {
  api::validate_linear_distill_backward(student_hidden, student_weight, teacher, target,
                                        grad_output, options, grads, workspace);
  api::require_backend("linear_distill_backward", student_hidden.device);
#if defined(XENT_WITH_CUDA)
  if (student_hidden.device.kind == DeviceKind::cuda) {
    return cuda::linear_distill_backward(student_hidden, student_weight, teacher, target,
                                         grad_output, options, grads, workspace, stream);
  }
#endif
  cpu::linear_distill_backward(student_hidden, student_weight, teacher, target, grad_output,
                               options, grads, workspace, stream);
}

}  // namespace xent
