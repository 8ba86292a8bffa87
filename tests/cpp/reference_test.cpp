// The float64 reference checked against itself: its analytic gradients against central finite
// differences of its own loss, for every option, reduction and distillation kind, plus a few
// closed forms. Everything else in the suite trusts these gradients.
#include <cmath>

#include "support.hpp"

namespace xent::test {
namespace {

using reference::CeSpec;
using reference::DistillSpec;
using reference::Upstream;

constexpr double kStep = 1e-5;

// J = Σ_k g_k·loss_k, whose gradient the reference gives with upstream g.
double weighted_total(const std::vector<double>& loss, const Upstream& upstream) {
  double total = 0.0;
  for (std::size_t k = 0; k < loss.size(); ++k)
    total +=
        loss[k] * (upstream.values.size() == loss.size() ? upstream.values[k] : upstream.values[0]);
  return total;
}

// Central differences of `objective` over every element of `values`, compared with `analytic`.
// A `kinked` objective (tvd: |p_s − p_t| has a kink where p_s = p_t) may cross a kink inside the
// step: the central difference then misses the one-sided slope by the slope's jump times the share
// of the step past the kink, which is |up + down − 2·f(x)| / (2·step) for a straight crossing; that
// amount is added to the bound, with 1 % for the curvature of p_s − p_t across the step (a relative
// step·|φ''/φ'|, about 1e-4 at these logits). A smooth objective keeps the plain bound.
void expect_matches_differences(std::vector<double>& values, const std::vector<double>& analytic,
                                const std::function<double()>& objective, const char* what,
                                bool kinked = false) {
  ASSERT_EQ(values.size(), analytic.size()) << what;
  double scale = 1e-3;
  for (double g : analytic) scale = std::max(scale, std::abs(g));
  const double at = kinked ? objective() : 0.0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double saved = values[i];
    values[i] = saved + kStep;
    const double up = objective();
    values[i] = saved - kStep;
    const double down = objective();
    values[i] = saved;
    const double numeric = (up - down) / (2 * kStep);
    const double kink = kinked ? 1.01 * std::abs(up + down - 2 * at) / (2 * kStep) : 0.0;
    ASSERT_NEAR(analytic[i], numeric, 1e-6 * scale + kink) << what << " element " << i;
  }
}

Upstream random_upstream(Rng& rng, Reduction reduction, int64_t rows) {
  Upstream upstream{true, {}};
  const int64_t count = reduction == Reduction::none ? rows : 1;
  for (int64_t k = 0; k < count; ++k) upstream.values.push_back(rng.uniform(-2.0, 2.0));
  return upstream;
}

// ---- cross-entropy ----------------------------------------------------------------------------

enum CeOption : unsigned {
  kSmoothing = 1,
  kZLoss = 2,
  kSoftcap = 4,
  kScale = 8,
  kClassWeight = 16,
  kRowWeight = 32,
  kAllCeOptions = 63
};

CeSpec ce_spec(Rng& rng, unsigned options, Reduction reduction, int64_t rows, int64_t vocab) {
  CeSpec spec;
  spec.reduction = reduction;
  if (options & kSmoothing) spec.label_smoothing = 0.2;
  if (options & kZLoss) spec.z_loss = 0.3;
  if (options & kSoftcap) spec.softcap = 2.5;  // small, so the tanh really bends
  if (options & kScale) spec.logit_scale = 0.7;
  if (options & kClassWeight) spec.class_weight = rng.uniform_vector(vocab, 0.2, 2.0);
  if (options & kRowWeight) spec.row_weight = rng.uniform_vector(rows, -1.0, 2.0);
  return spec;
}

using CeParam = std::tuple<unsigned, Reduction>;
class ReferenceCeGradient : public ::testing::TestWithParam<CeParam> {};

TEST_P(ReferenceCeGradient, MatchesFiniteDifferences) {
  XENT_TEST_RNG(rng);
  const auto [options, reduction] = GetParam();
  const int64_t rows = 4, vocab = 7;
  Matrix logits = rng.matrix(rows, vocab, 2.0);
  const std::vector<int64_t> target = {3, -100, 0, 6};
  const CeSpec spec = ce_spec(rng, options, reduction, rows, vocab);
  const Upstream upstream = random_upstream(rng, reduction, rows);
  const auto result = reference::ce(logits, target, spec, upstream);
  expect_matches_differences(
      logits.values, result.grad.values,
      [&] { return weighted_total(reference::ce(logits, target, spec, {}).loss, upstream); },
      "logits");
}

std::string ce_param_name(const ::testing::TestParamInfo<CeParam>& info) {
  return "options" + std::to_string(std::get<0>(info.param)) + "_" +
         reduction_label(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    EachOption, ReferenceCeGradient,
    ::testing::Combine(::testing::Values(0u, kSmoothing, kZLoss, kSoftcap, kScale, kClassWeight,
                                         kRowWeight, kAllCeOptions, kSmoothing | kClassWeight),
                       ::testing::Values(Reduction::none, Reduction::sum, Reduction::mean)),
    ce_param_name);

// The entropy term (semantics §1, differentiable log-probability and entropy): its analytic
// gradient against differences of Σ_valid g_H,n·H_n, through scale and softcap.
class ReferenceEntropyGradient : public ::testing::TestWithParam<unsigned> {};

TEST_P(ReferenceEntropyGradient, MatchesFiniteDifferences) {
  XENT_TEST_RNG(rng);
  const int64_t rows = 4, vocab = 7;
  Matrix logits = rng.matrix(rows, vocab, 2.0);
  const std::vector<int64_t> target = {3, -100, 0, 6};
  const CeSpec spec = ce_spec(rng, GetParam(), Reduction::none, rows, vocab);
  const std::vector<double> grad_entropy = rng.uniform_vector(rows, -2.0, 2.0);
  const auto analytic = reference::entropy_grad(logits, target, spec, grad_entropy);
  for (int64_t i = 0; i < vocab; ++i) EXPECT_EQ(analytic.at(1, i), 0.0);
  expect_matches_differences(
      logits.values, analytic.values,
      [&] {
        const auto entropy = reference::ce(logits, target, spec, {}).entropy;
        double total = 0.0;
        for (int64_t n = 0; n < rows; ++n) {
          if (target[n] != spec.ignore_index) total += grad_entropy[n] * entropy[n];
        }
        return total;
      },
      "logits");
}

INSTANTIATE_TEST_SUITE_P(Transforms, ReferenceEntropyGradient,
                         ::testing::Values(0u, kSoftcap, kScale, kSoftcap | kScale));

TEST(ReferenceCe, UniformLogitsGiveLogV) {
  const Matrix logits(3, 11);
  const auto result = reference::ce(logits, {0, 5, 10}, CeSpec{}, {});
  EXPECT_NEAR(result.loss[0], std::log(11.0), 1e-14);
  EXPECT_NEAR(result.entropy[1], std::log(11.0), 1e-14);
}

TEST(ReferenceCe, FullSmoothingIsTheMeanOverClasses) {
  Matrix logits(1, 3);
  logits.values = {1.0, 2.0, 4.0};
  CeSpec spec;
  spec.label_smoothing = 1.0;
  const auto result = reference::ce(logits, {0}, spec, {});
  const double lse = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(4.0));
  EXPECT_NEAR(result.loss[0], lse - 7.0 / 3.0, 1e-14);
  EXPECT_NEAR(result.logprob[0], 1.0 - lse, 1e-14);
}

TEST(ReferenceCe, MeanOverNothingIsZero) {
  const Matrix logits(2, 4);
  const auto result = reference::ce(logits, {-100, -100}, CeSpec{}, {true, {}});
  EXPECT_EQ(result.loss[0], 0.0);
  for (double g : result.grad.values) EXPECT_EQ(g, 0.0);
}

// ---- distillation -----------------------------------------------------------------------------

enum DistillVariant : int { kPlain, kTemperature, kDistillSoftcap, kHardAndSoft, kNoTarget, kBeta };

using DistillParam = std::tuple<DistillKind, int, Reduction>;
class ReferenceDistillGradient : public ::testing::TestWithParam<DistillParam> {};

DistillSpec distill_spec(DistillKind kind, int variant, Reduction reduction) {
  DistillSpec spec;
  spec.kind = kind;
  spec.ce.reduction = reduction;
  if (variant == kTemperature) spec.temperature = 1.7;
  if (variant == kDistillSoftcap) spec.softcap = 2.0;
  if (variant == kHardAndSoft) {
    spec.hard_weight = 0.4;
    spec.soft_weight = 0.6;
    spec.ce.label_smoothing = 0.1;
    spec.ce.z_loss = 0.05;
  }
  if (variant == kBeta) spec.beta = 0.3;
  return spec;
}

TEST_P(ReferenceDistillGradient, MatchesFiniteDifferences) {
  XENT_TEST_RNG(rng);
  const auto [kind, variant, reduction] = GetParam();
  const int64_t rows = 4, vocab = 6;
  Matrix student = rng.matrix(rows, vocab, 1.5);
  const Matrix teacher = rng.matrix(rows, vocab, 1.5);
  const std::vector<int64_t> target = {2, -100, 5, 0};
  const std::vector<int64_t>* target_or_null = variant == kNoTarget ? nullptr : &target;
  const DistillSpec spec = distill_spec(kind, variant, reduction);
  const Upstream upstream = random_upstream(rng, reduction, rows);
  const auto result = reference::distill(student, teacher, target_or_null, spec, upstream);
  expect_matches_differences(
      student.values, result.grad.values,
      [&] {
        return weighted_total(reference::distill(student, teacher, target_or_null, spec, {}).loss,
                              upstream);
      },
      "student", kind == DistillKind::tvd);
}

std::string distill_param_name(const ::testing::TestParamInfo<DistillParam>& info) {
  static const char* variants[] = {"plain",     "temperature", "softcap",
                                   "hard_soft", "no_target",   "beta"};
  return std::string(distill_kind_name(std::get<0>(info.param))) + "_" +
         variants[std::get<1>(info.param)] + "_" + reduction_label(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    EachKind, ReferenceDistillGradient,
    ::testing::Combine(::testing::Values(DistillKind::forward_kl, DistillKind::reverse_kl,
                                         DistillKind::jsd, DistillKind::soft_ce, DistillKind::tvd),
                       ::testing::Values(kPlain, kTemperature, kDistillSoftcap, kHardAndSoft,
                                         kNoTarget, kBeta),
                       ::testing::Values(Reduction::none, Reduction::sum, Reduction::mean)),
    distill_param_name);

TEST(ReferenceDistill, IdenticalDistributionsGiveZero) {
  XENT_TEST_RNG(rng);
  const Matrix logits = rng.matrix(3, 9, 2.0);
  for (DistillKind kind :
       {DistillKind::forward_kl, DistillKind::reverse_kl, DistillKind::jsd, DistillKind::tvd}) {
    DistillSpec spec;
    spec.kind = kind;
    EXPECT_NEAR(reference::distill(logits, logits, nullptr, spec, {}).loss[0], 0.0, 1e-14);
  }
}

TEST(ReferenceDistill, JsdAtBetaZeroAndOneIsExactlyZero) {
  XENT_TEST_RNG(rng);
  const Matrix student = rng.matrix(3, 9, 2.0), teacher = rng.matrix(3, 9, 2.0);
  for (double beta : {0.0, 1.0}) {
    DistillSpec spec;
    spec.kind = DistillKind::jsd;
    spec.beta = beta;
    const auto result = reference::distill(student, teacher, nullptr, spec, {true, {}});
    EXPECT_EQ(result.loss[0], 0.0);
    for (double g : result.grad.values) EXPECT_EQ(g, 0.0);
  }
}

TEST(ReferenceDistill, SoftCeIsForwardKlPlusTeacherEntropy) {
  XENT_TEST_RNG(rng);
  const Matrix student = rng.matrix(1, 8, 2.0), teacher = rng.matrix(1, 8, 2.0);
  DistillSpec spec;
  const double kl = reference::distill(student, teacher, nullptr, spec, {}).loss[0];
  spec.kind = DistillKind::soft_ce;
  const double soft_ce = reference::distill(student, teacher, nullptr, spec, {}).loss[0];
  const double entropy = reference::ce(teacher, {0}, CeSpec{}, {}).entropy[0];
  EXPECT_NEAR(soft_ce, kl + entropy, 1e-13);
}

// ---- linear forms -----------------------------------------------------------------------------

class ReferenceLinearCeGradient : public ::testing::TestWithParam<CeParam> {};

TEST_P(ReferenceLinearCeGradient, MatchesFiniteDifferences) {
  XENT_TEST_RNG(rng);
  const auto [options, reduction] = GetParam();
  const int64_t rows = 3, hidden_size = 4, vocab = 5;
  Matrix hidden = rng.matrix(rows, hidden_size, 1.0), weight = rng.matrix(vocab, hidden_size, 1.0);
  std::vector<double> bias = rng.uniform_vector(vocab, -1.0, 1.0);
  const std::vector<int64_t> target = {4, 0, -100};
  const CeSpec spec = ce_spec(rng, options, reduction, rows, vocab);
  const Upstream upstream = random_upstream(rng, reduction, rows);
  const auto result = reference::linear_ce(hidden, weight, bias, target, spec, upstream);
  const auto objective = [&] {
    return weighted_total(reference::linear_ce(hidden, weight, bias, target, spec, {}).ce.loss,
                          upstream);
  };
  expect_matches_differences(hidden.values, result.grads.hidden.values, objective, "hidden");
  expect_matches_differences(weight.values, result.grads.weight.values, objective, "weight");
  expect_matches_differences(bias, result.grads.bias, objective, "bias");
}

INSTANTIATE_TEST_SUITE_P(EachOption, ReferenceLinearCeGradient,
                         ::testing::Combine(::testing::Values(0u, kAllCeOptions),
                                            ::testing::Values(Reduction::none, Reduction::sum,
                                                              Reduction::mean)),
                         ce_param_name);

class ReferenceLinearDistillGradient : public ::testing::TestWithParam<DistillParam> {};

TEST_P(ReferenceLinearDistillGradient, MatchesFiniteDifferences) {
  XENT_TEST_RNG(rng);
  const auto [kind, variant, reduction] = GetParam();
  const int64_t rows = 3, hidden_size = 4, vocab = 5;
  Matrix hidden = rng.matrix(rows, hidden_size, 1.0), weight = rng.matrix(vocab, hidden_size, 1.0);
  const Matrix teacher = rng.matrix(rows, vocab, 1.5);
  const std::vector<int64_t> target = {1, -100, 4};
  const DistillSpec spec = distill_spec(kind, variant, reduction);
  const Upstream upstream = random_upstream(rng, reduction, rows);
  const auto result = reference::linear_distill(hidden, weight, teacher, &target, spec, upstream);
  const auto objective = [&] {
    return weighted_total(
        reference::linear_distill(hidden, weight, teacher, &target, spec, {}).distill.loss,
        upstream);
  };
  const bool kinked = kind == DistillKind::tvd;
  expect_matches_differences(hidden.values, result.grads.hidden.values, objective, "hidden",
                             kinked);
  expect_matches_differences(weight.values, result.grads.weight.values, objective, "weight",
                             kinked);
}

INSTANTIATE_TEST_SUITE_P(
    EachKind, ReferenceLinearDistillGradient,
    ::testing::Combine(::testing::Values(DistillKind::forward_kl, DistillKind::reverse_kl,
                                         DistillKind::jsd, DistillKind::soft_ce, DistillKind::tvd),
                       ::testing::Values(kHardAndSoft),
                       ::testing::Values(Reduction::none, Reduction::mean)),
    distill_param_name);

}  // namespace
}  // namespace xent::test
