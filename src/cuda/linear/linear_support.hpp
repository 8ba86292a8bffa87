// Pieces shared by the fused linear losses on CUDA: carving the caller's workspace, and the small
// memory-bound kernels around the products (bias gradient, fp32 accumulator write-back, in-place
// narrowing of fp32 chunk gradients to the operand dtype).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/rows/ce_rows.cuh"
#include "cuda/plan/chunk_plan.hpp"
#include "cuda/core/device.cuh"
#include "cuda/core/gemm.hpp"
#include "xent/linear_ce.hpp"
#include "xent/types.hpp"

namespace xent::cuda {

// Hands out aligned regions of the caller's workspace in order; throws a runtime Error when the
// workspace is smaller than the plan (the API layer has checked sizes, so this is a bug guard).
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(Workspace workspace)
      : base_(static_cast<char*>(workspace.data)), capacity_(workspace.bytes) {}
  void* take(std::size_t bytes);
  std::size_t used() const { return used_; }

 private:
  char* base_;
  std::size_t capacity_;
  std::size_t used_ = 0;
};

// accumulator[c] (+)= Σ_r matrix[r, c] in fp32 (∂bias = column sums of the chunk gradient).
// Rows are summed in order by one thread per column: deterministic, and coalesced across columns.
void accumulate_column_sums(const void* matrix, DType dtype, int64_t rows, int64_t cols,
                            int64_t stride, float* accumulator, bool accumulate,
                            cudaStream_t stream);

// Writes an fp32 [rows, cols] matrix (source_stride) into `destination` in its dtype.
void write_from_fp32(const float* source, int64_t source_stride, TensorView destination,
                     cudaStream_t stream);

// Zero-fills a matrix or vector view (gradients of an empty batch).
void fill_zero(TensorView view, cudaStream_t stream);

// Rounds each fp32 row of `data` ([rows, cols], row stride `stride` floats) to `target` (bf16 or
// fp16) in place: row r's 16-bit values land at the start of its own fp32 row, so the result is
// a 16-bit matrix with row stride 2·stride elements.
void narrow_rows_in_place(void* data, int64_t rows, int64_t cols, int64_t stride, DType target,
                          cudaStream_t stream);

// Copies a [rows, cols] matrix into `destination` (row stride `destination_stride`), converting
// the dtype (teacher logits to the dtype of the student chunk).
void convert_rows(const void* source, DType source_dtype, int64_t source_stride, void* destination,
                  DType destination_dtype, int64_t destination_stride, int64_t rows, int64_t cols,
                  cudaStream_t stream);

// Where ∂W and ∂bias accumulate across chunks: the outputs themselves when they are fp32, else
// fp32 accumulators in the workspace, written back once at the end (linear_ce.hpp). Only the
// row_chunks_accumulated schedule keeps a V×H fp32 ∂W (accumulate_weight): a single chunk writes
// ∂W straight into the 16-bit output (one rounding, as a plain Gᵀ·h would), and the
// vocabulary-blocked schedule forms ∂W block by block after the row chunks (weight = null here).
// With accumulate_weight ∂W sums straight into the caller's fp32 buffer from the first chunk on
// (weight_added: the first product adds too).
struct GradientSums {
  void* weight = nullptr;
  DType weight_dtype = DType::f32;
  int64_t weight_stride = 0;
  bool weight_in_workspace = false;
  bool weight_added = false;
  float* bias = nullptr;
  bool bias_in_workspace = false;
};
// Grid-stride elementwise kernels over `work` items: 256-thread blocks, as many as cover the work
// up to 65535.
constexpr int kElementwiseThreads = 256;
inline int elementwise_blocks(int64_t work) {
  const int64_t blocks = (work + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 65535 ? 65535 : blocks));
}

// The per-row arrays of the whole batch that the row kernels fill chunk by chunk: the batch
// totals and three fp32 arrays (loss, z-loss, correct) of N rows.
inline std::size_t row_scratch_bytes(int64_t rows) {
  const std::size_t per_row = align_up(static_cast<std::size_t>(rows) * sizeof(float));
  return align_up(sizeof(CeBatchTotals)) + 3 * per_row;
}

// Element `first_row` of a 1-D view (the chunk's slice of a per-row input or output), or null.
template <class T>
T* offset_rows(const TensorView& view, int64_t first_row) {
  if (!view.present()) return nullptr;
  return reinterpret_cast<T*>(static_cast<char*>(view.data) +
                              static_cast<std::size_t>(first_row) * dtype_size(view.dtype));
}

// A budget below the smallest plan cannot run (docs/semantics.md §2 bounds the workspace by it): the op says
// so in the validation message format, before anything is written.
[[noreturn]] void throw_budget_too_small(OpCode op, std::size_t budget, std::size_t needed);

// fp32 ∂bias bytes (V floats) when a 16-bit bias gradient is wanted, part of every plan's budget.
std::size_t bias_accumulator_bytes(bool sixteen_bit_bias_gradient, int64_t vocab);
GradientSums carve_gradient_sums(WorkspaceCarver& carver, const LinearGradients& grads,
                                 int64_t vocab, int64_t hidden, const ChunkPlan& plan);

// The products of one chunk after its gradient G [rows, V] is formed: ∂h rows = G·W (written),
// ∂W (+)= Gᵀ·h_chunk and ∂bias (+)= Σ_rows G into the sums (overwriting on the first chunk).
void accumulate_chunk_gradients(const GemmMatrix& gradient, const GemmMatrix& hidden_rows,
                                const GemmMatrix& weight, const LinearGradients& grads,
                                int64_t first_row, bool first_chunk, const GradientSums& sums,
                                GemmScratch scratch, cudaStream_t stream);

// After the last chunk: writes workspace accumulators to the outputs, or zero-fills the
// parameter gradients when there was no chunk at all (N = 0; an accumulated ∂W is left as is).
void finish_gradient_sums(const LinearGradients& grads, const GradientSums& sums, int64_t hidden,
                          bool any_chunk, cudaStream_t stream);

}  // namespace xent::cuda
