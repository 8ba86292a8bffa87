// Fused linear cross-entropy on CUDA (SPEC.md §2). Placeholder until the chunked path lands.
#include "api/backend.hpp"

namespace xent::cuda {

namespace {
[[noreturn]] void not_implemented(const char* function) {
  throw Error(ErrorKind::runtime, std::string(function) + ": CUDA path not implemented yet");
}
}  // namespace

std::size_t linear_ce_workspace_size(int64_t, int64_t, int64_t, DType, const LinearCeOptions&,
                                     bool) {
  not_implemented("linear_ce_workspace_size");
}
void linear_ce_forward(TensorView, TensorView, TensorView, TensorView, const LinearCeOptions&,
                       const LinearCeOutputs&, TensorView, Workspace, Stream) {
  not_implemented("linear_ce_forward");
}
void linear_ce_backward(TensorView, TensorView, TensorView, TensorView, TensorView, TensorView,
                        const LinearCeOptions&, const LinearGradients&, Workspace, Stream) {
  not_implemented("linear_ce_backward");
}

}  // namespace xent::cuda
