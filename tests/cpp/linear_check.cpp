// Shared pieces of the fused linear suites.
#include "linear_check.hpp"

#include <cmath>
#include <sstream>
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

double bias_grad_tolerance(DType dtype, const Matrix& grad_logits,
                           const std::vector<int64_t>& target,
                           const std::vector<double>& torch_bias,
                           const std::vector<double>& ref_bias) {
  const double tolerance = grad_tolerance(dtype, Family::linear, torch_bias, ref_bias);
  if (!is_half(dtype)) return tolerance;
  const double u = unit_roundoff(dtype);
  std::vector<double> coherent(ref_bias.size(), 0.0);
  std::vector<int> rows_of(ref_bias.size(), 0);
  for (std::size_t n = 0; n < target.size(); ++n) {
    const int64_t v = target[n];
    if (v < 0 || v >= grad_logits.cols) continue;  // ignored rows
    coherent[static_cast<std::size_t>(v)] += std::abs(grad_logits.at(static_cast<int64_t>(n), v));
    ++rows_of[static_cast<std::size_t>(v)];
  }
  double coherent_squares = 0.0;
  for (std::size_t v = 0; v < coherent.size(); ++v) {
    if (rows_of[v] >= 2) coherent_squares += coherent[v] * coherent[v];
  }
  const double reference_norm = norm(ref_bias);
  if (reference_norm == 0.0) return tolerance;
  return tolerance + u * std::sqrt(coherent_squares) / reference_norm;
}

void check_argmax_accuracy(const std::vector<int64_t>& argmax, double accuracy,
                           const std::vector<int64_t>& target, int64_t ignore_index,
                           const Matrix& logits, const reference::CeSpec& spec,
                           const reference::CeResult& ref, int64_t skip_row, double tie) {
  const int64_t rows = static_cast<int64_t>(target.size()), vocab = logits.cols;
  int64_t valid = 0, correct = 0;
  for (int64_t n = 0; n < rows; ++n) {
    if (target[n] == ignore_index) {
      EXPECT_EQ(argmax[n], -1) << "argmax of ignored row " << n;
      continue;
    }
    ++valid;
    if (n == skip_row) continue;
    ASSERT_TRUE(argmax[n] >= 0 && argmax[n] < vocab) << "argmax row " << n << " = " << argmax[n];
    correct += argmax[n] == target[n];
    const double chosen = ce_transformed(spec, logits.at(n, argmax[n]));
    EXPECT_LE(std::abs(chosen - ref.transformed_max[n]), tie * (1 + std::abs(chosen)))
        << "argmax row " << n << ": got " << argmax[n] << ", expected " << ref.argmax[n];
  }
  if (skip_row < 0) {
    EXPECT_NEAR(accuracy, valid ? double(correct) / double(valid) : 0.0, 1e-6);
  }
}

std::string linear_case_label(int64_t rows, int64_t hidden, int64_t vocab, unsigned options,
                              Reduction reduction) {
  // Streamed, not a chain of operator+ on std::string: GCC 12 warns (-Wrestrict) on that chain's
  // inlined copies, falsely.
  std::ostringstream label;
  label << 'N' << rows << "_H" << hidden << "_V" << vocab << '_' << ce_options_label(options) << '_'
        << reduction_label(reduction);
  return label.str();
}

const char* budget_name(Budget budget) {
  switch (budget) {
    case Budget::default_budget:
      return "one_chunk";
    case Budget::smallest:
      return "smallest_budget";
    case Budget::several_chunks:
      return "several_chunks";
    case Budget::uneven_chunks:
      return "uneven_chunks";
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
    case Budget::smallest:
      return smallest;
    case Budget::several_chunks:
      return smallest * 8;
    default:
      return smallest * 11;  // 37 rows do not divide evenly by this
  }
}

}  // namespace xent::test
