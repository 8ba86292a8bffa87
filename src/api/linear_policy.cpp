// Public entry point of the fused linear policy loss: validate, then run the CPU backend (the
// only one today; validation rejects other devices).
#include "api/backend.hpp"
#include "api/validate.hpp"

namespace xent {

void linear_policy_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                           const PolicyTokens& tokens, const LinearPolicyOptions& options,
                           const LinearPolicyOutputs& out, Workspace workspace, Stream stream) {
  api::validate_linear_policy_forward(hidden, weight, bias, target, tokens, options, out,
                                      workspace);
  cpu::linear_policy_forward(hidden, weight, bias, target, tokens, options, out, workspace, stream);
}

}  // namespace xent
