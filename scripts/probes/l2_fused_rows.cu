// Can a row's second sweep read its logits from L2 instead of HBM? Models distillation's two
// passes (statistics of student and teacher rows, then the gradient written over the student)
// with synthetic arithmetic, three ways:
//   two passes  a statistics kernel (a cluster of CTAs per row, 128 KiB of each input per CTA,
//               one exchange) and an elementwise gradient kernel: 10 bytes an element from HBM;
//   fused       persistent clusters walk the rows: each CTA streams its slice of a row, the
//               cluster exchanges, and the same CTA then reads the slice again for the gradient,
//               which should still be in L2 when slices are short and few CTAs run at once:
//               6 bytes an element from HBM if it is.
// Run:
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/l2_fused scripts/probes/l2_fused_rows.cu
//   /tmp/l2_fused 16384 131072
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

namespace cg = cooperative_groups;


namespace {

constexpr int kThreads = 256;

struct Stats {
  float a, b;
};

// This thread's sums of e^s and e^t over the slice's vectors, four of each in flight.
__device__ __forceinline__ Stats sweep_stats(const uint4* s, const uint4* t, int vectors) {
  float a = 0.f, b = 0.f;
  int j = threadIdx.x;
  for (; j + 3 * kThreads < vectors; j += 4 * kThreads) {
    uint4 vs[4], vt[4];
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      vs[d] = __ldg(s + j + d * kThreads);
      vt[d] = __ldg(t + j + d * kThreads);
    }
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const auto* xs = reinterpret_cast<const __nv_bfloat162*>(&vs[d]);
      const auto* xt = reinterpret_cast<const __nv_bfloat162*>(&vt[d]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 fs = __bfloat1622float2(xs[e]);
        const float2 ft = __bfloat1622float2(xt[e]);
        a += __expf(fs.x) + __expf(fs.y);
        b += __expf(ft.x) + __expf(ft.y);
      }
    }
  }
  for (; j < vectors; j += kThreads) {
    const uint4 vs = __ldg(s + j), vt = __ldg(t + j);
    const auto* xs = reinterpret_cast<const __nv_bfloat162*>(&vs);
    const auto* xt = reinterpret_cast<const __nv_bfloat162*>(&vt);
    for (int e = 0; e < 4; ++e) {
      const float2 fs = __bfloat1622float2(xs[e]);
      const float2 ft = __bfloat1622float2(xt[e]);
      a += __expf(fs.x) + __expf(fs.y);
      b += __expf(ft.x) + __expf(ft.y);
    }
  }
  return {a, b};
}

// s := e^(s − la) − e^(t − lb) over the slice's vectors, two of each in flight.
__device__ __forceinline__ void sweep_grad(uint4* s, const uint4* t, int vectors, float la,
                                           float lb) {
  for (int j = threadIdx.x; j < vectors; j += kThreads) {
    uint4 vs = __ldg(s + j);
    const uint4 vt = __ldg(t + j);
    auto* xs = reinterpret_cast<__nv_bfloat162*>(&vs);
    const auto* xt = reinterpret_cast<const __nv_bfloat162*>(&vt);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 fs = __bfloat1622float2(xs[e]);
      const float2 ft = __bfloat1622float2(xt[e]);
      xs[e] = __float22bfloat162_rn(
          make_float2(__expf(fs.x - la) - __expf(ft.x - lb), __expf(fs.y - la) - __expf(ft.y - lb)));
    }
    s[j] = vs;
  }
}

__device__ __forceinline__ Stats block_sum(Stats v, Stats* scratch) {
  for (int o = 16; o > 0; o /= 2) {
    v.a += __shfl_down_sync(0xffffffffu, v.a, o);
    v.b += __shfl_down_sync(0xffffffffu, v.b, o);
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  Stats total{0.f, 0.f};
  for (int w = 0; w < kThreads / 32; ++w) {
    total.a += scratch[w].a;
    total.b += scratch[w].b;
  }
  return total;
}

// The row's sums over the cluster: each CTA publishes its own, reads every rank's.
__device__ __forceinline__ Stats cluster_sum(Stats mine, Stats* slot) {
  cg::cluster_group cluster = cg::this_cluster();
  if (threadIdx.x == 0) *slot = mine;
  cluster.sync();
  Stats total{0.f, 0.f};
  for (unsigned r = 0; r < cluster.num_blocks(); ++r) {
    const Stats* other = cluster.map_shared_rank(slot, r);
    total.a += other->a;
    total.b += other->b;
  }
  cluster.sync();  // no CTA leaves (or overwrites its slot) while another still reads it
  return total;
}

// The row's two log-sums (every thread), from this CTA's slice of `vectors` vectors of each input
// and the other CTAs' of the cluster.
__device__ __forceinline__ float2 row_lse(const uint4* s, const uint4* t, int vectors,
                                          Stats* scratch, Stats* slot) {
  const Stats mine = block_sum(sweep_stats(s, t, vectors), scratch);
  __syncthreads();  // scratch is free again (the fused kernel's next row writes it)
  const Stats total = cluster_sum(mine, slot);
  return make_float2(__logf(total.a), __logf(total.b));
}

// This CTA's slice of a row: its first vector and how many it holds (the last may be short).
struct Slice {
  long begin;
  int vectors;
};
__device__ __forceinline__ Slice cta_slice(const cg::cluster_group& cluster, long row_vectors,
                                           int slice_vectors) {
  const long begin = long{cluster.block_rank()} * slice_vectors;
  return {begin, static_cast<int>(min(long{slice_vectors}, row_vectors - begin))};
}

// Pass 1 of the two-pass form: one cluster per row, stats to global.
__global__ void __launch_bounds__(kThreads) stats_kernel(const uint4* s, const uint4* t,
                                                        long row_vectors, int slice_vectors,
                                                        float2* stats) {
  __shared__ Stats scratch[kThreads / 32];
  __shared__ Stats slot;
  cg::cluster_group cluster = cg::this_cluster();
  const long row = blockIdx.x / cluster.num_blocks();
  const Slice slice = cta_slice(cluster, row_vectors, slice_vectors);
  const float2 lse = row_lse(s + row * row_vectors + slice.begin,
                             t + row * row_vectors + slice.begin, slice.vectors, scratch, &slot);
  if (cluster.block_rank() == 0 && threadIdx.x == 0) stats[row] = lse;
}

// Pass 2: one CTA per 4096-column segment (as the block gradient).
__global__ void __launch_bounds__(kThreads) grad_kernel(uint4* s, const uint4* t, long row_vectors,
                                                       const float2* stats) {
  const long segments = row_vectors / (2 * kThreads);
  const long row = blockIdx.x / segments;
  const long begin = (blockIdx.x % segments) * 2 * kThreads;
  const float2 st = stats[row];
  sweep_grad(s + row * row_vectors + begin, t + row * row_vectors + begin, 2 * kThreads, st.x,
             st.y);
}

// The fused form: persistent clusters; cluster c takes rows c, c + clusters, ...
__global__ void __launch_bounds__(kThreads) fused_kernel(uint4* s, const uint4* t, long rows,
                                                        long row_vectors, int slice_vectors,
                                                        float2* stats) {
  __shared__ Stats scratch[kThreads / 32];
  __shared__ Stats slot;
  cg::cluster_group cluster = cg::this_cluster();
  const long clusters = gridDim.x / cluster.num_blocks();
  const Slice slice = cta_slice(cluster, row_vectors, slice_vectors);
  for (long row = blockIdx.x / cluster.num_blocks(); row < rows; row += clusters) {
    uint4* sr = s + row * row_vectors + slice.begin;
    const uint4* tr = t + row * row_vectors + slice.begin;
    const float2 lse = row_lse(sr, tr, slice.vectors, scratch, &slot);
    if (cluster.block_rank() == 0 && threadIdx.x == 0) stats[row] = lse;
    sweep_grad(sr, tr, slice.vectors, lse.x, lse.y);
  }
}

template <class Kernel, class... Args>
void launch(Kernel kernel, long grid, int cluster, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(kThreads);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

template <class Body>
float median_ms(Body body, int repeat = 15) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  body();
  CHECK(cudaDeviceSynchronize());
  std::vector<float> times;
  for (int r = 0; r < repeat; ++r) {
    CHECK(cudaEventRecord(start));
    body();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const long rows = argc > 1 ? std::atol(argv[1]) : 16384;
  const long vocab = argc > 2 ? std::atol(argv[2]) : 131072;  // a multiple of 4096
  const long row_vectors = vocab / 8;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  __nv_bfloat16 *s, *t;
  float2* stats;
  CHECK(cudaMalloc(&s, size_t(rows) * vocab * 2));
  CHECK(cudaMalloc(&t, size_t(rows) * vocab * 2));
  CHECK(cudaMalloc(&stats, size_t(rows) * sizeof(float2)));
  // Refill the student before every run (the gradient overwrites it): the refill is timed apart
  // and subtracted.
  auto refill = [&] { fill<<<sms * 8, 256>>>(s, rows * vocab, 1, -2.0f, 4.0f); };
  fill<<<sms * 8, 256>>>(t, rows * vocab, 2, -2.0f, 4.0f);
  const float refill_ms = median_ms(refill);
  auto* sv = reinterpret_cast<uint4*>(s);
  const auto* tv = reinterpret_cast<const uint4*>(t);
  const double bytes = double(rows) * vocab * 2 * 3;  // the least: read both, write one
  std::printf("rows=%ld vocab=%ld SMs=%d (refill %.3f ms, subtracted)\n", rows, vocab, sms,
              refill_ms);
  {
    const int cluster = static_cast<int>(std::max<long>(1, vocab * 2 / (128 << 10)));
    const int slice = static_cast<int>(row_vectors / cluster);
    const float ms = median_ms([&] {
      refill();
      launch(stats_kernel, rows * cluster, cluster, (const uint4*)sv, tv, row_vectors, slice,
             stats);
      grad_kernel<<<rows * (row_vectors / (2 * kThreads)), kThreads>>>(sv, tv, row_vectors, stats);
    }) - refill_ms;
    std::printf("two passes, cluster %2d:                   %7.3f ms  %.0f GB/s of 6 B/elem\n",
                cluster, ms, bytes / ms / 1e6);
  }
  for (int cluster : {4, 8, 16}) {
    if (cluster == 16) {
      cudaFuncSetAttribute(fused_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    }
    const int slice = static_cast<int>((row_vectors + cluster - 1) / cluster);
    for (int per_sm : {2, 3, 4, 6, 8}) {
      long grid = long{sms} * per_sm / cluster * cluster;
      grid = std::min(grid, rows * cluster);
      const float ms = median_ms([&] {
        refill();
        launch(fused_kernel, grid, cluster, sv, tv, rows, row_vectors, slice, stats);
      }) - refill_ms;
      std::printf("fused, cluster %2d, %d CTAs per SM (%4ld):  %7.3f ms  %.0f GB/s  slice %3d KiB x2,"
                  " %5.1f MB in flight\n",
                  cluster, per_sm, grid, ms, bytes / ms / 1e6, slice * 16 / 1024,
                  grid * slice * 32.0 / 1e6);
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
