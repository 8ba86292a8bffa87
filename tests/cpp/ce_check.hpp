// The cross-entropy harness shared by the ce suites: builds one random problem, runs ce_forward
// (statistics only), ce_forward with the gradient, and ce_backward (with and without lse) on the
// test device, and compares every output with the float64 reference.
#pragma once

#include <string>
#include <tuple>

#include "support.hpp"

namespace xent::test {

// Options of docs/semantics.md §1 as bits, so suites can enumerate each option alone and all pairs.
enum CeOptionBit : unsigned {
  kSmoothing = 1u << 0,
  kZLoss = 1u << 1,
  kSoftcap = 1u << 2,
  kLogitScale = 1u << 3,
  kClassWeight = 1u << 4,
  kRowWeight = 1u << 5,
};
constexpr unsigned kCeOptionCount = 6;
std::string ce_options_label(unsigned options);
// Every option alone, every pair, and none: 1 + 6 + 15 sets.
std::vector<unsigned> ce_option_sets_up_to_pairs();
constexpr unsigned kAllCeOptions =
    kSmoothing | kZLoss | kSoftcap | kLogitScale | kClassWeight | kRowWeight;

// Grids over (dtype, CE option set, reduction): the test name "<dtype>_<options>_<reduction>".
using CeGridParam = std::tuple<DType, unsigned, Reduction>;
std::string ce_grid_name(const ::testing::TestParamInfo<CeGridParam>& info);

struct CeProblem {
  DType dtype = DType::f32;
  DType target_dtype = DType::i64;
  int64_t rows = 37;
  int64_t vocab = 1031;
  int64_t row_stride = -1;  // padded rows when > vocab
  unsigned options = 0;
  Reduction reduction = Reduction::mean;
  int64_t ignore_index = -100;
  bool ignored_rows = true;  // every fifth row ignored
  bool all_ignored = false;
  bool nan_row = false;           // one row holds a NaN logit
  bool targets_at_edges = false;  // targets 0 and V−1
  bool in_place = false;          // grad_logits aliases logits
  bool unit_grad_output = false;  // grad_output absent (means 1)
  double logit_sd = 2.0;
};

// Runs every entry point on `problem` with fresh inputs from `rng`; failures name the step.
void check_ce(const CeProblem& problem, Rng& rng);

// Builds the public options and the matching reference spec (class/row weights rounded to fp32,
// as the op sees them).
struct CeSetup {
  CeOptions options;
  reference::CeSpec spec;
  Tensor class_weight, row_weight;
};
CeSetup make_ce_setup(unsigned options, Reduction reduction, int64_t ignore_index, int64_t rows,
                      int64_t vocab, Rng& rng);

// Random targets in [0, V) with the ignored rows the problem asks for.
std::vector<int64_t> make_targets(Rng& rng, int64_t rows, int64_t vocab, int64_t ignore_index,
                                  bool ignored_rows, bool all_ignored, bool at_edges);
// Random upstream gradient: a scalar for sum/mean, one value per row for none.
reference::Upstream make_upstream(Rng& rng, Reduction reduction, int64_t rows, bool unit);
// Loss-shaped tensors in the result dtype of an op on `input` (float64 for float64, else float32).
Tensor upstream_tensor(const reference::Upstream& upstream, Reduction reduction, int64_t rows,
                       DType input = DType::f32);
Tensor loss_tensor(Reduction reduction, int64_t rows, DType input = DType::f32);
// x̃ = softcap(a·x) in double, to judge argmax ties.
double ce_transformed(const reference::CeSpec& spec, double x);

}  // namespace xent::test
