// torch op xent::check_errors: reports what CUDA kernels flagged (out-of-range targets) since the
// last check, with the CPU backend's message. Synchronises the stream, so it is never called by
// the loss ops themselves; users call it (xent.check_errors) or set XENT_VALIDATE=1.
#include <c10/core/DeviceGuard.h>

#include "binding_support.hpp"
#if XENT_TORCH_CUDA
#include "cuda/test_hook.hpp"
#endif

namespace xent::torch_binding {
namespace {

void check_errors_op(const at::Tensor& device_tensor) {
  translate_errors([&] {
    c10::DeviceGuard guard(device_tensor.device());
    check_errors(xent_device(device_tensor), current_stream(device_tensor));
  });
}

#if XENT_TORCH_CUDA
// Not API: the Python tests and benchmarks force the portable paths (src/cuda/core/arch.hpp) on a
// Hopper GPU through the core's test hook, as the C++ suites do.
void force_portable_paths_op(bool on) {
  cuda::test_hook().portable_paths = on ? cuda::Forced::on : cuda::Forced::planned;
}

// Not API: which cuBLASLt products are timed (0 the default, 1 none, 2 all), for measuring what
// the timing buys and whether it makes a call's algorithm depend on the process's history. Read
// as each product configuration is first met, so set before the first call.
void set_gemm_tuning_op(int64_t mode) {
  cuda::test_hook().gemm_tuning = mode == 1   ? cuda::GemmTuning::off
                                  : mode == 2 ? cuda::GemmTuning::all
                                              : cuda::GemmTuning::planned;
}
#endif

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def("check_errors(Tensor device_tensor) -> ()");
  xent::torch_binding::impl_on_devices(m, "check_errors", &xent::torch_binding::check_errors_op);
#if XENT_TORCH_CUDA
  m.def("_force_portable_paths(bool on) -> ()", &xent::torch_binding::force_portable_paths_op);
  m.def("_set_gemm_tuning(int mode) -> ()", &xent::torch_binding::set_gemm_tuning_op);
#endif
}
