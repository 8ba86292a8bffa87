// Fused linear distillation on CUDA (SPEC.md §4). Placeholder until the chunked path lands.
#include "api/backend.hpp"

namespace xent::cuda {

namespace {
[[noreturn]] void not_implemented(const char* function) {
  throw Error(ErrorKind::runtime, std::string(function) + ": CUDA path not implemented yet");
}
}  // namespace

std::size_t linear_distill_workspace_size(int64_t, int64_t, int64_t, int64_t, DType,
                                          const LinearDistillOptions&, bool) {
  not_implemented("linear_distill_workspace_size");
}
void linear_distill_forward(TensorView, TensorView, const Teacher&, TensorView,
                            const LinearDistillOptions&, const LinearDistillOutputs&, TensorView,
                            Workspace, Stream) {
  not_implemented("linear_distill_forward");
}
void linear_distill_backward(TensorView, TensorView, const Teacher&, TensorView, TensorView,
                             const LinearDistillOptions&, const LinearGradients&, Workspace,
                             Stream) {
  not_implemented("linear_distill_backward");
}

}  // namespace xent::cuda
