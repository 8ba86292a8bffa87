// What the GPU-only suites share (they link the CUDA runtime; the shared suites do not).
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/arch.hpp"

namespace xent::test {

// Whether device 0 takes the Hopper paths (src/cuda/core/arch.hpp), where the fused sm_90a
// products, clusters and the reference path run: compute capability 9.0, a build with sm_90
// code, the portable paths not forced.
inline bool hopper_paths_here() { return cuda::hopper_paths(0); }

}  // namespace xent::test
