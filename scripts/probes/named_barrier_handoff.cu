// What compute-sanitizer's racecheck makes of the shared-memory hand-over that the fused
// gradient's kernel (src/cuda/fused_epilogue_kernel.cuh) uses, alone and provably ordered: warps
// 0-1 store a tile, signal `full` with bar.arrive and wait on `empty` with bar.sync before the next
// store; warps 2-3 signal `empty` with bar.arrive, wait on `full` with bar.sync and read it.
// Every read sees the value of its own round, checked on the host. Run:
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/handoff scripts/probes/named_barrier_handoff.cu
//   compute-sanitizer --tool racecheck /tmp/handoff; compute-sanitizer --tool synccheck /tmp/handoff
#include <cstdio>
#include <cuda_runtime.h>

constexpr int kRounds = 8, kThreads = 128, kHalf = kThreads / 2;
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

int main() {
  int* wrong = nullptr;
  cudaMalloc(&wrong, sizeof(int));
  cudaMemset(wrong, 0, sizeof(int));
  handoff<<<4, kThreads>>>(wrong);
  int host = -1;
  cudaMemcpy(&host, wrong, sizeof(int), cudaMemcpyDeviceToHost);
  const cudaError_t error = cudaGetLastError();
  std::printf("wrong reads: %d (%s)\n", host, cudaGetErrorString(error));
  return host == 0 && error == cudaSuccess ? 0 : 1;
}
