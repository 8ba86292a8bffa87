// distill on logits (docs/semantics.md §3): every kind with each option alone and every pair of options, every
// reduction and dtype; then the special cases (JSD β, ignored rows, N = 0, NaN rows, in place).
#include "distill_check.hpp"

namespace xent::test {
namespace {

const std::vector<DistillKind> kKinds = {DistillKind::forward_kl, DistillKind::reverse_kl,
                                         DistillKind::jsd, DistillKind::soft_ce, DistillKind::tvd};

using DistillGridParam = std::tuple<DType, DistillKind, unsigned, Reduction>;

class DistillGrid : public ::testing::TestWithParam<DistillGridParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(DistillGrid, MatchesReference) {
  XENT_TEST_RNG(rng);
  DistillProblem problem;
  std::tie(problem.dtype, problem.kind, problem.options, problem.reduction) = GetParam();
  check_distill(problem, rng);
}

std::string grid_name(const ::testing::TestParamInfo<DistillGridParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + distill_kind_name(std::get<1>(info.param)) +
         "_" + distill_options_label(std::get<2>(info.param)) + "_" +
         reduction_label(std::get<3>(info.param));
}

// fp32 gets the whole grid, bf16 each option alone, fp16 and fp64 (CPU) a cross-section: every
// dtype meets every kind, and the suite stays fast.
INSTANTIATE_TEST_SUITE_P(OptionsUpToPairs, DistillGrid,
                         ::testing::Combine(::testing::Values(DType::f32),
                                            ::testing::ValuesIn(kKinds),
                                            ::testing::ValuesIn(distill_option_sets_up_to_pairs()),
                                            kAllReductions),
                         grid_name);

INSTANTIATE_TEST_SUITE_P(EachOption, DistillGrid,
                         ::testing::Combine(::testing::Values(DType::bf16),
                                            ::testing::ValuesIn(kKinds),
                                            ::testing::Values(0u, kTemperature, kDistillSoftcap,
                                                              kHardAndSoft, kNoTarget),
                                            kAllReductions),
                         grid_name);

std::vector<DType> other_dtypes() {
  std::vector<DType> dtypes = {DType::f16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(
    OtherDtypes, DistillGrid,
    ::testing::Combine(::testing::ValuesIn(other_dtypes()), ::testing::ValuesIn(kKinds),
                       ::testing::Values(kTemperature | kDistillSoftcap, kHardAndSoft),
                       ::testing::Values(Reduction::none, Reduction::mean)),
    grid_name);

// ---- special cases ----------------------------------------------------------------------------

enum class DistillCase {
  jsd_beta_0,
  jsd_beta_quarter,
  jsd_beta_1,
  all_rows_ignored,
  empty_batch,
  nan_row,
  in_place,
  padded_rows,
  student_wider,  // docs/semantics.md §3.2: V' columns of operands of their own widths
  teacher_wider,
  absent_grad_output,
  peaked_teacher,  // most teacher probabilities underflow to 0 in float: 0·log 0 gives 0
  small_vocab,
};

const char* case_name(DistillCase c) {
  switch (c) {
    case DistillCase::jsd_beta_0:
      return "jsd_beta0";
    case DistillCase::jsd_beta_quarter:
      return "jsd_beta025";
    case DistillCase::jsd_beta_1:
      return "jsd_beta1";
    case DistillCase::all_rows_ignored:
      return "all_rows_ignored";
    case DistillCase::empty_batch:
      return "empty_batch";
    case DistillCase::nan_row:
      return "nan_row";
    case DistillCase::in_place:
      return "in_place";
    case DistillCase::padded_rows:
      return "padded_rows";
    case DistillCase::student_wider:
      return "student_wider";
    case DistillCase::teacher_wider:
      return "teacher_wider";
    case DistillCase::absent_grad_output:
      return "absent_grad_output";
    case DistillCase::peaked_teacher:
      return "peaked";
    case DistillCase::small_vocab:
      return "vocab3";
  }
  return "unknown";
}

using DistillCaseParam = std::tuple<DType, DistillCase, DistillKind, Reduction>;

class DistillCases : public ::testing::TestWithParam<DistillCaseParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(DistillCases, MatchesReference) {
  XENT_TEST_RNG(rng);
  const auto [dtype, which, kind, reduction] = GetParam();
  DistillProblem p;
  p.dtype = dtype;
  p.kind = kind;
  p.reduction = reduction;
  switch (which) {
    case DistillCase::jsd_beta_0:
      p.kind = DistillKind::jsd;
      p.beta = 0.0;
      break;
    case DistillCase::jsd_beta_quarter:
      p.kind = DistillKind::jsd;
      p.beta = 0.25;
      break;
    case DistillCase::jsd_beta_1:
      p.kind = DistillKind::jsd;
      p.beta = 1.0;
      break;
    case DistillCase::all_rows_ignored:
      p.all_ignored = true;
      p.options = kHardAndSoft;
      break;
    case DistillCase::empty_batch:
      p.rows = 0;
      break;
    case DistillCase::nan_row:
      p.nan_row = true;
      break;
    case DistillCase::in_place:
      p.in_place = true;
      p.options = kTemperature;
      break;
    case DistillCase::padded_rows:
      p.row_stride = p.vocab + 5;
      break;
    // The columns past V' are poisoned (NaN): read, they would show in the loss.
    case DistillCase::student_wider:
      p.row_stride = p.vocab + 14;
      p.teacher_row_stride = p.vocab;
      p.options = kHardAndSoft;
      break;
    case DistillCase::teacher_wider:
      p.teacher_row_stride = p.vocab + 9;
      break;
    case DistillCase::absent_grad_output:
      p.unit_grad_output = true;
      break;
    case DistillCase::peaked_teacher:
      p.teacher_sd = 30.0;
      break;
    case DistillCase::small_vocab:
      p.vocab = 3;
      break;
  }
  check_distill(p, rng);
}

std::string case_param_name(const ::testing::TestParamInfo<DistillCaseParam>& info) {
  const DistillCase which = std::get<1>(info.param);
  const bool jsd_case = which == DistillCase::jsd_beta_0 ||
                        which == DistillCase::jsd_beta_quarter || which == DistillCase::jsd_beta_1;
  return short_name(std::get<0>(info.param)) + "_" + case_name(which) +
         (jsd_case ? "" : std::string("_") + distill_kind_name(std::get<2>(info.param))) + "_" +
         reduction_label(std::get<3>(info.param));
}

INSTANTIATE_TEST_SUITE_P(JsdBeta, DistillCases,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(DistillCase::jsd_beta_0,
                                                              DistillCase::jsd_beta_quarter,
                                                              DistillCase::jsd_beta_1),
                                            ::testing::Values(DistillKind::jsd), kAllReductions),
                         case_param_name);

const auto kSpecialCases =
    ::testing::Values(DistillCase::all_rows_ignored, DistillCase::empty_batch, DistillCase::nan_row,
                      DistillCase::in_place, DistillCase::padded_rows, DistillCase::student_wider,
                      DistillCase::teacher_wider, DistillCase::absent_grad_output,
                      DistillCase::peaked_teacher, DistillCase::small_vocab);

INSTANTIATE_TEST_SUITE_P(Special, DistillCases,
                         ::testing::Combine(::testing::Values(DType::f32), kSpecialCases,
                                            ::testing::ValuesIn(kKinds),
                                            ::testing::Values(Reduction::none, Reduction::mean)),
                         case_param_name);

INSTANTIATE_TEST_SUITE_P(SpecialBf16, DistillCases,
                         ::testing::Combine(::testing::Values(DType::bf16), kSpecialCases,
                                            ::testing::ValuesIn(kKinds),
                                            ::testing::Values(Reduction::mean)),
                         case_param_name);

}  // namespace
}  // namespace xent::test
