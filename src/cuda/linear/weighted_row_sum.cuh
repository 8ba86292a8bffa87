// Σ_r c_r·M_r over the rows of a 16-bit matrix, in fp32 and in a fixed order: label smoothing on
// linear_ce's per-row reference path takes its uniform term in rank-1 form from two such sums,
// w̄ = Σ_i w_i·W_i over the vocabulary and U = Σ_n k_n·h_n over a chunk's rows
// (linear_reference.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "xent/types.hpp"

namespace xent::cuda {

// Slices of rows, each summed by blocks of its own into fp32 partials that a second kernel adds
// in slice order: enough blocks to stream a 128K-row weight at the memory's pace, and the same
// sum on every run.
constexpr int kRowSumSlices = 128;

// Bytes of the partials for `cols` columns (kRowSumSlices × cols floats, aligned).
std::size_t weighted_row_sum_scratch_bytes(int64_t cols);

// out[c] = Σ_r coef[r]·M[r, c] for c in [0, cols): M is [rows, cols] in bf16 or fp16 with row
// stride `stride`; coef is fp32 [rows], or null for coefficients of 1. A row whose coefficient is
// 0 is skipped, so a NaN in a row that counts for nothing (an ignored token's h) stays out of
// the sum. `partials` holds weighted_row_sum_scratch_bytes(cols); out is fp32 [cols].
void weighted_row_sum(const void* matrix, DType dtype, int64_t rows, int64_t cols, int64_t stride,
                      const float* coef, float* partials, float* out, cudaStream_t stream);

}  // namespace xent::cuda
