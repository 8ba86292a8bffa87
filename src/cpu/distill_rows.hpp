// Distillation of one row on the CPU (docs/semantics.md §3), with the optional hard-label CE term on the
// student: used by distill on logits and by the chunks of linear_distill.
#pragma once

#include <cstdint>
#include <vector>

#include "common/distill_row.hpp"
#include "cpu/ce_rows.hpp"
#include "xent/distill.hpp"

namespace xent::cpu {

template <class T>
struct DistillCall {
  common::DistillConstants<T> constants;
  int64_t vocab = 0;
  T soft_weight = 1;  // σ
  T hard_weight = 0;  // α
  // σ/N_valid for mean, σ otherwise (0 when no row is valid): turns g into the row coefficient.
  T soft_factor = 1;
  double soft_divisor = 1;  // N_valid for mean, 1 otherwise
  CeCall<T> hard;           // the §1 call of the hard-label term (used when α != 0)
};

template <class T>
DistillCall<T> make_distill_call(const DistillOptions& options, int64_t vocab,
                                 const ValidCounts& counts) {
  DistillCall<T> call;
  call.constants = common::make_distill_constants<T>(
      static_cast<common::DistillKindCode>(options.kind), static_cast<T>(options.temperature),
      options.softcap ? static_cast<T>(*options.softcap) : T(0), static_cast<T>(options.beta));
  call.vocab = vocab;
  call.soft_weight = static_cast<T>(options.soft_weight);
  call.hard_weight = static_cast<T>(options.hard_weight);
  call.soft_factor = call.soft_weight;
  if (options.ce.reduction == Reduction::mean) {
    call.soft_divisor = static_cast<double>(counts.valid_rows);
    call.soft_factor =
        counts.valid_rows > 0 ? static_cast<T>(options.soft_weight / counts.valid_rows) : T(0);
  }
  call.hard = make_ce_call<T>(options.ce, vocab, counts);
  return call;
}

template <class T>
struct DistillRowResult {
  T soft = 0;  // d_n, the distillation loss of the row (not weighted by σ)
  T hard = 0;  // r_n·(ℓ_n + ζ_n) of the hard term (not weighted by α)
  T hard_loss = 0;
  T hard_z_loss = 0;
};

// The hard-label term of one valid row (α·CE at T = 1 with its own options): its losses, and
// when `want_grad` the row constants of its gradient, which element() adds per column.
template <class T>
struct DistillHardTerm {
  DistillRowResult<T> result;
  bool active = false;  // α != 0, a target, and a gradient wanted
  const DistillCall<T>* call = nullptr;
  common::CeGradRow<T> row{};

  T element(T x, int64_t i) const {
    const T w = call->hard.class_weight ? static_cast<T>(call->hard.class_weight[i]) : T(1);
    return common::ce_grad_element(call->hard.constants, row, x, i, w);
  }
};

template <class T, class S>
DistillHardTerm<T> distill_hard_term(const DistillCall<T>& call, const S* s, int64_t target,
                                     bool has_target, int64_t row, T upstream, bool want_grad) {
  DistillHardTerm<T> term;
  term.call = &call;
  if (call.hard_weight == T(0) || !has_target) return term;
  const auto hard = ce_process_row<T, S, S>(call.hard, s, target, row, CeRowRequest{}, T(0),
                                            static_cast<S*>(nullptr));
  term.result.hard_loss = hard.loss;
  term.result.hard_z_loss = hard.z_loss;
  term.result.hard = hard.loss + hard.z_loss;
  if (!want_grad) return term;
  const T r = call.hard.row_weight ? static_cast<T>(call.hard.row_weight[row]) : T(1);
  const T target_weight =
      call.hard.class_weight ? static_cast<T>(call.hard.class_weight[target]) : T(1);
  const T coef = call.hard_weight * upstream * r;
  term.row = common::ce_grad_row(call.hard.constants, hard.lse, target, target_weight,
                                 coef * call.hard.loss_factor, coef * call.hard.z_factor);
  term.active = true;
  return term;
}

// One row of student s and teacher t (storage types S and U). When `grad` is present the
// gradient with respect to s, scaled by `upstream` (g or g_n), is written there; it may alias s.
template <class T, class S, class U, class G>
DistillRowResult<T> distill_process_row(const DistillCall<T>& call, const S* s, const U* t,
                                        int64_t target, bool has_target, int64_t row, T upstream,
                                        G* grad, bool want_loss) {
  DistillRowResult<T> result;
  const int64_t vocab = call.vocab;
  if (has_target && target == call.hard.ignore_index) {
    if (grad) zero_row(grad, vocab);
    return result;
  }
  const auto& c = call.constants;
  const auto& transform = c.transform;
  const T lse_s = blocked_row_stats<T>(vocab, [&](common::RowStats<T>& stats, int64_t i) {
                    stats.add(transform.value(to_compute<T>(s[i])), i, T(1));
                  }).lse();
  const T lse_t = blocked_row_stats<T>(vocab, [&](common::RowStats<T>& stats, int64_t i) {
                    stats.add(transform.value(to_compute<T>(t[i])), i, T(1));
                  }).lse();

  // Row sums in double: Σ p_s·u is subtracted from each u_i in the gradient, where it nearly
  // cancels for peaked rows (jsd, tvd), so its own rounding must stay far below the result's.
  // tvd's gradient uses the per-side sums of common::TvdSums instead of Σ p_s·u (see there).
  const bool tvd = c.kind == common::DistillKindCode::tvd;
  common::TvdSums<double> tvd_sums;
  T sum_prob_u = 0;
  if (want_loss || common::distill_needs_sum_pu(c.kind)) {
    double loss = 0, prob_u = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const T vs = transform.value(to_compute<T>(s[i])), vt = transform.value(to_compute<T>(t[i]));
      const auto term = common::distill_term(c, lse_s, lse_t, vs, vt);
      loss += term.loss;
      prob_u += term.prob_u;
      if (tvd) tvd_sums.add(lse_s, lse_t, vs, vt);
    }
    result.soft = static_cast<T>(loss);
    sum_prob_u = static_cast<T>(prob_u);
  }

  const auto hard = distill_hard_term(call, s, target, has_target, row, upstream, grad != nullptr);
  result.hard = hard.result.hard;
  result.hard_loss = hard.result.hard_loss;
  result.hard_z_loss = hard.result.hard_z_loss;

  if (grad) {
    const T soft_coef = upstream * call.soft_factor;
    for (int64_t i = 0; i < vocab; ++i) {
      const T x = to_compute<T>(s[i]);
      const T vs = transform.value(x), vt = transform.value(to_compute<T>(t[i]));
      const T row_grad = tvd ? common::tvd_grad_element(tvd_sums, lse_s, lse_t, vs, vt)
                             : common::distill_grad_element(c, lse_s, lse_t, vs, vt, sum_prob_u);
      T g = soft_coef * row_grad * transform.slope(x);
      if (hard.active) g += hard.element(x, i);
      grad[i] = from_compute<G>(g);
    }
  }
  return result;
}

// The `none` loss of one row: σ·d_n + α·r_n·(ℓ_n + ζ_n). A term whose weight is 0 is left out,
// so that a NaN it cannot influence does not appear.
template <class T>
double distill_row_loss(const DistillCall<T>& call, const DistillRowResult<T>& r) {
  double value = 0;
  if (call.soft_weight != T(0)) value += static_cast<double>(call.soft_weight) * r.soft;
  if (call.hard_weight != T(0)) value += static_cast<double>(call.hard_weight) * r.hard;
  return value;
}

// The reduced loss σ·reduce(d) + α·CE, from per-row values, summed in row order.
template <class T>
double reduce_distill_loss(const DistillCall<T>& call, Reduction reduction,
                           const std::vector<T>& soft, const std::vector<T>& hard_loss,
                           const std::vector<T>& hard_z) {
  double soft_sum = 0;
  for (const T v : soft) soft_sum += v;
  double total = 0;
  if (call.soft_weight != T(0)) {
    const double reduced = reduction == Reduction::mean
                               ? (call.soft_divisor > 0 ? soft_sum / call.soft_divisor : 0.0)
                               : soft_sum;
    total += static_cast<double>(call.soft_weight) * reduced;
  }
  if (call.hard_weight != T(0)) {
    total += static_cast<double>(call.hard_weight) * reduce_ce_loss(call.hard, hard_loss, hard_z);
  }
  return total;
}

// The state of one distillation op over its rows: the call, the upstream gradient of each row,
// and the per-row results kept for the reduction in row order.
template <class T>
struct DistillRows {
  DistillCall<T> call;
  Reduction reduction = Reduction::mean;
  TensorView grad_output, loss;
  T scalar = 1;
  std::vector<T> soft, hard_loss, hard_z;

  T upstream(int64_t n) const {
    return reduction == Reduction::none && grad_output.present() ? read_scalar<T>(grad_output, n)
                                                                 : scalar;
  }
  void finish_row(int64_t n, const DistillRowResult<T>& r) {
    soft[n] = r.soft;
    hard_loss[n] = r.hard_loss;
    hard_z[n] = r.hard_z_loss;
    if (loss.present() && reduction == Reduction::none)
      write_result(loss, n, distill_row_loss(call, r));
  }
  void finish() {
    if (loss.present() && reduction != Reduction::none)
      write_result(loss, 0, reduce_distill_loss(call, reduction, soft, hard_loss, hard_z));
  }
};

template <class T>
DistillRows<T> make_distill_rows(const DistillOptions& options, TensorView target, int64_t rows,
                                 int64_t vocab, TensorView loss, TensorView grad_output) {
  DistillRows<T> d;
  d.reduction = options.ce.reduction;
  const auto counts =
      count_valid_rows(target, rows, options.ce.ignore_index, options.ce.class_weight);
  d.call = make_distill_call<T>(options, vocab, counts);
  d.grad_output = grad_output;
  d.loss = loss;
  d.scalar = grad_output.present() && d.reduction != Reduction::none
                 ? read_scalar<T>(grad_output, 0)
                 : T(1);
  d.soft.assign(rows, T(0));
  d.hard_loss.assign(rows, T(0));
  d.hard_z.assign(rows, T(0));
  return d;
}

}  // namespace xent::cpu
