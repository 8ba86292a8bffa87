// Σ_r c_r·M_r over a 16-bit matrix's rows (weighted_row_sum.cuh).
#include "cuda/linear/weighted_row_sum.cuh"

#include "cuda/plan/chunk_plan.hpp"
#include "cuda/core/device.cuh"

namespace xent::cuda {
namespace {

constexpr int kColumnsPerLane = 8;  // one 16-byte load of a 16-bit row
constexpr int kSliceWarps = 8;
constexpr int kSliceColumns = 32 * kColumnsPerLane;

// Block (column group, slice): its warps take the slice's rows in turn, each lane 8 adjacent
// columns, and the block's sums go to partials[slice, column].
template <class S>
__global__ void __launch_bounds__(32 * kSliceWarps)
    slice_sums_kernel(const S* matrix, int64_t rows, int64_t cols, int64_t stride,
                      const float* coef, float* partials, bool vectors) {
  __shared__ float warp_sums[kSliceWarps][kSliceColumns];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t first_column =
      static_cast<int64_t>(blockIdx.x) * kSliceColumns + lane * kColumnsPerLane;
  const int64_t slice = blockIdx.y;
  const int64_t begin = rows * slice / kRowSumSlices, end = rows * (slice + 1) / kRowSumSlices;
  float sum[kColumnsPerLane] = {};
  for (int64_t r = begin + warp; r < end; r += kSliceWarps) {
    const float c = coef != nullptr ? coef[r] : 1.0f;
    if (c == 0.0f) continue;
    const S* row = matrix + r * stride;
    if (vectors && first_column + kColumnsPerLane <= cols) {
      const Vector<S> v = unpack<S>(*reinterpret_cast<const uint4*>(row + first_column));
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) sum[j] = fmaf(c, v.value[j], sum[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kColumnsPerLane; ++j) {
        if (first_column + j < cols) sum[j] = fmaf(c, load_float(row[first_column + j]), sum[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kColumnsPerLane; ++j) warp_sums[warp][lane * kColumnsPerLane + j] = sum[j];
  __syncthreads();
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kSliceColumns + threadIdx.x;
  if (column >= cols) return;
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kSliceWarps; ++w) total += warp_sums[w][threadIdx.x];
  partials[slice * cols + column] = total;
}

__global__ void add_slices_kernel(const float* partials, int64_t cols, float* out) {
  for (int64_t column = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; column < cols;
       column += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = 0.0f;
    for (int slice = 0; slice < kRowSumSlices; ++slice) total += partials[slice * cols + column];
    out[column] = total;
  }
}

}  // namespace

std::size_t weighted_row_sum_scratch_bytes(int64_t cols) {
  return align_up(static_cast<std::size_t>(kRowSumSlices) * static_cast<std::size_t>(cols) *
                  sizeof(float));
}

void weighted_row_sum(const void* matrix, DType dtype, int64_t rows, int64_t cols, int64_t stride,
                      const float* coef, float* partials, float* out, cudaStream_t stream) {
  if (cols <= 0) return;
  const dim3 grid(static_cast<unsigned>((cols + kSliceColumns - 1) / kSliceColumns), kRowSumSlices);
  const bool vectors = cols % kColumnsPerLane == 0 && rows_are_vector_aligned(matrix, stride, 2);
  if (dtype == DType::bf16) {
    slice_sums_kernel<<<grid, 32 * kSliceWarps, 0, stream>>>(
        static_cast<const bf16_t*>(matrix), rows, cols, stride, coef, partials, vectors);
  } else {
    slice_sums_kernel<<<grid, 32 * kSliceWarps, 0, stream>>>(
        static_cast<const f16_t*>(matrix), rows, cols, stride, coef, partials, vectors);
  }
  XENT_CUDA_CHECK_LAUNCH();
  constexpr int kThreads = 256;
  add_slices_kernel<<<static_cast<unsigned>((cols + kThreads - 1) / kThreads), kThreads, 0,
                      stream>>>(partials, cols, out);
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
