// What the two fused linear suites share: random layers, the PyTorch-at-this-dtype error model of
// docs/semantics.md §6, and chunk budgets that force one, several or uneven chunks.
#pragma once

#include <functional>
#include <string>

#include "distill_check.hpp"

namespace xent::test {

struct LinearLayer {
  Matrix hidden;             // [N, H]
  Matrix weight;             // [V, H]
  std::vector<double> bias;  // [V] or empty
};

// Hidden ~ N(0, 1) and weight ~ N(0, (sd/√H)²), so logits have standard deviation ≈ sd; rounded
// to `dtype`, the values the op sees.
LinearLayer make_linear_layer(Rng& rng, int64_t rows, int64_t hidden, int64_t vocab, bool bias,
                              double logits_sd, DType dtype);

// Gradients of the layer for a gradient G with respect to the logits, rounded to their dtypes:
// what PyTorch holds after `(h @ W.T + b)` backward at the input dtype.
reference::LinearGrads rounded_linear_backward(const Matrix& grad_logits, const LinearLayer& layer,
                                               DType dtype, DType param_grad_dtype);

// The tolerance on ∂b = Σ_n G_n (G: `grad_logits`, the float64 gradient with respect to the
// logits) at a half dtype: grad_tolerance's PyTorch-sized draw, plus the worst case of roundings
// that add up in one direction. Rows whose target is the same column v hold nearly the same G_nv
// (≈ (p_y − 1)·g/N), rounded to the dtype alike, so k of them err k times the same way: u·Σ|G_nv|
// over those rows, for each column that is the target of two rows or more (u the dtype's unit
// roundoff). When such columns dominate ‖∂b‖ (targets at the vocabulary's edges) the op's error
// and PyTorch's are two draws, not averages, so PyTorch's is no yardstick there. Other dtypes:
// grad_tolerance.
double bias_grad_tolerance(DType dtype, const Matrix& grad_logits,
                           const std::vector<int64_t>& target,
                           const std::vector<double>& torch_bias,
                           const std::vector<double>& ref_bias);

// "N<rows>_H<hidden>_V<vocab>_<options>_<reduction>": the shape part of the linear suites' case
// names (gpu-check.sh's filters name cases by it).
std::string linear_case_label(int64_t rows, int64_t hidden, int64_t vocab, unsigned options,
                              Reduction reduction);

// The argmax and accuracy outputs of a linear step against the float64 reference: −1 for ignored
// rows, else a column whose x̃ (softcap(a·x) of `logits`) is within `tie` (relative) of the row's
// largest, and the accuracy those columns give (not checked with a NaN row, whose argmax is
// any; skip_row −1 for none).
void check_argmax_accuracy(const std::vector<int64_t>& argmax, double accuracy,
                           const std::vector<int64_t>& target, int64_t ignore_index,
                           const Matrix& logits, const reference::CeSpec& spec,
                           const reference::CeResult& ref, int64_t skip_row, double tie);

// Chunk budgets, measured by the op: the smallest budget it accepts (found by doubling from
// 1 KiB), then multiples of it.
enum class Budget { default_budget, smallest, several_chunks, uneven_chunks };
const char* budget_name(Budget budget);
// `accepts(bytes)` runs the op with that budget and returns false when it rejects the budget.
std::size_t budget_bytes(Budget budget, const std::function<bool(std::size_t)>& accepts);

}  // namespace xent::test
