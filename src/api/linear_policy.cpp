// Public entry points of the fused linear policy loss: validate, then dispatch by device.
#include "api/argument_checker.hpp"
#include "api/backend.hpp"
#include "api/validate.hpp"

namespace xent {

std::size_t linear_policy_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                         const LinearPolicyOptions& options, Device device,
                                         bool with_gradients) {
  api::require_backend("linear_policy_workspace_size", device);
#if defined(XENT_WITH_CUDA)
  if (device.kind == DeviceKind::cuda) {
    return cuda::linear_policy_workspace_size(rows, hidden, vocab, dtype, options, with_gradients);
  }
#endif
  return cpu::linear_policy_workspace_size(rows, hidden, vocab, dtype, options, with_gradients);
}

void linear_policy_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                           const PolicyTokens& tokens, const LinearPolicyOptions& options,
                           const LinearPolicyOutputs& out, Workspace workspace, Stream stream) {
  api::validate_linear_policy_forward(hidden, weight, bias, target, tokens, options, out,
                                      workspace);
  api::require_backend("linear_policy_forward", hidden.device);
#if defined(XENT_WITH_CUDA)
  if (hidden.device.kind == DeviceKind::cuda) {
    return cuda::linear_policy_forward(hidden, weight, bias, target, tokens, options, out,
                                       workspace, stream);
  }
#endif
  cpu::linear_policy_forward(hidden, weight, bias, target, tokens, options, out, workspace, stream);
}

}  // namespace xent
