// The per-token policy math of src/common/policy_row.hpp (docs/semantics.md §7): the coefficients
// c_ℓ and c_H against central differences of the token's loss in float64, and the clip counts and
// statistics at ratios on either side of the bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "common/policy_row.hpp"

namespace {

using xent::common::KlEstimator;
using xent::common::policy_token;
using xent::common::PolicyOptions;
using xent::common::PolicyTerm;
using xent::common::PolicyToken;

// The token's loss with ℓ_old held fixed at its value at ℓ (the on-policy case's stopped ℓ_old).
double loss_at(PolicyOptions<double> o, PolicyToken<double> t, double logprob, double entropy) {
  if (!o.has_old) o.has_old = true, t.old = t.logprob;
  t.logprob = logprob, t.entropy = entropy;
  return policy_token(o, t).loss;
}

// Random tokens away from the kinks of the clip (|ρ − bound| > 1e-3) so differences are smooth.
void check_against_differences(PolicyOptions<double> o, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> unit(-1, 1);
  int checked = 0;
  for (int i = 0; i < 400; ++i) {
    PolicyToken<double> t{};
    t.logprob = -2 + unit(rng), t.entropy = 2 + unit(rng), t.advantage = unit(rng);
    t.old = t.logprob + 0.4 * unit(rng), t.ref = t.logprob + 0.5 * unit(rng);
    t.rollout = t.old + 0.3 * unit(rng), t.weight = 0.5 + 0.5 * unit(rng);
    const double ratio = o.has_old ? std::exp(t.logprob - t.old) : 1.0;
    const double near = std::fmin(std::fabs(ratio - o.low), std::fabs(ratio - o.high));
    if (near < 1e-3 || (o.dual_clip > 0 && std::fabs(ratio - o.dual_clip) < 1e-3)) continue;
    const auto r = policy_token(o, t);
    const double h = 1e-6;
    const double d_logprob =
        (loss_at(o, t, t.logprob + h, t.entropy) - loss_at(o, t, t.logprob - h, t.entropy)) /
        (2 * h);
    const double d_entropy =
        (loss_at(o, t, t.logprob, t.entropy + h) - loss_at(o, t, t.logprob, t.entropy - h)) /
        (2 * h);
    EXPECT_NEAR(r.grad_logprob, d_logprob, 1e-7 * (1 + std::fabs(d_logprob))) << "token " << i;
    EXPECT_NEAR(r.grad_entropy, d_entropy, 1e-7 * (1 + std::fabs(d_entropy))) << "token " << i;
    EXPECT_NEAR(r.ratio, ratio, 1e-15 * ratio);
    ++checked;
  }
  EXPECT_GT(checked, 300);
}

PolicyOptions<double> options(PolicyTerm term) {
  PolicyOptions<double> o;
  o.term = term, o.low = 0.8, o.high = 1.28, o.has_old = true;
  return o;
}

TEST(PolicyRow, SurrogateGradientMatchesDifferences) {
  for (const auto kl : {KlEstimator::k1, KlEstimator::k2, KlEstimator::k3}) {
    auto o = options(PolicyTerm::surrogate);
    o.has_ref = true, o.kl = kl, o.kl_coef = 0.05, o.entropy_coef = 0.01;
    check_against_differences(o, 1);
    o.dual_clip = 1.1;  // inside the sampled ratios, so the dual branch is taken
    check_against_differences(o, 2);
    o.has_rollout = true, o.tis_cap = 1.1;
    check_against_differences(o, 3);
  }
  auto on_policy = options(PolicyTerm::surrogate);
  on_policy.has_old = false, on_policy.entropy_coef = 0.02;
  check_against_differences(on_policy, 4);
}

TEST(PolicyRow, SapoGradientMatchesDifferences) {
  auto o = options(PolicyTerm::sapo);
  o.has_ref = true, o.kl_coef = 0.1, o.entropy_coef = 0.01;
  check_against_differences(o, 5);
  o.has_rollout = true, o.tis_cap = 2;
  check_against_differences(o, 6);
}

// CISPO's clipped ratio is a stopped weight: c_ℓ = −g·w·clip(r)·A (+ the KL part), not ∂L/∂ℓ.
TEST(PolicyRow, CispoStopsTheWeight) {
  auto o = options(PolicyTerm::cispo);
  o.low = 0, o.high = 1.2;
  for (const double lr : {-0.5, 0.0, 0.3}) {
    PolicyToken<double> t{-1.5, 2.0, -0.7, -1.5 - lr, 0, 0, 0.25};
    const auto r = policy_token(o, t);
    const double ratio = std::exp(lr), weight = std::fmin(ratio, 1.2);
    EXPECT_DOUBLE_EQ(r.grad_logprob, 0.25 * -weight * -0.7);
    EXPECT_DOUBLE_EQ(r.loss, 0.25 * -weight * -0.7 * -1.5);
    EXPECT_EQ(r.clipped_high, ratio > 1.2);
    EXPECT_FALSE(r.clipped_low);
  }
}

TEST(PolicyRow, ClipCounts) {
  auto o = options(PolicyTerm::surrogate);
  struct Case {
    double log_ratio, advantage;
    bool low, high;
  } cases[] = {{-0.5, -1, true, false},
               {-0.5, 1, false, false},
               {0.5, 1, false, true},
               {0.5, -1, false, false},
               {0.0, 1, false, false}};
  for (const auto& c : cases) {
    PolicyToken<double> t{-1, 1, c.advantage, -1 - c.log_ratio, 0, 0, 1};
    const auto r = policy_token(o, t);
    EXPECT_EQ(r.clipped_low, c.low) << c.log_ratio << " " << c.advantage;
    EXPECT_EQ(r.clipped_high, c.high) << c.log_ratio << " " << c.advantage;
  }
  o.dual_clip = 1.5;  // A < 0 and ρ > c: counted high, the term bounded at −c·A, no gradient
  PolicyToken<double> t{-1, 1, -2, -1 - std::log(2.0), 0, 0, 1};
  const auto r = policy_token(o, t);
  EXPECT_TRUE(r.clipped_high);
  EXPECT_DOUBLE_EQ(r.loss, 3.0);
  EXPECT_DOUBLE_EQ(r.grad_logprob, 0.0);
}

// GSPO: the token returns g·w·∂P/∂ρ at its sequence's ratio for the caller's sequence sum.
TEST(PolicyRow, GspoLeavesTheSequenceSum) {
  auto o = options(PolicyTerm::gspo);
  PolicyToken<double> t{-1, 1, 0.5, -1.2, 0, 0, 0.5};
  const auto r = policy_token(o, t, 1.1);
  EXPECT_DOUBLE_EQ(r.ratio, 1.1);
  EXPECT_DOUBLE_EQ(r.policy_grad, 0.5 * -0.5);
  EXPECT_DOUBLE_EQ(r.grad_logprob, 0.0);
  EXPECT_DOUBLE_EQ(r.loss, 0.5 * -(1.1 * 0.5));
}

}  // namespace
