// Fused linear distillation: student h_s·W_sᵀ against a teacher given as h_t·W_tᵀ.
#include <cmath>
#include <cstdio>
#include <vector>

#include "xent/xent.hpp"

int main() {
  const int64_t rows = 3, hidden = 4, vocab = 7;
  std::vector<float> student_h(rows * hidden), student_w(vocab * hidden);
  for (std::size_t i = 0; i < student_h.size(); ++i) student_h[i] = 0.1f * float(i % 5) - 0.2f;
  for (std::size_t i = 0; i < student_w.size(); ++i) student_w[i] = 0.05f * float(i % 9) - 0.2f;
  // The teacher is the student itself: every divergence is 0 and so is every gradient.
  const xent::Teacher teacher{{},
                              xent::matrix(student_h.data(), xent::DType::f32, rows, hidden),
                              xent::matrix(student_w.data(), xent::DType::f32, vocab, hidden)};
  std::vector<float> grad_h(rows * hidden, 1.0f), grad_w(vocab * hidden, 1.0f);
  float loss = -1;

  xent::LinearDistillOptions options;
  options.distill.kind = xent::DistillKind::jsd;
  xent::LinearDistillOutputs out;
  out.loss = xent::scalar(&loss, xent::DType::f32);
  out.grads.hidden = xent::matrix(grad_h.data(), xent::DType::f32, rows, hidden);
  out.grads.weight = xent::matrix(grad_w.data(), xent::DType::f32, vocab, hidden);
  xent::linear_distill_forward(xent::matrix(student_h.data(), xent::DType::f32, rows, hidden),
                               xent::matrix(student_w.data(), xent::DType::f32, vocab, hidden),
                               teacher, /*target=*/{}, options, out);

  std::printf("jsd %.3g\n", loss);
  bool ok = std::fabs(loss) < 1e-6;
  for (const float g : grad_h) ok = ok && std::fabs(g) < 1e-6;
  for (const float g : grad_w) ok = ok && std::fabs(g) < 1e-6;
  return ok ? 0 : 1;
}
