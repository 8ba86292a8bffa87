// A sum (or minimum) over one CTA in a fixed shape, for the batch-wide one-CTA steps (ce_totals.cu,
// policy_rows.cu): one CTA and a fixed tree make the order of every addition fixed (bitwise
// reproducible) without atomics.
#pragma once

#include <cuda_runtime.h>

namespace xent::cuda {

constexpr int kBlockReduceThreads = 1024;

// A shuffle tree per warp, then warp 0 folds the 32 warp results with the same tree (the
// thread-0 loop this replaced was a 31-step dependent chain of shared-memory reads, about a
// microsecond per call at the end of every op). `scratch`: 32 values of shared memory. The
// result is valid in thread 0.
template <class T>
__device__ T block_reduce(T value, T* scratch, bool minimum = false) {
  auto warp_fold = [minimum](T v) {
    for (int offset = 16; offset > 0; offset /= 2) {
      const T other = __shfl_down_sync(0xffffffffu, v, offset);
      v = minimum ? (other < v ? other : v) : v + other;
    }
    return v;
  };
  value = warp_fold(value);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) value = warp_fold(scratch[lane]);
  return value;
}

}  // namespace xent::cuda
