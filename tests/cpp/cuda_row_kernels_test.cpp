// GPU-only cases aimed at the paths of the CUDA row kernels (src/cuda/rows/row_slice.cuh) that the
// shared suites, built on small rows, never reach: rows split over clusters of 2, 4 and 8 CTAs,
// slices that fill a whole multiprocessor, rows too long for shared memory (read twice), unaligned
// rows (scalar path), and odd tails after the last 16-byte vector. Same harness and tolerances as
// the shared suites (float64 reference of docs/semantics.md).
#include <optional>
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "ce_check.hpp"
#include "cuda/core/arch.hpp"
#include "cuda/rows/row_kernel_counts.hpp"
#include "distill_check.hpp"
#include "hook_scope.hpp"

namespace xent::test {
namespace {

// (dtype, vocab, row padding, options, in place). Vocabulary sizes, for bf16 unless said:
// 40000 → cluster of 2; 131079 → cluster of 8 with an odd tail; 300007 → one 75 KB slice per
// CTA of 8; fp32 500000 → 250 KB slices, beyond shared memory: the streaming path. bf16 24576
// and fp32 12287 → one staged slice of exactly 48 KiB, the default dynamic limit, which the
// kernel's static shared memory leaves short (the limit must be raised for it).
using CeKernelCase = std::tuple<DType, int64_t, int64_t, unsigned, bool>;

class CudaCeRowKernel : public ::testing::TestWithParam<CeKernelCase> {};

// A mean-reduced ce problem of `rows` rows of `vocab` columns (padded rows when padding > 0), its
// targets at the row's edges too.
CeProblem row_problem(DType dtype, int64_t rows, int64_t vocab, int64_t padding, unsigned options) {
  CeProblem problem;
  problem.dtype = dtype;
  problem.rows = rows;
  problem.vocab = vocab;
  problem.row_stride = padding > 0 ? vocab + padding : -1;
  problem.options = options;
  problem.reduction = Reduction::mean;
  problem.targets_at_edges = true;
  return problem;
}

TEST_P(CudaCeRowKernel, MatchesReference) {
  require_device();
  const auto [dtype, vocab, padding, options, in_place] = GetParam();
  XENT_TEST_RNG(rng);
  CeProblem problem = row_problem(dtype, 6, vocab, padding, options);
  problem.in_place = in_place;
  check_ce(problem, rng);
}

std::string ce_case_name(const ::testing::TestParamInfo<CeKernelCase>& info) {
  const auto [dtype, vocab, padding, options, in_place] = info.param;
  return short_name(dtype) + "_V" + std::to_string(vocab) + "_pad" + std::to_string(padding) + "_" +
         ce_options_label(options) + (in_place ? "_inplace" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Paths, CudaCeRowKernel,
    ::testing::Values(CeKernelCase{DType::bf16, 40000, 0, 0, false},
                      CeKernelCase{DType::bf16, 40000, 0, kAllCeOptions, true},
                      CeKernelCase{DType::bf16, 24576, 0, kSmoothing, false},
                      CeKernelCase{DType::f32, 12287, 0, 0, true},
                      CeKernelCase{DType::bf16, 131079, 0, kAllCeOptions, false},
                      CeKernelCase{DType::bf16, 131072, 3, kSmoothing, false},
                      CeKernelCase{DType::f16, 131072, 0, kZLoss | kSoftcap, true},
                      CeKernelCase{DType::bf16, 300007, 0, kClassWeight | kSmoothing, false},
                      CeKernelCase{DType::f32, 300007, 1, kRowWeight, true},
                      CeKernelCase{DType::f32, 500000, 0, kAllCeOptions, false},
                      CeKernelCase{DType::f32, 500000, 0, 0, true}),
    ce_case_name);

// Batches with more rows than the GPU holds CTAs at once, so multiprocessors run many CTAs one
// after another: (dtype, vocab, rows, options, in place, NaN row). Every fifth row is ignored.
// 4099 bf16 columns make unaligned rows (thread copies instead of bulk copies); 40000 → clusters
// of 2; 131079 → clusters of 8. Full 64 KiB staged slices, the docs/performance.md rows' plan: bf16 32768
// (one CTA), f16 65531 and f32 32768 (two).
using CeManyRowsCase = std::tuple<DType, int64_t, int64_t, unsigned, bool, bool>;

class CudaCeManyRows : public ::testing::TestWithParam<CeManyRowsCase> {};

TEST_P(CudaCeManyRows, MatchesReference) {
  require_device();
  const auto [dtype, vocab, rows, options, in_place, nan_row] = GetParam();
  XENT_TEST_RNG(rng);
  CeProblem problem;
  problem.dtype = dtype;
  problem.rows = rows;
  problem.vocab = vocab;
  problem.options = options;
  problem.reduction = Reduction::mean;
  problem.in_place = in_place;
  problem.nan_row = nan_row;
  check_ce(problem, rng);
}

std::string many_rows_case_name(const ::testing::TestParamInfo<CeManyRowsCase>& info) {
  const auto [dtype, vocab, rows, options, in_place, nan_row] = info.param;
  return short_name(dtype) + "_V" + std::to_string(vocab) + "_N" + std::to_string(rows) + "_" +
         ce_options_label(options) + (in_place ? "_inplace" : "") + (nan_row ? "_nan" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Paths, CudaCeManyRows,
    ::testing::Values(CeManyRowsCase{DType::bf16, 40000, 1500, 0, true, false},
                      CeManyRowsCase{DType::bf16, 4099, 3000, kAllCeOptions, false, true},
                      CeManyRowsCase{DType::bf16, 131079, 700, kSmoothing | kZLoss, false, false},
                      CeManyRowsCase{DType::f32, 32768, 1200, kSoftcap, true, true},
                      CeManyRowsCase{DType::bf16, 32768, 600, kAllCeOptions, false, true},
                      CeManyRowsCase{DType::f16, 65531, 300, kSmoothing | kZLoss, true, false}),
    many_rows_case_name);

// (dtype, vocab, kind, options). bf16 70000 → cluster of 8 with two staged inputs; bf16 200003
// → a cluster of 16 (non-portable) where the device runs one, else 8 with 100 KB slices; fp32
// 300007 → the streaming path; 4099 → one CTA with an odd tail; bf16 12288 → two staged inputs of
// 48 KiB together in one CTA (the default dynamic limit, short by the static shared memory).
using DistillKernelCase = std::tuple<DType, int64_t, DistillKind, unsigned>;

class CudaDistillRowKernel : public ::testing::TestWithParam<DistillKernelCase> {};

TEST_P(CudaDistillRowKernel, MatchesReference) {
  require_device();
  const auto [dtype, vocab, kind, options] = GetParam();
  XENT_TEST_RNG(rng);
  DistillProblem problem;
  problem.dtype = dtype;
  problem.rows = 5;
  problem.vocab = vocab;
  problem.kind = kind;
  problem.options = options;
  problem.reduction = Reduction::mean;
  // The row kernel's paths: rows without a hard term would take the two passes by default.
  std::optional<HookScope> hook(std::in_place);
  (*hook)->distill_two_pass = cuda::Forced::off;
  const int64_t wide_before = cuda::distill_rows_wide_cluster_launches();
  check_distill(problem, rng);
  hook.reset();
  // Two bf16 inputs of 200003 columns: 100 KB slices in a cluster of 8, so Hopper takes 16.
  if (dtype == DType::bf16 && vocab > 131072 && cuda::hopper_paths(test_device().index)) {
    EXPECT_GT(cuda::distill_rows_wide_cluster_launches(), wide_before);
  } else {
    EXPECT_EQ(cuda::distill_rows_wide_cluster_launches(), wide_before);
  }
}

std::string distill_case_name(const ::testing::TestParamInfo<DistillKernelCase>& info) {
  const auto [dtype, vocab, kind, options] = info.param;
  return short_name(dtype) + "_V" + std::to_string(vocab) + "_" + distill_kind_name(kind) + "_" +
         distill_options_label(options);
}

INSTANTIATE_TEST_SUITE_P(
    Paths, CudaDistillRowKernel,
    ::testing::Values(
        DistillKernelCase{DType::bf16, 70000, DistillKind::forward_kl, kTemperature},
        DistillKernelCase{DType::bf16, 70000, DistillKind::reverse_kl, kHardAndSoft},
        DistillKernelCase{DType::bf16, 70000, DistillKind::jsd, kDistillSoftcap},
        DistillKernelCase{DType::f16, 70001, DistillKind::tvd, kNoTarget},
        DistillKernelCase{DType::bf16, 200003, DistillKind::forward_kl, kHardAndSoft},
        DistillKernelCase{DType::bf16, 200003, DistillKind::jsd, kTemperature | kDistillSoftcap},
        DistillKernelCase{DType::bf16, 4099, DistillKind::soft_ce, kHardAndSoft | kTemperature},
        DistillKernelCase{DType::bf16, 12288, DistillKind::forward_kl, kHardAndSoft},
        DistillKernelCase{DType::f32, 300007, DistillKind::reverse_kl, kHardAndSoft},
        DistillKernelCase{DType::f32, 300007, DistillKind::forward_kl, 0}),
    distill_case_name);

// Rows without a hard term take two passes (three for jsd and tvd; distill_two_pass.cuh:
// streamed statistics with the loss, the sums, then the elementwise gradient);
// The test hook keeps them on the row kernel. Every case runs both ways: (dtype,
// vocab, kind, options, reduction, in place, NaN row, row padding, two-pass). Streamed slices of
// up to 128 KiB of each row: bf16 70000 and 200003 → clusters of 2 and 4, a short last slice;
// fp32 300007 → 8 CTAs of 37504 columns; 4099 → one CTA; padded rows → the scalar path. The
// hard-label term rides in pass 1 for forward and reverse KL and soft ce (its ce statistics
// beside the pair's; odd vocabularies add class and row weights), and keeps jsd and tvd on the
// row kernel.
using TwoPassCase =
    std::tuple<DType, int64_t, DistillKind, unsigned, Reduction, bool, bool, int64_t, bool>;

class CudaDistillTwoPass : public ::testing::TestWithParam<TwoPassCase> {};

TEST_P(CudaDistillTwoPass, MatchesReference) {
  require_device();
  const auto [dtype, vocab, kind, options, reduction, in_place, nan_row, padding, two_pass] =
      GetParam();
  XENT_TEST_RNG(rng);
  DistillProblem problem;
  problem.dtype = dtype;
  problem.rows = 7;
  problem.vocab = vocab;
  problem.row_stride = padding > 0 ? vocab + padding : -1;
  problem.kind = kind;
  problem.options = options;
  problem.reduction = reduction;
  problem.in_place = in_place;
  problem.nan_row = nan_row;
  // The weighted hard-term cases (class and row weights, smoothing: the full ce statistics in
  // pass 1) at the first hard case of each kind: odd vocabularies.
  problem.hard_weights = (options & kHardAndSoft) != 0 && vocab % 2 == 1;
  std::optional<HookScope> hook(std::in_place);
  (*hook)->distill_two_pass = two_pass ? cuda::Forced::planned : cuda::Forced::off;
  const int64_t before = cuda::distill_two_pass_launches();
  check_distill(problem, rng);
  const int64_t after = cuda::distill_two_pass_launches();
  hook.reset();
  const bool three_passes = kind == DistillKind::jsd || kind == DistillKind::tvd;
  const bool applies = two_pass && !(three_passes && (options & kHardAndSoft) != 0);
  if (applies) {
    EXPECT_GT(after, before);
  } else {
    EXPECT_EQ(after, before);
  }
}

std::string two_pass_case_name(const ::testing::TestParamInfo<TwoPassCase>& info) {
  const auto [dtype, vocab, kind, options, reduction, in_place, nan_row, padding, two_pass] =
      info.param;
  return short_name(dtype) + "_V" + std::to_string(vocab) + "_" + distill_kind_name(kind) + "_" +
         distill_options_label(options) + "_" + reduction_label(reduction) +
         (in_place ? "_inplace" : "") + (nan_row ? "_nan" : "") +
         (padding > 0 ? "_pad" + std::to_string(padding) : "") +
         (two_pass ? "_twopass" : "_rowkernel");
}

std::vector<TwoPassCase> two_pass_cases() {
  const std::vector<TwoPassCase> problems = {
      {DType::bf16, 70000, DistillKind::forward_kl, kTemperature, Reduction::mean, true, true, 0,
       false},
      {DType::bf16, 70000, DistillKind::reverse_kl, kDistillSoftcap, Reduction::none, false, false,
       0, false},
      {DType::bf16, 200003, DistillKind::forward_kl, kNoTarget, Reduction::sum, false, false, 0,
       false},
      {DType::f32, 300007, DistillKind::reverse_kl, 0, Reduction::mean, false, true, 0, false},
      {DType::f16, 4099, DistillKind::forward_kl, kTemperature | kDistillSoftcap, Reduction::none,
       false, false, 3, false},
      {DType::f32, 1031, DistillKind::reverse_kl, kTemperature, Reduction::sum, true, false, 1,
       false},
      {DType::bf16, 4099, DistillKind::reverse_kl, kHardAndSoft, Reduction::mean, false, false, 0,
       false},
      {DType::bf16, 70000, DistillKind::soft_ce, kTemperature, Reduction::none, true, false, 0,
       false},
      {DType::f16, 4099, DistillKind::soft_ce, kDistillSoftcap | kNoTarget, Reduction::sum, false,
       false, 5, false},
      {DType::bf16, 70000, DistillKind::jsd, kDistillSoftcap, Reduction::mean, false, true, 0,
       false},
      {DType::f32, 300007, DistillKind::jsd, kTemperature, Reduction::none, true, false, 0, false},
      {DType::f16, 70001, DistillKind::tvd, kNoTarget, Reduction::mean, false, false, 0, false},
      {DType::bf16, 200003, DistillKind::tvd, kTemperature, Reduction::sum, true, true, 0, false},
      {DType::bf16, 70001, DistillKind::forward_kl, kHardAndSoft | kTemperature, Reduction::mean,
       true, true, 0, false},
      {DType::f32, 300007, DistillKind::soft_ce, kHardAndSoft, Reduction::none, false, false, 0,
       false},
      {DType::f16, 4098, DistillKind::forward_kl, kHardAndSoft | kDistillSoftcap, Reduction::sum,
       false, false, 3, false},
      {DType::bf16, 70001, DistillKind::jsd, kHardAndSoft, Reduction::mean, false, false, 0,
       false}};
  std::vector<TwoPassCase> cases;
  for (const TwoPassCase& c : problems) {
    for (const bool two_pass : {true, false}) {
      TwoPassCase run = c;
      std::get<8>(run) = two_pass;
      cases.push_back(run);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Paths, CudaDistillTwoPass, ::testing::ValuesIn(two_pass_cases()),
                         two_pass_case_name);

// Repeated runs on identical inputs give identical bits (no atomics, fixed reduction order).
TEST(CudaCeDeterminism, SameInputsSameBits) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t rows = 64, vocab = 131079;
  const Tensor logits = Tensor::of(rng.matrix(rows, vocab, 2.0), DType::bf16);
  const Tensor target =
      Tensor::of_integers(make_targets(rng, rows, vocab, -100, true, false, false), DType::i64);
  CeOptions options;
  options.label_smoothing = 0.1;
  options.z_loss = 1e-4;
  const Scratch scratch(ce_workspace_size(rows, vocab, options, test_device()));
  std::vector<double> first_loss, first_grad;
  for (int run = 0; run < 3; ++run) {
    Tensor loss = Tensor::scalar(DType::f32);
    Tensor grad = Tensor::matrix(DType::bf16, rows, vocab);
    CeOutputs out;
    out.loss = loss.view();
    out.grad_logits = grad.view();
    ce_forward(logits.view(), target.view(), options, out, {}, scratch.workspace());
    finish();
    if (run == 0) {
      first_loss = loss.download();
      first_grad = grad.download();
    } else {
      EXPECT_EQ(loss.download(), first_loss);
      EXPECT_EQ(grad.download(), first_grad);
    }
  }
}

// The ops make no host synchronisation and no allocation, so a forward with gradient captured in
// a CUDA graph (after one warm-up call, as frameworks do) replays to the same bits.
TEST(CudaCeGraph, CapturedForwardReplaysToTheSameBits) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t rows = 32, vocab = 40000;  // a cluster of two CTAs per row
  const Tensor logits = Tensor::of(rng.matrix(rows, vocab, 2.0), DType::bf16);
  const Tensor target =
      Tensor::of_integers(make_targets(rng, rows, vocab, -100, true, false, false), DType::i64);
  CeOptions options;
  options.label_smoothing = 0.05;
  const Scratch scratch(ce_workspace_size(rows, vocab, options, test_device()));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto run = [&](Tensor& loss, Tensor& grad) {
    CeOutputs out;
    out.loss = loss.view();
    out.grad_logits = grad.view();
    ce_forward(logits.view(), target.view(), options, out, {}, scratch.workspace(), Stream{stream});
  };
  Tensor direct_loss = Tensor::scalar(DType::f32),
         direct_grad = Tensor::matrix(DType::bf16, rows, vocab);
  run(direct_loss, direct_grad);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

  Tensor graph_loss = Tensor::scalar(DType::f32),
         graph_grad = Tensor::matrix(DType::bf16, rows, vocab);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  run(graph_loss, graph_grad);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(graph_loss.download(), direct_loss.download());
  EXPECT_EQ(graph_grad.download(), direct_grad.download());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// An out-of-range target: NaN loss row and gradient row, other rows exact, and check_errors
// reports the first offending row with the CPU's words.
TEST(CudaCeErrors, OutOfRangeTargetFlagsAndNaNs) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t rows = 8, vocab = 40000;
  const Tensor logits = Tensor::of(rng.matrix(rows, vocab, 1.0), DType::f32);
  std::vector<int64_t> targets(rows, 5);
  targets[3] = vocab + 7;
  targets[6] = -3;
  const Tensor target = Tensor::of_integers(targets, DType::i64);
  CeOptions options;
  options.reduction = Reduction::none;
  const Scratch scratch(ce_workspace_size(rows, vocab, options, test_device()));
  Tensor loss = Tensor::vector(DType::f32, rows);
  Tensor grad = Tensor::matrix(DType::f32, rows, vocab);
  CeOutputs out;
  out.loss = loss.view();
  out.grad_logits = grad.view();
  ce_forward(logits.view(), target.view(), options, out, {}, scratch.workspace());
  cudaDeviceSynchronize();
  const auto l = loss.download();
  const auto g = grad.download();
  for (int64_t n = 0; n < rows; ++n) {
    const bool bad = n == 3 || n == 6;
    EXPECT_EQ(std::isnan(l[n]), bad) << "row " << n;
    EXPECT_EQ(std::isnan(g[n * vocab + 11]), bad) << "row " << n;
  }
  try {
    check_errors(test_device());
    ADD_FAILURE() << "check_errors did not report the out-of-range target";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("ce_forward"), std::string::npos) << message;
    EXPECT_NE(message.find("target[3] = 40007"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(check_errors(test_device()));  // reading clears the flag
}

// ---- which paths a device takes (src/cuda/core/arch.hpp) ----------------------------------------

TEST(CudaDevicePaths, HopperPathsOnComputeCapability90Only) {
  require_device();
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  const bool forced = cuda::test_hook().portable_paths == cuda::Forced::on;
  EXPECT_EQ(cuda::hopper_paths(0), major == 9 && minor == 0 && XENT_TEST_HOPPER_CODE && !forced)
      << "compute capability " << major << "." << minor << ", sm_90 code in the build "
      << XENT_TEST_HOPPER_CODE;
  HookScope hook;
  hook->portable_paths = cuda::Forced::on;
  EXPECT_FALSE(cuda::hopper_paths(0));
  EXPECT_FALSE(cuda::hopper_paths());
}

// The portable paths on rows of every kind they plan differently from Hopper: one CTA staging a
// whole row by cp.async (40000, 65536 bf16), rows past one CTA's shared memory (a staged prefix
// and a streamed tail where rows are 16-byte aligned: 131079 padded to 131080, 140001 f16,
// 65541 fp32, 262144; read twice where they are not: 131079 bf16, 300007 fp32), a padded odd row
// and an unaligned one (scalar staging).
using PortableCase = std::tuple<DType, int64_t, int64_t, unsigned>;
class CudaPortableRows : public ::testing::TestWithParam<PortableCase> {};

TEST_P(CudaPortableRows, CeAndDistillMatchTheReference) {
  require_device();
  HookScope hook;
  hook->portable_paths = cuda::Forced::on;
  const auto [dtype, vocab, padding, options] = GetParam();
  XENT_TEST_RNG(rng);
  check_ce(row_problem(dtype, 5, vocab, padding, options), rng);
  DistillProblem distill;
  distill.dtype = dtype;
  distill.rows = 4;
  distill.vocab = vocab;
  distill.kind = DistillKind::jsd;
  distill.reduction = Reduction::sum;
  check_distill(distill, rng);
}

std::string portable_case_name(const ::testing::TestParamInfo<PortableCase>& info) {
  const auto [dtype, vocab, padding, options] = info.param;
  return short_name(dtype) + "_V" + std::to_string(vocab) + "_pad" + std::to_string(padding) + "_" +
         ce_options_label(options);
}

INSTANTIATE_TEST_SUITE_P(Paths, CudaPortableRows,
                         ::testing::Values(PortableCase{DType::bf16, 40000, 0, kAllCeOptions},
                                           PortableCase{DType::bf16, 65536, 0, kSmoothing},
                                           PortableCase{DType::f16, 40001, 3, kZLoss | kSoftcap},
                                           PortableCase{DType::bf16, 131079, 0, kAllCeOptions},
                                           PortableCase{DType::bf16, 131079, 1, kAllCeOptions},
                                           PortableCase{DType::f16, 140001, 7, kRowWeight},
                                           PortableCase{DType::f32, 65541, 3, kZLoss | kSoftcap},
                                           PortableCase{DType::bf16, 262144, 0, kSmoothing},
                                           PortableCase{DType::f32, 300007, 1, kRowWeight}),
                         portable_case_name);

}  // namespace
}  // namespace xent::test
