// GPU-only cases for the short-row kernel of ce (src/cuda/ce_short_rows_kernel.cuh): a warp, or a pair of
// warps, per row, the row held in registers. The vocabulary sizes straddle every register-array
// size of the kernel and both of its limits — 16-bit rows: 4, 8, 16 vectors of 8 columns a lane
// up to 1024 / 2048 / 4096 columns (down to V = 1, where one lane holds the row), a pair of warps
// up to 8192, then the cluster kernel; fp32 half of each — with many rows (four rows a CTA, more CTAs than one wave), every
// option, ignored rows, odd widths (unaligned rows: element loads and stores), padded rows,
// in-place gradients, int32 targets and per-row upstream gradients (reduction none). Outputs
// start NaN-poisoned (support.hpp). Same harness and tolerances as the shared suites.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "ce_check.hpp"

namespace xent::test {
namespace {

struct ShortRowCase {
  DType dtype;
  int64_t vocab;
  int64_t rows;
  unsigned options;
  Reduction reduction;
  bool in_place = false;
  int64_t padding = 0;  // row stride = vocab + padding
  bool nan_row = false;
  bool edges = false;  // targets 0 and V − 1
  bool int32_target = false;
};

void PrintTo(const ShortRowCase& c, std::ostream* os) {
  *os << short_name(c.dtype) << " V=" << c.vocab << " N=" << c.rows;
}

class CudaCeShortRows : public ::testing::TestWithParam<ShortRowCase> {};

TEST_P(CudaCeShortRows, MatchesReference) {
  require_device();
  const ShortRowCase c = GetParam();
  XENT_TEST_RNG(rng);
  CeProblem problem;
  problem.dtype = c.dtype;
  problem.target_dtype = c.int32_target ? DType::i32 : DType::i64;
  problem.rows = c.rows;
  problem.vocab = c.vocab;
  problem.row_stride = c.padding > 0 ? c.vocab + c.padding : -1;
  problem.options = c.options;
  problem.reduction = c.reduction;
  problem.in_place = c.in_place;
  problem.nan_row = c.nan_row;
  problem.targets_at_edges = c.edges;
  check_ce(problem, rng);
}

std::string short_row_name(const ::testing::TestParamInfo<ShortRowCase>& info) {
  const ShortRowCase& c = info.param;
  return short_name(c.dtype) + "_V" + std::to_string(c.vocab) + "_N" + std::to_string(c.rows) +
         "_" + ce_options_label(c.options) + "_" + reduction_label(c.reduction) +
         (c.in_place ? "_inplace" : "") + (c.padding ? "_pad" + std::to_string(c.padding) : "") +
         (c.nan_row ? "_nan" : "") + (c.edges ? "_edges" : "") + (c.int32_target ? "_i32" : "");
}

constexpr unsigned kAll = kAllCeOptions;
constexpr Reduction kNone = Reduction::none, kSum = Reduction::sum, kMean = Reduction::mean;

// (dtype, V, N, options, reduction, in place, padding, NaN row, edge targets, int32 targets)
INSTANTIATE_TEST_SUITE_P(
    Paths, CudaCeShortRows,
    ::testing::Values(
        // bf16: four vectors a lane (V ≤ 1024), the tail lanes idle or partly filled
        ShortRowCase{DType::bf16, 1, 1000, 0, kMean},
        ShortRowCase{DType::bf16, 2, 1000, kAll, kNone},
        ShortRowCase{DType::bf16, 7, 1000, kSmoothing | kClassWeight, kSum, false, 0, false,
                     false, true},
        ShortRowCase{DType::bf16, 31, 1000, kSoftcap | kZLoss, kNone, true},
        ShortRowCase{DType::bf16, 32, 1000, 0, kMean, false, 3},
        ShortRowCase{DType::bf16, 255, 1000, kAll, kMean, false, 0, true},
        ShortRowCase{DType::bf16, 256, 1000, kLogitScale | kRowWeight, kNone, false, 0, false,
                     true},
        // ragged and exact fits of four, eight, sixteen vectors a lane
        ShortRowCase{DType::bf16, 257, 1000, kSmoothing, kMean, true},
        ShortRowCase{DType::bf16, 1000, 1200, kAll, kNone},
        ShortRowCase{DType::bf16, 1023, 1000, kClassWeight | kSmoothing | kSoftcap, kMean, false,
                     1},
        ShortRowCase{DType::bf16, 1024, 1000, 0, kSum, true},
        ShortRowCase{DType::bf16, 2048, 1000, kAll, kMean, false, 0, true},
        ShortRowCase{DType::bf16, 2049, 1000, kZLoss, kNone},
        ShortRowCase{DType::bf16, 4095, 1000, kAll, kNone, true},
        ShortRowCase{DType::bf16, 4096, 1000, 0, kMean, false, 0, false, true},
        // a pair of warps (V ≤ 8192), then the cluster kernel
        ShortRowCase{DType::bf16, 4097, 1000, kSmoothing | kClassWeight, kMean},
        ShortRowCase{DType::bf16, 8191, 1000, kAll, kNone, false, 0, true},
        ShortRowCase{DType::bf16, 8192, 1000, kSoftcap, kMean, true, 0, false, true},
        ShortRowCase{DType::bf16, 8192, 600, kAll, kSum, false, 8},
        ShortRowCase{DType::bf16, 8193, 300, 0, kMean},
        // fp32: four columns a vector, so each limit is half the 16-bit one
        ShortRowCase{DType::f32, 1, 1000, kAll, kNone},
        ShortRowCase{DType::f32, 127, 1000, 0, kMean, false, 0, false, true},
        ShortRowCase{DType::f32, 128, 1000, kSmoothing | kClassWeight, kSum, true},
        ShortRowCase{DType::f32, 129, 1000, kSoftcap, kNone, false, 2},
        ShortRowCase{DType::f32, 1000, 1000, kAll, kMean, false, 0, true},
        ShortRowCase{DType::f32, 2048, 1000, kRowWeight | kZLoss, kNone, false, 0, false, false,
                     true},
        ShortRowCase{DType::f32, 2049, 1000, kAll, kMean, false, 0, true},
        ShortRowCase{DType::f32, 4096, 1000, 0, kNone, true},
        ShortRowCase{DType::f32, 4097, 300, kSmoothing, kMean},
        // fp16
        ShortRowCase{DType::f16, 33, 1000, kAll, kNone},
        ShortRowCase{DType::f16, 512, 1000, kSmoothing | kZLoss, kMean, true},
        ShortRowCase{DType::f16, 3001, 1000, kSoftcap | kClassWeight | kSmoothing, kSum},
        ShortRowCase{DType::f16, 6000, 1000, kAll, kNone, false, 0, true}),
    short_row_name);

// Rows whose target is outside [0, V) (and not ignore_index) get a NaN loss and an all-NaN
// gradient row; every other row is bit for bit what it is when those rows are ignored instead
// (rows are independent), ignored rows report 0 and a zero gradient, and check_errors names the
// first bad row. V = 100 / 3000 / 6000: one warp of 4 and 16 vectors a lane, a pair of warps.
TEST(CudaShortRowErrors, OutOfRangeTargetNaNsOnlyItsRow) {
  require_device();
  XENT_TEST_RNG(rng);
  for (const DType dtype : {DType::bf16, DType::f32}) {
    for (const int64_t vocab : {int64_t{100}, int64_t{3000}, int64_t{6000}}) {
      SCOPED_TRACE(short_name(dtype) + " V=" + std::to_string(vocab));
      const int64_t rows = 64;
      const Tensor logits = Tensor::of(rng.matrix(rows, vocab, 2.0), dtype);
      std::vector<int64_t> targets = make_targets(rng, rows, vocab, -100, false, false, false);
      targets[9] = -100;
      std::vector<int64_t> bad = targets;
      bad[3] = vocab + 7;
      bad[6] = -3;
      std::vector<int64_t> ignored = targets;
      ignored[3] = ignored[6] = -100;
      CeOptions options;
      options.reduction = Reduction::none;
      options.label_smoothing = 0.125;
      const Tensor grad_output = Tensor::of(rng.uniform_vector(rows, 0.5, 2.0), DType::f32);
      const Scratch scratch(ce_workspace_size(rows, vocab, options, test_device()));
      auto run = [&](const std::vector<int64_t>& t, std::vector<double>& loss_out,
                     std::vector<double>& grad_out) {
        const Tensor target = Tensor::of_integers(t, DType::i64);
        Tensor loss = Tensor::vector(DType::f32, rows);
        Tensor grad = Tensor::matrix(dtype, rows, vocab);
        CeOutputs out;
        out.loss = loss.view();
        out.grad_logits = grad.view();
        ce_forward(logits.view(), target.view(), options, out, grad_output.view(),
                   scratch.workspace());
        cudaDeviceSynchronize();
        loss_out = loss.download();
        grad_out = grad.download();
      };
      std::vector<double> loss_bad, grad_bad, loss_ignored, grad_ignored;
      run(bad, loss_bad, grad_bad);
      try {
        check_errors(test_device());
        ADD_FAILURE() << "check_errors did not report the out-of-range target";
      } catch (const Error& e) {
        const std::string message = e.what();
        EXPECT_NE(message.find("target[3] = " + std::to_string(vocab + 7)), std::string::npos)
            << message;
      }
      run(ignored, loss_ignored, grad_ignored);
      EXPECT_NO_THROW(check_errors(test_device()));
      for (int64_t n = 0; n < rows; ++n) {
        const bool nan_expected = n == 3 || n == 6;
        EXPECT_EQ(std::isnan(loss_bad[n]), nan_expected) << "row " << n;
        if (!nan_expected) {
          EXPECT_EQ(loss_bad[n], loss_ignored[n]) << "row " << n;
        }
        if (n == 9) {
          EXPECT_EQ(loss_bad[n], 0.0) << "ignored row";
        }
        for (int64_t i = 0; i < vocab; ++i) {
          const double g = grad_bad[n * vocab + i];
          if (nan_expected) {
            ASSERT_TRUE(std::isnan(g)) << "row " << n << " column " << i;
          } else if (n == 9) {
            ASSERT_EQ(g, 0.0) << "ignored row, column " << i;
          } else {
            ASSERT_EQ(g, grad_ignored[n * vocab + i]) << "row " << n << " column " << i;
          }
        }
      }
    }
  }
}

// The short-row kernel against the cluster kernel on the same inputs (XENT_CUDA_SHORT_ROWS=0
// sends every row to the cluster kernel; the setting is read at every call): the same statistics
// and gradient to fp32 rounding (fp32 logits, so no 16-bit rounding hides a difference). The
// two merge a row's partial sums in different orders, so bits may differ in the last places.
TEST(CudaShortRowsAgreement, SameAsClusterKernel) {
  require_device();
  XENT_TEST_RNG(rng);
  for (const int64_t vocab : {int64_t{3}, int64_t{500}, int64_t{2048}, int64_t{3999}}) {
    for (const bool every_option : {false, true}) {
      SCOPED_TRACE("V=" + std::to_string(vocab) + (every_option ? " every option" : ""));
      const int64_t rows = 300;
      const Tensor logits = Tensor::of(rng.matrix(rows, vocab, 3.0), DType::f32);
      const Tensor target = Tensor::of_integers(
          make_targets(rng, rows, vocab, -100, true, false, false), DType::i64);
      CeSetup setup = make_ce_setup(every_option ? kAllCeOptions : 0u, Reduction::mean, -100,
                                    rows, vocab, rng);
      const Scratch scratch(ce_workspace_size(rows, vocab, setup.options, test_device()));
      auto run = [&](const char* setting, std::vector<double>& lse_out,
                     std::vector<double>& entropy_out, std::vector<double>& grad_out) {
        ::setenv("XENT_CUDA_SHORT_ROWS", setting, 1);
        Tensor loss = Tensor::scalar(DType::f32), lse = Tensor::vector(DType::f32, rows),
               entropy = Tensor::vector(DType::f32, rows);
        Tensor grad = Tensor::matrix(DType::f32, rows, vocab);
        CeOutputs out;
        out.loss = loss.view();
        out.stats.lse = lse.view();
        out.stats.entropy = entropy.view();
        out.grad_logits = grad.view();
        ce_forward(logits.view(), target.view(), setup.options, out, {}, scratch.workspace());
        finish();
        ::unsetenv("XENT_CUDA_SHORT_ROWS");
        lse_out = lse.download();
        entropy_out = entropy.download();
        grad_out = grad.download();
      };
      std::vector<double> lse_short, entropy_short, grad_short, lse_cluster, entropy_cluster,
          grad_cluster;
      run("", lse_short, entropy_short, grad_short);
      run("0", lse_cluster, entropy_cluster, grad_cluster);
      EXPECT_TRUE(close("lse", lse_short, lse_cluster, 1e-6));
      EXPECT_TRUE(close("entropy", entropy_short, entropy_cluster, 1e-5));
      // A last-place difference of lse (~1e-6 absolute at lse ≈ 10) moves every p_i by ~1e-6.
      EXPECT_TRUE(close("grad_logits", grad_short, grad_cluster, 4e-6));
    }
  }
}

}  // namespace
}  // namespace xent::test
