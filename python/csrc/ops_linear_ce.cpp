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

// weight_grad_dtype: float32 for the gradient of an fp32 (master) weight whose products run in
// 16 bits: the core then accumulates ∂W in place in it, with no fp32 accumulator in the workspace.
GradientBuffers make_gradients(const char* function, const LinearInputs& inputs, bool grad_hidden,
                               bool grad_weight, bool grad_bias,
                               c10::optional<at::ScalarType> weight_grad_dtype = c10::nullopt) {
  GradientBuffers grads;
  const auto none = [&](const Tensor& like) { return at::empty({0}, like.options()); };
  grads.hidden = grad_hidden ? at::empty(inputs.hidden.sizes(), inputs.hidden.options())
                             : none(inputs.hidden);
  const auto weight_options =
      inputs.weight.options().dtype(weight_grad_dtype.value_or(inputs.weight.scalar_type()));
  grads.weight = grad_weight ? at::empty(inputs.weight.sizes(), weight_options)
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
                     bool grad_bias, bool cache_logits, const c10::optional<Tensor>& grad_scale,
                     c10::optional<at::ScalarType> weight_grad_dtype) {
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
    const Reduction reduction_kind = options.ce.reduction;

    const LossOutputs outputs =
        make_loss_outputs(function, hidden, reduction_kind, rows, with_stats);
    GradientBuffers grads =
        make_gradients(function, inputs, grad_hidden, grad_weight, grad_bias, weight_grad_dtype);
    const auto grad_scale32 = as_result_dtype(grad_scale, hidden);
    LinearCeOptions cached_options = options;
    Tensor logits_cache = at::empty({0}, hidden.options());
    if (cache_logits) {
      const int64_t vocab = weight.dim() >= 1 ? weight.size(0) : 0;
      logits_cache = at::empty({rows, vocab}, fp32_logits ? f32 : hidden.options());
      cached_options.logits_cache = matrix_view(logits_cache, function, "logits_cache");
    }

    LinearCeOutputs out;
    out.loss = outputs.loss_view;
    out.stats = outputs.stats;
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
                      optional_vector_view(grad_scale32, function, "grad_scale"), workspace,
                      current_stream(hidden));
    return std::tuple_cat(outputs.as_tuple(),
                          std::make_tuple(grads.hidden, grads.weight, grads.bias, logits_cache));
  });
}

// linear_ce_backward into fresh gradient buffers, with its workspace from the caching allocator.
// grad_output is fp32; lse may be absent unless `entropy` is present.
std::tuple<Tensor, Tensor, Tensor> run_linear_backward(
    const char* function, const LinearInputs& inputs, const LinearCeOptions& options,
    const c10::optional<Tensor>& lse, const Tensor& grad_output, const EntropyGradient& entropy,
    bool grad_hidden, bool grad_weight, bool grad_bias,
    c10::optional<at::ScalarType> weight_grad_dtype = c10::nullopt) {
  const auto lse_vector = lse.has_value() ? c10::optional<Tensor>(lse->contiguous()) : lse;
  GradientBuffers grads =
      make_gradients(function, inputs, grad_hidden, grad_weight, grad_bias, weight_grad_dtype);
  const TensorView hidden_view = matrix_view(inputs.hidden, function, "hidden");
  const TensorView weight_view = matrix_view(inputs.weight, function, "weight");
  const int64_t rows = inputs.hidden.dim() >= 1 ? inputs.hidden.size(0) : 0;
  const std::size_t bytes = linear_ce_workspace_size(
      rows, hidden_view.cols, weight_view.rows, hidden_view.dtype, options, hidden_view.device,
      true);
  auto [buffer, workspace] = allocate_workspace(inputs.hidden, bytes);
  linear_ce_backward(hidden_view, weight_view, optional_vector_view(inputs.bias, function, "bias"),
                     vector_view(inputs.target, function, "target"),
                     optional_vector_view(lse_vector, function, "lse"),
                     vector_view(grad_output, function, "grad_output"), entropy, options,
                     grads.views, workspace, current_stream(inputs.hidden));
  return std::make_tuple(grads.hidden, grads.weight, grads.bias);
}

std::tuple<Tensor, Tensor, Tensor> linear_ce_backward_op(
    const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
    const Tensor& target, const c10::optional<Tensor>& lse, const Tensor& grad_output,
    const c10::optional<Tensor>& class_weight, const c10::optional<Tensor>& row_weight,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, double z_loss,
    c10::optional<double> softcap, double logit_scale, int64_t workspace_bytes, bool fp32_logits,
    bool grad_hidden, bool grad_weight, bool grad_bias,
    const c10::optional<Tensor>& logits_cache, c10::optional<at::ScalarType> weight_grad_dtype) {
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
    return run_linear_backward(function, inputs, options, lse,
                               grad_output.to(result_dtype(hidden)).contiguous(), EntropyGradient{},
                               grad_hidden, grad_weight, grad_bias, weight_grad_dtype);
  });
}

// The backward of xent.linear_logprobs (reduction none, no other loss option): g_lp enters as
// grad_output = −g_lp, grad_entropy (may be absent) adds the entropy term to each chunk's
// gradient in the same pass, from the forward's lse and entropy. logits_cache: the [N, V] logits
// a forward with cache_logits kept (read instead of recomputed), and weight_grad_dtype (fp32 for
// an fp32 master weight: ∂W accumulated in place), as in linear_ce_backward.
std::tuple<Tensor, Tensor, Tensor> linear_logprob_backward_op(
    const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
    const Tensor& target, const Tensor& lse, const Tensor& entropy, const Tensor& grad_logprob,
    const c10::optional<Tensor>& grad_entropy, int64_t ignore_index,
    c10::optional<double> softcap, double logit_scale, int64_t workspace_bytes, bool fp32_logits,
    bool grad_hidden, bool grad_weight, bool grad_bias,
    const c10::optional<Tensor>& logits_cache, c10::optional<at::ScalarType> weight_grad_dtype) {
  constexpr const char* function = "linear_logprob_backward";
  return translate_errors([&] {
    c10::DeviceGuard guard(hidden.device());
    const LinearInputs inputs = prepare_inputs(hidden, weight, bias, target, c10::nullopt,
                                               c10::nullopt);
    LinearCeOptions options =
        make_linear_options(function, inputs, ignore_index, "none", 0.0, 0.0, softcap,
                            logit_scale, workspace_bytes, fp32_logits);
    const auto cache_rows = optional_rows(logits_cache);
    options.logits_cache = optional_matrix_view(cache_rows, function, "logits_cache");
    const Tensor entropy_vector = entropy.contiguous();
    const auto grad_entropy32 = as_result_dtype(grad_entropy, hidden);
    EntropyGradient entropy_gradient;
    if (grad_entropy32.has_value()) {
      entropy_gradient.entropy = vector_view(entropy_vector, function, "entropy");
      entropy_gradient.grad = vector_view(*grad_entropy32, function, "grad_entropy");
    }
    return run_linear_backward(function, inputs, options, lse,
                               grad_logprob.to(result_dtype(hidden)).neg().contiguous(), entropy_gradient,
                               grad_hidden, grad_weight, grad_bias, weight_grad_dtype);
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
      "bool grad_weight, bool grad_bias, bool cache_logits, Tensor? grad_scale, "
      "ScalarType? weight_grad_dtype) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "linear_ce_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? lse, "
      "Tensor grad_output, Tensor? class_weight, Tensor? row_weight, int ignore_index, "
      "str reduction, float label_smoothing, float z_loss, float? softcap, float logit_scale, "
      "int workspace_bytes, bool fp32_logits, bool grad_hidden, bool grad_weight, "
      "bool grad_bias, Tensor? logits_cache, ScalarType? weight_grad_dtype) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "linear_logprob_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor lse, Tensor entropy, Tensor grad_logprob, Tensor? grad_entropy, int ignore_index, "
      "float? softcap, float logit_scale, int workspace_bytes, bool fp32_logits, "
      "bool grad_hidden, bool grad_weight, bool grad_bias, Tensor? logits_cache, "
      "ScalarType? weight_grad_dtype) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(xent, CPU, m) {
  m.impl("linear_ce_forward", &xent::torch_binding::linear_ce_forward_op);
  m.impl("linear_ce_backward", &xent::torch_binding::linear_ce_backward_op);
  m.impl("linear_logprob_backward", &xent::torch_binding::linear_logprob_backward_op);
}

#if defined(XENT_TORCH_CUDA)
TORCH_LIBRARY_IMPL(xent, CUDA, m) {
  m.impl("linear_ce_forward", &xent::torch_binding::linear_ce_forward_op);
  m.impl("linear_ce_backward", &xent::torch_binding::linear_ce_backward_op);
  m.impl("linear_logprob_backward", &xent::torch_binding::linear_logprob_backward_op);
}
#endif
