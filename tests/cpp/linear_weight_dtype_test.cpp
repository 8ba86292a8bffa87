// WeightGradAccumulation::weight_dtype (linear_ce.hpp, docs/semantics.md §2 "Accumulation in the
// weight's dtype"): a 16-bit ∂W summed chunk by chunk in its own dtype, one rounding per chunk.
// Checked against the float64 reference with the section's error model: what PyTorch loses at the
// dtype (grad_tolerance) plus u·Σ_k ‖S_k‖ / ‖S_K‖, S_k the float64 ∂W after chunk k and u the
// dtype's unit roundoff, over several chunk counts that small budgets force. An fp32 layer's ∂W
// is untouched by the option (the same bits as the default).
#include <cmath>
#include <vector>

#include "linear_check.hpp"
#if XENT_TEST_ON_GPU
#include "cuda/plan/linear_ce_plan.hpp"
#else
#include "cpu/linear_plan.hpp"
#endif

namespace xent::test {
namespace {

#if !XENT_TEST_ON_GPU
// The CPU planner's view of a training call with weight_dtype accumulation.
cpu::LinearShape training_shape(int64_t rows, int64_t hidden, int64_t vocab, DType dtype) {
  cpu::LinearShape shape;
  shape.rows = rows;
  shape.hidden = hidden;
  shape.vocab = vocab;
  shape.dtype = dtype;
  shape.with_gradients = true;
  shape.weight_dtype_accumulation = true;
  return shape;
}
#endif

// Rows per rounding of ∂W under this budget: the plan's row chunks (on CUDA always the row-chunk
// schedule without an accumulator, whose products add into the 16-bit ∂W).
int64_t rows_per_rounding(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                          const LinearCeOptions& options,
                          [[maybe_unused]] const LinearGradients& grads) {
#if XENT_TEST_ON_GPU
  const cuda::ChunkPlan plan =
      cuda::linear_ce_chunk_plan(rows, hidden, vocab, dtype, options, grads);
  EXPECT_EQ(plan.schedule, cuda::Schedule::row_chunks) << "weight_dtype needs no fp32 accumulator";
  EXPECT_EQ(plan.accumulator_bytes, 0u);
  return plan.chunk_rows;
#else
  return cpu::plan_linear(training_shape(rows, hidden, vocab, dtype), options.workspace_budget)
      .chunk_rows;
#endif
}

// Σ_k ‖S_k‖ / ‖S_K‖ for row chunks of `chunk_rows`: S_k = Σ over rows < end of chunk k of G_nᵀ h_n.
double partial_sum_ratio(const Matrix& grad, const Matrix& hidden, int64_t chunk_rows) {
  const int64_t rows = grad.rows, vocab = grad.cols, width = hidden.cols;
  std::vector<double> sum(static_cast<std::size_t>(vocab * width), 0.0);
  double total = 0, last = 0;
  for (int64_t first = 0; first < rows; first += chunk_rows) {
    for (int64_t n = first; n < std::min(rows, first + chunk_rows); ++n) {
      for (int64_t v = 0; v < vocab; ++v) {
        const double g = grad.at(n, v);
        if (g == 0) continue;
        for (int64_t i = 0; i < width; ++i) sum[v * width + i] += g * hidden.at(n, i);
      }
    }
    last = norm(sum);
    total += last;
  }
  return last > 0 ? total / last : 0.0;
}

class LinearCeWeightDtype : public ::testing::TestWithParam<std::tuple<DType, int>> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(LinearCeWeightDtype, OneRoundingPerChunkWithinTheErrorModel) {
  XENT_TEST_RNG(rng);
  const auto [dtype, rows_per_chunk] = GetParam();
  const int64_t rows = 37, hidden_size = 67, vocab = 1031;
  const LinearLayer layer = make_linear_layer(rng, rows, hidden_size, vocab, false, 2.0, dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  const CeSetup setup = make_ce_setup(0, Reduction::mean, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, Reduction::mean, rows, false);
  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const reference::CeResult ref = reference::ce(logits, target, setup.spec, upstream);
  const reference::CeResult torch =
      reference::ce(rounded(logits, dtype), target, setup.spec, upstream);
  const reference::LinearGrads grads_ref =
      reference::linear_backward(ref.grad, layer.hidden, layer.weight);
  const reference::LinearGrads grads_torch =
      rounded_linear_backward(torch.grad, layer, dtype, dtype);

  const Tensor hidden = Tensor::of(layer.hidden, dtype), weight = Tensor::of(layer.weight, dtype);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, Reduction::mean, rows, dtype);
  Tensor grad_hidden = Tensor::matrix(dtype, rows, hidden_size);
  Tensor grad_weight = Tensor::matrix(dtype, vocab, hidden_size);
  const LinearGradients grads{grad_hidden.view(), grad_weight.view(), {}};

  LinearCeOptions options;
  options.ce = setup.options;
  options.weight_grad_accumulation = WeightGradAccumulation::weight_dtype;
#if XENT_TEST_ON_GPU
  // The largest budget (steps of 1/8) whose plan fits it and sums ∂W over chunks of at most
  // rows_per_chunk rows. (A budget below the smallest plan reports that plan, of one-row chunks,
  // which the call would refuse: only plans that fit count.)
  std::size_t chosen = 0;
  for (std::size_t budget = 4096; budget < (std::size_t{64} << 20); budget += budget / 8) {
    LinearCeOptions trial = options;
    trial.workspace_budget = budget;
    const cuda::ChunkPlan plan =
        cuda::linear_ce_chunk_plan(rows, hidden_size, vocab, dtype, trial, grads);
    if (!plan.fits_budget) continue;
    if (plan.chunk_rows > rows_per_chunk) break;
    chosen = budget;
  }
  ASSERT_GT(chosen, 0u) << "no budget gives chunks of at most " << rows_per_chunk << " rows";
  options.workspace_budget = chosen;
#else
  options.workspace_budget = static_cast<std::size_t>(rows_per_chunk) *
                             cpu::linear_row_bytes(training_shape(rows, hidden_size, vocab, dtype));
#endif
  const int64_t chunk_rows = rows_per_rounding(rows, hidden_size, vocab, dtype, options, grads);
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget
                                    << ", rows per chunk " << chunk_rows);
  const Scratch scratch(on_gpu() ? linear_ce_workspace_size(rows, hidden_size, vocab, dtype,
                                                            options, test_device(), true)
                                 : 0);
  const double growth =
      unit_roundoff(dtype) * partial_sum_ratio(ref.grad, layer.hidden, chunk_rows);
  auto check = [&](const char* what) {
    finish();
    EXPECT_TRUE(close(
        std::string(what) + ": grads.weight", grad_weight.download(), grads_ref.weight.values,
        grad_tolerance(dtype, Family::linear, grads_torch.weight.values, grads_ref.weight.values) +
            1.05 * growth));
    EXPECT_TRUE(close(
        std::string(what) + ": grads.hidden", grad_hidden.download(), grads_ref.hidden.values,
        grad_tolerance(dtype, Family::linear, grads_torch.hidden.values, grads_ref.hidden.values)));
  };
  Tensor loss = loss_tensor(Reduction::mean, rows, dtype);
  Tensor lse = Tensor::vector(DType::f32, rows);
  LinearCeOutputs out;
  out.loss = loss.view();
  out.stats.lse = lse.view();
  out.grads = grads;
  linear_ce_forward(hidden.view(), weight.view(), {}, target_tensor.view(), options, out,
                    grad_output.view(), scratch.workspace());
  check("forward");
  grad_hidden.poison();
  grad_weight.poison();
  linear_ce_backward(hidden.view(), weight.view(), {}, target_tensor.view(), lse.view(),
                     grad_output.view(), options, grads, scratch.workspace());
  check("backward");
}

std::string weight_dtype_name(const ::testing::TestParamInfo<std::tuple<DType, int>>& info) {
  return short_name(std::get<0>(info.param)) + "_rows" + std::to_string(std::get<1>(info.param));
}

// 37 rows: one chunk, chunks of 8 (5 roundings), of 3 (13) and of one row (37).
INSTANTIATE_TEST_SUITE_P(Chunks, LinearCeWeightDtype,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                                            ::testing::Values(37, 8, 3, 1)),
                         weight_dtype_name);

#if XENT_TEST_ON_GPU
// The plan at the shape (no run): at 64 MiB the fp32 path cannot hold its 1.96 GiB
// accumulator and leaves the row chunks; weight_dtype keeps them, with no accumulator, and the
// workspace query stays within the budget.
TEST(LinearCeWeightDtypeEdges, SmallBudgetKeepsRowChunksOnCuda) {
  require_device();
  const int64_t rows = 8192, hidden_size = 4096, vocab = 128256;
  const LinearGradients grads{TensorView{nullptr, DType::bf16, 2, rows, hidden_size, hidden_size},
                              TensorView{nullptr, DType::bf16, 2, vocab, hidden_size, hidden_size},
                              {}};
  LinearCeOptions options;
  options.workspace_budget = std::size_t{64} << 20;
  const cuda::ChunkPlan fp32 =
      cuda::linear_ce_chunk_plan(rows, hidden_size, vocab, DType::bf16, options, grads);
  EXPECT_NE(fp32.schedule, cuda::Schedule::row_chunks);
  options.weight_grad_accumulation = WeightGradAccumulation::weight_dtype;
  for (const bool statistics : {false, true}) {
    const cuda::ChunkPlan plan = cuda::linear_ce_chunk_plan(rows, hidden_size, vocab, DType::bf16,
                                                            options, grads, statistics);
    EXPECT_EQ(plan.schedule, cuda::Schedule::row_chunks);
    EXPECT_EQ(plan.accumulator_bytes, 0u);
    EXPECT_GT(plan.chunk_count, 1);
    EXPECT_LE(plan.total_bytes, options.workspace_budget);
  }
  EXPECT_LE(
      linear_ce_workspace_size(rows, hidden_size, vocab, DType::bf16, options, test_device(), true),
      options.workspace_budget);
}
#endif

TEST(LinearCeWeightDtypeEdges, NoEffectOnAnFp32LayerOrAnEmptyBatch) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t rows = 9, hidden_size = 13, vocab = 101;
  const Tensor hidden = Tensor::of(rng.matrix(rows, hidden_size, 1.0), DType::f32);
  const Tensor weight = Tensor::of(rng.matrix(vocab, hidden_size, 0.3), DType::f32);
  const Tensor target =
      Tensor::of_integers(make_targets(rng, rows, vocab, -100, false, false, false), DType::i64);
  auto grad_weight_with = [&](WeightGradAccumulation accumulation) {
    LinearCeOptions options;
    options.ce.reduction = Reduction::sum;
    options.workspace_budget = 4096;  // several chunks
    options.weight_grad_accumulation = accumulation;
    Tensor grad_weight = Tensor::matrix(DType::f32, vocab, hidden_size);
    Tensor loss = Tensor::scalar(DType::f32);
    const Scratch scratch(on_gpu() ? linear_ce_workspace_size(rows, hidden_size, vocab, DType::f32,
                                                              options, test_device(), true)
                                   : 0);
    linear_ce_forward(hidden.view(), weight.view(), {}, target.view(), options,
                      {loss.view(), {}, {{}, grad_weight.view(), {}}}, {}, scratch.workspace());
    finish();
    return grad_weight.download();
  };
  EXPECT_TRUE(grad_weight_with(WeightGradAccumulation::fp32) ==
              grad_weight_with(WeightGradAccumulation::weight_dtype));

  // No rows: ∂W is zero in its own dtype.
  const Tensor no_hidden = Tensor::matrix(DType::bf16, 0, hidden_size);
  const Tensor weight16 =
      Tensor::of(rounded(rng.matrix(vocab, hidden_size, 0.3), DType::bf16), DType::bf16);
  const Tensor no_target = Tensor::vector(DType::i64, 0);
  Tensor grad_weight = Tensor::matrix(DType::bf16, vocab, hidden_size);
  LinearCeOptions options;
  options.ce.reduction = Reduction::sum;
  options.weight_grad_accumulation = WeightGradAccumulation::weight_dtype;
  const Scratch scratch(on_gpu() ? linear_ce_workspace_size(0, hidden_size, vocab, DType::bf16,
                                                            options, test_device(), true)
                                 : 0);
  Tensor loss = Tensor::scalar(DType::f32);
  linear_ce_forward(no_hidden.view(), weight16.view(), {}, no_target.view(), options,
                    {loss.view(), {}, {{}, grad_weight.view(), {}}}, {}, scratch.workspace());
  finish();
  EXPECT_TRUE(grad_weight.download() == std::vector<double>(vocab * hidden_size, 0.0));
}

}  // namespace
}  // namespace xent::test
