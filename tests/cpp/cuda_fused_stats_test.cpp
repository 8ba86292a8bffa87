// GPU-only cases of the fused statistics product (src/cuda/fused_stats*.cu): a linear_ce forward
// without gradients on a compute capability 9.0 device runs as one CUTLASS sm_90a product whose
// epilogue reduces the logits to per-tile row statistics. Odd shapes (N not a multiple of the
// 128-row tile, V not a multiple of the 256-column tile, H down to one 16-byte TMA row), bf16 and
// fp16, every option the path takes, every reduction and statistic, against the float64
// reference, with outputs NaN-poisoned before the run. Each case also asserts which path ran,
// through the process-wide count of fused forwards (fused_stats.hpp): the fused path where it
// must run, the cuBLASLt path where it must not (unaligned rows, the fused_statistics = off
// switch). Off compute capability 9.0 the path assertions are skipped and
// the numerical checks run on the fallback.
#include <optional>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>

#include "cuda/sm90/fused_stats.hpp"
#include "gpu_support.hpp"
#include "linear_check.hpp"
#include "hook_scope.hpp"

namespace xent::test {
namespace {

enum class Path { fused, fallback };

struct FusedCase {
  DType dtype = DType::bf16;
  int64_t rows = 77, hidden = 64, vocab = 129;
  int64_t hidden_stride = -1;
  unsigned options = 0;
  Reduction reduction = Reduction::mean;
  bool bias = false;
  // The test hook's fused_statistics for the call: on takes the fused path whenever the call is
  // eligible (so every option reaches the epilogue), off never, planned leaves the policy of
  // fused_stats_preferred to choose.
  cuda::Forced fused_switch = cuda::Forced::on;
  std::size_t budget = 0;  // 0: the default workspace budget
  // false: only the loss, lse, logprob and z-loss value are asked for, so (without label
  // smoothing) the product forms max and Σe alone (the lean epilogue without extras).
  bool all_stats = true;
  Path expected = Path::fused;
};

void check_fused_forward(const FusedCase& c, Rng& rng) {
  const int64_t rows = c.rows, vocab = c.vocab;
  const LinearLayer layer = make_linear_layer(rng, rows, c.hidden, vocab, c.bias, 2.0, c.dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, true);
  CeSetup setup = make_ce_setup(c.options, c.reduction, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, c.reduction, rows, true);
  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const reference::CeResult ref = reference::ce(logits, target, setup.spec, upstream);
  // PyTorch at this dtype rounds the logits; so do both paths (the fused one in its epilogue).
  const reference::CeResult torch =
      reference::ce(rounded(logits, c.dtype), target, setup.spec, upstream);

  const Tensor hidden = Tensor::of(layer.hidden, c.dtype, c.hidden_stride);
  const Tensor weight = Tensor::of(layer.weight, c.dtype);
  const Tensor bias = c.bias ? Tensor::of(layer.bias, c.dtype) : Tensor();
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  LinearCeOptions options;
  options.ce = setup.options;
  if (c.budget > 0) options.workspace_budget = c.budget;

  const DType stat = result_dtype(c.dtype);
  Tensor loss = loss_tensor(c.reduction, rows, c.dtype);
  Tensor lse = Tensor::vector(stat, rows), logprob = Tensor::vector(stat, rows),
         entropy = Tensor::vector(stat, rows), argmax = Tensor::vector(DType::i64, rows),
         accuracy = Tensor::scalar(stat), z_value = loss_tensor(c.reduction, rows, c.dtype);
  for (Tensor* t : {&loss, &lse, &logprob, &entropy, &argmax, &accuracy, &z_value}) t->poison();
  LinearCeOutputs out;
  out.loss = loss.view();
  out.stats = {lse.view(),    logprob.view(),  entropy.view(),
               argmax.view(), accuracy.view(), z_value.view()};
  if (!c.all_stats) out.stats.entropy = out.stats.argmax = out.stats.accuracy = TensorView();

  std::optional<HookScope> hook(std::in_place);
  (*hook)->fused_statistics = c.fused_switch;
  const Scratch scratch(
      linear_ce_workspace_size(rows, c.hidden, vocab, c.dtype, options, test_device(), false));
  const int64_t before = cuda::fused_stats_forward_count();
  linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), options, out,
                    {}, scratch.workspace());
  finish();
  const int64_t ran = cuda::fused_stats_forward_count() - before;
  hook.reset();
  if (hopper_paths_here()) {
    EXPECT_EQ(ran, c.expected == Path::fused ? 1 : 0)
        << (c.expected == Path::fused ? "the fused statistics product did not run"
                                      : "the fused statistics product ran where it must not");
  } else {
    EXPECT_EQ(ran, 0) << "the fused product ran on a device other than compute capability 9.0";
  }

  auto check_stat = [&](const char* what, const Tensor& t, const std::vector<double>& r,
                        const std::vector<double>& torch_values) {
    EXPECT_TRUE(
        close(what, t.download(), r, stat_tolerance(c.dtype, Family::linear, torch_values, r)));
  };
  check_stat("loss", loss, ref.loss, torch.loss);
  check_stat("lse", lse, ref.lse, torch.lse);
  check_stat("logprob", logprob, ref.logprob, torch.logprob);
  check_stat("z_loss_value", z_value, ref.z_loss_value, torch.z_loss_value);
  if (!c.all_stats) return;
  check_stat("entropy", entropy, ref.entropy, torch.entropy);
  const std::vector<double> lse_out = lse.download(), entropy_out = entropy.download();
  const std::vector<int64_t> arg = argmax.download_integers();
  int64_t valid = 0, correct = 0;
  for (int64_t n = 0; n < rows; ++n) {
    if (target[n] == -100) {
      EXPECT_EQ(arg[n], -1) << "argmax of ignored row " << n;
      EXPECT_EQ(lse_out[n], 0.0) << "lse of ignored row " << n;
      EXPECT_EQ(entropy_out[n], 0.0) << "entropy of ignored row " << n;
      continue;
    }
    ++valid;
    ASSERT_TRUE(arg[n] >= 0 && arg[n] < vocab) << "argmax row " << n << " = " << arg[n];
    correct += arg[n] == target[n];
    // fp32 products of bf16/fp16 operands in another summation order: near-ties may swap. Both
    // paths round the logits to the operands' type first (relative 2^-8 for bf16, 2^-11 for
    // fp16, once on each of the two values compared), so ties within that rounding may swap too.
    const double chosen = ce_transformed(setup.spec, logits.at(n, arg[n]));
    const double tie = c.dtype == DType::bf16 ? 0x1p-7 : 0x1p-10;
    EXPECT_LE(std::abs(chosen - ref.transformed_max[n]), tie * (1 + std::abs(chosen)))
        << "argmax row " << n << ": got " << arg[n] << ", expected " << ref.argmax[n];
  }
  EXPECT_NEAR(accuracy.download()[0], valid ? double(correct) / double(valid) : 0.0, 1e-6);
}

// (dtype, N, H, V, options, reduction)
using FusedShapeCase = std::tuple<DType, int64_t, int64_t, int64_t, unsigned, Reduction>;

class CudaFusedStats : public ::testing::TestWithParam<FusedShapeCase> {};

TEST_P(CudaFusedStats, MatchesReference) {
  require_device();
  const auto [dtype, rows, hidden, vocab, options, reduction] = GetParam();
  XENT_TEST_RNG(rng);
  FusedCase c;
  c.dtype = dtype;
  c.rows = rows;
  c.hidden = hidden;
  c.vocab = vocab;
  c.options = options;
  c.reduction = reduction;
  check_fused_forward(c, rng);
}

std::string fused_case_name(const ::testing::TestParamInfo<FusedShapeCase>& info) {
  const auto [dtype, rows, hidden, vocab, options, reduction] = info.param;
  return short_name(dtype) + "_" + linear_case_label(rows, hidden, vocab, options, reduction);
}

// Every option of docs/semantics.md §1: class weights too (w_y and W in the merge, Σ w·x̃ in the epilogue
// where label smoothing needs it).
constexpr unsigned kFusedOptions = kAllCeOptions;

// Shapes: V = 1 and 7 (one partial column tile), 129 and 4099 (a residue tile past a multiple
// of 128 / 256), 32003 (126 tiles); N = 77 and 1000 (a residue row tile); H = 8 (one 16-byte
// row, far below the 64-wide K tile), 136 and 1032 (a K residue).
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaFusedStats,
    ::testing::Values(FusedShapeCase{DType::bf16, 77, 8, 1, 0, Reduction::mean},
                      FusedShapeCase{DType::f16, 77, 64, 7, kFusedOptions, Reduction::sum},
                      FusedShapeCase{DType::bf16, 1000, 136, 129, 0, Reduction::none},
                      FusedShapeCase{DType::f16, 1000, 64, 129, kFusedOptions, Reduction::mean},
                      FusedShapeCase{DType::bf16, 77, 1032, 4099, kFusedOptions, Reduction::none},
                      FusedShapeCase{DType::f16, 300, 136, 4099, 0, Reduction::sum},
                      FusedShapeCase{DType::bf16, 1000, 64, 32003, kFusedOptions, Reduction::mean},
                      FusedShapeCase{DType::f16, 77, 136, 32003, kSoftcap | kLogitScale,
                                     Reduction::none}),
    fused_case_name);

// 200 rows (a residue row tile) of H = 72 (a K residue) with these options and vocabulary.
void check_option_case(DType dtype, unsigned options, int64_t vocab, Reduction reduction,
                       bool all_stats) {
  require_device();
  XENT_TEST_RNG(rng);
  FusedCase c;
  c.dtype = dtype;
  c.rows = 200;
  c.hidden = 72;
  c.vocab = vocab;
  c.options = options;
  c.reduction = reduction;
  c.all_stats = all_stats;
  check_fused_forward(c, rng);
}

// Every option alone and the fused set, in both dtypes, at a shape with residues in N and V.
class CudaFusedStatsOptions
    : public ::testing::TestWithParam<std::tuple<DType, unsigned, Reduction>> {};

TEST_P(CudaFusedStatsOptions, MatchesReference) {
  const auto [dtype, options, reduction] = GetParam();
  check_option_case(dtype, options, 1031, reduction, true);
}

INSTANTIATE_TEST_SUITE_P(
    Options, CudaFusedStatsOptions,
    ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                       ::testing::Values(0u, kSmoothing, kZLoss, kSoftcap, kLogitScale,
                                         kClassWeight, kRowWeight, kClassWeight | kSmoothing,
                                         kFusedOptions),
                       ::testing::Values(Reduction::none, Reduction::sum, Reduction::mean)),
    [](const auto& info) {
      return short_name(std::get<0>(info.param)) + "_" + ce_options_label(std::get<1>(info.param)) +
             "_" + reduction_label(std::get<2>(info.param));
    });

// Only the loss and lse-based statistics asked for: the lean epilogue (max and Σe per tile) with
// each transform, at a vocabulary with a partial last tile (1031) and at whole tiles only (2048).
class CudaFusedStatsLean
    : public ::testing::TestWithParam<std::tuple<DType, unsigned, int64_t, Reduction>> {};

TEST_P(CudaFusedStatsLean, MatchesReference) {
  const auto [dtype, options, vocab, reduction] = GetParam();
  check_option_case(dtype, options, vocab, reduction, false);
}

INSTANTIATE_TEST_SUITE_P(
    Lean, CudaFusedStatsLean,
    ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                       ::testing::Values(0u, kZLoss, kSoftcap, kLogitScale, kClassWeight,
                                         kZLoss | kSoftcap | kLogitScale | kRowWeight),
                       ::testing::Values(int64_t{1031}, int64_t{2048}),
                       ::testing::Values(Reduction::none, Reduction::mean)),
    [](const auto& info) {
      return short_name(std::get<0>(info.param)) + "_" + ce_options_label(std::get<1>(info.param)) +
             "_V" + std::to_string(std::get<2>(info.param)) + "_" +
             reduction_label(std::get<3>(info.param));
    });

// Rows whose logits are NaN, ±Inf or huge (an fp32 product of bf16/fp16 values near their
// largest overflows): the fused path's per-tile statistics hand these to the exact per-element
// path, and must give what the cuBLASLt path gives: the same NaN and infinite outputs, the same
// argmax, close finite values. (The float64 reference cannot stand in: its products do not
// overflow.)
class CudaFusedStatsNonFinite : public ::testing::TestWithParam<std::tuple<DType, bool>> {};

TEST_P(CudaFusedStatsNonFinite, MatchesCublasLtPath) {
  require_device();
  const auto [dtype, all_stats] = GetParam();
  XENT_TEST_RNG(rng);
  const int64_t rows = 40, hidden = 64, vocab = 1031;
  LinearLayer layer = make_linear_layer(rng, rows, hidden, vocab, false, 2.0, dtype);
  // bf16: big·wide overflows fp32 (±Inf logits). fp16 holds no such value: there the same rows
  // get large finite logits (≈ 4.8·10⁴, still inside fp16, which the cuBLASLt path writes them
  // in), peaked on the chosen columns.
  const double big = dtype == DType::bf16 ? 3.0e38 : 6000.0;
  const double wide = dtype == DType::bf16 ? 2.0 : 8.0;
  for (int64_t v : {int64_t{3}, int64_t{700}, int64_t{1030}}) layer.weight.at(v, 0) = wide;
  layer.weight.at(5, 0) = -wide;
  layer.weight.at(9, 0) = wide;
  layer.weight.at(9, 1) = wide;
  for (int64_t k = 0; k < hidden; ++k) layer.hidden.at(1, k) = std::nan("");  // all NaN
  layer.hidden.at(2, 0) = big;   // +Inf at 3, 700, 1030, 9; -Inf at 5
  layer.hidden.at(3, 0) = -big;  // the mirror image
  layer.hidden.at(4, 0) = big;
  layer.hidden.at(4, 1) = -big;          // column 9: Inf − Inf = NaN
  layer.hidden.at(5, 7) = std::nan("");  // one NaN input: every logit NaN
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, true);

  const Tensor hidden_t = Tensor::of(layer.hidden, dtype);
  const Tensor weight_t = Tensor::of(layer.weight, dtype);
  const Tensor target_t = Tensor::of_integers(target, DType::i64);
  LinearCeOptions options;
  options.ce.reduction = Reduction::none;
  struct Run {
    std::vector<double> loss, lse, logprob, entropy;
    std::vector<int64_t> argmax;
  };
  auto run = [&](bool fused) {
    const DType stat = result_dtype(dtype);
    Tensor loss = Tensor::vector(stat, rows), lse = Tensor::vector(stat, rows),
           logprob = Tensor::vector(stat, rows), entropy = Tensor::vector(stat, rows),
           argmax = Tensor::vector(DType::i64, rows);
    for (Tensor* t : {&loss, &lse, &logprob, &entropy, &argmax}) t->poison();
    LinearCeOutputs out;
    out.loss = loss.view();
    out.stats.lse = lse.view();
    out.stats.logprob = logprob.view();
    if (all_stats) {
      out.stats.entropy = entropy.view();
      out.stats.argmax = argmax.view();
    }
    std::optional<HookScope> hook(std::in_place);
    (*hook)->fused_statistics = fused ? cuda::Forced::on : cuda::Forced::off;
    const Scratch scratch(
        linear_ce_workspace_size(rows, hidden, vocab, dtype, options, test_device(), false));
    const int64_t before = cuda::fused_stats_forward_count();
    linear_ce_forward(hidden_t.view(), weight_t.view(), {}, target_t.view(), options, out, {},
                      scratch.workspace());
    finish();
    hook.reset();
    if (fused && hopper_paths_here()) {
      EXPECT_EQ(cuda::fused_stats_forward_count() - before, 1) << "the fused path did not run";
    }
    Run r{loss.download(), lse.download(), logprob.download(), {}, {}};
    if (all_stats) {
      r.entropy = entropy.download();
      r.argmax = argmax.download_integers();
    }
    return r;
  };
  const Run fused = run(true), plain = run(false);
  auto same = [&](const char* what, const std::vector<double>& a, const std::vector<double>& b) {
    for (int64_t n = 0; n < rows; ++n) {
      const double x = a[n], y = b[n];
      if (std::isnan(y) || std::isinf(y)) {
        EXPECT_TRUE((std::isnan(x) && std::isnan(y)) || x == y)
            << what << " row " << n << ": fused " << x << ", cuBLASLt path " << y;
      } else {
        // The cuBLASLt path rounds the logits to the operands' type; the fused path keeps fp32.
        EXPECT_NEAR(x, y, 2e-2 * (1 + std::abs(y))) << what << " row " << n;
      }
    }
  };
  same("loss", fused.loss, plain.loss);
  same("lse", fused.lse, plain.lse);
  same("logprob", fused.logprob, plain.logprob);
  if (all_stats) {
    // In fp16 rows 2–4 are finite and so peaked that the cuBLASLt path's fp16 logits (32 apart
    // near 48000) turn near-ties into exact ones (entropy ln 4 where fp32 logits give 0.8): their
    // entropy is not comparable, only their NaN-free, finite loss and lse above.
    std::vector<double> fused_entropy = fused.entropy, plain_entropy = plain.entropy;
    if (dtype == DType::f16) {
      for (int64_t n = 2; n <= 4; ++n) fused_entropy[n] = plain_entropy[n] = 0;
    }
    same("entropy", fused_entropy, plain_entropy);
    // The rows built above; elsewhere near-ties may swap. In fp16 rows 2–4 are finite near-ties
    // too (the cuBLASLt path's fp16 logits are 32 apart near 48000), so only the NaN rows count.
    for (int64_t n = 1; n <= 5; ++n) {
      if (dtype == DType::f16 && n >= 2 && n <= 4) continue;
      EXPECT_EQ(fused.argmax[n], plain.argmax[n]) << "argmax row " << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, CudaFusedStatsNonFinite,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return short_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_all_stats" : "_loss_only");
                         });

// The default policy (fused_stats_preferred): the lean epilogue's calls take the fused path, calls
// that need extras or a softcap keep the cuBLASLt path while their logits fit the budget in one
// chunk, and take the fused path once that path would chunk the rows. Small budgets also split
// the fused product into row chunks (here 1000 rows into chunks of whole 128-row tiles), which
// must give the same outputs.
enum class Policy {
  lean_default,
  lean_wide_hidden,
  extras_default,
  extras_small_budget,
  lean_fused_chunks,
  extras_fused_chunks
};

class CudaFusedStatsPolicy : public ::testing::TestWithParam<Policy> {};

std::string policy_name(const ::testing::TestParamInfo<Policy>& info) {
  switch (info.param) {
    case Policy::lean_default:
      return "lean_default";
    case Policy::lean_wide_hidden:
      return "lean_wide_hidden";
    case Policy::extras_default:
      return "extras_default";
    case Policy::extras_small_budget:
      return "extras_small_budget";
    case Policy::lean_fused_chunks:
      return "lean_fused_chunks";
    case Policy::extras_fused_chunks:
      return "extras_fused_chunks";
  }
  return "unknown";
}

TEST_P(CudaFusedStatsPolicy, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  FusedCase c;
  c.fused_switch = cuda::Forced::planned;
  c.rows = 1000;
  c.hidden = 64;
  c.vocab = 4099;  // 17 column tiles: 408 bytes of partials per row; logits 8.2 MB in bf16
  switch (GetParam()) {
    case Policy::lean_default:
      c.all_stats = false;
      c.options = kZLoss | kLogitScale;
      break;
    case Policy::lean_wide_hidden:  // a wide H (and a K residue) takes the fused path too
      c.all_stats = false;
      c.rows = 40;
      c.hidden = 4104;
      c.vocab = 300;
      break;
    case Policy::extras_default:
      c.expected = Path::fallback;
      c.options = kSmoothing;
      break;
    case Policy::extras_small_budget:  // the cuBLASLt path would chunk; all partials fit
      c.options = kSmoothing | kSoftcap;
      c.budget = std::size_t{1} << 20;
      break;
    case Policy::lean_fused_chunks:  // ≈ 500 rows of partials fit: chunks of 384 rows
      c.all_stats = false;
      c.budget = 256 * 1024;
      break;
    case Policy::extras_fused_chunks:
      c.options = kFusedOptions;
      c.budget = 256 * 1024;
      break;
  }
  check_fused_forward(c, rng);
}

INSTANTIATE_TEST_SUITE_P(Default, CudaFusedStatsPolicy,
                         ::testing::Values(Policy::lean_default, Policy::lean_wide_hidden,
                                           Policy::extras_default, Policy::extras_small_budget,
                                           Policy::lean_fused_chunks, Policy::extras_fused_chunks),
                         policy_name);

// A valid target outside [0, V) on the fused path: as on every GPU path, no synchronisation and
// no exception in the call; that row's loss is NaN, the others are finite, and check_errors then
// reports the target, its value and the op (through ce_shard_finish, as linear_ce_forward).
TEST(CudaFusedStatsErrors, OutOfRangeTargetFlagged) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t rows = 40, hidden = 64, vocab = 300;
  const LinearLayer layer = make_linear_layer(rng, rows, hidden, vocab, false, 2.0, DType::bf16);
  std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, false, false, false);
  target[4] = vocab + 6;
  const Tensor hidden_t = Tensor::of(layer.hidden, DType::bf16);
  const Tensor weight_t = Tensor::of(layer.weight, DType::bf16);
  const Tensor target_t = Tensor::of_integers(target, DType::i64);
  LinearCeOptions options;
  options.ce.reduction = Reduction::none;
  Tensor loss = Tensor::vector(DType::f32, rows);
  loss.poison();
  LinearCeOutputs out;
  out.loss = loss.view();
  const Scratch scratch(
      linear_ce_workspace_size(rows, hidden, vocab, DType::bf16, options, test_device(), false));
  std::optional<HookScope> hook(std::in_place);
  (*hook)->fused_statistics = cuda::Forced::on;
  const int64_t before = cuda::fused_stats_forward_count();
  linear_ce_forward(hidden_t.view(), weight_t.view(), {}, target_t.view(), options, out, {},
                    scratch.workspace());
  hook.reset();
  if (hopper_paths_here()) {
    EXPECT_EQ(cuda::fused_stats_forward_count() - before, 1) << "the fused path did not run";
  }
  const std::vector<double> values = loss.download();  // synchronises; check_errors is below
  EXPECT_TRUE(std::isnan(values[4])) << "the row with the bad target must have a NaN loss";
  for (int64_t n = 0; n < rows; ++n) {
    if (n != 4) {
      EXPECT_TRUE(std::isfinite(values[n])) << "row " << n;
    }
  }
  std::string message;
  expect_invalid(
      [&] {
        try {
          check_errors(test_device());
        } catch (const Error& e) {
          message = e.what();
          throw;
        }
      },
      "target", "306");
  EXPECT_NE(message.find("linear_ce"), std::string::npos) << "the op is not named: " << message;
  EXPECT_NO_THROW(check_errors(test_device())) << "check_errors must clear the flag it reported";
}

// Calls the fused path declines: they must still be right, through the cuBLASLt path.
enum class Decline { unaligned_hidden_rows, switched_off };

class CudaFusedStatsFallback : public ::testing::TestWithParam<Decline> {};

TEST_P(CudaFusedStatsFallback, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  FusedCase c;
  c.expected = Path::fallback;
  switch (GetParam()) {
    case Decline::unaligned_hidden_rows:
      c.hidden = 67;
      break;  // 134-byte rows: no TMA stride
    case Decline::switched_off:
      c.fused_switch = cuda::Forced::off;
      break;
  }
  check_fused_forward(c, rng);
}

std::string decline_name(const ::testing::TestParamInfo<Decline>& info) {
  switch (info.param) {
    case Decline::unaligned_hidden_rows:
      return "unaligned_hidden_rows";
    case Decline::switched_off:
      return "switched_off";
  }
  return "unknown";
}

INSTANTIATE_TEST_SUITE_P(Declined, CudaFusedStatsFallback,
                         ::testing::Values(Decline::unaligned_hidden_rows, Decline::switched_off),
                         decline_name);

TEST(CudaFusedStatsStrides, PaddedHiddenRows) {
  require_device();
  XENT_TEST_RNG(rng);
  FusedCase c;
  c.hidden = 64;
  c.hidden_stride = 80;  // 16-byte aligned padding: TMA takes the stride
  c.options = kFusedOptions;
  check_fused_forward(c, rng);
}

// A bias (in the operands' dtype) added to x in the epilogue, with the lean epilogue, with every
// option and statistic, in both dtypes, at shapes with residues in N, H and V (the bias of the
// last tile's columns past V is never read).
class CudaFusedStatsBias : public ::testing::TestWithParam<std::tuple<DType, unsigned, bool>> {};

TEST_P(CudaFusedStatsBias, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  FusedCase c;
  std::tie(c.dtype, c.options, c.all_stats) = GetParam();
  c.rows = 300;
  c.hidden = 72;
  c.vocab = 4099;
  c.bias = true;
  c.reduction = c.options != 0 ? Reduction::none : Reduction::mean;
  check_fused_forward(c, rng);
}

INSTANTIATE_TEST_SUITE_P(Bias, CudaFusedStatsBias,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                                            ::testing::Values(0u, kFusedOptions),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return short_name(std::get<0>(info.param)) + "_" +
                                  ce_options_label(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_all_stats" : "_lean");
                         });

}  // namespace
}  // namespace xent::test
