// Row-major matrix products of the CPU backend: C = alpha·op(A)·op(B) + beta·C, with op(X) = X or
// Xᵀ. float and double (fp64 inputs keep fp64 math). OpenBLAS when the build found it, else a
// blocked OpenMP loop that sums in a fixed order (deterministic, slower).
#pragma once

#include <cstdint>

namespace xent::cpu {

// m × n result, k the inner dimension; lda/ldb/ldc are row strides in elements of the matrices as
// stored (A is m × k, or k × m when trans_a).
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// gemm() that never calls OpenBLAS: each element of C is summed over k in order by the same
// instructions wherever its row is and however many rows there are, so a row of C does not
// depend on m (OpenBLAS takes other kernels for small m: docs/semantics.md §1, batch invariance).
template <class T>
void gemm_fixed_order(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha,
                      const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

}  // namespace xent::cpu
