// Float64 reference of docs/semantics.md §1–§4: every formula is written the way the spec states it, not the
// way a fast kernel would arrange it (no online statistics, no shared coefficients).
#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace xent::test::reference {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// x -> softcap(a·x) and its derivative.
double ce_transform(const CeSpec& spec, double x) {
  const double z = spec.logit_scale * x;
  return spec.softcap > 0 ? spec.softcap * std::tanh(z / spec.softcap) : z;
}
double ce_slope(const CeSpec& spec, double x) {
  if (!(spec.softcap > 0)) return spec.logit_scale;
  const double t = std::tanh(spec.logit_scale * x / spec.softcap);
  return spec.logit_scale * (1.0 - t * t);
}

}  // namespace

// log Σ exp(v) with the max shifted out; NaN anywhere gives NaN.
double log_sum_exp(const std::vector<double>& v) {
  double m = -std::numeric_limits<double>::infinity();
  for (double x : v) {
    if (std::isnan(x)) return kNaN;
    m = std::max(m, x);
  }
  if (std::isinf(m)) return m;
  double s = 0.0;
  for (double x : v) s += std::exp(x - m);
  return m + std::log(s);
}

double upstream_value(const Upstream& upstream, int64_t row) {
  if (upstream.values.empty()) return 1.0;
  if (upstream.values.size() == 1) return upstream.values[0];
  return upstream.values[static_cast<std::size_t>(row)];
}

namespace {

double class_weight_of(const CeSpec& spec, int64_t i) {
  return spec.class_weight.empty() ? 1.0 : spec.class_weight[static_cast<std::size_t>(i)];
}
double row_weight_of(const CeSpec& spec, int64_t n) {
  return spec.row_weight.empty() ? 1.0 : spec.row_weight[static_cast<std::size_t>(n)];
}

}  // namespace

CeResult ce(const Matrix& logits, const std::vector<int64_t>& target, const CeSpec& spec,
            const Upstream& upstream) {
  const int64_t rows = logits.rows, vocab = logits.cols;
  const double eps = spec.label_smoothing, lambda = spec.z_loss;
  CeResult r;
  r.lse.assign(rows, 0.0);
  r.logprob.assign(rows, 0.0);
  r.entropy.assign(rows, 0.0);
  r.argmax.assign(rows, -1);
  r.transformed_max.assign(rows, 0.0);
  std::vector<double> row_loss(rows, 0.0), row_z(rows, 0.0);
  std::vector<std::vector<double>> probs(rows);
  std::vector<double> full_lse(rows, 0.0);

  double class_weight_total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) class_weight_total += class_weight_of(spec, i);

  int64_t valid_rows = 0, correct = 0;
  double denominator = 0.0;  // D
  for (int64_t n = 0; n < rows; ++n) {
    std::vector<double> v(vocab);
    for (int64_t i = 0; i < vocab; ++i) v[i] = ce_transform(spec, logits.at(n, i));
    const double lse = log_sum_exp(v);
    full_lse[n] = lse;
    std::vector<double>& p = probs[n];
    p.resize(vocab);
    double mean_logit = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      p[i] = std::exp(v[i] - lse);
      mean_logit += p[i] * v[i];
    }
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i) {
      if (std::isnan(v[best])) break;
      if (std::isnan(v[i]) || v[i] > v[best]) best = i;
    }
    r.transformed_max[n] = vocab > 0 ? v[best] : 0.0;

    const int64_t y = target[n];
    if (y == spec.ignore_index) continue;  // lse, logprob, entropy 0; argmax −1
    ++valid_rows;
    r.entropy[n] = lse - mean_logit;
    const double wy = class_weight_of(spec, y);
    denominator += wy;
    r.lse[n] = lse;
    r.logprob[n] = v[y] - lse;
    r.argmax[n] = best;
    if (best == y) ++correct;
    double smooth = 0.0;
    for (int64_t i = 0; i < vocab; ++i) smooth += class_weight_of(spec, i) * (lse - v[i]);
    row_loss[n] = (1.0 - eps) * wy * (lse - v[y]) + (eps / static_cast<double>(vocab)) * smooth;
    row_z[n] = lambda * lse * lse;
  }
  if (spec.class_weight.empty()) denominator = static_cast<double>(valid_rows);
  r.accuracy = valid_rows > 0 ? static_cast<double>(correct) / valid_rows : 0.0;

  // Reduction; `mean` with nothing valid gives 0 (the one deviation from PyTorch).
  const double loss_divisor = spec.reduction == Reduction::mean ? denominator : 1.0;
  const double z_divisor =
      spec.reduction == Reduction::mean ? static_cast<double>(valid_rows) : 1.0;
  auto part = [](double value, double divisor) { return divisor > 0 ? value / divisor : 0.0; };
  if (spec.reduction == Reduction::none) {
    r.loss.assign(rows, 0.0);
    r.z_loss_value.assign(rows, 0.0);
    for (int64_t n = 0; n < rows; ++n) {
      if (target[n] == spec.ignore_index) continue;
      r.loss[n] = row_weight_of(spec, n) * (row_loss[n] + row_z[n]);
      r.z_loss_value[n] = row_weight_of(spec, n) * row_z[n];
    }
  } else {
    double loss_sum = 0.0, z_sum = 0.0;
    for (int64_t n = 0; n < rows; ++n) {
      if (target[n] == spec.ignore_index) continue;
      loss_sum += row_weight_of(spec, n) * row_loss[n];
      z_sum += row_weight_of(spec, n) * row_z[n];
    }
    r.loss = {part(loss_sum, loss_divisor) + part(z_sum, z_divisor)};
    r.z_loss_value = {part(z_sum, z_divisor)};
  }
  if (!upstream.wanted) return r;

  r.grad = Matrix(rows, vocab);
  r.grad_magnitude = Matrix(rows, vocab);
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t y = target[n];
    if (y == spec.ignore_index) continue;
    const double g = upstream_value(upstream, n) * row_weight_of(spec, n);
    const double c = part(g, loss_divisor), cz = part(g, z_divisor);
    const double wy = class_weight_of(spec, y);
    const std::vector<double>& p = probs[n];
    for (int64_t i = 0; i < vocab; ++i) {
      const double wi = class_weight_of(spec, i);
      const double d_loss = (1.0 - eps) * wy * (p[i] - (i == y ? 1.0 : 0.0)) +
                            (eps / static_cast<double>(vocab)) * (class_weight_total * p[i] - wi);
      const double d_z = 2.0 * lambda * full_lse[n] * p[i];
      r.grad.at(n, i) = (c * d_loss + cz * d_z) * ce_slope(spec, logits.at(n, i));
      const double loss_terms =
          (1.0 - eps) * wy * (p[i] + (i == y ? 1.0 : 0.0)) +
          (eps / static_cast<double>(vocab)) * (class_weight_total * p[i] + wi);
      r.grad_magnitude.at(n, i) = (std::abs(c) * loss_terms + std::abs(cz * d_z)) *
                                  std::abs(ce_slope(spec, logits.at(n, i)));
    }
  }
  return r;
}

Matrix entropy_grad(const Matrix& logits, const std::vector<int64_t>& target, const CeSpec& spec,
                    const std::vector<double>& grad_entropy) {
  const int64_t rows = logits.rows, vocab = logits.cols;
  Matrix grad(rows, vocab);
  for (int64_t n = 0; n < rows; ++n) {
    if (target[n] == spec.ignore_index) continue;
    std::vector<double> v(vocab);
    for (int64_t i = 0; i < vocab; ++i) v[i] = ce_transform(spec, logits.at(n, i));
    const double lse = log_sum_exp(v);
    double mean_logit = 0.0;  // S = Σ p_j x̃_j
    for (int64_t i = 0; i < vocab; ++i) mean_logit += std::exp(v[i] - lse) * v[i];
    const double g = grad_entropy[static_cast<std::size_t>(n)];
    for (int64_t i = 0; i < vocab; ++i) {
      const double p = std::exp(v[i] - lse);
      grad.at(n, i) = -g * p * (v[i] - mean_logit) * ce_slope(spec, logits.at(n, i));
    }
  }
  return grad;
}

namespace {}  // namespace

double distill_transform(const DistillSpec& spec, double x) {
  const double capped = spec.softcap > 0 ? spec.softcap * std::tanh(x / spec.softcap) : x;
  return capped / spec.temperature;
}
double distill_slope(const DistillSpec& spec, double x) {
  if (!(spec.softcap > 0)) return 1.0 / spec.temperature;
  const double t = std::tanh(x / spec.softcap);
  return (1.0 - t * t) / spec.temperature;
}

namespace {

std::vector<double> log_softmax(const std::vector<double>& v) {
  const double lse = log_sum_exp(v);
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = v[i] - lse;
  return out;
}

// p·log(p/q) with 0·log 0 = 0.
double plogp_ratio(double p, double log_p, double log_q) {
  return p == 0.0 ? 0.0 : p * (log_p - log_q);
}

}  // namespace

DistillResult distill_from_rows(const Matrix& student, const std::vector<int64_t>* target,
                                const DistillSpec& spec, const Upstream& upstream,
                                const std::vector<double>& row_loss, const Matrix& row_grad,
                                int64_t valid_rows) {
  const int64_t rows = student.rows, vocab = student.cols;
  const Reduction reduction = spec.ce.reduction;
  const double divisor = reduction == Reduction::mean ? static_cast<double>(valid_rows) : 1.0;
  DistillResult r;
  if (reduction == Reduction::none) {
    r.loss.assign(rows, 0.0);
    for (int64_t n = 0; n < rows; ++n) r.loss[n] = spec.soft_weight * row_loss[n];
  } else {
    double total = 0.0;
    for (int64_t n = 0; n < rows; ++n) total += row_loss[n];
    r.loss = {divisor > 0 ? spec.soft_weight * total / divisor : 0.0};
  }
  if (upstream.wanted) {
    r.grad = Matrix(rows, vocab);
    for (int64_t n = 0; n < rows; ++n) {
      if ((target != nullptr && (*target)[n] == spec.ce.ignore_index) || !(divisor > 0)) continue;
      const double c = spec.soft_weight * upstream_value(upstream, n) / divisor;
      for (int64_t i = 0; i < vocab; ++i)
        r.grad.at(n, i) = c * row_grad.at(n, i) * distill_slope(spec, student.at(n, i));
    }
  }

  if (spec.hard_weight != 0.0 && target != nullptr) {
    const CeResult hard = ce(student, *target, spec.ce, upstream);
    for (std::size_t k = 0; k < r.loss.size(); ++k) r.loss[k] += spec.hard_weight * hard.loss[k];
    if (upstream.wanted)
      for (std::size_t k = 0; k < r.grad.values.size(); ++k)
        r.grad.values[k] += spec.hard_weight * hard.grad.values[k];
  }
  return r;
}

DistillResult distill(const Matrix& student, const Matrix& teacher,
                      const std::vector<int64_t>* target, const DistillSpec& spec,
                      const Upstream& upstream) {
  const int64_t rows = student.rows, vocab = student.cols;
  const double beta = spec.beta;
  const bool degenerate_jsd = spec.kind == DistillKind::jsd && (beta == 0.0 || beta == 1.0);
  auto is_valid = [&](int64_t n) {
    return target == nullptr || (*target)[n] != spec.ce.ignore_index;
  };

  std::vector<double> row_loss(rows, 0.0);
  Matrix row_grad(rows, vocab);  // ∂(row loss)/∂s
  int64_t valid_rows = 0;
  for (int64_t n = 0; n < rows; ++n) {
    if (!is_valid(n)) continue;
    ++valid_rows;
    std::vector<double> vs(vocab), vt(vocab);
    for (int64_t i = 0; i < vocab; ++i) {
      vs[i] = distill_transform(spec, student.at(n, i));
      vt[i] = distill_transform(spec, teacher.at(n, i));
    }
    const std::vector<double> log_ps = log_softmax(vs), log_pt = log_softmax(vt);
    std::vector<double> ps(vocab), pt(vocab), u(vocab, 0.0);
    for (int64_t i = 0; i < vocab; ++i) {
      ps[i] = std::exp(log_ps[i]);
      pt[i] = std::exp(log_pt[i]);
    }
    double loss = 0.0;
    // d loss / d p_s,i (up to a constant that the softmax Jacobian cancels) is u_i; the gradient
    // with respect to the transformed logit is then p_s,j·(u_j − Σ_i p_s,i·u_i).
    for (int64_t i = 0; i < vocab; ++i) {
      switch (spec.kind) {
        case DistillKind::forward_kl:
          loss += plogp_ratio(pt[i], log_pt[i], log_ps[i]);
          break;
        case DistillKind::soft_ce:
          loss += pt[i] == 0.0 ? 0.0 : -pt[i] * log_ps[i];
          break;
        case DistillKind::reverse_kl:
          loss += plogp_ratio(ps[i], log_ps[i], log_pt[i]);
          u[i] = log_ps[i] - log_pt[i];
          break;
        case DistillKind::jsd: {
          if (degenerate_jsd) break;
          const double m = beta * pt[i] + (1.0 - beta) * ps[i];
          const double log_m = std::log(m);
          loss += beta * plogp_ratio(pt[i], log_pt[i], log_m) +
                  (1.0 - beta) * plogp_ratio(ps[i], log_ps[i], log_m);
          u[i] = (1.0 - beta) * (log_ps[i] - log_m);
          break;
        }
        case DistillKind::tvd:
          loss += 0.5 * std::abs(pt[i] - ps[i]);
          u[i] = 0.5 * (ps[i] > pt[i] ? 1.0 : (ps[i] < pt[i] ? -1.0 : 0.0));
          if (std::abs(ps[i] - pt[i]) <= spec.tvd_tie_band * std::max(ps[i], pt[i])) u[i] = 0.0;
          break;
      }
    }
    row_loss[n] = loss;
    if (!upstream.wanted) continue;
    if (spec.kind == DistillKind::forward_kl || spec.kind == DistillKind::soft_ce) {
      // Here d loss/d p_s,i = −p_t,i/p_s,i, and p_s·(u − Σ p_s·u) collapses to p_s − p_t; written
      // in that form so a p_s that underflows to 0 does not divide by zero.
      for (int64_t i = 0; i < vocab; ++i) row_grad.at(n, i) = ps[i] - pt[i];
    } else {
      double mean_u = 0.0;
      for (int64_t i = 0; i < vocab; ++i) mean_u += ps[i] == 0.0 ? 0.0 : ps[i] * u[i];
      for (int64_t i = 0; i < vocab; ++i)
        row_grad.at(n, i) = ps[i] == 0.0 ? 0.0 : ps[i] * (u[i] - mean_u);
    }
  }

  return distill_from_rows(student, target, spec, upstream, row_loss, row_grad, valid_rows);
}

Matrix linear_logits(const Matrix& hidden, const Matrix& weight, const std::vector<double>& bias) {
  Matrix x(hidden.rows, weight.rows);
  for (int64_t n = 0; n < hidden.rows; ++n)
    for (int64_t v = 0; v < weight.rows; ++v) {
      double s = bias.empty() ? 0.0 : bias[v];
      for (int64_t k = 0; k < hidden.cols; ++k) s += hidden.at(n, k) * weight.at(v, k);
      x.at(n, v) = s;
    }
  return x;
}

LinearGrads linear_backward(const Matrix& grad_logits, const Matrix& hidden, const Matrix& weight) {
  LinearGrads g;
  g.hidden = Matrix(hidden.rows, hidden.cols);
  g.weight = Matrix(weight.rows, weight.cols);
  g.bias.assign(weight.rows, 0.0);
  for (int64_t n = 0; n < hidden.rows; ++n)
    for (int64_t v = 0; v < weight.rows; ++v) {
      const double gv = grad_logits.at(n, v);
      if (gv == 0.0) continue;
      g.bias[v] += gv;
      for (int64_t k = 0; k < hidden.cols; ++k) {
        g.hidden.at(n, k) += gv * weight.at(v, k);
        g.weight.at(v, k) += gv * hidden.at(n, k);
      }
    }
  return g;
}

LinearCeResult linear_ce(const Matrix& hidden, const Matrix& weight,
                         const std::vector<double>& bias, const std::vector<int64_t>& target,
                         const CeSpec& spec, const Upstream& upstream) {
  LinearCeResult r;
  r.ce = ce(linear_logits(hidden, weight, bias), target, spec, upstream);
  if (upstream.wanted) r.grads = linear_backward(r.ce.grad, hidden, weight);
  return r;
}

LinearDistillResult linear_distill(const Matrix& student_hidden, const Matrix& student_weight,
                                   const Matrix& teacher_logits, const std::vector<int64_t>* target,
                                   const DistillSpec& spec, const Upstream& upstream) {
  LinearDistillResult r;
  r.distill = distill(linear_logits(student_hidden, student_weight, {}), teacher_logits, target,
                      spec, upstream);
  if (upstream.wanted) r.grads = linear_backward(r.distill.grad, student_hidden, student_weight);
  return r;
}

}  // namespace xent::test::reference
