// Float64 reference of distillation from a top-k teacher (docs/semantics.md §3.1).
#include <algorithm>
#include <cmath>

#include "reference.hpp"

namespace xent::test::reference {
namespace {

// The compared distributions of one row: student π and teacher q over the categories, with
// ∂π_c/∂p_i expressed by `category` (the category of column i, −1 for none) and, for
// renormalize, the division by P_S.
struct TopKCategories {
  std::vector<double> pi, q;
  std::vector<int64_t> category;  // per column
  double ps_sum = 1.0;            // P_S (renormalize)
};

double xlogy_ratio(double x, double a, double b) { return x == 0.0 ? 0.0 : x * std::log(a / b); }

// L over the categories and ∂L/∂π_c, by the table of §3.
double category_loss(DistillKind kind, double beta, double tie_band, const std::vector<double>& pi,
                     const std::vector<double>& q, std::vector<double>& dpi) {
  double loss = 0.0;
  dpi.assign(pi.size(), 0.0);
  for (std::size_t c = 0; c < pi.size(); ++c) {
    const double p = pi[c], t = q[c];
    switch (kind) {
      case DistillKind::forward_kl:
        loss += xlogy_ratio(t, t, p);
        dpi[c] = t == 0.0 ? 0.0 : -t / p;
        break;
      case DistillKind::soft_ce:
        loss += t == 0.0 ? 0.0 : -t * std::log(p);
        dpi[c] = t == 0.0 ? 0.0 : -t / p;
        break;
      case DistillKind::reverse_kl:
        loss += xlogy_ratio(p, p, t);
        dpi[c] = p == 0.0 ? 0.0 : std::log(p / t) + 1.0;
        break;
      case DistillKind::jsd: {
        if (beta == 0.0 || beta == 1.0) break;
        const double m = beta * t + (1.0 - beta) * p;
        loss += beta * xlogy_ratio(t, t, m) + (1.0 - beta) * xlogy_ratio(p, p, m);
        dpi[c] = p == 0.0 ? 0.0 : (1.0 - beta) * std::log(p / m);
        break;
      }
      case DistillKind::tvd:
        loss += 0.5 * std::abs(p - t);
        dpi[c] = 0.5 * (p > t ? 1.0 : (p < t ? -1.0 : 0.0));
        if (std::abs(p - t) <= tie_band * std::max(p, t))
          dpi[c] = 0.0;  // DistillSpec::tvd_tie_band
        break;
    }
  }
  return loss;
}

}  // namespace

DistillResult distill_topk(const Matrix& student, const TopKSpec& teacher,
                           const std::vector<int64_t>* target, const DistillSpec& spec,
                           const Upstream& upstream) {
  const int64_t rows = student.rows, vocab = student.cols;
  auto is_valid = [&](int64_t n) {
    return target == nullptr || (*target)[n] != spec.ce.ignore_index;
  };
  std::vector<double> row_loss(rows, 0.0);
  Matrix row_grad(rows, vocab);
  int64_t valid_rows = 0;
  for (int64_t n = 0; n < rows; ++n) {
    if (!is_valid(n)) continue;
    ++valid_rows;
    std::vector<double> v(vocab);
    for (int64_t i = 0; i < vocab; ++i) v[i] = distill_transform(spec, student.at(n, i));
    const double lse = log_sum_exp(v);
    std::vector<double> p(vocab);
    for (int64_t i = 0; i < vocab; ++i) p[i] = std::exp(v[i] - lse);

    TopKCategories cat;
    cat.category.assign(vocab, -1);
    std::vector<double> ell;
    for (int64_t j = 0; j < teacher.k; ++j) {
      const int64_t id = teacher.ids[n * teacher.k + j];
      if (id < 0) continue;
      cat.category[id] = static_cast<int64_t>(cat.pi.size());
      cat.pi.push_back(p[id]);
      ell.push_back(teacher.logprobs[n * teacher.k + j]);
    }
    const std::size_t present = ell.size();
    if (teacher.mass == TopKMass::renormalize) {
      if (present == 0) continue;
      cat.ps_sum = 0.0;
      for (const double x : cat.pi) cat.ps_sum += x;
      for (double& x : cat.pi) x /= cat.ps_sum;
      std::vector<double> scaled(present);
      for (std::size_t j = 0; j < present; ++j) scaled[j] = ell[j] / spec.temperature;
      const double z = log_sum_exp(scaled);
      for (std::size_t j = 0; j < present; ++j) cat.q.push_back(std::exp(scaled[j] - z));
    } else {
      double q_sum = 0.0, tail = 0.0;
      for (const double l : ell) {
        cat.q.push_back(std::exp(l));
        q_sum += std::exp(l);
      }
      for (int64_t i = 0; i < vocab; ++i)
        if (cat.category[i] < 0) tail += p[i];
      // Ids covering the vocabulary leave no tail category (1 − Σ q is then rounding).
      if (teacher.mass == TopKMass::tail && static_cast<int64_t>(present) < vocab) {
        cat.pi.push_back(tail);
        cat.q.push_back(std::max(0.0, 1.0 - q_sum));
        for (int64_t i = 0; i < vocab; ++i)
          if (cat.category[i] < 0) cat.category[i] = static_cast<int64_t>(present);
      }
    }
    std::vector<double> dpi;
    row_loss[n] = category_loss(spec.kind, spec.beta, spec.tvd_tie_band, cat.pi, cat.q, dpi);
    if (!upstream.wanted) continue;
    // ∂L/∂p_i through π: renormalize divides by P_S (π_j = p_id_j / P_S).
    std::vector<double> dp(vocab, 0.0);
    double mean_dpi = 0.0;
    if (teacher.mass == TopKMass::renormalize)
      for (std::size_t c = 0; c < present; ++c) mean_dpi += cat.pi[c] * dpi[c];
    for (int64_t i = 0; i < vocab; ++i) {
      const int64_t c = cat.category[i];
      if (c < 0) continue;
      dp[i] = teacher.mass == TopKMass::renormalize ? (dpi[c] - mean_dpi) / cat.ps_sum : dpi[c];
    }
    double mean = 0.0;
    for (int64_t i = 0; i < vocab; ++i) mean += p[i] * dp[i];
    for (int64_t i = 0; i < vocab; ++i) row_grad.at(n, i) = p[i] * (dp[i] - mean);
  }

  return distill_from_rows(student, target, spec, upstream, row_loss, row_grad, valid_rows);
}

}  // namespace xent::test::reference
