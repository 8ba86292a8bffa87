// torch op xent::scale_ over xent::scale_in_place: the backward of a loss whose gradient was
// formed in the forward pass, applying the upstream scalar on the device without a host sync.
#include <c10/core/DeviceGuard.h>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

void scale_op(const at::Tensor& data, const at::Tensor& factor) {
  translate_errors([&] {
    constexpr const char* function = "scale_in_place";
    c10::DeviceGuard guard(data.device());
    require_in_place_rows(function, "data", data.dim() == 1 ? data.unsqueeze(0) : data);
    const at::Tensor factor32 = factor.to(at::kFloat).reshape({});
    scale_in_place(
        data.dim() == 1 ? vector_view(data, function, "data") : matrix_view(data, function, "data"),
        vector_view(factor32, function, "factor"), current_stream(data));
  });
}

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def("scale_(Tensor(a!) data, Tensor factor) -> ()");
  xent::torch_binding::impl_on_devices(m, "scale_", &xent::torch_binding::scale_op);
}
