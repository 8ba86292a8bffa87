// What the GPU-only suites share (they link the CUDA runtime; the shared suites do not).
#pragma once

#include <cuda_runtime.h>

namespace xent::test {

// Whether device 0 is compute capability 9.0, where the fused Hopper products run.
inline bool device_is_sm90() {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major == 9 && minor == 0;
}

}  // namespace xent::test
