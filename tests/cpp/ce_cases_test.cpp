// ce on logits (docs/semantics.md §1): the special cases, each for every input dtype and reduction: odd and
// padded shapes, int32 targets, ignored rows, N = 0, NaN rows, edge targets, in-place gradients.
#include <algorithm>
#include <cmath>

#include "ce_check.hpp"

namespace xent::test {
namespace {

enum class CeCase {
  odd_shape,     // N = 37, V = 1031 (the grid's shape) with padded rows
  tiny_vocab,    // V = 2
  single_class,  // V = 1: every valid row has loss 0
  single_row,    // N = 1
  wide_row,      // V = 50021 (past any per-block tile), few rows
  int32_target,
  custom_ignore_index,
  no_ignored_rows,
  all_rows_ignored,
  empty_batch,  // N = 0
  nan_row,
  targets_at_edges,  // targets 0 and V − 1
  in_place,          // grad_logits aliases logits
  in_place_padded,
  unit_grad_output,  // grad_output absent means 1
  large_logits,      // |x| ~ 50: exp overflows without the max shift
  all_options,
};

const char* case_name(CeCase c) {
  switch (c) {
    case CeCase::odd_shape:
      return "padded_rows";
    case CeCase::tiny_vocab:
      return "vocab2";
    case CeCase::single_class:
      return "vocab1";
    case CeCase::single_row:
      return "one_row";
    case CeCase::wide_row:
      return "vocab50021";
    case CeCase::int32_target:
      return "int32_target";
    case CeCase::custom_ignore_index:
      return "ignore_index_minus1";
    case CeCase::no_ignored_rows:
      return "no_ignored_rows";
    case CeCase::all_rows_ignored:
      return "all_rows_ignored";
    case CeCase::empty_batch:
      return "empty_batch";
    case CeCase::nan_row:
      return "nan_row";
    case CeCase::targets_at_edges:
      return "targets_at_edges";
    case CeCase::in_place:
      return "in_place";
    case CeCase::in_place_padded:
      return "in_place_padded";
    case CeCase::unit_grad_output:
      return "absent_grad_output";
    case CeCase::large_logits:
      return "large_logits";
    case CeCase::all_options:
      return "all_options";
  }
  return "unknown";
}

CeProblem problem_for(CeCase c) {
  CeProblem p;
  switch (c) {
    case CeCase::odd_shape:
      p.row_stride = p.vocab + 9;
      break;
    case CeCase::tiny_vocab:
      p.vocab = 2;
      break;
    case CeCase::single_class:
      p.vocab = 1;
      break;
    case CeCase::single_row:
      p.rows = 1;
      p.ignored_rows = false;
      break;
    case CeCase::wide_row:
      p.rows = 5;
      p.vocab = 50021;
      break;
    case CeCase::int32_target:
      p.target_dtype = DType::i32;
      break;
    case CeCase::custom_ignore_index:
      p.ignore_index = -1;
      break;
    case CeCase::no_ignored_rows:
      p.ignored_rows = false;
      break;
    case CeCase::all_rows_ignored:
      p.all_ignored = true;
      break;
    case CeCase::empty_batch:
      p.rows = 0;
      break;
    case CeCase::nan_row:
      p.nan_row = true;
      break;
    case CeCase::targets_at_edges:
      p.targets_at_edges = true;
      break;
    case CeCase::in_place:
      p.in_place = true;
      break;
    case CeCase::in_place_padded:
      p.in_place = true;
      p.row_stride = p.vocab + 3;
      break;
    case CeCase::unit_grad_output:
      p.unit_grad_output = true;
      break;
    case CeCase::large_logits:
      p.logit_sd = 25.0;
      break;
    case CeCase::all_options:
      p.options = kSmoothing | kZLoss | kSoftcap | kLogitScale | kClassWeight | kRowWeight;
      break;
  }
  return p;
}

using CeCaseParam = std::tuple<DType, CeCase, Reduction>;

class CeCases : public ::testing::TestWithParam<CeCaseParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(CeCases, MatchesReference) {
  XENT_TEST_RNG(rng);
  const auto [dtype, which, reduction] = GetParam();
  CeProblem problem = problem_for(which);
  problem.dtype = dtype;
  problem.reduction = reduction;
  check_ce(problem, rng);
}

std::string case_param_name(const ::testing::TestParamInfo<CeCaseParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + case_name(std::get<1>(info.param)) + "_" +
         reduction_label(std::get<2>(info.param));
}

const auto kAllCases = ::testing::Values(
    CeCase::odd_shape, CeCase::tiny_vocab, CeCase::single_class, CeCase::single_row,
    CeCase::wide_row, CeCase::int32_target, CeCase::custom_ignore_index, CeCase::no_ignored_rows,
    CeCase::all_rows_ignored, CeCase::empty_batch, CeCase::nan_row, CeCase::targets_at_edges,
    CeCase::in_place, CeCase::in_place_padded, CeCase::unit_grad_output, CeCase::large_logits,
    CeCase::all_options);

INSTANTIATE_TEST_SUITE_P(Special, CeCases,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16), kAllCases,
                                            ::testing::Values(Reduction::none, Reduction::sum,
                                                              Reduction::mean)),
                         case_param_name);

std::vector<DType> other_dtypes() {
  std::vector<DType> dtypes = {DType::f16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(SpecialOtherDtypes, CeCases,
                         ::testing::Combine(::testing::ValuesIn(other_dtypes()), kAllCases,
                                            ::testing::Values(Reduction::mean)),
                         case_param_name);

// Rows are independent: changing one row's logits changes no other row's loss or gradient.
TEST(CeRowIndependence, OtherRowsUnchangedBitForBit) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t rows = 9, vocab = 257;
  Matrix x = rounded(rng.matrix(rows, vocab, 2.0), DType::f32);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, false, false, false);
  CeOptions options;
  options.reduction = Reduction::none;
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Scratch scratch(ce_workspace_size(rows, vocab, options, test_device()));
  std::vector<std::vector<double>> losses, grads;
  for (int trial = 0; trial < 2; ++trial) {
    if (trial == 1)
      for (int64_t i = 0; i < vocab; ++i) x.at(4, i) = round_to(DType::f32, rng.normal(5.0));
    const Tensor logits = Tensor::of(x, DType::f32);
    Tensor loss = Tensor::vector(DType::f32, rows), grad = Tensor::matrix(DType::f32, rows, vocab);
    CeOutputs out;
    out.loss = loss.view();
    out.grad_logits = grad.view();
    ce_forward(logits.view(), target_tensor.view(), options, out, {}, scratch.workspace());
    finish();
    losses.push_back(loss.download());
    grads.push_back(grad.download());
  }
  for (int64_t n = 0; n < rows; ++n) {
    if (n == 4) continue;
    EXPECT_EQ(losses[0][n], losses[1][n]) << "row " << n;
    for (int64_t i = 0; i < vocab; ++i)
      ASSERT_EQ(grads[0][n * vocab + i], grads[1][n * vocab + i]) << "row " << n << " col " << i;
  }
}

// docs/semantics.md §1 mean with D = 0 and N_valid > 0: every valid target has class weight 0. The ℓ part is 0
// (its divisor D is 0, though with smoothing its numerator is not), the z-loss part keeps its own
// divisor N_valid, and the gradient is the z-loss gradient alone (docs/semantics.md says why).
class CeMeanZeroTargetWeight : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(CeMeanZeroTargetWeight, LossPartZeroZLossPartKept) {
  XENT_TEST_RNG(rng);
  const DType dtype = GetParam();
  const int64_t rows = 13, vocab = 101;
  const double lambda = 1e-2, g = 1.7;
  const Matrix x = rounded(rng.matrix(rows, vocab, 2.0), dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  // Weights are fp32 in the op: rounded here so the float64 case checks float64 math.
  std::vector<double> class_weight = rounded(rng.uniform_vector(vocab, 0.5, 1.5), DType::f32);
  int64_t valid = 0;
  for (const int64_t y : target) {
    if (y == -100) continue;
    class_weight[static_cast<std::size_t>(y)] = 0.0;
    ++valid;
  }
  ASSERT_GT(valid, 0);
  const std::vector<double> row_weight = rounded(rng.uniform_vector(rows, 0.5, 1.5), DType::f32);

  // By hand: Σ_valid r_n·λ·lse_n² / N_valid and its gradient c^z·2λ·lse_n·p_i.
  double expected_loss = 0;
  Matrix expected_grad(rows, vocab);
  for (int64_t n = 0; n < rows; ++n) {
    if (target[n] == -100) continue;
    double m = x.at(n, 0), s = 0;
    for (int64_t i = 0; i < vocab; ++i) m = std::max(m, x.at(n, i));
    for (int64_t i = 0; i < vocab; ++i) s += std::exp(x.at(n, i) - m);
    const double lse = m + std::log(s);
    expected_loss += row_weight[n] * lambda * lse * lse / static_cast<double>(valid);
    const double z_coef = g * row_weight[n] / static_cast<double>(valid);
    for (int64_t i = 0; i < vocab; ++i)
      expected_grad.at(n, i) = z_coef * 2 * lambda * lse * std::exp(x.at(n, i) - lse);
  }

  const Tensor logits = Tensor::of(x, dtype);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor class_weight_tensor = Tensor::of(class_weight, DType::f32);
  const Tensor row_weight_tensor = Tensor::of(row_weight, DType::f32);
  CeOptions options;
  options.reduction = Reduction::mean;
  options.label_smoothing = 0.1;
  options.z_loss = lambda;
  options.class_weight = class_weight_tensor.view();
  options.row_weight = row_weight_tensor.view();
  const reference::Upstream upstream{true, {g}};
  const Tensor grad_output = upstream_tensor(upstream, Reduction::mean, rows, dtype);
  Tensor loss = loss_tensor(Reduction::mean, rows, dtype);
  Tensor z_value = loss_tensor(Reduction::mean, rows, dtype);
  Tensor grad = Tensor::matrix(dtype, rows, vocab);
  CeOutputs out;
  out.loss = loss.view();
  out.stats.z_loss_value = z_value.view();
  out.grad_logits = grad.view();
  const Scratch scratch(ce_workspace_size(rows, vocab, options, test_device()));
  ce_forward(logits.view(), target_tensor.view(), options, out, grad_output.view(),
             scratch.workspace());
  finish();

  const double tol = dtype == DType::f64 ? 1e-10 : 1e-5;
  EXPECT_GT(expected_loss, 0.0);
  EXPECT_TRUE(close("loss", loss.download(), {expected_loss}, tol));
  EXPECT_TRUE(close("z_loss_value", z_value.download(), {expected_loss}, tol));
  EXPECT_TRUE(close("grad_logits", grad.download(), expected_grad.values, tol));
}

std::vector<DType> zero_weight_dtypes() {
  std::vector<DType> dtypes = {DType::f32};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(Special, CeMeanZeroTargetWeight, ::testing::ValuesIn(zero_weight_dtypes()),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return short_name(info.param);
                         });

}  // namespace
}  // namespace xent::test
