// What compute-sanitizer's racecheck makes of a shared-memory hand-over between warps, alone and
// provably ordered, in the two forms a kernel can use (the fused gradient's kernel,
// src/cuda/sm90/fused_epilogue_kernel.cuh): warps 0-1 store a tile, signal `full` and wait on `empty`
// before the next store; warps 2-3 signal `empty`, wait on `full` and read the tile. Every read
// is checked against its round on the host.
//   named:    bar.arrive on one side, bar.sync on the other (named barriers)
//   mbarrier: mbarrier.arrive by every thread, mbarrier.try_wait.parity (shared-memory barriers)
//   mbarrier-warp: the same, but one arrival per warp after __syncwarp (a count of warps)
// Run:
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/handoff scripts/probes/handoff_racecheck.cu
//   compute-sanitizer --tool racecheck /tmp/handoff named|mbarrier|mbarrier-warp
//   compute-sanitizer --tool synccheck /tmp/handoff named|mbarrier|mbarrier-warp
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

constexpr int kRounds = 8, kThreads = 128, kHalf = kThreads / 2;

namespace named {
constexpr int kFull = 1, kEmpty = 2;
__device__ __forceinline__ void arrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}
__device__ __forceinline__ void sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}

__global__ void handoff(int* wrong) {
  __shared__ int tile[kHalf];
  const int t = threadIdx.x;
  for (int round = 0; round < kRounds; ++round) {
    if (t < kHalf) {
      sync(kEmpty);  // the readers have read the previous round
      tile[t] = round * 1000 + t;
      arrive(kFull);
    } else {
      arrive(kEmpty);  // the previous round is read
      sync(kFull);
      const int u = t - kHalf;
      if (tile[kHalf - 1 - u] != round * 1000 + kHalf - 1 - u) atomicAdd(wrong, 1);
    }
  }
}
}  // namespace named

namespace mbarrier {
__device__ __forceinline__ uint32_t address(uint64_t* barrier) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(barrier));
}
__device__ __forceinline__ void init(uint64_t* barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(address(barrier)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void arrive(uint64_t* barrier) {
  asm volatile(
      "{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(
          address(barrier))
      : "memory");
}
__device__ __forceinline__ void wait(uint64_t* barrier, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "retry:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra retry;\n}" ::"r"(address(barrier)),
      "r"(parity)
      : "memory");
}

// per_warp: each warp arrives once, by its lane 0 after a __syncwarp.
__device__ __forceinline__ void arrive_from(uint64_t* barrier, bool per_warp) {
  if (!per_warp) {
    arrive(barrier);
    return;
  }
  __syncwarp();
  if (threadIdx.x % 32 == 0) arrive(barrier);
}

__global__ void handoff(int* wrong, bool per_warp) {
  __shared__ int tile[kHalf];
  __shared__ uint64_t full, empty;
  const int t = threadIdx.x;
  if (t == 0) {
    init(&full, per_warp ? kHalf / 32 : kHalf);
    init(&empty, per_warp ? kHalf / 32 : kHalf);
  }
  __syncthreads();
  for (int round = 0; round < kRounds; ++round) {
    if (t < kHalf) {
      if (round > 0) wait(&empty, (round - 1) & 1);  // the readers have read the previous round
      tile[t] = round * 1000 + t;
      arrive_from(&full, per_warp);
    } else {
      wait(&full, round & 1);
      const int u = t - kHalf;
      if (tile[kHalf - 1 - u] != round * 1000 + kHalf - 1 - u) atomicAdd(wrong, 1);
      arrive_from(&empty, per_warp);
    }
  }
}
}  // namespace mbarrier

int main(int argc, char** argv) {
  const char* form = argc > 1 ? argv[1] : "mbarrier";
  const bool use_named = std::strcmp(form, "named") == 0;
  const bool per_warp = std::strcmp(form, "mbarrier-warp") == 0;
  int* wrong = nullptr;
  cudaMalloc(&wrong, sizeof(int));
  cudaMemset(wrong, 0, sizeof(int));
  if (use_named) {
    named::handoff<<<4, kThreads>>>(wrong);
  } else {
    mbarrier::handoff<<<4, kThreads>>>(wrong, per_warp);
  }
  int host = -1;
  cudaMemcpy(&host, wrong, sizeof(int), cudaMemcpyDeviceToHost);
  const cudaError_t error = cudaGetLastError();
  std::printf("%s: wrong reads: %d (%s)\n", form, host,
              cudaGetErrorString(error));
  return host == 0 && error == cudaSuccess ? 0 : 1;
}
