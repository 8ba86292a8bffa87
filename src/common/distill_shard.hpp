// The records of vocabulary-parallel distillation (xent/distill_shard.hpp) and their merge across
// ranks, written once for both backends: the global lse of student and teacher from the slices'
// lse, the row's loss by the chain rule over slices (forward_kl, reverse_kl, soft_ce) or from the
// pass-2 sums (jsd, tvd), and the row constants of the gradient.
#pragma once

#include "common/ce_shard.hpp"
#include "common/distill_row.hpp"
#include "xent/distill_shard.hpp"

namespace xent::common {

// A slice's lse as RowStats (max = lse, Σ e^(v−max) = 1), so that slices merge with
// RowStats::merge: its handling of empty slices (−inf) and NaN is the row kernels' own.
template <class T>
XENT_HD RowStats<T> lse_stats(T lse, int64_t slice) {
  RowStats<T> stats;
  if (lse == -infinity<T>()) return stats;  // an empty (or fully masked) slice adds nothing
  stats.max = lse;
  stats.sum_exp = T(1);
  stats.argmax = slice;
  return stats;
}

// What a slice contributes to the row loss, given its log-masses log w_r (teacher) and log v_r
// (student) and its divergence between the renormalised distributions (xent/distill_shard.hpp):
// the chain rule of the divergence. A slice of zero weight adds 0, whatever its divergence
// (undefined when the slice holds no mass); NaN passes.
template <class T>
XENT_HD T distill_slice_term(DistillKindCode kind, T log_w, T log_v, T divergence) {
  switch (kind) {
    case DistillKindCode::forward_kl: {
      const T w = std::exp(log_w);
      return w == T(0) ? T(0) : w * (divergence + (log_w - log_v));
    }
    case DistillKindCode::reverse_kl: {
      const T v = std::exp(log_v);
      return v == T(0) ? T(0) : v * (divergence + (log_v - log_w));
    }
    case DistillKindCode::soft_ce: {
      const T w = std::exp(log_w);
      return w == T(0) ? T(0) : w * (divergence - log_v);
    }
    default:
      return T(0);  // jsd, tvd: from the pass-2 sums
  }
}

template <class T>
struct DistillShardRow {
  T lse_student = 0;
  T lse_teacher = 0;
  T soft = 0;        // d_n: the row's distillation loss
  T sum_prob_u = 0;  // Σ p_s·u of the gradient: reverse_kl's KL, jsd's merged sum
  TvdSums<T> tvd;    // tvd's per-side student mass
};

template <class T>
XENT_HD const T* distill_record(const T* gathered, int64_t rows, int64_t rank, int64_t row) {
  return gathered + (rank * rows + row) * kDistillShardStatsWidth;
}

// The global lse of student and teacher of row `row` from `ranks` gathered records (rank-major).
template <class T>
XENT_HD void merge_distill_lse(const T* gathered, int64_t rows, int64_t ranks, int64_t row,
                               T& lse_student, T& lse_teacher) {
  RowStats<T> student, teacher;
  for (int64_t p = 0; p < ranks; ++p) {
    const T* record = distill_record(gathered, rows, p, row);
    student.merge(lse_stats(record[kDistillShardLseStudent], p));
    teacher.merge(lse_stats(record[kDistillShardLseTeacher], p));
  }
  lse_student = student.lse();
  lse_teacher = teacher.lse();
}

// Row `row` merged in rank order (so every rank gets the same bits). `gathered_sums` [P·N,
// kDistillShardSumsWidth] is read for jsd and tvd only (may be null for the other kinds).
template <class T>
XENT_HD DistillShardRow<T> merge_distill_records(DistillKindCode kind, const T* gathered,
                                                 const T* gathered_sums, int64_t rows,
                                                 int64_t ranks, int64_t row) {
  DistillShardRow<T> m;
  merge_distill_lse(gathered, rows, ranks, row, m.lse_student, m.lse_teacher);
  const bool from_sums = kind == DistillKindCode::jsd || kind == DistillKindCode::tvd;
  for (int64_t p = 0; p < ranks; ++p) {
    if (from_sums) {
      if (gathered_sums == nullptr) continue;
      const T* sums = gathered_sums + (p * rows + row) * kDistillShardSumsWidth;
      m.soft += sums[kDistillSumLoss];
      m.sum_prob_u += sums[kDistillSumProbU];
      m.tvd.above += sums[kDistillSumAbove];
      m.tvd.below += sums[kDistillSumBelow];
      m.tvd.equal += sums[kDistillSumEqual];
    } else {
      const T* record = distill_record(gathered, rows, p, row);
      m.soft += distill_slice_term(kind, record[kDistillShardLseTeacher] - m.lse_teacher,
                                   record[kDistillShardLseStudent] - m.lse_student,
                                   record[kDistillShardDivergence]);
    }
  }
  if (kind == DistillKindCode::reverse_kl) m.sum_prob_u = m.soft;  // Σ p_s·(log p_s − log p_t)
  return m;
}

// The hard-label term's ce record of row `row`, merged (common/ce_shard.hpp).
template <class T>
XENT_HD ShardPartial<T> merge_distill_hard(const T* gathered, int64_t rows, int64_t ranks,
                                           int64_t row) {
  return merge_shard_records(gathered + kDistillShardHard, rows, ranks, row,
                             kDistillShardStatsWidth);
}

// The records `a` and `b` of two disjoint slices of one row folded into the record of their
// union, written to `out` (which may be `a`): so a pass over the vocabulary block by block keeps
// one record per row, not one per block (linear_distill's schedule (d), chunk_plan.hpp). The
// chain rule of distill_slice_term is associative (the union's divergence is Σ_r of the slices'
// terms relative to the union, and the union's own term relative to the whole row multiplies
// into them), so folding the slices one at a time and merging the result gives the divergence
// merge_distill_records forms from all of them at once, to rounding. `b` holds the later
// columns: an argmax tie keeps `a`'s (the lower column), as the row kernel does.
template <class T>
XENT_HD void fold_distill_record(DistillKindCode kind, const T* a, const T* b, T* out) {
  RowStats<T> student, teacher;
  student.merge(lse_stats(a[kDistillShardLseStudent], 0));
  student.merge(lse_stats(b[kDistillShardLseStudent], 1));
  teacher.merge(lse_stats(a[kDistillShardLseTeacher], 0));
  teacher.merge(lse_stats(b[kDistillShardLseTeacher], 1));
  const T lse_s = student.lse(), lse_t = teacher.lse();
  T divergence = 0;
  const T* parts[2] = {a, b};
  for (const T* part : parts) {
    if (part[kDistillShardLseTeacher] == -infinity<T>() &&
        part[kDistillShardLseStudent] == -infinity<T>()) {
      continue;  // an empty slice adds nothing (and −inf − −inf would be NaN)
    }
    divergence +=
        distill_slice_term(kind, part[kDistillShardLseTeacher] - lse_t,
                           part[kDistillShardLseStudent] - lse_s, part[kDistillShardDivergence]);
  }
  ShardPartial<T> hard = read_shard_record(a + kDistillShardHard);
  const ShardPartial<T> later = read_shard_record(b + kDistillShardHard);
  hard.stats.merge(later.stats);
  hard.target_logit += later.target_logit;
  hard.target_weight += later.target_weight;
  hard.class_weight_sum += later.class_weight_sum;
  out[kDistillShardLseStudent] = lse_s;
  out[kDistillShardLseTeacher] = lse_t;
  out[kDistillShardDivergence] = divergence;
  out[kDistillShardReserved] = 0;
  write_shard_record(out + kDistillShardHard, hard);
}

}  // namespace xent::common
