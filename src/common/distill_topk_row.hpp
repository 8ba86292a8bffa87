// The per-row math of distillation from a top-k teacher (docs/semantics.md §3.1), written once
// for both backends. The loss compares two distributions over a few categories: the row's present
// ids (and, for `tail`, one category for everything else). Each category c has a student value
// a_c (a_j = s̃_id_j; a_tail = logsumexp of s̃ outside the ids) and the student's category
// log-probability is a_c − Z, Z = logsumexp of the a_c (for `ignore`, the logsumexp of the whole
// row with the tail category weighted 0 by the teacher). The §3 terms of distill_row.hpp then
// give the loss and ∂loss/∂a_c, which reach the columns as ∂a_j/∂s̃_id_j = 1 and
// ∂a_tail/∂s̃_i = e^(s̃_i − a_tail) outside the ids.
#pragma once

#include "common/distill_row.hpp"

namespace xent::common {

enum class TopKMassCode : int { renormalize = 0, tail = 1, ignore = 2 };

// The teacher's side of one row, from its present log-probabilities ℓ_j (already checked <= 0).
template <class T>
struct TopKTeacherRow {
  T shift = 0;  // renormalize: log q̂_j = ℓ_j / T − shift; else log q_j = ℓ_j
  T log_tail = -infinity<T>();  // log q_tail (tail); −inf for the others
};

// For renormalize: shift = logsumexp_j(ℓ_j / T). For tail: q_tail = max(0, 1 − Σ q_j), formed
// as −expm1(logsumexp ℓ) so that a small tail keeps its digits.
template <class T, class Logprob>
XENT_HD TopKTeacherRow<T> topk_teacher_row(TopKMassCode mass, T inv_temperature, int64_t count,
                                           Logprob&& logprob) {
  TopKTeacherRow<T> row;
  if (mass == TopKMassCode::ignore) return row;
  const T scale = mass == TopKMassCode::renormalize ? inv_temperature : T(1);
  T m = -infinity<T>();
  for (int64_t j = 0; j < count; ++j) {
    const T v = logprob(j) * scale;
    if (v > m || v != v) m = v;
  }
  T sum = 0;
  if (m > -infinity<T>()) {
    for (int64_t j = 0; j < count; ++j) sum += std::exp(logprob(j) * scale - m);
  }
  const T lse = m > -infinity<T>() ? m + std::log(sum) : m;
  if (mass == TopKMassCode::renormalize) {
    row.shift = lse;
  } else {
    const T rest = -std::expm1(lse);
    row.log_tail = rest > T(0) ? std::log(rest) : (rest != rest ? rest : -infinity<T>());
  }
  return row;
}

// ∂loss/∂a_c of one category from its student and teacher log-probabilities, given the row's
// Σ p·u (kinds of distill_needs_sum_pu) and the teacher's total weight W over the categories.
// forward_kl and soft_ce use W·p_s − p_t: the §3 form p_s − p_t assumes W = 1, which `ignore`
// (W = Σ_S q) and rounding of `tail` (Σ_S q > 1) do not give.
template <class T>
XENT_HD T topk_category_grad(const DistillConstants<T>& c, T log_ps, T log_pt, T sum_prob_u,
                             T teacher_weight) {
  const T ps = std::exp(log_ps), pt = std::exp(log_pt);
  if (c.kind == DistillKindCode::forward_kl || c.kind == DistillKindCode::soft_ce) {
    return teacher_weight * ps - pt;
  }
  return distill_grad_from_probs(c, log_ps, log_pt, ps, pt, sum_prob_u);
}

}  // namespace xent::common
