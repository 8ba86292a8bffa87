// Validation of ce and distill, and the checks every validator shares.
#include "api/validate.hpp"

#include "api/backend.hpp"
#include "api/validate_parts.hpp"

namespace xent::api {

namespace {
std::string rows_form(int64_t rows, const char* of) {
  return bracketed(rows, " (one per row of ").append(of).append(")");
}
}  // namespace

void check_logits(const ArgumentChecker& check, const TensorView& logits, const char* name) {
  check.require_present(logits, name, "a [N, V] tensor");
  check.matrix(logits, name, -1, -1, "a 2-D tensor [N, V]");
  check.floating_input(logits, name);
  if (logits.cols == 0) check.fail(name, "has no classes", "V = 0", "V >= 1");
}

void check_target(const ArgumentChecker& check, const TensorView& target, int64_t rows,
                  const char* expected_when_missing, bool required) {
  if (!target.present()) {
    if (required) check.require_present(target, "target", expected_when_missing);
    return;
  }
  check.vector(target, "target", rows, rows_form(rows, "the input"));
  check.dtype_in(target, "target", {DType::i64, DType::i32}, "int64 or int32");
}

void check_ce_options(const ArgumentChecker& check, const CeOptions& options, int64_t rows,
                      int64_t vocab) {
  check.in_unit_interval(options.label_smoothing, "label_smoothing");
  check.non_negative_finite(options.z_loss, "z_loss");
  if (options.softcap) check.positive_finite(*options.softcap, "softcap");
  check.positive_finite(options.logit_scale, "logit_scale");
  if (options.class_weight.present()) {
    check.vector(options.class_weight, "class_weight", vocab, bracketed(vocab, " (one per class)"));
    check.fp32(options.class_weight, "class_weight");
  }
  if (options.row_weight.present()) {
    check.vector(options.row_weight, "row_weight", rows, rows_form(rows, "the input"));
    check.fp32(options.row_weight, "row_weight");
  }
}

void check_loss(const ArgumentChecker& check, const TensorView& loss, Reduction reduction,
                int64_t rows) {
  check.require_present(loss, "loss",
                        reduction == Reduction::none ? "a [N] float32 tensor" : "a float32 scalar");
  check.loss_shaped(loss, "loss", reduction, rows);
  check.result(loss, "loss");
}

void check_grad_output(const ArgumentChecker& check, const TensorView& grad_output,
                       Reduction reduction, int64_t rows) {
  if (!grad_output.present()) return;
  check.loss_shaped(grad_output, "grad_output", reduction, rows);
  check.result(grad_output, "grad_output");
}

void check_ce_stats(const ArgumentChecker& check, const CeStats& stats, Reduction reduction,
                    int64_t rows) {
  const std::string per_row = rows_form(rows, "the input");
  const std::pair<const TensorView*, const char*> float_rows[] = {
      {&stats.lse, "lse"}, {&stats.logprob, "logprob"}, {&stats.entropy, "entropy"}};
  for (const auto& [view, name] : float_rows) {
    if (!view->present()) continue;
    check.vector(*view, name, rows, per_row);
    check.result(*view, name);
  }
  if (stats.argmax.present()) {
    check.vector(stats.argmax, "argmax", rows, per_row);
    check.dtype_in(stats.argmax, "argmax", {DType::i64}, "int64");
  }
  if (stats.accuracy.present()) {
    check.scalar(stats.accuracy, "accuracy");
    check.result(stats.accuracy, "accuracy");
  }
  if (stats.z_loss_value.present()) {
    check.loss_shaped(stats.z_loss_value, "z_loss_value", reduction, rows);
    check.result(stats.z_loss_value, "z_loss_value");
  }
}

void check_ce_values(const ArgumentChecker& check, const TensorView& target,
                     const CeOptions& options, int64_t vocab) {
  check.class_weights_valid(options.class_weight, vocab);
  check.targets_in_range(target, vocab, options.ignore_index);
}

void check_workspace(const ArgumentChecker& check, const Workspace& workspace,
                     std::size_t required) {
  if (workspace.bytes < required) {
    check.fail("workspace", "too small", std::to_string(workspace.bytes) + " bytes",
               "at least " + std::to_string(required) + " bytes");
  }
  if (required > 0 && workspace.data == nullptr) {
    check.fail("workspace", "has no data", "a null pointer",
               "memory for " + std::to_string(required) + " bytes");
  }
}

void check_distill_options(const ArgumentChecker& check, const DistillOptions& options,
                           const TensorView& target, int64_t rows, int64_t vocab) {
  check.positive_finite(options.temperature, "temperature");
  check.in_unit_interval(options.beta, "beta");
  if (options.softcap) check.positive_finite(*options.softcap, "softcap");
  check.non_negative_finite(options.soft_weight, "soft_weight");
  check.non_negative_finite(options.hard_weight, "hard_weight");
  if (options.hard_weight > 0 && !target.present()) {
    check.fail("target", "missing", "an absent tensor", "a [N] tensor when hard_weight > 0");
  }
  check_ce_options(check, options.ce, rows, vocab);
}

void validate_ce_forward(const TensorView& logits, const TensorView& target,
                         const CeOptions& options, const CeOutputs& out,
                         const TensorView& grad_output, const Workspace& workspace) {
  const ArgumentChecker check("ce_forward", logits.device, logits.dtype);
  check_logits(check, logits, "logits");
  const int64_t rows = logits.rows, vocab = logits.cols;
  check_target(check, target, rows, "a [N] tensor", true);
  check_ce_options(check, options, rows, vocab);
  check_loss(check, out.loss, options.reduction, rows);
  check_ce_stats(check, out.stats, options.reduction, rows);
  if (out.grad_logits.present()) {
    check.matrix(out.grad_logits, "grad_logits", rows, vocab,
                 "the shape of logits " + shape_string(logits));
    check.same_dtype(out.grad_logits, "grad_logits", logits, "logits");
    check.no_overlap(out.grad_logits, "grad_logits", logits, "logits", true);
  }
  check_grad_output(check, grad_output, options.reduction, rows);
#if defined(XENT_WITH_CUDA)
  if (!check.on_cpu())
    check_workspace(check, workspace, cuda::ce_workspace_size(rows, vocab, options));
#else
  (void)workspace;
#endif
  check_ce_values(check, target, options, vocab);
}

void validate_ce_backward(const TensorView& logits, const TensorView& target, const TensorView& lse,
                          const TensorView& grad_output, const CeOptions& options,
                          const TensorView& grad_logits, const Workspace& workspace) {
  const ArgumentChecker check("ce_backward", logits.device, logits.dtype);
  check_logits(check, logits, "logits");
  const int64_t rows = logits.rows, vocab = logits.cols;
  check_target(check, target, rows, "a [N] tensor", true);
  check_ce_options(check, options, rows, vocab);
  if (lse.present()) {
    check.vector(lse, "lse", rows, rows_form(rows, "logits"));
    check.result(lse, "lse");
  }
  check_grad_output(check, grad_output, options.reduction, rows);
  check.require_present(grad_logits, "grad_logits", "a tensor shaped like logits");
  check.matrix(grad_logits, "grad_logits", rows, vocab,
               "the shape of logits " + shape_string(logits));
  check.same_dtype(grad_logits, "grad_logits", logits, "logits");
  check.no_overlap(grad_logits, "grad_logits", logits, "logits", true);
#if defined(XENT_WITH_CUDA)
  if (!check.on_cpu())
    check_workspace(check, workspace, cuda::ce_workspace_size(rows, vocab, options));
#else
  (void)workspace;
#endif
  check_ce_values(check, target, options, vocab);
}

void validate_entropy_gradient(const char* function, Device device, DType input,
                               const EntropyGradient& entropy, const TensorView& lse,
                               Reduction reduction, int64_t rows) {
  if (!entropy.present() && !entropy.entropy.present()) return;
  const ArgumentChecker check(function, device, input);
  if (reduction != Reduction::none) {
    check.fail("entropy", "needs reduction none", reduction_name(reduction),
               "reduction none (the entropy gradient is per row)");
  }
  check.require_present(entropy.grad, "entropy.grad", "a [N] fp32 upstream gradient");
  check.require_present(entropy.entropy, "entropy.entropy", "the [N] fp32 entropy of the forward");
  check.require_present(lse, "lse", "the [N] fp32 lse of the forward (with an entropy gradient)");
  const std::string per_row = rows_form(rows, "the input");
  check.vector(entropy.grad, "entropy.grad", rows, per_row);
  check.result(entropy.grad, "entropy.grad");
  check.vector(entropy.entropy, "entropy.entropy", rows, per_row);
  check.result(entropy.entropy, "entropy.entropy");
}

namespace {
// Different widths are not an error of the op but of the views (docs/semantics.md §3.2).
constexpr const char* kSharedVocabularyHint =
    " (vocabularies of different sizes: views of the first V' columns of each, their own "
    "row_stride, docs/semantics.md §3.2)";

void check_distill_common(const ArgumentChecker& check, const TensorView& student,
                          const TensorView& teacher, const TensorView& target,
                          const DistillOptions& options, const TensorView& grad_output) {
  check_logits(check, student, "student");
  const int64_t rows = student.rows, vocab = student.cols;
  check.require_present(teacher, "teacher", "a tensor shaped like student");
  check.matrix(teacher, "teacher", rows, vocab,
               "the shape of student " + shape_string(student) + kSharedVocabularyHint);
  check.same_dtype(teacher, "teacher", student, "student");
  check_target(check, target, rows, "a [N] tensor", false);
  check_distill_options(check, options, target, rows, vocab);
  check_grad_output(check, grad_output, options.ce.reduction, rows);
}

void check_grad_student(const ArgumentChecker& check, const TensorView& grad,
                        const TensorView& student, const TensorView& teacher) {
  check.matrix(grad, "grad_student", student.rows, student.cols,
               "the shape of student " + shape_string(student));
  check.same_dtype(grad, "grad_student", student, "student");
  check.no_overlap(grad, "grad_student", student, "student", true);
  check.no_overlap(grad, "grad_student", teacher, "teacher", false);
}
}  // namespace

void validate_distill_forward(const TensorView& student, const TensorView& teacher,
                              const TensorView& target, const DistillOptions& options,
                              const DistillOutputs& out, const TensorView& grad_output,
                              const Workspace& workspace) {
  const ArgumentChecker check("distill_forward", student.device, student.dtype);
  check_distill_common(check, student, teacher, target, options, grad_output);
  check_loss(check, out.loss, options.ce.reduction, student.rows);
  if (out.grad_student.present()) check_grad_student(check, out.grad_student, student, teacher);
#if defined(XENT_WITH_CUDA)
  if (!check.on_cpu()) {
    check_workspace(check, workspace,
                    cuda::distill_workspace_size(student.rows, student.cols, options));
  }
#else
  (void)workspace;
#endif
  check_ce_values(check, target, options.ce, student.cols);
}

void validate_distill_backward(const TensorView& student, const TensorView& teacher,
                               const TensorView& target, const TensorView& grad_output,
                               const DistillOptions& options, const TensorView& grad_student,
                               const Workspace& workspace) {
  const ArgumentChecker check("distill_backward", student.device, student.dtype);
  check_distill_common(check, student, teacher, target, options, grad_output);
  check.require_present(grad_student, "grad_student", "a tensor shaped like student");
  check_grad_student(check, grad_student, student, teacher);
#if defined(XENT_WITH_CUDA)
  if (!check.on_cpu()) {
    check_workspace(check, workspace,
                    cuda::distill_workspace_size(student.rows, student.cols, options));
  }
#else
  (void)workspace;
#endif
  check_ce_values(check, target, options.ce, student.cols);
}

}  // namespace xent::api
