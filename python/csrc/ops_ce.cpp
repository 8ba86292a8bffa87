// torch ops xent::ce_forward and xent::ce_backward over the C++ API (docs/semantics.md §1).
#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

using CeForwardOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// The outputs of make_loss_outputs. `grad_logits`, when given, receives the gradient in the same pass (it may be the logits
// themselves), for the upstream gradient `grad_scale` (an fp32 scalar tensor; absent means 1).
CeForwardOutputs run_ce_forward(const char* function, const Tensor& logits, const Tensor& target,
                                const c10::optional<Tensor>& class_weight,
                                const c10::optional<Tensor>& row_weight, int64_t ignore_index,
                                c10::string_view reduction, double label_smoothing, double z_loss,
                                c10::optional<double> softcap, double logit_scale, bool with_stats,
                                const Tensor* grad_logits,
                                const c10::optional<Tensor>& grad_scale) {
  c10::DeviceGuard guard(logits.device());
  const Tensor logits_rows = contiguous_rows(logits);
  const Tensor target_vector = contiguous_vector(target);
  const auto class_weight32 = as_fp32_vector(class_weight);
  const auto row_weight32 = as_fp32_vector(row_weight);
  const auto grad_scale32 = as_result_dtype(grad_scale, logits);
  const CeOptions options =
      make_ce_options(function, ignore_index, reduction, label_smoothing, z_loss, softcap,
                      logit_scale, optional_vector_view(class_weight32, function, "class_weight"),
                      optional_vector_view(row_weight32, function, "row_weight"));
  const int64_t rows = logits.dim() >= 1 ? logits.size(0) : 0;
  const int64_t vocab = logits.dim() == 2 ? logits.size(1) : 0;

  const LossOutputs outputs =
      make_loss_outputs(function, logits, options.reduction, rows, with_stats);
  CeOutputs out;
  out.loss = outputs.loss_view;
  out.stats = outputs.stats;
  if (grad_logits != nullptr) out.grad_logits = matrix_view(*grad_logits, function, "grad_logits");
  const TensorView logits_view = matrix_view(logits_rows, function, "logits");
  const TensorView target_view = vector_view(target_vector, function, "target");
  const std::size_t bytes = ce_workspace_size(rows, vocab, options, logits_view.device);
  auto [buffer, workspace] = allocate_workspace(logits, bytes);
  ce_forward(logits_view, target_view, options, out,
             optional_vector_view(grad_scale32, function, "grad_scale"), workspace,
             current_stream(logits));
  return outputs.as_tuple();
}

CeForwardOutputs ce_forward_op(const Tensor& logits, const Tensor& target,
                               const c10::optional<Tensor>& class_weight,
                               const c10::optional<Tensor>& row_weight, int64_t ignore_index,
                               c10::string_view reduction, double label_smoothing, double z_loss,
                               c10::optional<double> softcap, double logit_scale, bool with_stats) {
  return translate_errors([&] {
    return run_ce_forward("ce_forward", logits, target, class_weight, row_weight, ignore_index,
                          reduction, label_smoothing, z_loss, softcap, logit_scale, with_stats,
                          nullptr, c10::nullopt);
  });
}

// The forward and the gradient in one pass (one read of the logits, one write of the gradient):
// the loss outputs of ce_forward, then the gradient for the upstream scalar grad_scale.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ce_forward_grad_op(
    const Tensor& logits, const Tensor& target, const c10::optional<Tensor>& class_weight,
    const c10::optional<Tensor>& row_weight, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss, c10::optional<double> softcap, double logit_scale,
    bool with_stats, const c10::optional<Tensor>& grad_scale) {
  return translate_errors([&] {
    Tensor grad = at::empty(contiguous_rows(logits).sizes(), logits.options());
    auto [loss, lse, logprob, entropy, argmax, accuracy, z_loss_value] = run_ce_forward(
        "ce_forward", logits, target, class_weight, row_weight, ignore_index, reduction,
        label_smoothing, z_loss, softcap, logit_scale, with_stats, &grad, grad_scale);
    return std::make_tuple(loss, lse, logprob, entropy, argmax, accuracy, z_loss_value, grad);
  });
}

// As ce_forward_grad, with the gradient written over the logits (no N×V memory added; the
// logits are gone afterwards). Logits the core cannot read in place are an error: a copy would
// leave the caller's tensor unchanged.
CeForwardOutputs ce_forward_grad_inplace_op(
    const Tensor& logits, const Tensor& target, const c10::optional<Tensor>& class_weight,
    const c10::optional<Tensor>& row_weight, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss, c10::optional<double> softcap, double logit_scale,
    bool with_stats, const c10::optional<Tensor>& grad_scale) {
  return translate_errors([&] {
    require_in_place_rows("ce_forward", "logits", logits);
    return run_ce_forward("ce_forward", logits, target, class_weight, row_weight, ignore_index,
                          reduction, label_smoothing, z_loss, softcap, logit_scale, with_stats,
                          &logits, grad_scale);
  });
}

// The gradient for a scalar (sum, mean) or per-row (none) upstream gradient.
Tensor ce_backward_op(const Tensor& logits, const Tensor& target, const c10::optional<Tensor>& lse,
                      const Tensor& grad_output, const c10::optional<Tensor>& class_weight,
                      const c10::optional<Tensor>& row_weight, int64_t ignore_index,
                      c10::string_view reduction, double label_smoothing, double z_loss,
                      c10::optional<double> softcap, double logit_scale) {
  return translate_errors([&] {
    c10::DeviceGuard guard(logits.device());
    const Tensor logits_rows = contiguous_rows(logits);
    const Tensor target_vector = contiguous_vector(target);
    const Tensor grad_output32 = grad_output.to(result_dtype(logits)).contiguous();
    const auto lse_vector = lse.has_value() ? c10::optional<Tensor>(lse->contiguous()) : lse;
    const auto class_weight32 = as_fp32_vector(class_weight);
    const auto row_weight32 = as_fp32_vector(row_weight);
    const CeOptions options = make_ce_options(
        "ce_backward", ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
        optional_vector_view(class_weight32, "ce_backward", "class_weight"),
        optional_vector_view(row_weight32, "ce_backward", "row_weight"));
    const int64_t rows = logits.dim() >= 1 ? logits.size(0) : 0;
    const int64_t vocab = logits.dim() == 2 ? logits.size(1) : 0;

    Tensor grad_logits = at::empty(logits_rows.sizes(), logits.options());
    const TensorView logits_view = matrix_view(logits_rows, "ce_backward", "logits");
    const std::size_t bytes = ce_workspace_size(rows, vocab, options, logits_view.device);
    auto [buffer, workspace] = allocate_workspace(logits, bytes);
    ce_backward(logits_view, vector_view(target_vector, "ce_backward", "target"),
                optional_vector_view(lse_vector, "ce_backward", "lse"),
                vector_view(grad_output32, "ce_backward", "grad_output"), options,
                matrix_view(grad_logits, "ce_backward", "grad_logits"), workspace,
                current_stream(logits));
    return grad_logits;
  });
}

// The backward of xent.logprobs: logprob = −(the plain `none` loss), so g_lp enters as
// grad_output = −g_lp; grad_entropy (absent when the entropy has no gradient) adds the entropy
// term in the same pass, from the forward's lse and entropy.
Tensor ce_logprob_backward_op(const Tensor& logits, const Tensor& target, const Tensor& lse,
                              const Tensor& entropy, const Tensor& grad_logprob,
                              const c10::optional<Tensor>& grad_entropy, int64_t ignore_index,
                              c10::optional<double> softcap, double logit_scale) {
  constexpr const char* function = "ce_logprob_backward";
  return translate_errors([&] {
    c10::DeviceGuard guard(logits.device());
    const Tensor logits_rows = contiguous_rows(logits);
    const Tensor target_vector = contiguous_vector(target);
    const Tensor grad_output = grad_logprob.to(result_dtype(logits)).neg().contiguous();
    const Tensor lse_vector = lse.contiguous(), entropy_vector = entropy.contiguous();
    const auto grad_entropy32 = as_result_dtype(grad_entropy, logits);
    const CeOptions options = make_ce_options(function, ignore_index, "none", 0.0, 0.0, softcap,
                                              logit_scale, TensorView{}, TensorView{});
    const int64_t rows = logits.dim() >= 1 ? logits.size(0) : 0;
    const int64_t vocab = logits.dim() == 2 ? logits.size(1) : 0;
    EntropyGradient entropy_gradient;
    if (grad_entropy32.has_value()) {
      entropy_gradient.entropy = vector_view(entropy_vector, function, "entropy");
      entropy_gradient.grad = vector_view(*grad_entropy32, function, "grad_entropy");
    }

    Tensor grad_logits = at::empty(logits_rows.sizes(), logits.options());
    const TensorView logits_view = matrix_view(logits_rows, function, "logits");
    const std::size_t bytes = ce_workspace_size(rows, vocab, options, logits_view.device);
    auto [buffer, workspace] = allocate_workspace(logits, bytes);
    ce_backward(logits_view, vector_view(target_vector, function, "target"),
                vector_view(lse_vector, function, "lse"),
                vector_view(grad_output, function, "grad_logprob"), entropy_gradient, options,
                matrix_view(grad_logits, function, "grad_logits"), workspace,
                current_stream(logits));
    return grad_logits;
  });
}

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "ce_forward(Tensor logits, Tensor target, Tensor? class_weight, Tensor? row_weight, "
      "int ignore_index, str reduction, float label_smoothing, float z_loss, float? softcap, "
      "float logit_scale, bool with_stats) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "ce_forward_grad(Tensor logits, Tensor target, Tensor? class_weight, Tensor? row_weight, "
      "int ignore_index, str reduction, float label_smoothing, float z_loss, float? softcap, "
      "float logit_scale, bool with_stats, Tensor? grad_scale) -> (Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ce_forward_grad_inplace(Tensor(a!) logits, Tensor target, Tensor? class_weight, "
      "Tensor? row_weight, int ignore_index, str reduction, float label_smoothing, "
      "float z_loss, float? softcap, float logit_scale, bool with_stats, Tensor? grad_scale) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ce_backward(Tensor logits, Tensor target, Tensor? lse, Tensor grad_output, "
      "Tensor? class_weight, Tensor? row_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, float? softcap, float logit_scale) -> Tensor");
  m.def(
      "ce_logprob_backward(Tensor logits, Tensor target, Tensor lse, Tensor entropy, "
      "Tensor grad_logprob, Tensor? grad_entropy, int ignore_index, float? softcap, "
      "float logit_scale) -> Tensor");
  xent::torch_binding::impl_on_devices(m, "ce_forward", &xent::torch_binding::ce_forward_op);
  xent::torch_binding::impl_on_devices(m, "ce_forward_grad",
                                       &xent::torch_binding::ce_forward_grad_op);
  xent::torch_binding::impl_on_devices(m, "ce_forward_grad_inplace",
                                       &xent::torch_binding::ce_forward_grad_inplace_op);
  xent::torch_binding::impl_on_devices(m, "ce_backward", &xent::torch_binding::ce_backward_op);
  xent::torch_binding::impl_on_devices(m, "ce_logprob_backward",
                                       &xent::torch_binding::ce_logprob_backward_op);
}
