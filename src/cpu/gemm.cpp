#include "cpu/gemm.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/tensor_access.hpp"

#if defined(XENT_WITH_OPENBLAS)
#include <cblas.h>
#endif

namespace xent::cpu {
namespace {

// Fallback for machines without OpenBLAS (the GPU machines). Each thread owns a block of
// kColumns output columns and packs op(B) for them into strips of kTileColumns; rows of op(A)
// are packed kTileRows at a time. The kTileRows × kTileColumns tile of C then stays in registers
// (8 SSE registers for float, the baseline x86-64 target) while k is walked in order, so results
// do not depend on the thread count.
constexpr int64_t kColumns = 64;
// Multiply-adds below which a product runs on one thread (about a millisecond of work): waking
// the OpenMP team for the small products of a test suite costs more than it saves.
constexpr int64_t kParallelProductWork = int64_t{1} << 24;
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileColumns = 8;

// kTileRows × kTileColumns += Σ_p a_strip[p] ⊗ b_strip[p]. The accumulators are vectors of the
// GCC/Clang vector extension (16 bytes: SSE on baseline x86-64, NEON on ARM), which compilers
// keep in registers.
template <class T>
void multiply_tile(int64_t k, const T* a_strip, const T* b_strip,
                   T (&tile)[kTileRows][kTileColumns]) {
  typedef T Vec __attribute__((vector_size(16)));
  constexpr int64_t lanes = 16 / sizeof(T);
  constexpr int64_t vectors = kTileColumns / lanes;
  Vec sum[kTileRows][vectors];
  for (auto& row : sum)
    for (auto& v : row) v = Vec{};
  for (int64_t p = 0; p < k; ++p) {
    Vec b_row[vectors];
    std::memcpy(b_row, b_strip + p * kTileColumns, sizeof b_row);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const T factor = a_strip[p * kTileRows + r];
      for (int64_t v = 0; v < vectors; ++v) sum[r][v] += factor * b_row[v];
    }
  }
  for (int64_t r = 0; r < kTileRows; ++r) std::memcpy(tile[r], sum[r], sizeof sum[r]);
}

template <class T>
void fallback_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                   int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const int64_t column_blocks = (n + kColumns - 1) / kColumns;
  constexpr int64_t strips = kColumns / kTileColumns;
#pragma omp parallel for schedule(static) if (m * n * k >= kParallelProductWork)
  for (int64_t block = 0; block < column_blocks; ++block) {
    const int64_t j0 = block * kColumns;
    const int64_t width = std::min(kColumns, n - j0);
    // Strip s holds columns j0 + 8s .. j0 + 8s + 7 as k rows of 8 (zero beyond n).
    std::vector<T> b_panel(static_cast<std::size_t>(strips * k * kTileColumns), T(0));
    for (int64_t j = 0; j < width; ++j) {
      T* strip = b_panel.data() + (j / kTileColumns) * k * kTileColumns + j % kTileColumns;
      for (int64_t p = 0; p < k; ++p) {
        strip[p * kTileColumns] = trans_b ? b[(j0 + j) * ldb + p] : b[p * ldb + j0 + j];
      }
    }
    std::vector<T> a_strip(static_cast<std::size_t>(k * kTileRows));
    for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
      const int64_t height = std::min(kTileRows, m - i0);
      for (int64_t p = 0; p < k; ++p) {
        for (int64_t r = 0; r < kTileRows; ++r) {
          a_strip[p * kTileRows + r] =
              r < height ? (trans_a ? a[p * lda + i0 + r] : a[(i0 + r) * lda + p]) : T(0);
        }
      }
      for (int64_t s = 0; s * kTileColumns < width; ++s) {
        T tile[kTileRows][kTileColumns];
        multiply_tile(k, a_strip.data(), b_panel.data() + s * k * kTileColumns, tile);
        const int64_t columns = std::min(kTileColumns, width - s * kTileColumns);
        for (int64_t r = 0; r < height; ++r) {
          T* out = c + (i0 + r) * ldc + j0 + s * kTileColumns;
          for (int64_t j = 0; j < columns; ++j) {
            // beta = 0 must not read C: its old contents may be NaN (uninitialised workspace).
            out[j] = beta == T(0) ? alpha * tile[r][j] : beta * out[j] + alpha * tile[r][j];
          }
        }
      }
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

template <class T>
void gemm_fixed_order(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha,
                      const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  fallback_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                           const double*, int64_t, double, double*, int64_t);
template void gemm_fixed_order<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*,
                                      int64_t, const float*, int64_t, float, float*, int64_t);
template void gemm_fixed_order<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                       int64_t, const double*, int64_t, double, double*, int64_t);

}  // namespace xent::cpu
