// torch ops xent::ce_forward and xent::ce_backward over the C++ API (SPEC.md §1).
#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

// (loss, lse, logprob, entropy, argmax, accuracy, z_loss_value). lse is always computed: the
// backward reads it instead of recomputing row statistics. The other statistics are empty [0]
// tensors unless with_stats, so the output signature stays fixed for torch.compile.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ce_forward_op(
    const Tensor& logits, const Tensor& target, const c10::optional<Tensor>& class_weight,
    const c10::optional<Tensor>& row_weight, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss, c10::optional<double> softcap, double logit_scale,
    bool with_stats) {
  return translate_errors([&] {
    c10::DeviceGuard guard(logits.device());
    const Tensor logits_rows = contiguous_rows(logits);
    const Tensor target_vector = contiguous_vector(target);
    const auto class_weight32 = as_fp32_vector(class_weight);
    const auto row_weight32 = as_fp32_vector(row_weight);
    const CeOptions options = make_ce_options(
        "ce_forward", ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
        optional_vector_view(class_weight32, "ce_forward", "class_weight"),
        optional_vector_view(row_weight32, "ce_forward", "row_weight"));
    const int64_t rows = logits.dim() >= 1 ? logits.size(0) : 0;
    const int64_t vocab = logits.dim() == 2 ? logits.size(1) : 0;

    const auto stat = logits.options().dtype(result_dtype(logits));
    Tensor loss = new_loss(logits, options.reduction, rows);
    Tensor lse = at::empty({rows}, stat);
    const int64_t stat_rows = with_stats ? rows : 0;
    Tensor logprob = at::empty({stat_rows}, stat);
    Tensor entropy = at::empty({stat_rows}, stat);
    Tensor argmax = at::empty({stat_rows}, logits.options().dtype(at::kLong));
    Tensor accuracy = with_stats ? at::empty({}, stat) : at::empty({0}, stat);
    Tensor z_loss_value =
        with_stats ? new_loss(logits, options.reduction, rows) : at::empty({0}, stat);

    CeOutputs out;
    out.loss = vector_view(loss, "ce_forward", "loss");
    out.stats.lse = vector_view(lse, "ce_forward", "lse");
    if (with_stats) {
      out.stats.logprob = vector_view(logprob, "ce_forward", "logprob");
      out.stats.entropy = vector_view(entropy, "ce_forward", "entropy");
      out.stats.argmax = vector_view(argmax, "ce_forward", "argmax");
      out.stats.accuracy = vector_view(accuracy, "ce_forward", "accuracy");
      out.stats.z_loss_value = vector_view(z_loss_value, "ce_forward", "z_loss_value");
    }
    const TensorView logits_view = matrix_view(logits_rows, "ce_forward", "logits");
    const TensorView target_view = vector_view(target_vector, "ce_forward", "target");
    const std::size_t bytes = ce_workspace_size(rows, vocab, options, logits_view.device);
    auto [buffer, workspace] = allocate_workspace(logits, bytes);
    ce_forward(logits_view, target_view, options, out, TensorView{}, workspace,
               current_stream(logits));
    return std::make_tuple(loss, lse, logprob, entropy, argmax, accuracy, z_loss_value);
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

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "ce_forward(Tensor logits, Tensor target, Tensor? class_weight, Tensor? row_weight, "
      "int ignore_index, str reduction, float label_smoothing, float z_loss, float? softcap, "
      "float logit_scale, bool with_stats) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "ce_backward(Tensor logits, Tensor target, Tensor? lse, Tensor grad_output, "
      "Tensor? class_weight, Tensor? row_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, float? softcap, float logit_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  m.impl("ce_forward", &xent::torch_binding::ce_forward_op);
  m.impl("ce_backward", &xent::torch_binding::ce_backward_op);
}

#if defined(XENT_TORCH_CUDA)
TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  m.impl("ce_forward", &xent::torch_binding::ce_forward_op);
  m.impl("ce_backward", &xent::torch_binding::ce_backward_op);
}
#endif
