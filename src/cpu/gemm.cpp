#include "cpu/gemm.hpp"

#include "cpu/tensor_access.hpp"

#include <algorithm>

#if defined(XENT_WITH_OPENBLAS)
#include <cblas.h>
#endif

namespace xent::cpu {
namespace {

template <class T>
void scale_result(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {
#pragma omp parallel for schedule(static) if (m * n >= kParallelWork)
  for (int64_t i = 0; i < m; ++i) {
    T* row = c + i * ldc;
    if (beta == T(0)) {
      std::fill(row, row + n, T(0));  // beta = 0 must not propagate NaN from C's old contents
    } else if (beta != T(1)) {
      for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

// Fallback for machines without OpenBLAS. Each output element is owned by one thread and summed
// over k in order, so results do not depend on the thread count.
template <class T>
void fallback_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha,
                   const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  scale_result(m, n, beta, c, ldc);
  if (k == 0 || alpha == T(0)) return;
  auto a_at = [&](int64_t i, int64_t p) { return trans_a ? a[p * lda + i] : a[i * lda + p]; };
  if (trans_b) {
    // C[i, j] += alpha·Σ_p A[i, p]·B[j, p]: dot products; blocks of B rows stay in cache while
    // every row of A passes over them.
    constexpr int64_t block = 32;
#pragma omp parallel for schedule(static) if (m * n * k >= kParallelWork)
    for (int64_t j0 = 0; j0 < n; j0 += block) {
      const int64_t j1 = std::min(n, j0 + block);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = j0; j < j1; ++j) {
          const T* b_row = b + j * ldb;
          T sum = 0;
          if (!trans_a) {
            const T* a_row = a + i * lda;
#pragma omp simd reduction(+ : sum)
            for (int64_t p = 0; p < k; ++p) sum += a_row[p] * b_row[p];
          } else {
            for (int64_t p = 0; p < k; ++p) sum += a_at(i, p) * b_row[p];
          }
          c[i * ldc + j] += alpha * sum;
        }
      }
    }
    return;
  }
  // C[i, :] += alpha·Σ_p A[i, p]·B[p, :]: contiguous row updates that vectorise.
#pragma omp parallel for schedule(static) if (m * n * k >= kParallelWork)
  for (int64_t i = 0; i < m; ++i) {
    T* c_row = c + i * ldc;
    for (int64_t p = 0; p < k; ++p) {
      const T factor = alpha * a_at(i, p);
      if (factor == T(0)) continue;
      const T* b_row = b + p * ldb;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) c_row[j] += factor * b_row[j];
    }
  }
}

}  // namespace

template <class T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#if defined(XENT_WITH_OPENBLAS)
  if (k > 0) {
    const auto ta = trans_a ? CblasTrans : CblasNoTrans;
    const auto tb = trans_b ? CblasTrans : CblasNoTrans;
    if constexpr (sizeof(T) == 4) {
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    } else {
      cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
    return;
  }
#endif
  fallback_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                           const double*, int64_t, double, double*, int64_t);

}  // namespace xent::cpu
