// ce on logits (docs/semantics.md §1): every option alone and every pair of options, for every reduction and
// input dtype, through ce_forward (statistics), ce_forward with the gradient and ce_backward.
#include "ce_check.hpp"

namespace xent::test {
namespace {

class CeGrid : public ::testing::TestWithParam<CeGridParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(CeGrid, MatchesReference) {
  XENT_TEST_RNG(rng);
  CeProblem problem;
  std::tie(problem.dtype, problem.options, problem.reduction) = GetParam();
  check_ce(problem, rng);
}

INSTANTIATE_TEST_SUITE_P(OptionsUpToPairs, CeGrid,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::ValuesIn(ce_option_sets_up_to_pairs()),
                                            kAllReductions),
                         ce_grid_name);

// fp16 and fp64 (a CPU-only dtype, for gradcheck) meet each option alone: the pairs add nothing
// dtype-specific, and the suite stays fast.
std::vector<DType> other_dtypes() {
  std::vector<DType> dtypes = {DType::f16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(EachOption, CeGrid,
                         ::testing::Combine(::testing::ValuesIn(other_dtypes()),
                                            ::testing::Values(0u, kSmoothing, kZLoss, kSoftcap,
                                                              kLogitScale, kClassWeight,
                                                              kRowWeight),
                                            kAllReductions),
                         ce_grid_name);

}  // namespace
}  // namespace xent::test
