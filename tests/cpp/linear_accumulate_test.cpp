// accumulate_weight (linear_ce.hpp LinearGradients): ∂W ADDED into a caller's buffer (fp32, fp64
// for fp64 layers), Megatron's main_grad. The buffer starts with random values of the size of ∂W,
// so an op that overwrote it, zero-filled it or left part of it unwritten fails: each check takes
// the prefill off and compares what was added with the float64 reference. Every entry point that
// forms ∂W adds into the same buffer in turn: linear_ce_forward with gradients, then
// linear_ce_backward (and the entropy overload), and linear_distill through the shared paths;
// on CUDA with budgets that force each place ∂W is formed in (chunk_plan.hpp).
#include <cmath>
#include <functional>
#include <type_traits>

#include "linear_check.hpp"
#if XENT_TEST_ON_GPU
#include "hook_scope.hpp"
#include "cuda/plan/linear_ce_plan.hpp"
#include "cuda/plan/linear_distill_plan.hpp"
#else
#include "cpu/linear_plan.hpp"
#endif

namespace xent::test {
namespace {

// Where ∂W is formed. CUDA (chunk_plan.hpp): one row chunk; several row chunks adding in place;
// vocabulary blocks whose ∂W is one product per block (all rows in one tile); blocks summed over
// row tiles. The CPU has row chunks only: there the cases run one chunk, chunks of 8 rows, of one
// row and of 5 rows (uneven).
enum class WeightSchedule { one_chunk, row_chunks, blocks, block_tiles };

const char* schedule_name(WeightSchedule schedule) {
  static const char* names[] = {"one_chunk", "row_chunks", "blocks", "block_tiles"};
  return names[static_cast<int>(schedule)];
}

struct Shape {
  int64_t rows, hidden, vocab;
};

// The planner takes vocabulary blocks for an fp32 ∂W only when re-reading V×H per row chunk costs
// more than the blocks' extra product: a wide layer (the small one stays in row chunks). Row
// tiles of a block re-read its columns of W per tile (chunk_plan.cpp), so the planner takes them
// only where the blocks are wider still. The CPU's row chunks need no wide layer: its cases all
// take the small one (the wide ones cost 27 of the 44 s a CPU suite takes).
Shape shape_for(WeightSchedule schedule) {
#if !XENT_TEST_ON_GPU
  schedule = WeightSchedule::one_chunk;
#endif
  switch (schedule) {
    case WeightSchedule::blocks:
      return Shape{23, 256, 16411};
    case WeightSchedule::block_tiles:
      return Shape{37, 256, 24593};
    default:
      return Shape{37, 67, 1031};
  }
}

#if XENT_TEST_ON_GPU
bool takes(const cuda::ChunkPlan& plan, WeightSchedule schedule) {
  // Both vocabulary-blocked schedules form ∂W block by block (linear_distill takes (d) where its
  // row chunks would be small; linear_ce's plan here does not offer it the fused product).
  const bool blocked = plan.schedule == cuda::Schedule::vocabulary_blocks ||
                       plan.schedule == cuda::Schedule::statistics_blocks;
  switch (schedule) {
    case WeightSchedule::one_chunk:
      return !blocked && plan.chunk_count == 1;
    case WeightSchedule::row_chunks:
      return !blocked && plan.chunk_count > 1;
    case WeightSchedule::blocks:
      return blocked && plan.block_count >= 2 && plan.tile_count == 1;
    case WeightSchedule::block_tiles:
      return blocked && plan.tile_count > 1;
  }
  return false;
}

// The smallest budget (in steps of 1/8) whose plan forms ∂W as `schedule` asks, asserted.
std::size_t gpu_budget(WeightSchedule schedule,
                       const std::function<cuda::ChunkPlan(std::size_t)>& plan_of) {
  std::size_t budget = std::size_t{512} << 20;
  if (schedule != WeightSchedule::one_chunk) {
    for (budget = 4096; budget <= (std::size_t{64} << 20); budget += budget / 8) {
      const cuda::ChunkPlan plan = plan_of(budget);
      if (plan.fits_budget && takes(plan, schedule)) break;
    }
  }
  const cuda::ChunkPlan plan = plan_of(budget);
  EXPECT_TRUE(plan.fits_budget && takes(plan, schedule))
      << "no workspace_budget up to 64 MiB gives the schedule " << schedule_name(schedule);
  return budget;
}
#else
// On the CPU a number of rows per chunk.
std::size_t cpu_budget(WeightSchedule schedule, const Shape& s, DType dtype, bool distill) {
  cpu::LinearShape shape;
  shape.rows = s.rows;
  shape.hidden = s.hidden;
  shape.vocab = s.vocab;
  shape.dtype = dtype;
  shape.distill = distill;
  shape.with_gradients = true;
  const int64_t rows_per_chunk[] = {s.rows, 8, 1, 5};
  return static_cast<std::size_t>(rows_per_chunk[static_cast<int>(schedule)]) *
         cpu::linear_row_bytes(shape);
}
#endif

#if XENT_TEST_ON_GPU
// The plan each op makes for a call (linear_distill's teacher: logits of the student's dtype).
cuda::ChunkPlan plan_of(const Shape& s, DType dtype, const LinearCeOptions& options,
                        const LinearGradients& grads) {
  return cuda::linear_ce_chunk_plan(s.rows, s.hidden, s.vocab, dtype, options, grads);
}
cuda::ChunkPlan plan_of(const Shape& s, DType dtype, const LinearDistillOptions& options,
                        const LinearGradients& grads) {
  return cuda::linear_distill_chunk_plan(s.rows, s.hidden, 0, s.vocab, dtype, options, dtype,
                                         grads);
}
#endif

// The budget that makes the op of `Options` (linear_ce's or linear_distill's) form ∂W as
// `schedule` asks.
template <class Options>
std::size_t budget_for(WeightSchedule schedule, const Shape& s, DType dtype,
                       [[maybe_unused]] Options options,
                       [[maybe_unused]] const LinearGradients& grads) {
#if XENT_TEST_ON_GPU
  return gpu_budget(schedule, [&](std::size_t budget) {
    options.workspace_budget = budget;
    return plan_of(s, dtype, options, grads);
  });
#else
  return cpu_budget(schedule, s, dtype, std::is_same_v<Options, LinearDistillOptions>);
#endif
}

// The caller's buffer: random values as large as ∂W's (rms), in the buffer dtype.
struct Prefilled {
  Matrix values;
  Tensor buffer;
  Prefilled(Rng& rng, const Matrix& grad_weight, DType dtype)
      : values(rounded(
            rng.matrix(grad_weight.rows, grad_weight.cols,
                       norm(grad_weight.values) / std::sqrt(double(grad_weight.values.size()))),
            dtype)),
        buffer(Tensor::of(values, dtype)) {}
  void refill() { buffer.upload(values.values); }
  // What the calls since the prefill added, per call (divided by `calls`).
  std::vector<double> added(int calls) const {
    std::vector<double> out = buffer.download();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = (out[i] - values.values[i]) / calls;
    return out;
  }
};

// ∂W and its PyTorch-at-this-dtype model for a gradient with respect to the logits.
struct WeightReference {
  reference::LinearGrads ref, torch;
};

WeightReference weight_reference(const Matrix& grad, const Matrix& torch_grad,
                                 const LinearLayer& layer, DType dtype) {
  return {reference::linear_backward(grad, layer.hidden, layer.weight),
          is_half(dtype) ? rounded_linear_backward(torch_grad, layer, dtype, DType::f32)
                         : reference::linear_backward(grad, layer.hidden, layer.weight)};
}

void expect_added(const char* what, const Prefilled& prefilled, int calls,
                  const std::vector<double>& ref, const std::vector<double>& torch, DType dtype) {
  EXPECT_TRUE(
      close(what, prefilled.added(calls), ref, grad_tolerance(dtype, Family::linear, torch, ref)));
}

using AccumulateParam = std::tuple<DType, WeightSchedule, Reduction>;

// (layer dtype, where ∂W is formed, reduction) and the shape that schedule needs.
class AccumulateCase : public ::testing::TestWithParam<AccumulateParam> {
 protected:
  void SetUp() override { require_device(); }
  const Shape shape = shape_for(std::get<1>(GetParam()));
  const int64_t rows = shape.rows, hidden_size = shape.hidden, vocab = shape.vocab;
};

class LinearCeAccumulate : public AccumulateCase {};
class LinearDistillAccumulate : public AccumulateCase {};

TEST_P(LinearCeAccumulate, AddsIntoTheBuffer) {
  XENT_TEST_RNG(rng);
  const auto [dtype, schedule, reduction] = GetParam();
  const DType buffer_dtype = result_dtype(dtype);
  const LinearLayer layer = make_linear_layer(rng, rows, hidden_size, vocab, true, 2.0, dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  const CeSetup setup = make_ce_setup(0, reduction, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, reduction, rows, false);
  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const Matrix torch_logits = is_half(dtype) ? rounded(logits, dtype) : logits;
  const reference::CeResult ref = reference::ce(logits, target, setup.spec, upstream);
  const reference::CeResult torch = reference::ce(torch_logits, target, setup.spec, upstream);
  const WeightReference grads_ref = weight_reference(ref.grad, torch.grad, layer, dtype);

  const Tensor hidden = Tensor::of(layer.hidden, dtype), weight = Tensor::of(layer.weight, dtype);
  const Tensor bias = Tensor::of(layer.bias, dtype);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, reduction, rows, dtype);
  Prefilled prefilled(rng, grads_ref.ref.weight, buffer_dtype);
  Tensor grad_hidden = Tensor::matrix(dtype, rows, hidden_size);
  Tensor grad_bias = Tensor::vector(buffer_dtype, vocab);
  LinearGradients grads{grad_hidden.view(), prefilled.buffer.view(), grad_bias.view()};
  grads.accumulate_weight = true;

  LinearCeOptions options;
  options.ce = setup.options;
  options.workspace_budget = budget_for(schedule, shape, dtype, options, grads);
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget);
  const Scratch scratch(on_gpu() ? linear_ce_workspace_size(rows, hidden_size, vocab, dtype,
                                                            options, test_device(), true)
                                 : 0);
  auto check_hidden_and_bias = [&] {
    EXPECT_TRUE(close("grads.hidden", grad_hidden.download(), grads_ref.ref.hidden.values,
                      grad_tolerance(dtype, Family::linear, grads_ref.torch.hidden.values,
                                     grads_ref.ref.hidden.values)));
    EXPECT_TRUE(
        close("grads.bias", grad_bias.download(), grads_ref.ref.bias,
              grad_tolerance(dtype, Family::linear, grads_ref.torch.bias, grads_ref.ref.bias)));
  };

  Tensor loss = loss_tensor(reduction, rows, dtype);
  Tensor lse = Tensor::vector(buffer_dtype, rows), entropy = Tensor::vector(buffer_dtype, rows);
  {
    SCOPED_TRACE("linear_ce_forward with gradients adds ∂W");
    LinearCeOutputs out;
    out.loss = loss.view();
    out.stats.lse = lse.view();
    out.stats.entropy = entropy.view();
    out.grads = grads;
    linear_ce_forward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), options, out,
                      grad_output.view(), scratch.workspace());
    finish();
    expect_added("buffer − prefill", prefilled, 1, grads_ref.ref.weight.values,
                 grads_ref.torch.weight.values, dtype);
    check_hidden_and_bias();
  }
  {
    SCOPED_TRACE("linear_ce_backward adds ∂W once more");
    grad_hidden.poison();
    grad_bias.poison();
    linear_ce_backward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), lse.view(),
                       grad_output.view(), options, grads, scratch.workspace());
    finish();
    expect_added("(buffer − prefill) / 2", prefilled, 2, grads_ref.ref.weight.values,
                 grads_ref.torch.weight.values, dtype);
    check_hidden_and_bias();
  }
  if (reduction != Reduction::none) return;  // the entropy term needs per-row upstreams
  SCOPED_TRACE("linear_ce_backward with the entropy term adds its ∂W");
  std::vector<double> grad_entropy_values;
  for (int64_t n = 0; n < rows; ++n) {
    grad_entropy_values.push_back(round_to(DType::f32, rng.uniform(-2, 2)));
  }
  auto with_entropy = [&](const Matrix& x, const reference::CeResult& ce) {
    Matrix g = ce.grad;
    const Matrix e = reference::entropy_grad(x, target, setup.spec, grad_entropy_values);
    for (std::size_t i = 0; i < g.values.size(); ++i) g.values[i] += e.values[i];
    return g;
  };
  const WeightReference entropy_ref =
      weight_reference(with_entropy(logits, ref), with_entropy(torch_logits, torch), layer, dtype);
  const Tensor grad_entropy = Tensor::of(grad_entropy_values, buffer_dtype);
  prefilled.refill();
  linear_ce_backward(hidden.view(), weight.view(), bias.view(), target_tensor.view(), lse.view(),
                     grad_output.view(), EntropyGradient{entropy.view(), grad_entropy.view()},
                     options, grads, scratch.workspace());
  finish();
  expect_added("buffer − prefill", prefilled, 1, entropy_ref.ref.weight.values,
               entropy_ref.torch.weight.values, dtype);
}

std::vector<DType> accumulate_dtypes() {
  std::vector<DType> dtypes = {DType::f32, DType::bf16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

std::string accumulate_name(const ::testing::TestParamInfo<AccumulateParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + schedule_name(std::get<1>(info.param)) + "_" +
         reduction_label(std::get<2>(info.param));
}

const auto kSchedules = ::testing::Values(WeightSchedule::one_chunk, WeightSchedule::row_chunks,
                                          WeightSchedule::blocks, WeightSchedule::block_tiles);

INSTANTIATE_TEST_SUITE_P(Schedules, LinearCeAccumulate,
                         ::testing::Combine(::testing::ValuesIn(accumulate_dtypes()), kSchedules,
                                            ::testing::Values(Reduction::mean, Reduction::none)),
                         accumulate_name);

// ---- linear_distill: the same flag through the shared gradient sums and block pass -----------

TEST_P(LinearDistillAccumulate, AddsIntoTheBuffer) {
  XENT_TEST_RNG(rng);
  const auto [dtype, schedule, reduction] = GetParam();
  const LinearLayer student = make_linear_layer(rng, rows, hidden_size, vocab, false, 2.0, dtype);
  const Matrix teacher_logits = rounded(rng.matrix(rows, vocab, 2.0), dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  const DistillSetup setup = make_distill_setup(DistillKind::forward_kl, 0, reduction, 0.5);
  const reference::Upstream upstream = make_upstream(rng, reduction, rows, false);
  const Matrix logits = reference::linear_logits(student.hidden, student.weight, {});
  const Matrix torch_logits = is_half(dtype) ? rounded(logits, dtype) : logits;
  const WeightReference grads_ref = weight_reference(
      reference::distill(logits, teacher_logits, &target, setup.spec, upstream).grad,
      reference::distill(torch_logits, teacher_logits, &target, setup.spec, upstream).grad, student,
      dtype);

  const Tensor hidden = Tensor::of(student.hidden, dtype);
  const Tensor weight = Tensor::of(student.weight, dtype);
  const Tensor teacher = Tensor::of(teacher_logits, dtype);
  const Teacher teacher_views{teacher.view(), {}, {}};
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, reduction, rows, dtype);
  Prefilled prefilled(rng, grads_ref.ref.weight, result_dtype(dtype));
  LinearGradients grads{{}, prefilled.buffer.view(), {}};
  grads.accumulate_weight = true;

#if XENT_TEST_ON_GPU
  // The planner takes (d) for this small shape at every budget (its model prices it cheapest):
  // the row-chunk schedules these cases cover run with (d) held off.
  HookScope hook;
  if (schedule == WeightSchedule::one_chunk || schedule == WeightSchedule::row_chunks) {
    hook->distill_statistics_blocks = cuda::Forced::off;
  }
#endif
  LinearDistillOptions options;
  options.distill = setup.options;
  options.workspace_budget = budget_for(schedule, shape, dtype, options, grads);
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget);
  const Scratch scratch(on_gpu() ? linear_distill_workspace_size(rows, hidden_size, 0, vocab, dtype,
                                                                 options, test_device(), true)
                                 : 0);
  Tensor loss = loss_tensor(reduction, rows, dtype);
  linear_distill_forward(hidden.view(), weight.view(), teacher_views, target_tensor.view(), options,
                         {loss.view(), grads}, grad_output.view(), scratch.workspace());
  finish();
  expect_added("forward: buffer − prefill", prefilled, 1, grads_ref.ref.weight.values,
               grads_ref.torch.weight.values, dtype);
  linear_distill_backward(hidden.view(), weight.view(), teacher_views, target_tensor.view(),
                          grad_output.view(), options, grads, scratch.workspace());
  finish();
  expect_added("backward: (buffer − prefill) / 2", prefilled, 2, grads_ref.ref.weight.values,
               grads_ref.torch.weight.values, dtype);
}

INSTANTIATE_TEST_SUITE_P(Schedules, LinearDistillAccumulate,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16), kSchedules,
                                            ::testing::Values(Reduction::sum)),
                         accumulate_name);

// ---- an empty batch adds nothing; a float64 layer takes a float64 buffer ----------------------

TEST(LinearCeAccumulateEdges, EmptyBatchLeavesTheBufferAsItWas) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t hidden_size = 67, vocab = 1031;
  const Tensor hidden = Tensor::matrix(DType::bf16, 0, hidden_size);
  const Tensor weight =
      Tensor::of(rounded(rng.matrix(vocab, hidden_size, 0.2), DType::bf16), DType::bf16);
  const Tensor target = Tensor::vector(DType::i64, 0);
  const Matrix prefill = rounded(rng.matrix(vocab, hidden_size, 1.0), DType::f32);
  Tensor buffer = Tensor::of(prefill, DType::f32);
  LinearGradients grads{{}, buffer.view(), {}};
  grads.accumulate_weight = true;
  LinearCeOptions options;
  options.ce.reduction = Reduction::sum;
  const Scratch scratch(on_gpu() ? linear_ce_workspace_size(0, hidden_size, vocab, DType::bf16,
                                                            options, test_device(), true)
                                 : 0);
  Tensor loss = Tensor::scalar(DType::f32);
  linear_ce_forward(hidden.view(), weight.view(), {}, target.view(), options,
                    {loss.view(), {}, grads}, {}, scratch.workspace());
  linear_ce_backward(hidden.view(), weight.view(), {}, target.view(), {}, {}, options, grads,
                     scratch.workspace());
  finish();
  EXPECT_TRUE(buffer.download() == prefill.values) << "an empty batch must add nothing";
}

TEST(LinearCeAccumulateEdges, BufferDtypeFollowsTheLayer) {
  require_device();
  XENT_TEST_RNG(rng);
  const int64_t rows = 5, hidden_size = 7, vocab = 11;
  auto call = [&](DType layer_dtype, DType buffer_dtype) {
    const Tensor hidden = Tensor::of(rng.matrix(rows, hidden_size, 1.0), layer_dtype);
    const Tensor weight = Tensor::of(rng.matrix(vocab, hidden_size, 0.3), layer_dtype);
    const Tensor target =
        Tensor::of_integers(make_targets(rng, rows, vocab, -100, false, false, false), DType::i64);
    Tensor buffer = Tensor::matrix(buffer_dtype, vocab, hidden_size);
    LinearGradients grads{{}, buffer.view(), {}};
    grads.accumulate_weight = true;
    Tensor loss = Tensor::scalar(result_dtype(layer_dtype));
    const Scratch scratch(on_gpu() ? linear_ce_workspace_size(rows, hidden_size, vocab, layer_dtype,
                                                              {}, test_device(), true)
                                   : 0);
    expect_invalid(
        [&] {
          linear_ce_forward(hidden.view(), weight.view(), {}, target.view(), {},
                            {loss.view(), {}, grads}, {}, scratch.workspace());
        },
        "grads.weight", std::string("accumulate_weight: got ") + dtype_name(buffer_dtype));
    EXPECT_TRUE(buffer.untouched() && loss.untouched()) << "an output was written before the error";
  };
  call(DType::bf16, DType::bf16);  // the layer's dtype: not where fp32 sums can go
  call(DType::f32, DType::f16);
  if (!on_gpu()) call(DType::f64, DType::f32);  // float64 math keeps a float64 buffer
}

}  // namespace
}  // namespace xent::test
