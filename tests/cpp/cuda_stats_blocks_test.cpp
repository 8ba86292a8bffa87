// GPU-only cases of linear_ce's blocked schedules (chunk_plan.hpp): (d), statistics_blocks — the
// fused statistics product forms the loss, the statistics and the lse of every row without
// logits, then per vocabulary block the block's gradient from the lse, ∂W of the block, and ∂h
// summed over the blocks in an fp32 accumulator — and (c), vocabulary_blocks, whose first pass
// forms them from row chunks of cuBLASLt logits. Each block's gradient comes from the fused
// gradient product (fused_grad.cuh) or from cuBLASLt logits and the elementwise block kernel
// (the test hook's fused_gradient: off, or on whatever the hidden size); every case
// runs in all four combinations, and (d) also with its ∂h sums in the ∂W output and the ∂h output
// (hidden_sums = weight_grad; plain (d) forces workspace). fused_statistics = on
// makes every eligible call take (d) whenever it fits the budget, off never. Each case asserts the
// schedule and the gradient path it asked for ran (process-wide counts) on compute capability 9.0,
// and checks the loss, lse and every gradient against the float64 reference with outputs
// NaN-poisoned before the run: forward with gradients, backward with and without the forward's
// lse, and the backward with the entropy term of log-probabilities; with and without a bias (and
// ∂bias where the schedule forms it). Budgets: the default (one
// block) and the smallest that still gives several blocks, or several row tiles per block (∂W in
// the fp32 block accumulator).
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/plan/linear_ce_plan.hpp"
#include "gpu_support.hpp"
#include "linear_check.hpp"
#include "hook_scope.hpp"

namespace xent::test {
namespace {

// Where the weight gradient goes.
enum class WeightGrad { same_dtype, fp32, accumulate_fp32, none };
// The budget: the default (one block of all V), several blocks of all rows, several row tiles.
enum class Blocks { one, several, row_tiles };

// Which blocked schedule, and how its blocks form their gradients.
// chunks_fused: the row-chunk schedules ((a), (b)), whose backward with the forward's lse forms
// each chunk's gradient with the fused gradient product (the per-row reference path switched
// off through the test hook, which would otherwise take both calls: cuda_reference_test.cpp).
// *_sums_in_dW: (d) with its fp32 ∂h sums in the last rows of the ∂W output (chunk_plan.hpp
// HiddenSums), whose blocks write ∂W after ∂h; the plain (d) variants keep them in the workspace.
enum class Variant {
  statistics_fused,
  statistics_cublaslt,
  blocks_fused,
  blocks_cublaslt,
  chunks_fused,
  statistics_fused_sums_in_dW,
  statistics_cublaslt_sums_in_dW
};

// A grid case's options may carry this bit beside docs/semantics.md §1's (ce_check.hpp): the layer has a bias
// (in the operands' dtype), and ∂bias is wanted: (c) forms it in its first pass, (d) from its
// blocks' gradients, the row-chunk schedules from each chunk's.
constexpr unsigned kBiasBit = 1u << 16;

struct StatsBlocksCase {
  Variant variant = Variant::statistics_fused;
  DType dtype = DType::bf16;
  int64_t rows = 300, hidden = 72, vocab = 4099;
  unsigned options = 0;  // docs/semantics.md §1's bits, and kBiasBit
  Reduction reduction = Reduction::mean;
  WeightGrad weight = WeightGrad::same_dtype;
  bool want_hidden = true;
  Blocks blocks = Blocks::several;
};

bool sums_in_weight_grad(Variant v) {
  return v == Variant::statistics_fused_sums_in_dW || v == Variant::statistics_cublaslt_sums_in_dW;
}
bool statistics_schedule(Variant v) {
  return v == Variant::statistics_fused || v == Variant::statistics_cublaslt ||
         sums_in_weight_grad(v);
}
bool fused_gradient(Variant v) {
  return v == Variant::statistics_fused || v == Variant::blocks_fused ||
         v == Variant::chunks_fused || v == Variant::statistics_fused_sums_in_dW;
}
bool row_chunks(const cuda::ChunkPlan& plan) {
  return plan.schedule == cuda::Schedule::row_chunks ||
         plan.schedule == cuda::Schedule::row_chunks_accumulated;
}

// Forces through the test hook, for the lifetime of a case: the fused statistics product (on for
// (d), off for (c)), the fused gradient product and where (d) keeps its ∂h sums. With the sums in
// ∂W, the first N/2 rows' sums are in the ∂h output and are narrowed in place at the end: the f16
// cases stage 3 rows of them only, so the in-place ranges run; the bf16 cases stage all; the case
// with H = 1032 keeps all the sums in ∂W.
bool sums_in_hidden_grad(Variant v, int64_t hidden) {
  return sums_in_weight_grad(v) && hidden != 1032;
}
struct ForcedVariant {
  ForcedVariant(Variant v, DType dtype, int64_t hidden) {
    using cuda::Forced;
    hook->fused_statistics = statistics_schedule(v) ? Forced::on : Forced::off;
    hook->fused_gradient = fused_gradient(v) ? Forced::on : Forced::off;
    hook->hidden_sums =
        sums_in_weight_grad(v) ? cuda::HiddenSums::weight_grad : cuda::HiddenSums::workspace;
    hook->hidden_sums_head =
        sums_in_hidden_grad(v, hidden) ? cuda::HiddenSumsHead::always : cuda::HiddenSumsHead::never;
    if (dtype == DType::f16) hook->hidden_sums_staged_rows = 3;
    if (v == Variant::chunks_fused) hook->reference_path = Forced::off;
  }
  HookScope hook;
};

bool takes(const cuda::ChunkPlan& plan, Blocks blocks, Variant variant, int64_t hidden) {
  if (!plan.fits_budget) return false;
  if (variant == Variant::chunks_fused) {
    // one: a chunk of all rows; several: several row chunks.
    return row_chunks(plan) &&
           (blocks == Blocks::one ? plan.chunk_count == 1 : plan.chunk_count >= 2);
  }
  const cuda::Schedule schedule = statistics_schedule(variant) ? cuda::Schedule::statistics_blocks
                                                               : cuda::Schedule::vocabulary_blocks;
  if (plan.schedule != schedule) return false;
  if (plan.hidden_sums_in_weight_grad != sums_in_weight_grad(variant)) return false;
  // ... and the first rows' sums in the ∂h output (contiguous and 16-bit here) where asked.
  if ((plan.hidden_sums_head_rows > 0) != sums_in_hidden_grad(variant, hidden)) return false;
  // In ∂W the sums defer some blocks' ∂W; with several blocks, some but not all.
  if (sums_in_weight_grad(variant) && blocks != Blocks::one &&
      (plan.deferred_first_block == 0 || plan.deferred_first_block >= plan.block_count)) {
    return false;
  }
  switch (blocks) {
    case Blocks::one:
      return plan.block_count == 1;
    case Blocks::several:
      return plan.block_count >= 3 && plan.tile_count == 1;
    case Blocks::row_tiles:
      return plan.block_count >= 2 && plan.tile_count >= 2;
  }
  return false;
}

// The default budget, or the largest below it (in steps of 1/16 down) whose plan has the blocks
// the case asks for; asserted.
std::size_t budget_for(const StatsBlocksCase& c, const LinearCeOptions& base,
                       const LinearGradients& grads) {
  LinearCeOptions options = base;
  const bool statistics = statistics_schedule(c.variant);
  std::size_t budget = options.workspace_budget;
  for (; budget >= 4096; budget -= budget / 16) {
    options.workspace_budget = budget;
    const cuda::ChunkPlan plan =
        cuda::linear_ce_chunk_plan(c.rows, c.hidden, c.vocab, c.dtype, options, grads, statistics);
    if (takes(plan, c.blocks, c.variant, c.hidden)) break;
  }
  options.workspace_budget = budget;
  EXPECT_TRUE(takes(
      cuda::linear_ce_chunk_plan(c.rows, c.hidden, c.vocab, c.dtype, options, grads, statistics),
      c.blocks, c.variant, c.hidden))
      << "no workspace_budget gives the blocked plan this case asks for";
  return budget;
}

void check_statistics_blocks(const StatsBlocksCase& c, Rng& rng) {
  const ForcedVariant forced(c.variant, c.dtype, c.hidden);
  const int64_t rows = c.rows, vocab = c.vocab, hidden_size = c.hidden;
  const bool fp32_weight = c.weight == WeightGrad::fp32 || c.weight == WeightGrad::accumulate_fp32;
  const DType weight_dtype = fp32_weight ? DType::f32 : c.dtype;
  const bool with_bias = (c.options & kBiasBit) != 0;
  const bool want_bias = with_bias;
  const unsigned ce_options = c.options & ~kBiasBit;
  const LinearLayer layer =
      make_linear_layer(rng, rows, hidden_size, vocab, with_bias, 2.0, c.dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, true);
  CeSetup setup = make_ce_setup(ce_options, c.reduction, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, c.reduction, rows, false);
  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const reference::CeResult ref = reference::ce(logits, target, setup.spec, upstream);
  const reference::CeResult torch =
      reference::ce(rounded(logits, c.dtype), target, setup.spec, upstream);
  const reference::LinearGrads ref_grads =
      reference::linear_backward(ref.grad, layer.hidden, layer.weight);
  const reference::LinearGrads torch_grads =
      rounded_linear_backward(torch.grad, layer, c.dtype, weight_dtype);

  const Tensor hidden = Tensor::of(layer.hidden, c.dtype);
  const Tensor weight = Tensor::of(layer.weight, c.dtype);
  const Tensor bias = with_bias ? Tensor::of(layer.bias, c.dtype) : Tensor();
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, c.reduction, rows, c.dtype);
  Tensor grad_hidden = c.want_hidden ? Tensor::matrix(c.dtype, rows, hidden_size) : Tensor();
  Tensor grad_weight =
      c.weight != WeightGrad::none ? Tensor::matrix(weight_dtype, vocab, hidden_size) : Tensor();
  Tensor grad_bias = want_bias ? Tensor::vector(c.dtype, vocab) : Tensor();
  LinearGradients grads{grad_hidden.view(), grad_weight.view(), grad_bias.view()};
  grads.accumulate_weight = c.weight == WeightGrad::accumulate_fp32;

  LinearCeOptions options;
  options.ce = setup.options;
  options.workspace_budget = budget_for(c, options, grads);
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget);
  const Scratch scratch(
      linear_ce_workspace_size(rows, hidden_size, vocab, c.dtype, options, test_device(), true));

  // The buffer ∂W is added into starts from these values; the check subtracts them.
  const Matrix prefill = rng.matrix(vocab, hidden_size, 0.01);
  auto reset_grads = [&] {
    if (grad_hidden.present()) grad_hidden.poison();
    if (grad_bias.present()) grad_bias.poison();
    if (!grad_weight.present()) return;
    if (grads.accumulate_weight) {
      grad_weight.upload(prefill.values);
    } else {
      grad_weight.poison();
    }
  };
  auto check_grads = [&](const reference::LinearGrads& ref_grads,
                         const reference::LinearGrads& torch_grads) {
    const std::vector<double>&ref_hidden = ref_grads.hidden.values,
          &torch_hidden = torch_grads.hidden.values, &ref_weight = ref_grads.weight.values,
          &torch_weight = torch_grads.weight.values;
    if (grad_bias.present()) {
      EXPECT_TRUE(close("grads.bias", grad_bias.download(), ref_grads.bias,
                        grad_tolerance(c.dtype, Family::linear, torch_grads.bias, ref_grads.bias)));
    }
    if (grad_hidden.present()) {
      EXPECT_TRUE(close("grads.hidden", grad_hidden.download(), ref_hidden,
                        grad_tolerance(c.dtype, Family::linear, torch_hidden, ref_hidden)));
    }
    if (!grad_weight.present()) return;
    std::vector<double> formed = grad_weight.download();
    if (grads.accumulate_weight) {
      for (std::size_t i = 0; i < formed.size(); ++i) formed[i] -= prefill.values[i];
    }
    EXPECT_TRUE(close("grads.weight", formed, ref_weight,
                      grad_tolerance(c.dtype, Family::linear, torch_weight, ref_weight)));
  };
  // Runs `call` and asserts it took the case's schedule and gradient path where they can run
  // (compute capability 9.0; elsewhere (d) and the fused gradient decline). `with_lse`: the call
  // brings the forward's lse, which the row-chunk schedules need for the fused gradient.
  const cuda::ChunkPlan plan = cuda::linear_ce_chunk_plan(
      rows, hidden_size, vocab, c.dtype, options, grads, statistics_schedule(c.variant));
  auto expect_paths = [&](const auto& call, bool with_lse) {
    const bool sm90 = hopper_paths_here();
    const int64_t before = cuda::linear_ce_runs(plan.schedule);
    const int64_t fused_before = cuda::fused_grad_count();
    call();
    finish();
    const int64_t ran = cuda::linear_ce_runs(plan.schedule) - before;
    EXPECT_EQ(ran, sm90 || plan.schedule != cuda::Schedule::statistics_blocks ? 1 : 0)
        << "the schedule of this case did not run";
    const bool fused_ran = cuda::fused_grad_count() > fused_before;
    EXPECT_EQ(fused_ran,
              sm90 && fused_gradient(c.variant) && (c.variant != Variant::chunks_fused || with_lse))
        << "the fused gradient product " << (fused_ran ? "ran" : "did not run");
  };

  const DType stat = result_dtype(c.dtype);
  Tensor lse = Tensor::vector(stat, rows);
  {
    SCOPED_TRACE("linear_ce_forward with gradients");
    Tensor loss = loss_tensor(c.reduction, rows, c.dtype);
    loss.poison();
    lse.poison();
    reset_grads();
    LinearCeOutputs out;
    out.loss = loss.view();
    out.stats.lse = lse.view();
    out.grads = grads;
    expect_paths(
        [&] {
          linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(),
                            options, out, grad_output.view(), scratch.workspace());
        },
        false);
    EXPECT_TRUE(close("loss", loss.download(), ref.loss,
                      stat_tolerance(c.dtype, Family::linear, torch.loss, ref.loss)));
    EXPECT_TRUE(close("lse", lse.download(), ref.lse,
                      stat_tolerance(c.dtype, Family::linear, torch.lse, ref.lse)));
    check_grads(ref_grads, torch_grads);
  }
  for (const bool with_lse : {true, false}) {
    SCOPED_TRACE(with_lse ? "linear_ce_backward with lse" : "linear_ce_backward without lse");
    reset_grads();
    expect_paths(
        [&] {
          linear_ce_backward(hidden.view(), weight.view(), bias.view(), target_tensor.view(),
                             with_lse ? lse.view() : TensorView{}, grad_output.view(), options,
                             grads, scratch.workspace());
        },
        with_lse);
    check_grads(ref_grads, torch_grads);
  }
  if (c.reduction != Reduction::none || ce_options != 0) return;

  // Log-probabilities with entropy (reduction none, no options): the backward brings the
  // forward's lse and entropy, so (d) forms no statistics and goes straight to the blocks.
  SCOPED_TRACE("linear_ce_backward with the entropy term");
  Tensor entropy = Tensor::vector(stat, rows);
  {
    Tensor loss = loss_tensor(c.reduction, rows, c.dtype);
    LinearCeOutputs out;
    out.loss = loss.view();
    out.stats.lse = lse.view();
    out.stats.entropy = entropy.view();
    const Scratch forward_scratch(
        linear_ce_workspace_size(rows, hidden_size, vocab, c.dtype, options, test_device(), false));
    linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), options, out,
                      {}, forward_scratch.workspace());
    finish();
  }
  const std::vector<double> grad_entropy = rng.uniform_vector(rows, -1.0, 1.0);
  const Tensor grad_entropy_tensor = Tensor::of(grad_entropy, DType::f32);
  auto with_entropy = [&](const Matrix& of_logits, const reference::CeResult& base) {
    Matrix grad = reference::entropy_grad(of_logits, target, setup.spec, grad_entropy);
    for (std::size_t i = 0; i < grad.values.size(); ++i) grad.values[i] += base.grad.values[i];
    return grad;
  };
  const Matrix ref_grad = with_entropy(logits, ref);
  const Matrix torch_grad = with_entropy(rounded(logits, c.dtype), torch);
  const reference::LinearGrads ref_entropy =
      reference::linear_backward(ref_grad, layer.hidden, layer.weight);
  const reference::LinearGrads torch_entropy =
      rounded_linear_backward(torch_grad, layer, c.dtype, weight_dtype);
  reset_grads();
  expect_paths(
      [&] {
        linear_ce_backward(hidden.view(), weight.view(), bias.view(), target_tensor.view(),
                           lse.view(), grad_output.view(),
                           EntropyGradient{entropy.view(), grad_entropy_tensor.view()}, options,
                           grads, scratch.workspace());
      },
      true);
  check_grads(ref_entropy, torch_entropy);
}

// (dtype, N, H, V, options, reduction, weight gradient, ∂h wanted, blocks)
using StatsBlocksParam =
    std::tuple<DType, int64_t, int64_t, int64_t, unsigned, Reduction, WeightGrad, bool, Blocks>;

class CudaStatisticsBlocks
    : public ::testing::TestWithParam<std::tuple<Variant, StatsBlocksParam>> {};

TEST_P(CudaStatisticsBlocks, MatchesReference) {
  require_device();
  XENT_TEST_RNG(rng);
  StatsBlocksCase c;
  c.variant = std::get<0>(GetParam());
  std::tie(c.dtype, c.rows, c.hidden, c.vocab, c.options, c.reduction, c.weight, c.want_hidden,
           c.blocks) = std::get<1>(GetParam());
  check_statistics_blocks(c, rng);
}

std::string stats_blocks_name(
    const ::testing::TestParamInfo<std::tuple<Variant, StatsBlocksParam>>& info) {
  const auto [dtype, rows, hidden, vocab, options, reduction, weight, want_hidden, blocks] =
      std::get<1>(info.param);
  static const char* variants[] = {"d_fused",
                                   "d_cublaslt",
                                   "c_fused",
                                   "c_cublaslt",
                                   "chunks_fused",
                                   "d_fused_sums_in_dW",
                                   "d_cublaslt_sums_in_dW"};
  static const char* weights[] = {"dW", "dWfp32", "dWadded", "nodW"};
  static const char* block_names[] = {"one", "several", "row_tiles"};
  return std::string(variants[static_cast<int>(std::get<0>(info.param))]) + "_" +
         short_name(dtype) + "_" +
         linear_case_label(rows, hidden, vocab, options & ~kBiasBit, reduction) +
         ((options & kBiasBit) != 0 ? "_bias" : "") + "_" + weights[static_cast<int>(weight)] +
         (want_hidden ? "" : "_nodh") + "_" + block_names[static_cast<int>(blocks)];
}

// Every option of docs/semantics.md §1 (class weights: w_y in the records, and the lane's columns' weights in
// the fused gradient where label smoothing carries them).
constexpr unsigned kFusedOptions = kAllCeOptions;

// Odd shapes (N off the 128-row tile, V off the 256-column tile, H off the 64-wide K tile), every
// option the fused product takes alone and together, every reduction (none with a per-row
// upstream gradient), each weight-gradient form, ∂h absent, and the three block layouts.
const StatsBlocksParam kGrid[] = {
    StatsBlocksParam{DType::bf16, 300, 72, 4099, 0, Reduction::none, WeightGrad::same_dtype, true,
                     Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, 0, Reduction::mean, WeightGrad::same_dtype, true,
                     Blocks::one},
    StatsBlocksParam{DType::f16, 300, 72, 4099, 0, Reduction::sum, WeightGrad::same_dtype, true,
                     Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, kSmoothing, Reduction::mean,
                     WeightGrad::same_dtype, true, Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, kZLoss, Reduction::none, WeightGrad::same_dtype,
                     true, Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, kSoftcap, Reduction::sum, WeightGrad::same_dtype,
                     true, Blocks::several},
    StatsBlocksParam{DType::f16, 300, 72, 4099, kLogitScale, Reduction::mean,
                     WeightGrad::same_dtype, true, Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, kRowWeight, Reduction::mean,
                     WeightGrad::same_dtype, true, Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, kClassWeight, Reduction::mean,
                     WeightGrad::same_dtype, true, Blocks::several},
    StatsBlocksParam{DType::f16, 300, 72, 4099, kClassWeight | kSmoothing, Reduction::none,
                     WeightGrad::same_dtype, true, Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, kFusedOptions, Reduction::none,
                     WeightGrad::same_dtype, true, Blocks::several},
    StatsBlocksParam{DType::f16, 300, 72, 4099, kFusedOptions, Reduction::mean, WeightGrad::fp32,
                     true, Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, 0, Reduction::mean, WeightGrad::accumulate_fp32,
                     true, Blocks::several},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, kBiasBit, Reduction::none, WeightGrad::same_dtype,
                     true, Blocks::several},
    StatsBlocksParam{DType::f16, 1000, 136, 4099, kBiasBit | kFusedOptions, Reduction::sum,
                     WeightGrad::same_dtype, true, Blocks::row_tiles},
    StatsBlocksParam{DType::bf16, 300, 72, 4099, 0, Reduction::mean, WeightGrad::same_dtype, false,
                     Blocks::several},
    StatsBlocksParam{DType::bf16, 1000, 136, 4099, 0, Reduction::none, WeightGrad::same_dtype, true,
                     Blocks::row_tiles},
    StatsBlocksParam{DType::f16, 1000, 136, 4099, kFusedOptions, Reduction::sum, WeightGrad::fp32,
                     true, Blocks::row_tiles},
    StatsBlocksParam{DType::bf16, 77, 8, 32003, kSmoothing | kZLoss, Reduction::mean,
                     WeightGrad::same_dtype, true, Blocks::several},
    StatsBlocksParam{DType::bf16, 200, 1032, 2051, 0, Reduction::none, WeightGrad::same_dtype, true,
                     Blocks::several}};

// Every grid case in every variant whose plan the planner makes at some budget (budget_for
// asserts it), which leaves out for (c): one block of all V (its first pass already chunks the
// rows, so a tile of all N rows and all V never fits beside it) and an fp32 ∂W (at these sizes
// row chunks accumulating it in place are cheaper at every budget); for the row-chunk variant:
// row tiles (it has no blocks) and H = 1032 (every budget that splits those rows into chunks
// makes (c) cheaper).
std::vector<std::tuple<Variant, StatsBlocksParam>> variant_grid() {
  std::vector<std::tuple<Variant, StatsBlocksParam>> cases;
  for (const Variant variant :
       {Variant::statistics_fused, Variant::statistics_cublaslt, Variant::blocks_fused,
        Variant::blocks_cublaslt, Variant::chunks_fused, Variant::statistics_fused_sums_in_dW,
        Variant::statistics_cublaslt_sums_in_dW}) {
    for (const StatsBlocksParam& param : kGrid) {
      const int64_t hidden = std::get<2>(param);
      const WeightGrad weight = std::get<6>(param);
      const bool want_hidden = std::get<7>(param);
      const Blocks blocks = std::get<8>(param);
      // ∂h sums in ∂W need ∂h, and a ∂W written over.
      if (sums_in_weight_grad(variant) &&
          (!want_hidden || weight == WeightGrad::none || weight == WeightGrad::accumulate_fp32)) {
        continue;
      }
      if (variant == Variant::blocks_fused || variant == Variant::blocks_cublaslt) {
        if (blocks == Blocks::one || weight == WeightGrad::fp32 ||
            weight == WeightGrad::accumulate_fp32) {
          continue;
        }
      }
      if (variant == Variant::chunks_fused && (blocks == Blocks::row_tiles || hidden > 1024)) {
        continue;
      }
      cases.emplace_back(variant, param);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaStatisticsBlocks, ::testing::ValuesIn(variant_grid()),
                         stats_blocks_name);

// The fused gradient's row split between the consumers and the epilogue warps
// (fused_grad_product.cu) differs between a CTA's last tile and the others, which the grid's
// shapes (one or two tiles per CTA) barely reach: here ≈ 5 tiles per CTA, with each steady share
// (the test hook's fused_own_rows) forced in turn.
TEST(CudaFusedGradientShare, ManyTilesPerCta) {
  require_device();
  XENT_TEST_RNG(rng);
  HookScope hook;
  for (const int own : {0, 4, 8}) {
    SCOPED_TRACE(::testing::Message() << "fused_own_rows=" << own);
    hook->fused_own_rows = own;
    StatsBlocksCase c;
    c.variant = Variant::statistics_fused;
    std::tie(c.dtype, c.rows, c.hidden, c.vocab, c.options, c.reduction, c.weight, c.want_hidden,
             c.blocks) = StatsBlocksParam{
        DType::bf16, 1100,       40, 20011, 0, Reduction::none, WeightGrad::same_dtype,
        true,        Blocks::one};
    check_statistics_blocks(c, rng);
    std::tie(c.dtype, c.options, c.reduction) =
        std::make_tuple(DType::f16, kFusedOptions, Reduction::mean);
    check_statistics_blocks(c, rng);
  }
}

}  // namespace
}  // namespace xent::test
