// Distillation from a top-k teacher, CPU backend (docs/semantics.md §3.1): rows in parallel, the
// category math of common/distill_topk_row.hpp, per-row losses reduced afterwards in row order.
#include <cmath>
#include <vector>

#include "api/backend.hpp"
#include "api/topk_access.hpp"
#include "common/distill_topk_row.hpp"
#include "cpu/distill_rows.hpp"

namespace xent::cpu {
namespace {

// One row's categories: the present ids with their student values a_j and teacher
// log-probabilities, then (tail, ignore) the tail category.
template <class T>
struct TopKRow {
  std::vector<int64_t> ids;
  std::vector<T> log_ps, log_pt;
  T a_tail = -common::infinity<T>();
  T teacher_weight = 0;  // W = Σ_c p_t,c
};

template <class T, class S>
TopKRow<T> topk_row(const DistillCall<T>& call, common::TopKMassCode mass, const S* s,
                    const TopKTeacher& teacher, int64_t n, std::vector<int64_t>& column_entry) {
  const auto& transform = call.constants.transform;
  const int64_t vocab = call.vocab, k = teacher.ids.cols;
  TopKRow<T> row;
  std::vector<T> logprob;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t id = api::topk_id(teacher.ids, n, j);
    if (id < 0) continue;
    column_entry[id] = static_cast<int64_t>(row.ids.size());
    row.ids.push_back(id);
    row.log_ps.push_back(transform.value(to_compute<T>(s[id])));
    logprob.push_back(static_cast<T>(api::topk_logprob(teacher.logprobs, n, j)));
  }
  const auto present = static_cast<int64_t>(row.ids.size());
  const auto t_row = common::topk_teacher_row<T>(mass, transform.inv_temperature, present,
                                                 [&](int64_t j) { return logprob[j]; });
  const bool renormalize = mass == common::TopKMassCode::renormalize;
  for (int64_t j = 0; j < present; ++j) {
    row.log_pt.push_back(renormalize ? logprob[j] * transform.inv_temperature - t_row.shift
                                     : logprob[j]);
  }
  // The student's normaliser: over the ids (renormalize) or the whole row, and a_tail.
  T z;
  if (renormalize) {
    z = blocked_row_stats<T>(present, [&](common::RowStats<T>& st, int64_t j) {
          st.add(row.log_ps[j], j, T(1));
        }).lse();
  } else {
    z = blocked_row_stats<T>(vocab, [&](common::RowStats<T>& st, int64_t i) {
          st.add(transform.value(to_compute<T>(s[i])), i, T(1));
        }).lse();
    // Σ outside the ids is summed on its own, never as 1 − Σ_S p_s (docs/semantics.md §3.1).
    row.a_tail = blocked_row_stats<T>(vocab, [&](common::RowStats<T>& st, int64_t i) {
                   st.add(column_entry[i] >= 0 ? -common::infinity<T>()
                                               : transform.value(to_compute<T>(s[i])),
                          i, T(1));
                 }).lse();
  }
  if (present == 0 && renormalize) z = 0;  // no category: loss and gradient 0
  for (T& v : row.log_ps) v -= z;
  // Ids covering the row leave no tail category: its teacher mass 1 − Σ q could only be rounding
  // against a student mass of exactly 0 (docs/semantics.md §3.1).
  if (!renormalize && present < vocab) {
    row.log_ps.push_back(row.a_tail - z);
    row.log_pt.push_back(t_row.log_tail);
  }
  for (const T l : row.log_pt) row.teacher_weight += std::exp(l);
  return row;
}

template <class S>
void distill_topk_typed(TensorView student, const TopKTeacher& teacher, TensorView target,
                        const DistillOptions& options, TensorView loss, TensorView grad,
                        TensorView grad_output) {
  using T = ComputeType<S>;
  const int64_t rows = student.rows, vocab = student.cols;
  auto d = make_distill_rows<T>(options, target, rows, vocab, loss, grad_output);
  const auto& call = d.call;
  const auto mass = static_cast<common::TopKMassCode>(teacher.mass);
  const auto& c = call.constants;
  const bool has_target = target.present();
#pragma omp parallel for schedule(static) if (2 * rows * vocab >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    const T upstream = d.upstream(n);
    const S* s = row_pointer<const S>(student, n);
    S* g = grad.present() ? row_pointer<S>(grad, n) : nullptr;
    const int64_t y = has_target ? read_target(target, n) : 0;
    DistillRowResult<T> r;
    if (has_target && y == options.ce.ignore_index) {
      if (g) zero_row(g, vocab);
    } else {
      std::vector<int64_t> column_entry(static_cast<std::size_t>(vocab), -1);
      const TopKRow<T> row = topk_row(call, mass, s, teacher, n, column_entry);
      const auto categories = static_cast<int64_t>(row.log_ps.size());
      // Row sums in double, as in distill_process_row.
      double row_loss = 0, prob_u = 0;
      for (int64_t j = 0; j < categories; ++j) {
        const T lp = row.log_ps[j], lt = row.log_pt[j];
        const auto term = common::distill_term_from_probs(c, lp, lt, std::exp(lp), std::exp(lt));
        row_loss += term.loss;
        prob_u += term.prob_u;
      }
      r.soft = static_cast<T>(row_loss);
      const auto hard = distill_hard_term(call, s, y, has_target, n, upstream, g != nullptr);
      r.hard = hard.result.hard;
      r.hard_loss = hard.result.hard_loss;
      r.hard_z_loss = hard.result.hard_z_loss;
      if (g) {
        std::vector<T> category_grad(static_cast<std::size_t>(categories));
        for (int64_t j = 0; j < categories; ++j) {
          category_grad[j] = common::topk_category_grad(c, row.log_ps[j], row.log_pt[j],
                                                        static_cast<T>(prob_u), row.teacher_weight);
        }
        const auto present = static_cast<int64_t>(row.ids.size());
        const bool spread_tail = categories > present && row.a_tail > -common::infinity<T>();
        const T soft_coef = upstream * call.soft_factor;
        for (int64_t i = 0; i < vocab; ++i) {
          const T x = to_compute<T>(s[i]);
          const int64_t j = column_entry[i];
          T d = 0;
          if (j >= 0) {
            d = category_grad[j];
          } else if (spread_tail) {
            d = category_grad[present] * std::exp(c.transform.value(x) - row.a_tail);
          }
          T value = soft_coef * d * c.transform.slope(x);
          if (hard.active) value += hard.element(x, i);
          g[i] = from_compute<S>(value);
        }
      }
    }
    d.finish_row(n, r);
  }
  d.finish();
}

}  // namespace

void distill_topk(TensorView student, const TopKTeacher& teacher, TensorView target,
                  const DistillOptions& options, TensorView loss, TensorView grad,
                  TensorView grad_output) {
  dispatch_float(student.dtype, [&](auto storage) {
    distill_topk_typed<decltype(storage)>(student, teacher, target, options, loss, grad,
                                          grad_output);
  });
}

}  // namespace xent::cpu
