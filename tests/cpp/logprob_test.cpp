// Differentiable log-probability and entropy (semantics §1): the forward's logprob and entropy
// statistics at a temperature, and the backward given upstream gradients of both
// (EntropyGradient), on logits and fused with the linear layer, against the float64 reference.
#include <cmath>

#include "linear_check.hpp"
#if XENT_TEST_ON_GPU
#include "cuda/plan/linear_ce_plan.hpp"
#include "gpu_support.hpp"
#endif

namespace xent::test {
namespace {

// Upstream gradients g_lp and g_H of the two per-row outputs.
struct RowGradients {
  std::vector<double> logprob, entropy;
};

RowGradients make_row_gradients(Rng& rng, int64_t rows) {
  RowGradients g;
  for (int64_t n = 0; n < rows; ++n) {
    g.logprob.push_back(round_to(DType::f32, rng.uniform(-2.0, 2.0)));
    g.entropy.push_back(round_to(DType::f32, rng.uniform(-2.0, 2.0)));
  }
  return g;
}

std::vector<double> negated(std::vector<double> values) {
  for (double& v : values) v = -v;
  return values;
}

// ∂(Σ g_n·ℓ_n + g_H,n·H_n)/∂x with g = −g_lp when the loss is plain: ℓ = −logprob.
Matrix reference_gradient(const Matrix& logits, const std::vector<int64_t>& target,
                          const reference::CeSpec& spec, const RowGradients& g) {
  Matrix grad = reference::ce(logits, target, spec, {true, negated(g.logprob)}).grad;
  const Matrix entropy = reference::entropy_grad(logits, target, spec, g.entropy);
  for (std::size_t i = 0; i < grad.values.size(); ++i) grad.values[i] += entropy.values[i];
  return grad;
}

// Entropy of ignored rows: 0 or the row's value are both accepted here (the statistic of an
// ignored row is fixed elsewhere; the bindings return 0).
std::vector<double> entropy_reference(const reference::CeResult& ref,
                                      const std::vector<int64_t>& target,
                                      const std::vector<double>& out) {
  std::vector<double> expected = ref.entropy;
  for (std::size_t n = 0; n < target.size(); ++n)
    if (target[n] == -100 && out[n] == 0.0) expected[n] = 0.0;
  return expected;
}

// The forward's per-row outputs: the statistics under test and what the backward reads.
struct RowOutputs {
  Tensor loss, lse, logprob, entropy;
  explicit RowOutputs(int64_t rows)
      : loss(Tensor::vector(DType::f32, rows)),
        lse(Tensor::vector(DType::f32, rows)),
        logprob(Tensor::vector(DType::f32, rows)),
        entropy(Tensor::vector(DType::f32, rows)) {}
  CeStats stats() const {
    CeStats stats;
    stats.lse = lse.view();
    stats.logprob = logprob.view();
    stats.entropy = entropy.view();
    return stats;
  }
};

// "<dtype>_T<100·temperature>_<label>" for the grids below.
std::string label_of(unsigned options) { return ce_options_label(options); }
std::string label_of(Budget budget) { return budget_name(budget); }
template <class Param>
std::string grid_name(const ::testing::TestParamInfo<Param>& info) {
  return short_name(std::get<0>(info.param)) + "_T" +
         std::to_string(static_cast<int>(std::get<1>(info.param) * 100)) + "_" +
         label_of(std::get<2>(info.param));
}

// ---- on logits --------------------------------------------------------------------------------

// temperature: logit_scale = 1/T; options: further §1 options of the loss the entropy term joins.
using LogitsParam = std::tuple<DType, double, unsigned>;

class LogprobLogits : public ::testing::TestWithParam<LogitsParam> {};

TEST_P(LogprobLogits, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  const auto [dtype, temperature, options] = GetParam();
  const int64_t rows = 37, vocab = 1031;
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  const Matrix x = rounded(rng.matrix(rows, vocab, 2.0), dtype);
  CeSetup setup = make_ce_setup(options, Reduction::none, -100, rows, vocab, rng);
  setup.options.logit_scale = 1.0 / temperature;
  setup.spec.logit_scale = setup.options.logit_scale;
  const RowGradients g = make_row_gradients(rng, rows);
  const reference::CeResult ref = reference::ce(x, target, setup.spec, {});
  const Matrix ref_grad = reference_gradient(x, target, setup.spec, g);

  const Tensor logits = Tensor::of(x, dtype);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Scratch scratch(ce_workspace_size(rows, vocab, setup.options, test_device()));
  const RowOutputs row_outputs(rows);
  const Tensor &lse = row_outputs.lse, &logprob = row_outputs.logprob,
               &entropy = row_outputs.entropy;
  CeOutputs out;
  out.loss = row_outputs.loss.view();
  out.stats = row_outputs.stats();
  ce_forward(logits.view(), target_tensor.view(), setup.options, out, {}, scratch.workspace());
  finish();
  const double stat_tol = stat_tolerance(dtype, Family::logits, {}, ref.logprob);
  EXPECT_TRUE(close("logprob", logprob.download(), ref.logprob, stat_tol));
  const std::vector<double> entropy_out = entropy.download();
  EXPECT_TRUE(close("entropy", entropy_out, entropy_reference(ref, target, entropy_out), stat_tol));

  const Tensor grad_output = Tensor::of(negated(g.logprob), DType::f32);
  const Tensor grad_entropy = Tensor::of(g.entropy, DType::f32);
  Tensor grad = Tensor::matrix(dtype, rows, vocab);
  grad.poison();
  ce_backward(logits.view(), target_tensor.view(), lse.view(), grad_output.view(),
              EntropyGradient{entropy.view(), grad_entropy.view()}, setup.options, grad.view(),
              scratch.workspace());
  finish();
  const double grad_tol =
      grad_tolerance(dtype, Family::logits, rounded(ref_grad.values, dtype), ref_grad.values);
  EXPECT_TRUE(close("grad_logits", grad.download(), ref_grad.values, grad_tol));
}

INSTANTIATE_TEST_SUITE_P(Grid, LogprobLogits,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                                            ::testing::Values(1.0, 0.7, 1.6),
                                            ::testing::Values(0u, kSoftcap,
                                                              kSmoothing | kZLoss | kRowWeight)),
                         grid_name<LogitsParam>);

TEST(LogprobErrors, EntropyGradientNeedsNoneAndLse) {
  const int64_t rows = 3, vocab = 5;
  const Tensor logits = Tensor::matrix(DType::f32, rows, vocab);
  const Tensor target = Tensor::of_integers({0, 1, 2}, DType::i64);
  const Tensor row = Tensor::vector(DType::f32, rows), other = Tensor::vector(DType::f32, rows);
  const Tensor short_row = Tensor::vector(DType::f32, rows - 1);
  Tensor grad = Tensor::matrix(DType::f32, rows, vocab);
  CeOptions options;
  options.reduction = Reduction::none;
  const Scratch scratch(ce_workspace_size(rows, vocab, options, test_device()));
  expect_invalid(
      [&] {
        ce_backward(logits.view(), target.view(), {}, row.view(), {other.view(), row.view()},
                    options, grad.view(), scratch.workspace());
      },
      "lse", "missing");
  expect_invalid(
      [&] {
        ce_backward(logits.view(), target.view(), row.view(), row.view(),
                    {other.view(), short_row.view()}, options, grad.view(), scratch.workspace());
      },
      "entropy.grad", "[2]");
  CeOptions mean = options;
  mean.reduction = Reduction::mean;
  const Tensor scalar = Tensor::scalar(DType::f32);
  expect_invalid(
      [&] {
        ce_backward(logits.view(), target.view(), row.view(), scalar.view(),
                    {other.view(), row.view()}, mean, grad.view(), scratch.workspace());
      },
      "entropy", "mean");
}

// ---- fused with the linear layer --------------------------------------------------------------

// Runs of the CUDA backward's schedule (d) and of the fused gradient product so far (zeros off
// the GPU build).
struct BackwardRuns {
  int64_t blocks = 0, fused = 0;
};

BackwardRuns backward_runs() {
#if XENT_TEST_ON_GPU
  return {cuda::linear_ce_runs(cuda::Schedule::statistics_blocks), cuda::fused_grad_count()};
#else
  return {};
#endif
}

// On a Hopper GPU: one run of schedule (d) between the two counts, and a fused gradient product
// unless every row's logits were read from a cache (elsewhere both decline and the cuBLASLt
// schedules run).
void expect_statistics_blocks([[maybe_unused]] const BackwardRuns& before,
                              [[maybe_unused]] const BackwardRuns& after,
                              [[maybe_unused]] bool all_cached) {
#if XENT_TEST_ON_GPU
  if (!hopper_paths_here()) return;
  EXPECT_EQ(after.blocks - before.blocks, 1) << "schedule (d) did not run";
  if (all_cached) {
    EXPECT_EQ(after.fused, before.fused) << "a fused gradient product formed cached rows again";
  } else {
    EXPECT_GT(after.fused, before.fused) << "the fused gradient product did not run";
  }
#endif
}

// The smallest power-of-two budget at which the CUDA planner takes schedule (d) for this backward
// (the budget of a case that must take it).
std::size_t statistics_blocks_budget([[maybe_unused]] int64_t rows, [[maybe_unused]] int64_t hidden,
                                     [[maybe_unused]] int64_t vocab, [[maybe_unused]] DType dtype,
                                     const LinearCeOptions& options,
                                     [[maybe_unused]] const LinearGradients& grads) {
#if XENT_TEST_ON_GPU
  LinearCeOptions trial = options;
  for (std::size_t bytes = std::size_t{16} << 10; bytes <= (std::size_t{256} << 20); bytes *= 2) {
    trial.workspace_budget = bytes;
    const cuda::ChunkPlan plan =
        cuda::linear_ce_chunk_plan(rows, hidden, vocab, dtype, trial, grads, true);
    if (plan.fits_budget && plan.schedule == cuda::Schedule::statistics_blocks) return bytes;
  }
  ADD_FAILURE() << "no budget up to 256 MiB takes schedule (d)";
#endif
  return options.workspace_budget;
}

// Cache: the forward fills options.logits_cache with the logits of its rows [0, R) and the
// backward reads them there (row chunks and, at the smallest budget, vocabulary blocks) instead
// of recomputing them, recomputing the other rows': no cache, a cache of no rows, of some rows (a
// count no chunk size divides, so chunks and tiles cross row R), of all rows.
enum class Cache { none, no_rows, some_rows, all_rows };
using LinearParam = std::tuple<DType, double, Budget, Cache>;

std::string linear_grid_name(const ::testing::TestParamInfo<LinearParam>& info) {
  static const char* const suffix[] = {"", "_cache0", "_cache_some", "_cache"};
  return grid_name(info) + suffix[static_cast<int>(std::get<3>(info.param))];
}

// The layer's sizes and the rows a "some rows" cache holds.
struct LayerShape {
  int64_t rows, hidden, vocab, some_rows;
};

// What a case asserts of the backward's path: nothing, or (on a Hopper GPU) schedule (d) with the
// fused gradient product, at a budget chosen for that schedule instead of `budget`.
enum class BackwardPath { any, statistics_blocks };

void check_linear_logprobs(DType dtype, double temperature, Budget budget, Cache cache,
                           const LayerShape& shape, BackwardPath path, Rng& rng) {
  const int64_t rows = shape.rows, hidden_size = shape.hidden, vocab = shape.vocab;
  const LinearLayer layer = make_linear_layer(rng, rows, hidden_size, vocab, true, 2.0, dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  reference::CeSpec spec;
  spec.reduction = Reduction::none;
  spec.logit_scale = 1.0 / temperature;
  const RowGradients g = make_row_gradients(rng, rows);

  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const reference::CeResult ref = reference::ce(logits, target, spec, {});
  const reference::LinearGrads ref_grads = reference::linear_backward(
      reference_gradient(logits, target, spec, g), layer.hidden, layer.weight);
  // PyTorch at this dtype rounds the logits (h @ W.T + b) to the input dtype.
  const bool half = is_half(dtype);
  const Matrix torch_logits = half ? rounded(logits, dtype) : logits;
  const reference::CeResult torch = reference::ce(torch_logits, target, spec, {});
  const reference::LinearGrads torch_grads = rounded_linear_backward(
      reference_gradient(torch_logits, target, spec, g), layer, dtype, dtype);

  const Tensor hidden = Tensor::of(layer.hidden, dtype), weight = Tensor::of(layer.weight, dtype);
  const Tensor bias = Tensor::of(layer.bias, dtype);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = Tensor::of(negated(g.logprob), DType::f32);
  const Tensor grad_entropy = Tensor::of(g.entropy, DType::f32);
  LinearCeOptions options;
  options.ce.reduction = Reduction::none;
  options.ce.logit_scale = spec.logit_scale;
  const int64_t cache_rows = cache == Cache::all_rows    ? rows
                             : cache == Cache::some_rows ? shape.some_rows
                                                         : 0;
  Tensor logits_cache = Tensor::matrix(dtype, cache_rows, cache == Cache::none ? 0 : vocab);
  if (cache != Cache::none) {
    logits_cache.poison();  // the forward must write every element the backward reads
    options.logits_cache = logits_cache.view();
  }
  auto scratch_for = [&](const LinearCeOptions& o, bool with_gradients) {
    return Scratch(on_gpu() ? linear_ce_workspace_size(rows, hidden_size, vocab, dtype, o,
                                                       test_device(), with_gradients)
                            : 0);
  };

  // Forward: loss and statistics, no gradient (reduction none forms it in the backward).
  const RowOutputs row_outputs(rows);
  const Tensor &lse = row_outputs.lse, &logprob = row_outputs.logprob,
               &entropy = row_outputs.entropy;
  LinearCeOutputs out;
  out.loss = row_outputs.loss.view();
  out.stats = row_outputs.stats();
  {
    const Scratch scratch = scratch_for(options, false);
    linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), options, out,
                      {}, scratch.workspace());
    finish();
  }
  EXPECT_TRUE(close("logprob", logprob.download(), ref.logprob,
                    stat_tolerance(dtype, Family::linear, torch.logprob, ref.logprob)));
  const std::vector<double> entropy_out = entropy.download();
  const std::vector<double> entropy_ref = entropy_reference(ref, target, entropy_out);
  EXPECT_TRUE(close("entropy", entropy_out, entropy_ref,
                    stat_tolerance(dtype, Family::linear,
                                   entropy_reference(torch, target, entropy_out), entropy_ref)));

  Tensor grad_h = Tensor::matrix(dtype, rows, hidden_size);
  Tensor grad_w = Tensor::matrix(dtype, vocab, hidden_size);
  Tensor grad_b = Tensor::vector(dtype, vocab);
  const LinearGradients grads{grad_h.view(), grad_w.view(), grad_b.view()};
  const EntropyGradient entropy_grad{entropy.view(), grad_entropy.view()};
  auto backward = [&](const LinearCeOptions& o) {
    const Scratch scratch = scratch_for(o, true);
    linear_ce_backward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), lse.view(),
                       grad_output.view(), entropy_grad, o, grads, scratch.workspace());
    finish();
  };
  if (path == BackwardPath::statistics_blocks) {
    options.workspace_budget =
        statistics_blocks_budget(rows, hidden_size, vocab, dtype, options, grads);
  } else {
    options.workspace_budget = budget_bytes(budget, [&](std::size_t bytes) {
      LinearCeOptions trial = options;
      trial.workspace_budget = bytes;
      try {
        backward(trial);
      } catch (const Error& e) {
        if (std::string(e.what()).find("workspace_budget") != std::string::npos) return false;
        throw;
      }
      return true;
    });
  }
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget);
  grad_h.poison();
  grad_w.poison();
  grad_b.poison();
  const BackwardRuns before = backward_runs();
  backward(options);
  if (path == BackwardPath::statistics_blocks) {
    expect_statistics_blocks(before, backward_runs(), cache == Cache::all_rows);
  }
  const std::pair<const Tensor*, std::pair<const std::vector<double>*, const std::vector<double>*>>
      checks[] = {{&grad_h, {&ref_grads.hidden.values, &torch_grads.hidden.values}},
                  {&grad_w, {&ref_grads.weight.values, &torch_grads.weight.values}},
                  {&grad_b, {&ref_grads.bias, &torch_grads.bias}}};
  const char* names[] = {"grads.hidden", "grads.weight", "grads.bias"};
  for (int k = 0; k < 3; ++k) {
    const auto& [tensor, values] = checks[k];
    EXPECT_TRUE(close(names[k], tensor->download(), *values.first,
                      grad_tolerance(dtype, Family::linear, *values.second, *values.first)));
  }
}

class LogprobLinear : public ::testing::TestWithParam<LinearParam> {};

TEST_P(LogprobLinear, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  const auto [dtype, temperature, budget, cache] = GetParam();
  check_linear_logprobs(dtype, temperature, budget, cache, {37, 67, 1031, 13}, BackwardPath::any,
                        rng);
}

// Aligned bf16 operands, which the Hopper products take, at a budget where the backward takes
// schedule (d): its vocabulary-block tiles read the cached rows' logits (a tile across the cache's
// end, row 137, forms the others by the fused gradient product).
class LogprobLinearBlocks : public ::testing::TestWithParam<Cache> {};

TEST_P(LogprobLinearBlocks, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  check_linear_logprobs(DType::bf16, 0.7, Budget::smallest, GetParam(), {300, 64, 2053, 137},
                        on_gpu() ? BackwardPath::statistics_blocks : BackwardPath::any, rng);
}

std::string cache_name(const ::testing::TestParamInfo<Cache>& info) {
  static const char* const names[] = {"none", "no_rows", "some_rows", "all_rows"};
  return names[static_cast<int>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Caches, LogprobLinearBlocks,
                         ::testing::Values(Cache::none, Cache::some_rows, Cache::all_rows),
                         cache_name);

TEST(LogprobErrors, LogitsCacheHoldsAtMostTheRows) {
  const int64_t rows = 3, hidden_size = 4, vocab = 5;
  const Tensor hidden = Tensor::matrix(DType::f32, rows, hidden_size);
  const Tensor weight = Tensor::matrix(DType::f32, vocab, hidden_size);
  const Tensor target = Tensor::of_integers({0, 1, 2}, DType::i64);
  const RowOutputs row_outputs(rows);
  LinearCeOutputs out;
  out.loss = row_outputs.loss.view();
  LinearCeOptions options;
  options.ce.reduction = Reduction::none;
  const Tensor too_many = Tensor::matrix(DType::f32, rows + 1, vocab);
  options.logits_cache = too_many.view();
  auto forward = [&] {
    const Scratch scratch(on_gpu() ? linear_ce_workspace_size(rows, hidden_size, vocab, DType::f32,
                                                              options, test_device(), false)
                                   : 0);
    linear_ce_forward(hidden.view(), weight.view(), {}, target.view(), options, out, {},
                      scratch.workspace());
  };
  expect_invalid(forward, "logits_cache", "more rows");
  const Tensor narrow = Tensor::matrix(DType::f32, rows, vocab - 1);
  options.logits_cache = narrow.view();
  expect_invalid(forward, "logits_cache", "wrong shape");
}

INSTANTIATE_TEST_SUITE_P(
    Grid, LogprobLinear,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16), ::testing::Values(1.0, 0.6),
                       ::testing::Values(Budget::default_budget, Budget::smallest,
                                         Budget::several_chunks, Budget::uneven_chunks),
                       ::testing::Values(Cache::none, Cache::no_rows, Cache::some_rows,
                                         Cache::all_rows)),
    linear_grid_name);

}  // namespace
}  // namespace xent::test
