// Public entry points of cross-entropy on logits: validate, then dispatch by device.
#include "xent/ce.hpp"

#include "api/argument_checker.hpp"
#include "api/backend.hpp"
#include "api/validate.hpp"

namespace xent {

std::size_t ce_workspace_size(int64_t rows, int64_t vocab, const CeOptions& options,
                              Device device) {
  api::require_backend("ce_workspace_size", device);
#if defined(XENT_WITH_CUDA)
  if (device.kind == DeviceKind::cuda) return cuda::ce_workspace_size(rows, vocab, options);
#endif
  return cpu::ce_workspace_size(rows, vocab, options);
}

void ce_forward(TensorView logits, TensorView target, const CeOptions& options,
                const CeOutputs& out, TensorView grad_output, Workspace workspace, Stream stream) {
  api::validate_ce_forward(logits, target, options, out, grad_output, workspace);
  api::require_backend("ce_forward", logits.device);
#if defined(XENT_WITH_CUDA)
  if (logits.device.kind == DeviceKind::cuda) {
    return cuda::ce_forward(logits, target, options, out, grad_output, workspace, stream);
  }
#endif
  cpu::ce_forward(logits, target, options, out, grad_output, workspace, stream);
}

void ce_backward(TensorView logits, TensorView target, TensorView lse, TensorView grad_output,
                 const CeOptions& options, TensorView grad_logits, Workspace workspace,
                 Stream stream) {
  ce_backward(logits, target, lse, grad_output, EntropyGradient{}, options, grad_logits, workspace,
              stream);
}

void ce_backward(TensorView logits, TensorView target, TensorView lse, TensorView grad_output,
                 const EntropyGradient& entropy, const CeOptions& options, TensorView grad_logits,
                 Workspace workspace, Stream stream) {
  api::validate_ce_backward(logits, target, lse, grad_output, options, grad_logits, workspace);
  api::validate_entropy_gradient("ce_backward", logits.device, logits.dtype, entropy, lse,
                                 options.reduction, logits.rows);
  api::require_backend("ce_backward", logits.device);
#if defined(XENT_WITH_CUDA)
  if (logits.device.kind == DeviceKind::cuda) {
    return cuda::ce_backward(logits, target, lse, grad_output, entropy, options, grad_logits,
                             workspace, stream);
  }
#endif
  cpu::ce_backward(logits, target, lse, grad_output, entropy, options, grad_logits, workspace,
                   stream);
}

}  // namespace xent
