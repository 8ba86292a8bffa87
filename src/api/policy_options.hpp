// What the backends of linear_policy share of a call's options: the chunk options of its logits
// (linear_ce's, reduction none) and the per-token options of common/policy_row.hpp.
#pragma once

#include "common/policy_row.hpp"
#include "xent/linear_policy.hpp"

namespace xent::api {

// The chunk options of linear_policy: its logits are linear_ce's with reduction none.
inline LinearCeOptions linear_policy_chunk_options(const LinearPolicyOptions& options) {
  LinearCeOptions linear;
  linear.ce.ignore_index = options.ignore_index;
  linear.ce.reduction = Reduction::none;
  linear.ce.softcap = options.softcap;
  linear.ce.logit_scale = options.logit_scale;
  linear.workspace_budget = options.workspace_budget;
  linear.fp32_logits = options.fp32_logits;
  linear.batch_invariant = options.batch_invariant;
  return linear;
}

// The per-token options of §7 in the compute type T, with which token data the call brings.
template <class T>
common::PolicyOptions<T> policy_options(const PolicyLossOptions& p, const PolicyTokens& tokens) {
  common::PolicyOptions<T> o;
  switch (p.type) {
    case PolicyLossType::cispo:
      o.term = common::PolicyTerm::cispo;
      break;
    case PolicyLossType::sapo:
      o.term = common::PolicyTerm::sapo;
      break;
    default:
      o.term = common::PolicyTerm::surrogate;
  }
  o.low = static_cast<T>(1.0 - p.clip_low);
  o.high = static_cast<T>(1.0 + p.clip_high);
  o.dual_clip = static_cast<T>(p.dual_clip);
  o.sapo_tau_pos = static_cast<T>(p.sapo_tau_pos);
  o.sapo_tau_neg = static_cast<T>(p.sapo_tau_neg);
  o.tis_cap = static_cast<T>(p.tis_cap);
  o.kl = p.kl_estimator == KlEstimator::k1   ? common::KlEstimator::k1
         : p.kl_estimator == KlEstimator::k2 ? common::KlEstimator::k2
                                             : common::KlEstimator::k3;
  o.kl_coef = static_cast<T>(p.kl_coef);
  o.entropy_coef = static_cast<T>(p.entropy_coef);
  o.has_old = tokens.old_logprobs.present();
  o.has_ref = tokens.ref_logprobs.present();
  o.has_rollout = tokens.rollout_logprobs.present();
  return o;
}

}  // namespace xent::api
