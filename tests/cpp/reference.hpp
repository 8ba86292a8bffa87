// An independent float64 reference of docs/semantics.md §1–§4, written straight from the formulas of the
// spec and deliberately sharing no code with src/common or the backends: when both agree, the
// agreement means something. Everything here is plain loops over dense row-major matrices; speed
// does not matter at test sizes.
#pragma once

#include <cstdint>
#include <vector>

#include "xent/xent.hpp"

namespace xent::test::reference {

// Dense row-major matrix of doubles.
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<double> values;

  Matrix() = default;
  Matrix(int64_t r, int64_t c) : rows(r), cols(c), values(static_cast<std::size_t>(r * c), 0.0) {}
  double& at(int64_t r, int64_t c) { return values[static_cast<std::size_t>(r * cols + c)]; }
  double at(int64_t r, int64_t c) const { return values[static_cast<std::size_t>(r * cols + c)]; }
};

// §1 options in double; softcap 0 means off, empty weights mean absent.
struct CeSpec {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  double softcap = 0.0;
  double logit_scale = 1.0;
  std::vector<double> class_weight;
  std::vector<double> row_weight;
};

// Upstream gradient: `wanted` false skips the gradient; `values` empty means 1, one value is the
// scalar of sum/mean, N values are the per-row g_n of `none`.
struct Upstream {
  bool wanted = false;
  std::vector<double> values;
};

struct CeResult {
  std::vector<double> loss;             // 1 value (sum, mean) or N (none)
  std::vector<double> z_loss_value;     // shaped like loss
  std::vector<double> lse;              // 0 for ignored rows
  std::vector<double> logprob;          // 0 for ignored rows
  std::vector<double> entropy;          // 0 for ignored rows
  std::vector<int64_t> argmax;          // -1 for ignored rows
  std::vector<double> transformed_max;  // max of x̃ per row (to judge argmax ties)
  double accuracy = 0.0;
  Matrix grad;  // ∂loss/∂logits when wanted
  // The same sum with every term taken in magnitude: the scale of an fp32 gradient's rounding
  // error, which p_y − 1 cancels when a row is peaked (its net value can be far smaller).
  Matrix grad_magnitude;
};

CeResult ce(const Matrix& logits, const std::vector<int64_t>& target, const CeSpec& spec,
            const Upstream& upstream);

// ∂(Σ_n g_H,n·H_n)/∂logits, the entropy term of §1 (differentiable log-probability and
// entropy): zero rows for ignored targets. Only the transform and ignore_index of `spec` matter.
Matrix entropy_grad(const Matrix& logits, const std::vector<int64_t>& target, const CeSpec& spec,
                    const std::vector<double>& grad_entropy);

// log Σ exp(v), NaN anywhere giving NaN; the upstream gradient of row n.
double log_sum_exp(const std::vector<double>& v);
double upstream_value(const Upstream& upstream, int64_t row);

// §3 options in double.
struct DistillSpec {
  DistillKind kind = DistillKind::forward_kl;
  double temperature = 1.0;
  double beta = 0.5;
  double softcap = 0.0;
  double soft_weight = 1.0;
  double hard_weight = 0.0;
  // tvd is not differentiable where p_s = p_t: elements with |p_s − p_t| <= band·max(p_s, p_t)
  // take the subgradient 0 there. Tests use it to bound how much a rounding-dependent choice of
  // side at a near-tie may move the gradient; 0 is the plain formula.
  double tvd_tie_band = 0.0;
  CeSpec ce;  // ignore_index and reduction of the whole op; the rest configures the hard term
};

struct DistillResult {
  std::vector<double> loss;
  Matrix grad;  // ∂loss/∂student when wanted
};

// target may be null (every row valid).
DistillResult distill(const Matrix& student, const Matrix& teacher,
                      const std::vector<int64_t>* target, const DistillSpec& spec,
                      const Upstream& upstream);

// §3.1: a teacher given as ids [N, k] (−1 absent) and their log-probabilities; the softcap and
// temperature of `spec` act on the student (and the temperature on a renormalized teacher).
// Independent of the implementation's category form: the loss straight from the formulas, the
// gradient as p_s ⊙ (∂L/∂p_s − Σ p_s ∂L/∂p_s) through the student's full softmax.
struct TopKSpec {
  std::vector<int64_t> ids;      // row-major [N, k]
  std::vector<double> logprobs;  // row-major [N, k]
  int64_t k = 0;
  TopKMass mass = TopKMass::renormalize;
};
DistillResult distill_topk(const Matrix& student, const TopKSpec& teacher,
                           const std::vector<int64_t>* target, const DistillSpec& spec,
                           const Upstream& upstream);

// The §3 transform of the student (softcap, then 1/T) and its derivative.
double distill_transform(const DistillSpec& spec, double x);
double distill_slope(const DistillSpec& spec, double x);
// The reduction of per-row losses d_n and row gradients ∂d_n/∂s̃ (before the slope), with σ, the
// upstream gradient, and the hard-label term α·CE added.
DistillResult distill_from_rows(const Matrix& student, const std::vector<int64_t>* target,
                                const DistillSpec& spec, const Upstream& upstream,
                                const std::vector<double>& row_loss, const Matrix& row_grad,
                                int64_t valid_rows);

// x = h·Wᵀ (+ bias); bias may be empty.
Matrix linear_logits(const Matrix& hidden, const Matrix& weight, const std::vector<double>& bias);

struct LinearGrads {
  Matrix hidden;             // G·W
  Matrix weight;             // Gᵀ·h
  std::vector<double> bias;  // Σ_n G_n
};
LinearGrads linear_backward(const Matrix& grad_logits, const Matrix& hidden, const Matrix& weight);

struct LinearCeResult {
  CeResult ce;  // loss, statistics and the gradient with respect to the logits
  LinearGrads grads;
};
LinearCeResult linear_ce(const Matrix& hidden, const Matrix& weight,
                         const std::vector<double>& bias, const std::vector<int64_t>& target,
                         const CeSpec& spec, const Upstream& upstream);

struct LinearDistillResult {
  DistillResult distill;
  LinearGrads grads;  // student hidden and weight (bias unused)
};
LinearDistillResult linear_distill(const Matrix& student_hidden, const Matrix& student_weight,
                                   const Matrix& teacher_logits, const std::vector<int64_t>* target,
                                   const DistillSpec& spec, const Upstream& upstream);

}  // namespace xent::test::reference
