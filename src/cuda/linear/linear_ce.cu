// Fused linear cross-entropy on CUDA: the entry points and the choice of schedule for a call.
// Planning is plan/linear_ce_plan.cu; the schedules run in linear_ce_row_chunks.cu (row chunks,
// schedules (a)-(c)) and linear_ce_blocks.cu (the vocabulary-blocked pass and schedule (d));
// docs/architecture.md says when each runs.
#include <atomic>
#include <cstdint>

#include "cuda/linear/linear_ce_call.hpp"
#include "cuda/linear/linear_reference.cuh"
#include "cuda/plan/linear_ce_plan.hpp"
#include "cuda/sm90/fused_grad.cuh"
#include "cuda/sm90/fused_stats.hpp"

namespace xent::cuda {

namespace {

std::atomic<int64_t> schedule_runs[4];

// A forward with batch_invariant (docs/semantics.md §1): its values come from the pinned cuBLASLt
// row chunks and the row kernel only, not from the fused products, whose tiles and reductions are
// not pinned. A backward is not covered and keeps every path.
bool pinned_forward(const LinearCeCall& call) {
  return call.options.batch_invariant && call.op == OpCode::linear_ce_forward;
}

// Whether a call may form its row chunks by the per-row reference path (linear_reference.cuh),
// its plan aside from the path's scratch: gradients formed in this call (a backward that brings
// the forward's lse forms its own, as the row kernel does: the path stages x in f16, decision
// 114, and a forward's lse from it must not meet logits rounded otherwise; not an entropy
// gradient), options the path forms, statistics where its statistics form is preferred, no
// logits cache, bf16 operands the fused products take and no bias (16-bit logits: the plan's
// schedule and chunks are reference_plan_accepted's).
bool reference_candidate(const LinearCeCall& call) {
  return !pinned_forward(call) &&
         reference_path_possible(call.hidden.dtype, call.options, call.grads) &&
         !call.entropy.present() && !call.bias.present() &&
         (!reference_statistics_wanted(call.stats) ||
          reference_statistics_preferred(call.hidden.cols)) &&
         fused_operands_eligible(call.hidden, call.weight, call.bias);
}

// Whether the reference path's fp32 ∂h product rows may lie in the ∂W output: a 16-bit ∂W written
// over (not added into, nor holding the running sums of weight_dtype accumulation over `chunks`
// row chunks: one chunk writes it over too), one contiguous buffer twice the bytes of N fp32 rows
// of H.
bool hidden_product_fits_weight_grad(const LinearCeCall& call, int64_t chunks) {
  const TensorView& weight_grad = call.grads.weight;
  const bool sums_in_output =
      call.options.weight_grad_accumulation == WeightGradAccumulation::weight_dtype && chunks > 1;
  return call.grads.hidden.present() && weight_grad.present() && !call.grads.accumulate_weight &&
         !sums_in_output && weight_grad.dtype != DType::f32 &&
         weight_grad.row_stride == weight_grad.cols &&
         reinterpret_cast<std::uintptr_t>(weight_grad.data) % kWorkspaceAlignment == 0 &&
         weight_grad.rows >= 2 * call.hidden.rows;
}

void run_linear_ce(const LinearCeCall& call, Workspace workspace, cudaStream_t stream) {
  const int64_t rows = call.hidden.rows, hidden = call.hidden.cols, vocab = call.weight.rows;
  const DType dtype = call.hidden.dtype;
  // A backward reads a logits cache and writes none: the cache keeps it off no fused product.
  const bool statistics =
      !pinned_forward(call) &&
      fused_stats_eligible(
          call.hidden, call.weight, call.bias,
          call.op == OpCode::linear_ce_backward ? without_cache(call.options) : call.options);
  const bool candidate = reference_candidate(call);
  LinearCePlan plan = plan_for_gradients(rows, hidden, vocab, dtype, call.options, call.grads,
                                         statistics, candidate);
  if (plan.chunks.schedule == Schedule::statistics_blocks) {
    if (run_statistics_blocks(call, plan, workspace, stream)) {
      schedule_runs[static_cast<int>(Schedule::statistics_blocks)].fetch_add(1);
      return;
    }
    // The fused product declined these operands: the cuBLASLt schedules.
    plan =
        plan_for_gradients(rows, hidden, vocab, dtype, call.options, call.grads, false, candidate);
  }
  if (!plan.chunks.fits_budget) {
    throw_budget_too_small(call.op, call.options.workspace_budget, plan.chunks.total_bytes);
  }
  // The per-row reference path where its scratch fits beside the same chunks
  // (reference_plan_accepted).
  ReferenceUse reference;
  if (candidate) {
    reference.hidden_product_in_weight_grad =
        hidden_product_fits_weight_grad(call, plan.chunks.chunk_count);
    const LinearCePlan with_scratch = plan_for_gradients(
        rows, hidden, vocab, dtype, call.options, call.grads, statistics, true,
        reference_chunk_row_bytes(
            vocab, hidden, call.grads.hidden.present() && !reference.hidden_product_in_weight_grad,
            reference_statistics_wanted(call.stats)));
    reference.on = reference_plan_accepted(plan, with_scratch);
    if (reference.on) plan = with_scratch;
  }
  run_row_chunks(call, plan, workspace, stream, reference);
  schedule_runs[static_cast<int>(plan.chunks.schedule)].fetch_add(1);
}

}  // namespace

int64_t linear_ce_runs(Schedule schedule) {
  return schedule_runs[static_cast<int>(schedule)].load();
}

void linear_ce_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                       const LinearCeOptions& options, const LinearCeOutputs& out,
                       TensorView grad_output, Workspace workspace, Stream stream) {
  DeviceGuard guard(hidden.device.index);
  const LinearGradients& grads = out.grads;
  // Without gradients (and no logits cache to fill) the forward may be fused products on
  // Hopper, with no logits buffer (fused_stats.hpp says when); it declines (launching nothing)
  // where it cannot run or is not preferred.
  if (!grads.hidden.present() && !grads.weight.present() && !grads.bias.present() &&
      !options.batch_invariant && fused_stats_candidate(hidden.dtype, options)) {
    const bool logits_chunked =
        plan_linear_ce(hidden.rows, hidden.cols, weight.rows, hidden.dtype, options, PlanWants{})
            .chunks.chunk_count > 1;
    if (linear_ce_forward_fused_stats(hidden, weight, bias, target, options, out, logits_chunked,
                                      workspace, stream_of(stream))) {
      return;
    }
  }
  LinearCeCall call{hidden, weight, bias, target, options};
  call.grad_output = grad_output;
  call.loss = &out.loss;
  call.stats = &out.stats;
  call.grads = out.grads;
  call.op = OpCode::linear_ce_forward;
  run_linear_ce(call, workspace, stream_of(stream));
}

// Without an entropy gradient lse is not read: the row kernel re-derives it on chip from the chunk.
void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView lse, TensorView grad_output, const EntropyGradient& entropy,
                        const LinearCeOptions& options, const LinearGradients& grads,
                        Workspace workspace, Stream stream) {
  DeviceGuard guard(hidden.device.index);
  LinearCeCall call{hidden, weight, bias, target, options};
  call.grad_output = grad_output;
  call.lse = lse;
  call.entropy = entropy;
  call.grads = grads;
  call.op = OpCode::linear_ce_backward;
  run_linear_ce(call, workspace, stream_of(stream));
}

}  // namespace xent::cuda
