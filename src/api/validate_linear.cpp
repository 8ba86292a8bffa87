// Validation of the fused linear ops (docs/semantics.md §2, §4, §7).
#include <cmath>
#include <optional>

#include "api/backend.hpp"
#include "api/policy_options.hpp"
#include "api/validate.hpp"
#include "api/validate_parts.hpp"
#include "cpu/linear_chunks.hpp"
#include "cpu/linear_plan.hpp"

namespace xent::api {
namespace {

// hidden [N, H] and weight [V, H] of one dtype; bias [V] of that dtype when present.
void check_linear_layer(const ArgumentChecker& check, const TensorView& hidden,
                        const char* hidden_name, const TensorView& weight, const char* weight_name,
                        const TensorView* bias) {
  check.require_present(hidden, hidden_name, "a [N, H] tensor");
  check.matrix(hidden, hidden_name, -1, -1, "a 2-D tensor [N, H]");
  check.floating_input(hidden, hidden_name);
  check.require_present(weight, weight_name, "a [V, H] tensor");
  check.matrix(weight, weight_name, -1, hidden.cols,
               "a 2-D tensor [V, H] with H = " + std::to_string(hidden.cols) + " (columns of " +
                   hidden_name + ")");
  check.same_dtype(weight, weight_name, hidden, hidden_name);
  if (weight.rows == 0) check.fail(weight_name, "has no classes", "V = 0", "V >= 1");
  if (bias && bias->present()) {
    check.vector(*bias, "bias", weight.rows, bracketed(weight.rows, " (one per row of weight)"));
    check.same_dtype(*bias, "bias", hidden, hidden_name);
  }
}

// accumulate_weight: grads.weight is the caller's buffer that ∂W is added into, in the compute
// type (fp32, or fp64 for fp64 layers), so the products accumulate into it directly.
void check_accumulated_weight(const ArgumentChecker& check, const LinearGradients& grads,
                              const TensorView& hidden) {
  if (!grads.accumulate_weight) return;
  check.require_present(grads.weight, "grads.weight",
                        "the [V, H] buffer that accumulate_weight adds the weight gradient into");
  const bool wide = hidden.dtype == DType::f64;
  if (grads.weight.dtype != (wide ? DType::f64 : DType::f32)) {
    check.fail("grads.weight", "has wrong dtype for accumulate_weight",
               dtype_name(grads.weight.dtype),
               wide ? "float64 (the buffer of a float64 layer)"
                    : "float32 (accumulate_weight adds into an fp32 buffer whatever the layer "
                      "dtype)");
  }
}

// Gradients: hidden like hidden; weight and bias in their parameter's dtype or fp32; none of them
// overlapping an input (each is written while the inputs are still read).
void check_linear_gradients(const ArgumentChecker& check, const LinearGradients& grads,
                            const TensorView& hidden, const char* hidden_name,
                            const TensorView& weight, const char* weight_name,
                            const TensorView& bias, bool bias_allowed) {
  check_accumulated_weight(check, grads, hidden);
  if (grads.hidden.present()) {
    check.matrix(grads.hidden, "grads.hidden", hidden.rows, hidden.cols,
                 std::string("the shape of ") + hidden_name + " " + shape_string(hidden));
    check.same_dtype(grads.hidden, "grads.hidden", hidden, hidden_name);
  }
  if (grads.weight.present()) {
    check.matrix(grads.weight, "grads.weight", weight.rows, weight.cols,
                 std::string("the shape of ") + weight_name + " " + shape_string(weight));
    if (grads.weight.dtype != DType::f32) {
      check.same_dtype(grads.weight, "grads.weight", weight, weight_name);
    }
  }
  if (grads.bias.present()) {
    if (!bias_allowed) {
      check.require_absent(grads.bias, "grads.bias", "(linear distillation has no bias)");
    }
    if (!bias.present()) check.require_absent(grads.bias, "grads.bias", "when bias is absent");
    check.vector(grads.bias, "grads.bias", bias.rows, "the shape of bias " + shape_string(bias));
    if (grads.bias.dtype != DType::f32) check.same_dtype(grads.bias, "grads.bias", bias, "bias");
  }
  const std::pair<const TensorView*, const char*> outputs[] = {{&grads.hidden, "grads.hidden"},
                                                               {&grads.weight, "grads.weight"},
                                                               {&grads.bias, "grads.bias"}};
  const std::pair<const TensorView*, const char*> inputs[] = {
      {&hidden, hidden_name}, {&weight, weight_name}, {&bias, "bias"}};
  for (const auto& [output, output_name] : outputs) {
    for (const auto& [input, input_name] : inputs) {
      check.no_overlap(*output, output_name, *input, input_name, false);
    }
  }
}

bool any_gradient(const LinearGradients& grads) {
  return grads.hidden.present() || grads.weight.present() || grads.bias.present();
}

// The budget must hold one row of chunk buffers; a caller's workspace must hold the whole plan.
void check_linear_memory(const ArgumentChecker& check, const cpu::LinearShape& shape,
                         std::size_t budget, const Workspace& workspace,
                         std::size_t device_workspace) {
  if (!check.on_cpu()) {
    check_workspace(check, workspace, device_workspace);
    return;
  }
  const std::size_t minimum = cpu::linear_row_bytes(shape);
  if (budget < minimum) {
    check.fail("workspace_budget", "too small", std::to_string(budget) + " bytes",
               "at least " + std::to_string(minimum) + " bytes (the chunk buffers of one row)");
  }
  if (workspace.data != nullptr && workspace.bytes > 0) {
    check_workspace(check, workspace, cpu::plan_linear(shape, budget).total_bytes());
  }
}

// The caller's logits cache: [R, V] with R ≤ N (the logits of rows [0, R)) in the chunk-logits
// dtype, disjoint from every other tensor (the forward writes it while reading the inputs; the
// backward reads it while writing grads).
void check_logits_cache(const ArgumentChecker& check, const LinearCeOptions& options,
                        const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                        const LinearGradients& grads) {
  const TensorView& cache = options.logits_cache;
  if (!cache.present()) return;
  const std::string what = "[R, V] with R <= N = " + std::to_string(hidden.rows) +
                           " (rows of hidden) and V = " + std::to_string(weight.rows) +
                           " (rows of weight)";
  check.matrix(cache, "logits_cache", -1, weight.rows, what);
  if (cache.rows > hidden.rows) {
    check.fail("logits_cache", "has more rows than hidden", std::to_string(cache.rows) + " rows",
               what);
  }
  if (options.fp32_logits) {
    check.dtype_in(cache, "logits_cache", {DType::f32}, "float32 (fp32_logits is set)");
  } else {
    check.same_dtype(cache, "logits_cache", hidden, "hidden");
  }
  const std::pair<const TensorView*, const char*> others[] = {{&hidden, "hidden"},
                                                              {&weight, "weight"},
                                                              {&bias, "bias"},
                                                              {&grads.hidden, "grads.hidden"},
                                                              {&grads.weight, "grads.weight"},
                                                              {&grads.bias, "grads.bias"}};
  for (const auto& [other, other_name] : others) {
    check.no_overlap(cache, "logits_cache", *other, other_name, false);
  }
}

void check_linear_ce(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                     const TensorView& target, const LinearCeOptions& options,
                     const LinearGradients& grads, const TensorView& grad_output,
                     const Workspace& workspace, const ArgumentChecker& check,
                     const CeOutputs* loss_and_stats,
                     std::optional<std::size_t> device_workspace_bytes = std::nullopt) {
  check_linear_layer(check, hidden, "hidden", weight, "weight", &bias);
  const int64_t rows = hidden.rows, vocab = weight.rows;
  check_target(check, target, rows, "a [N] tensor", true);
  check_ce_options(check, options.ce, rows, vocab);
  if (loss_and_stats) {
    check_loss(check, loss_and_stats->loss, options.ce.reduction, rows);
    check_ce_stats(check, loss_and_stats->stats, options.ce.reduction, rows);
  }
  check_linear_gradients(check, grads, hidden, "hidden", weight, "weight", bias, true);
  check_logits_cache(check, options, hidden, weight, bias, grads);
  check_grad_output(check, grad_output, options.ce.reduction, rows);
  cpu::LinearShape shape;
  shape.rows = rows;
  shape.hidden = hidden.cols;
  shape.vocab = vocab;
  shape.dtype = hidden.dtype;
  shape.with_gradients = any_gradient(grads);
  shape.weight_dtype_accumulation =
      options.weight_grad_accumulation == WeightGradAccumulation::weight_dtype;
  std::size_t device_workspace = 0;
#if defined(XENT_WITH_CUDA)
  if (!check.on_cpu()) {
    device_workspace = device_workspace_bytes
                           ? *device_workspace_bytes
                           : cuda::linear_ce_workspace_size(rows, hidden.cols, vocab, hidden.dtype,
                                                            options, shape.with_gradients);
  }
#endif
  check_linear_memory(check, shape, options.workspace_budget, workspace, device_workspace);
  check_ce_values(check, target, options.ce, vocab);
}

}  // namespace

void validate_linear_ce_forward(const TensorView& hidden, const TensorView& weight,
                                const TensorView& bias, const TensorView& target,
                                const LinearCeOptions& options, const LinearCeOutputs& out,
                                const TensorView& grad_output, const Workspace& workspace) {
  const ArgumentChecker check("linear_ce_forward", hidden.device, hidden.dtype);
  CeOutputs loss_and_stats;
  loss_and_stats.loss = out.loss;
  loss_and_stats.stats = out.stats;
  check_linear_ce(hidden, weight, bias, target, options, out.grads, grad_output, workspace, check,
                  &loss_and_stats);
}

void validate_linear_ce_backward(const TensorView& hidden, const TensorView& weight,
                                 const TensorView& bias, const TensorView& target,
                                 const TensorView& lse, const TensorView& grad_output,
                                 const LinearCeOptions& options, const LinearGradients& grads,
                                 const Workspace& workspace) {
  const ArgumentChecker check("linear_ce_backward", hidden.device, hidden.dtype);
  if (lse.present() && hidden.present()) {
    check.vector(lse, "lse", hidden.rows, bracketed(hidden.rows, " (one per row of hidden)"));
    check.result(lse, "lse");
  }
  check_linear_ce(hidden, weight, bias, target, options, grads, grad_output, workspace, check,
                  nullptr);
}

namespace {

void check_linear_distill(const ArgumentChecker& check, const TensorView& student_hidden,
                          const TensorView& student_weight, const Teacher& teacher,
                          const TensorView& target, const LinearDistillOptions& options,
                          const TensorView* loss, const LinearGradients& grads,
                          const TensorView& grad_output, const Workspace& workspace) {
  check_linear_layer(check, student_hidden, "student_hidden", student_weight, "student_weight",
                     nullptr);
  const int64_t rows = student_hidden.rows, vocab = student_weight.rows;
  const bool has_logits = teacher.logits.present();
  const bool has_linear = teacher.hidden.present() || teacher.weight.present();
  if (has_logits == has_linear) {
    check.fail("teacher", has_logits ? "has both forms" : "missing",
               has_logits ? "logits and hidden/weight" : "neither logits nor hidden/weight",
               "either teacher.logits [N, V] or teacher.hidden [N, H_t] with teacher.weight "
               "[V, H_t]");
  }
  if (has_logits) {
    check.matrix(teacher.logits, "teacher.logits", rows, vocab,
                 "the shape of the student logits " +
                     shape_string(matrix(nullptr, DType::f32, rows, vocab)) +
                     " (vocabularies of different sizes: the first V' rows of each head, the "
                     "first V' columns of teacher.logits, docs/semantics.md §3.2)");
    check.floating_input(teacher.logits, "teacher.logits");
  } else {
    check_linear_layer(check, teacher.hidden, "teacher.hidden", teacher.weight, "teacher.weight",
                       nullptr);
    if (teacher.hidden.rows != rows) {
      check.fail("teacher.hidden", "has wrong shape", shape_string(teacher.hidden),
                 bracketed(rows, " rows (the rows of student_hidden)"));
    }
    if (teacher.weight.rows != vocab) {
      check.fail("teacher.weight", "has wrong shape", shape_string(teacher.weight),
                 bracketed(vocab,
                           " rows (the rows of student_weight; vocabularies of different "
                           "sizes: the first V' rows of each head, docs/semantics.md "
                           "§3.2)"));
    }
    check.same_dtype(teacher.hidden, "teacher.hidden", student_hidden, "student_hidden");
  }
  check_target(check, target, rows, "a [N] tensor", false);
  check_distill_options(check, options.distill, target, rows, vocab);
  if (loss) check_loss(check, *loss, options.distill.ce.reduction, rows);
  check_linear_gradients(check, grads, student_hidden, "student_hidden", student_weight,
                         "student_weight", TensorView{}, false);
  const std::pair<const TensorView*, const char*> outputs[] = {{&grads.hidden, "grads.hidden"},
                                                               {&grads.weight, "grads.weight"}};
  const std::pair<const TensorView*, const char*> teacher_inputs[] = {
      {&teacher.logits, "teacher.logits"},
      {&teacher.hidden, "teacher.hidden"},
      {&teacher.weight, "teacher.weight"}};
  for (const auto& [output, output_name] : outputs) {
    for (const auto& [input, input_name] : teacher_inputs) {
      check.no_overlap(*output, output_name, *input, input_name, false);
    }
  }
  check_grad_output(check, grad_output, options.distill.ce.reduction, rows);
  cpu::LinearShape shape;
  shape.rows = rows;
  shape.hidden = student_hidden.cols;
  shape.vocab = vocab;
  shape.dtype = student_hidden.dtype;
  shape.distill = true;
  shape.teacher_hidden = has_logits ? 0 : teacher.hidden.cols;
  shape.with_gradients = grads.hidden.present() || grads.weight.present();
  std::size_t device_workspace = 0;
#if defined(XENT_WITH_CUDA)
  if (!check.on_cpu()) {
    device_workspace =
        cuda::linear_distill_workspace_size(rows, shape.hidden, shape.teacher_hidden, vocab,
                                            shape.dtype, options, shape.with_gradients);
  }
#endif
  check_linear_memory(check, shape, options.workspace_budget, workspace, device_workspace);
  check_ce_values(check, target, options.distill.ce, vocab);
}

}  // namespace

void validate_linear_distill_forward(const TensorView& student_hidden,
                                     const TensorView& student_weight, const Teacher& teacher,
                                     const TensorView& target, const LinearDistillOptions& options,
                                     const LinearDistillOutputs& out, const TensorView& grad_output,
                                     const Workspace& workspace) {
  const ArgumentChecker check("linear_distill_forward", student_hidden.device,
                              student_hidden.dtype);
  check_linear_distill(check, student_hidden, student_weight, teacher, target, options, &out.loss,
                       out.grads, grad_output, workspace);
}

void validate_linear_distill_backward(const TensorView& student_hidden,
                                      const TensorView& student_weight, const Teacher& teacher,
                                      const TensorView& target, const TensorView& grad_output,
                                      const LinearDistillOptions& options,
                                      const LinearGradients& grads, const Workspace& workspace) {
  const ArgumentChecker check("linear_distill_backward", student_hidden.device,
                              student_hidden.dtype);
  check_linear_distill(check, student_hidden, student_weight, teacher, target, options, nullptr,
                       grads, grad_output, workspace);
}

namespace {

void check_policy_options(const ArgumentChecker& check, const PolicyLossOptions& p,
                          const PolicyTokens& tokens) {
  check.non_negative_finite(p.clip_low, "clip_low");
  if (p.clip_low >= 1) {
    check.fail("clip_low", "out of range", std::to_string(p.clip_low), "a value in [0, 1)");
  }
  check.non_negative_finite(p.clip_high, "clip_high");
  if (p.dual_clip != 0) {
    if (p.type != PolicyLossType::clipped_surrogate) {
      check.fail("dual_clip", "unsupported", std::to_string(p.dual_clip),
                 "0 (dual clipping applies to the clipped surrogate only)");
    }
    if (!(p.dual_clip > 1) || !std::isfinite(p.dual_clip)) {
      check.fail("dual_clip", "out of range", std::to_string(p.dual_clip),
                 "0 (off) or a finite value > 1");
    }
  }
  check.positive_finite(p.sapo_tau_pos, "sapo_tau_pos");
  check.positive_finite(p.sapo_tau_neg, "sapo_tau_neg");
  if (tokens.rollout_logprobs.present()) {
    check.positive_finite(p.tis_cap, "tis_cap");
  } else if (p.tis_cap != 0) {
    check.fail("tis_cap", "given without rollout_logprobs", std::to_string(p.tis_cap),
               "0 (the cap applies to the rollout importance weight only)");
  }
  check.non_negative_finite(p.kl_coef, "kl_coef");
  if (!std::isfinite(p.entropy_coef)) {
    check.fail("entropy_coef", "not finite", std::to_string(p.entropy_coef), "a finite value");
  }
}

void check_policy_tokens(const ArgumentChecker& check, const PolicyTokens& tokens, int64_t rows) {
  check.require_present(tokens.advantages, "advantages", "a [N] tensor");
  check.require_present(tokens.weight, "token_weight",
                        "a [N] tensor (the aggregation weights g_n)");
  const std::pair<const TensorView*, const char*> views[] = {
      {&tokens.advantages, "advantages"},
      {&tokens.old_logprobs, "old_logprobs"},
      {&tokens.ref_logprobs, "ref_logprobs"},
      {&tokens.rollout_logprobs, "rollout_logprobs"},
      {&tokens.weight, "token_weight"}};
  for (const auto& [view, name] : views) {
    if (!view->present()) continue;
    check.vector(*view, name, rows, bracketed(rows, " (one per row of hidden)"));
    check.result(*view, name);
    check.same_device(*view, name);
  }
}

void check_policy_outputs(const ArgumentChecker& check, const LinearPolicyOutputs& out,
                          int64_t rows) {
  check.require_present(out.loss, "loss", "a float32 scalar");
  check.scalar(out.loss, "loss");
  check.result(out.loss, "loss");
  const std::pair<const TensorView*, const char*> vectors[] = {{&out.logprob, "logprob"},
                                                               {&out.entropy, "entropy"}};
  for (const auto& [view, name] : vectors) {
    if (!view->present()) continue;
    check.vector(*view, name, rows, bracketed(rows, " (one per row of hidden)"));
    check.result(*view, name);
  }
  if (out.stats.present()) {
    check.vector(out.stats, "stats", 4, "[4] (clip-low, clip-high, KL and ratio sums)");
    check.result(out.stats, "stats");
  }
}

}  // namespace

void validate_linear_policy_forward(const TensorView& hidden, const TensorView& weight,
                                    const TensorView& bias, const TensorView& target,
                                    const PolicyTokens& tokens, const LinearPolicyOptions& options,
                                    const LinearPolicyOutputs& out, const Workspace& workspace) {
  const ArgumentChecker check("linear_policy_forward", hidden.device, hidden.dtype);
  const LinearCeOptions linear = linear_policy_chunk_options(options);
  std::optional<std::size_t> device_workspace;
#if defined(XENT_WITH_CUDA)
  if (!check.on_cpu()) {
    device_workspace = cuda::linear_policy_workspace_size(
        hidden.rows, hidden.cols, weight.rows, hidden.dtype, options, any_gradient(out.grads));
  }
#endif
  check_linear_ce(hidden, weight, bias, target, linear, out.grads, TensorView{}, workspace, check,
                  nullptr, device_workspace);
  check_policy_tokens(check, tokens, hidden.rows);
  check_policy_outputs(check, out, hidden.rows);
  check_policy_options(check, options.policy, tokens);
}

}  // namespace xent::api
