// Distillation harness: one problem through distill_forward (with and without the gradient) and
// distill_backward, every output against the reference.
#include "distill_check.hpp"

#include <cmath>
#include <limits>

namespace xent::test {

std::string distill_options_label(unsigned options) {
  static const char* const names[kDistillOptionCount] = {"temperature", "softcap", "hard_soft",
                                                         "no_target"};
  return options_label(options, names, kDistillOptionCount);
}

std::vector<unsigned> distill_option_sets_up_to_pairs() {
  // A hard term without targets is an error case, tested as such.
  return option_sets_up_to_pairs(kDistillOptionCount, kHardAndSoft | kNoTarget);
}

DistillSetup make_distill_setup(DistillKind kind, unsigned options, Reduction reduction,
                                double beta) {
  DistillSetup s;
  s.options.kind = s.spec.kind = kind;
  s.options.beta = s.spec.beta = beta;
  s.options.ce.reduction = s.spec.ce.reduction = reduction;
  if (options & kTemperature) s.options.temperature = s.spec.temperature = 2.0;
  if (options & kDistillSoftcap) {
    s.options.softcap = 4.5;  // bends the largest logits
    s.spec.softcap = 4.5;
  }
  if (options & kHardAndSoft) {
    s.options.hard_weight = s.spec.hard_weight = 0.375;
    s.options.soft_weight = s.spec.soft_weight = 0.625;
    s.options.ce.label_smoothing = s.spec.ce.label_smoothing = 0.125;
    s.options.ce.z_loss = s.spec.ce.z_loss = 0.0625;
  }
  return s;
}

HardWeightTensors add_hard_weights(DistillSetup& setup, Rng& rng, int64_t rows, int64_t vocab) {
  HardWeightTensors tensors;
  setup.spec.ce.class_weight = rng.uniform_vector(vocab, 0.5, 1.5);
  setup.spec.ce.row_weight = rng.uniform_vector(rows, 0.5, 1.5);
  tensors.class_weight = Tensor::of(setup.spec.ce.class_weight, DType::f32);
  tensors.row_weight = Tensor::of(setup.spec.ce.row_weight, DType::f32);
  setup.options.ce.class_weight = tensors.class_weight.view();
  setup.options.ce.row_weight = tensors.row_weight.view();
  return tensors;
}

Matrix make_teacher(Rng& rng, const Matrix& student, double sd) {
  Matrix teacher = student;
  for (double& v : teacher.values) v = std::isnan(v) ? rng.normal(sd) : v + rng.normal(0.6 * sd);
  return teacher;
}

reference::DistillResult tvd_ties_at_midpoint(const Matrix& student, const Matrix& teacher,
                                              const std::vector<int64_t>* target,
                                              reference::DistillSpec spec,
                                              const reference::Upstream& upstream, double band) {
  if (spec.kind == DistillKind::tvd) spec.tvd_tie_band = band;
  return reference::distill(student, teacher, target, spec, upstream);
}

void check_distill(const DistillProblem& p, Rng& rng) {
  const int64_t rows = p.rows, vocab = p.vocab;
  DistillSetup setup = make_distill_setup(p.kind, p.options, p.reduction, p.beta);
  const HardWeightTensors weights =
      p.hard_weights ? add_hard_weights(setup, rng, rows, vocab) : HardWeightTensors{};
  const bool with_target = !(p.options & kNoTarget);
  const std::vector<int64_t> target =
      make_targets(rng, rows, vocab, -100, p.ignored_rows, p.all_ignored, false);
  Matrix student = rng.matrix(rows, vocab, p.logit_sd);
  Matrix teacher = p.teacher_sd > 0 ? rng.matrix(rows, vocab, p.teacher_sd)
                                    : make_teacher(rng, student, p.logit_sd);
  const int64_t nan_row = p.nan_row && rows > 3 && (!with_target || target[3] != -100) ? 3 : -1;
  if (nan_row >= 0) student.at(nan_row, vocab / 3) = std::numeric_limits<double>::quiet_NaN();
  student = rounded(student, p.dtype);
  teacher = rounded(teacher, p.dtype);

  const reference::Upstream upstream = make_upstream(rng, p.reduction, rows, p.unit_grad_output);
  const reference::DistillResult ref =
      reference::distill(student, teacher, with_target ? &target : nullptr, setup.spec, upstream);

  Tensor student_tensor = Tensor::of(student, p.dtype, p.row_stride);
  const Tensor teacher_tensor =
      Tensor::of(teacher, p.dtype, p.teacher_row_stride != 0 ? p.teacher_row_stride : p.row_stride);
  const Tensor target_tensor = with_target ? Tensor::of_integers(target, DType::i64) : Tensor();
  const Tensor grad_output = upstream_tensor(upstream, p.reduction, rows, p.dtype);
  const Scratch scratch(distill_workspace_size(rows, vocab, setup.options, test_device()));

  const int64_t loss_skip = p.reduction == Reduction::none ? nan_row : -1;
  const bool loss_all_nan = nan_row >= 0 && p.reduction != Reduction::none;
  const std::vector<double> ref_loss = without_row(ref.loss, 1, loss_skip);
  const std::vector<double> ref_grad = without_row(ref.grad.values, vocab, nan_row);
  const double loss_tol = stat_tolerance(p.dtype, Family::logits, {}, ref_loss);
  // A near-tie of tvd may land on either side (twice the distance to the midpoint). The band is
  // the relative error of a probability computed in the compute type: log p = v − lse loses
  // about one ulp of the largest |logit|.
  double largest = 0.0;
  for (const Matrix* m : {&student, &teacher})
    for (double v : m->values)
      if (std::isfinite(v)) largest = std::max(largest, std::abs(v));
  const double ulp = p.dtype == DType::f64 ? 0x1p-52 : 0x1p-23;
  const std::vector<double> midpoint_grad =
      without_row(tvd_ties_at_midpoint(student, teacher, with_target ? &target : nullptr,
                                       setup.spec, upstream, 8 * ulp * (largest + 8.0))
                      .grad.values,
                  vocab, nan_row);
  const double grad_tol =
      grad_tolerance(p.dtype, Family::logits, rounded(ref_grad, p.dtype), ref_grad) +
      2 * relative_error(midpoint_grad, ref_grad);

  auto check_loss = [&](const Tensor& loss) {
    const std::vector<double> out = loss.download();
    if (loss_all_nan) {
      EXPECT_TRUE(std::isnan(out[0])) << "a NaN student logit must make the loss NaN: " << out[0];
      return;
    }
    EXPECT_TRUE(close("loss", without_row(out, 1, loss_skip), ref_loss, loss_tol));
    if (loss_skip >= 0) {
      EXPECT_TRUE(std::isnan(out[loss_skip])) << "NaN row loss " << out[loss_skip];
    }
  };
  auto check_grad = [&](const Tensor& grad) {
    const std::vector<double> out = grad.download();
    EXPECT_TRUE(close("grad_student", without_row(out, vocab, nan_row), ref_grad, grad_tol));
    if (nan_row >= 0) {
      bool any_nan = false;
      for (int64_t i = 0; i < vocab; ++i) any_nan |= std::isnan(out[nan_row * vocab + i]);
      EXPECT_TRUE(any_nan) << "the NaN row's gradient must show the NaN";
    }
    EXPECT_TRUE(grad.padding_untouched()) << "grad_student written outside its columns";
  };

  {
    SCOPED_TRACE("distill_forward, loss only");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    DistillOutputs out;
    out.loss = loss.view();
    distill_forward(student_tensor.view(), teacher_tensor.view(), target_tensor.view(),
                    setup.options, out, {}, scratch.workspace());
    finish();
    check_loss(loss);
  }
  Tensor grad_storage = p.in_place ? Tensor() : Tensor::matrix(p.dtype, rows, vocab, p.row_stride);
  Tensor& grad = p.in_place ? student_tensor : grad_storage;
  {
    SCOPED_TRACE("distill_forward, with gradient");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    DistillOutputs out;
    out.loss = loss.view();
    out.grad_student = grad.view();
    distill_forward(student_tensor.view(), teacher_tensor.view(), target_tensor.view(),
                    setup.options, out, grad_output.view(), scratch.workspace());
    finish();
    check_loss(loss);
    check_grad(grad);
  }
  {
    SCOPED_TRACE("distill_backward");
    grad.poison();
    if (p.in_place) student_tensor.upload(student.values);
    distill_backward(student_tensor.view(), teacher_tensor.view(), target_tensor.view(),
                     grad_output.view(), setup.options, grad.view(), scratch.workspace());
    finish();
    check_grad(grad);
  }
}

}  // namespace xent::test
