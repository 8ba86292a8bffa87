// linear_ce (docs/semantics.md §2): the loss of x = h·Wᵀ + b with every §1 option, checked through
// linear_ce_forward (statistics), linear_ce_forward with gradients and linear_ce_backward, for each
// option and pair, reduction, dtype, chunk budget and special case.
#include <cmath>
#include <limits>

#include "linear_check.hpp"

namespace xent::test {
namespace {

struct LinearCeProblem {
  DType dtype = DType::f32;
  int64_t rows = 37, hidden = 67, vocab = 1031;
  int64_t hidden_stride = -1;
  unsigned options = 0;
  Reduction reduction = Reduction::mean;
  bool bias = true;
  Budget budget = Budget::default_budget;
  bool fp32_logits = false;
  bool fp32_param_grads = false;  // grads.weight / grads.bias in fp32
  bool ignored_rows = true, all_ignored = false, nan_row = false;
  bool targets_at_edges = false;
  bool unit_grad_output = false;
  bool caller_workspace = false;  // CPU: pass the queried workspace instead of none
  bool logits_cache = false;      // pass a caller-owned [N, V] cache to forward and backwards
  bool want_hidden = true, want_weight = true;
};

void check_linear_ce(const LinearCeProblem& p, Rng& rng) {
  const int64_t rows = p.rows, vocab = p.vocab;
  const DType param_dtype = p.fp32_param_grads ? DType::f32 : p.dtype;
  LinearLayer layer = make_linear_layer(rng, rows, p.hidden, vocab, p.bias, 2.0, p.dtype);
  const int64_t nan_row = p.nan_row && rows > 3 ? 3 : -1;
  if (nan_row >= 0) layer.hidden.at(nan_row, 1) = std::numeric_limits<double>::quiet_NaN();
  const std::vector<int64_t> target =
      make_targets(rng, rows, vocab, -100, p.ignored_rows, p.all_ignored, p.targets_at_edges);
  CeSetup setup = make_ce_setup(p.options, p.reduction, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, p.reduction, rows, p.unit_grad_output);

  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const reference::CeResult ref = reference::ce(logits, target, setup.spec, upstream);
  const reference::LinearGrads ref_grads =
      reference::linear_backward(ref.grad, layer.hidden, layer.weight);
  // PyTorch at this dtype: F.cross_entropy(h @ W.T + b) rounds the logits to the input dtype.
  const bool half = is_half(p.dtype);
  const reference::CeResult torch =
      half ? reference::ce(rounded(logits, p.dtype), target, setup.spec, upstream) : ref;
  const reference::LinearGrads torch_grads =
      half ? rounded_linear_backward(torch.grad, layer, p.dtype, param_dtype) : ref_grads;

  const Tensor hidden = Tensor::of(layer.hidden, p.dtype, p.hidden_stride);
  const Tensor weight = Tensor::of(layer.weight, p.dtype);
  const Tensor bias = p.bias ? Tensor::of(layer.bias, p.dtype) : Tensor();
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, p.reduction, rows, p.dtype);

  LinearCeOptions options;
  options.ce = setup.options;
  options.fp32_logits = p.fp32_logits;
  // A forward without gradients fills the cache; the backwards below read their logits from it.
  Tensor logits_cache =
      p.logits_cache ? Tensor::matrix(p.fp32_logits ? DType::f32 : p.dtype, rows, vocab) : Tensor();
  options.logits_cache = logits_cache.view();
  auto scratch_for = [&](const LinearCeOptions& o, bool with_gradients) {
    const bool query = on_gpu() || p.caller_workspace;
    return Scratch(query ? linear_ce_workspace_size(rows, p.hidden, vocab, p.dtype, o,
                                                    test_device(), with_gradients)
                         : 0);
  };
  options.workspace_budget = budget_bytes(p.budget, [&](std::size_t bytes) {
    LinearCeOptions trial = options;
    trial.workspace_budget = bytes;
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    LinearCeOutputs out;
    out.loss = loss.view();
    // With every gradient, the call that needs the most chunk memory per row.
    Tensor grad_h = Tensor::matrix(p.dtype, rows, p.hidden);
    Tensor grad_w = Tensor::matrix(param_dtype, vocab, p.hidden);
    Tensor grad_b = p.bias ? Tensor::vector(param_dtype, vocab) : Tensor();
    out.grads = {grad_h.view(), grad_w.view(), grad_b.view()};
    try {
      const Scratch scratch = scratch_for(trial, true);
      linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), trial, out,
                        {}, scratch.workspace());
      finish();
    } catch (const Error& e) {
      if (std::string(e.what()).find("workspace_budget") != std::string::npos) return false;
      throw;
    }
    return true;
  });
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget);

  const int64_t loss_skip = p.reduction == Reduction::none ? nan_row : -1;
  const bool loss_all_nan = nan_row >= 0 && p.reduction != Reduction::none;
  auto check_stat = [&](const char* what, const Tensor& t, const std::vector<double>& ref_values,
                        const std::vector<double>& torch_values, int64_t skip) {
    const std::vector<double> r = without_row(ref_values, 1, skip);
    EXPECT_TRUE(
        close(what, without_row(t.download(), 1, skip), r,
              stat_tolerance(p.dtype, Family::linear, without_row(torch_values, 1, skip), r)));
  };
  auto check_loss = [&](const Tensor& loss) {
    if (loss_all_nan) {
      EXPECT_TRUE(std::isnan(loss.download()[0])) << "a NaN row must make the reduced loss NaN";
      return;
    }
    check_stat("loss", loss, ref.loss, torch.loss, loss_skip);
  };
  auto check_grads = [&](const Tensor& grad_hidden, const Tensor& grad_weight,
                         const Tensor& grad_bias) {
    if (grad_hidden.present()) {
      const std::vector<double> r = without_row(ref_grads.hidden.values, p.hidden, nan_row);
      const std::vector<double> t = without_row(torch_grads.hidden.values, p.hidden, nan_row);
      EXPECT_TRUE(close("grads.hidden", without_row(grad_hidden.download(), p.hidden, nan_row), r,
                        grad_tolerance(p.dtype, Family::linear, t, r)));
      EXPECT_TRUE(grad_hidden.padding_untouched());
    }
    if (nan_row >= 0) return;  // ∂W and ∂b sum over rows: the NaN reaches all of them
    if (grad_weight.present()) {
      EXPECT_TRUE(close("grads.weight", grad_weight.download(), ref_grads.weight.values,
                        grad_tolerance(p.dtype, Family::linear, torch_grads.weight.values,
                                       ref_grads.weight.values)));
    }
    if (grad_bias.present()) {
      EXPECT_TRUE(
          close("grads.bias", grad_bias.download(), ref_grads.bias,
                bias_grad_tolerance(p.dtype, ref.grad, target, torch_grads.bias, ref_grads.bias)));
    }
  };

  const DType stat = result_dtype(p.dtype);
  Tensor lse = Tensor::vector(stat, rows);
  {
    SCOPED_TRACE("linear_ce_forward, statistics");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    Tensor logprob = Tensor::vector(stat, rows), entropy = Tensor::vector(stat, rows),
           argmax = Tensor::vector(DType::i64, rows), accuracy = Tensor::scalar(stat),
           z_value = loss_tensor(p.reduction, rows, p.dtype);
    LinearCeOutputs out;
    out.loss = loss.view();
    out.stats = {lse.view(),    logprob.view(),  entropy.view(),
                 argmax.view(), accuracy.view(), z_value.view()};
    const Scratch scratch = scratch_for(options, false);
    linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), options, out,
                      {}, scratch.workspace());
    finish();
    check_loss(loss);
    check_stat("lse", lse, ref.lse, torch.lse, nan_row);
    check_stat("logprob", logprob, ref.logprob, torch.logprob, nan_row);
    check_stat("entropy", entropy, ref.entropy, torch.entropy, nan_row);
    const std::vector<double> entropy_out = entropy.download();
    for (int64_t n = 0; n < rows; ++n) {
      if (target[n] == -100) {
        EXPECT_EQ(entropy_out[n], 0.0) << "entropy of ignored row " << n;
      }
    }
    if (!loss_all_nan) {
      check_stat("z_loss_value", z_value, ref.z_loss_value, torch.z_loss_value, loss_skip);
    }
    // Logits formed by fp32 products (rounded to bf16/fp16 in chunks) tie within this.
    const double tie = half ? 2e-2 : 1e-4;
    check_argmax_accuracy(argmax.download_integers(), accuracy.download()[0], target, -100, logits,
                          setup.spec, ref, nan_row, tie);
  }

  if (logits_cache.present()) {
    SCOPED_TRACE("logits_cache filled by the forward");
    const Matrix stored = half && !p.fp32_logits ? rounded(logits, p.dtype) : logits;
    EXPECT_TRUE(close("logits_cache", without_row(logits_cache.download(), vocab, nan_row),
                      without_row(stored.values, vocab, nan_row),
                      half && !p.fp32_logits ? 1e-2 : 1e-5));
  }

  Tensor grad_hidden =
      p.want_hidden ? Tensor::matrix(p.dtype, rows, p.hidden, p.hidden_stride) : Tensor();
  Tensor grad_weight = p.want_weight ? Tensor::matrix(param_dtype, vocab, p.hidden) : Tensor();
  Tensor grad_bias = p.want_weight && p.bias ? Tensor::vector(param_dtype, vocab) : Tensor();
  const LinearGradients grads{grad_hidden.view(), grad_weight.view(), grad_bias.view()};
  {
    SCOPED_TRACE("linear_ce_forward, with gradients");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    LinearCeOutputs out;
    out.loss = loss.view();
    out.grads = grads;
    const Scratch scratch = scratch_for(options, true);
    linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), options, out,
                      grad_output.view(), scratch.workspace());
    finish();
    check_loss(loss);
    check_grads(grad_hidden, grad_weight, grad_bias);
  }
  for (const bool with_lse : {true, false}) {
    SCOPED_TRACE(with_lse ? "linear_ce_backward with lse" : "linear_ce_backward without lse");
    for (Tensor* t : {&grad_hidden, &grad_weight, &grad_bias})
      if (t->present()) t->poison();
    const Scratch scratch = scratch_for(options, true);
    linear_ce_backward(hidden.view(), weight.view(), bias.view(), target_tensor.view(),
                       with_lse ? lse.view() : TensorView{}, grad_output.view(), options, grads,
                       scratch.workspace());
    finish();
    check_grads(grad_hidden, grad_weight, grad_bias);
  }
}

// ---- the grid: each option and every pair ----------------------------------------------------

class LinearCeGrid : public ::testing::TestWithParam<CeGridParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(LinearCeGrid, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearCeProblem p;
  std::tie(p.dtype, p.options, p.reduction) = GetParam();
  check_linear_ce(p, rng);
}

INSTANTIATE_TEST_SUITE_P(OptionsUpToPairs, LinearCeGrid,
                         ::testing::Combine(::testing::Values(DType::f32),
                                            ::testing::ValuesIn(ce_option_sets_up_to_pairs()),
                                            kAllReductions),
                         ce_grid_name);

INSTANTIATE_TEST_SUITE_P(EachOption, LinearCeGrid,
                         ::testing::Combine(::testing::Values(DType::bf16),
                                            ::testing::Values(0u, kSmoothing, kZLoss, kSoftcap,
                                                              kLogitScale, kClassWeight,
                                                              kRowWeight),
                                            kAllReductions),
                         ce_grid_name);

std::vector<DType> other_dtypes() {
  std::vector<DType> dtypes = {DType::f16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(OtherDtypes, LinearCeGrid,
                         ::testing::Combine(::testing::ValuesIn(other_dtypes()),
                                            ::testing::Values(0u, kAllCeOptions),
                                            ::testing::Values(Reduction::none, Reduction::mean)),
                         ce_grid_name);

// ---- chunk budgets and special cases ---------------------------------------------------------

enum class LinearCase {
  smallest_budget,
  several_chunks,
  uneven_chunks,
  no_bias,
  fp32_logits,
  fp32_param_grads,
  all_rows_ignored,
  empty_batch,
  nan_row,
  padded_hidden,
  absent_grad_output,
  caller_workspace,
  logits_cache,
  hidden_grad_only,
  weight_grads_only,
  wide_vocab,
  all_options,
  targets_at_edges,
  smallest_budget_cache,
  smallest_budget_fp32_logits,
};

const char* case_name(LinearCase c) {
  static const char* names[] = {"smallest_budget",
                                "several_chunks",
                                "uneven_chunks",
                                "no_bias",
                                "fp32_logits",
                                "fp32_param_grads",
                                "all_rows_ignored",
                                "empty_batch",
                                "nan_row",
                                "padded_hidden",
                                "absent_grad_output",
                                "caller_workspace",
                                "logits_cache",
                                "hidden_grad_only",
                                "weight_grads_only",
                                "vocab5003",
                                "all_options",
                                "targets_at_edges",
                                "smallest_budget_cache",
                                "smallest_budget_fp32_logits"};
  return names[static_cast<int>(c)];
}

using CaseParam = std::tuple<DType, LinearCase, Reduction>;
class LinearCeCases : public ::testing::TestWithParam<CaseParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(LinearCeCases, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearCeProblem p;
  LinearCase which;
  std::tie(p.dtype, which, p.reduction) = GetParam();
  switch (which) {
    case LinearCase::smallest_budget:
      p.budget = Budget::smallest;
      p.rows = 11;
      break;
    case LinearCase::several_chunks:
      p.budget = Budget::several_chunks;
      break;
    case LinearCase::uneven_chunks:
      p.budget = Budget::uneven_chunks;
      p.options = kSmoothing | kZLoss;
      break;
    case LinearCase::no_bias:
      p.bias = false;
      break;
    case LinearCase::fp32_logits:
      p.fp32_logits = true;
      break;
    case LinearCase::fp32_param_grads:
      p.fp32_param_grads = true;
      break;
    case LinearCase::all_rows_ignored:
      p.all_ignored = true;
      break;
    case LinearCase::empty_batch:
      p.rows = 0;
      break;
    case LinearCase::nan_row:
      p.nan_row = true;
      break;
    case LinearCase::padded_hidden:
      p.hidden_stride = p.hidden + 5;
      break;
    case LinearCase::absent_grad_output:
      p.unit_grad_output = true;
      break;
    case LinearCase::caller_workspace:
      p.caller_workspace = true;
      p.budget = Budget::several_chunks;
      break;
    case LinearCase::logits_cache:
      p.logits_cache = true;
      break;
    case LinearCase::hidden_grad_only:
      p.want_weight = false;
      break;
    case LinearCase::weight_grads_only:
      p.want_hidden = false;
      break;
    case LinearCase::wide_vocab:
      p.rows = 7;
      p.vocab = 5003;
      break;
    case LinearCase::all_options:
      p.options = kAllCeOptions;
      p.budget = Budget::uneven_chunks;
      break;
    case LinearCase::targets_at_edges:
      p.targets_at_edges = true;
      p.options = kSmoothing;
      break;
    // On CUDA the smallest budget takes the vocabulary-blocked schedule: its ∂W pass then reads
    // each block from the logits cache, or narrows fp32 block logits before the products.
    case LinearCase::smallest_budget_cache:
      p.budget = Budget::smallest;
      p.rows = 11;
      p.logits_cache = true;
      break;
    case LinearCase::smallest_budget_fp32_logits:
      p.budget = Budget::smallest;
      p.rows = 11;
      p.fp32_logits = true;
      break;
  }
  check_linear_ce(p, rng);
}

std::string case_param_name(const ::testing::TestParamInfo<CaseParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + case_name(std::get<1>(info.param)) + "_" +
         reduction_label(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    Special, LinearCeCases,
    ::testing::Combine(
        ::testing::Values(DType::f32, DType::bf16),
        ::testing::Values(
            LinearCase::smallest_budget, LinearCase::several_chunks, LinearCase::uneven_chunks,
            LinearCase::no_bias, LinearCase::fp32_logits, LinearCase::fp32_param_grads,
            LinearCase::all_rows_ignored, LinearCase::empty_batch, LinearCase::nan_row,
            LinearCase::padded_hidden, LinearCase::absent_grad_output, LinearCase::caller_workspace,
            LinearCase::logits_cache, LinearCase::hidden_grad_only, LinearCase::weight_grads_only,
            LinearCase::wide_vocab, LinearCase::all_options, LinearCase::targets_at_edges,
            LinearCase::smallest_budget_cache, LinearCase::smallest_budget_fp32_logits),
        ::testing::Values(Reduction::none, Reduction::mean)),
    case_param_name);

}  // namespace
}  // namespace xent::test
