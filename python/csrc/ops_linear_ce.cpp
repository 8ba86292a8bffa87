// torch ops xent::linear_ce_forward and xent::linear_ce_backward (SPEC.md §2).
#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

c10::optional<Tensor> optional_rows(const c10::optional<Tensor>& tensor) {
  return tensor.has_value() ? c10::optional<Tensor>(contiguous_rows(*tensor)) : tensor;
}

struct LinearInputs {
  Tensor hidden, weight, target;
  c10::optional<Tensor> bias, class_weight, row_weight;
};

LinearInputs prepare_inputs(const Tensor& hidden, const Tensor& weight,
                            const c10::optional<Tensor>& bias, const Tensor& target,
                            const c10::optional<Tensor>& class_weight,
                            const c10::optional<Tensor>& row_weight) {
  LinearInputs inputs;
  inputs.hidden = contiguous_rows(hidden);
  inputs.weight = contiguous_rows(weight);
  inputs.target = contiguous_vector(target);
  if (bias.has_value()) inputs.bias = bias->contiguous();
  inputs.class_weight = as_fp32_vector(class_weight);
  inputs.row_weight = as_fp32_vector(row_weight);
  return inputs;
}

LinearCeOptions make_linear_options(const char* function, const LinearInputs& inputs,
                                    int64_t ignore_index, c10::string_view reduction,
                                    double label_smoothing, double z_loss,
                                    c10::optional<double> softcap, double logit_scale,
                                    int64_t workspace_bytes, bool fp32_logits) {
  LinearCeOptions options;
  options.ce = make_ce_options(function, ignore_index, reduction, label_smoothing, z_loss, softcap,
                               logit_scale,
                               optional_vector_view(inputs.class_weight, function, "class_weight"),
                               optional_vector_view(inputs.row_weight, function, "row_weight"));
  options.workspace_budget = workspace_budget(workspace_bytes, options.workspace_budget);
  options.fp32_logits = fp32_logits;
  return options;
}

// Gradient tensors in their input's dtype ([0] when not requested) and their views.
struct GradientBuffers {
  Tensor hidden, weight, bias;
  LinearGradients views;
};

GradientBuffers make_gradients(const char* function, const LinearInputs& inputs, bool grad_hidden,
                               bool grad_weight, bool grad_bias) {
  GradientBuffers grads;
  const auto none = [&](const Tensor& like) { return at::empty({0}, like.options()); };
  grads.hidden = grad_hidden ? at::empty(inputs.hidden.sizes(), inputs.hidden.options())
                             : none(inputs.hidden);
  grads.weight = grad_weight ? at::empty(inputs.weight.sizes(), inputs.weight.options())
                             : none(inputs.weight);
  const bool with_bias = grad_bias && inputs.bias.has_value();
  grads.bias = with_bias ? at::empty(inputs.bias->sizes(), inputs.bias->options())
                         : none(inputs.weight);
  if (grad_hidden) grads.views.hidden = matrix_view(grads.hidden, function, "grad_hidden");
  if (grad_weight) grads.views.weight = matrix_view(grads.weight, function, "grad_weight");
  if (with_bias) grads.views.bias = vector_view(grads.bias, function, "grad_bias");
  return grads;
}

// (loss, lse, logprob, entropy, argmax, accuracy, z_loss_value, grad_hidden, grad_weight,
//  grad_bias, logits_cache): unrequested ones are empty [0] tensors. The logits cache [N, V] is
// filled by a forward that forms no gradient, for a backward that then skips h·Wᵀ.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
linear_ce_forward_op(const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
                     const Tensor& target, const c10::optional<Tensor>& class_weight,
                     const c10::optional<Tensor>& row_weight, int64_t ignore_index,
                     c10::string_view reduction, double label_smoothing, double z_loss,
                     c10::optional<double> softcap, double logit_scale, int64_t workspace_bytes,
                     bool fp32_logits, bool with_stats, bool grad_hidden, bool grad_weight,
                     bool grad_bias, bool cache_logits) {
  constexpr const char* function = "linear_ce_forward";
  return translate_errors([&] {
    c10::DeviceGuard guard(hidden.device());
    const LinearInputs inputs =
        prepare_inputs(hidden, weight, bias, target, class_weight, row_weight);
    const LinearCeOptions options =
        make_linear_options(function, inputs, ignore_index, reduction, label_smoothing, z_loss,
                            softcap, logit_scale, workspace_bytes, fp32_logits);
    const int64_t rows = hidden.dim() >= 1 ? hidden.size(0) : 0;
    const auto f32 = hidden.options().dtype(at::kFloat);
    const auto stat = hidden.options().dtype(result_dtype(hidden));
    const Reduction reduction_kind = options.ce.reduction;

    Tensor loss = new_loss(hidden, reduction_kind, rows);
    Tensor lse = at::empty({rows}, stat);
    const int64_t stat_rows = with_stats ? rows : 0;
    Tensor logprob = at::empty({stat_rows}, stat);
    Tensor entropy = at::empty({stat_rows}, stat);
    Tensor argmax = at::empty({stat_rows}, hidden.options().dtype(at::kLong));
    Tensor accuracy = with_stats ? at::empty({}, stat) : at::empty({0}, stat);
    Tensor z_loss_value =
        with_stats ? new_loss(hidden, reduction_kind, rows) : at::empty({0}, stat);
    GradientBuffers grads = make_gradients(function, inputs, grad_hidden, grad_weight, grad_bias);
    LinearCeOptions cached_options = options;
    Tensor logits_cache = at::empty({0}, hidden.options());
    if (cache_logits) {
      const int64_t vocab = weight.dim() >= 1 ? weight.size(0) : 0;
      logits_cache = at::empty({rows, vocab}, fp32_logits ? f32 : hidden.options());
      cached_options.logits_cache = matrix_view(logits_cache, function, "logits_cache");
    }

    LinearCeOutputs out;
    out.loss = vector_view(loss, function, "loss");
    out.stats.lse = vector_view(lse, function, "lse");
    if (with_stats) {
      out.stats.logprob = vector_view(logprob, function, "logprob");
      out.stats.entropy = vector_view(entropy, function, "entropy");
      out.stats.argmax = vector_view(argmax, function, "argmax");
      out.stats.accuracy = vector_view(accuracy, function, "accuracy");
      out.stats.z_loss_value = vector_view(z_loss_value, function, "z_loss_value");
    }
    out.grads = grads.views;

    const TensorView hidden_view = matrix_view(inputs.hidden, function, "hidden");
    const TensorView weight_view = matrix_view(inputs.weight, function, "weight");
    const bool with_gradients = grad_hidden || grad_weight || grad_bias;
    const std::size_t bytes = linear_ce_workspace_size(
        rows, hidden_view.cols, weight_view.rows, hidden_view.dtype, cached_options,
        hidden_view.device, with_gradients);
    auto [buffer, workspace] = allocate_workspace(hidden, bytes);
    linear_ce_forward(hidden_view, weight_view, optional_vector_view(inputs.bias, function, "bias"),
                      vector_view(inputs.target, function, "target"), cached_options, out,
                      TensorView{}, workspace, current_stream(hidden));
    return std::make_tuple(loss, lse, logprob, entropy, argmax, accuracy, z_loss_value,
                           grads.hidden, grads.weight, grads.bias, logits_cache);
  });
}

std::tuple<Tensor, Tensor, Tensor> linear_ce_backward_op(
    const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
    const Tensor& target, const c10::optional<Tensor>& lse, const Tensor& grad_output,
    const c10::optional<Tensor>& class_weight, const c10::optional<Tensor>& row_weight,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, double z_loss,
    c10::optional<double> softcap, double logit_scale, int64_t workspace_bytes, bool fp32_logits,
    bool grad_hidden, bool grad_weight, bool grad_bias,
    const c10::optional<Tensor>& logits_cache) {
  constexpr const char* function = "linear_ce_backward";
  return translate_errors([&] {
    c10::DeviceGuard guard(hidden.device());
    const LinearInputs inputs =
        prepare_inputs(hidden, weight, bias, target, class_weight, row_weight);
    LinearCeOptions options =
        make_linear_options(function, inputs, ignore_index, reduction, label_smoothing, z_loss,
                            softcap, logit_scale, workspace_bytes, fp32_logits);
    const auto cache_rows = optional_rows(logits_cache);
    options.logits_cache = optional_matrix_view(cache_rows, function, "logits_cache");
    const Tensor grad_output32 = grad_output.to(result_dtype(hidden)).contiguous();
    const auto lse_vector = lse.has_value() ? c10::optional<Tensor>(lse->contiguous()) : lse;
    GradientBuffers grads = make_gradients(function, inputs, grad_hidden, grad_weight, grad_bias);

    const TensorView hidden_view = matrix_view(inputs.hidden, function, "hidden");
    const TensorView weight_view = matrix_view(inputs.weight, function, "weight");
    const int64_t rows = hidden.dim() >= 1 ? hidden.size(0) : 0;
    const std::size_t bytes = linear_ce_workspace_size(
        rows, hidden_view.cols, weight_view.rows, hidden_view.dtype, options, hidden_view.device,
        true);
    auto [buffer, workspace] = allocate_workspace(hidden, bytes);
    linear_ce_backward(hidden_view, weight_view,
                       optional_vector_view(inputs.bias, function, "bias"),
                       vector_view(inputs.target, function, "target"),
                       optional_vector_view(lse_vector, function, "lse"),
                       vector_view(grad_output32, function, "grad_output"), options, grads.views,
                       workspace, current_stream(hidden));
    return std::make_tuple(grads.hidden, grads.weight, grads.bias);
  });
}

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "linear_ce_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor? class_weight, Tensor? row_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, float? softcap, float logit_scale, "
      "int workspace_bytes, bool fp32_logits, bool with_stats, bool grad_hidden, "
      "bool grad_weight, bool grad_bias, bool cache_logits) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "linear_ce_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? lse, "
      "Tensor grad_output, Tensor? class_weight, Tensor? row_weight, int ignore_index, "
      "str reduction, float label_smoothing, float z_loss, float? softcap, float logit_scale, "
      "int workspace_bytes, bool fp32_logits, bool grad_hidden, bool grad_weight, "
      "bool grad_bias, Tensor? logits_cache) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  m.impl("linear_ce_forward", &xent::torch_binding::linear_ce_forward_op);
  m.impl("linear_ce_backward", &xent::torch_binding::linear_ce_backward_op);
}

#if defined(XENT_TORCH_CUDA)
TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  m.impl("linear_ce_forward", &xent::torch_binding::linear_ce_forward_op);
  m.impl("linear_ce_backward", &xent::torch_binding::linear_ce_backward_op);
}
#endif
