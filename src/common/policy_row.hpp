// The per-token math of the policy losses (docs/semantics.md §7), written once for both backends:
// from a valid token's ℓ and H, its data (A, ℓ_old, ℓ_ref, ℓ_rol) and its aggregation weight g,
// its share of the loss, the upstream coefficients c_ℓ and c_H of the row kernel's gradient sweep,
// and its share of the detached statistics. The fused LM-head form calls it between a chunk's
// statistics and gradient sweeps; g never depends on a logit, so it is known before the chunk.
// T is the compute type: float for fp32/bf16/fp16 inputs, double for fp64.
#pragma once

#include <cmath>

#include "common/numeric.hpp"

namespace xent::common {

// The loss types of §7 that differ in their per-token term: the four clipped-surrogate names
// (grpo, bnpo, dapo, dr_grpo) share one; gspo's ρ is its sequence's ratio s_i, formed outside.
enum class PolicyTerm { surrogate, gspo, cispo, sapo };
enum class KlEstimator { k1, k2, k3 };

template <class T>
struct PolicyOptions {
  PolicyTerm term = PolicyTerm::surrogate;
  T low = T(0.8);   // lo = 1 − ε_low
  T high = T(1.2);  // hi = 1 + ε_high
  T dual_clip = 0;  // c > 1; 0 means off (clipped-surrogate types only)
  T sapo_tau_pos = 1;
  T sapo_tau_neg = T(1.05);
  T tis_cap = 0;  // used only when the token has rollout logprobs
  KlEstimator kl = KlEstimator::k3;
  T kl_coef = 0;       // β
  T entropy_coef = 0;  // α
  bool has_old = false;
  bool has_ref = false;
  bool has_rollout = false;
};

// One valid token's inputs. old/ref/rollout are read only when the options say they are given.
template <class T>
struct PolicyToken {
  T logprob;  // ℓ
  T entropy;  // H
  T advantage;
  T old = 0;
  T ref = 0;
  T rollout = 0;
  T weight;  // g
};

// One valid token's results. For gspo, grad_logprob holds only the KL part and policy_grad the
// token's g·w·∂P/∂ρ, which the caller sums over the sequence and multiplies by s_i/|V_i|.
template <class T>
struct PolicyResult {
  T loss = 0;          // g·L
  T grad_logprob = 0;  // c_ℓ
  T grad_entropy = 0;  // c_H
  T policy_grad = 0;   // gspo only: g·w·∂P/∂ρ
  bool clipped_low = false;
  bool clipped_high = false;
  T kl = 0;     // k (0 without reference logprobs)
  T ratio = 0;  // ρ
};

// ∂P/∂ρ and P of the clipped surrogate at ratio ρ, with the clip counts of §7.
template <class T>
XENT_HD T surrogate_term(const PolicyOptions<T>& o, T ratio, T advantage, T& d_ratio,
                         bool& clipped_low, bool& clipped_high) {
  const T clipped = ratio < o.low ? o.low : (ratio > o.high ? o.high : ratio);
  const T unclipped_value = ratio * advantage, clipped_value = clipped * advantage;
  T value = -(clipped_value < unclipped_value ? clipped_value : unclipped_value);
  // The unclipped branch is the minimum (its gradient flows) below the upper bound for A ≥ 0 and
  // above the lower one for A < 0.
  bool flows = advantage >= 0 ? ratio <= o.high : ratio >= o.low;
  clipped_low = advantage < 0 && ratio < o.low;
  clipped_high = advantage > 0 && ratio > o.high;
  if (o.dual_clip > 0 && advantage < 0 && ratio > o.dual_clip) {
    value = -o.dual_clip * advantage;
    flows = false;
    clipped_high = true;
  }
  d_ratio = flows ? -advantage : T(0);
  return value;
}

// ratio_override: gspo's s_i of the token's sequence (ignored for the other types).
template <class T>
XENT_HD PolicyResult<T> policy_token(const PolicyOptions<T>& o, const PolicyToken<T>& t,
                                     T ratio_override = T(1)) {
  PolicyResult<T> r;
  const T old = o.has_old ? t.old : t.logprob;  // on policy: ratio 1, ∂r/∂ℓ = 1
  const T ratio = o.term == PolicyTerm::gspo ? ratio_override : std::exp(t.logprob - old);
  r.ratio = ratio;
  T tis = 1;
  if (o.has_rollout) {
    const T w = std::exp(old - t.rollout);
    tis = w < o.tis_cap ? w : o.tis_cap;
  }
  const T scaled = t.weight * tis;  // the policy term's weight in the loss
  T value = 0;
  switch (o.term) {
    case PolicyTerm::surrogate:
    case PolicyTerm::gspo: {
      T d_ratio = 0;
      value = surrogate_term(o, ratio, t.advantage, d_ratio, r.clipped_low, r.clipped_high);
      if (o.term == PolicyTerm::gspo)
        r.policy_grad = scaled * d_ratio;
      else
        r.grad_logprob = scaled * d_ratio * ratio;
      break;
    }
    case PolicyTerm::sapo: {
      const T tau = t.advantage > 0 ? o.sapo_tau_pos : o.sapo_tau_neg;
      const T gate = T(1) / (T(1) + std::exp(-tau * (ratio - T(1))));
      value = -t.advantage * gate * T(4) / tau;
      r.grad_logprob = scaled * (-t.advantage * T(4) * gate * (T(1) - gate)) * ratio;
      break;
    }
    case PolicyTerm::cispo: {
      const T weight = ratio < o.low ? o.low : (ratio > o.high ? o.high : ratio);
      value = -weight * t.advantage * t.logprob;
      r.grad_logprob = scaled * (-weight * t.advantage);
      r.clipped_low = ratio < o.low;
      r.clipped_high = ratio > o.high;
      break;
    }
  }
  r.loss = scaled * value;
  if (o.has_ref) {
    const T u = t.ref - t.logprob;  // log(π_ref / π)
    T d_kl;
    switch (o.kl) {
      case KlEstimator::k1:
        r.kl = -u, d_kl = 1;
        break;
      case KlEstimator::k2:
        r.kl = T(0.5) * u * u, d_kl = -u;
        break;
      default: {
        const T e = std::exp(u);
        r.kl = e - u - T(1), d_kl = T(1) - e;
      }
    }
    // Skipped at β = 0 rather than multiplied: the statistic may be inf where the loss is not.
    if (o.kl_coef != 0) {
      r.loss += t.weight * o.kl_coef * r.kl;
      r.grad_logprob += t.weight * o.kl_coef * d_kl;
    }
  }
  if (o.entropy_coef != 0) {
    r.loss -= t.weight * o.entropy_coef * t.entropy;
    r.grad_entropy = -o.entropy_coef * t.weight;
  }
  return r;
}

}  // namespace xent::common
