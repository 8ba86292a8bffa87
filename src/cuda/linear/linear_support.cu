// Small memory-bound kernels around the products of the fused linear losses. Each touches a
// chunk or a parameter-sized array once; none is on the critical path when bias is absent.
#include "cuda/linear/linear_support.hpp"

#include <algorithm>
#include <string>

#include "cuda/core/device.cuh"

namespace xent::cuda {

void* WorkspaceCarver::take(std::size_t bytes) {
  const std::size_t aligned = align_up(bytes);
  if (used_ + aligned > capacity_) {
    throw Error(ErrorKind::runtime, "linear workspace carving: need " +
                                        std::to_string(used_ + aligned) + " bytes, have " +
                                        std::to_string(capacity_));
  }
  void* region = base_ + used_;
  used_ += aligned;
  return region;
}

namespace {

constexpr int kThreads = kElementwiseThreads;

// Column sums: a CTA per 32 columns (a lane per column, so a warp reads 32 adjacent values of a
// row), its 32 warps taking every 32nd row, then the warps' partials added in a fixed order:
// deterministic, and a tile of a few thousand columns still spreads over ~100 multiprocessors
// (a thread per column walking all rows ran 12 CTAs for 3072 columns: decision 101).
constexpr int kColumnSumWarps = 32;

template <class S>
__global__ void __launch_bounds__(32 * kColumnSumWarps)
    column_sums_kernel(const S* matrix, int64_t rows, int64_t cols, int64_t stride,
                       float* accumulator, bool accumulate) {
  __shared__ float partials[kColumnSumWarps][33];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t col = int64_t{blockIdx.x} * 32 + lane;
  // Four independent partial sums keep several loads in flight per thread.
  float partial[4] = {0, 0, 0, 0};
  if (col < cols) {
    int64_t row = warp;
    for (; row + 3 * kColumnSumWarps < rows; row += 4 * kColumnSumWarps) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        partial[k] += load_float(matrix[(row + k * kColumnSumWarps) * stride + col]);
      }
    }
    for (; row < rows; row += kColumnSumWarps) partial[0] += load_float(matrix[row * stride + col]);
  }
  partials[warp][lane] = (partial[0] + partial[1]) + (partial[2] + partial[3]);
  __syncthreads();
  if (warp != 0 || col >= cols) return;
  float sum = 0;
  for (int w = 0; w < kColumnSumWarps; ++w) sum += partials[w][lane];
  accumulator[col] = accumulate ? accumulator[col] + sum : sum;
}

// Contiguous case (the accumulators are dense): four elements per thread from one 16-byte load,
// and no per-element index division. Used when source and destination are both 16-byte aligned.
template <class D>
__global__ void write_dense_from_fp32_kernel(const float4* source, D* destination, int64_t quads) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < quads;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float4 v = source[i];
    D* out = destination + 4 * i;
    out[0] = store_float<D>(v.x);
    out[1] = store_float<D>(v.y);
    out[2] = store_float<D>(v.z);
    out[3] = store_float<D>(v.w);
  }
}

template <class D>
__global__ void write_from_fp32_kernel(const float* source, int64_t source_stride, D* destination,
                                       int64_t rows, int64_t cols, int64_t destination_stride) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / cols, col = i % cols;
    destination[row * destination_stride + col] = store_float<D>(source[row * source_stride + col]);
  }
}

// One block per row, tile by tile in increasing column order. A 16-bit value for column j lands
// in bytes [2j, 2j+2), inside fp32 element j/2 ≤ j, which this block has already read: the
// barrier between a tile's reads and its writes is the only ordering needed.
template <class D>
__global__ void narrow_rows_kernel(void* data, int64_t cols, int64_t stride) {
  constexpr int kPerThread = 4;
  char* row_start = static_cast<char*>(data) + blockIdx.x * stride * int64_t{sizeof(float)};
  const float* source = reinterpret_cast<const float*>(row_start);
  D* destination = reinterpret_cast<D*>(row_start);
  const int64_t tile = int64_t{blockDim.x} * kPerThread;
  for (int64_t first = 0; first < cols; first += tile) {
    float values[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t col = first + k * blockDim.x + threadIdx.x;
      values[k] = col < cols ? source[col] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int64_t col = first + k * blockDim.x + threadIdx.x;
      if (col < cols) destination[col] = store_float<D>(values[k]);
    }
    __syncthreads();
  }
}

template <class S, class D>
__global__ void convert_rows_kernel(const S* source, int64_t source_stride, D* destination,
                                    int64_t destination_stride, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / cols, col = i % cols;
    destination[row * destination_stride + col] =
        store_float<D>(load_float(source[row * source_stride + col]));
  }
}

template <class S>
void convert_rows_from(const S* source, int64_t source_stride, void* destination,
                       DType destination_dtype, int64_t destination_stride, int64_t rows,
                       int64_t cols, cudaStream_t stream) {
  const int blocks = elementwise_blocks(rows * cols);
  switch (destination_dtype) {
    case DType::f32:
      convert_rows_kernel<<<blocks, kThreads, 0, stream>>>(
          source, source_stride, static_cast<float*>(destination), destination_stride, rows, cols);
      break;
    case DType::bf16:
      convert_rows_kernel<<<blocks, kThreads, 0, stream>>>(
          source, source_stride, static_cast<bf16_t*>(destination), destination_stride, rows, cols);
      break;
    default:
      convert_rows_kernel<<<blocks, kThreads, 0, stream>>>(
          source, source_stride, static_cast<f16_t*>(destination), destination_stride, rows, cols);
  }
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void convert_rows(const void* source, DType source_dtype, int64_t source_stride, void* destination,
                  DType destination_dtype, int64_t destination_stride, int64_t rows, int64_t cols,
                  cudaStream_t stream) {
  if (rows * cols == 0) return;
  switch (source_dtype) {
    case DType::f32:
      convert_rows_from(static_cast<const float*>(source), source_stride, destination,
                        destination_dtype, destination_stride, rows, cols, stream);
      break;
    case DType::bf16:
      convert_rows_from(static_cast<const bf16_t*>(source), source_stride, destination,
                        destination_dtype, destination_stride, rows, cols, stream);
      break;
    default:
      convert_rows_from(static_cast<const f16_t*>(source), source_stride, destination,
                        destination_dtype, destination_stride, rows, cols, stream);
  }
}

std::size_t bias_accumulator_bytes(bool sixteen_bit_bias_gradient, int64_t vocab) {
  return sixteen_bit_bias_gradient ? align_up(static_cast<std::size_t>(vocab) * sizeof(float)) : 0;
}

GradientSums carve_gradient_sums(WorkspaceCarver& carver, const LinearGradients& grads,
                                 int64_t vocab, int64_t hidden, const ChunkPlan& plan) {
  GradientSums sums;
  if (grads.weight.present() && plan.schedule != Schedule::vocabulary_blocks) {
    sums.weight_in_workspace = plan.schedule == Schedule::row_chunks_accumulated;
    if (sums.weight_in_workspace) {
      sums.weight = carver.take(static_cast<std::size_t>(vocab) * static_cast<std::size_t>(hidden) *
                                sizeof(float));
      sums.weight_dtype = DType::f32;
      sums.weight_stride = hidden;
    } else {
      sums.weight = grads.weight.data;
      sums.weight_dtype = grads.weight.dtype;
      sums.weight_stride = grads.weight.row_stride;
      sums.weight_added = grads.accumulate_weight;
    }
  }
  if (grads.bias.present()) {
    sums.bias_in_workspace = grads.bias.dtype != DType::f32;
    sums.bias =
        sums.bias_in_workspace
            ? static_cast<float*>(carver.take(static_cast<std::size_t>(vocab) * sizeof(float)))
            : static_cast<float*>(grads.bias.data);
  }
  return sums;
}

void accumulate_chunk_gradients(const GemmMatrix& gradient, const GemmMatrix& hidden_rows,
                                const GemmMatrix& weight, const LinearGradients& grads,
                                int64_t first_row, bool first_chunk, const GradientSums& sums,
                                GemmScratch scratch, cudaStream_t stream) {
  if (grads.hidden.present()) {
    GemmProduct product;
    product.a = gradient;
    product.b = weight;
    product.c = gemm_matrix(grads.hidden, first_row, gradient.rows);
    gemm(product, scratch, stream);
  }
  if (sums.weight) {
    GemmProduct product;
    product.a = gradient;
    product.a_transposed = true;
    product.b = hidden_rows;
    product.c =
        GemmMatrix{sums.weight, sums.weight_dtype, weight.rows, weight.cols, sums.weight_stride};
    product.beta = first_chunk && !sums.weight_added ? 0.0f : 1.0f;
    gemm(product, scratch, stream);
  }
  if (sums.bias) {
    accumulate_column_sums(gradient.data, gradient.dtype, gradient.rows, gradient.cols,
                           gradient.stride, sums.bias, !first_chunk, stream);
  }
}

void finish_gradient_sums(const LinearGradients& grads, const GradientSums& sums, int64_t hidden,
                          bool any_chunk, cudaStream_t stream) {
  if (!any_chunk) {
    if (grads.weight.present() && !grads.accumulate_weight) fill_zero(grads.weight, stream);
    if (grads.bias.present()) fill_zero(grads.bias, stream);
    return;
  }
  if (sums.weight_in_workspace) {
    write_from_fp32(static_cast<const float*>(sums.weight), hidden, grads.weight, stream);
  }
  if (sums.bias_in_workspace) write_from_fp32(sums.bias, 1, grads.bias, stream);
}

void accumulate_column_sums(const void* matrix, DType dtype, int64_t rows, int64_t cols,
                            int64_t stride, float* accumulator, bool accumulate,
                            cudaStream_t stream) {
  if (cols == 0) return;
  const unsigned blocks = static_cast<unsigned>((cols + 31) / 32);
  constexpr int kColumnSumThreads = 32 * kColumnSumWarps;
  auto launch = [&](const auto* typed) {
    column_sums_kernel<<<blocks, kColumnSumThreads, 0, stream>>>(typed, rows, cols, stride,
                                                                 accumulator, accumulate);
  };
  switch (dtype) {
    case DType::f32:
      launch(static_cast<const float*>(matrix));
      break;
    case DType::bf16:
      launch(static_cast<const bf16_t*>(matrix));
      break;
    default:
      launch(static_cast<const f16_t*>(matrix));
  }
  XENT_CUDA_CHECK_LAUNCH();
}

void write_from_fp32(const float* source, int64_t source_stride, TensorView destination,
                     cudaStream_t stream) {
  const int64_t rows = destination.ndim == 2 ? destination.rows : destination.numel();
  const int64_t cols = destination.ndim == 2 ? destination.cols : 1;
  const int64_t stride = destination.ndim == 2 ? destination.row_stride : 1;
  if (rows * cols == 0) return;
  const int64_t total = rows * cols;
  const bool dense = (rows == 1 || (source_stride == cols && stride == cols)) && total % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(source) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(destination.data) % 16 == 0;
  if (dense && destination.dtype != DType::f32) {
    const int64_t quads = total / 4;
    const int blocks = elementwise_blocks(quads);
    const auto* packed = reinterpret_cast<const float4*>(source);
    if (destination.dtype == DType::bf16) {
      write_dense_from_fp32_kernel<<<blocks, kThreads, 0, stream>>>(
          packed, static_cast<bf16_t*>(destination.data), quads);
    } else {
      write_dense_from_fp32_kernel<<<blocks, kThreads, 0, stream>>>(
          packed, static_cast<f16_t*>(destination.data), quads);
    }
    XENT_CUDA_CHECK_LAUNCH();
    return;
  }
  const int blocks = elementwise_blocks(total);
  switch (destination.dtype) {
    case DType::f32:
      write_from_fp32_kernel<<<blocks, kThreads, 0, stream>>>(
          source, source_stride, static_cast<float*>(destination.data), rows, cols, stride);
      break;
    case DType::bf16:
      write_from_fp32_kernel<<<blocks, kThreads, 0, stream>>>(
          source, source_stride, static_cast<bf16_t*>(destination.data), rows, cols, stride);
      break;
    default:
      write_from_fp32_kernel<<<blocks, kThreads, 0, stream>>>(
          source, source_stride, static_cast<f16_t*>(destination.data), rows, cols, stride);
  }
  XENT_CUDA_CHECK_LAUNCH();
}

void fill_zero(TensorView view, cudaStream_t stream) {
  if (!view.present() || view.numel() == 0) return;
  const std::size_t element = dtype_size(view.dtype);
  if (view.ndim == 2) {
    XENT_CUDA_CHECK(cudaMemset2DAsync(view.data, view.row_stride * element, 0, view.cols * element,
                                      view.rows, stream));
  } else {
    XENT_CUDA_CHECK(cudaMemsetAsync(view.data, 0, view.numel() * element, stream));
  }
}

void narrow_rows_in_place(void* data, int64_t rows, int64_t cols, int64_t stride, DType target,
                          cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  // Rows go one per block along grid x (2^31 − 1 blocks, far above any chunk).
  const dim3 grid(static_cast<unsigned>(rows));
  if (target == DType::bf16) {
    narrow_rows_kernel<bf16_t><<<grid, kThreads, 0, stream>>>(data, cols, stride);
  } else {
    narrow_rows_kernel<f16_t><<<grid, kThreads, 0, stream>>>(data, cols, stride);
  }
  XENT_CUDA_CHECK_LAUNCH();
}

void throw_budget_too_small(OpCode op, std::size_t budget, std::size_t needed) {
  throw Error(ErrorKind::invalid_argument,
              std::string(op_name(op)) + ": workspace_budget too small: got " +
                  std::to_string(budget) + " bytes; expected at least " + std::to_string(needed) +
                  " bytes (the smallest chunk plan of these sizes)");
}

}  // namespace xent::cuda
