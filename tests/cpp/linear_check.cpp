// Shared pieces of the fused linear suites.
#include "linear_check.hpp"

#include <cmath>
#include <string>

namespace xent::test {

LinearLayer make_linear_layer(Rng& rng, int64_t rows, int64_t hidden, int64_t vocab, bool bias,
                              double logits_sd, DType dtype) {
  LinearLayer layer;
  layer.hidden = rounded(rng.matrix(rows, hidden, 1.0), dtype);
  layer.weight = rounded(rng.matrix(vocab, hidden, logits_sd / std::sqrt(double(hidden))), dtype);
  if (bias) layer.bias = rounded(rng.uniform_vector(vocab, -1.0, 1.0), dtype);
  return layer;
}

reference::LinearGrads rounded_linear_backward(const Matrix& grad_logits, const LinearLayer& layer,
                                               DType dtype, DType param_grad_dtype) {
  reference::LinearGrads g =
      reference::linear_backward(rounded(grad_logits, dtype), layer.hidden, layer.weight);
  g.hidden = rounded(g.hidden, dtype);
  g.weight = rounded(g.weight, param_grad_dtype);
  g.bias = rounded(g.bias, param_grad_dtype);
  return g;
}

std::string linear_case_label(int64_t rows, int64_t hidden, int64_t vocab, unsigned options,
                              Reduction reduction) {
  return "N" + std::to_string(rows) + "_H" + std::to_string(hidden) + "_V" +
         std::to_string(vocab) + "_" + ce_options_label(options) + "_" +
         reduction_label(reduction);
}

const char* budget_name(Budget budget) {
  switch (budget) {
    case Budget::default_budget: return "one_chunk";
    case Budget::smallest: return "smallest_budget";
    case Budget::several_chunks: return "several_chunks";
    case Budget::uneven_chunks: return "uneven_chunks";
  }
  return "unknown";
}

std::size_t budget_bytes(Budget budget, const std::function<bool(std::size_t)>& accepts) {
  if (budget == Budget::default_budget) return std::size_t{512} << 20;
  std::size_t smallest = 1024;
  while (!accepts(smallest)) {
    smallest *= 2;
    if (smallest > (std::size_t{1} << 32)) {
      ADD_FAILURE() << "no workspace_budget up to 4 GiB was accepted";
      return std::size_t{512} << 20;
    }
  }
  switch (budget) {
    case Budget::smallest: return smallest;
    case Budget::several_chunks: return smallest * 8;
    default: return smallest * 11;  // 37 rows do not divide evenly by this
  }
}

}  // namespace xent::test
