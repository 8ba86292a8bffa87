// CUDA cross-entropy on logits (SPEC.md §1). Kernels land here; until then the ops report that.
#include "api/backend.hpp"

namespace xent::cuda {

namespace {
[[noreturn]] void not_implemented(const char* op) {
  throw Error(ErrorKind::runtime, std::string(op) + ": CUDA kernel not implemented yet");
}
}  // namespace

std::size_t ce_workspace_size(int64_t, int64_t, const CeOptions&) { return 0; }
void ce_forward(TensorView, TensorView, const CeOptions&, const CeOutputs&, TensorView, Workspace,
                Stream) {
  not_implemented("ce_forward");
}
void ce_backward(TensorView, TensorView, TensorView, TensorView, const CeOptions&, TensorView,
                 Workspace, Stream) {
  not_implemented("ce_backward");
}

std::size_t distill_workspace_size(int64_t, int64_t, const DistillOptions&) { return 0; }
void distill_forward(TensorView, TensorView, TensorView, const DistillOptions&,
                     const DistillOutputs&, TensorView, Workspace, Stream) {
  not_implemented("distill_forward");
}
void distill_backward(TensorView, TensorView, TensorView, TensorView, const DistillOptions&,
                      TensorView, Workspace, Stream) {
  not_implemented("distill_backward");
}


}  // namespace xent::cuda
