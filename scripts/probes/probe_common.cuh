// What the standalone probes of this folder share: a check that exits on the first failed CUDA,
// cuBLAS or cuBLASLt call, and a hashed fill of bf16 buffers. Each probe builds alone with the
// nvcc line in its header comment.
#pragma once

#include <cuda_bf16.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                              \
  do {                                                                           \
    auto status_ = (call);                                                       \
    if (static_cast<int>(status_) != 0) {                                        \
      std::fprintf(stderr, "%s failed: %d\n", #call, static_cast<int>(status_)); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

// x[i] = low + span · (a hash of i and seed, uniform in [0, 1)), grid-stride.
__global__ void fill(__nv_bfloat16* x, long count, unsigned seed, float low = -0.5f,
                     float span = 1.0f) {
  for (long i = blockIdx.x * long{blockDim.x} + threadIdx.x; i < count;
       i += long{gridDim.x} * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    x[i] = __float2bfloat16(low + span * ((h & 0xffff) / 65536.0f));
  }
}
