// GPU-only cases of linear_ce's per-row reference path (src/cuda/linear/linear_reference.cu): a training
// step (linear_ce_forward with gradients, or linear_ce_backward without the forward's lse) of bf16
// operands on a compute capability 9.0 device forms each row chunk's gradient as s_n·E with
// E = e^(x̃ − r_n) written by the fused gradient product, r_n the row's target logit. Odd shapes
// (N not a multiple of the 128-row tile, V not a multiple of the 256-column tile, H down to one
// 16-byte TMA row), every option the path takes, every reduction, ignored rows, a NaN row, and
// rows whose loss is far beyond what e^(x̃ − r) holds (the fallback kernels), against the float64
// reference with outputs NaN-poisoned before the run. Each case asserts which path ran through the
// process-wide count of reference chunks (linear_ce_plan.hpp): the path where it must run, not
// where it must not (label smoothing with a softcap, fp16, a bias, the test hook's
// reference_path = off). Label smoothing without a softcap runs on the path with its uniform term in rank-1
// form (w̄, and kUniformRows more rows of the ∂W product); entropy, argmax and accuracy asked for
// run the product's statistics form (from kReferenceStatisticsMinHidden on, or everywhere with
// the test hook's reference_path = on, which the statistics cases set). Off compute capability 9.0 the path assertions are skipped and
// the numerical checks run on the row kernel.
#include <optional>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>

#include "cuda/plan/linear_ce_plan.hpp"
#include "gpu_support.hpp"
#include "linear_check.hpp"
#include "hook_scope.hpp"

namespace xent::test {
namespace {

struct ReferenceCase {
  DType dtype = DType::bf16;
  int64_t rows = 77, hidden = 64, vocab = 129;
  unsigned options = 0;
  Reduction reduction = Reduction::mean;
  bool bias = false;
  double logits_sd = 2.0;  // 40: most rows' loss far above 60 nats (the fallback)
  bool nan_row = false;    // row 3 of h holds a NaN
  // Row 4 of h holds a NaN, an ignored row (make_targets ignores rows n % 5 == 4): its gradient
  // is 0 all the same, through the fallback (its reference is +∞, its E row NaN).
  bool nan_ignored_row = false;
  // Row 5 of h scaled by this power of two (0: none): its logits then pass f16's range, in
  // which the product stages x, and the row must come out of the fallback (decision 114).
  double scaled_row = 0;
  bool fp32_weight_grad = false;
  bool want_hidden = true;
  bool backward = false;  // linear_ce_backward without lse instead of the forward with gradients
  // The backward is given an lse (float64's, rounded to fp32): the path forms its own and must
  // still run, so that a forward's lse and a backward's logits never come from different
  // roundings of x (decision 114).
  bool backward_lse = false;
  // Ask the forward for entropy, argmax and accuracy too; below kReferenceStatisticsMinHidden
  // they take the path only with the test hook's reference_path = on.
  bool statistics = false;
  cuda::Forced reference_path = cuda::Forced::planned;  // the test hook's, for the call
  // The test hook's fused_statistics: off holds schedule (d) off, which the planner prices below
  // the path's row chunks for a call without ∂h at these small shapes.
  cuda::Forced fused_statistics = cuda::Forced::planned;
  std::size_t budget = 0;  // 0: the default workspace budget
  bool expected = true;    // the path must run (on compute capability 9.0)
};

void check_reference_step(const ReferenceCase& c, Rng& rng) {
  const int64_t rows = c.rows, vocab = c.vocab;
  LinearLayer layer = make_linear_layer(rng, rows, c.hidden, vocab, c.bias, c.logits_sd, c.dtype);
  const int64_t nan_row = c.nan_row ? 3 : -1;
  if (nan_row >= 0) layer.hidden.at(nan_row, 1) = std::numeric_limits<double>::quiet_NaN();
  const int64_t nan_ignored_row = c.nan_ignored_row ? 4 : -1;
  if (nan_ignored_row >= 0) {
    layer.hidden.at(nan_ignored_row, 1) = std::numeric_limits<double>::quiet_NaN();
  }
  if (c.scaled_row > 0) {
    for (int64_t k = 0; k < c.hidden; ++k) layer.hidden.at(5, k) *= c.scaled_row;
  }
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, true);
  CeSetup setup = make_ce_setup(c.options, c.reduction, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, c.reduction, rows, false);
  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const reference::CeResult ref = reference::ce(logits, target, setup.spec, upstream);
  const reference::LinearGrads ref_grads =
      reference::linear_backward(ref.grad, layer.hidden, layer.weight);
  // PyTorch at this dtype: the logits rounded to it, its gradients rounded to it.
  const DType weight_grad_dtype = c.fp32_weight_grad ? DType::f32 : c.dtype;
  const reference::CeResult torch =
      reference::ce(rounded(logits, c.dtype), target, setup.spec, upstream);
  const reference::LinearGrads torch_grads =
      rounded_linear_backward(torch.grad, layer, c.dtype, weight_grad_dtype);

  const Tensor hidden = Tensor::of(layer.hidden, c.dtype);
  const Tensor weight = Tensor::of(layer.weight, c.dtype);
  const Tensor bias = c.bias ? Tensor::of(layer.bias, c.dtype) : Tensor();
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, c.reduction, rows, c.dtype);
  LinearCeOptions options;
  options.ce = setup.options;
  if (c.budget > 0) options.workspace_budget = c.budget;

  const DType stat = result_dtype(c.dtype);
  Tensor loss = loss_tensor(c.reduction, rows, c.dtype);
  Tensor lse = Tensor::vector(stat, rows), logprob = Tensor::vector(stat, rows),
         entropy = Tensor::vector(stat, rows), z_value = loss_tensor(c.reduction, rows, c.dtype),
         argmax = Tensor::vector(DType::i64, rows), accuracy = Tensor::scalar(stat);
  Tensor grad_hidden = c.want_hidden ? Tensor::matrix(c.dtype, rows, c.hidden) : Tensor();
  Tensor grad_weight = Tensor::matrix(weight_grad_dtype, vocab, c.hidden);
  Tensor grad_bias = c.bias ? Tensor::vector(c.dtype, vocab) : Tensor();
  for (Tensor* t : {&loss, &lse, &logprob, &entropy, &z_value, &argmax, &accuracy, &grad_hidden,
                    &grad_weight, &grad_bias}) {
    if (t->present()) t->poison();
  }
  const LinearGradients grads{grad_hidden.view(), grad_weight.view(), grad_bias.view()};

  std::optional<HookScope> hook(std::in_place);
  (*hook)->reference_path = c.reference_path;
  (*hook)->fused_statistics = c.fused_statistics;
  const cuda::ChunkPlan plan = cuda::linear_ce_chunk_plan(
      rows, c.hidden, vocab, c.dtype, options, grads, c.fused_statistics != cuda::Forced::off);
  const Scratch scratch(
      linear_ce_workspace_size(rows, c.hidden, vocab, c.dtype, options, test_device(), true));
  const int64_t before = cuda::reference_chunk_count();
  if (c.backward) {
    const Tensor given_lse = c.backward_lse ? Tensor::of(ref.lse, DType::f32) : Tensor();
    linear_ce_backward(hidden.view(), weight.view(), bias.view(), target_tensor.view(),
                       given_lse.view(), grad_output.view(), options, grads, scratch.workspace());
  } else {
    LinearCeOutputs out;
    out.loss = loss.view();
    out.stats.lse = lse.view();
    out.stats.logprob = logprob.view();
    out.stats.z_loss_value = z_value.view();
    if (c.statistics) {
      out.stats.entropy = entropy.view();
      out.stats.argmax = argmax.view();
      out.stats.accuracy = accuracy.view();
    }
    out.grads = grads;
    linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), options, out,
                      grad_output.view(), scratch.workspace());
  }
  finish();
  const int64_t ran = cuda::reference_chunk_count() - before;
  hook.reset();
  if (hopper_paths_here()) {
    if (c.expected) {
      EXPECT_GT(ran, 0) << "the reference path did not run (the plan: schedule "
                        << static_cast<int>(plan.schedule) << ", " << plan.chunk_count
                        << " chunks)";
    } else {
      EXPECT_EQ(ran, 0) << "the reference path ran where it must not";
    }
  } else {
    EXPECT_EQ(ran, 0) << "the reference path ran on a device other than compute capability 9.0";
  }

  const int64_t loss_skip = c.reduction == Reduction::none ? nan_row : -1;
  auto check_stat = [&](const char* what, const Tensor& t, const std::vector<double>& r,
                        const std::vector<double>& torch_values, int64_t skip) {
    const std::vector<double> expected = without_row(r, 1, skip);
    EXPECT_TRUE(close(
        what, without_row(t.download(), 1, skip), expected,
        stat_tolerance(c.dtype, Family::linear, without_row(torch_values, 1, skip), expected)));
  };
  if (!c.backward) {
    if (nan_row >= 0 && c.reduction != Reduction::none) {
      EXPECT_TRUE(std::isnan(loss.download()[0])) << "a NaN row must make the reduced loss NaN";
    } else {
      check_stat("loss", loss, ref.loss, torch.loss, loss_skip);
      check_stat("z_loss_value", z_value, ref.z_loss_value, torch.z_loss_value, loss_skip);
    }
    if (nan_row >= 0 && c.reduction == Reduction::none) {
      EXPECT_TRUE(std::isnan(loss.download()[static_cast<std::size_t>(nan_row)]))
          << "the NaN row's loss";
    }
    check_stat("lse", lse, ref.lse, torch.lse, nan_row);
    check_stat("logprob", logprob, ref.logprob, torch.logprob, nan_row);
    if (c.statistics) {
      check_stat("entropy", entropy, ref.entropy, torch.entropy, nan_row);
      const std::vector<double> entropy_out = entropy.download();
      for (int64_t n = 0; n < rows; ++n) {
        if (target[n] == -100) {
          EXPECT_EQ(entropy_out[n], 0.0) << "entropy of ignored row " << n;
        }
      }
      // x̃ of 16-bit logits tie with float64's within 2e-2.
      check_argmax_accuracy(argmax.download_integers(), accuracy.download()[0], target, -100,
                            logits, setup.spec, ref, nan_row, 2e-2);
    }
  }
  if (grad_hidden.present()) {
    const std::vector<double> r = without_row(ref_grads.hidden.values, c.hidden, nan_row);
    const std::vector<double> t = without_row(torch_grads.hidden.values, c.hidden, nan_row);
    EXPECT_TRUE(close("grads.hidden", without_row(grad_hidden.download(), c.hidden, nan_row), r,
                      grad_tolerance(c.dtype, Family::linear, t, r)));
    if (nan_row >= 0) {
      const std::vector<double> all = grad_hidden.download();
      bool nan = false;
      for (int64_t k = 0; k < c.hidden; ++k) nan |= std::isnan(all[nan_row * c.hidden + k]);
      EXPECT_TRUE(nan) << "the NaN row's ∂h";
    }
    if (nan_ignored_row >= 0) {  // compared above too; stated here for what it is
      const std::vector<double> all = grad_hidden.download();
      for (int64_t k = 0; k < c.hidden; ++k) {
        EXPECT_EQ(all[nan_ignored_row * c.hidden + k], 0.0) << "the ignored NaN row's ∂h, " << k;
      }
    }
  }
  // ∂W sums over rows: a NaN in h reaches it (0·NaN in the reference too).
  if (nan_row < 0 && nan_ignored_row < 0) {
    EXPECT_TRUE(close("grads.weight", grad_weight.download(), ref_grads.weight.values,
                      grad_tolerance(c.dtype, Family::linear, torch_grads.weight.values,
                                     ref_grads.weight.values)));
  }
}

// (N, H, V, options, reduction)
using ShapeCase = std::tuple<int64_t, int64_t, int64_t, unsigned, Reduction>;

class CudaReference : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(CudaReference, MatchesReference) {
  require_device();
  const auto [rows, hidden, vocab, options, reduction] = GetParam();
  XENT_TEST_RNG(rng);
  ReferenceCase c;
  c.rows = rows;
  c.hidden = hidden;
  c.vocab = vocab;
  c.options = options;
  c.reduction = reduction;
  check_reference_step(c, rng);
}

std::string shape_case_name(const ::testing::TestParamInfo<ShapeCase>& info) {
  const auto [rows, hidden, vocab, options, reduction] = info.param;
  return linear_case_label(rows, hidden, vocab, options, reduction);
}

constexpr unsigned kReferenceOptions = kZLoss | kSoftcap | kLogitScale | kClassWeight | kRowWeight;
// Every option with label smoothing, which the path takes without a softcap.
constexpr unsigned kSmoothingOptions = (kReferenceOptions & ~kSoftcap) | kSmoothing;

// V = 7 (one partial column tile), 129 and 4099 (residue tiles), 32003 (126 tiles); N = 77 and
// 1000 (a residue row tile); H = 8 (one 16-byte row), 136 and 1032 (a K residue).
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaReference,
    ::testing::Values(ShapeCase{77, 8, 7, 0, Reduction::mean},
                      ShapeCase{1000, 136, 129, kReferenceOptions, Reduction::sum},
                      ShapeCase{77, 1032, 4099, kReferenceOptions, Reduction::none},
                      ShapeCase{300, 136, 4099, 0, Reduction::mean},
                      ShapeCase{1000, 64, 32003, kReferenceOptions, Reduction::mean},
                      ShapeCase{77, 136, 32003, kSoftcap | kLogitScale, Reduction::none},
                      ShapeCase{77, 8, 7, kSmoothing, Reduction::sum},
                      ShapeCase{1000, 136, 129, kSmoothingOptions, Reduction::mean},
                      ShapeCase{77, 1032, 4099, kSmoothingOptions, Reduction::none},
                      ShapeCase{1000, 64, 32003, kSmoothing | kClassWeight, Reduction::sum}),
    shape_case_name);

// Every option the path takes alone and all together, every reduction, at a shape with residues
// in N, H and V.
class CudaReferenceOptions : public ::testing::TestWithParam<std::tuple<unsigned, Reduction>> {};

TEST_P(CudaReferenceOptions, MatchesReference) {
  require_device();
  const auto [options, reduction] = GetParam();
  XENT_TEST_RNG(rng);
  ReferenceCase c;
  c.rows = 200;
  c.hidden = 72;
  c.vocab = 1031;
  c.options = options;
  c.reduction = reduction;
  check_reference_step(c, rng);
}

INSTANTIATE_TEST_SUITE_P(
    Options, CudaReferenceOptions,
    ::testing::Combine(::testing::Values(0u, kZLoss, kSoftcap, kLogitScale, kClassWeight,
                                         kRowWeight, kReferenceOptions, kSmoothing,
                                         kSmoothing | kClassWeight, kSmoothing | kLogitScale,
                                         kSmoothingOptions),
                       ::testing::Values(Reduction::none, Reduction::sum, Reduction::mean)),
    [](const auto& info) {
      return ce_options_label(std::get<0>(info.param)) + "_" +
             reduction_label(std::get<1>(info.param));
    });

// Special cases: which path runs, and what the path forms for them.
struct SpecialCase {
  const char* name;
  ReferenceCase c;
};

class CudaReferenceSpecial : public ::testing::TestWithParam<SpecialCase> {};

TEST_P(CudaReferenceSpecial, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  check_reference_step(GetParam().c, rng);
}

ReferenceCase special(void (*change)(ReferenceCase&)) {
  ReferenceCase c;
  c.rows = 300;
  c.hidden = 136;
  c.vocab = 4099;
  change(c);
  return c;
}

// special() asking for entropy, argmax and accuracy, with the statistics form taken at every H.
ReferenceCase statistics_special(void (*change)(ReferenceCase&)) {
  ReferenceCase c = special(change);
  c.statistics = true;
  c.reference_path = cuda::Forced::on;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaReferenceSpecial,
    ::testing::Values(
        // Losses of ≈ 40·√(2 ln V) nats: most rows take the fallback kernels.
        SpecialCase{"huge_losses", special([](ReferenceCase& c) { c.logits_sd = 40.0; })},
        SpecialCase{"huge_losses_all_options", special([](ReferenceCase& c) {
                      c.logits_sd = 40.0;
                      c.options = kReferenceOptions;
                      c.reduction = Reduction::none;
                    })},
        // One row's logits of ≈ ±10⁵, past f16's range (the staged tile's): through the fallback.
        SpecialCase{"beyond_f16_range", special([](ReferenceCase& c) { c.scaled_row = 32768; })},
        SpecialCase{"beyond_f16_range_statistics", statistics_special([](ReferenceCase& c) {
                      c.scaled_row = 32768;
                      c.options = kReferenceOptions;
                    })},
        SpecialCase{"nan_row", special([](ReferenceCase& c) { c.nan_row = true; })},
        SpecialCase{"nan_row_none", special([](ReferenceCase& c) {
                      c.nan_row = true;
                      c.reduction = Reduction::none;
                    })},
        SpecialCase{"nan_ignored_row", special([](ReferenceCase& c) { c.nan_ignored_row = true; })},
        SpecialCase{"nan_ignored_row_none", special([](ReferenceCase& c) {
                      c.nan_ignored_row = true;
                      c.reduction = Reduction::none;
                    })},
        SpecialCase{"fp32_weight_grad",
                    special([](ReferenceCase& c) { c.fp32_weight_grad = true; })},
        SpecialCase{"no_hidden_grad", special([](ReferenceCase& c) {
                      c.want_hidden = false;
                      c.fused_statistics = cuda::Forced::off;
                    })},
        SpecialCase{"backward_with_lse", special([](ReferenceCase& c) {
                      c.backward = true;
                      c.backward_lse = true;
                      c.reduction = Reduction::none;
                      c.options = kReferenceOptions;
                    })},
        SpecialCase{"backward_without_lse", special([](ReferenceCase& c) {
                      c.backward = true;
                      c.reduction = Reduction::none;
                      c.options = kReferenceOptions;
                    })},
        // Several chunks: ∂W summed over them in the fp32 accumulator.
        SpecialCase{"several_chunks", special([](ReferenceCase& c) {
                      c.budget = std::size_t{3} << 20;
                      c.options = kZLoss | kRowWeight;
                    })},
        SpecialCase{"switch_off", special([](ReferenceCase& c) {
                      c.reference_path = cuda::Forced::off;
                      c.expected = false;
                    })},
        SpecialCase{"label_smoothing_softcap", special([](ReferenceCase& c) {
                      c.options = kSmoothing | kSoftcap;
                      c.expected = false;
                    })},
        // Label smoothing where the rank-1 rows meet each other part of the path: the fallback's
        // exact rows (k_n = 0), an ignored row of NaN (out of U), the fp32 accumulator over
        // chunks, an fp32 ∂W, no ∂h, the backward without lse.
        SpecialCase{"smoothing_huge_losses", special([](ReferenceCase& c) {
                      c.logits_sd = 40.0;
                      c.options = kSmoothingOptions;
                      c.reduction = Reduction::none;
                    })},
        SpecialCase{"smoothing_nan_ignored_row", special([](ReferenceCase& c) {
                      c.nan_ignored_row = true;
                      c.options = kSmoothing | kClassWeight;
                    })},
        SpecialCase{"smoothing_nan_row_none", special([](ReferenceCase& c) {
                      c.nan_row = true;
                      c.options = kSmoothing;
                      c.reduction = Reduction::none;
                    })},
        SpecialCase{"smoothing_several_chunks", special([](ReferenceCase& c) {
                      c.budget = std::size_t{3} << 20;
                      c.options = kSmoothingOptions;
                    })},
        SpecialCase{"smoothing_fp32_weight_grad", special([](ReferenceCase& c) {
                      c.fp32_weight_grad = true;
                      c.options = kSmoothing | kClassWeight;
                    })},
        SpecialCase{"smoothing_no_hidden_grad", special([](ReferenceCase& c) {
                      c.want_hidden = false;
                      c.fused_statistics = cuda::Forced::off;
                      c.options = kSmoothing;
                    })},
        SpecialCase{"smoothing_backward_without_lse", special([](ReferenceCase& c) {
                      c.backward = true;
                      c.reduction = Reduction::none;
                      c.options = kSmoothingOptions;
                    })},
        // Entropy, argmax and accuracy from the statistics form: its tiles, the fallback's rows,
        // a NaN row, ignored rows, several chunks, with every option the path takes.
        SpecialCase{"statistics", statistics_special([](ReferenceCase&) {})},
        SpecialCase{"statistics_all_options", statistics_special([](ReferenceCase& c) {
                      c.options = kReferenceOptions;
                      c.reduction = Reduction::none;
                    })},
        SpecialCase{"statistics_smoothing",
                    statistics_special([](ReferenceCase& c) { c.options = kSmoothingOptions; })},
        SpecialCase{"statistics_huge_losses", statistics_special([](ReferenceCase& c) {
                      c.logits_sd = 40.0;
                      c.options = kSoftcap | kLogitScale;
                    })},
        SpecialCase{"statistics_nan_row", statistics_special([](ReferenceCase& c) {
                      c.nan_row = true;
                      c.reduction = Reduction::none;
                    })},
        SpecialCase{"statistics_several_chunks",
                    statistics_special([](ReferenceCase& c) { c.budget = std::size_t{3} << 20; })},
        // Below kReferenceStatisticsMinHidden the default keeps the row kernel for them; from
        // it on the default takes the statistics form.
        SpecialCase{"statistics_small_hidden_default", special([](ReferenceCase& c) {
                      c.statistics = true;
                      c.expected = false;
                    })},
        SpecialCase{"statistics_large_hidden_default",
                    [] {
                      ReferenceCase c;
                      c.rows = 77;
                      c.hidden = cuda::kReferenceStatisticsMinHidden;
                      c.vocab = 1031;
                      c.statistics = true;
                      return c;
                    }()},
        SpecialCase{"statistics_narrow", statistics_special([](ReferenceCase& c) {
                      c.rows = 77;
                      c.hidden = 8;
                      c.vocab = 7;
                    })},
        SpecialCase{"statistics_wide", statistics_special([](ReferenceCase& c) {
                      c.rows = 1000;
                      c.hidden = 64;
                      c.vocab = 32003;
                      c.options = kZLoss | kClassWeight;
                    })},
        SpecialCase{"bias", special([](ReferenceCase& c) {
                      c.bias = true;
                      c.expected = false;
                    })},
        SpecialCase{"fp16", special([](ReferenceCase& c) {
                      c.dtype = DType::f16;
                      c.expected = false;
                    })}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace xent::test
