// Fused linear policy loss on CUDA (docs/semantics.md §7 "Fused with the LM head"). Per row chunk
// of linear_ce's plan for the call (reduction none, its gradients):
//   1. L = h_chunk·Wᵀ (+ bias) by cuBLASLt into the chunk buffer;
//   2. the ce row kernel's statistics: each row's lse, ℓ and, where wanted, H;
//   3. policy_rows: the per-token math of common/policy_row.hpp gives c_ℓ, c_H and the row's
//      results (g is an input, known before the chunk);
//   4. G = c_ℓ·∂ℓ/∂x + c_H·∂H/∂x over L in place (ce_grad_from_lse with coefficient −c_ℓ);
//   5. ∂h_chunk = G·W, ∂W += Gᵀ·h_chunk, ∂bias += column sums of G (accumulate_chunk_gradients).
// Three products, as linear_ce's training step. Where the budget cannot hold the fp32 ∂W
// accumulator of a 16-bit weight, the plan is linear_ce's vocabulary-blocked schedule: steps 1–5
// without ∂W, then ∂W block by block from the saved lse, H and coefficients, as the logprob
// backward with its entropy term forms it (run_block_pass): four products.
// The per-row arrays follow linear_ce's plan in the workspace; the plan is made for the budget
// less their bytes. The loss and statistics are one fixed-order sum at the end: no atomics, no
// host synchronisation.
#include <cstdint>

#include "api/backend.hpp"
#include "api/policy_options.hpp"
#include "cuda/core/gemm.hpp"
#include "cuda/linear/linear_ce_call.hpp"
#include "cuda/linear/linear_support.hpp"
#include "cuda/rows/ce_grad.cuh"
#include "cuda/rows/policy_rows.cuh"

namespace xent::cuda {
namespace {

// lse, ℓ, H, −c_ℓ, c_H and the five results of PolicyRowResults, [N] fp32 each.
constexpr int kPolicyRowArrays = 10;

std::size_t policy_row_bytes(int64_t rows) {
  return kPolicyRowArrays * align_up(static_cast<std::size_t>(rows) * sizeof(float));
}

// linear_ce's options for the chunks, within the budget less the per-row arrays.
LinearCeOptions chunk_options(const LinearPolicyOptions& options, int64_t rows) {
  LinearCeOptions linear = api::linear_policy_chunk_options(options);
  const std::size_t arrays = policy_row_bytes(rows);
  linear.workspace_budget =
      options.workspace_budget > arrays ? options.workspace_budget - arrays : 0;
  return linear;
}

}  // namespace

std::size_t linear_policy_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                         const LinearPolicyOptions& options, bool with_gradients) {
  return linear_ce_workspace_size(rows, hidden, vocab, dtype, chunk_options(options, rows),
                                  with_gradients) +
         policy_row_bytes(rows);
}

void linear_policy_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                           const PolicyTokens& tokens, const LinearPolicyOptions& options,
                           const LinearPolicyOutputs& out, Workspace workspace, Stream on) {
  DeviceGuard guard(hidden.device.index);
  const cudaStream_t stream = stream_of(on);
  const int64_t rows = hidden.rows, width = hidden.cols, vocab = weight.rows;
  const LinearGradients& grads = out.grads;
  const bool want_grad = grads.hidden.present() || grads.weight.present() || grads.bias.present();
  const LinearCeOptions linear = chunk_options(options, rows);
  // Not schedule (d) (its statistics product forms no logits for step 3 to follow), nor the
  // per-row reference path (its epilogue forms only the ce gradient).
  const LinearCePlan plan =
      plan_for_gradients(rows, width, vocab, hidden.dtype, linear, grads, false, false);
  if (!plan.chunks.fits_budget) {
    throw_budget_too_small(OpCode::linear_policy_forward, options.workspace_budget,
                           plan.chunks.total_bytes + policy_row_bytes(rows));
  }
  const bool blocked = plan.chunks.schedule == Schedule::vocabulary_blocks;
  const bool chunk_grad = want_grad && (!blocked || grads.hidden.present() || grads.bias.present());

  WorkspaceCarver carver(workspace);
  void* chunk_buffer = carver.take(chunk_region_bytes(plan.chunks));
  auto* totals = static_cast<CeBatchTotals*>(carver.take(sizeof(CeBatchTotals)));
  const GemmScratch scratch{carver.take(plan.chunks.gemm_workspace_bytes),
                            plan.chunks.gemm_workspace_bytes};
  const GradientSums sums = carve_gradient_sums(carver, grads, vocab, width, plan.chunks);
  auto* records =
      blocked ? static_cast<CeGradRecord*>(carver.take(grad_record_bytes(rows))) : nullptr;
  auto row_array = [&] {
    return static_cast<float*>(carver.take(static_cast<std::size_t>(rows) * sizeof(float)));
  };
  float* lse = row_array();
  float* logprob = out.logprob.present() ? static_cast<float*>(out.logprob.data) : row_array();
  float* entropy = out.entropy.present() ? static_cast<float*>(out.entropy.data) : row_array();
  float* upstream = row_array();
  float* grad_entropy = row_array();
  PolicyRowResults results;
  results.loss = row_array();
  results.clipped_low = row_array();
  results.clipped_high = row_array();
  results.kl = row_array();
  results.ratio = row_array();

  // The step reads H only for the entropy bonus; the row kernel forms it only when asked.
  const bool entropy_term = options.policy.entropy_coef != 0;
  const bool want_entropy = entropy_term || out.entropy.present();
  LinearCeCall call{hidden, weight, bias, target, linear};
  call.grads = grads;
  call.op = OpCode::linear_policy_forward;
  batch_totals(call, totals, stream);  // also records an out-of-range target for check_errors
  const CeRowOptions row_options = ce_row_options(linear.ce);
  const common::PolicyOptions<float> policy = api::policy_options<float>(options.policy, tokens);
  const DType operand_dtype = hidden.dtype;
  const bool narrow_gradient = plan.logits_dtype != operand_dtype;
  const GemmMatrix weight_matrix = gemm_matrix(weight, 0, vocab);

  for (int64_t chunk = 0; chunk < plan.chunks.chunk_count; ++chunk) {
    const int64_t first = chunk * plan.chunks.chunk_rows;
    const int64_t count = std::min(plan.chunks.chunk_rows, rows - first);
    const GemmMatrix hidden_rows = gemm_matrix(hidden, first, count);

    GemmProduct forward;  // step 1
    forward.a = hidden_rows;
    forward.b = weight_matrix;
    forward.b_transposed = true;
    forward.c = GemmMatrix{chunk_buffer, plan.logits_dtype, count, vocab, vocab};
    forward.bias = bias.present() ? bias.data : nullptr;
    forward.pinned = linear.batch_invariant;  // docs/semantics.md §1
    gemm(forward, scratch, stream);

    CeRowsArgs args;  // step 2
    args.logits = chunk_buffer;
    args.dtype = plan.logits_dtype;
    args.rows = count;
    args.vocab = vocab;
    args.row_stride = vocab;
    args.target = static_cast<const char*>(target.data) +
                  static_cast<std::size_t>(first) * dtype_size(target.dtype);
    args.target_dtype = target.dtype;
    args.options = row_options;
    args.totals = totals;
    args.lse = lse + first;
    args.logprob = logprob + first;
    args.entropy = want_entropy ? entropy + first : nullptr;
    ce_rows(args, stream);

    PolicyRowsArgs step;  // step 3
    step.rows = count;
    step.target = args.target;
    step.target_dtype = target.dtype;
    step.ignore_index = options.ignore_index;
    step.logprob = logprob + first;
    step.entropy = entropy_term ? entropy + first : nullptr;
    step.advantages = offset_rows<const float>(tokens.advantages, first);
    step.old_logprobs = offset_rows<const float>(tokens.old_logprobs, first);
    step.ref_logprobs = offset_rows<const float>(tokens.ref_logprobs, first);
    step.rollout_logprobs = offset_rows<const float>(tokens.rollout_logprobs, first);
    step.weight = offset_rows<const float>(tokens.weight, first);
    step.options = policy;
    step.upstream = upstream + first;
    step.grad_entropy = grad_entropy + first;
    step.results =
        PolicyRowResults{results.loss + first, results.clipped_low + first,
                         results.clipped_high + first, results.kl + first, results.ratio + first};
    policy_rows(step, stream);
    if (!chunk_grad) continue;

    CeRowsArgs gradient_args = args;  // step 4, in place
    gradient_args.lse = gradient_args.logprob = gradient_args.entropy = nullptr;
    gradient_args.grad_output_rows = upstream + first;
    gradient_args.grad = chunk_buffer;
    gradient_args.grad_row_stride = vocab;
    ce_grad_from_lse(
        gradient_args, lse + first,
        entropy_term ? EntropyRows{entropy + first, grad_entropy + first} : EntropyRows{}, stream);
    // The products take operands of one dtype: fp32 chunk gradients of 16-bit inputs are rounded
    // to the input dtype in place.
    GemmMatrix gradient{chunk_buffer, plan.logits_dtype, count, vocab, vocab};
    if (narrow_gradient) {
      narrow_rows_in_place(chunk_buffer, count, vocab, vocab, operand_dtype, stream);
      gradient.dtype = operand_dtype;
      gradient.stride = 2 * vocab;
    }
    accumulate_chunk_gradients(gradient, hidden_rows, weight_matrix, grads, first, chunk == 0, sums,
                               scratch, stream);  // step 5
  }

  if (blocked && grads.weight.present()) {
    // ∂W as the logprob backward forms it: per-row upstream −c_ℓ, the entropy term c_H.
    LinearCeCall blocks{hidden, weight, bias, target, linear};
    blocks.grads = grads;
    blocks.op = OpCode::linear_policy_forward;
    blocks.grad_output = vector(upstream, DType::f32, rows, hidden.device);
    blocks.lse = vector(lse, DType::f32, rows, hidden.device);
    if (entropy_term) {
      blocks.entropy = EntropyGradient{vector(entropy, DType::f32, rows, hidden.device),
                                       vector(grad_entropy, DType::f32, rows, hidden.device)};
    }
    CeBlockPass pass{blocks, plan, chunk_buffer, lse, scratch, totals, row_options, true, false};
    pass.records = records;
    run_block_pass(pass, stream);
  }
  finish_gradient_sums(grads, sums, width, plan.chunks.chunk_count > 0, stream);
  policy_reduce(rows, results, static_cast<float*>(out.loss.data),
                out.stats.present() ? static_cast<float*>(out.stats.data) : nullptr, stream);
}

}  // namespace xent::cuda
