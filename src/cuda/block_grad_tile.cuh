// What the two elementwise block-gradient kernels share (linear_block_grad.cu for cross-entropy,
// linear_distill_block_grad.cu for distillation): the gradient tile they write, and how their CTAs
// cover it. The threads of a row segment (up to 256, × 2 16-byte vectors each) each form the
// per-row coefficients once; 16-byte loads and stores wherever every row of every operand is
// aligned, element by element else.
#pragma once

#include <cstdint>

#include "cuda/ce_device.cuh"

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

// The kernel parameter of a block-gradient launch: the arguments (a BlockGradTile and what the
// loss forms it of), how the CTAs cover the tile, and whether every row of every operand is
// 16-byte aligned (rows_are_vector_aligned). A row is covered by threads_per_row threads (a power
// of two, 32 to 256), so a CTA covers 256 / threads_per_row rows, or one segment of a long row.
// Narrow blocks need this: with one row per CTA, the 960-column blocks of a 64 MiB plan at
// (32768, 768, 128256) kept 120 of 256 threads busy on one 16-byte load each, and the block
// gradient took 21 % of the step at 27 % of copy bandwidth (docs/perf-notes.md, decision 36).
template <class Args>
struct BlockGradParams {
  Args args;
  int64_t segments_per_row;
  int threads_per_row;
  bool vector_ok;
};

template <class Args>
BlockGradParams<Args> block_grad_params(const Args& args, bool vector_ok) {
  const int64_t vec = 16 / static_cast<int64_t>(dtype_size(args.dtype));
  const int64_t vectors = (args.columns + vec - 1) / vec;
  // The fewest threads that still leave each at most kBlockGradVectorsPerThread vectors.
  int threads = kBlockGradThreads;
  while (threads > 32 && int64_t{threads / 2} * kBlockGradVectorsPerThread >= vectors) threads /= 2;
  const int64_t segment = int64_t{threads} * kBlockGradVectorsPerThread * vec;
  return BlockGradParams<Args>{args, (args.columns + segment - 1) / segment, threads, vector_ok};
}

template <class Args>
dim3 block_grad_grid(const BlockGradParams<Args>& p) {
  const int64_t rows_per_cta = kBlockGradThreads / p.threads_per_row;
  return dim3(static_cast<unsigned>((p.args.rows + rows_per_cta - 1) / rows_per_cta *
                                    p.segments_per_row));
}

// The row segment of this thread: tile row, first column within the tile, length, and the
// thread's place among those covering it (lane, stride). present is false for the threads of a
// last CTA past the tile's rows.
struct RowSegment {
  int64_t row;
  int64_t begin;
  int64_t length;
  int lane;
  int stride;
  bool present;
};

template <class S, class Args>
__device__ __forceinline__ RowSegment row_segment(const BlockGradParams<Args>& p) {
  RowSegment segment;
  const int64_t segment_columns =
      int64_t{p.threads_per_row} * kBlockGradVectorsPerThread * kVectorElements<S>;
  const int rows_per_cta = kBlockGradThreads / p.threads_per_row;
  segment.stride = p.threads_per_row;
  segment.lane = static_cast<int>(threadIdx.x) % p.threads_per_row;
  segment.row = static_cast<int64_t>(blockIdx.x / p.segments_per_row) * rows_per_cta +
                static_cast<int>(threadIdx.x) / p.threads_per_row;
  segment.begin = (blockIdx.x % p.segments_per_row) * segment_columns;
  const int64_t left = p.args.columns - segment.begin;
  segment.length = left < segment_columns ? left : segment_columns;
  segment.present = segment.row < p.args.rows;
  return segment;
}

// A row without a gradient: zeros for an ignored row, NaN for an out-of-range target (SPEC §1).
template <class S>
__device__ __forceinline__ void fill_segment(S* grad, const RowSegment& segment, bool valid) {
  const S fill = store_float<S>(valid ? quiet_nan() : 0.0f);
  for (int64_t i = segment.lane; i < segment.length; i += segment.stride) grad[i] = fill;
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

template <class S>
struct VectorPair {
  Vector<S> first, second;
};

// Vectors j0 and j1 of one input, both loads issued before either is used.
template <class S>
__device__ __forceinline__ VectorPair<S> load_pair(const S* input, int64_t j0, int64_t j1) {
  const uint4* vectors = reinterpret_cast<const uint4*>(input);
  const uint4 first = __ldg(vectors + j0);
  const uint4 second = __ldg(vectors + j1);
  return {unpack<S>(first), unpack<S>(second)};
}

template <class S, class Element, class... Pairs>
__device__ __forceinline__ void write_pair(S* grad, int64_t j0, int64_t j1,
                                           const Element& element, const Pairs&... pairs) {
  write_vector(grad, j0, element, pairs.first...);
  write_vector(grad, j1, element, pairs.second...);
}

// grad[i] = element(i, inputs[i] in fp32...) over the segment's `length` columns: the inputs are
// the logits of the segment (ce), or the student's then the teacher's (distillation).
template <class S, class Element, class... Inputs>
__device__ __forceinline__ void write_segment(S* grad, const RowSegment& segment, bool vector_ok,
                                              const Element& element, const Inputs*... inputs) {
  constexpr int kVec = kVectorElements<S>;
  static_assert(kBlockGradVectorsPerThread == 2, "write_segment's fast path holds two vectors");
  const int64_t length = segment.length;
  if (vector_ok) {
    // A thread holds at most two vectors of its segment (block_grad_params). When both are
    // whole, every load is issued before any element is formed: the loop below, whose stride is
    // known only at run time, issued them one after the other (decision 36, perf-notes).
    const int64_t j0 = segment.lane, j1 = segment.lane + segment.stride;
    if ((j1 + 1) * kVec <= length) {
      write_pair(grad, j0, j1, element, load_pair(inputs, j0, j1)...);
      return;
    }
    for (int64_t j = segment.lane; j * kVec < length; j += segment.stride) {
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
    for (int64_t i = segment.lane; i < length; i += segment.stride) {
      grad[i] = store_float<S>(element(i, load_float(inputs[i])...));
    }
  }
}

}  // namespace xent::cuda
