// Times every algorithm cuBLASLt's heuristic offers for the products of linear_ce's schedules, to
// see what the first choice (the one src/cuda/core/gemm.cu takes) leaves on the table. Products are
// given in xent's row-major terms, as src/cuda/core/gemm.hpp states them:
//   name:M,N,K,a_transposed,b_transposed,c_dtype(bf16|f32),beta,workspace_mib
// Run:
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/gemm_algos scripts/probes/gemm_algos.cu -lcublasLt
//   /tmp/gemm_algos dh:8192,768,3072,0,0,f32,1,4 dW:3072,768,8192,1,0,f32,1,4
// Prints, per product, each candidate's median time over 10 runs and its configuration (tile id,
// stages, split-K, reduction scheme, swizzle, cluster shape), the heuristic's first marked.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "probe_common.cuh"


struct Spec {
  std::string name;
  long m, n, k;
  bool at, bt, c_f32;
  float beta;
  long workspace_mib;
};

Spec parse(const char* text) {
  Spec s;
  const char* colon = std::strchr(text, ':');
  s.name = std::string(text, colon - text);
  char dtype[8] = {};
  int at = 0, bt = 0;
  std::sscanf(colon + 1, "%ld,%ld,%ld,%d,%d,%7[^,],%f,%ld", &s.m, &s.n, &s.k, &at, &bt, dtype,
              &s.beta, &s.workspace_mib);
  s.at = at != 0;
  s.bt = bt != 0;
  s.c_f32 = std::string(dtype) == "f32";
  return s;
}

template <class T>
T attribute(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t which) {
  T value{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, which, &value, sizeof value, &written);
  return value;
}

int main(int argc, char** argv) {
  cublasLtHandle_t handle;
  CHECK(cublasLtCreate(&handle));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int arg = 1; arg < argc; ++arg) {
    const Spec s = parse(argv[arg]);
    // Row-major C[M,N] = op(A)·op(B) is column-major Cᵀ[N,M] = op(B)ᵀ·op(A)ᵀ (as gemm.cu).
    const long a_rows = s.at ? s.k : s.m, a_cols = s.at ? s.m : s.k;
    const long b_rows = s.bt ? s.n : s.k, b_cols = s.bt ? s.k : s.n;
    __nv_bfloat16 *a, *b;
    void *c, *workspace;
    const size_t c_bytes = size_t(s.m) * s.n * (s.c_f32 ? 4 : 2);
    const size_t workspace_bytes = size_t(s.workspace_mib) << 20;
    CHECK(cudaMalloc(&a, size_t(a_rows) * a_cols * 2));
    CHECK(cudaMalloc(&b, size_t(b_rows) * b_cols * 2));
    CHECK(cudaMalloc(&c, c_bytes));
    CHECK(cudaMalloc(&workspace, std::max<size_t>(workspace_bytes, 256)));
    fill<<<1024, 256>>>(a, a_rows * a_cols, 1);
    fill<<<1024, 256>>>(b, b_rows * b_cols, 2);
    CHECK(cudaMemset(c, 0, c_bytes));

    cublasLtMatmulDesc_t desc;
    CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t first_op = s.bt ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t second_op = s.at ? CUBLAS_OP_T : CUBLAS_OP_N;
    CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &first_op,
                                         sizeof first_op));
    CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &second_op,
                                         sizeof second_op));
    cublasLtMatrixLayout_t la, lb, lc;
    CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, b_cols, b_rows, b_cols));
    CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, a_cols, a_rows, a_cols));
    CHECK(cublasLtMatrixLayoutCreate(&lc, s.c_f32 ? CUDA_R_32F : CUDA_R_16BF, s.n, s.m, s.n));
    cublasLtMatmulPreference_t preference;
    CHECK(cublasLtMatmulPreferenceCreate(&preference));
    const uint64_t max_workspace = workspace_bytes;
    CHECK(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof max_workspace));
    if (!s.c_f32) {
      const uint32_t fp32_reductions =
          CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      CHECK(cublasLtMatmulPreferenceSetAttribute(
          preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &fp32_reductions,
          sizeof fp32_reductions));
    }
    std::vector<cublasLtMatmulHeuristicResult_t> results(16);
    int found = 0;
    CHECK(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, preference, 16,
                                         results.data(), &found));
    const double flops = 2.0 * s.m * s.n * s.k;
    std::printf("%s  M=%ld N=%ld K=%ld at=%d bt=%d C=%s beta=%g ws=%ld MiB: %d candidates\n",
                s.name.c_str(), s.m, s.n, s.k, s.at, s.bt, s.c_f32 ? "f32" : "bf16", s.beta,
                s.workspace_mib, found);
    const float alpha = 1.0f;
    for (int i = 0; i < found; ++i) {
      const auto& algo = results[i].algo;
      auto run = [&] {
        return cublasLtMatmul(handle, desc, &alpha, b, la, a, lb, &s.beta, c, lc, c, lc, &algo,
                              workspace, results[i].workspaceSize, stream);
      };
      if (run() != CUBLAS_STATUS_SUCCESS) {
        std::printf("  [%2d] failed to run\n", i);
        continue;
      }
      for (int w = 0; w < 2; ++w) run();
      std::vector<float> times;
      for (int r = 0; r < 10; ++r) {
        cudaEventRecord(start, stream);
        run();
        cudaEventRecord(stop, stream);
        cudaEventSynchronize(stop);
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);
        times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      const float median = times[times.size() / 2];
      std::printf(
          "  [%2d]%s %8.4f ms %6.1f TFLOP/s  tile=%d stages=%d splitk=%d red=%d swizzle=%d "
          "cluster=%d ws=%zu\n",
          i, i == 0 ? "*" : " ", median, flops / (median * 1e-3) / 1e12,
          attribute<int>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
          attribute<int>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
          attribute<int>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
          attribute<int>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
          attribute<int>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
          attribute<int>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), results[i].workspaceSize);
    }
    cublasLtMatmulPreferenceDestroy(preference);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    cudaFree(workspace);
    std::fflush(stdout);
  }
  return 0;
}
