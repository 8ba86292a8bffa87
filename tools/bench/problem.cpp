// Random inputs of a case on its device. Logits are uniform in [-8, 8) (a spread like a trained
// LM head's, so softmax is neither flat nor one-hot); linear weights are scaled by 1/sqrt(H) so
// h·Wᵀ lands in the same range whatever H is.
#include <cmath>

#include "bench/problem.hpp"

namespace xent::bench {

bool is_linear(Op op) { return op == Op::linear_ce || op == Op::linear_distill; }
bool is_distill(Op op) { return op == Op::distill || op == Op::linear_distill; }
bool has_hidden_grad(const Case& c) { return is_linear(c.op) && c.mode == Mode::fwdbwd; }

std::size_t elements_bytes(int64_t count, DType dtype) {
  return static_cast<std::size_t>(count) * dtype_size(dtype);
}

std::size_t Problem::input_bytes(const Case& c) {
  const int64_t matrices = c.op == Op::ce          ? c.n * c.v
                           : c.op == Op::distill   ? 2 * c.n * c.v
                           : c.op == Op::linear_ce ? (c.n + c.v) * c.h
                                                   : 2 * (c.n + c.v) * c.h;
  std::size_t bytes = elements_bytes(matrices, c.dtype) + elements_bytes(c.n, DType::i64);
  // Distillation reads weights only for its hard-label term.
  const bool weighted = !is_distill(c.op) || c.options.hard;
  if (c.options.class_weight && weighted) bytes += elements_bytes(c.v, DType::f32);
  if (c.options.row_weight && weighted) bytes += elements_bytes(c.n, DType::f32);
  if (c.mode == Mode::fwdbwd && c.reduction == Reduction::none)
    bytes += elements_bytes(c.n, DType::f32);
  return bytes;
}

TensorView Problem::add_matrix(DType dtype, int64_t rows, int64_t cols, float low, float high) {
  buffers_.emplace_back(device_, elements_bytes(rows * cols, dtype));
  void* data = buffers_.back().data();
  device_.fill_uniform(data, dtype, rows * cols, low, high, seed_++);
  return matrix(data, dtype, rows, cols, cols, device_.device());
}

TensorView Problem::add_vector(DType dtype, int64_t length, float low, float high) {
  buffers_.emplace_back(device_, elements_bytes(length, dtype));
  void* data = buffers_.back().data();
  if (dtype == DType::i64) {
    device_.fill_targets(data, length, case_.v, seed_++);
  } else {
    device_.fill_uniform(data, dtype, length, low, high, seed_++);
  }
  return vector(data, dtype, length, device_.device());
}

Problem::Problem(BenchDevice& device, const Case& c, int copies)
    : device_(device), case_(c), input_bytes_(input_bytes(c)) {
  const int64_t n = c.n, h = c.h, v = c.v;
  const float weight_range = is_linear(c.op) ? 8.0f * std::sqrt(3.0f / static_cast<float>(h)) : 0;
  for (int copy = 0; copy < copies; ++copy) {
    Inputs in;
    switch (c.op) {
      case Op::ce:
        in.logits = add_matrix(c.dtype, n, v, -8, 8);
        break;
      case Op::distill:
        in.logits = add_matrix(c.dtype, n, v, -8, 8);
        in.teacher = add_matrix(c.dtype, n, v, -8, 8);
        break;
      case Op::linear_ce:
        in.hidden = add_matrix(c.dtype, n, h, -1, 1);
        in.weight = add_matrix(c.dtype, v, h, -weight_range, weight_range);
        break;
      case Op::linear_distill:
        in.hidden = add_matrix(c.dtype, n, h, -1, 1);
        in.weight = add_matrix(c.dtype, v, h, -weight_range, weight_range);
        in.teacher_hidden = add_matrix(c.dtype, n, h, -1, 1);
        in.teacher_weight = add_matrix(c.dtype, v, h, -weight_range, weight_range);
        break;
    }
    in.target = add_vector(DType::i64, n, 0, 0);
    const bool weighted = !is_distill(c.op) || c.options.hard;
    if (c.options.class_weight && weighted) in.class_weight = add_vector(DType::f32, v, 0.5f, 1.5f);
    if (c.options.row_weight && weighted) in.row_weight = add_vector(DType::f32, n, 0.0f, 2.0f);
    if (c.mode == Mode::fwdbwd && c.reduction == Reduction::none)
      in.grad_output = add_vector(DType::f32, n, 0.5f, 1.5f);
    inputs_.push_back(in);
  }
  if (c.mode == Mode::fwdbwd) {
    auto gradient = [&](int64_t rows, int64_t cols) {
      buffers_.emplace_back(device_, elements_bytes(rows * cols, c.dtype));
      return matrix(buffers_.back().data(), c.dtype, rows, cols, cols, device_.device());
    };
    if (is_linear(c.op)) {
      gradients_.grad_hidden = gradient(n, h);
      gradients_.grad_weight = gradient(v, h);
    } else {
      gradients_.grad_logits = gradient(n, v);
    }
  }
}

Outputs Problem::make_outputs(const Outputs& gradients) {
  Outputs out = gradients;
  const bool per_row = case_.reduction == Reduction::none;
  buffers_.emplace_back(device_, sizeof(float) * static_cast<std::size_t>(per_row ? case_.n : 1));
  out.loss = per_row ? vector(buffers_.back().data(), DType::f32, case_.n, device_.device())
                     : scalar(buffers_.back().data(), DType::f32, device_.device());
  if (per_row && case_.mode == Mode::fwdbwd) {
    buffers_.emplace_back(device_, sizeof(float) * static_cast<std::size_t>(case_.n));
    out.lse = vector(buffers_.back().data(), DType::f32, case_.n, device_.device());
  }
  return out;
}

CeOptions Problem::ce_options(const Inputs& in) const {
  CeOptions o;
  o.reduction = case_.reduction;
  if (case_.options.smoothing) o.label_smoothing = kSmoothing;
  if (case_.options.z_loss) o.z_loss = kZLoss;
  if (case_.options.softcap) o.softcap = kSoftcap;
  if (case_.options.logit_scale) o.logit_scale = kLogitScale;
  o.class_weight = in.class_weight;
  o.row_weight = in.row_weight;
  return o;
}

DistillOptions Problem::distill_options(const Inputs& in) const {
  DistillOptions o;
  o.kind = case_.kind;
  o.ce.reduction = case_.reduction;
  if (case_.options.softcap) o.softcap = kSoftcap;
  if (case_.options.hard) {
    o.hard_weight = 0.5;
    o.soft_weight = 0.5;
    o.ce = ce_options(in);  // the hard term's ce options (smoothing, z-loss, weights)
  }
  return o;
}

}  // namespace xent::bench
