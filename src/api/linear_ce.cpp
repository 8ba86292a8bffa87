// Public entry points of fused linear cross-entropy: validate, then dispatch by device.
#include "xent/linear_ce.hpp"

#include "api/argument_checker.hpp"
#include "api/backend.hpp"
#include "api/validate.hpp"

namespace xent {

std::size_t linear_ce_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                     const LinearCeOptions& options, Device device,
                                     bool with_gradients) {
  api::require_backend("linear_ce_workspace_size", device);
#if defined(XENT_WITH_CUDA)
  if (device.kind == DeviceKind::cuda) {
    return cuda::linear_ce_workspace_size(rows, hidden, vocab, dtype, options, with_gradients);
  }
#endif
  return cpu::linear_ce_workspace_size(rows, hidden, vocab, dtype, options, with_gradients);
}

void linear_ce_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                       const LinearCeOptions& options, const LinearCeOutputs& out,
                       TensorView grad_output, Workspace workspace, Stream stream) {
  api::validate_linear_ce_forward(hidden, weight, bias, target, options, out, grad_output,
                                  workspace);
  api::require_backend("linear_ce_forward", hidden.device);
#if defined(XENT_WITH_CUDA)
  if (hidden.device.kind == DeviceKind::cuda) {
    return cuda::linear_ce_forward(hidden, weight, bias, target, options, out, grad_output,
                                   workspace, stream);
  }
#endif
  cpu::linear_ce_forward(hidden, weight, bias, target, options, out, grad_output, workspace,
                         stream);
}

void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView lse, TensorView grad_output, const LinearCeOptions& options,
                        const LinearGradients& grads, Workspace workspace, Stream stream) {
  linear_ce_backward(hidden, weight, bias, target, lse, grad_output, EntropyGradient{}, options,
                     grads, workspace, stream);
}

void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView lse, TensorView grad_output, const EntropyGradient& entropy,
                        const LinearCeOptions& options, const LinearGradients& grads,
                        Workspace workspace, Stream stream) {
  api::validate_linear_ce_backward(hidden, weight, bias, target, lse, grad_output, options, grads,
                                   workspace);
  api::validate_entropy_gradient("linear_ce_backward", hidden.device, hidden.dtype, entropy, lse,
                                 options.ce.reduction, hidden.rows);
  api::require_backend("linear_ce_backward", hidden.device);
#if defined(XENT_WITH_CUDA)
  if (hidden.device.kind == DeviceKind::cuda) {
    return cuda::linear_ce_backward(hidden, weight, bias, target, lse, grad_output, entropy,
                                    options, grads, workspace, stream);
  }
#endif
  cpu::linear_ce_backward(hidden, weight, bias, target, lse, grad_output, entropy, options, grads,
                          workspace, stream);
}

}  // namespace xent
