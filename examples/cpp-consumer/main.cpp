// Uses the installed xent: cross-entropy on logits and fused linear cross-entropy on the CPU,
// each checked against a plain loop written here. Exits 1 on a mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "xent/xent.hpp"

namespace {

// Mean over valid rows of lse(row) - row[target], in double.
double plain_cross_entropy(const std::vector<float>& logits, const std::vector<int64_t>& target,
                           int64_t rows, int64_t vocab) {
  double total = 0;
  int64_t valid = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (target[r] == -100) continue;
    const float* row = &logits[r * vocab];
    double max = row[0], sum = 0;
    for (int64_t v = 1; v < vocab; ++v) max = std::fmax(max, row[v]);
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - max);
    total += max + std::log(sum) - row[target[r]];
    ++valid;
  }
  return total / static_cast<double>(valid);
}

bool close(const char* what, double got, double expected) {
  const bool ok = std::fabs(got - expected) <= 1e-5 * (1 + std::fabs(expected));
  std::printf("%-10s xent %.7f  plain loop %.7f  %s\n", what, got, expected,
              ok ? "ok" : "MISMATCH");
  return ok;
}

}  // namespace

int main() {
  const int64_t rows = 6, hidden = 5, vocab = 11;
  std::vector<float> h(rows * hidden), weight(vocab * hidden), logits(rows * vocab);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = std::sin(0.7f * static_cast<float>(i));
  for (std::size_t i = 0; i < weight.size(); ++i)
    weight[i] = std::cos(0.3f * static_cast<float>(i));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t v = 0; v < vocab; ++v) {
      float dot = 0;
      for (int64_t k = 0; k < hidden; ++k) dot += h[r * hidden + k] * weight[v * hidden + k];
      logits[r * vocab + v] = dot;
    }
  }
  const std::vector<int64_t> target = {3, 0, -100, 10, 7, 1};
  const double expected = plain_cross_entropy(logits, target, rows, vocab);

  float ce_loss = 0;
  xent::CeOutputs ce_out;
  ce_out.loss = xent::scalar(&ce_loss, xent::DType::f32);
  xent::ce_forward(xent::matrix(logits.data(), xent::DType::f32, rows, vocab),
                   xent::vector(target.data(), xent::DType::i64, rows), xent::CeOptions{}, ce_out);

  float linear_loss = 0;
  xent::LinearCeOutputs linear_out;
  linear_out.loss = xent::scalar(&linear_loss, xent::DType::f32);
  xent::linear_ce_forward(xent::matrix(h.data(), xent::DType::f32, rows, hidden),
                          xent::matrix(weight.data(), xent::DType::f32, vocab, hidden),
                          /*bias=*/{}, xent::vector(target.data(), xent::DType::i64, rows),
                          xent::LinearCeOptions{}, linear_out);

  const bool ok = close("ce", ce_loss, expected) & close("linear_ce", linear_loss, expected);
  return ok ? 0 : 1;
}
