// linear_policy (docs/semantics.md §7 "Fused with the LM head"): loss, ℓ, H, the statistic sums
// and ∂h, ∂W, ∂b of the three-product op against the float64 reference, for each loss type and
// option, dtype and chunk budget. The per-token coefficients of the reference come from
// common/policy_row.hpp in float64 (tests/python/test_linear_policy_loss.py holds that math to the
// Python formulas); the row statistics and ∂ℓ/∂x, ∂H/∂x are the reference's own.
#include <algorithm>
#include <cmath>

#include "common/policy_row.hpp"
#include "linear_check.hpp"

namespace xent::test {
namespace {

enum PolicyOption : unsigned {
  kDualClip = 1u << 0,
  kKl = 1u << 1,
  kEntropy = 1u << 2,
  kRollout = 1u << 3,
  kOnPolicy = 1u << 4,  // no old logprobs: ratio 1
  kSoftcap = 1u << 5,
};
constexpr unsigned kPolicyOptionCount = 6;
const char* const kPolicyOptionNames[] = {"dual", "kl", "entropy", "tis", "onpolicy", "softcap"};

struct LinearPolicyProblem {
  DType dtype = DType::f32;
  PolicyLossType type = PolicyLossType::clipped_surrogate;
  KlEstimator kl = KlEstimator::k3;
  unsigned options = 0;
  int64_t rows = 37, hidden = 67, vocab = 1031;
  Budget budget = Budget::default_budget;
  bool bias = true;
};

// A ratio in [0.5, 2] whose log is more than `margin` from the log of each bound of the problem,
// so an error of the op's ℓ within the margin never moves a token across a clip boundary (where
// c_ℓ jumps).
double ratio_away_from_bounds(Rng& rng, double margin) {
  for (;;) {
    const double r = rng.uniform(0.5, 2.0);
    bool clear = true;
    for (const double bound : {0.8, 1.25, 1.5})
      clear = clear && std::abs(std::log(r / bound)) > margin;
    if (clear) return r;
  }
}

// How far the op's ℓ of row n may be from the float64 one: 0.02, plus, for logits held in a 16-bit
// type, each logit rounded (at most 2u·|x|: the op's fp32 product may round to the other
// neighbour) moving ℓ = x̃_y − lse by at most the transform's slope (≤ logit_scale) times
// 2u·(|x_y| + Σ_j p_j·|x_j|).
double logprob_margin(const Matrix& logits, const reference::CeSpec& spec, double lse, int64_t n,
                      int64_t target, DType dtype) {
  if (!is_half(dtype)) return 0.02;
  double mean_magnitude = 0;
  for (int64_t j = 0; j < logits.cols; ++j) {
    const double x = logits.at(n, j);
    mean_magnitude += std::exp(ce_transformed(spec, x) - lse) * std::abs(x);
  }
  const double moved = std::abs(logits.at(n, target)) + mean_magnitude;
  return 0.02 + spec.logit_scale * 2 * unit_roundoff(dtype) * moved;
}

struct Expected {
  double loss = 0;
  std::vector<double> stats = std::vector<double>(4, 0.0);
  // The same sums of magnitudes: signed advantages (and k1) cancel in the sums, so their
  // rounding error scales with these, not with the net values.
  double loss_magnitude = 0;
  std::vector<double> stats_magnitude = std::vector<double>(4, 0.0);
  reference::CeResult ce;
  reference::LinearGrads grads;
};

// The op's results from float64 logits and statistics `ce` (the reference, or PyTorch's rounded
// ones for the error model).
Expected expected(const Matrix& logits, const reference::CeResult& ce,
                  const std::vector<int64_t>& target, const reference::CeSpec& spec,
                  const common::PolicyOptions<double>& o, const std::vector<double> data[5],
                  const LinearLayer& layer, DType dtype, bool rounded_grads) {
  const int64_t rows = logits.rows;
  Expected e;
  e.ce = ce;
  reference::Upstream upstream{true, std::vector<double>(rows, 0.0)};
  std::vector<double> grad_entropy(rows, 0.0);
  for (int64_t n = 0; n < rows; ++n) {
    if (target[n] == spec.ignore_index) continue;
    common::PolicyToken<double> t{ce.logprob[n], ce.entropy[n], data[0][n], data[1][n],
                                  data[2][n],    data[3][n],    data[4][n]};
    const auto r = common::policy_token(o, t);
    e.loss += r.loss;
    e.loss_magnitude += std::abs(r.loss);
    e.stats_magnitude[2] += std::abs(r.kl);
    e.stats_magnitude[3] += std::abs(r.ratio);
    e.stats[0] += r.clipped_low ? 1 : 0;
    e.stats[1] += r.clipped_high ? 1 : 0;
    e.stats[2] += r.kl;
    e.stats[3] += r.ratio;
    upstream.values[n] = -r.grad_logprob;  // ∂ℓ/∂x = −∂ce/∂x
    grad_entropy[n] = r.grad_entropy;
  }
  Matrix grad = reference::ce(logits, target, spec, upstream).grad;
  const Matrix entropy_grad = reference::entropy_grad(logits, target, spec, grad_entropy);
  for (std::size_t i = 0; i < grad.values.size(); ++i) grad.values[i] += entropy_grad.values[i];
  e.grads = rounded_grads ? rounded_linear_backward(grad, layer, dtype, dtype)
                          : reference::linear_backward(grad, layer.hidden, layer.weight);
  return e;
}

void check_linear_policy(const LinearPolicyProblem& p, Rng& rng) {
  const int64_t rows = p.rows, vocab = p.vocab;
  const LinearLayer layer = make_linear_layer(rng, rows, p.hidden, vocab, p.bias, 2.0, p.dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  reference::CeSpec spec;
  spec.reduction = Reduction::none;
  spec.logit_scale = 1.25;  // a temperature of 0.8
  if (p.options & kSoftcap) spec.softcap = 6.0;
  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const reference::Upstream none{false, {}};
  const reference::CeResult ref_ce = reference::ce(logits, target, spec, none);

  LinearPolicyOptions options;
  options.policy.type = p.type;
  options.policy.clip_low = 0.2;
  options.policy.clip_high = 0.25;  // clip-higher
  if (p.options & kDualClip) options.policy.dual_clip = 1.5;
  options.policy.kl_estimator = p.kl;
  if (p.options & kKl) options.policy.kl_coef = 0.05;
  if (p.options & kEntropy) options.policy.entropy_coef = 0.01;
  if (p.options & kRollout) options.policy.tis_cap = 1.1;
  options.ignore_index = -100;
  options.logit_scale = spec.logit_scale;
  if (p.options & kSoftcap) options.softcap = spec.softcap;

  // advantages, old, ref, rollout, g: data around the reference's ℓ so ratios spread over the
  // clip bounds; g as token_mean's 1/N_valid times a random factor (any aggregation's shape).
  std::vector<double> data[5];
  for (auto& d : data) d.assign(rows, 0.0);
  int64_t valid = 0;
  for (int64_t n = 0; n < rows; ++n) valid += target[n] != -100;
  for (int64_t n = 0; n < rows; ++n) {
    const bool ok = target[n] != -100;
    data[0][n] = rng.normal();
    const double margin =
        ok ? logprob_margin(logits, spec, ref_ce.lse[n], n, target[n], p.dtype) : 0.0;
    data[1][n] = ok ? ref_ce.logprob[n] - std::log(ratio_away_from_bounds(rng, margin)) : -INFINITY;
    data[2][n] = ok ? ref_ce.logprob[n] + rng.normal(0.3) : -INFINITY;
    data[3][n] = ok ? data[1][n] + rng.normal(0.1) : -INFINITY;
    data[4][n] = ok ? rng.uniform(0.5, 1.5) / static_cast<double>(valid) : 0.0;
  }
  const DType stat = result_dtype(p.dtype);
  for (auto& d : data) d = rounded(d, stat);
  common::PolicyOptions<double> o;
  o.term = p.type == PolicyLossType::cispo  ? common::PolicyTerm::cispo
           : p.type == PolicyLossType::sapo ? common::PolicyTerm::sapo
                                            : common::PolicyTerm::surrogate;
  o.low = 1 - options.policy.clip_low;
  o.high = 1 + options.policy.clip_high;
  o.dual_clip = options.policy.dual_clip;
  o.tis_cap = options.policy.tis_cap;
  o.kl = p.kl == KlEstimator::k1   ? common::KlEstimator::k1
         : p.kl == KlEstimator::k2 ? common::KlEstimator::k2
                                   : common::KlEstimator::k3;
  o.kl_coef = options.policy.kl_coef;
  o.entropy_coef = options.policy.entropy_coef;
  o.has_old = !(p.options & kOnPolicy);
  o.has_ref = (p.options & kKl) != 0;
  o.has_rollout = (p.options & kRollout) != 0;

  const Expected ref = expected(logits, ref_ce, target, spec, o, data, layer, p.dtype, false);
  // PyTorch at this dtype rounds the logits to it before the loss.
  const bool half = is_half(p.dtype);
  const Matrix torch_logits = half ? rounded(logits, p.dtype) : logits;
  const Expected torch =
      half ? expected(torch_logits, reference::ce(torch_logits, target, spec, none), target, spec,
                      o, data, layer, p.dtype, true)
           : ref;

  const Tensor hidden = Tensor::of(layer.hidden, p.dtype);
  const Tensor weight = Tensor::of(layer.weight, p.dtype);
  const Tensor bias = p.bias ? Tensor::of(layer.bias, p.dtype) : Tensor();
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor advantages = Tensor::of(data[0], stat);
  const Tensor old = o.has_old ? Tensor::of(data[1], stat) : Tensor();
  const Tensor ref_lp = o.has_ref ? Tensor::of(data[2], stat) : Tensor();
  const Tensor rollout = o.has_rollout ? Tensor::of(data[3], stat) : Tensor();
  const Tensor g = Tensor::of(data[4], stat);
  const PolicyTokens tokens{advantages.view(), old.view(), ref_lp.view(), rollout.view(), g.view()};

  auto run = [&](const LinearPolicyOptions& trial, Tensor& loss, Tensor& logprob, Tensor& entropy,
                 Tensor& stats, Tensor& gh, Tensor& gw, Tensor& gb) {
    LinearPolicyOutputs out;
    out.loss = loss.view();
    out.logprob = logprob.view();
    out.entropy = entropy.view();
    out.stats = stats.view();
    out.grads = {gh.view(), gw.view(), gb.view()};
    // The CPU allocates its own; CUDA takes the caller's workspace.
    const Scratch scratch(on_gpu() ? linear_policy_workspace_size(rows, p.hidden, vocab, p.dtype,
                                                                  trial, test_device(), true)
                                   : 0);
    linear_policy_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), tokens,
                          trial, out, scratch.workspace());
    finish();
  };
  Tensor loss = Tensor::scalar(stat), logprob = Tensor::vector(stat, rows),
         entropy = Tensor::vector(stat, rows), stats = Tensor::vector(stat, 4),
         gh = Tensor::matrix(p.dtype, rows, p.hidden),
         gw = Tensor::matrix(p.dtype, vocab, p.hidden),
         gb = p.bias ? Tensor::vector(p.dtype, vocab) : Tensor();
  options.workspace_budget = budget_bytes(p.budget, [&](std::size_t bytes) {
    LinearPolicyOptions trial = options;
    trial.workspace_budget = bytes;
    try {
      run(trial, loss, logprob, entropy, stats, gh, gw, gb);
    } catch (const Error& e) {
      if (std::string(e.what()).find("workspace_budget") != std::string::npos) return false;
      throw;
    }
    return true;
  });
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget);
  for (Tensor* t : {&loss, &logprob, &entropy, &stats, &gh, &gw, &gb}) {
    if (t->present()) t->poison();
  }
  run(options, loss, logprob, entropy, stats, gh, gw, gb);

  // A sum's error against the sum of its terms' magnitudes, at the statistics' tolerance.
  auto check_sum = [&](const char* what, double got, double want, double torch_value,
                       double magnitude) {
    const double tol = stat_tolerance(p.dtype, Family::linear, {torch_value}, {want});
    EXPECT_LE(std::abs(got - want), tol * std::max(magnitude, 1e-30))
        << what << ": got " << got << ", want " << want;
  };
  check_sum("loss", loss.download()[0], ref.loss, torch.loss, ref.loss_magnitude);
  EXPECT_TRUE(close("logprob", logprob.download(), ref_ce.logprob,
                    stat_tolerance(p.dtype, Family::linear, torch.ce.logprob, ref_ce.logprob)));
  EXPECT_TRUE(close("entropy", entropy.download(), ref_ce.entropy,
                    stat_tolerance(p.dtype, Family::linear, torch.ce.entropy, ref_ce.entropy)));
  const std::vector<double> got_stats = stats.download();
  EXPECT_EQ(got_stats[0], ref.stats[0]) << "clip-low count";
  EXPECT_EQ(got_stats[1], ref.stats[1]) << "clip-high count";
  check_sum("KL sum", got_stats[2], ref.stats[2], torch.stats[2], ref.stats_magnitude[2]);
  check_sum("ratio sum", got_stats[3], ref.stats[3], torch.stats[3], ref.stats_magnitude[3]);
  EXPECT_TRUE(close(
      "grads.hidden", gh.download(), ref.grads.hidden.values,
      grad_tolerance(p.dtype, Family::linear, torch.grads.hidden.values, ref.grads.hidden.values)));
  EXPECT_TRUE(close(
      "grads.weight", gw.download(), ref.grads.weight.values,
      grad_tolerance(p.dtype, Family::linear, torch.grads.weight.values, ref.grads.weight.values)));
  if (p.bias) {
    EXPECT_TRUE(close("grads.bias", gb.download(), ref.grads.bias,
                      grad_tolerance(p.dtype, Family::linear, torch.grads.bias, ref.grads.bias)));
  }
}

using PolicyParam = std::tuple<DType, PolicyLossType, unsigned>;

// Both backends; float64 on the CPU only.
template <class Param>
class OnDevice : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    require_device();
    if (on_gpu() && std::get<0>(this->GetParam()) == DType::f64) {
      GTEST_SKIP() << "float64 runs on the CPU only";
    }
  }
};

class LinearPolicyGrid : public OnDevice<PolicyParam> {};

TEST_P(LinearPolicyGrid, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearPolicyProblem p;
  std::tie(p.dtype, p.type, p.options) = GetParam();
  if ((p.options & kDualClip) && p.type != PolicyLossType::clipped_surrogate) GTEST_SKIP();
  check_linear_policy(p, rng);
}

std::string type_label(PolicyLossType type) {
  return type == PolicyLossType::cispo ? "cispo" : type == PolicyLossType::sapo ? "sapo" : "clip";
}

std::string grid_name(const ::testing::TestParamInfo<PolicyParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + type_label(std::get<1>(info.param)) + "_" +
         options_label(std::get<2>(info.param), kPolicyOptionNames, kPolicyOptionCount);
}

INSTANTIATE_TEST_SUITE_P(
    OptionsUpToPairs, LinearPolicyGrid,
    ::testing::Combine(::testing::Values(DType::f32),
                       ::testing::Values(PolicyLossType::clipped_surrogate, PolicyLossType::cispo,
                                         PolicyLossType::sapo),
                       ::testing::ValuesIn(option_sets_up_to_pairs(kPolicyOptionCount))),
    grid_name);

INSTANTIATE_TEST_SUITE_P(
    OtherDtypes, LinearPolicyGrid,
    ::testing::Combine(::testing::Values(DType::bf16, DType::f16, DType::f64),
                       ::testing::Values(PolicyLossType::clipped_surrogate, PolicyLossType::cispo,
                                         PolicyLossType::sapo),
                       ::testing::Values(0u, kDualClip | kKl | kEntropy | kRollout)),
    grid_name);

// Budgets (one chunk, several, uneven) and the KL estimators, on the recipe: clip-higher,
// KL, an entropy bonus.
using BudgetParam = std::tuple<DType, Budget, KlEstimator>;
class LinearPolicyBudgets : public OnDevice<BudgetParam> {};

TEST_P(LinearPolicyBudgets, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearPolicyProblem p;
  KlEstimator kl;
  std::tie(p.dtype, p.budget, kl) = GetParam();
  p.kl = kl;
  p.options = kKl | kEntropy;
  p.bias = p.budget != Budget::uneven_chunks;
  check_linear_policy(p, rng);
}

INSTANTIATE_TEST_SUITE_P(
    Budgets, LinearPolicyBudgets,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                       ::testing::Values(Budget::smallest, Budget::several_chunks,
                                         Budget::uneven_chunks),
                       ::testing::Values(KlEstimator::k1, KlEstimator::k2, KlEstimator::k3)),
    [](const ::testing::TestParamInfo<BudgetParam>& info) {
      const KlEstimator kl = std::get<2>(info.param);
      return short_name(std::get<0>(info.param)) + "_" + budget_name(std::get<1>(info.param)) +
             (kl == KlEstimator::k1   ? "_k1"
              : kl == KlEstimator::k2 ? "_k2"
                                      : "_k3");
    });

TEST(LinearPolicyErrors, RejectsBadArguments) {
  require_device();
  Rng rng(1);
  const Tensor h = Tensor::of(rng.matrix(3, 4, 1.0), DType::f32);
  const Tensor w = Tensor::of(rng.matrix(5, 4, 1.0), DType::f32);
  const Tensor target = Tensor::of_integers({0, 1, 2}, DType::i64);
  const Tensor adv = Tensor::of(std::vector<double>{1, 2, 3}, DType::f32);
  const Tensor g = Tensor::of(std::vector<double>{1, 1, 1}, DType::f32);
  const Tensor short_g = Tensor::of(std::vector<double>{1, 1}, DType::f32);
  const Tensor rollout = Tensor::of(std::vector<double>{0, 0, 0}, DType::f32);
  Tensor loss = Tensor::scalar(DType::f32);
  LinearPolicyOutputs out;
  out.loss = loss.view();
  auto call = [&](const PolicyTokens& tokens, const LinearPolicyOptions& options) {
    return [&, tokens, options] {
      const Scratch scratch(on_gpu() ? linear_policy_workspace_size(3, 4, 5, DType::f32, options,
                                                                    test_device(), false)
                                     : 0);
      linear_policy_forward(h.view(), w.view(), {}, target.view(), tokens, options, out,
                            scratch.workspace());
    };
  };
  const PolicyTokens good{adv.view(), {}, {}, {}, g.view()};
  LinearPolicyOptions options;
  expect_invalid(call({adv.view(), {}, {}, {}, short_g.view()}, options), "token_weight", "[2]");
  expect_invalid(call({adv.view(), {}, {}, {}, {}}, options), "token_weight", "absent");
  LinearPolicyOptions bad = options;
  bad.policy.dual_clip = 0.5;
  expect_invalid(call(good, bad), "dual_clip", "0.5");
  bad = options;
  bad.policy.type = PolicyLossType::sapo;
  bad.policy.dual_clip = 2;
  expect_invalid(call(good, bad), "dual_clip", "2");
  expect_invalid(call({adv.view(), {}, {}, rollout.view(), g.view()}, options), "tis_cap", "0");
  bad = options;
  bad.policy.clip_low = 1.0;
  expect_invalid(call(good, bad), "clip_low", "1");
}

}  // namespace
}  // namespace xent::test
