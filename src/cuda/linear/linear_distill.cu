// Fused linear distillation on CUDA (docs/semantics.md §4). The flow of linear_ce.cu with a teacher beside
// the student: per row chunk, s = h_s·W_sᵀ into the student buffer; the teacher rows are either
// read where the caller's teacher logits sit, or formed as t = h_t·W_tᵀ into a second buffer (no
// gradient ever flows to the teacher); the distill row kernel of distill_rows.cuh reads both
// once and writes ∂loss/∂s over the student buffer; then ∂h_s = G·W_s and ∂W_s += Gᵀ·h_s.
// When the budget has no room for a V×H fp32 ∂W accumulator (chunk_plan.cpp (c)), the row chunks
// form loss and ∂h_s and save each row's statistics (DistillRowStatistics), and ∂W_s follows per
// block of vocabulary columns: the block's logits again, its gradient elementwise from the saved
// statistics (linear_distill_block_grad.cuh), then ∂W of the block (the pass that linear_ce.cu
// shares, linear_block_pass.hpp). Where even row chunks would be too few rows for efficient
// products (small budgets), schedule (d) forms the statistics block by block as well and sums ∂h
// over the blocks (linear_distill_blocks.cu). The blocked passes live there.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "api/backend.hpp"
#include "api/shard_backend.hpp"
#include "cuda/rows/distill_rows.cuh"
#include "cuda/core/gemm.hpp"
#include "cuda/plan/hidden_sums.hpp"
#include "cuda/linear/linear_distill_passes.hpp"
#include "cuda/plan/linear_distill_plan.hpp"
#include "cuda/linear/linear_distill_records.cuh"
#include "cuda/linear/linear_support.hpp"
#include "cuda/test_hook.hpp"

namespace xent::cuda {

namespace {

// Schedule (d) forced on wherever it fits the budget, or off (tests); else the planner chooses.
char statistics_blocks_switch() {
  const Forced forced = test_hook().distill_statistics_blocks;
  return forced == Forced::on ? '1' : forced == Forced::off ? '0' : 0;
}

// teacher_from_hidden: the teacher comes as hidden + weight. teacher_dtype: the dtype of given
// teacher logits (ignored otherwise); rows of another dtype than the student chunk are converted.
// sums_scratch: the outputs that (d) may keep its ∂h sums in (hidden_sums.hpp).
LinearDistillPlan plan_linear_distill(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                      const LinearDistillOptions& options, bool teacher_from_hidden,
                                      DType teacher_dtype, const LinearGradients& grads,
                                      const HiddenSumsScratch& sums_scratch) {
  LinearDistillPlan plan;
  plan.logits_dtype = options.fp32_logits ? DType::f32 : dtype;
  plan.teacher_buffer = teacher_from_hidden || teacher_dtype != plan.logits_dtype;
  ChunkRequest request;
  request.rows = rows;
  request.hidden = hidden;
  request.vocab = vocab;
  request.logits_element_bytes = dtype_size(plan.logits_dtype);
  request.logits_buffers_per_row = plan.teacher_buffer ? 2 : 1;
  request.budget_bytes = options.workspace_budget;
  // The row chunks' statistics for the two-pass distillation (distill_two_pass.cuh) as well.
  const std::size_t statistics_bytes =
      static_cast<std::size_t>(rows) * sizeof(DistillRowStatistics);
  request.fixed_bytes = row_scratch_bytes(rows) + align_up(statistics_bytes);
  // A 16-bit ∂W over several chunks needs fp32 accumulation, inside the budget (chunk_plan.hpp).
  request.weight_gradient = grads.weight.present();
  request.weight_accumulator = grads.weight.present() && grads.weight.dtype != DType::f32;
  request.products_per_logits_chunk = teacher_from_hidden ? 2 : 1;
  // The blocked schedules keep the row statistics of their first pass for the block gradients.
  request.saved_row_bytes = sizeof(DistillRowStatistics);
  // Schedule (d): the records of every row formed block by block (linear_distill_records.cuh),
  // one sweep of logits products over the blocks (two for jsd and tvd), then the blocks'
  // gradients with ∂h summed over them.
  const char forced = statistics_blocks_switch();
  const double sweeps = distill_shard_needs_sums(options.distill.kind) ? 2 : 1;
  request.statistics_product = grads.weight.present() && forced != '0';
  request.prefer_statistics = forced == '1';
  request.statistics_products = sweeps * request.products_per_logits_chunk;
  request.statistics_passes = sweeps * 2;  // the record kernels read student and teacher tiles
  request.statistics_records_bytes = distill_records_bytes(rows, options.distill.kind);
  request.hidden_gradient = grads.hidden.present();
  set_hidden_sums_places(request, sums_scratch);
  plan.chunks = plan_chunks(request);
  return plan;
}

// The workspace query cannot see the dtype of teacher logits; it reports the larger of the plans
// with and without a conversion buffer where both fit the budget. A workspace smaller than the
// plan (sized for the student's dtype alone) makes the chunks shrink until the plan fits (slower,
// never wrong) where a smaller plan exists.
LinearDistillPlan fit_to_workspace(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                   const LinearDistillOptions& options, bool teacher_from_hidden,
                                   DType teacher_dtype, const LinearGradients& grads,
                                   std::size_t workspace_bytes) {
  LinearDistillOptions fitted = options;
  const HiddenSumsScratch sums_scratch = hidden_sums_scratch(grads);
  LinearDistillPlan plan = plan_linear_distill(
      rows, hidden, vocab, dtype, fitted, teacher_from_hidden, teacher_dtype, grads, sums_scratch);
  auto shrinkable = [&](const ChunkPlan& chunks) {
    return chunks.schedule == Schedule::statistics_blocks
               ? chunks.tile_rows > 1 || chunks.block_columns > 1
               : chunks.chunk_rows > 1;
  };
  while (plan.chunks.total_bytes > workspace_bytes && shrinkable(plan.chunks) &&
         fitted.workspace_budget > 0) {
    fitted.workspace_budget = fitted.workspace_budget / 4 * 3;
    plan = plan_linear_distill(rows, hidden, vocab, dtype, fitted, teacher_from_hidden,
                               teacher_dtype, grads, sums_scratch);
  }
  return plan;
}

std::atomic<int64_t> schedule_runs[4];

void run_linear_distill(const LinearDistillCall& call, Workspace workspace, cudaStream_t stream) {
  const int64_t rows = call.student_hidden.rows, hidden = call.student_hidden.cols,
                vocab = call.student_weight.rows;
  const Teacher& teacher = call.teacher;
  const bool teacher_from_hidden = !teacher.logits.present();
  const DType teacher_dtype = teacher_from_hidden ? DType::f32 : teacher.logits.dtype;
  const LinearGradients& grads = call.grads;
  const bool want_hidden = grads.hidden.present(), want_weight = grads.weight.present();
  const bool want_grad = want_hidden || want_weight;
  const LinearDistillPlan requested =
      plan_linear_distill(rows, hidden, vocab, call.student_hidden.dtype, call.options,
                          teacher_from_hidden, teacher_dtype, grads, hidden_sums_scratch(grads));
  if (!requested.chunks.fits_budget) {
    throw_budget_too_small(call.op, call.options.workspace_budget, requested.chunks.total_bytes);
  }
  const LinearDistillPlan plan =
      fit_to_workspace(rows, hidden, vocab, call.student_hidden.dtype, call.options,
                       teacher_from_hidden, teacher_dtype, grads, workspace.bytes);
  schedule_runs[static_cast<int>(plan.chunks.schedule)].fetch_add(1);
  if (plan.chunks.schedule == Schedule::statistics_blocks) {
    run_statistics_blocks(call, plan, workspace, stream);
    return;
  }
  const DistillOptions& distill = call.options.distill;
  const Reduction reduction = distill.ce.reduction;
  const bool sum_or_mean = reduction != Reduction::none;

  WorkspaceCarver carver(workspace);
  CeBatchTotals* totals = nullptr;
  const DistillRowLosses losses = carve_row_losses(carver, rows, totals);
  auto* row_statistics = static_cast<DistillRowStatistics*>(
      carver.take(static_cast<std::size_t>(rows) * sizeof(DistillRowStatistics)));
  const GemmScratch scratch{carver.take(plan.chunks.gemm_workspace_bytes),
                            plan.chunks.gemm_workspace_bytes};
  char* chunk_buffer = static_cast<char*>(carver.take(chunk_region_bytes(plan.chunks)));
  const GradientSums sums = carve_gradient_sums(carver, grads, vocab, hidden, plan.chunks);
  // Vocabulary-blocked schedule (chunk_plan.cpp (c)): the row chunks form loss, ∂h and the row
  // statistics; ∂W follows block by block (run_block_pass).
  const bool blocked = plan.chunks.schedule == Schedule::vocabulary_blocks && want_weight;
  auto* statistics =
      blocked ? static_cast<DistillRowStatistics*>(carver.take(plan.chunks.lse_bytes)) : nullptr;
  // The teacher half of each chunk buffer follows the student half.
  const std::size_t student_bytes = static_cast<std::size_t>(plan.chunks.chunk_rows) *
                                    static_cast<std::size_t>(vocab) * dtype_size(plan.logits_dtype);
  char* teacher_buffer = plan.teacher_buffer ? chunk_buffer + student_bytes : nullptr;

  const DistillRowOptions row_options = distill_row_options(distill);
  const bool hard_term = row_options.hard_weight > 0 && call.target.present();
  CeBatchRequest batch;
  batch.target = call.target.present() ? call.target.data : nullptr;
  batch.target_dtype = call.target.dtype;
  batch.rows = rows;
  batch.vocab = vocab;
  batch.options = row_options.ce;
  batch.grad_output = (sum_or_mean && call.grad_output.present())
                          ? static_cast<const float*>(call.grad_output.data)
                          : nullptr;
  batch.op = call.op;
  ce_batch_totals(batch, totals, stream);
  const DistillPasses pass{call,   plan,        scratch,
                           totals, row_options, !sum_or_mean && call.grad_output.present()};

  const int64_t chunk_rows = plan.chunks.chunk_rows;
  const DType operand_dtype = call.student_hidden.dtype;
  const GemmMatrix weight = gemm_matrix(call.student_weight, 0, vocab);
  // Pass 1 of the blocked schedule forms no ∂W; its gradient is needed for ∂h only.
  const bool chunk_grad = want_grad && (!blocked || want_hidden);
  for (int64_t chunk = 0; chunk < plan.chunks.chunk_count; ++chunk) {
    const int64_t first = chunk * chunk_rows;
    const int64_t count = std::min(chunk_rows, rows - first);
    const GemmMatrix hidden_rows = gemm_matrix(call.student_hidden, first, count);

    GemmProduct student;
    student.a = hidden_rows;
    student.b = weight;
    student.b_transposed = true;
    student.c = GemmMatrix{chunk_buffer, plan.logits_dtype, count, vocab, vocab};
    gemm(student, scratch, stream);

    DistillRowsArgs args;
    args.teacher =
        teacher_rows(pass, first, count, 0, vocab, teacher_buffer, args.teacher_row_stride, stream);
    args.student = chunk_buffer;
    args.student_row_stride = vocab;
    args.dtype = plan.logits_dtype;
    args.rows = count;
    args.vocab = vocab;
    if (call.target.present()) {
      args.target = static_cast<const char*>(call.target.data) +
                    static_cast<std::size_t>(first) * dtype_size(call.target.dtype);
      args.target_dtype = call.target.dtype;
    }
    args.row_weight = offset_rows<const float>(distill.ce.row_weight, first);
    args.options = row_options;
    args.totals = totals;
    args.grad_output_rows =
        pass.per_row_upstream ? offset_rows<const float>(call.grad_output, first) : nullptr;
    if (call.loss) {
      if (sum_or_mean) {
        args.row_soft = losses.soft + first;
        if (hard_term) {
          args.row_hard_loss = losses.hard_loss + first;
          args.row_hard_z = losses.hard_z + first;
        }
      } else {
        args.row_total = offset_rows<float>(*call.loss, first);
      }
    }
    if (chunk_grad) {
      args.grad = chunk_buffer;
      args.grad_row_stride = vocab;
    }
    if (statistics) args.statistics = statistics + first;
    args.scratch_statistics = row_statistics + first;
    distill_rows(args, stream);
    if (!chunk_grad) continue;

    GemmMatrix gradient{chunk_buffer, plan.logits_dtype, count, vocab, vocab};
    if (plan.logits_dtype != operand_dtype) {
      narrow_rows_in_place(chunk_buffer, count, vocab, vocab, operand_dtype, stream);
      gradient.dtype = operand_dtype;
      gradient.stride = 2 * vocab;
    }
    accumulate_chunk_gradients(gradient, hidden_rows, weight, grads, first, chunk == 0, sums,
                               scratch, stream);
  }
  if (blocked && plan.chunks.chunk_count > 0) {
    run_block_pass(pass, chunk_buffer, statistics, nullptr, stream);
  }
  finish_gradient_sums(grads, sums, hidden, plan.chunks.chunk_count > 0, stream);

  reduce_distill_loss(pass, losses, stream);
}

}  // namespace

int64_t linear_distill_runs(Schedule schedule) {
  return schedule_runs[static_cast<int>(schedule)].load();
}

ChunkPlan linear_distill_chunk_plan(int64_t rows, int64_t student_hidden, int64_t teacher_hidden,
                                    int64_t vocab, DType dtype, const LinearDistillOptions& options,
                                    DType teacher_logits_dtype, const LinearGradients& grads) {
  return plan_linear_distill(rows, student_hidden, vocab, dtype, options, teacher_hidden > 0,
                             teacher_logits_dtype, grads, hidden_sums_scratch(grads))
      .chunks;
}

std::size_t linear_distill_workspace_size(int64_t rows, int64_t student_hidden,
                                          int64_t teacher_hidden, int64_t vocab, DType dtype,
                                          const LinearDistillOptions& options,
                                          bool with_gradients) {
  // teacher_hidden > 0: the teacher comes as hidden + weight; else as logits. As for linear_ce,
  // the query reports the largest plan a call may choose: without ∂W, with an fp32 ∂W, and with a
  // 16-bit ∂W (fp32 accumulation), each with and without ∂h, and (d) with its ∂h sums in the
  // workspace or in outputs that can hold them; for teacher logits also of a dtype other than
  // the chunk logits (converted into a buffer of their own), where that plan fits the budget.
  // Without it a small budget gave a workspace that the converting call's smallest plan did not
  // fit.
  std::size_t bytes = 0;
  const bool teacher_from_hidden = teacher_hidden > 0;
  const bool half = dtype != DType::f32;
  const DType logits_dtype = options.fp32_logits ? DType::f32 : dtype;
  const DType converted_teacher = logits_dtype == DType::f32 ? DType::bf16 : DType::f32;
  auto consider = [&](const LinearGradients& grads, const HiddenSumsScratch& sums_scratch) {
    bytes =
        std::max(bytes, plan_linear_distill(rows, student_hidden, vocab, dtype, options,
                                            teacher_from_hidden, logits_dtype, grads, sums_scratch)
                            .chunks.total_bytes);
    if (teacher_from_hidden) return;
    const ChunkPlan converting = plan_linear_distill(rows, student_hidden, vocab, dtype, options,
                                                     false, converted_teacher, grads, sums_scratch)
                                     .chunks;
    if (converting.fits_budget) bytes = std::max(bytes, converting.total_bytes);
  };
  consider(LinearGradients{}, HiddenSumsScratch{});
  if (!with_gradients) return bytes;
  const TensorView hidden_grad{nullptr, dtype, 2, rows, student_hidden, student_hidden};
  for (const DType weight_dtype : {DType::f32, dtype}) {
    for (const bool with_hidden : {false, true}) {
      LinearGradients grads;
      grads.weight = TensorView{nullptr, weight_dtype, 2, vocab, student_hidden, student_hidden};
      if (with_hidden) grads.hidden = hidden_grad;
      consider(grads, HiddenSumsScratch{});
      if (with_hidden) {
        consider(grads, contiguous_hidden_sums_scratch(rows, student_hidden, vocab,
                                                       weight_dtype != DType::f32, half));
      }
    }
  }
  return bytes;
}

void linear_distill_forward(TensorView student_hidden, TensorView student_weight,
                            const Teacher& teacher, TensorView target,
                            const LinearDistillOptions& options, const LinearDistillOutputs& out,
                            TensorView grad_output, Workspace workspace, Stream stream) {
  DeviceGuard guard(student_hidden.device.index);
  LinearDistillCall call{student_hidden, student_weight, teacher, target, options};
  call.grad_output = grad_output;
  call.loss = &out.loss;
  call.grads = out.grads;
  call.op = OpCode::linear_distill_forward;
  run_linear_distill(call, workspace, stream_of(stream));
}

void linear_distill_backward(TensorView student_hidden, TensorView student_weight,
                             const Teacher& teacher, TensorView target, TensorView grad_output,
                             const LinearDistillOptions& options, const LinearGradients& grads,
                             Workspace workspace, Stream stream) {
  DeviceGuard guard(student_hidden.device.index);
  LinearDistillCall call{student_hidden, student_weight, teacher, target, options};
  call.grad_output = grad_output;
  call.grads = grads;
  call.op = OpCode::linear_distill_backward;
  run_linear_distill(call, workspace, stream_of(stream));
}

}  // namespace xent::cuda
