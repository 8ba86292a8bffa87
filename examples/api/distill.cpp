// Forward KL distillation between student and teacher logits at temperature 2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "xent/xent.hpp"

int main() {
  const int64_t rows = 2, vocab = 5;
  std::vector<float> student = {0, 1, 2, 3, 4, 4, 3, 2, 1, 0};
  std::vector<float> teacher = student;  // identical distributions: KL = 0, gradient 0
  std::vector<float> grad(rows * vocab, 1.0f);
  float loss = -1;

  xent::DistillOptions options;
  options.kind = xent::DistillKind::forward_kl;
  options.temperature = 2.0;
  xent::DistillOutputs out;
  out.loss = xent::scalar(&loss, xent::DType::f32);
  out.grad_student = xent::matrix(grad.data(), xent::DType::f32, rows, vocab);
  xent::distill_forward(xent::matrix(student.data(), xent::DType::f32, rows, vocab),
                        xent::matrix(teacher.data(), xent::DType::f32, rows, vocab),
                        /*target=*/{}, options, out);

  std::printf("forward KL %.3g, largest |grad| %.3g\n", loss,
              std::fabs(*std::max_element(grad.begin(), grad.end(), [](float a, float b) {
                return std::fabs(a) < std::fabs(b);
              })));
  bool ok = std::fabs(loss) < 1e-6;
  for (const float g : grad) ok = ok && std::fabs(g) < 1e-6;
  return ok ? 0 : 1;
}
