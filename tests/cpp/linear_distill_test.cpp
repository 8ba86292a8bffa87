// linear_distill (docs/semantics.md §4): student logits h_s·W_sᵀ against a teacher given as logits or as
// h_t·W_tᵀ, every kind and option, checked through linear_distill_forward (with and without
// gradients) and linear_distill_backward; on the GPU also through each vocabulary-blocked
// schedule, with the outputs poisoned before every gradient call.
#include <cmath>

#include "linear_check.hpp"
#if XENT_TEST_ON_GPU
#include "cuda/plan/linear_distill_plan.hpp"
#include "hook_scope.hpp"
#endif

namespace xent::test {
namespace {

struct LinearDistillProblem {
  DType dtype = DType::f32;
  DType teacher_logits_dtype = DType::f32;  // used when the teacher comes as logits
  int64_t rows = 37, hidden = 67, teacher_hidden = 53, vocab = 1031;
  DistillKind kind = DistillKind::forward_kl;
  unsigned options = 0;
  double beta = 0.5;
  Reduction reduction = Reduction::mean;
  bool teacher_as_logits = false;
  // > vocab: the V' shared columns of a wider teacher's logits (docs/semantics.md §3.2), the
  // columns past V' poisoned.
  int64_t teacher_logits_row_stride = -1;
  Budget budget = Budget::default_budget;
  bool fp32_logits = false;
  bool fp32_param_grads = false;
  bool ignored_rows = true, all_ignored = false;
  bool unit_grad_output = false;
  bool want_hidden = true, want_weight = true;
  // GPU: a budget that makes the CUDA planner take the vocabulary-blocked schedule (gradients of
  // column blocks from the row statistics of a first pass), with all rows in one tile or
  // (row_tiles) in several tiles accumulated per block. The case asserts the schedule it takes.
  bool blocked = false, row_tiles = false;
  // With blocked: schedule (d), whose first pass forms the row statistics block by block too
  // and whose blocks sum ∂h in fp32 (statistics), else (c). (d)'s ∂h sums in the workspace, or
  // in the ∂W output (sums_in_weight_grad) and there the first rows' in the ∂h output
  // (sums_head), narrowed in place with only 3 rows staged (staged_rows).
  bool statistics = false, sums_in_weight_grad = false, sums_head = false, staged_rows = false;
  bool hard_weights = false;  // class and row weights on the hard term
};

#if XENT_TEST_ON_GPU
// The test hook's forcings that make the planner take (c) or (d), and put (d)'s ∂h sums where the problem
// asks, for the lifetime of a case.
struct BlockedScheduleSwitches {
  explicit BlockedScheduleSwitches(const LinearDistillProblem& p) {
    if (!p.blocked) return;
    hook->distill_statistics_blocks = p.statistics ? cuda::Forced::on : cuda::Forced::off;
    hook->hidden_sums =
        p.sums_in_weight_grad ? cuda::HiddenSums::weight_grad : cuda::HiddenSums::workspace;
    hook->hidden_sums_head =
        p.sums_head ? cuda::HiddenSumsHead::always : cuda::HiddenSumsHead::never;
    if (p.staged_rows) hook->hidden_sums_staged_rows = 3;
  }
  HookScope hook;
};
#endif

#if XENT_TEST_ON_GPU
// The plan of the call with every requested gradient, as linear_distill.cu makes it.
cuda::ChunkPlan gpu_plan(const LinearDistillProblem& p, std::size_t budget) {
  LinearDistillOptions options;
  options.distill.kind = p.kind;  // jsd and tvd keep sums beside their records
  options.fp32_logits = p.fp32_logits;
  options.workspace_budget = budget;
  LinearGradients grads;
  const DType param_dtype = p.fp32_param_grads ? DType::f32 : p.dtype;
  if (p.want_hidden) grads.hidden = TensorView{nullptr, p.dtype, 2, p.rows, p.hidden, p.hidden};
  if (p.want_weight) {
    grads.weight = TensorView{nullptr, param_dtype, 2, p.vocab, p.hidden, p.hidden};
  }
  const int64_t teacher_h = p.teacher_as_logits ? 0 : p.teacher_hidden;
  return cuda::linear_distill_chunk_plan(p.rows, p.hidden, teacher_h, p.vocab, p.dtype, options,
                                         p.teacher_logits_dtype, grads);
}

cuda::Schedule blocked_schedule(const LinearDistillProblem& p) {
  return p.statistics ? cuda::Schedule::statistics_blocks : cuda::Schedule::vocabulary_blocks;
}

// The smallest budget (in steps of 1/8) at which the blocked schedule runs as the problem asks.
std::size_t blocked_budget(const LinearDistillProblem& p) {
  for (std::size_t budget = 4096; budget <= (std::size_t{64} << 20); budget += budget / 8) {
    const cuda::ChunkPlan plan = gpu_plan(p, budget);
    if (plan.fits_budget && plan.schedule == blocked_schedule(p) && plan.block_count >= 2 &&
        (plan.tile_count > 1) == p.row_tiles &&
        (plan.hidden_sums_head_rows > 0) == (p.sums_head && p.want_hidden)) {
      return budget;
    }
  }
  ADD_FAILURE() << "no workspace_budget up to 64 MiB gives the blocked schedule";
  return std::size_t{512} << 20;
}
#endif

void check_linear_distill(const LinearDistillProblem& p, Rng& rng) {
  const int64_t rows = p.rows, vocab = p.vocab;
  const DType param_dtype = p.fp32_param_grads ? DType::f32 : p.dtype;
  const bool with_target = !(p.options & kNoTarget);
  const DistillSetup unweighted = make_distill_setup(p.kind, p.options, p.reduction, p.beta);
  const LinearLayer student = make_linear_layer(rng, rows, p.hidden, vocab, false, 2.0, p.dtype);
  const LinearLayer teacher =
      make_linear_layer(rng, rows, p.teacher_hidden, vocab, false, 2.0, p.dtype);
  const std::vector<int64_t> target =
      make_targets(rng, rows, vocab, -100, p.ignored_rows, p.all_ignored, false);
  const std::vector<int64_t>* target_or_null = with_target ? &target : nullptr;
  const reference::Upstream upstream = make_upstream(rng, p.reduction, rows, p.unit_grad_output);
  DistillSetup weighted = unweighted;
  const HardWeightTensors weights =
      p.hard_weights ? add_hard_weights(weighted, rng, rows, vocab) : HardWeightTensors{};
  const DistillSetup& setup = weighted;

  const Matrix student_logits = reference::linear_logits(student.hidden, student.weight, {});
  Matrix teacher_logits = reference::linear_logits(teacher.hidden, teacher.weight, {});
  if (p.teacher_as_logits) teacher_logits = rounded(teacher_logits, p.teacher_logits_dtype);
  const reference::DistillResult ref =
      reference::distill(student_logits, teacher_logits, target_or_null, setup.spec, upstream);
  const reference::LinearGrads ref_grads =
      reference::linear_backward(ref.grad, student.hidden, student.weight);
  // PyTorch at this dtype holds the student logits in the input dtype, and the teacher's in the
  // dtype the teacher comes in: the input dtype for h_t·W_tᵀ, the given one for teacher logits
  // (fp32 teacher logits stay fp32, as they do for the op). Rounding them to the input dtype
  // anyway added an independent rounding error to this model that the op does not make, so the
  // two errors no longer moved together and the op's exceeded the model's by chance (2 seeds in
  // 300 for fp32 teacher logits of a bf16 student, reverse_kl).
  const bool half = is_half(p.dtype);
  // The CUDA backend converts teacher logits of another dtype into the chunk dtype of the student
  // (src/cuda/linear/linear_distill.cu), so there the op does round them, and so does its model.
  const DType torch_teacher_dtype =
      p.teacher_as_logits && !on_gpu() ? p.teacher_logits_dtype : p.dtype;
  const reference::DistillResult torch =
      half ? reference::distill(rounded(student_logits, p.dtype),
                                rounded(teacher_logits, torch_teacher_dtype), target_or_null,
                                setup.spec, upstream)
           : ref;
  const reference::LinearGrads torch_grads =
      half ? rounded_linear_backward(torch.grad, student, p.dtype, param_dtype) : ref_grads;

  const Tensor hidden = Tensor::of(student.hidden, p.dtype);
  const Tensor weight = Tensor::of(student.weight, p.dtype);
  const Tensor teacher_logits_tensor =
      p.teacher_as_logits
          ? Tensor::of(teacher_logits, p.teacher_logits_dtype, p.teacher_logits_row_stride)
          : Tensor();
  const Tensor teacher_hidden =
      p.teacher_as_logits ? Tensor() : Tensor::of(teacher.hidden, p.dtype);
  const Tensor teacher_weight =
      p.teacher_as_logits ? Tensor() : Tensor::of(teacher.weight, p.dtype);
  const Teacher teacher_views{teacher_logits_tensor.view(), teacher_hidden.view(),
                              teacher_weight.view()};
  const Tensor target_tensor = with_target ? Tensor::of_integers(target, DType::i64) : Tensor();
  const Tensor grad_output = upstream_tensor(upstream, p.reduction, rows, p.dtype);

  LinearDistillOptions options;
  options.distill = setup.options;
  options.fp32_logits = p.fp32_logits;
  const int64_t teacher_h = p.teacher_as_logits ? 0 : p.teacher_hidden;
  auto scratch_for = [&](const LinearDistillOptions& o, bool with_gradients) {
    return Scratch(on_gpu()
                       ? linear_distill_workspace_size(rows, p.hidden, teacher_h, vocab, p.dtype, o,
                                                       test_device(), with_gradients)
                       : 0);
  };
#if XENT_TEST_ON_GPU
  const BlockedScheduleSwitches switches(p);
  const int64_t runs_before = cuda::linear_distill_runs(blocked_schedule(p));
  if (p.blocked) {
    options.workspace_budget = blocked_budget(p);
    const cuda::ChunkPlan plan = gpu_plan(p, options.workspace_budget);
    ASSERT_EQ(plan.schedule, blocked_schedule(p));
    EXPECT_GE(plan.block_count, 2);
    EXPECT_EQ(plan.tile_count > 1, p.row_tiles);
    EXPECT_EQ(plan.hidden_sums_in_weight_grad, p.sums_in_weight_grad && p.want_hidden);
    // The workspace the query reports holds this plan (fp32 teacher logits of a 16-bit student
    // included, which need a conversion tile), so the op runs it as planned.
    EXPECT_LE(plan.total_bytes,
              linear_distill_workspace_size(rows, p.hidden, teacher_h, vocab, p.dtype, options,
                                            test_device(), true));
  }
#endif
  if (!p.blocked)
    options.workspace_budget = budget_bytes(p.budget, [&](std::size_t bytes) {
      LinearDistillOptions trial = options;
      trial.workspace_budget = bytes;
      Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
      LinearDistillOutputs out;
      out.loss = loss.view();
      // With every gradient, the call that needs the most chunk memory per row.
      Tensor grad_h = Tensor::matrix(p.dtype, rows, p.hidden);
      Tensor grad_w = Tensor::matrix(param_dtype, vocab, p.hidden);
      out.grads = {grad_h.view(), grad_w.view(), {}};
      try {
        const Scratch scratch = scratch_for(trial, true);
        linear_distill_forward(hidden.view(), weight.view(), teacher_views, target_tensor.view(),
                               trial, out, {}, scratch.workspace());
        finish();
        // The forward without gradients too: below the smallest row chunk, blocks can still
        // train where the loss alone, in row chunks, cannot run.
        LinearDistillOutputs loss_only;
        loss_only.loss = loss.view();
        const Scratch loss_scratch = scratch_for(trial, false);
        linear_distill_forward(hidden.view(), weight.view(), teacher_views, target_tensor.view(),
                               trial, loss_only, {}, loss_scratch.workspace());
        finish();
      } catch (const Error& e) {
        if (std::string(e.what()).find("workspace_budget") != std::string::npos) return false;
        throw;
      }
      return true;
    });
  SCOPED_TRACE(::testing::Message() << "workspace_budget " << options.workspace_budget);

  const double loss_tol = stat_tolerance(p.dtype, Family::linear, torch.loss, ref.loss);
  // tvd near-ties may take either side; the band covers the rounding of the chunk logits.
  const reference::LinearGrads midpoint_grads = reference::linear_backward(
      tvd_ties_at_midpoint(student_logits, teacher_logits, target_or_null, setup.spec, upstream,
                           half ? 3e-2 : 1e-4)
          .grad,
      student.hidden, student.weight);
  const double hidden_slack =
      2 * relative_error(midpoint_grads.hidden.values, ref_grads.hidden.values);
  const double weight_slack =
      2 * relative_error(midpoint_grads.weight.values, ref_grads.weight.values);
  auto check_grads = [&](const Tensor& grad_hidden, const Tensor& grad_weight) {
    if (grad_hidden.present()) {
      EXPECT_TRUE(close("grads.hidden", grad_hidden.download(), ref_grads.hidden.values,
                        grad_tolerance(p.dtype, Family::linear, torch_grads.hidden.values,
                                       ref_grads.hidden.values) +
                            hidden_slack));
    }
    if (grad_weight.present()) {
      EXPECT_TRUE(close("grads.weight", grad_weight.download(), ref_grads.weight.values,
                        grad_tolerance(p.dtype, Family::linear, torch_grads.weight.values,
                                       ref_grads.weight.values) +
                            weight_slack));
    }
  };

  {
    SCOPED_TRACE("linear_distill_forward, loss only");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    LinearDistillOutputs out;
    out.loss = loss.view();
    const Scratch scratch = scratch_for(options, false);
    linear_distill_forward(hidden.view(), weight.view(), teacher_views, target_tensor.view(),
                           options, out, {}, scratch.workspace());
    finish();
    EXPECT_TRUE(close("loss", loss.download(), ref.loss, loss_tol));
  }
  Tensor grad_hidden = p.want_hidden ? Tensor::matrix(p.dtype, rows, p.hidden) : Tensor();
  Tensor grad_weight = p.want_weight ? Tensor::matrix(param_dtype, vocab, p.hidden) : Tensor();
  const LinearGradients grads{grad_hidden.view(), grad_weight.view(), {}};
  {
    SCOPED_TRACE("linear_distill_forward, with gradients");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    LinearDistillOutputs out;
    out.loss = loss.view();
    out.grads = grads;
    const Scratch scratch = scratch_for(options, true);
    linear_distill_forward(hidden.view(), weight.view(), teacher_views, target_tensor.view(),
                           options, out, grad_output.view(), scratch.workspace());
    finish();
    EXPECT_TRUE(close("loss", loss.download(), ref.loss, loss_tol));
    check_grads(grad_hidden, grad_weight);
  }
  {
    SCOPED_TRACE("linear_distill_backward");
    for (Tensor* t : {&grad_hidden, &grad_weight})
      if (t->present()) t->poison();
    const Scratch scratch = scratch_for(options, true);
    linear_distill_backward(hidden.view(), weight.view(), teacher_views, target_tensor.view(),
                            grad_output.view(), options, grads, scratch.workspace());
    finish();
    check_grads(grad_hidden, grad_weight);
  }
#if XENT_TEST_ON_GPU
  // The forward with gradients and the backward ran the blocked schedule asked for.
  if (p.blocked && rows > 0) {
    EXPECT_EQ(cuda::linear_distill_runs(blocked_schedule(p)) - runs_before, 2);
  }
#endif
}

const std::vector<DistillKind> kKinds = {DistillKind::forward_kl, DistillKind::reverse_kl,
                                         DistillKind::jsd, DistillKind::soft_ce, DistillKind::tvd};

// ---- grid: every kind with each option and every pair, teacher as hidden+weight --------------

using GridParam = std::tuple<DType, DistillKind, unsigned, Reduction>;
class LinearDistillGrid : public ::testing::TestWithParam<GridParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(LinearDistillGrid, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearDistillProblem p;
  std::tie(p.dtype, p.kind, p.options, p.reduction) = GetParam();
  check_linear_distill(p, rng);
}

std::string grid_name(const ::testing::TestParamInfo<GridParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + distill_kind_name(std::get<1>(info.param)) +
         "_" + distill_options_label(std::get<2>(info.param)) + "_" +
         reduction_label(std::get<3>(info.param));
}

INSTANTIATE_TEST_SUITE_P(OptionsUpToPairs, LinearDistillGrid,
                         ::testing::Combine(::testing::Values(DType::f32),
                                            ::testing::ValuesIn(kKinds),
                                            ::testing::ValuesIn(distill_option_sets_up_to_pairs()),
                                            ::testing::Values(Reduction::none, Reduction::mean)),
                         grid_name);

std::vector<DType> other_dtypes() {
  std::vector<DType> dtypes = {DType::bf16, DType::f16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(OtherDtypes, LinearDistillGrid,
                         ::testing::Combine(::testing::ValuesIn(other_dtypes()),
                                            ::testing::ValuesIn(kKinds),
                                            ::testing::Values(kHardAndSoft | kTemperature),
                                            ::testing::Values(Reduction::sum)),
                         grid_name);

// ---- teacher forms, budgets and special cases -------------------------------------------------

enum class LinearDistillCase {
  teacher_logits,
  teacher_logits_f32,
  wider_teacher_logits,
  smallest_budget,
  uneven_chunks,
  fp32_logits,
  fp32_param_grads,
  all_rows_ignored,
  empty_batch,
  absent_grad_output,
  hidden_grad_only,
  weight_grad_only,
  jsd_beta_quarter,
};

const char* case_name(LinearDistillCase c) {
  static const char* names[] = {"teacher_logits",     "teacher_logits_f32", "wider_teacher_logits",
                                "smallest_budget",    "uneven_chunks",      "fp32_logits",
                                "fp32_param_grads",   "all_rows_ignored",   "empty_batch",
                                "absent_grad_output", "hidden_grad_only",   "weight_grad_only",
                                "jsd_beta025"};
  return names[static_cast<int>(c)];
}

using CaseParam = std::tuple<DType, LinearDistillCase, DistillKind>;
class LinearDistillCases : public ::testing::TestWithParam<CaseParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(LinearDistillCases, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearDistillProblem p;
  LinearDistillCase which;
  std::tie(p.dtype, which, p.kind) = GetParam();
  p.reduction = Reduction::mean;
  p.teacher_logits_dtype = p.dtype;
  switch (which) {
    case LinearDistillCase::teacher_logits:
      p.teacher_as_logits = true;
      break;
    case LinearDistillCase::teacher_logits_f32:
      p.teacher_as_logits = true;
      p.teacher_logits_dtype = DType::f32;
      p.reduction = Reduction::none;
      break;
    case LinearDistillCase::wider_teacher_logits:
      p.teacher_as_logits = true;
      p.teacher_logits_row_stride = p.vocab + 13;
      break;
    case LinearDistillCase::smallest_budget:
      p.budget = Budget::smallest;
      p.rows = 11;
      break;
    case LinearDistillCase::uneven_chunks:
      p.budget = Budget::uneven_chunks;
      p.reduction = Reduction::none;
      break;
    case LinearDistillCase::fp32_logits:
      p.fp32_logits = true;
      break;
    case LinearDistillCase::fp32_param_grads:
      p.fp32_param_grads = true;
      break;
    case LinearDistillCase::all_rows_ignored:
      p.all_ignored = true;
      break;
    case LinearDistillCase::empty_batch:
      p.rows = 0;
      break;
    case LinearDistillCase::absent_grad_output:
      p.unit_grad_output = true;
      break;
    case LinearDistillCase::hidden_grad_only:
      p.want_weight = false;
      break;
    case LinearDistillCase::weight_grad_only:
      p.want_hidden = false;
      break;
    case LinearDistillCase::jsd_beta_quarter:
      p.kind = DistillKind::jsd;
      p.beta = 0.25;
      break;
  }
  check_linear_distill(p, rng);
}

std::string case_param_name(const ::testing::TestParamInfo<CaseParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + case_name(std::get<1>(info.param)) + "_" +
         distill_kind_name(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    Special, LinearDistillCases,
    ::testing::Combine(
        ::testing::Values(DType::f32, DType::bf16),
        ::testing::Values(LinearDistillCase::teacher_logits, LinearDistillCase::teacher_logits_f32,
                          LinearDistillCase::wider_teacher_logits,
                          LinearDistillCase::smallest_budget, LinearDistillCase::uneven_chunks,
                          LinearDistillCase::fp32_logits, LinearDistillCase::fp32_param_grads,
                          LinearDistillCase::all_rows_ignored, LinearDistillCase::empty_batch,
                          LinearDistillCase::absent_grad_output,
                          LinearDistillCase::hidden_grad_only, LinearDistillCase::weight_grad_only),
        ::testing::Values(DistillKind::forward_kl, DistillKind::reverse_kl)),
    case_param_name);

INSTANTIATE_TEST_SUITE_P(JsdBeta, LinearDistillCases,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(LinearDistillCase::jsd_beta_quarter),
                                            ::testing::Values(DistillKind::jsd)),
                         case_param_name);

#if XENT_TEST_ON_GPU
// ---- the vocabulary-blocked schedule: every kind and option through the block gradients -------

enum class BlockedVariant {
  hidden_teacher,      // bf16, teacher hidden + weight, mean, ignored rows, one tile of all rows
  fp32_logits_none,    // fp32 chunk and tile logits, reduction none (per-row upstream gradient)
  logits_row_tiles,    // input-dtype teacher logits of wider rows (§3.2), 600 rows in tiles, sum
  f32_teacher_logits,  // fp32 teacher logits of a bf16 student: converted tiles
  weight_only_f16,     // fp16, ∂W alone: the first pass writes no gradient, only statistics
};

const char* blocked_variant_name(BlockedVariant v) {
  static const char* names[] = {"hidden_teacher", "fp32_logits_none", "logits_row_tiles",
                                "f32_teacher_logits", "weight_only_f16"};
  return names[static_cast<int>(v)];
}

using BlockedParam = std::tuple<DistillKind, unsigned, BlockedVariant>;
class LinearDistillBlocked : public ::testing::TestWithParam<BlockedParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(LinearDistillBlocked, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearDistillProblem p;
  BlockedVariant variant;
  std::tie(p.kind, p.options, variant) = GetParam();
  p.dtype = DType::bf16;
  p.teacher_logits_dtype = DType::bf16;
  p.blocked = true;
  switch (variant) {
    case BlockedVariant::hidden_teacher:
      break;
    case BlockedVariant::fp32_logits_none:
      p.fp32_logits = true;
      p.reduction = Reduction::none;
      break;
    case BlockedVariant::logits_row_tiles:
      p.teacher_as_logits = true;
      p.teacher_logits_row_stride = p.vocab + 13;
      p.rows = 600;
      p.row_tiles = true;
      p.reduction = Reduction::sum;
      break;
    case BlockedVariant::f32_teacher_logits:
      p.teacher_as_logits = true;
      p.teacher_logits_dtype = DType::f32;
      break;
    case BlockedVariant::weight_only_f16:
      p.dtype = DType::f16;
      p.teacher_logits_dtype = DType::f16;
      p.want_hidden = false;
      break;
  }
  check_linear_distill(p, rng);
}

std::string blocked_name(const ::testing::TestParamInfo<BlockedParam>& info) {
  return std::string(distill_kind_name(std::get<0>(info.param))) + "_" +
         distill_options_label(std::get<1>(info.param)) + "_" +
         blocked_variant_name(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    EveryKindAndOption, LinearDistillBlocked,
    ::testing::Combine(::testing::ValuesIn(kKinds),
                       ::testing::Values(0u, kTemperature, kDistillSoftcap, kHardAndSoft, kNoTarget,
                                         kTemperature | kDistillSoftcap | kHardAndSoft),
                       ::testing::Values(BlockedVariant::hidden_teacher,
                                         BlockedVariant::fp32_logits_none,
                                         BlockedVariant::logits_row_tiles,
                                         BlockedVariant::f32_teacher_logits,
                                         BlockedVariant::weight_only_f16)),
    blocked_name);

// ---- schedule (d): the row statistics block by block too, ∂h summed over the blocks ----------

enum class StatisticsVariant {
  hidden_teacher,   // bf16, teacher hidden + weight, mean, ignored rows; ∂h sums in the workspace
  sums_in_outputs,  // fp32 chunk logits, reduction none; ∂h sums in ∂W, the first rows' in ∂h
  logits_row_tiles,  // teacher logits of wider rows (§3.2), 600 rows in tiles, sum; sums in ws
  f32_teacher_f16,   // fp16 student, fp32 teacher logits converted per tile; sums in ∂W and ∂h,
                     // three rows staged for the in-place narrowing
  weight_only,       // ∂W alone: no ∂h sums
  hard_weights,      // class and row weights on the hard term (each block's class weights)
};

const char* statistics_variant_name(StatisticsVariant v) {
  static const char* names[] = {"hidden_teacher",  "sums_in_outputs", "logits_row_tiles",
                                "f32_teacher_f16", "weight_only",     "hard_weights"};
  return names[static_cast<int>(v)];
}

using StatisticsParam = std::tuple<DistillKind, unsigned, StatisticsVariant>;
class LinearDistillStatisticsBlocks : public ::testing::TestWithParam<StatisticsParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(LinearDistillStatisticsBlocks, MatchesReference) {
  XENT_TEST_RNG(rng);
  LinearDistillProblem p;
  StatisticsVariant variant;
  std::tie(p.kind, p.options, variant) = GetParam();
  p.dtype = DType::bf16;
  p.teacher_logits_dtype = DType::bf16;
  p.blocked = p.statistics = true;
  switch (variant) {
    case StatisticsVariant::hidden_teacher:
      break;
    case StatisticsVariant::sums_in_outputs:
      p.fp32_logits = true;
      p.reduction = Reduction::none;
      p.sums_in_weight_grad = p.sums_head = true;
      break;
    case StatisticsVariant::logits_row_tiles:  // the sums of 600 rows outgrow this ∂W
      p.teacher_as_logits = true;
      p.teacher_logits_row_stride = p.vocab + 13;
      p.rows = 600;
      p.row_tiles = true;
      p.reduction = Reduction::sum;
      break;
    case StatisticsVariant::f32_teacher_f16:
      p.dtype = DType::f16;
      p.teacher_as_logits = true;
      p.teacher_logits_dtype = DType::f32;
      p.sums_in_weight_grad = p.sums_head = p.staged_rows = true;
      break;
    case StatisticsVariant::weight_only:
      p.want_hidden = false;
      break;
    case StatisticsVariant::hard_weights:
      p.hard_weights = true;
      break;
  }
  check_linear_distill(p, rng);
}

std::string statistics_name(const ::testing::TestParamInfo<StatisticsParam>& info) {
  return std::string(distill_kind_name(std::get<0>(info.param))) + "_" +
         distill_options_label(std::get<1>(info.param)) + "_" +
         statistics_variant_name(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    EveryKindAndOption, LinearDistillStatisticsBlocks,
    ::testing::Combine(
        ::testing::ValuesIn(kKinds),
        ::testing::Values(0u, kTemperature, kDistillSoftcap, kHardAndSoft, kNoTarget,
                          kTemperature | kDistillSoftcap | kHardAndSoft),
        ::testing::Values(StatisticsVariant::hidden_teacher, StatisticsVariant::sums_in_outputs,
                          StatisticsVariant::logits_row_tiles, StatisticsVariant::f32_teacher_f16,
                          StatisticsVariant::weight_only, StatisticsVariant::hard_weights)),
    statistics_name);
#endif

}  // namespace
}  // namespace xent::test
