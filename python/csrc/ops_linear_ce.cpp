// torch ops xent::linear_ce_forward, xent::linear_ce_backward, and the correction of a weight
// gradient added in the forward (docs/semantics.md §2).
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

// The schema's weight_grad_accumulation string (linear_ce.hpp WeightGradAccumulation).
WeightGradAccumulation parse_weight_grad_accumulation(const char* function,
                                                      c10::string_view value_view) {
  const std::string value(value_view.data(), value_view.size());
  if (value == "fp32") return WeightGradAccumulation::fp32;
  if (value == "weight_dtype") return WeightGradAccumulation::weight_dtype;
  TORCH_CHECK_VALUE(false, function, ": weight_grad_accumulation unknown: got '", value,
                    "'; expected one of 'fp32', 'weight_dtype'");
}

// Gradient tensors in their input's dtype ([0] when not requested) and their views.
struct GradientBuffers {
  Tensor hidden, weight, bias;
  LinearGradients views;
};

// weight_grad_dtype: float32 for the gradient of an fp32 (master) weight whose products run in
// 16 bits: the core then accumulates ∂W in place in it, with no fp32 accumulator in the workspace.
// accumulate_into: the caller's fp32 [V, H] buffer that ∂W is added into (accumulate_weight); the
// returned weight gradient is then empty.
GradientBuffers make_gradients(const char* function, const LinearInputs& inputs, bool grad_hidden,
                               bool grad_weight, bool grad_bias,
                               c10::optional<at::ScalarType> weight_grad_dtype = c10::nullopt,
                               const c10::optional<Tensor>& accumulate_into = c10::nullopt) {
  GradientBuffers grads;
  const auto none = [&](const Tensor& like) { return at::empty({0}, like.options()); };
  grads.hidden =
      grad_hidden ? at::empty(inputs.hidden.sizes(), inputs.hidden.options()) : none(inputs.hidden);
  const auto weight_options =
      inputs.weight.options().dtype(weight_grad_dtype.value_or(inputs.weight.scalar_type()));
  const bool added = grad_weight && accumulate_into.has_value();
  grads.weight = grad_weight && !added ? at::empty(inputs.weight.sizes(), weight_options)
                                       : none(inputs.weight);
  const bool with_bias = grad_bias && inputs.bias.has_value();
  grads.bias =
      with_bias ? at::empty(inputs.bias->sizes(), inputs.bias->options()) : none(inputs.weight);
  if (grad_hidden) grads.views.hidden = matrix_view(grads.hidden, function, "grad_hidden");
  if (added) {
    // The core adds where the tensor is: a copy would take the gradient and be dropped.
    require_in_place_rows(function, "accumulate_into", *accumulate_into,
                          "the buffer the weight gradient is added into");
    grads.views.weight = matrix_view(*accumulate_into, function, "accumulate_into");
    grads.views.accumulate_weight = true;
  } else if (grad_weight) {
    grads.views.weight = matrix_view(grads.weight, function, "grad_weight");
  }
  if (with_bias) grads.views.bias = vector_view(grads.bias, function, "grad_bias");
  return grads;
}

// (loss, lse, logprob, entropy, argmax, accuracy, z_loss_value, grad_hidden, grad_weight,
//  grad_bias, logits_cache): unrequested ones are empty [0] tensors. The logits cache [R, V] of
// rows [0, R) (R = cache_rows, or N when it is negative) is filled by a forward that forms no
// gradient, for a backward that then skips h·Wᵀ on those rows.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
linear_ce_forward_op(const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
                     const Tensor& target, const c10::optional<Tensor>& class_weight,
                     const c10::optional<Tensor>& row_weight, int64_t ignore_index,
                     c10::string_view reduction, double label_smoothing, double z_loss,
                     c10::optional<double> softcap, double logit_scale, int64_t workspace_bytes,
                     bool fp32_logits, bool with_stats, bool grad_hidden, bool grad_weight,
                     bool grad_bias, bool cache_logits, const c10::optional<Tensor>& grad_scale,
                     c10::optional<at::ScalarType> weight_grad_dtype,
                     const c10::optional<Tensor>& accumulate_into, bool batch_invariant,
                     c10::string_view weight_grad_accumulation, int64_t cache_rows) {
  constexpr const char* function = "linear_ce_forward";
  return translate_errors([&] {
    c10::DeviceGuard guard(hidden.device());
    const LinearInputs inputs =
        prepare_inputs(hidden, weight, bias, target, class_weight, row_weight);
    LinearCeOptions options =
        make_linear_options(function, inputs, ignore_index, reduction, label_smoothing, z_loss,
                            softcap, logit_scale, workspace_bytes, fp32_logits);
    options.batch_invariant = batch_invariant;
    options.weight_grad_accumulation =
        parse_weight_grad_accumulation(function, weight_grad_accumulation);
    const int64_t rows = hidden.dim() >= 1 ? hidden.size(0) : 0;
    const auto f32 = hidden.options().dtype(at::kFloat);
    const Reduction reduction_kind = options.ce.reduction;

    const LossOutputs outputs =
        make_loss_outputs(function, hidden, reduction_kind, rows, with_stats);
    GradientBuffers grads = make_gradients(function, inputs, grad_hidden, grad_weight, grad_bias,
                                           weight_grad_dtype, accumulate_into);
    const auto grad_scale32 = as_result_dtype(grad_scale, hidden);
    LinearCeOptions cached_options = options;
    Tensor logits_cache = at::empty({0}, hidden.options());
    if (cache_logits) {
      const int64_t vocab = weight.dim() >= 1 ? weight.size(0) : 0;
      // A count above N is left to the core's check of the cache's shape.
      logits_cache = at::empty({cache_rows < 0 ? rows : cache_rows, vocab},
                               fp32_logits ? f32 : hidden.options());
      cached_options.logits_cache = matrix_view(logits_cache, function, "logits_cache");
    }

    LinearCeOutputs out;
    out.loss = outputs.loss_view;
    out.stats = outputs.stats;
    out.grads = grads.views;

    const TensorView hidden_view = matrix_view(inputs.hidden, function, "hidden");
    const TensorView weight_view = matrix_view(inputs.weight, function, "weight");
    const bool with_gradients = grad_hidden || grad_weight || grad_bias;
    const std::size_t bytes =
        linear_ce_workspace_size(rows, hidden_view.cols, weight_view.rows, hidden_view.dtype,
                                 cached_options, hidden_view.device, with_gradients);
    auto [buffer, workspace] = allocate_workspace(hidden, bytes);
    linear_ce_forward(hidden_view, weight_view, optional_vector_view(inputs.bias, function, "bias"),
                      vector_view(inputs.target, function, "target"), cached_options, out,
                      optional_vector_view(grad_scale32, function, "grad_scale"), workspace,
                      current_stream(hidden));
    return std::tuple_cat(outputs.as_tuple(),
                          std::make_tuple(grads.hidden, grads.weight, grads.bias, logits_cache));
  });
}

// linear_ce_backward into fresh gradient buffers (∂W into accumulate_into when given), with its
// workspace from the caching allocator. grad_output is fp32; lse may be absent unless `entropy`
// is present.
std::tuple<Tensor, Tensor, Tensor> run_linear_backward(
    const char* function, const LinearInputs& inputs, const LinearCeOptions& options,
    const c10::optional<Tensor>& lse, const Tensor& grad_output, const EntropyGradient& entropy,
    bool grad_hidden, bool grad_weight, bool grad_bias,
    c10::optional<at::ScalarType> weight_grad_dtype = c10::nullopt,
    const c10::optional<Tensor>& accumulate_into = c10::nullopt) {
  const auto lse_vector = lse.has_value() ? c10::optional<Tensor>(lse->contiguous()) : lse;
  GradientBuffers grads = make_gradients(function, inputs, grad_hidden, grad_weight, grad_bias,
                                         weight_grad_dtype, accumulate_into);
  const TensorView hidden_view = matrix_view(inputs.hidden, function, "hidden");
  const TensorView weight_view = matrix_view(inputs.weight, function, "weight");
  const int64_t rows = inputs.hidden.dim() >= 1 ? inputs.hidden.size(0) : 0;
  const std::size_t bytes =
      linear_ce_workspace_size(rows, hidden_view.cols, weight_view.rows, hidden_view.dtype, options,
                               hidden_view.device, true);
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
    bool grad_hidden, bool grad_weight, bool grad_bias, const c10::optional<Tensor>& logits_cache,
    c10::optional<at::ScalarType> weight_grad_dtype, const c10::optional<Tensor>& accumulate_into,
    c10::string_view weight_grad_accumulation) {
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
    options.weight_grad_accumulation =
        parse_weight_grad_accumulation(function, weight_grad_accumulation);
    return run_linear_backward(
        function, inputs, options, lse, grad_output.to(result_dtype(hidden)).contiguous(),
        EntropyGradient{}, grad_hidden, grad_weight, grad_bias, weight_grad_dtype, accumulate_into);
  });
}

// The rest of ∂W after a forward that added it into accumulate_into for an upstream gradient of
// 1 (sum/mean, formed in the forward): adds (g − 1)·∂W for the real upstream g by recomputing
// the chunk logits, the linear_ce_backward of the weight alone. grad_scale (1/normalizer) is
// what the forward formed the gradient for. Deciding g == 1 reads g on the host: one small
// device-to-host copy (a synchronisation) per step, which skips the recompute in the common
// case (loss.backward(), a normalizer instead of dividing the loss). While the stream is captured
// into a CUDA graph nothing may be read (a replay would not read it again): the recompute then
// always runs, adding 0·∂W when g is 1.
void linear_ce_accumulate_correction_op(
    const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
    const Tensor& target, const Tensor& lse, const Tensor& grad_loss,
    const c10::optional<Tensor>& grad_scale, const c10::optional<Tensor>& class_weight,
    const c10::optional<Tensor>& row_weight, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss, c10::optional<double> softcap, double logit_scale,
    int64_t workspace_bytes, bool fp32_logits, const Tensor& accumulate_into) {
  constexpr const char* function = "linear_ce_accumulate_correction";
  translate_errors([&] {
    c10::DeviceGuard guard(hidden.device());
    if (!stream_is_capturing(grad_loss) && grad_loss.item<double>() == 1.0) return;
    const LinearInputs inputs =
        prepare_inputs(hidden, weight, bias, target, class_weight, row_weight);
    const LinearCeOptions options =
        make_linear_options(function, inputs, ignore_index, reduction, label_smoothing, z_loss,
                            softcap, logit_scale, workspace_bytes, fp32_logits);
    Tensor upstream = grad_loss.to(result_dtype(hidden)) - 1;
    if (grad_scale.has_value()) upstream = upstream * grad_scale->to(upstream.scalar_type());
    run_linear_backward(function, inputs, options, lse, upstream.contiguous(), EntropyGradient{},
                        false, true, false, c10::nullopt, accumulate_into);
  });
}

// The backward of xent.linear_logprobs (reduction none, no other loss option): g_lp enters as
// grad_output = −g_lp, grad_entropy (may be absent) adds the entropy term to each chunk's
// gradient in the same pass, from the forward's lse and entropy. logits_cache: the [R, V] logits
// of rows [0, R) a forward with cache_logits kept (read instead of recomputed; the other rows'
// recomputed), and weight_grad_dtype (fp32 for
// an fp32 master weight: ∂W accumulated in place), as in linear_ce_backward.
std::tuple<Tensor, Tensor, Tensor> linear_logprob_backward_op(
    const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
    const Tensor& target, const Tensor& lse, const Tensor& entropy, const Tensor& grad_logprob,
    const c10::optional<Tensor>& grad_entropy, int64_t ignore_index, c10::optional<double> softcap,
    double logit_scale, int64_t workspace_bytes, bool fp32_logits, bool grad_hidden,
    bool grad_weight, bool grad_bias, const c10::optional<Tensor>& logits_cache,
    c10::optional<at::ScalarType> weight_grad_dtype) {
  constexpr const char* function = "linear_logprob_backward";
  return translate_errors([&] {
    c10::DeviceGuard guard(hidden.device());
    const LinearInputs inputs =
        prepare_inputs(hidden, weight, bias, target, c10::nullopt, c10::nullopt);
    LinearCeOptions options =
        make_linear_options(function, inputs, ignore_index, "none", 0.0, 0.0, softcap, logit_scale,
                            workspace_bytes, fp32_logits);
    const auto cache_rows = optional_rows(logits_cache);
    options.logits_cache = optional_matrix_view(cache_rows, function, "logits_cache");
    const Tensor entropy_vector = entropy.contiguous();
    const auto grad_entropy32 = as_result_dtype(grad_entropy, hidden);
    EntropyGradient entropy_gradient;
    if (grad_entropy32.has_value()) {
      entropy_gradient.entropy = vector_view(entropy_vector, function, "entropy");
      entropy_gradient.grad = vector_view(*grad_entropy32, function, "grad_entropy");
    }
    return run_linear_backward(
        function, inputs, options, lse, grad_logprob.to(result_dtype(hidden)).neg().contiguous(),
        entropy_gradient, grad_hidden, grad_weight, grad_bias, weight_grad_dtype);
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
      "ScalarType? weight_grad_dtype, Tensor(a!)? accumulate_into=None, "
      "bool batch_invariant=False, str weight_grad_accumulation='fp32', int cache_rows=-1) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "linear_ce_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? lse, "
      "Tensor grad_output, Tensor? class_weight, Tensor? row_weight, int ignore_index, "
      "str reduction, float label_smoothing, float z_loss, float? softcap, float logit_scale, "
      "int workspace_bytes, bool fp32_logits, bool grad_hidden, bool grad_weight, "
      "bool grad_bias, Tensor? logits_cache, ScalarType? weight_grad_dtype, "
      "Tensor(a!)? accumulate_into=None, str weight_grad_accumulation='fp32') -> (Tensor, "
      "Tensor, Tensor)");
  m.def(
      "linear_ce_accumulate_correction(Tensor hidden, Tensor weight, Tensor? bias, "
      "Tensor target, Tensor lse, Tensor grad_loss, Tensor? grad_scale, Tensor? class_weight, "
      "Tensor? row_weight, int ignore_index, str reduction, float label_smoothing, "
      "float z_loss, float? softcap, float logit_scale, int workspace_bytes, bool fp32_logits, "
      "Tensor(a!) accumulate_into) -> ()");
  m.def(
      "linear_logprob_backward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor lse, Tensor entropy, Tensor grad_logprob, Tensor? grad_entropy, int ignore_index, "
      "float? softcap, float logit_scale, int workspace_bytes, bool fp32_logits, "
      "bool grad_hidden, bool grad_weight, bool grad_bias, Tensor? logits_cache, "
      "ScalarType? weight_grad_dtype) -> (Tensor, Tensor, Tensor)");
  xent::torch_binding::impl_on_devices(m, "linear_ce_forward",
                                       &xent::torch_binding::linear_ce_forward_op);
  xent::torch_binding::impl_on_devices(m, "linear_ce_backward",
                                       &xent::torch_binding::linear_ce_backward_op);
  xent::torch_binding::impl_on_devices(m, "linear_ce_accumulate_correction",
                                       &xent::torch_binding::linear_ce_accumulate_correction_op);
  xent::torch_binding::impl_on_devices(m, "linear_logprob_backward",
                                       &xent::torch_binding::linear_logprob_backward_op);
}
