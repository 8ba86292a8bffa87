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

bool device_is_hopper(int device) {
  if (device < 0 || device >= kMaxDevices) return true;
  int8_t seen = known[device].load(std::memory_order_relaxed);
  if (seen == unknown) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      (void)cudaGetLastError();  // no such device: leave no error for the next check
      return true;
    }
    seen = major == 9 && minor == 0 ? hopper : portable;
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
