// The per-row math of the distillation losses (docs/semantics.md §3), written once for both backends.
// A row is processed in up to three sweeps over its elements (on the GPU these sweep on-chip
// data, never HBM again):
//   1. RowStats of the transformed student and teacher logits -> lse_s, lse_t;
//   2. distill_term per element, summed -> the loss, and Σ p_s·u for kinds that need it;
//   3. distill_grad_element per element -> ∂loss/∂s.
// Sweep 2 can be merged into 3 only for kinds where distill_needs_sum_pu() is false.
#pragma once

#include "common/ce_row.hpp"

namespace xent::common {

enum class DistillKindCode : int { forward_kl = 0, reverse_kl = 1, jsd = 2, soft_ce = 3, tvd = 4 };

// Transform of distillation logits: x -> softcap(x) / T, applied to student and teacher alike.
template <class T>
struct DistillTransform {
  T inv_temperature = 1;
  T softcap = 0;  // 0 means off

  XENT_HD T value(T x) const {
    return (softcap > 0 ? softcap * std::tanh(x / softcap) : x) * inv_temperature;
  }
  XENT_HD T slope(T x) const {
    if (!(softcap > 0)) return inv_temperature;
    const T t = std::tanh(x / softcap);
    return (T(1) - t * t) * inv_temperature;
  }
};

template <class T>
struct DistillConstants {
  DistillKindCode kind = DistillKindCode::forward_kl;
  DistillTransform<T> transform;
  T beta = T(0.5);
  T log_beta = 0;            // log β (jsd)
  T log_one_minus_beta = 0;  // log(1−β) (jsd)
};

template <class T>
XENT_HD DistillConstants<T> make_distill_constants(DistillKindCode kind, T temperature, T softcap,
                                                   T beta) {
  DistillConstants<T> c;
  c.kind = kind;
  c.transform.inv_temperature = T(1) / temperature;
  c.transform.softcap = softcap;
  c.beta = beta;
  c.log_beta = std::log(beta);
  c.log_one_minus_beta = std::log(T(1) - beta);
  return c;
}

// True when the gradient needs Σ_j p_s,j·u_j of the whole row before any element is written.
constexpr XENT_HD bool distill_needs_sum_pu(DistillKindCode kind) {
  return kind == DistillKindCode::reverse_kl || kind == DistillKindCode::jsd ||
         kind == DistillKindCode::tvd;
}

// β = 0 and β = 1 make the JSD exactly 0 (docs/semantics.md §3); rounding of log m must not say otherwise.
template <class T>
XENT_HD bool distill_is_degenerate(const DistillConstants<T>& c) {
  return c.kind == DistillKindCode::jsd && (c.beta == T(0) || c.beta == T(1));
}

template <class T>
struct DistillTerm {
  T loss;    // this element's contribution to the row loss
  T prob_u;  // p_s·u, summed over the row for the gradient (kinds of distill_needs_sum_pu)
};

// 0·log 0 = 0: a zero probability contributes nothing, whatever the log says. NaN still passes
// (p == 0 is false for NaN), so a NaN row stays visibly NaN.
template <class T>
XENT_HD T weighted_log_ratio(T p, T log_ratio) {
  return p == T(0) ? T(0) : p * log_ratio;
}

// How the jsd terms evaluate e^x (x <= 0) and log y (y in [1, 2]): std::exp / std::log here; the
// GPU kernels pass their ex2/lg2 forms, which keep log m within ~3e-7 absolute on every element
// (cuda/distill_rows.cuh) instead of a precise expf and logf per element per sweep.
struct StdExpLog {
  template <class T>
  XENT_HD T exp(T x) const {
    return std::exp(x);
  }
  template <class T>
  XENT_HD T log(T y) const {
    return std::log(y);
  }
};

// log m, m = β·p_t + (1−β)·p_s, from the log-probabilities: with a = log β + log p_t and
// b = log(1−β) + log p_s, log m = max(a, b) + log(1 + e^(−|a−b|)). The larger side contributes
// e^0 = 1 exactly (the same value as log(e^(a−m) + e^(b−m)), bit for bit), so only one
// exponential is formed, and the log's argument lies in [1, 2], where its absolute error is
// smallest. NaN passes through (|a − b| is NaN).
template <class T, class Math = StdExpLog>
XENT_HD T log_mixture(const DistillConstants<T>& c, T log_pt, T log_ps, Math math = {}) {
  const T a = c.log_beta + log_pt, b = c.log_one_minus_beta + log_ps;
  const T m = a > b ? a : b;
  if (m == -infinity<T>()) return m;
  return m + math.log(T(1) + math.exp(-(a > b ? a - b : b - a)));
}

// The jsd's u = (1−β)·(log p_s − log m) of the gradient p_s·(u − Σ p_s·u), shifted by the
// constant c0 = −(1−β)·log(1−β) that u takes wherever p_t = 0: (1−β)·(b − log m), b as above,
// with b − log m formed from |a − b| alone. The gradient does not change (Σ p_s = 1), but against
// a peaked teacher u ≈ c0 on almost every element, and u − Σ p_s·u was a difference of two values
// near c0 = 0.35 (β = ½): fp32 lost up to ~1e-5 relative against float64, the bound of
// docs/semantics.md §6. Measured from c0 the p_t = 0 elements give exactly 0 and the others small
// values.
template <class T, class Math = StdExpLog>
XENT_HD T jsd_shifted_u(const DistillConstants<T>& c, T log_pt, T log_ps, Math math = {}) {
  const T a = c.log_beta + log_pt, b = c.log_one_minus_beta + log_ps;
  const T gap = a > b ? a - b : b - a;
  const T student_share = (a > b ? -gap : T(0)) - math.log(T(1) + math.exp(-gap));  // b − log m
  return (T(1) - c.beta) * student_share;
}

// One element's terms from its log-probabilities and probabilities (log_p = v − lse, p = e^log_p),
// for a backend that forms the exponentials its own way (the GPU kernels use the ex2 unit);
// distill_term below is this with std::exp.
template <class T, class Math = StdExpLog>
XENT_HD DistillTerm<T> distill_term_from_probs(const DistillConstants<T>& c, T log_ps, T log_pt,
                                               T ps, T pt, Math math = {}) {
  switch (c.kind) {
    case DistillKindCode::forward_kl:
      return {weighted_log_ratio(pt, log_pt - log_ps), T(0)};
    case DistillKindCode::reverse_kl: {
      const T term = weighted_log_ratio(ps, log_ps - log_pt);
      return {term, term};
    }
    case DistillKindCode::jsd: {
      if (distill_is_degenerate(c)) return {T(0), T(0)};
      const T log_m = log_mixture(c, log_pt, log_ps, math);
      const T loss = c.beta * weighted_log_ratio(pt, log_pt - log_m) +
                     (T(1) - c.beta) * weighted_log_ratio(ps, log_ps - log_m);
      return {loss, weighted_log_ratio(ps, jsd_shifted_u(c, log_pt, log_ps, math))};
    }
    case DistillKindCode::soft_ce:
      return {-weighted_log_ratio(pt, log_ps), T(0)};
    case DistillKindCode::tvd: {
      const T diff = pt - ps;
      const T sign = ps > pt ? T(1) : (ps < pt ? T(-1) : T(0));
      return {T(0.5) * (diff < 0 ? -diff : diff), T(0.5) * sign * ps};
    }
  }
  return {T(0), T(0)};
}

// vs, vt: transformed student and teacher logits of one element; lse_s, lse_t of their rows.
template <class T>
XENT_HD DistillTerm<T> distill_term(const DistillConstants<T>& c, T lse_s, T lse_t, T vs, T vt) {
  const T log_ps = vs - lse_s, log_pt = vt - lse_t;
  return distill_term_from_probs(c, log_ps, log_pt, std::exp(log_ps), std::exp(log_pt));
}

// ∂(row loss)/∂vs for one element from its log-probabilities and probabilities, given Σ p_s·u of
// the row (unused by forward_kl and soft_ce). The caller multiplies by the row coefficient and by
// transform.slope(s) for ∂/∂s. distill_grad_element below is this with std::exp.
template <class T, class Math = StdExpLog>
XENT_HD T distill_grad_from_probs(const DistillConstants<T>& c, T log_ps, T log_pt, T ps, T pt,
                                  T sum_prob_u, Math math = {}) {
  switch (c.kind) {
    case DistillKindCode::forward_kl:
    case DistillKindCode::soft_ce:
      return ps - pt;
    case DistillKindCode::reverse_kl:
      return ps == T(0) ? T(0) : ps * (log_ps - log_pt - sum_prob_u);
    case DistillKindCode::jsd: {
      if (distill_is_degenerate(c) || ps == T(0)) return T(0);
      return ps * (jsd_shifted_u(c, log_pt, log_ps, math) - sum_prob_u);
    }
    case DistillKindCode::tvd: {
      const T u = T(0.5) * (ps > pt ? T(1) : (ps < pt ? T(-1) : T(0)));
      return ps * (u - sum_prob_u);
    }
  }
  return T(0);
}

template <class T>
XENT_HD T distill_grad_element(const DistillConstants<T>& c, T lse_s, T lse_t, T vs, T vt,
                               T sum_prob_u) {
  const T log_ps = vs - lse_s, log_pt = vt - lse_t;
  return distill_grad_from_probs(c, log_ps, log_pt, std::exp(log_ps), std::exp(log_pt), sum_prob_u);
}

// tvd gradient without cancellation (an alternative to distill_grad_element for kind tvd).
// There u_i − Σ_j p_s,j·u_j is a difference of two values near ±½ whenever most student mass lies
// on one side of p_t (a peaked teacher): a result near 1e-3 then carries float's rounding of ½
// and the common rounding of lse_s in every p_s (relative errors up to 1e-4 against float64).
// With the student mass summed per side, A = Σ_{p_s>p_t} p_s, B = Σ_{p_s<p_t} p_s,
// E = Σ_{p_s=p_t} p_s and P = A + B + E, the same quantity u_i − Σ p_s·u / P is
// (B + E/2)/P, −(A + E/2)/P or (B − A)/(2P) for u_i = ½, −½, 0: sums of like-signed terms whose
// common error cancels in the ratio. A is the accumulation type (wider than T where it is cheap).
template <class A>
struct TvdSums {
  A above = 0;
  A below = 0;
  A equal = 0;

  template <class T>
  XENT_HD void add(T lse_s, T lse_t, T vs, T vt) {
    add_probs(std::exp(vs - lse_s), std::exp(vt - lse_t));
  }

  // The same from the element's probabilities (formed by the caller).
  template <class T>
  XENT_HD void add_probs(T ps, T pt) {
    if (ps > pt) {
      above += ps;
    } else if (ps < pt) {
      below += ps;
    } else {
      equal += ps;  // also NaN, so a NaN row stays NaN
    }
  }
};

// The three quotients of tvd's gradient, one per side of p_t: u_i − Σ p_s·u / P for p_s > p_t,
// p_s < p_t and p_s = p_t. They depend on the row only, so a sweep divides three times per row
// instead of once per element (the same expressions, hence the same values).
template <class A>
struct TvdGradRow {
  A above = 0;
  A below = 0;
  A equal = 0;
};

template <class A>
XENT_HD TvdGradRow<A> tvd_grad_row(const TvdSums<A>& sums) {
  const A total = sums.above + sums.below + sums.equal;
  TvdGradRow<A> row;
  row.above = (sums.below + A(0.5) * sums.equal) / total;
  row.below = -(sums.above + A(0.5) * sums.equal) / total;
  row.equal = A(0.5) * (sums.below - sums.above) / total;
  return row;
}

// ∂(row loss)/∂vs of tvd for one element, from the row's quotients. NaN p_s takes the `equal`
// side and stays NaN.
template <class T, class A>
XENT_HD T tvd_grad_from_row(const TvdGradRow<A>& row, T ps, T pt) {
  if (ps == T(0)) return T(0);
  const A d = ps > pt ? row.above : (ps < pt ? row.below : row.equal);
  return ps * static_cast<T>(d);
}

// ∂(row loss)/∂vs of tvd for one element, from the row's TvdSums.
template <class T, class A>
XENT_HD T tvd_grad_from_probs(const TvdSums<A>& sums, T ps, T pt) {
  return tvd_grad_from_row(tvd_grad_row(sums), ps, pt);
}

template <class T, class A>
XENT_HD T tvd_grad_element(const TvdSums<A>& sums, T lse_s, T lse_t, T vs, T vt) {
  return tvd_grad_from_probs(sums, std::exp(vs - lse_s), std::exp(vt - lse_t));
}

}  // namespace xent::common
