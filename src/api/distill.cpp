// Public entry points of distillation on logits: validate, then dispatch by device.
#include "xent/distill.hpp"

#include "api/argument_checker.hpp"
#include "api/backend.hpp"
#include "api/validate.hpp"

namespace xent {

std::size_t distill_workspace_size(int64_t rows, int64_t vocab, const DistillOptions& options,
                                   Device device) {
  api::require_backend("distill_workspace_size", device);
#if defined(XENT_WITH_CUDA)
  if (device.kind == DeviceKind::cuda) return cuda::distill_workspace_size(rows, vocab, options);
#endif
  return cpu::distill_workspace_size(rows, vocab, options);
}

void distill_forward(TensorView student, TensorView teacher, TensorView target,
                     const DistillOptions& options, const DistillOutputs& out,
                     TensorView grad_output, Workspace workspace, Stream stream) {
  api::validate_distill_forward(student, teacher, target, options, out, grad_output, workspace);
  api::require_backend("distill_forward", student.device);
#if defined(XENT_WITH_CUDA)
  if (student.device.kind == DeviceKind::cuda) {
    return cuda::distill_forward(student, teacher, target, options, out, grad_output, workspace,
                                 stream);
  }
#endif
  cpu::distill_forward(student, teacher, target, options, out, grad_output, workspace, stream);
}

void distill_backward(TensorView student, TensorView teacher, TensorView target,
                      TensorView grad_output, const DistillOptions& options,
                      TensorView grad_student, Workspace workspace, Stream stream) {
  api::validate_distill_backward(student, teacher, target, grad_output, options, grad_student,
                                 workspace);
  api::require_backend("distill_backward", student.device);
#if defined(XENT_WITH_CUDA)
  if (student.device.kind == DeviceKind::cuda) {
    return cuda::distill_backward(student, teacher, target, grad_output, options, grad_student,
                                  workspace, stream);
  }
#endif
  cpu::distill_backward(student, teacher, target, grad_output, options, grad_student, workspace,
                        stream);
}

namespace {
// Top-k teachers (docs/semantics.md §3.1): the CPU backend, or the CUDA row kernel.
void run_distill_topk(TensorView student, const TopKTeacher& teacher, TensorView target,
                      const DistillOptions& options, TensorView loss, TensorView grad,
                      TensorView grad_output, Workspace workspace, Stream stream) {
#if defined(XENT_WITH_CUDA)
  if (student.device.kind == DeviceKind::cuda) {
    return cuda::distill_topk(student, teacher, target, options, loss, grad, grad_output, workspace,
                              stream);
  }
#else
  (void)workspace;
  (void)stream;
#endif
  cpu::distill_topk(student, teacher, target, options, loss, grad, grad_output);
}
}  // namespace

void distill_topk_forward(TensorView student, const TopKTeacher& teacher, TensorView target,
                          const DistillOptions& options, const DistillOutputs& out,
                          TensorView grad_output, Workspace workspace, Stream stream) {
  api::validate_distill_topk_forward(student, teacher, target, options, out, grad_output,
                                     workspace);
  api::require_backend("distill_topk_forward", student.device);
  run_distill_topk(student, teacher, target, options, out.loss, out.grad_student, grad_output,
                   workspace, stream);
}

void distill_topk_backward(TensorView student, const TopKTeacher& teacher, TensorView target,
                           TensorView grad_output, const DistillOptions& options,
                           TensorView grad_student, Workspace workspace, Stream stream) {
  api::validate_distill_topk_backward(student, teacher, target, grad_output, options, grad_student,
                                      workspace);
  api::require_backend("distill_topk_backward", student.device);
  run_distill_topk(student, teacher, target, options, TensorView{}, grad_student, grad_output,
                   workspace, stream);
}

}  // namespace xent
