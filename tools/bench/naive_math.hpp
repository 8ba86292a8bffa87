// Element formulas of the naive form, straight from docs/semantics.md §1 and §3, in double precision so the
// naive result is a sharper reference than any fp32 kernel. Shared by the CPU loops and the CUDA
// row kernels of the naive form (host and device).
#pragma once

#include <cmath>

#include "common/numeric.hpp"

namespace xent::bench::naive {

struct CeParams {
  double smoothing = 0;   // ε
  double z_loss = 0;      // λ
  double softcap = 0;     // s, 0 = off
  double scale = 1;       // a
  double weight_sum = 0;  // W = Σ w_i (V unweighted)
  double vocab = 0;
};

XENT_HD double ce_transformed(const CeParams& p, double x) {
  const double z = p.scale * x;
  return p.softcap > 0 ? p.softcap * tanh(z / p.softcap) : z;
}

XENT_HD double ce_slope(const CeParams& p, double x) {
  if (!(p.softcap > 0)) return p.scale;
  const double t = tanh(p.scale * x / p.softcap);
  return p.scale * (1 - t * t);
}

// ℓ = (1−ε)·w_y·(lse − x̃_y) + (ε/V)·(W·lse − Σ w_i·x̃_i)
XENT_HD double ce_row_loss(const CeParams& p, double lse, double target_logit, double w_y,
                           double weighted_logit_sum) {
  return (1 - p.smoothing) * w_y * (lse - target_logit) +
         p.smoothing / p.vocab * (p.weight_sum * lse - weighted_logit_sum);
}

// ∂loss/∂x_i: coef multiplies the ℓ part (c_n), z_coef the ζ part.
XENT_HD double ce_gradient(const CeParams& p, double coef, double z_coef, double lse, double x,
                           bool is_target, double w_y, double w_i) {
  const double prob = exp(ce_transformed(p, x) - lse);
  const double d = coef * ((1 - p.smoothing) * w_y * (prob - (is_target ? 1.0 : 0.0)) +
                           p.smoothing / p.vocab * (p.weight_sum * prob - w_i)) +
                   z_coef * 2 * p.z_loss * lse * prob;
  return d * ce_slope(p, x);
}

// Distillation (kind codes follow xent::DistillKind: 0 forward_kl, 1 reverse_kl, 2 jsd, 3 soft_ce,
// 4 tvd). The loss of a row is Σ_i term; the gradient w.r.t. the transformed student logit is
// p_s − p_t (forward_kl, soft_ce) or p_s·(d_i − Σ_j p_s,j·d_j) with d = ∂loss/∂p_s up to a
// constant (reverse_kl, jsd, tvd).
struct DistillTerm {
  double loss;
  double d;
};

XENT_HD double xlog(double p, double log_ratio) { return p == 0 ? 0.0 : p * log_ratio; }

XENT_HD DistillTerm distill_term(int kind, double beta, double log_ps, double log_pt) {
  const double ps = exp(log_ps), pt = exp(log_pt);
  switch (kind) {
    case 0:
      return {xlog(pt, log_pt - log_ps), 0};
    case 1:
      return {xlog(ps, log_ps - log_pt), log_ps - log_pt};
    case 2: {
      if (beta == 0 || beta == 1) return {0, 0};
      const double log_m = log(beta * pt + (1 - beta) * ps);
      return {beta * xlog(pt, log_pt - log_m) + (1 - beta) * xlog(ps, log_ps - log_m),
              (1 - beta) * (log_ps - log_m)};
    }
    case 3:
      return {-xlog(pt, log_ps), 0};
    default:
      return {0.5 * fabs(pt - ps), ps > pt ? 0.5 : (ps < pt ? -0.5 : 0.0)};
  }
}

XENT_HD double distill_dlogit(int kind, double beta, double log_ps, double log_pt, double sum_pd) {
  const double ps = exp(log_ps), pt = exp(log_pt);
  if (kind == 0 || kind == 3) return ps - pt;
  if (ps == 0) return 0;
  return ps * (distill_term(kind, beta, log_ps, log_pt).d - sum_pd);
}

XENT_HD double distill_transformed(double softcap, double x) {
  return softcap > 0 ? softcap * tanh(x / softcap) : x;
}

XENT_HD double distill_slope(double softcap, double x) {
  if (!(softcap > 0)) return 1;
  const double t = tanh(x / softcap);
  return 1 - t * t;
}

}  // namespace xent::bench::naive
