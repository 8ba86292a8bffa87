// The per-row math of cross-entropy (docs/semantics.md §1), written once for both backends. A backend
// streams a row's elements through RowStats (online, mergeable across threads and blocks), turns
// the finished statistics into the loss with ce_row_loss, and forms each gradient element with
// ce_grad_element. T is the compute type: float for fp32/bf16/fp16 inputs, double for fp64.
#pragma once

#include "common/numeric.hpp"

namespace xent::common {

// The logit transform x -> x̃ = softcap(a·x) and its slope dx̃/dx for the chain rule.
template <class T>
struct Transform {
  T scale = 1;    // a
  T softcap = 0;  // s; 0 means off

  XENT_HD T value(T x) const {
    const T z = x * scale;
    return softcap > 0 ? softcap * std::tanh(z / softcap) : z;
  }
  XENT_HD T slope(T x) const {
    if (!(softcap > 0)) return scale;
    const T t = std::tanh(x * scale / softcap);
    return scale * (T(1) - t * t);
  }
};

// Whether (other, other_index) takes over from (value, index) as a row's argmax when two parts
// of the row are merged: the first NaN, else the larger, else the lower index (torch.argmax's
// order, whatever the order of merging); an index below 0 holds nothing.
template <class T, class I>
XENT_HD bool argmax_wins(T other, I other_index, T value, I index) {
  const bool nan = value != value, other_nan = other != other;
  return other_index >= 0 && (index < 0 || (other_nan && (!nan || other_index < index)) ||
                              (!nan && (other > value || (other == value && other_index < index))));
}

// Online statistics of one row of transformed logits v_i = x̃_i. sum_exp and sum_exp_shift are
// kept relative to the running max m: S = Σ e^(v−m), P = Σ e^(v−m)·(v−m). Keeping P in shifted
// form avoids the cancellation of lse − Σ p·v when the entropy is small next to lse.
template <class T>
struct RowStats {
  T max = -infinity<T>();
  T sum_exp = 0;
  T sum_exp_shift = 0;
  T sum_logits = 0;           // Σ v_i          (label smoothing, unweighted)
  T sum_weighted_logits = 0;  // Σ w_i·v_i      (label smoothing with class weights)
  int64_t argmax = -1;        // first index of the maximum

  // Adds element `index` with transformed value v and class weight w (1 when unweighted).
  XENT_HD void add(T v, int64_t index, T w) {
    sum_logits += v;
    sum_weighted_logits += w * v;
    if (v > max || argmax < 0) {
      if (sum_exp > 0) {
        const T shift = max - v;  // < 0
        const T alpha = std::exp(shift);
        sum_exp_shift = alpha * (sum_exp_shift + shift * sum_exp);
        sum_exp *= alpha;
      }
      max = v;
      argmax = index;
    } else if (v != v) {
      if (argmax < 0 || max == max) argmax = index;  // the first NaN wins, as in torch.argmax
      max = v;
    }
    if (v == -infinity<T>()) return;  // a masked logit adds e^-inf = 0; v − m would be NaN
    const T d = v - max;
    const T e = std::exp(d);
    sum_exp += e;
    sum_exp_shift += e * d;
  }

  // Combines statistics of two disjoint parts of a row (any order; ties keep the lower index).
  XENT_HD void merge(const RowStats& other) {
    sum_logits += other.sum_logits;
    sum_weighted_logits += other.sum_weighted_logits;
    const bool self_nan = max != max, other_nan = other.max != other.max;
    const bool other_wins = argmax_wins(other.max, other.argmax, max, argmax);
    if (other.sum_exp == 0 && !other_nan) {
      // nothing to add
    } else if (sum_exp == 0 && !self_nan) {
      sum_exp = other.sum_exp;
      sum_exp_shift = other.sum_exp_shift;
    } else {
      const T m = other.max > max ? other.max : max;
      const T shift_self = max - m, shift_other = other.max - m;
      const T alpha = std::exp(shift_self), beta = std::exp(shift_other);
      sum_exp_shift = alpha * (sum_exp_shift + shift_self * sum_exp) +
                      beta * (other.sum_exp_shift + shift_other * other.sum_exp);
      sum_exp = alpha * sum_exp + beta * other.sum_exp;
    }
    if (other_wins) {
      argmax = other.argmax;
      max = other.max;
    } else if (other.max > max) {
      max = other.max;
    }
  }

  XENT_HD T lse() const { return max + std::log(sum_exp); }
  XENT_HD T entropy() const { return std::log(sum_exp) - sum_exp_shift / sum_exp; }
};

// What a row outside the loss (target == ignore_index) reports on every backend (docs/semantics.md §1): no
// loss and no statistics. Its entropy is 0 like its lse and logprob, not the entropy of its
// logits: an ignored row is padding or a prompt token, whose distribution nobody asked about, and
// a 0 lets `entropy.sum() / n_valid` average over the valid tokens as it does for logprob. It
// also spares backends a pass over the row.
template <class T>
struct IgnoredRow {
  static constexpr T loss = 0, lse = 0, logprob = 0, entropy = 0;
  static constexpr int64_t argmax = -1;
};

// Row-independent constants of a call.
template <class T>
struct CeConstants {
  Transform<T> transform;
  T smoothing = 0;         // ε
  T z_loss = 0;            // λ
  T vocab = 0;             // V
  T class_weight_sum = 0;  // W = Σ w_i (V when unweighted)
  bool weighted = false;
};

template <class T>
struct CeRowLoss {
  T loss;    // ℓ (not multiplied by the row weight)
  T z_loss;  // ζ = λ·lse²
};

// ℓ = (1−ε)·w_y·(lse − x̃_y) + (ε/V)·Σ_i w_i·(lse − x̃_i), with w ≡ 1 when unweighted.
template <class T>
XENT_HD CeRowLoss<T> ce_row_loss(const CeConstants<T>& c, const RowStats<T>& stats, T lse,
                                 T target_logit, T target_weight) {
  T loss = (T(1) - c.smoothing) * target_weight * (lse - target_logit);
  if (c.smoothing > 0) {
    const T weighted_sum = c.weighted ? stats.sum_weighted_logits : stats.sum_logits;
    loss += (c.smoothing / c.vocab) * (c.class_weight_sum * lse - weighted_sum);
  }
  return {loss, c.z_loss * lse * lse};
}

// Per-row gradient coefficients. `coef` is c_n of docs/semantics.md §1 (g·r_n/D, g·r_n or g_n·r_n) and
// `z_coef` the same with N_valid in place of D.
template <class T>
struct CeGradRow {
  T lse;
  T target_coef;     // a = c·(1−ε)·w_y
  T smoothing_coef;  // b = c·ε/V
  T prob_coef;       // a + b·W + 2λ·lse·c_z: multiplies p_i
  int64_t target;
};

template <class T>
XENT_HD CeGradRow<T> ce_grad_row(const CeConstants<T>& c, T lse, int64_t target, T target_weight,
                                 T coef, T z_coef) {
  CeGradRow<T> row;
  row.lse = lse;
  row.target = target;
  row.target_coef = coef * (T(1) - c.smoothing) * target_weight;
  row.smoothing_coef = coef * c.smoothing / c.vocab;
  row.prob_coef =
      row.target_coef + row.smoothing_coef * c.class_weight_sum + T(2) * c.z_loss * lse * z_coef;
  return row;
}

// ∂loss/∂x_i from p_i = exp(x̃_i − lse) and the slope dx̃_i/dx_i, for a backend that forms p its
// own way (the GPU kernels use the ex2 unit); ce_grad_element below is this with std::exp. The
// target term is subtracted in T before any rounding, so p_y − 1 keeps its precision when
// p_y → 1 (docs/semantics.md §1).
template <class T>
XENT_HD T ce_grad_before_slope(const CeGradRow<T>& row, T p, bool is_target, T class_weight) {
  T g = row.prob_coef * p - row.smoothing_coef * class_weight;
  if (is_target) g -= row.target_coef;
  return g;
}

template <class T>
XENT_HD T ce_grad_from_prob(const CeGradRow<T>& row, T p, T slope, bool is_target, T class_weight) {
  return ce_grad_before_slope(row, p, is_target, class_weight) * slope;
}

// The entropy term of a row (semantics §1, differentiable log-probability and entropy): the
// upstream gradient g_H of H = lse − S and S = Σ_j p_j·x̃_j, which the backward takes as lse − H
// from the forward's statistics instead of a second pass over the row.
template <class T>
struct EntropyGradRow {
  T coef = 0;        // g_H
  T mean_logit = 0;  // S
};

template <class T>
XENT_HD EntropyGradRow<T> entropy_grad_row(T grad_entropy, T lse, T entropy) {
  return {grad_entropy, lse - entropy};
}

// ce_grad_from_prob plus g_H·∂H/∂x̃_i = −g_H·p_i·(x̃_i − S), both before the slope, so one pass
// over the row forms the gradient of the loss and of the entropy. `value` is x̃_i.
template <class T>
XENT_HD T ce_entropy_grad_from_prob(const CeGradRow<T>& row, const EntropyGradRow<T>& entropy, T p,
                                    T value, T slope, bool is_target, T class_weight) {
  const T g = ce_grad_before_slope(row, p, is_target, class_weight) -
              entropy.coef * p * (value - entropy.mean_logit);
  return g * slope;
}

// ∂loss/∂x_i for element i with raw logit x and class weight w_i.
template <class T>
XENT_HD T ce_grad_element(const CeConstants<T>& c, const CeGradRow<T>& row, T x, int64_t index,
                          T class_weight) {
  const T v = c.transform.value(x);
  const T p = std::exp(v - row.lse);
  return ce_grad_from_prob(row, p, c.transform.slope(x), index == row.target, class_weight);
}

// ce_grad_element with the entropy term.
template <class T>
XENT_HD T ce_entropy_grad_element(const CeConstants<T>& c, const CeGradRow<T>& row,
                                  const EntropyGradRow<T>& entropy, T x, int64_t index,
                                  T class_weight) {
  const T v = c.transform.value(x);
  const T p = std::exp(v - row.lse);
  return ce_entropy_grad_from_prob(row, entropy, p, v, c.transform.slope(x), index == row.target,
                                   class_weight);
}

}  // namespace xent::common
