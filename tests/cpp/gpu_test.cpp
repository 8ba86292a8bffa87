// GPU-only cases (xent_gpu_tests): sizes the CPU suite cannot afford (V = 262144 and 500000, a
// logits tensor past 2^31 elements, linear_ce at N = 65536, V = 256000), and CUDA against the CPU
// backend of the same binary on identical inputs, for every op.
#include <optional>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>

#include "linear_check.hpp"
#include "hook_scope.hpp"

namespace xent::test {
namespace {

void cuda_ok(cudaError_t status) { ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status); }

// ---- large vocabularies through the shared harness -------------------------------------------

using LargeParam = std::tuple<DType, int64_t>;
class GpuLargeVocab : public ::testing::TestWithParam<LargeParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(GpuLargeVocab, CeMatchesReference) {
  XENT_TEST_RNG(rng);
  CeProblem p;
  std::tie(p.dtype, p.vocab) = GetParam();
  p.rows = 24;
  p.options = kSmoothing | kZLoss | kSoftcap;
  p.reduction = Reduction::none;
  check_ce(p, rng);
  p.reduction = Reduction::mean;
  p.options = kClassWeight | kRowWeight;
  check_ce(p, rng);
}

INSTANTIATE_TEST_SUITE_P(Gpu, GpuLargeVocab,
                         ::testing::Values(LargeParam{DType::f32, 262144},
                                           LargeParam{DType::bf16, 262144},
                                           LargeParam{DType::bf16, 500000},
                                           LargeParam{DType::f16, 500000}),
                         [](const ::testing::TestParamInfo<LargeParam>& info) {
                           return short_name(std::get<0>(info.param)) + "_vocab" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- ce past 2^31 elements -------------------------------------------------------------------

// 8200 rows × 262144 bf16 logits = 2.15e9 elements (4.3 GB): every offset past row 8192 needs
// 64-bit index arithmetic. Rows repeat 16 random patterns (so the float64 reference stays
// cheap) with their own targets; rows on both sides of the 2^31 boundary are checked in full.
TEST(GpuHuge, CeBeyondTwoToThe31Elements) {
  require_device();
  XENT_TEST_RNG(rng);
  constexpr int64_t kVocab = 262144, kRows = 8200, kPatterns = 16;
  static_assert(kVocab * kRows > (int64_t{1} << 31));
  const Matrix patterns = rounded(rng.matrix(kPatterns, kVocab, 2.0), DType::bf16);
  const std::vector<unsigned char> pattern_bytes = encode(DType::bf16, patterns.values);
  const std::size_t row_bytes = kVocab * 2;
  void* logits = nullptr;
  void* grad = nullptr;
  cuda_ok(cudaMalloc(&logits, kRows * row_bytes));
  cuda_ok(cudaMalloc(&grad, kRows * row_bytes));
  std::shared_ptr<void> free_logits(logits, cudaFree), free_grad(grad, cudaFree);
  for (int64_t n = 0; n < kRows; ++n)
    cuda_ok(cudaMemcpy(static_cast<char*>(logits) + n * row_bytes,
                       pattern_bytes.data() + (n % kPatterns) * row_bytes, row_bytes,
                       cudaMemcpyHostToDevice));
  const std::vector<int64_t> target = make_targets(rng, kRows, kVocab, -100, true, false, false);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const reference::Upstream upstream = make_upstream(rng, Reduction::none, kRows, false);
  const Tensor grad_output = upstream_tensor(upstream, Reduction::none, kRows);
  Tensor loss = Tensor::vector(DType::f32, kRows), lse = Tensor::vector(DType::f32, kRows);

  CeOptions options;
  options.reduction = Reduction::none;
  options.label_smoothing = 0.125;
  const Scratch scratch(ce_workspace_size(kRows, kVocab, options, test_device()));
  const TensorView logits_view = matrix(logits, DType::bf16, kRows, kVocab, -1, test_device());
  const TensorView grad_view = matrix(grad, DType::bf16, kRows, kVocab, -1, test_device());
  CeOutputs out;
  out.loss = loss.view();
  out.stats.lse = lse.view();
  out.grad_logits = grad_view;
  ce_forward(logits_view, target_tensor.view(), options, out, grad_output.view(),
             scratch.workspace());
  finish();

  // Every row's loss, from per-pattern statistics: the smoothing part (ε/V)·Σ_i (lse − x_i)
  // depends on the pattern only, the rest on the row's target.
  reference::CeSpec spec;
  spec.reduction = Reduction::none;
  spec.label_smoothing = options.label_smoothing;
  const std::vector<int64_t> first_class(kPatterns, 0);
  const reference::CeResult pattern_stats = reference::ce(patterns, first_class, spec, {});
  std::vector<double> expected_loss(kRows, 0.0);
  for (int64_t n = 0; n < kRows; ++n) {
    if (target[n] == -100) continue;
    const int64_t pattern = n % kPatterns;
    const double lse_value = pattern_stats.lse[pattern];
    const double smoothing_part =
        pattern_stats.loss[pattern] -
        (1 - spec.label_smoothing) * (lse_value - patterns.at(pattern, 0));
    expected_loss[n] =
        (1 - spec.label_smoothing) * (lse_value - patterns.at(pattern, target[n])) + smoothing_part;
  }
  EXPECT_TRUE(close("loss of every row", loss.download(), expected_loss, 1e-3));

  // Full rows around the boundary and at both ends against the reference.
  const std::vector<int64_t> checked = {0, 1, 4095, 8191, 8192, 8193, kRows - 2, kRows - 1};
  Matrix rows(static_cast<int64_t>(checked.size()), kVocab);
  std::vector<int64_t> rows_target;
  reference::Upstream rows_upstream{true, {}};
  std::vector<double> grad_out;
  for (std::size_t k = 0; k < checked.size(); ++k) {
    const int64_t n = checked[k];
    for (int64_t i = 0; i < kVocab; ++i) rows.at(k, i) = patterns.at(n % kPatterns, i);
    rows_target.push_back(target[n]);
    rows_upstream.values.push_back(upstream.values[n]);
    std::vector<unsigned char> bytes(row_bytes);
    cuda_ok(cudaMemcpy(bytes.data(), static_cast<char*>(grad) + n * row_bytes, row_bytes,
                       cudaMemcpyDeviceToHost));
    const std::vector<double> row = decode(DType::bf16, bytes);
    grad_out.insert(grad_out.end(), row.begin(), row.end());
  }
  const reference::CeResult ref = reference::ce(rows, rows_target, spec, rows_upstream);
  EXPECT_TRUE(close("gradient rows past 2^31", grad_out, ref.grad.values,
                    grad_tolerance(DType::bf16, Family::logits,
                                   rounded(ref.grad.values, DType::bf16), ref.grad.values)));
}

// ---- linear_ce at N = 65536, V = 256000, default budget --------------------------------------

TEST(GpuHuge, LinearCeAtDefaultBudget) {
  require_device();
  XENT_TEST_RNG(rng);
  constexpr int64_t kRows = 65536, kHidden = 256, kVocab = 256000;
  const LinearLayer layer = make_linear_layer(rng, kRows, kHidden, kVocab, false, 2.0, DType::bf16);
  const std::vector<int64_t> target = make_targets(rng, kRows, kVocab, -100, true, false, false);
  const reference::Upstream upstream = make_upstream(rng, Reduction::none, kRows, false);
  const Tensor hidden = Tensor::of(layer.hidden, DType::bf16);
  const Tensor weight = Tensor::of(layer.weight, DType::bf16);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, Reduction::none, kRows);

  LinearCeOptions options;
  options.ce.reduction = Reduction::none;
  // Two runs: the default budget, and a small one that forces many chunks. Their fp32 ∂W must
  // agree to accumulation-order rounding, so both form the gradient from bf16-rounded logits: the
  // per-row reference path (which 512 MiB takes since decision 115) stages them in f16, whose
  // ∂W differs from the blocked schedule's by ≈ 3e-3 (each is checked against float64 elsewhere).
  std::optional<HookScope> hook(std::in_place);
  (*hook)->reference_path = cuda::Forced::off;
  std::vector<std::vector<double>> grad_weights;
  std::vector<double> loss_values, grad_hidden_values;
  for (const std::size_t budget : {std::size_t{512} << 20, std::size_t{48} << 20}) {
    options.workspace_budget = budget;
    Tensor loss = Tensor::vector(DType::f32, kRows);
    Tensor grad_hidden = Tensor::matrix(DType::bf16, kRows, kHidden);
    Tensor grad_weight = Tensor::matrix(DType::f32, kVocab, kHidden);
    LinearCeOutputs out;
    out.loss = loss.view();
    out.grads = {grad_hidden.view(), grad_weight.view(), {}};
    const Scratch scratch(linear_ce_workspace_size(kRows, kHidden, kVocab, DType::bf16, options,
                                                   test_device(), true));
    linear_ce_forward(hidden.view(), weight.view(), {}, target_tensor.view(), options, out,
                      grad_output.view(), scratch.workspace());
    finish();
    grad_weights.push_back(grad_weight.download());
    if (loss_values.empty()) {
      loss_values = loss.download();
      grad_hidden_values = grad_hidden.download();
    }
  }
  hook.reset();
  EXPECT_TRUE(
      close("grads.weight, small budget against default", grad_weights[1], grad_weights[0], 1e-4));

  // Sampled rows against the float64 reference (rows are independent under `none`).
  const std::vector<int64_t> sampled = {0, 1, 777, 32768, 50001, kRows - 1};
  Matrix sample_hidden(static_cast<int64_t>(sampled.size()), kHidden);
  std::vector<int64_t> sample_target;
  reference::Upstream sample_upstream{true, {}};
  std::vector<double> sample_loss, sample_grad_hidden;
  for (std::size_t k = 0; k < sampled.size(); ++k) {
    const int64_t n = sampled[k];
    for (int64_t j = 0; j < kHidden; ++j) {
      sample_hidden.at(k, j) = layer.hidden.at(n, j);
      sample_grad_hidden.push_back(grad_hidden_values[n * kHidden + j]);
    }
    sample_target.push_back(target[n]);
    sample_upstream.values.push_back(upstream.values[n]);
    sample_loss.push_back(loss_values[n]);
  }
  reference::CeSpec spec;
  spec.reduction = Reduction::none;
  const reference::LinearCeResult ref =
      reference::linear_ce(sample_hidden, layer.weight, {}, sample_target, spec, sample_upstream);
  const Matrix logits = reference::linear_logits(sample_hidden, layer.weight, {});
  const reference::CeResult torch =
      reference::ce(rounded(logits, DType::bf16), sample_target, spec, sample_upstream);
  const LinearLayer sample_layer{sample_hidden, layer.weight, {}};
  const reference::LinearGrads torch_grads =
      rounded_linear_backward(torch.grad, sample_layer, DType::bf16, DType::f32);
  EXPECT_TRUE(close("loss of sampled rows", sample_loss, ref.ce.loss,
                    stat_tolerance(DType::bf16, Family::linear, torch.loss, ref.ce.loss)));
  EXPECT_TRUE(close("grads.hidden of sampled rows", sample_grad_hidden, ref.grads.hidden.values,
                    grad_tolerance(DType::bf16, Family::linear, torch_grads.hidden.values,
                                   ref.grads.hidden.values)));
}

}  // namespace
}  // namespace xent::test
