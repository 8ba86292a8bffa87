// ce on logits (SPEC §1): the special cases, each for every input dtype and reduction: odd and
// padded shapes, int32 targets, ignored rows, N = 0, NaN rows, edge targets, in-place gradients.
#include "ce_check.hpp"

namespace xent::test {
namespace {

enum class CeCase {
  odd_shape,         // N = 37, V = 1031 (the grid's shape) with padded rows
  tiny_vocab,        // V = 2
  single_class,      // V = 1: every valid row has loss 0
  single_row,        // N = 1
  wide_row,          // V = 50021 (past any per-block tile), few rows
  int32_target,
  custom_ignore_index,
  no_ignored_rows,
  all_rows_ignored,
  empty_batch,       // N = 0
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
    case CeCase::odd_shape: return "padded_rows";
    case CeCase::tiny_vocab: return "vocab2";
    case CeCase::single_class: return "vocab1";
    case CeCase::single_row: return "one_row";
    case CeCase::wide_row: return "vocab50021";
    case CeCase::int32_target: return "int32_target";
    case CeCase::custom_ignore_index: return "ignore_index_minus1";
    case CeCase::no_ignored_rows: return "no_ignored_rows";
    case CeCase::all_rows_ignored: return "all_rows_ignored";
    case CeCase::empty_batch: return "empty_batch";
    case CeCase::nan_row: return "nan_row";
    case CeCase::targets_at_edges: return "targets_at_edges";
    case CeCase::in_place: return "in_place";
    case CeCase::in_place_padded: return "in_place_padded";
    case CeCase::unit_grad_output: return "absent_grad_output";
    case CeCase::large_logits: return "large_logits";
    case CeCase::all_options: return "all_options";
  }
  return "unknown";
}

CeProblem problem_for(CeCase c) {
  CeProblem p;
  switch (c) {
    case CeCase::odd_shape: p.row_stride = p.vocab + 9; break;
    case CeCase::tiny_vocab: p.vocab = 2; break;
    case CeCase::single_class: p.vocab = 1; break;
    case CeCase::single_row: p.rows = 1; p.ignored_rows = false; break;
    case CeCase::wide_row: p.rows = 5; p.vocab = 50021; break;
    case CeCase::int32_target: p.target_dtype = DType::i32; break;
    case CeCase::custom_ignore_index: p.ignore_index = -1; break;
    case CeCase::no_ignored_rows: p.ignored_rows = false; break;
    case CeCase::all_rows_ignored: p.all_ignored = true; break;
    case CeCase::empty_batch: p.rows = 0; break;
    case CeCase::nan_row: p.nan_row = true; break;
    case CeCase::targets_at_edges: p.targets_at_edges = true; break;
    case CeCase::in_place: p.in_place = true; break;
    case CeCase::in_place_padded: p.in_place = true; p.row_stride = p.vocab + 3; break;
    case CeCase::unit_grad_output: p.unit_grad_output = true; break;
    case CeCase::large_logits: p.logit_sd = 25.0; break;
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

}  // namespace
}  // namespace xent::test
