// cuBLASLt behind lt_product: one handle and one 64 MiB workspace for the process (the bench is
// single-threaded), descriptors and algorithm cached per product shape.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

#include "bench/cublaslt_product.hpp"

namespace xent::bench {

namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt ") + what + " failed: status " +
                             std::to_string(static_cast<int>(status)));
}

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

constexpr std::size_t kWorkspaceBytes = std::size_t{64} << 20;

struct LtState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  LtState() {
    check(cublasLtCreate(&handle), "create");
    if (cudaMalloc(&workspace, kWorkspaceBytes) != cudaSuccess)
      throw std::runtime_error("cuBLASLt workspace: cudaMalloc failed");
  }
};

LtState& state() {
  static LtState lt;  // lives to process exit; the driver reclaims it
  return lt;
}

// Descriptors and the heuristic's algorithm of one product shape, built once: the floor F is
// then the time of cublasLtMatmul launches alone.
struct Plan {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int, int, int, bool, bool>;

Plan make_plan(const RowMajor& a, bool transpose_a, const RowMajor& b, bool transpose_b,
               DType c_dtype) {
  // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: B's storage is the first
  // column-major operand and A's the second, each transposed exactly when asked.
  const int64_t m = transpose_a ? a.cols : a.rows;
  const int64_t n = transpose_b ? b.rows : b.cols;
  Plan plan;
  check(cublasLtMatmulDescCreate(&plan.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
  const cublasOperation_t op_first = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                       sizeof op_first),
        "transa");
  check(cublasLtMatmulDescSetAttribute(plan.operation, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                       sizeof op_second),
        "transb");
  // Column-major view of row-major storage [rows × cols] is [cols × rows] with ld = cols.
  check(cublasLtMatrixLayoutCreate(&plan.first, cuda_type(b.dtype), b.cols, b.rows, b.cols),
        "layout");
  check(cublasLtMatrixLayoutCreate(&plan.second, cuda_type(a.dtype), a.cols, a.rows, a.cols),
        "layout");
  check(cublasLtMatrixLayoutCreate(&plan.out, cuda_type(c_dtype), n, m, n), "layout");
  cublasLtMatmulPreference_t preference = nullptr;
  check(cublasLtMatmulPreferenceCreate(&preference), "preference");
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &kWorkspaceBytes, sizeof kWorkspaceBytes),
        "preference");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(state().handle, plan.operation, plan.first, plan.second,
                                     plan.out, plan.out, preference, 1, &heuristic, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  check(status, "heuristic");
  if (found == 0) throw std::runtime_error("cuBLASLt: no algorithm for this product");
  plan.algo = heuristic.algo;
  return plan;
}

}  // namespace

void lt_product(const RowMajor& a, bool transpose_a, const RowMajor& b, bool transpose_b, void* c,
                DType c_dtype, void* stream) {
  static std::map<PlanKey, Plan> plans;
  const PlanKey key{a.rows,
                    a.cols,
                    b.rows,
                    b.cols,
                    static_cast<int>(a.dtype),
                    static_cast<int>(b.dtype),
                    static_cast<int>(c_dtype),
                    transpose_a,
                    transpose_b};
  auto found = plans.find(key);
  if (found == plans.end())
    found = plans.emplace(key, make_plan(a, transpose_a, b, transpose_b, c_dtype)).first;
  const Plan& plan = found->second;
  const float alpha = 1, beta = 0;
  LtState& lt = state();
  check(cublasLtMatmul(lt.handle, plan.operation, &alpha, b.data, plan.first, a.data, plan.second,
                       &beta, c, plan.out, c, plan.out, &plan.algo, lt.workspace, kWorkspaceBytes,
                       static_cast<cudaStream_t>(stream)),
        "matmul");
}

}  // namespace xent::bench
