// Can the bandwidth-bound passes of linear_ce / linear_distill hide behind the products? Models
// one call's chunks with synthetic kernels: the products are cuBLASLt's (heuristic's first
// answer), the elementwise passes a streaming kernel moving the same bytes as xent's (ce: read
// and rewrite the chunk's logits; distill: a statistics pass reading student and teacher, then a
// gradient pass reading both and rewriting the student's).
//   serial     one stream, chunks of 2R rows, every kernel on the whole GPU (today's schedule);
//   overlap s  chunks of R rows in two buffers (the same memory): the products on a stream told
//              to use 132 − s multiprocessors (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), the passes
//              of chunk i on a low-priority stream with a grid of s multiprocessors' worth of
//              CTAs, beside the products of chunks i − 1 and i + 1.
// Run:
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/overlap scripts/probes/overlap.cu -lcublasLt
//   /tmp/overlap ce 32768 768 128256 5504     (mode, N, H, V, R)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "probe_common.cuh"


namespace {

cublasLtHandle_t handle;
void* gemm_workspace[2];
constexpr size_t kGemmWorkspace = 32u << 20;

// Streams `count` 16-byte vectors of a (and b when given): with `write`, a := f(a, b) in place;
// without, a sum per CTA (so the reads are not dropped). Grid-stride, four vectors in flight.
__global__ void __launch_bounds__(256) stream_pass(uint4* a, const uint4* b, long count,
                                                   bool write, float* sink) {
  float acc = 0.f;
  const long stride = long{gridDim.x} * blockDim.x;
  long i = blockIdx.x * long{blockDim.x} + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    uint4 va[4], vb[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) va[u] = a[i + u * stride];
    if (b) {
#pragma unroll
      for (int u = 0; u < 4; ++u) vb[u] = b[i + u * stride];
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      auto* x = reinterpret_cast<__nv_bfloat162*>(&va[u]);
      const auto* y = reinterpret_cast<const __nv_bfloat162*>(&vb[u]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float2 f = __bfloat1622float2(x[e]);
        if (b) {
          const float2 g = __bfloat1622float2(y[e]);
          f.x = __expf(f.x) - __expf(g.x);
          f.y = __expf(f.y) - __expf(g.y);
        } else {
          f.x = __expf(f.x);
          f.y = __expf(f.y);
        }
        acc += f.x + f.y;
        x[e] = __float22bfloat162_rn(f);
      }
      if (write) a[i + u * stride] = va[u];
    }
  }
  for (; i < count; i += stride) {
    uint4 v = a[i];
    auto* x = reinterpret_cast<__nv_bfloat162*>(&v);
    for (int e = 0; e < 4; ++e) {
      float2 f = __bfloat1622float2(x[e]);
      acc += f.x;
      x[e] = __float22bfloat162_rn(make_float2(__expf(f.x), __expf(f.y)));
    }
    if (write) a[i] = v;
  }
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

// Row-major C[M,N] = op(A)·op(B), as src/cuda/core/gemm.cu states it to cuBLASLt.
struct Product {
  cublasLtMatmulDesc_t desc{};
  cublasLtMatrixLayout_t la{}, lb{}, lc{};
  cublasLtMatmulHeuristicResult_t result{};
  float beta = 0.f;
  Product(long m, long n, long k, bool at, bool bt, bool c_f32, float beta_, int sm_target)
      : beta(beta_) {
    const long a_rows = at ? k : m, a_cols = at ? m : k;
    const long b_rows = bt ? n : k, b_cols = bt ? k : n;
    CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t first = bt ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t second = at ? CUBLAS_OP_T : CUBLAS_OP_N;
    CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &first, sizeof first));
    CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &second,
                                         sizeof second));
    if (sm_target > 0)
      CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_target,
                                           sizeof sm_target));
    CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, b_cols, b_rows, b_cols));
    CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, a_cols, a_rows, a_cols));
    CHECK(cublasLtMatrixLayoutCreate(&lc, c_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t preference;
    CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const uint64_t max_workspace = kGemmWorkspace;
    CHECK(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof max_workspace));
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, preference, 1, &result,
                                         &found));
    if (found == 0) std::exit(2);
    cublasLtMatmulPreferenceDestroy(preference);
  }
  void run(const void* a, const void* b, void* c, cudaStream_t stream, int slot) const {
    const float alpha = 1.f;
    CHECK(cublasLtMatmul(handle, desc, &alpha, b, la, a, lb, &beta, c, lc, c, lc, &result.algo,
                         gemm_workspace[slot], kGemmWorkspace, stream));
  }
};

float median_ms(const std::function<void()>& body, cudaStream_t stream, int repeat = 5) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  body();
  CHECK(cudaStreamSynchronize(stream));
  std::vector<float> times;
  for (int r = 0; r < repeat; ++r) {
    CHECK(cudaEventRecord(start, stream));
    body();
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: overlap ce|distill N H V R\n");
    return 1;
  }
  const bool distill = std::string(argv[1]) == "distill";
  const long n = std::atol(argv[2]), h = std::atol(argv[3]), v = std::atol(argv[4]);
  const long r = std::atol(argv[5]);
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cublasLtCreate(&handle));
  int low = 0, high = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&low, &high));
  cudaStream_t main_stream, side_stream;
  CHECK(cudaStreamCreateWithPriority(&main_stream, cudaStreamNonBlocking, high));
  CHECK(cudaStreamCreateWithPriority(&side_stream, cudaStreamNonBlocking, low));
  for (auto& w : gemm_workspace) CHECK(cudaMalloc(&w, kGemmWorkspace));

  // Each buffer holds 2R rows: in serial, one chunk's student (buffer 0) and teacher (buffer 1);
  // overlapped, chunk i's student and teacher of R rows each in buffer i % 2.
  const long buffer_elems = 2 * r * v;
  __nv_bfloat16 *hidden, *weight, *teacher_hidden, *dh;
  __nv_bfloat16* logits[2];  // student; the teacher's follow each in distill mode
  float *dw, *sink;
  CHECK(cudaMalloc(&hidden, size_t(n) * h * 2));
  CHECK(cudaMalloc(&teacher_hidden, size_t(n) * h * 2));
  CHECK(cudaMalloc(&weight, size_t(v) * h * 2));
  CHECK(cudaMalloc(&dh, size_t(n) * h * 2));
  CHECK(cudaMalloc(&dw, size_t(v) * h * 4));
  CHECK(cudaMalloc(&sink, 1 << 20));
  for (auto& l : logits) CHECK(cudaMalloc(&l, size_t(buffer_elems) * 2));
  fill<<<1024, 256>>>(hidden, n * h, 1);
  fill<<<1024, 256>>>(teacher_hidden, n * h, 3);
  fill<<<1024, 256>>>(weight, v * h, 2);
  for (auto& l : logits) fill<<<1024, 256>>>(l, buffer_elems, 4);
  CHECK(cudaMemset(dw, 0, size_t(v) * h * 4));
  CHECK(cudaDeviceSynchronize());

  // The passes over a chunk of `rows` rows whose student logits start at s (teacher's at t).
  auto passes = [&](__nv_bfloat16* s, __nv_bfloat16* t, long rows, int grid, cudaStream_t st) {
    const long vectors = rows * v / 8;
    if (distill) {
      stream_pass<<<grid, 256, 0, st>>>(reinterpret_cast<uint4*>(s),
                                         reinterpret_cast<const uint4*>(t), vectors, false, sink);
      stream_pass<<<grid, 256, 0, st>>>(reinterpret_cast<uint4*>(s),
                                         reinterpret_cast<const uint4*>(t), vectors, true, sink);
    } else {
      stream_pass<<<grid, 256, 0, st>>>(reinterpret_cast<uint4*>(s), nullptr, vectors, true, sink);
    }
  };
  const int full_grid = sms * 8;

  struct Set {
    Product logits, dh, dw;
  };
  auto make_set = [&](long rows, int target) {
    return Set{Product(rows, v, h, false, true, false, 0.f, target),
               Product(rows, h, v, false, false, false, 0.f, target),
               Product(v, h, rows, true, false, true, 1.f, target)};
  };

  // Alone: the passes' bandwidth on s multiprocessors' worth of CTAs.
  std::printf("mode=%s N=%ld H=%ld V=%ld R=%ld SMs=%d\n", distill ? "distill" : "ce", n, h, v, r,
              sms);
  const double pass_bytes = double(r) * v * 2 * (distill ? 5 : 2);
  for (int s : {4, 8, 12, 16, 24, 32, sms}) {
    for (int per : {4, 8}) {
      const int grid = s * per;
      const float ms = median_ms(
          [&] { passes(logits[0], logits[1], r, grid, main_stream); },
          main_stream);
      std::printf("passes alone, %3d SMs x %d CTAs: %7.3f ms  %6.0f GB/s\n", s, per, ms,
                  pass_bytes / ms / 1e6);
    }
  }

  // Today: one stream, chunks of 2R.
  {
    Set set = make_set(2 * r, 0);
    Set teacher = make_set(2 * r, 0);
    auto body = [&] {
      for (long row = 0; row < n; row += 2 * r) {
        const long rows = std::min(2 * r, n - row);
        if (rows != 2 * r) break;  // whole chunks only: N a multiple of 2R
        __nv_bfloat16* s = logits[0];
        __nv_bfloat16* t = logits[1];
        set.logits.run(hidden + row * h, weight, s, main_stream, 0);
        if (distill) teacher.logits.run(teacher_hidden + row * h, weight, t, main_stream, 0);
        passes(s, t, rows, full_grid, main_stream);
        set.dh.run(s, weight, dh + row * h, main_stream, 0);
        set.dw.run(s, hidden + row * h, dw, main_stream, 0);
      }
    };
    const float ms = median_ms(body, main_stream);
    const float products = median_ms(
        [&] {
          for (long row = 0; row + 2 * r <= n; row += 2 * r) {
            set.logits.run(hidden + row * h, weight, logits[0], main_stream, 0);
            if (distill)
              teacher.logits.run(teacher_hidden + row * h, weight, logits[1], main_stream, 0);
            set.dh.run(logits[0], weight, dh + row * h, main_stream, 0);
            set.dw.run(logits[0], hidden + row * h, dw, main_stream, 0);
          }
        },
        main_stream);
    std::printf("serial, chunks of %ld: %8.3f ms (its products alone %8.3f ms)\n", 2 * r, ms,
                products);
  }

  // Overlapped: chunks of R in two buffers; products on the high-priority stream told to leave
  // s multiprocessors, passes on the low-priority stream.
  const long chunks = n / r;
  std::vector<cudaEvent_t> made(chunks), done(chunks);
  for (long i = 0; i < chunks; ++i) {
    CHECK(cudaEventCreateWithFlags(&made[i], cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&done[i], cudaEventDisableTiming));
  }
  cudaEvent_t fork, join;
  CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  for (int s : {0, 8, 12, 16, 20, 24, 32}) {
    for (int per : {4, 8}) {
      if (s == 0 && per == 8) continue;
      Set set = make_set(r, s ? sms - s : 0);
      Set teacher = make_set(r, s ? sms - s : 0);
      const int grid = s ? s * per : full_grid;
      auto body = [&] {
        CHECK(cudaEventRecord(fork, main_stream));
        CHECK(cudaStreamWaitEvent(side_stream, fork));
        auto chunk = [&](long i, int part) {
          __nv_bfloat16* s_buf = logits[i % 2];
          __nv_bfloat16* t_buf = s_buf + r * v;
          const long row = i * r;
          if (part == 0) {
            set.logits.run(hidden + row * h, weight, s_buf, main_stream, 0);
            if (distill) teacher.logits.run(teacher_hidden + row * h, weight, t_buf, main_stream, 0);
            CHECK(cudaEventRecord(made[i], main_stream));
            CHECK(cudaStreamWaitEvent(side_stream, made[i]));
            passes(s_buf, t_buf, r, grid, side_stream);
            CHECK(cudaEventRecord(done[i], side_stream));
          } else {
            CHECK(cudaStreamWaitEvent(main_stream, done[i]));
            set.dh.run(s_buf, weight, dh + row * h, main_stream, 0);
            set.dw.run(s_buf, hidden + row * h, dw, main_stream, 0);
          }
        };
        for (long i = 0; i < chunks; ++i) {
          chunk(i, 0);
          if (i > 0) chunk(i - 1, 1);
        }
        chunk(chunks - 1, 1);
        CHECK(cudaEventRecord(join, side_stream));
        CHECK(cudaStreamWaitEvent(main_stream, join));
      };
      const float ms = median_ms(body, main_stream);
      std::printf("overlap, chunks of %ld, products on %3d SMs, passes %4d CTAs: %8.3f ms\n", r,
                  s ? sms - s : sms, grid, ms);
    }
  }
  return 0;
}
