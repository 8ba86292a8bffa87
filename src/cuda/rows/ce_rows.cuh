// Internal entry points of the CUDA cross-entropy row kernel (docs/semantics.md §1), shared by ce on logits
// and by the chunked linear_ce, which feeds it chunks of logits it computed itself.
//
// A call is three steps, all stream-ordered, no host synchronisation, CUDA-graph capturable:
//   1. ce_batch_totals  — one pre-pass over ALL targets of the batch: N_valid, D, W (class-weight
//      sum), the mean factors 1/D and 1/N_valid and the scalar upstream gradient, into a
//      CeBatchTotals in device memory; it also records the first out-of-range target in the
//      device error state (read by check_errors).
//   2. ce_rows          — per chunk of rows: reads each row's logits from HBM ONCE, writes the
//      per-row loss parts and statistics to caller arrays and, on request, the gradient (which
//      may overwrite the logits in place). Coefficients come from the totals of step 1, so a
//      chunk's gradient is final when the chunk is done.
//   3. ce_reduce        — one fixed-order reduction of the per-row arrays of the whole batch into
//      the scalar loss, z-loss value and accuracy (bitwise deterministic, no atomics).
// Pointers marked "chunk" point at the chunk's first row (the caller adds the chunk offset).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/core/device.cuh"
#include "xent/ce.hpp"

namespace xent::cuda {

// Device-resident totals of a batch, written by ce_batch_totals, read by kernels.
struct CeBatchTotals {
  double valid_rows;         // N_valid (rows whose target != ignore_index; all rows if no target)
  double target_weight_sum;  // D: Σ_{valid n} w_{y_n} with class weights, else N_valid
  float class_weight_sum;    // W = Σ_i w_i, or V without class weights
  float loss_factor;         // 1/D for mean (0 when D = 0), 1 for sum/none
  float z_factor;            // 1/N_valid for mean (0 when N_valid = 0), 1 for sum/none
  float upstream;            // scalar grad_output for sum/mean (1 when absent or none)
};

// The §1 options as the row kernel takes them (row_weight is per chunk, see CeRowsArgs).
struct CeRowOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
  float label_smoothing = 0;
  float z_loss = 0;
  float softcap = 0;  // 0: off
  float logit_scale = 1;
  const float* class_weight = nullptr;  // [V] fp32 on the device, or null
};
CeRowOptions ce_row_options(const CeOptions& options);

struct CeBatchRequest {
  const void* target = nullptr;  // [rows] int64/int32 of the whole batch; null: every row valid
  DType target_dtype = DType::i64;
  int64_t rows = 0;
  int64_t vocab = 0;
  CeRowOptions options;
  const float* grad_output = nullptr;  // scalar upstream gradient of sum/mean, or null (= 1)
  OpCode op = OpCode::ce_forward;      // named by check_errors
};

// Step 1. `totals` is device memory (e.g. the first bytes of the workspace).
void ce_batch_totals(const CeBatchRequest& request, CeBatchTotals* totals, cudaStream_t stream);

struct CeRowsArgs {
  const void* logits = nullptr;  // chunk: [rows, vocab] with row_stride, fp32/bf16/fp16
  DType dtype = DType::bf16;
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t row_stride = 0;
  const void* target = nullptr;  // chunk: [rows] (required)
  DType target_dtype = DType::i64;
  const float* row_weight = nullptr;  // chunk: [rows] or null
  CeRowOptions options;
  const CeBatchTotals* totals = nullptr;  // device, from ce_batch_totals over the whole batch
  // The launch just before this one on the stream is the ce_batch_totals that fills `totals`:
  // the row kernel then starts beside it and waits for it only after its sweep over the logits.
  bool after_totals = false;
  const float* grad_output_rows = nullptr;  // chunk: per-row g_n (reduction none) or null

  // Outputs, each optional (null = not computed), all chunk pointers of fp32 unless said.
  float* row_loss = nullptr;     // r_n·ℓ_n, 0 for ignored rows (input of ce_reduce)
  float* row_z_loss = nullptr;   // r_n·ζ_n
  float* row_total = nullptr;    // r_n·(ℓ_n + ζ_n): the loss of reduction none
  float* row_correct = nullptr;  // 1 where argmax == target on a valid row, else 0
  float* lse = nullptr;          // 0 for ignored rows
  float* logprob = nullptr;      // 0 for ignored rows
  float* entropy = nullptr;      // 0 for ignored rows
  int64_t* argmax = nullptr;     // −1 for ignored rows
  // Gradient ∂loss/∂logits (same dtype as the logits), or null. It may be exactly the logits
  // buffer (in place): every CTA stages its part of a row on chip before writing it.
  // Coefficient of row n: upstream·r_n·loss_factor (g_n instead of upstream when
  // grad_output_rows is given); the z-loss part uses z_factor. Ignored rows get zeros;
  // rows with an out-of-range target get NaN (and a NaN loss).
  void* grad = nullptr;
  int64_t grad_row_stride = 0;
  float grad_scale = 1;  // extra constant multiplier of the gradient (1 for plain ce)
};

// Step 2: one launch over the chunk's rows. Rows up to a few hundred thousand columns stay on chip
// (split over a thread-block cluster); longer rows take a path that reads them twice.
void ce_rows(const CeRowsArgs& args, cudaStream_t stream);

struct CeReduceArgs {
  int64_t rows = 0;  // the whole batch
  Reduction reduction = Reduction::mean;
  const float* row_loss = nullptr;     // [rows] from ce_rows (required for loss)
  const float* row_z_loss = nullptr;   // [rows] or null (no z-loss)
  const float* row_correct = nullptr;  // [rows] or null (no accuracy)
  const CeBatchTotals* totals = nullptr;
  float* loss = nullptr;          // scalar of sum/mean, or null (for none ce_rows wrote row_total)
  float* z_loss_value = nullptr;  // scalar of sum/mean, or null
  float* accuracy = nullptr;      // scalar, or null
};

// Step 3: loss = Σ row_loss·loss_factor + Σ row_z_loss·z_factor (mean divides by D and N_valid,
// sum adds), summed in a fixed order in double.
void ce_reduce(const CeReduceArgs& args, cudaStream_t stream);

// The inputs of ce_rows for logits [N, V] and target [N] with the §1 options (no outputs set).
CeRowsArgs ce_rows_args(TensorView logits, TensorView target, const CeOptions& options,
                        const CeBatchTotals* totals);

// Points a's per-row outputs at `out` (the loss of none, the statistics) and at the per-row arrays
// row_loss, row_z_loss, row_correct of the batch; returns the reduction of those arrays into the
// scalar outputs of `out` (ce_forward, and the sharded ce's merge kernel, which writes the same).
CeReduceArgs bind_ce_outputs(CeRowsArgs& a, const CeOutputs& out, Reduction reduction, int64_t rows,
                             float* row_loss, float* row_z_loss, float* row_correct,
                             const CeBatchTotals* totals);

// Bytes of device workspace ce on logits uses for `rows` rows: totals + three per-row arrays.
std::size_t ce_workspace_bytes(int64_t rows);

}  // namespace xent::cuda
