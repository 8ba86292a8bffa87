// Every error of docs/semantics.md §1–§4: the op throws xent::Error(invalid_argument) whose message names the
// argument and shows the offending value, and writes nothing (the poisoned outputs survive).
#include <cmath>
#include <functional>
#include <limits>

#include "ce_check.hpp"

namespace xent::test {
namespace {

constexpr int64_t kRows = 7, kVocab = 97, kHidden = 11, kTeacherHidden = 5;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A valid call of every op on small inputs, with every output present and poisoned; a case
// breaks one thing, then calls one entry point.
struct Call {
  Rng rng{fresh_seed()};
  DType dtype = DType::f32;
  Tensor logits = Tensor::of(rng.matrix(kRows, kVocab, 1.0), DType::f32);
  Tensor teacher = Tensor::of(rng.matrix(kRows, kVocab, 1.0), DType::f32);
  std::vector<int64_t> target_values = make_targets(rng, kRows, kVocab, -100, true, false, false);
  Tensor target = Tensor::of_integers(target_values, DType::i64);
  Tensor hidden = Tensor::of(rng.matrix(kRows, kHidden, 1.0), DType::f32);
  Tensor weight = Tensor::of(rng.matrix(kVocab, kHidden, 0.3), DType::f32);
  Tensor bias = Tensor::of(rng.uniform_vector(kVocab, -1, 1), DType::f32);
  Tensor teacher_hidden = Tensor::of(rng.matrix(kRows, kTeacherHidden, 1.0), DType::f32);
  Tensor teacher_weight = Tensor::of(rng.matrix(kVocab, kTeacherHidden, 0.3), DType::f32);
  Tensor class_weight = Tensor::of(rng.uniform_vector(kVocab, 0.5, 1.5), DType::f32);
  Tensor row_weight = Tensor::of(rng.uniform_vector(kRows, 0.5, 1.5), DType::f32);
  Tensor grad_output = Tensor::scalar(DType::f32);
  Tensor lse = Tensor::of(std::vector<double>(kRows, 5.0), DType::f32);

  // Outputs, poisoned.
  Tensor loss = Tensor::scalar(DType::f32);
  Tensor stat_lse = Tensor::vector(DType::f32, kRows),
         stat_logprob = Tensor::vector(DType::f32, kRows),
         stat_entropy = Tensor::vector(DType::f32, kRows),
         stat_argmax = Tensor::vector(DType::i64, kRows),
         stat_accuracy = Tensor::scalar(DType::f32), stat_z = Tensor::scalar(DType::f32);
  Tensor grad_logits = Tensor::matrix(DType::f32, kRows, kVocab);
  Tensor grad_hidden = Tensor::matrix(DType::f32, kRows, kHidden);
  Tensor grad_weight = Tensor::matrix(DType::f32, kVocab, kHidden);
  Tensor grad_bias = Tensor::vector(DType::f32, kVocab);

  // Views and options the case may change.
  TensorView logits_view, teacher_view, target_view, hidden_view, weight_view, bias_view,
      grad_output_view, lse_view, loss_view, grad_logits_view, grad_hidden_view, grad_weight_view,
      grad_bias_view;
  Teacher linear_teacher;
  CeOptions ce;
  DistillOptions distill;
  LinearCeOptions linear_ce;
  LinearDistillOptions linear_distill;
  CeStats stats;
  std::size_t budget = std::size_t{512} << 20;
  bool accumulate_weight = false;  // LinearGradients::accumulate_weight of the linear ops

  Call() {
    grad_output.upload({1.0});
    logits_view = logits.view();
    teacher_view = teacher.view();
    target_view = target.view();
    hidden_view = hidden.view();
    weight_view = weight.view();
    bias_view = bias.view();
    grad_output_view = grad_output.view();
    lse_view = lse.view();
    loss_view = loss.view();
    grad_logits_view = grad_logits.view();
    grad_hidden_view = grad_hidden.view();
    grad_weight_view = grad_weight.view();
    grad_bias_view = grad_bias.view();
    linear_teacher = Teacher{{}, teacher_hidden.view(), teacher_weight.view()};
    stats = {stat_lse.view(),    stat_logprob.view(),  stat_entropy.view(),
             stat_argmax.view(), stat_accuracy.view(), stat_z.view()};
  }

  bool outputs_untouched() const {
    for (const Tensor* t :
         {&loss, &stat_lse, &stat_logprob, &stat_entropy, &stat_argmax, &stat_accuracy, &stat_z,
          &grad_logits, &grad_hidden, &grad_weight, &grad_bias})
      if (!t->untouched()) return false;
    return true;
  }
};

enum class Entry {
  ce_forward,
  ce_backward,
  distill_forward,
  distill_backward,
  linear_ce_forward,
  linear_ce_backward,
  linear_distill_forward,
  linear_distill_backward
};

// Workspaces are sized from the (valid) sizes; errors are raised before any is used.
void invoke(Entry entry, Call& c) {
  const Device device = test_device();
  switch (entry) {
    case Entry::ce_forward: {
      const Scratch s(ce_workspace_size(kRows, kVocab, CeOptions{}, device));
      ce_forward(c.logits_view, c.target_view, c.ce, {c.loss_view, c.stats, c.grad_logits_view},
                 c.grad_output_view, s.workspace());
      break;
    }
    case Entry::ce_backward: {
      const Scratch s(ce_workspace_size(kRows, kVocab, CeOptions{}, device));
      ce_backward(c.logits_view, c.target_view, c.lse_view, c.grad_output_view, c.ce,
                  c.grad_logits_view, s.workspace());
      break;
    }
    case Entry::distill_forward: {
      const Scratch s(distill_workspace_size(kRows, kVocab, DistillOptions{}, device));
      distill_forward(c.logits_view, c.teacher_view, c.target_view, c.distill,
                      {c.loss_view, c.grad_logits_view}, c.grad_output_view, s.workspace());
      break;
    }
    case Entry::distill_backward: {
      const Scratch s(distill_workspace_size(kRows, kVocab, DistillOptions{}, device));
      distill_backward(c.logits_view, c.teacher_view, c.target_view, c.grad_output_view, c.distill,
                       c.grad_logits_view, s.workspace());
      break;
    }
    case Entry::linear_ce_forward:
    case Entry::linear_ce_backward: {
      c.linear_ce.ce = c.ce;
      c.linear_ce.workspace_budget = c.budget;
      LinearCeOptions sizing;
      const Scratch s(
          on_gpu() ? linear_ce_workspace_size(kRows, kHidden, kVocab, c.dtype, sizing, device, true)
                   : 0);
      const LinearGradients grads{c.grad_hidden_view, c.grad_weight_view, c.grad_bias_view,
                                  c.accumulate_weight};
      if (entry == Entry::linear_ce_forward) {
        linear_ce_forward(c.hidden_view, c.weight_view, c.bias_view, c.target_view, c.linear_ce,
                          {c.loss_view, c.stats, grads}, c.grad_output_view, s.workspace());
      } else {
        linear_ce_backward(c.hidden_view, c.weight_view, c.bias_view, c.target_view, c.lse_view,
                           c.grad_output_view, c.linear_ce, grads, s.workspace());
      }
      break;
    }
    case Entry::linear_distill_forward:
    case Entry::linear_distill_backward: {
      c.linear_distill.distill = c.distill;
      c.linear_distill.workspace_budget = c.budget;
      LinearDistillOptions sizing;
      const Scratch s(on_gpu()
                          ? linear_distill_workspace_size(kRows, kHidden, kTeacherHidden, kVocab,
                                                          c.dtype, sizing, device, true)
                          : 0);
      const LinearGradients grads{c.grad_hidden_view, c.grad_weight_view, c.grad_bias_view,
                                  c.accumulate_weight};
      if (entry == Entry::linear_distill_forward) {
        linear_distill_forward(c.hidden_view, c.weight_view, c.linear_teacher, c.target_view,
                               c.linear_distill, {c.loss_view, grads}, c.grad_output_view,
                               s.workspace());
      } else {
        linear_distill_backward(c.hidden_view, c.weight_view, c.linear_teacher, c.target_view,
                                c.grad_output_view, c.linear_distill, grads, s.workspace());
      }
      break;
    }
  }
  finish();
}

struct ErrorCase {
  std::string name;
  Entry entry;
  std::function<void(Call&)> corrupt;
  std::string argument;
  std::string value;
  bool cpu_only = false;  // host-side value checks (device memory is never read on the host)
};

// Tensors a case swaps in must outlive the call: they are kept here.
struct Keep {
  static Tensor& slot() {
    static Tensor tensor;
    return tensor;
  }
  static TensorView hold(Tensor t) {
    slot() = std::move(t);
    return slot().view();
  }
};

TensorView retyped(const TensorView& v, DType dtype) {
  TensorView out = v;
  out.dtype = dtype;
  return out;
}

std::vector<ErrorCase> error_cases() {
  using E = Entry;
  std::vector<ErrorCase> cases;
  auto add = [&](std::string name, Entry entry, std::function<void(Call&)> corrupt,
                 std::string argument, std::string value, bool cpu_only = false) {
    // The GPU backend never reads device memory on the host; OutOfRangeTarget covers its flag.
    if (cpu_only && on_gpu()) return;
    cases.push_back({std::move(name), entry, std::move(corrupt), std::move(argument),
                     std::move(value), cpu_only});
  };
  // ---- ce (§1) ----
  for (const Entry e : {E::ce_forward, E::ce_backward}) {
    const std::string f = e == E::ce_forward ? "ce_forward_" : "ce_backward_";
    add(
        f + "target_above_vocab", e,
        [](Call& c) {
          c.target_values[2] = kVocab;
          c.target.upload_integers(c.target_values);
        },
        "target", "= 97", true);
    add(
        f + "target_negative", e,
        [](Call& c) {
          c.target_values[1] = -5;
          c.target.upload_integers(c.target_values);
        },
        "target", "-5", true);
    add(
        f + "label_smoothing_above_1", e, [](Call& c) { c.ce.label_smoothing = 1.5; },
        "label_smoothing", "1.5");
    add(
        f + "label_smoothing_negative", e, [](Call& c) { c.ce.label_smoothing = -0.25; },
        "label_smoothing", "-0.25");
    add(
        f + "z_loss_negative", e, [](Call& c) { c.ce.z_loss = -0.5; }, "z_loss", "-0.5");
    add(
        f + "softcap_zero", e, [](Call& c) { c.ce.softcap = 0.0; }, "softcap", "got 0");
    add(
        f + "softcap_negative", e, [](Call& c) { c.ce.softcap = -3.0; }, "softcap", "-3");
    add(
        f + "logit_scale_zero", e, [](Call& c) { c.ce.logit_scale = 0.0; }, "logit_scale", "got 0");
    add(
        f + "logit_scale_negative", e, [](Call& c) { c.ce.logit_scale = -2.0; }, "logit_scale",
        "-2");
    add(
        f + "logit_scale_inf", e, [](Call& c) { c.ce.logit_scale = kInf; }, "logit_scale", "inf");
    add(
        f + "logit_scale_nan", e, [](Call& c) { c.ce.logit_scale = kNaN; }, "logit_scale", "nan");
    add(
        f + "target_length", e,
        [](Call& c) {
          c.target_view = Keep::hold(Tensor::of_integers({1, 2, 3}, DType::i64));
        },
        "target", "[3]");
    add(
        f + "target_float", e, [](Call& c) { c.target_view = retyped(c.target_view, DType::f32); },
        "target", "float32");
    add(
        f + "logits_integer", e,
        [](Call& c) { c.logits_view = retyped(c.logits_view, DType::i64); }, "logits", "int64");
    add(
        f + "no_classes", e, [](Call& c) { c.logits_view.cols = 0; }, "logits", "V = 0");
    add(
        f + "class_weight_length", e,
        [](Call& c) {
          c.ce.class_weight =
              Keep::hold(Tensor::of(std::vector<double>(kVocab - 1, 1.0), DType::f32));
        },
        "class_weight", "[96]");
    add(
        f + "class_weight_dtype", e,
        [](Call& c) {
          c.ce.class_weight = Keep::hold(Tensor::of(std::vector<double>(kVocab, 1.0), DType::bf16));
        },
        "class_weight", "bfloat16");
    add(
        f + "class_weight_negative", e,
        [](Call& c) {
          std::vector<double> w(kVocab, 1.0);
          w[4] = -1.0;
          c.ce.class_weight = Keep::hold(Tensor::of(w, DType::f32));
        },
        "class_weight", "-1", true);
    add(
        f + "row_weight_length", e,
        [](Call& c) {
          c.ce.row_weight = Keep::hold(Tensor::of(std::vector<double>(kRows + 1, 1.0), DType::f32));
        },
        "row_weight", "[8]");
    add(
        f + "grad_logits_shape", e, [](Call& c) { c.grad_logits_view.cols = kVocab - 1; },
        "grad_logits", "[7, 96]");
    add(
        f + "grad_logits_dtype", e,
        [](Call& c) { c.grad_logits_view = retyped(c.grad_logits_view, DType::bf16); },
        "grad_logits", "bfloat16");
    add(
        f + "grad_output_shape", e,
        [](Call& c) {
          c.grad_output_view = Keep::hold(Tensor::of(std::vector<double>(kRows, 1.0), DType::f32));
        },
        "grad_output", "[7]");
    add(
        f + "grad_logits_partial_overlap", e,
        [](Call& c) {
          c.grad_logits_view = c.logits_view;
          c.grad_logits_view.data = static_cast<float*>(c.logits_view.data) + kVocab;
          c.grad_logits_view.rows = kRows - 1;
          c.logits_view.rows = kRows - 1;
          c.target_view.rows = kRows - 1;
          c.lse_view.rows = kRows - 1;
          c.stats = {};
        },
        "grad_logits", "partial overlap");
  }
  add(
      "ce_forward_loss_missing", E::ce_forward, [](Call& c) { c.loss_view = {}; }, "loss",
      "absent");
  add(
      "ce_forward_loss_shape_for_none", E::ce_forward,
      [](Call& c) { c.ce.reduction = Reduction::none; }, "loss", "scalar");
  add(
      "ce_forward_argmax_dtype", E::ce_forward,
      [](Call& c) { c.stats.argmax = retyped(c.stats.argmax, DType::f32); }, "argmax", "float32");
  add(
      "ce_backward_lse_length", E::ce_backward, [](Call& c) { c.lse_view.rows = kRows - 1; }, "lse",
      "[6]");
  add(
      "ce_backward_grad_logits_missing", E::ce_backward, [](Call& c) { c.grad_logits_view = {}; },
      "grad_logits", "absent");

  // ---- distill (§3) ----
  for (const Entry e : {E::distill_forward, E::distill_backward}) {
    const std::string f = e == E::distill_forward ? "distill_forward_" : "distill_backward_";
    add(
        f + "temperature_zero", e, [](Call& c) { c.distill.temperature = 0; }, "temperature",
        "got 0");
    add(
        f + "temperature_negative", e, [](Call& c) { c.distill.temperature = -1.5; }, "temperature",
        "-1.5");
    add(
        f + "temperature_nan", e, [](Call& c) { c.distill.temperature = kNaN; }, "temperature",
        "nan");
    add(
        f + "beta_above_1", e, [](Call& c) { c.distill.beta = 1.25; }, "beta", "1.25");
    add(
        f + "beta_negative", e, [](Call& c) { c.distill.beta = -0.1; }, "beta", "-0.1");
    add(
        f + "softcap_zero", e, [](Call& c) { c.distill.softcap = 0.0; }, "softcap", "got 0");
    add(
        f + "soft_weight_negative", e, [](Call& c) { c.distill.soft_weight = -1; }, "soft_weight",
        "-1");
    add(
        f + "hard_weight_without_target", e,
        [](Call& c) {
          c.distill.hard_weight = 0.5;
          c.target_view = {};
        },
        "target", "absent");
    add(
        f + "teacher_shape", e, [](Call& c) { c.teacher_view.cols = kVocab - 1; }, "teacher",
        "[7, 96]");
    add(
        f + "teacher_dtype", e,
        [](Call& c) { c.teacher_view = retyped(c.teacher_view, DType::f16); }, "teacher",
        "float16");
    add(
        f + "teacher_missing", e, [](Call& c) { c.teacher_view = {}; }, "teacher", "absent");
    add(
        f + "target_above_vocab", e,
        [](Call& c) {
          c.target_values[0] = kVocab + 3;
          c.target.upload_integers(c.target_values);
        },
        "target", "100", true);
    add(
        f + "hard_label_smoothing", e, [](Call& c) { c.distill.ce.label_smoothing = 2; },
        "label_smoothing", "got 2");
    add(
        f + "grad_student_shape", e, [](Call& c) { c.grad_logits_view.rows = kRows + 1; },
        "grad_student", "[8, 97]");
  }

  // ---- linear_ce (§2) ----
  for (const Entry e : {E::linear_ce_forward, E::linear_ce_backward}) {
    const std::string f = e == E::linear_ce_forward ? "linear_ce_forward_" : "linear_ce_backward_";
    add(
        f + "weight_hidden_size", e, [](Call& c) { c.weight_view.cols = kHidden - 1; }, "weight",
        "[97, 10]");
    add(
        f + "weight_dtype", e, [](Call& c) { c.weight_view = retyped(c.weight_view, DType::f16); },
        "weight", "float16");
    add(
        f + "bias_length", e, [](Call& c) { c.bias_view.rows = kVocab - 1; }, "bias", "[96]");
    add(
        f + "budget_too_small", e, [](Call& c) { c.budget = 1; }, "workspace_budget", "got 1 ");
    add(
        f + "grad_weight_dtype", e,
        [](Call& c) { c.grad_weight_view = retyped(c.grad_weight_view, DType::f16); },
        "grads.weight", "float16");
    add(
        f + "grad_bias_without_bias", e, [](Call& c) { c.bias_view = {}; }, "grads.bias", "[97]");
    add(
        f + "grad_hidden_shape", e, [](Call& c) { c.grad_hidden_view.rows = kRows - 1; },
        "grads.hidden", "[6, 11]");
    add(
        f + "label_smoothing", e, [](Call& c) { c.ce.label_smoothing = 1.5; }, "label_smoothing",
        "1.5");
    add(
        f + "softcap_negative", e, [](Call& c) { c.ce.softcap = -1.0; }, "softcap", "-1");
    add(
        f + "target_above_vocab", e,
        [](Call& c) {
          c.target_values[3] = kVocab;
          c.target.upload_integers(c.target_values);
        },
        "target", "= 97", true);
    // accumulate_weight: an fp32 [V, H] buffer on the op's device (float64 for float64 layers).
    add(
        f + "accumulate_weight_without_buffer", e,
        [](Call& c) {
          c.accumulate_weight = true;
          c.grad_weight_view = {};
        },
        "grads.weight", "missing");
    add(
        f + "accumulate_weight_16_bit_buffer", e,
        [](Call& c) {
          c.accumulate_weight = true;
          c.grad_weight_view = retyped(c.grad_weight_view, DType::bf16);
        },
        "grads.weight", "accumulate_weight: got bfloat16");
    add(
        f + "accumulate_weight_shape", e,
        [](Call& c) {
          c.accumulate_weight = true;
          c.grad_weight_view.rows = kVocab - 1;
        },
        "grads.weight", "[96, 11]");
    if (on_gpu()) {
      add(
          f + "accumulate_weight_on_host", e,
          [](Call& c) {
            c.accumulate_weight = true;
            c.grad_weight_view.device = Device{DeviceKind::cpu, 0};
          },
          "grads.weight", "cpu:0");
    }
  }

  // ---- linear_distill (§4) ----
  for (const Entry e : {E::linear_distill_forward, E::linear_distill_backward}) {
    const std::string f =
        e == E::linear_distill_forward ? "linear_distill_forward_" : "linear_distill_backward_";
    const auto no_bias = [](Call& c) { c.grad_bias_view = {}; };
    add(
        f + "teacher_both_forms", e,
        [=](Call& c) {
          no_bias(c);
          c.linear_teacher.logits = c.teacher_view;
        },
        "teacher", "logits and hidden/weight");
    add(
        f + "teacher_neither_form", e,
        [=](Call& c) {
          no_bias(c);
          c.linear_teacher = {};
        },
        "teacher", "neither");
    add(
        f + "teacher_hidden_rows", e,
        [=](Call& c) {
          no_bias(c);
          c.linear_teacher.hidden.rows = kRows - 2;
        },
        "teacher.hidden", "[5, 5]");
    add(
        f + "teacher_weight_rows", e,
        [=](Call& c) {
          no_bias(c);
          c.linear_teacher.weight.rows = kVocab - 2;
        },
        "teacher.weight", "[95, 5]");
    add(
        f + "teacher_logits_shape", e,
        [=](Call& c) {
          no_bias(c);
          c.linear_teacher = {c.teacher_view, {}, {}};
          c.linear_teacher.logits.cols = kVocab - 1;
        },
        "teacher.logits", "[7, 96]");
    add(
        f + "grad_bias_present", e, [](Call&) {}, "grads.bias", "[97]");
    add(
        f + "temperature_zero", e,
        [=](Call& c) {
          no_bias(c);
          c.distill.temperature = 0;
        },
        "temperature", "got 0");
    add(
        f + "student_weight_hidden_size", e,
        [=](Call& c) {
          no_bias(c);
          c.weight_view.cols = kHidden + 1;
        },
        "student_weight", "[97, 12]");
    add(
        f + "budget_too_small", e,
        [=](Call& c) {
          no_bias(c);
          c.budget = 1;
        },
        "workspace_budget", "got 1 ");
    add(
        f + "accumulate_weight_16_bit_buffer", e,
        [=](Call& c) {
          no_bias(c);
          c.accumulate_weight = true;
          c.grad_weight_view = retyped(c.grad_weight_view, DType::f16);
        },
        "grads.weight", "accumulate_weight: got float16");
  }
  if (on_gpu()) {
    add(
        "ce_forward_float64_on_gpu", E::ce_forward,
        [](Call& c) {
          c.logits_view = retyped(c.logits_view, DType::f64);
          c.grad_logits_view = {};
        },
        "logits", "float64");
  } else {
    // Results follow the input: float64 for float64 inputs, float32 otherwise (the views are
    // only retyped: validation rejects them before any element is read).
    add(
        "ce_forward_float64_logits_float32_loss", E::ce_forward,
        [](Call& c) { c.logits_view = retyped(c.logits_view, DType::f64); }, "loss",
        "expected float64");
    add(
        "ce_forward_float32_logits_float64_loss", E::ce_forward,
        [](Call& c) { c.loss_view = retyped(c.loss_view, DType::f64); }, "loss",
        "expected float32");
    add(
        "ce_backward_float64_logits_float32_grad_output", E::ce_backward,
        [](Call& c) {
          c.logits_view = retyped(c.logits_view, DType::f64);
          c.grad_logits_view = retyped(c.grad_logits_view, DType::f64);
          c.lse_view = {};
        },
        "grad_output", "expected float64");
    add(
        "ce_backward_float64_logits_float32_lse", E::ce_backward,
        [](Call& c) {
          c.logits_view = retyped(c.logits_view, DType::f64);
          c.grad_logits_view = retyped(c.grad_logits_view, DType::f64);
        },
        "lse", "expected float64");
  }
  return cases;
}

class Errors : public ::testing::TestWithParam<ErrorCase> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(Errors, RejectedWithMessageAndNothingWritten) {
  const ErrorCase& error = GetParam();
  Call call;
  SCOPED_TRACE(::testing::Message() << "XENT_TEST_SEED=" << run_seed());
  error.corrupt(call);
  expect_invalid([&] { invoke(error.entry, call); }, error.argument, error.value);
  EXPECT_TRUE(call.outputs_untouched()) << "an output was written before the error";
}

INSTANTIATE_TEST_SUITE_P(Spec, Errors, ::testing::ValuesIn(error_cases()),
                         [](const ::testing::TestParamInfo<ErrorCase>& info) {
                           return info.param.name;
                         });

// docs/semantics.md §1: the CPU rejects an out-of-range target at once; a GPU cannot look without a
// synchronisation, so the row gets a NaN loss and gradient and check_errors reports the same
// message afterwards.
TEST(OutOfRangeTarget, RejectedOnCpuFlaggedOnGpu) {
  require_device();
  XENT_TEST_RNG(rng);
  const Tensor logits = Tensor::of(rounded(rng.matrix(kRows, kVocab, 1.0), DType::f32), DType::f32);
  std::vector<int64_t> target = make_targets(rng, kRows, kVocab, -100, false, false, false);
  target[4] = kVocab + 6;
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  Tensor loss = Tensor::vector(DType::f32, kRows), grad = Tensor::matrix(DType::f32, kRows, kVocab);
  CeOptions options;
  options.reduction = Reduction::none;
  const Scratch scratch(ce_workspace_size(kRows, kVocab, options, test_device()));
  auto call = [&] {
    ce_forward(logits.view(), target_tensor.view(), options, {loss.view(), {}, grad.view()}, {},
               scratch.workspace());
  };
  if (!on_gpu()) {
    expect_invalid(call, "target", "103");
    EXPECT_TRUE(loss.untouched() && grad.untouched()) << "an output was written before the error";
    return;
  }
  call();  // no synchronisation, no exception
  const std::vector<double> out = loss.download(), g = grad.download();
  EXPECT_TRUE(std::isnan(out[4])) << "the row with the bad target must have a NaN loss";
  bool any_nan = false;
  for (int64_t i = 0; i < kVocab; ++i) any_nan |= std::isnan(g[4 * kVocab + i]);
  EXPECT_TRUE(any_nan) << "the row with the bad target must have a NaN gradient";
  for (int64_t n = 0; n < kRows; ++n) {
    if (n != 4) {
      EXPECT_TRUE(std::isfinite(out[n])) << "row " << n;
    }
  }
  expect_invalid([] { check_errors(test_device()); }, "target", "103");
  EXPECT_NO_THROW(check_errors(test_device())) << "check_errors must clear the flag it reported";
}

}  // namespace
}  // namespace xent::test
