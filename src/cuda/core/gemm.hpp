// Matrix products of the fused linear losses through cuBLASLt: 16-bit (or fp32) operands, fp32
// accumulation, an optional bias (rounded once with the sum: cuBLASLt's bias epilogue, without
// split-K into a 16-bit output), and accumulation into fp32 outputs with beta = 1.
// Matrices are row-major views with a row stride, as everywhere in xent; the translation to
// cuBLAS's column-major convention happens once, inside gemm.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "xent/types.hpp"

namespace xent::cuda {

// Row-major matrix [rows, cols] with `stride` elements between row starts.
struct GemmMatrix {
  const void* data = nullptr;
  DType dtype = DType::bf16;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;
};

// Rows [first_row, first_row + row_count) of a row-major view or matrix.
inline TensorView view_rows(const TensorView& view, int64_t first_row, int64_t row_count) {
  TensorView rows = view;
  rows.data = static_cast<char*>(view.data) + static_cast<std::size_t>(first_row) *
                                                  static_cast<std::size_t>(view.row_stride) *
                                                  dtype_size(view.dtype);
  rows.rows = row_count;
  return rows;
}
inline GemmMatrix gemm_rows(const GemmMatrix& m, int64_t first_row, int64_t row_count) {
  GemmMatrix rows = m;
  rows.data = static_cast<const char*>(m.data) + static_cast<std::size_t>(first_row) *
                                                     static_cast<std::size_t>(m.stride) *
                                                     dtype_size(m.dtype);
  rows.rows = row_count;
  return rows;
}

inline GemmMatrix gemm_matrix(const TensorView& view, int64_t first_row, int64_t row_count) {
  const TensorView rows = view_rows(view, first_row, row_count);
  return GemmMatrix{rows.data, rows.dtype, row_count, rows.cols, rows.row_stride};
}

struct GemmProduct {
  GemmMatrix a;  // A, or Aᵀ when a_transposed
  bool a_transposed = false;
  GemmMatrix b;  // B, or Bᵀ when b_transposed
  bool b_transposed = false;
  GemmMatrix c;  // output [M, N]; fp32 or the operands' dtype
  float alpha = 1;
  float beta = 0;              // 1: accumulate into c (c must then be fp32 for exact accumulation)
  const void* bias = nullptr;  // [N], operand dtype, added to every row of c (beta must be 0;
                               // rounded once with the product's sum)
  // One algorithm for every M (docs/semantics.md §1, batch invariance): chosen once per (N, K,
  // layout, dtypes, device) at a canonical M, with split-K 1, no reduction and no workspace,
  // never timed. Each element of c is then summed over k by the same kernel wherever its row
  // is and however many rows the call has. Only for a product whose a is not transposed.
  bool pinned = false;
};

// Caller-provided scratch for cuBLASLt (part of the op's workspace).
struct GemmScratch {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// c = alpha · op(a) · op(b) (+ bias) + beta · c on `stream`. A pinned product
// (GemmProduct::pinned) takes its configuration's one algorithm, checked for this M
// (cublasLtMatmulAlgoCheck); where the check fails, the heuristic's first answer for this M under
// the same limits (split-K 1, no reduction, no workspace), which GemmPlanState::pinned_fallback
// reports. Otherwise: descriptors, layouts and the algorithm are cached per shape, dtypes,
// strides, alignment, scratch size and device. For a product with a short inner dimension
// (K ≤ 1024, ≥ 2^30 flops; every such product when the test hook asks) the algorithm is the
// fastest of the heuristic's candidates, timed on the first call of the configuration that writes
// c over (beta = 0, outside CUDA graph capture); otherwise, before that, and when the test hook
// turns tuning off, the heuristic's first (docs/archive/perf-notes.md, decision 58). Later calls
// cost one cublasLtMatmul launch. Throws a runtime xent::Error when cuBLASLt fails or offers no
// algorithm.
void gemm(const GemmProduct& product, GemmScratch scratch, cudaStream_t stream);

// What the cache holds for the configuration of `product` (for tests).
struct GemmPlanState {
  bool cached = false;
  int candidates = 0;  // the heuristic's answers kept
  int chosen = 0;      // the one in use (0: the heuristic's first)
  bool tuned = false;  // chosen by timing, or never to be timed
  // Pinned products: the algorithm in use and its configuration.
  bool pinned = false;
  bool pinned_fallback = false;  // the pinned algorithm failed its check at this M
  int algo_id = -1, tile_id = -1, split_k = -1, reduction_scheme = -1;
  std::size_t workspace_bytes = 0;
};
GemmPlanState gemm_plan_state(const GemmProduct& product, GemmScratch scratch);

}  // namespace xent::cuda
