// Fused linear cross-entropy: the loss of h·Wᵀ and the gradients of h and W, without N×V logits.
#include <cmath>
#include <cstdio>
#include <vector>

#include "xent/xent.hpp"

int main() {
  const int64_t rows = 6, hidden = 4, vocab = 10;
  std::vector<float> h(rows * hidden, 0.5f);
  std::vector<float> weight(vocab * hidden, 0.0f);  // zero weight: uniform softmax
  std::vector<int64_t> target = {0, 1, 2, 3, 4, 5};
  std::vector<float> grad_h(rows * hidden), grad_weight(vocab * hidden);
  float loss = 0;

  xent::LinearCeOptions options;
  options.workspace_budget = 1 << 20;  // bytes of extra memory
  xent::LinearCeOutputs out;
  out.loss = xent::scalar(&loss, xent::DType::f32);
  out.grads.hidden = xent::matrix(grad_h.data(), xent::DType::f32, rows, hidden);
  out.grads.weight = xent::matrix(grad_weight.data(), xent::DType::f32, vocab, hidden);
  xent::linear_ce_forward(xent::matrix(h.data(), xent::DType::f32, rows, hidden),
                          xent::matrix(weight.data(), xent::DType::f32, vocab, hidden),
                          /*bias=*/{}, xent::vector(target.data(), xent::DType::i64, rows), options,
                          out);

  // ∂W_c = Σ_n (1/V − 1{y_n=c})·h_n / N: class 0 is the target of one row of six.
  const double expected = (6 * 0.1 - 1) * 0.5 / 6;
  std::printf("linear_ce loss %.6f, dW[0][0] %.6f (expected %.6f)\n", loss, grad_weight[0],
              expected);
  const bool ok = std::fabs(loss - std::log(10.0)) < 1e-5 &&
                  std::fabs(grad_weight[0] - expected) < 1e-6 && std::fabs(grad_h[0]) < 1e-6;
  return ok ? 0 : 1;
}
