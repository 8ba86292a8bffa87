// Cross-entropy on logits, with the gradient formed in the same pass.
#include <cmath>
#include <cstdio>
#include <vector>

#include "xent/xent.hpp"

int main() {
  const int64_t rows = 4, vocab = 8;
  std::vector<float> logits(rows * vocab, 0.0f);  // uniform logits: loss = log(vocab)
  std::vector<int64_t> target = {1, 7, -100, 3};  // -100: ignored row
  std::vector<float> grad(rows * vocab);
  float loss = 0;

  xent::CeOptions options;  // mean over valid rows, ignore_index -100
  options.label_smoothing = 0.1;
  xent::CeOutputs out;
  out.loss = xent::scalar(&loss, xent::DType::f32);
  out.grad_logits = xent::matrix(grad.data(), xent::DType::f32, rows, vocab);
  xent::ce_forward(xent::matrix(logits.data(), xent::DType::f32, rows, vocab),
                   xent::vector(target.data(), xent::DType::i64, rows), options, out);

  std::printf("ce loss %.6f (log %lld = %.6f)\n", loss, static_cast<long long>(vocab),
              std::log(double(vocab)));
  // Row 0, target 1: ∂/∂x = ((1−ε)(p − 1{i=y}) + ε(p − 1/V)) / N_valid with p = 1/V.
  const double expected = (0.9 * (1.0 / 8 - 1)) / 3;
  const bool ok = std::fabs(loss - std::log(8.0)) < 1e-5 && std::fabs(grad[1] - expected) < 1e-6 &&
                  grad[2 * vocab] == 0.0f;
  return ok ? 0 : 1;
}
