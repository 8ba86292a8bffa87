#include "cuda/core/arch.hpp"

#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "cuda/test_hook.hpp"

namespace xent::cuda {
namespace {

enum Known : int8_t { unknown = 0, hopper = 1, portable = 2 };
constexpr int kMaxDevices = 64;
std::array<std::atomic<int8_t>, kMaxDevices> known{};

// Compiled like every row kernel: the code the device runs for it tells which code the build
// holds for that device. An sm_80 build on a Hopper GPU runs compute_80 PTX compiled by the
// driver (ptxVersion 80), which has no Hopper instruction in it.
__global__ void build_probe_kernel() {}

bool device_is_hopper(int device) {
  if (device < 0 || device >= kMaxDevices) return true;
  int8_t seen = known[device].load(std::memory_order_relaxed);
  if (seen == unknown) {
    int major = 0, minor = 0, current = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
        cudaGetDevice(&current) != cudaSuccess) {
      (void)cudaGetLastError();  // no such device: leave no error for the next check
      return true;
    }
    bool hopper_code = false;
    if (major == 9 && minor == 0) {
      // The attributes are those of the current device's code: ask on `device`.
      if (current != device && cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
      cudaFuncAttributes attributes{};
      hopper_code = cudaFuncGetAttributes(&attributes, build_probe_kernel) == cudaSuccess &&
                    attributes.ptxVersion >= 90;
      (void)cudaGetLastError();
      if (current != device) (void)cudaSetDevice(current);
    }
    seen = hopper_code ? hopper : portable;
    known[device].store(seen, std::memory_order_relaxed);
  }
  return seen == hopper;
}

}  // namespace

bool hopper_paths(int device) {
  return test_hook().portable_paths != Forced::on && device_is_hopper(device);
}

bool hopper_paths() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return test_hook().portable_paths != Forced::on;
  }
  return hopper_paths(device);
}

}  // namespace xent::cuda
