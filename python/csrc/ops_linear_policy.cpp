// torch op xent::linear_policy_forward: the three-product linear policy loss (docs/semantics.md
// §7 "Fused with the LM head"), its gradients formed in the forward, on CPU and CUDA tensors;
// GSPO stays with the Python composition.
#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

PolicyLossOptions make_policy_options(const char* function, c10::string_view loss_type,
                                      double clip_low, double clip_high,
                                      c10::optional<double> dual_clip, double kl_coef,
                                      c10::string_view kl_estimator, double entropy_coef,
                                      c10::optional<double> tis_cap, double sapo_tau_pos,
                                      double sapo_tau_neg) {
  PolicyLossOptions p;
  if (loss_type == "cispo") {
    p.type = PolicyLossType::cispo;
  } else if (loss_type == "sapo") {
    p.type = PolicyLossType::sapo;
  } else if (loss_type == "grpo" || loss_type == "bnpo" || loss_type == "dapo" ||
             loss_type == "dr_grpo") {
    p.type = PolicyLossType::clipped_surrogate;
  } else {
    TORCH_CHECK_VALUE(false, function, ": loss_type ", std::string(loss_type),
                      " has no fused form (expected grpo, bnpo, dapo, dr_grpo, cispo or sapo)");
  }
  if (kl_estimator == "k1") {
    p.kl_estimator = KlEstimator::k1;
  } else if (kl_estimator == "k2") {
    p.kl_estimator = KlEstimator::k2;
  } else {
    TORCH_CHECK_VALUE(kl_estimator == "k3", function, ": kl_estimator ", std::string(kl_estimator),
                      " unknown (expected k1, k2 or k3)");
  }
  p.clip_low = clip_low;
  p.clip_high = clip_high;
  p.dual_clip = dual_clip.value_or(0.0);
  p.kl_coef = kl_coef;
  p.entropy_coef = entropy_coef;
  p.tis_cap = tis_cap.value_or(0.0);
  p.sapo_tau_pos = sapo_tau_pos;
  p.sapo_tau_neg = sapo_tau_neg;
  return p;
}

// (loss, logprob, entropy, stats, grad_hidden, grad_weight, grad_bias); stats [4] holds the sums
// over valid tokens of the clip indicators, the KL estimate and the ratio. Unrequested gradients
// are empty [0] tensors.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> linear_policy_forward_op(
    const Tensor& hidden, const Tensor& weight, const c10::optional<Tensor>& bias,
    const Tensor& target, const Tensor& advantages, const c10::optional<Tensor>& old_logprobs,
    const c10::optional<Tensor>& ref_logprobs, const c10::optional<Tensor>& rollout_logprobs,
    const Tensor& token_weight, c10::string_view loss_type, double clip_low, double clip_high,
    c10::optional<double> dual_clip, double kl_coef, c10::string_view kl_estimator,
    double entropy_coef, c10::optional<double> tis_cap, double sapo_tau_pos, double sapo_tau_neg,
    int64_t ignore_index, c10::optional<double> softcap, double logit_scale,
    int64_t workspace_bytes, bool fp32_logits, bool grad_hidden, bool grad_weight, bool grad_bias,
    c10::optional<at::ScalarType> weight_grad_dtype, bool batch_invariant) {
  constexpr const char* function = "linear_policy_forward";
  return translate_errors([&] {
    c10::DeviceGuard guard(hidden.device());
    LinearPolicyOptions options;
    options.policy =
        make_policy_options(function, loss_type, clip_low, clip_high, dual_clip, kl_coef,
                            kl_estimator, entropy_coef, tis_cap, sapo_tau_pos, sapo_tau_neg);
    options.ignore_index = ignore_index;
    options.softcap = softcap ? std::optional<double>(*softcap) : std::nullopt;
    options.logit_scale = logit_scale;
    options.workspace_budget = workspace_budget(workspace_bytes, options.workspace_budget);
    options.fp32_logits = fp32_logits;
    options.batch_invariant = batch_invariant;

    const Tensor h = contiguous_rows(hidden), w = contiguous_rows(weight);
    const Tensor y = contiguous_vector(target);
    const c10::optional<Tensor> b =
        bias.has_value() ? c10::optional<Tensor>(bias->contiguous()) : bias;
    const auto as_result = [&](const c10::optional<Tensor>& t) {
      const auto converted = as_result_dtype(t, hidden);
      return converted.has_value() ? c10::optional<Tensor>(converted->contiguous()) : converted;
    };
    const auto adv = as_result(advantages), old = as_result(old_logprobs),
               ref = as_result(ref_logprobs), rollout = as_result(rollout_logprobs),
               g = as_result(token_weight);
    const PolicyTokens tokens{optional_vector_view(adv, function, "advantages"),
                              optional_vector_view(old, function, "old_logprobs"),
                              optional_vector_view(ref, function, "ref_logprobs"),
                              optional_vector_view(rollout, function, "rollout_logprobs"),
                              optional_vector_view(g, function, "token_weight")};

    const int64_t rows = h.dim() >= 1 ? h.size(0) : 0;
    const auto results = hidden.options().dtype(result_dtype(hidden));
    Tensor loss = at::empty({}, results), logprob = at::empty({rows}, results),
           entropy = at::empty({rows}, results), stats = at::empty({4}, results);
    const auto none = [](const Tensor& like) { return at::empty({0}, like.options()); };
    Tensor gh = grad_hidden ? at::empty(h.sizes(), h.options()) : none(h);
    const auto weight_options = w.options().dtype(weight_grad_dtype.value_or(w.scalar_type()));
    Tensor gw = grad_weight ? at::empty(w.sizes(), weight_options) : none(w);
    const bool with_bias = grad_bias && b.has_value();
    Tensor gb = with_bias ? at::empty(b->sizes(), b->options()) : none(w);

    LinearPolicyOutputs out;
    out.loss = vector_view(loss, function, "loss");
    out.logprob = vector_view(logprob, function, "logprob");
    out.entropy = vector_view(entropy, function, "entropy");
    out.stats = vector_view(stats, function, "stats");
    if (grad_hidden) out.grads.hidden = matrix_view(gh, function, "grad_hidden");
    if (grad_weight) out.grads.weight = matrix_view(gw, function, "grad_weight");
    if (with_bias) out.grads.bias = vector_view(gb, function, "grad_bias");
    const TensorView hidden_view = matrix_view(h, function, "hidden");
    const TensorView weight_view = matrix_view(w, function, "weight");
    const std::size_t bytes = linear_policy_workspace_size(
        rows, hidden_view.cols, weight_view.rows, hidden_view.dtype, options, hidden_view.device,
        grad_hidden || grad_weight || with_bias);
    auto [buffer, workspace] = allocate_workspace(hidden, bytes);
    linear_policy_forward(hidden_view, weight_view, optional_vector_view(b, function, "bias"),
                          vector_view(y, function, "target"), tokens, options, out, workspace,
                          current_stream(hidden));
    return std::make_tuple(loss, logprob, entropy, stats, gh, gw, gb);
  });
}

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "linear_policy_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor advantages, Tensor? old_logprobs, Tensor? ref_logprobs, Tensor? rollout_logprobs, "
      "Tensor token_weight, str loss_type, float clip_low, float clip_high, float? dual_clip, "
      "float kl_coef, str kl_estimator, float entropy_coef, float? tis_cap, float sapo_tau_pos, "
      "float sapo_tau_neg, int ignore_index, float? softcap, float logit_scale, "
      "int workspace_bytes, bool fp32_logits, bool grad_hidden, bool grad_weight, "
      "bool grad_bias, ScalarType? weight_grad_dtype, bool batch_invariant=False) -> (Tensor, "
      "Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor)");
  xent::torch_binding::impl_on_devices(m, "linear_policy_forward",
                                       &xent::torch_binding::linear_policy_forward_op);
}
