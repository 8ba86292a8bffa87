// The device-side error state for out-of-range targets (docs/semantics.md §1: a GPU op cannot read targets
// on the host without a synchronisation) and check_errors, which reads and clears it.
#include <atomic>
#include <string>

#include "api/backend.hpp"
#include "cuda/core/device.cuh"

namespace xent::cuda {

namespace {
// One per device: a __device__ variable is instantiated in every context that loads the module.
__device__ DeviceErrorState g_error_state;
}  // namespace

const char* op_name(OpCode op) {
  switch (op) {
    case OpCode::ce_forward:
      return "ce_forward";
    case OpCode::ce_backward:
      return "ce_backward";
    case OpCode::distill_forward:
      return "distill_forward";
    case OpCode::distill_backward:
      return "distill_backward";
    case OpCode::linear_ce_forward:
      return "linear_ce_forward";
    case OpCode::linear_ce_backward:
      return "linear_ce_backward";
    case OpCode::linear_distill_forward:
      return "linear_distill_forward";
    case OpCode::linear_distill_backward:
      return "linear_distill_backward";
    case OpCode::linear_policy_forward:
      return "linear_policy_forward";
    case OpCode::none:
      break;
  }
  return "xent";
}

DeviceErrorState* device_error_state() {
  // Looked up once per device: ops run under graph capture, where a first-time symbol lookup
  // (which may load the module) is best kept out of the captured region.
  constexpr int kMaxDevices = 64;
  static std::atomic<DeviceErrorState*> cache[kMaxDevices] = {};
  int device = 0;
  XENT_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kMaxDevices) {
    if (DeviceErrorState* known = cache[device].load(std::memory_order_acquire)) return known;
  }
  void* address = nullptr;
  XENT_CUDA_CHECK(cudaGetSymbolAddress(&address, g_error_state));
  if (device < kMaxDevices) {
    cache[device].store(static_cast<DeviceErrorState*>(address), std::memory_order_release);
  }
  return static_cast<DeviceErrorState*>(address);
}

void check_errors(Device device, Stream stream) {
  DeviceGuard guard(device.index);
  const cudaStream_t s = stream_of(stream);
  DeviceErrorState* state = device_error_state();
  DeviceErrorState host{};
  XENT_CUDA_CHECK(cudaMemcpyAsync(&host, state, sizeof host, cudaMemcpyDeviceToHost, s));
  XENT_CUDA_CHECK(cudaStreamSynchronize(s));
  if (!host.pending) return;
  XENT_CUDA_CHECK(cudaMemsetAsync(state, 0, sizeof host, s));
  XENT_CUDA_CHECK(cudaStreamSynchronize(s));
  // Same words and kind as the CPU backend's check (src/api), which reports the case at once:
  // a bad target is the caller's argument (ValueError in Python on either device).
  throw Error(ErrorKind::invalid_argument,
              std::string(op_name(static_cast<OpCode>(host.op))) +
                  ": target out of range: got target[" + std::to_string(host.row) +
                  "] = " + std::to_string(host.value) + "; expected a class index in [0, " +
                  std::to_string(host.vocab) + ") or ignore_index (" +
                  std::to_string(host.ignore_index) + ")");
}

}  // namespace xent::cuda
