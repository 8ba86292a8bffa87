// Fused linear policy loss (docs/semantics.md §7 "Fused with the LM head"): the RL policy losses
// of x = h·Wᵀ (+ bias) in three products per row chunk (logits, ∂h, ∂W), never holding N×V.
// GSPO (a sequence's ratio depends on all its tokens' logits) keeps the four-product form of
// the Python API and has no entry here. Where the budget cannot hold the V×H fp32 ∂W accumulator
// of a 16-bit weight, ∂W is formed block by block from the saved statistics afterwards (linear_ce's
// vocabulary-blocked schedule): four products.
#pragma once

#include <optional>

#include "xent/linear_ce.hpp"

namespace xent {

// The per-token term of §7: the clipped surrogate (grpo, bnpo, dapo, dr_grpo), cispo or sapo.
enum class PolicyLossType { clipped_surrogate, cispo, sapo };
enum class KlEstimator { k1, k2, k3 };

struct PolicyLossOptions {
  PolicyLossType type = PolicyLossType::clipped_surrogate;
  double clip_low = 0.2;   // ε_low in [0, 1)
  double clip_high = 0.2;  // ε_high >= 0
  double dual_clip = 0;    // c > 1 (clipped surrogate only); 0 means off
  double sapo_tau_pos = 1.0;
  double sapo_tau_neg = 1.05;
  double tis_cap = 0;  // > 0, required exactly when rollout logprobs are given
  KlEstimator kl_estimator = KlEstimator::k3;
  double kl_coef = 0;       // β >= 0; the KL statistic needs reference logprobs
  double entropy_coef = 0;  // α
};

struct LinearPolicyOptions {
  PolicyLossOptions policy;
  int64_t ignore_index = -100;
  std::optional<double> softcap;                          // as CeOptions (§1's logit transform)
  double logit_scale = 1.0;                               // 1/temperature
  std::size_t workspace_budget = std::size_t{512} << 20;  // as LinearCeOptions
  bool fp32_logits = false;
  // As LinearCeOptions::batch_invariant: a row's ℓ and H (and so its per-token terms) bit-identical
  // whatever the other rows of the call and the budget; the sums over rows are not.
  bool batch_invariant = false;
};

// Per-token data, each [N] in the result dtype (float32; float64 for float64 inputs). Only
// valid tokens (target != ignore_index) are read. `weight` is the aggregation weight g_n of §7,
// formed by the caller from the mask and the sequences (it never depends on a logit).
struct PolicyTokens {
  TensorView advantages;  // required
  TensorView old_logprobs;
  TensorView ref_logprobs;
  TensorView rollout_logprobs;
  TensorView weight;  // required
};

struct LinearPolicyOutputs {
  TensorView loss;     // required scalar: Σ_n g_n·L_n
  TensorView logprob;  // optional [N]: ℓ_n (0 where ignored)
  TensorView entropy;  // optional [N]: H_n (0 where ignored)
  // Optional [4]: sums over the valid tokens of the low-clip and high-clip indicators, the KL
  // estimate (0 without reference logprobs) and the ratio; the caller divides by the count.
  TensorView stats;
  LinearGradients grads;  // gradients of the loss for an upstream gradient of 1
};

// Bytes of workspace for these sizes: the chunk plan of linear_ce within options.workspace_budget
// (reduction none, these gradients) and the per-row arrays of the policy terms, all inside the
// budget whenever the budget holds the smallest plan.
std::size_t linear_policy_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                         const LinearPolicyOptions& options, Device device,
                                         bool with_gradients);

// hidden [N, H], weight [V, H], bias [V] or absent, target [N]; float64 on the CPU only. On the
// CPU an empty workspace makes the op allocate what it needs itself; on CUDA the workspace holds
// linear_policy_workspace_size bytes.
void linear_policy_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                           const PolicyTokens& tokens, const LinearPolicyOptions& options,
                           const LinearPolicyOutputs& out, Workspace workspace = {},
                           Stream stream = {});

}  // namespace xent
