// Internal entry points of the CUDA distillation row kernel (SPEC.md §3), shared by distill on
// logits and by the chunked linear_distill, which feeds it chunks of student and teacher logits.
// The steps mirror ce_rows.cuh: ce_batch_totals over the whole batch (N_valid, and D/W for the
// hard-label term), distill_rows per chunk (student and teacher rows read from HBM once, the
// gradient with respect to the student written once, optionally over the student buffer), and
// distill_reduce for the scalar loss.
#pragma once

#include "common/distill_row.hpp"
#include "cuda/ce_rows.cuh"
#include "xent/distill.hpp"

namespace xent::cuda {

struct DistillRowOptions {
  common::DistillKindCode kind = common::DistillKindCode::forward_kl;
  float temperature = 1;
  float beta = 0.5f;
  float softcap = 0;         // 0: off; applied to student and teacher before T
  double soft_weight = 1;    // σ
  double hard_weight = 0;    // α (the hard term needs a target)
  CeRowOptions ce;           // ignore_index and reduction of the whole op; the rest: hard term
};
DistillRowOptions distill_row_options(const DistillOptions& options);

struct DistillRowsArgs {
  const void* student = nullptr;  // chunk [rows, vocab], fp32/bf16/fp16
  int64_t student_row_stride = 0;
  const void* teacher = nullptr;  // chunk [rows, vocab], same dtype as the student
  int64_t teacher_row_stride = 0;
  DType dtype = DType::bf16;
  int64_t rows = 0;
  int64_t vocab = 0;
  const void* target = nullptr;  // chunk [rows], or null: every row valid, no hard term
  DType target_dtype = DType::i64;
  const float* row_weight = nullptr;  // chunk [rows] or null (hard term only)
  DistillRowOptions options;
  const CeBatchTotals* totals = nullptr;    // from ce_batch_totals over the whole batch
  const float* grad_output_rows = nullptr;  // chunk: g_n of reduction none, or null

  // Outputs (chunk pointers, fp32, each optional).
  float* row_soft = nullptr;       // d_n, the distillation loss of the row (0 when ignored)
  float* row_hard_loss = nullptr;  // r_n·ℓ_n of the hard term
  float* row_hard_z = nullptr;     // r_n·ζ_n of the hard term
  float* row_total = nullptr;      // σ·d_n + α·r_n·(ℓ_n + ζ_n): the loss of reduction none
  // ∂loss/∂student (student dtype), or null; may be exactly the student buffer (in place).
  void* grad = nullptr;
  int64_t grad_row_stride = 0;
};

void distill_rows(const DistillRowsArgs& args, cudaStream_t stream);

struct DistillReduceArgs {
  int64_t rows = 0;  // the whole batch
  Reduction reduction = Reduction::mean;
  double soft_weight = 1;
  double hard_weight = 0;
  const float* row_soft = nullptr;
  const float* row_hard_loss = nullptr;  // null when there is no hard term
  const float* row_hard_z = nullptr;
  const CeBatchTotals* totals = nullptr;
  float* loss = nullptr;  // scalar of sum/mean
};

// σ·(Σ d_n, divided by N_valid for mean) + α·(the §1 reduction of the hard term), fixed order.
void distill_reduce(const DistillReduceArgs& args, cudaStream_t stream);

// Bytes of device workspace distill on logits uses: totals + three per-row arrays.
std::size_t distill_workspace_bytes(int64_t rows);

}  // namespace xent::cuda
