// Public entry point of scale_in_place: validate, then dispatch by device.
#include "xent/scale.hpp"

#include "api/argument_checker.hpp"
#include "api/backend.hpp"

namespace xent {

void scale_in_place(TensorView data, TensorView factor, Stream stream) {
  constexpr const char* function = "scale_in_place";
  const api::ArgumentChecker check(function, data.device);
  check.require_present(data, "data", "a [N, V] or [N] tensor");
  if (data.ndim == 2) {
    check.matrix(data, "data", -1, -1, "[N, V]");
  } else {
    check.vector(data, "data", -1, "[N, V] or [N]");
  }
  check.floating_input(data, "data");
  check.require_present(factor, "factor", "an fp32 scalar");
  check.scalar(factor, "factor");
  check.fp32(factor, "factor");
  check.same_device(factor, "factor");
  api::require_backend(function, data.device);
#if defined(XENT_WITH_CUDA)
  if (data.device.kind == DeviceKind::cuda) return cuda::scale_in_place(data, factor, stream);
#endif
  cpu::scale_in_place(data, factor, stream);
}

}  // namespace xent
