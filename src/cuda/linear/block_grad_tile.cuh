// What the two elementwise block-gradient kernels share (linear_block_grad.cu for cross-entropy,
// linear_distill_block_grad.cu for distillation): the gradient tile they write, and how their CTAs
// cover it. One CTA per row segment of 256 threads × 2 16-byte vectors, so the per-row
// coefficients are formed once per segment; 16-byte loads and stores wherever every row of every
// operand is aligned, element by element else.
#pragma once

#include <cstdint>

#include "cuda/rows/ce_device.cuh"

namespace xent::cuda {

// The gradient a block-gradient kernel writes: [rows, columns] with grad_stride, in `dtype` (that
// of the logits it reads), the columns [first_column, first_column + columns) of rows of V.
struct BlockGradTile {
  void* grad = nullptr;
  int64_t grad_stride = 0;
  DType dtype = DType::bf16;
  int64_t rows = 0;
  int64_t columns = 0;
  int64_t first_column = 0;  // global index of the block's first column
  int64_t vocab = 0;         // V of the whole row (smoothing divides by it)
};

inline constexpr int kBlockGradThreads = 256;
inline constexpr int kBlockGradVectorsPerThread = 2;

// Columns of one row segment of elements of `element` bytes.
__host__ __device__ constexpr int64_t segment_columns(std::size_t element) {
  return int64_t{kBlockGradThreads} * kBlockGradVectorsPerThread *
         (16 / static_cast<int64_t>(element));
}

// The kernel parameter of a block-gradient launch: the arguments (a BlockGradTile and what the
// loss forms it of), how many CTAs cover a row, and whether every row of every operand is 16-byte
// aligned (rows_are_vector_aligned).
template <class Args>
struct BlockGradParams {
  Args args;
  int64_t segments_per_row;
  bool vector_ok;
};

template <class Args>
BlockGradParams<Args> block_grad_params(const Args& args, bool vector_ok) {
  const int64_t segment = segment_columns(dtype_size(args.dtype));
  return BlockGradParams<Args>{args, (args.columns + segment - 1) / segment, vector_ok};
}

// One CTA per row segment.
template <class Args>
dim3 block_grad_grid(const BlockGradParams<Args>& p) {
  return dim3(static_cast<unsigned>(p.args.rows * p.segments_per_row));
}

// The row segment of CTA blockIdx.x: tile row, first column within the tile, and length.
struct RowSegment {
  int64_t row;
  int64_t begin;
  int64_t length;
};

template <class S>
__device__ __forceinline__ RowSegment row_segment(int64_t columns, int64_t segments_per_row) {
  constexpr int64_t kSegment = segment_columns(sizeof(S));
  RowSegment segment;
  segment.row = blockIdx.x / segments_per_row;
  segment.begin = (blockIdx.x % segments_per_row) * kSegment;
  segment.length = columns - segment.begin < kSegment ? columns - segment.begin : kSegment;
  return segment;
}

// A row without a gradient: zeros for an ignored row, NaN for an out-of-range target (docs/semantics.md §1).
template <class S>
__device__ __forceinline__ void fill_segment(S* grad, int64_t length, bool valid) {
  const S fill = store_float<S>(valid ? quiet_nan() : 0.0f);
  for (int64_t i = threadIdx.x; i < length; i += kBlockGradThreads) grad[i] = fill;
}

// grad[j·kVec + k] = element(j·kVec + k, value of every input there) over the 16-byte vector j;
// every input's vector is loaded before any element is formed.
template <class S, class Element, class... Rest>
__device__ __forceinline__ void write_vector(S* grad, int64_t j, const Element& element,
                                             Vector<S> first, const Rest&... rest) {
  constexpr int kVec = kVectorElements<S>;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    first.value[k] = element(j * kVec + k, first.value[k], rest.value[k]...);
  }
  reinterpret_cast<uint4*>(grad)[j] = pack<S>(first);
}

// grad[i] = element(i, inputs[i] in fp32...) over the segment's `length` columns: the inputs are
// the logits of the segment (ce), or the student's then the teacher's (distillation).
template <class S, class Element, class... Inputs>
__device__ __forceinline__ void write_segment(S* grad, int64_t length, bool vector_ok,
                                              const Element& element, const Inputs*... inputs) {
  constexpr int kVec = kVectorElements<S>;
  if (vector_ok) {
    for (int64_t j = threadIdx.x; j * kVec < length; j += kBlockGradThreads) {
      if ((j + 1) * kVec <= length) {
        write_vector(grad, j, element,
                     unpack<S>(__ldg(reinterpret_cast<const uint4*>(inputs) + j))...);
      } else {
        for (int64_t i = j * kVec; i < length; ++i) {
          grad[i] = store_float<S>(element(i, load_float(inputs[i])...));
        }
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < length; i += kBlockGradThreads) {
      grad[i] = store_float<S>(element(i, load_float(inputs[i])...));
    }
  }
}

}  // namespace xent::cuda
