// Vocabulary-parallel distillation, CPU backend (xent/distill_shard.hpp): the records of a slice
// (its lse, its local divergence, the hard term's ce record), the pass-2 sums of jsd and tvd, and
// the loss and gradient from the merged records (common/distill_shard.hpp). Rows in parallel;
// reductions in row order.
#include <algorithm>
#include <vector>

#include "api/shard_backend.hpp"
#include "common/distill_shard.hpp"
#include "cpu/distill_rows.hpp"
#include "cpu/shard_rows.hpp"

namespace xent::cpu {
namespace {

using common::DistillKindCode;

template <class T>
const T* records_of(TensorView view) {
  return view.present() ? static_cast<const T*>(view.data) : nullptr;
}

bool row_is_valid(TensorView target, int64_t row, int64_t ignore_index) {
  return !target.present() || read_target(target, row) != ignore_index;
}

template <class T>
common::DistillConstants<T> distill_constants(const DistillOptions& options) {
  return common::make_distill_constants<T>(
      static_cast<DistillKindCode>(options.kind), static_cast<T>(options.temperature),
      options.softcap ? static_cast<T>(*options.softcap) : T(0), static_cast<T>(options.beta));
}

template <class T, class S>
T slice_lse(const common::DistillTransform<T>& transform, const S* x, int64_t columns) {
  return blocked_row_stats<T>(columns,
                              [&](common::RowStats<T>& stats, int64_t i) {
                                stats.add(transform.value(to_compute<T>(x[i])), i, T(1));
                              })
      .lse();
}

bool with_hard_term(const DistillOptions& options, TensorView target) {
  return options.hard_weight != 0.0 && target.present();
}

// ---- pass 1 ---------------------------------------------------------------------------------------

template <class S>
void stats_typed(TensorView student, TensorView teacher, TensorView target, VocabShard shard,
                 const DistillOptions& options, TensorView partial) {
  using T = ComputeType<S>;
  const int64_t rows = student.rows, local = student.cols;
  const auto c = distill_constants<T>(options);
  const bool separable = !distill_shard_needs_sums(options.kind);
  const bool with_hard = with_hard_term(options, target);
  const CeCall<T> hard = make_ce_call<T>(options.ce, local, ValidCounts{});
  T* out = static_cast<T*>(partial.data);

#pragma omp parallel for schedule(static) if (2 * rows * local >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    T* record = out + n * kDistillShardStatsWidth;
    std::fill(record, record + kDistillShardStatsWidth, T(0));
    const S* s = row_pointer<const S>(student, n);
    // The hard term's record on every row: W travels in it, whatever the row's target.
    if (with_hard) {
      common::write_shard_record(record + kDistillShardHard,
                                 ce_shard_row_record(hard, s, read_target(target, n),
                                                     options.ce.ignore_index, shard.offset));
    }
    if (!row_is_valid(target, n, options.ce.ignore_index)) continue;
    const S* t = row_pointer<const S>(teacher, n);
    const T lse_s = slice_lse(c.transform, s, local), lse_t = slice_lse(c.transform, t, local);
    record[kDistillShardLseStudent] = lse_s;
    record[kDistillShardLseTeacher] = lse_t;
    if (separable && local > 0) {
      double divergence = 0;  // in double, as the unsharded row sums (cpu/distill_rows.hpp)
      for (int64_t i = 0; i < local; ++i) {
        divergence += common::distill_term(c, lse_s, lse_t, c.transform.value(to_compute<T>(s[i])),
                                           c.transform.value(to_compute<T>(t[i])))
                          .loss;
      }
      record[kDistillShardDivergence] = static_cast<T>(divergence);
    }
  }
}

// ---- pass 2 (jsd, tvd) ----------------------------------------------------------------------------

template <class S>
void sums_typed(TensorView student, TensorView teacher, TensorView target, TensorView gathered,
                const DistillOptions& options, TensorView sums) {
  using T = ComputeType<S>;
  const int64_t rows = student.rows, local = student.cols;
  const int64_t ranks = rows > 0 ? gathered.rows / rows : 0;
  const auto c = distill_constants<T>(options);
  const T* records = records_of<T>(gathered);
  T* out = static_cast<T*>(sums.data);

#pragma omp parallel for schedule(static) if (2 * rows * local >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    T* record = out + n * kDistillShardSumsWidth;
    std::fill(record, record + kDistillShardSumsWidth, T(0));
    if (!row_is_valid(target, n, options.ce.ignore_index)) continue;
    T lse_s, lse_t;
    common::merge_distill_lse(records, rows, ranks, n, lse_s, lse_t);
    const S* s = row_pointer<const S>(student, n);
    const S* t = row_pointer<const S>(teacher, n);
    double loss = 0, prob_u = 0;
    common::TvdSums<double> tvd;
    for (int64_t i = 0; i < local; ++i) {
      const T vs = c.transform.value(to_compute<T>(s[i])),
              vt = c.transform.value(to_compute<T>(t[i]));
      const auto term = common::distill_term(c, lse_s, lse_t, vs, vt);
      loss += term.loss;
      prob_u += term.prob_u;
      tvd.add(lse_s, lse_t, vs, vt);
    }
    record[kDistillSumLoss] = static_cast<T>(loss);
    record[kDistillSumProbU] = static_cast<T>(prob_u);
    record[kDistillSumAbove] = static_cast<T>(tvd.above);
    record[kDistillSumBelow] = static_cast<T>(tvd.below);
    record[kDistillSumEqual] = static_cast<T>(tvd.equal);
  }
}

// ---- merge: loss and gradient constants -----------------------------------------------------------

template <class T>
struct MergedBatch {
  std::vector<common::DistillShardRow<T>> soft;
  std::vector<common::ShardPartial<T>> hard;  // empty without a hard term
  ValidCounts counts;
  DistillCall<T> call;  // σ, α and the divisors of the whole batch, for the global vocabulary
};

template <class T>
MergedBatch<T> merge_batch(TensorView gathered, TensorView gathered_sums, TensorView target,
                           int64_t rows, VocabShard shard, const DistillOptions& options) {
  const int64_t ranks = rows > 0 ? gathered.rows / rows : 0;
  const auto kind = static_cast<DistillKindCode>(options.kind);
  const bool with_hard = with_hard_term(options, target);
  MergedBatch<T> batch;
  batch.soft.resize(static_cast<std::size_t>(rows));
  if (with_hard) batch.hard.resize(static_cast<std::size_t>(rows));
  for (int64_t n = 0; n < rows; ++n) {
    if (!row_is_valid(target, n, options.ce.ignore_index)) continue;
    ++batch.counts.valid_rows;
    batch.soft[n] = common::merge_distill_records(kind, records_of<T>(gathered),
                                                  records_of<T>(gathered_sums), rows, ranks, n);
    if (with_hard) {
      batch.hard[n] = common::merge_distill_hard(records_of<T>(gathered), rows, ranks, n);
      batch.counts.target_weight_sum += batch.hard[n].target_weight;
    } else {
      batch.counts.target_weight_sum += 1;
    }
  }
  DistillOptions global = options;
  global.ce.class_weight = TensorView{};  // W and w_y arrive merged in the records
  batch.call = make_distill_call<T>(global, shard.vocab, batch.counts);
  set_shard_divisors(batch.call.hard, batch.counts);
  return batch;
}

template <class T>
common::CeConstants<T> hard_constants(const MergedBatch<T>& batch, int64_t vocab, int64_t row) {
  return common::shard_constants(batch.call.hard.constants, vocab,
                                 batch.hard[row].class_weight_sum);
}

template <class T>
void loss_typed(TensorView gathered, TensorView gathered_sums, TensorView target, int64_t rows,
                VocabShard shard, const DistillOptions& options, TensorView loss) {
  const MergedBatch<T> batch =
      merge_batch<T>(gathered, gathered_sums, target, rows, shard, options);
  const bool with_hard = !batch.hard.empty();
  const Reduction reduction = options.ce.reduction;
  std::vector<T> soft(rows), hard_loss(rows), hard_z(rows);
  for (int64_t n = 0; n < rows; ++n) {
    if (!row_is_valid(target, n, options.ce.ignore_index)) {
      if (reduction == Reduction::none) write_result(loss, n, 0.0);
      continue;
    }
    DistillRowResult<T> r;
    r.soft = soft[n] = batch.soft[n].soft;
    if (with_hard) {
      const auto& h = batch.hard[n];
      const auto parts = common::ce_row_loss(hard_constants(batch, shard.vocab, n), h.stats,
                                             h.stats.lse(), h.target_logit, h.target_weight);
      const T weight =
          batch.call.hard.row_weight ? static_cast<T>(batch.call.hard.row_weight[n]) : T(1);
      r.hard_loss = hard_loss[n] = weight * parts.loss;
      r.hard_z_loss = hard_z[n] = weight * parts.z_loss;
      r.hard = r.hard_loss + r.hard_z_loss;
    }
    if (reduction == Reduction::none) write_result(loss, n, distill_row_loss(batch.call, r));
  }
  if (reduction != Reduction::none) {
    write_result(loss, 0, reduce_distill_loss(batch.call, reduction, soft, hard_loss, hard_z));
  }
}

template <class S>
void backward_typed(TensorView student, TensorView teacher, TensorView target, VocabShard shard,
                    TensorView gathered, TensorView gathered_sums, TensorView grad_output,
                    const DistillOptions& options, TensorView grad_student) {
  using T = ComputeType<S>;
  const int64_t rows = student.rows, local = student.cols;
  const MergedBatch<T> batch =
      merge_batch<T>(gathered, gathered_sums, target, rows, shard, options);
  const bool with_hard = !batch.hard.empty();
  const auto c = distill_constants<T>(options);
  const bool tvd = c.kind == DistillKindCode::tvd;
  const CeCall<T> local_call = make_ce_call<T>(options.ce, local, ValidCounts{});  // w_i, local
  const DistillCall<T>& call = batch.call;

#pragma omp parallel for schedule(static) if (2 * rows * local >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    S* grad = row_pointer<S>(grad_student, n);
    if (!row_is_valid(target, n, options.ce.ignore_index)) {
      zero_row(grad, local);
      continue;
    }
    const S* s = row_pointer<const S>(student, n);
    const S* t = row_pointer<const S>(teacher, n);
    const auto& m = batch.soft[n];
    const T upstream = upstream_of_row<T>(grad_output, options.ce.reduction, n);
    const T soft_coef = upstream * call.soft_factor;
    const common::TvdGradRow<T> tvd_row =
        tvd ? common::tvd_grad_row(m.tvd) : common::TvdGradRow<T>{};
    common::CeConstants<T> hc{};
    common::CeGradRow<T> hard_row{};
    if (with_hard) {
      const auto& h = batch.hard[n];
      hc = hard_constants(batch, shard.vocab, n);
      const T r = call.hard.row_weight ? static_cast<T>(call.hard.row_weight[n]) : T(1);
      const T coef = call.hard_weight * upstream * r;
      // Target index local to the slice (outside [0, local) when another rank holds y).
      hard_row = common::ce_grad_row(hc, h.stats.lse(), read_target(target, n) - shard.offset,
                                     h.target_weight, coef * call.hard.loss_factor,
                                     coef * call.hard.z_factor);
    }
    for (int64_t i = 0; i < local; ++i) {
      const T x = to_compute<T>(s[i]);
      const T vs = c.transform.value(x), vt = c.transform.value(to_compute<T>(t[i]));
      const T row_grad =
          tvd ? common::tvd_grad_from_row(tvd_row, std::exp(vs - m.lse_student),
                                          std::exp(vt - m.lse_teacher))
              : common::distill_grad_element(c, m.lse_student, m.lse_teacher, vs, vt, m.sum_prob_u);
      T g = soft_coef * row_grad * c.transform.slope(x);
      if (with_hard) {
        const T w = local_call.class_weight ? static_cast<T>(local_call.class_weight[i]) : T(1);
        g += common::ce_grad_element(hc, hard_row, x, i, w);
      }
      grad[i] = from_compute<S>(g);
    }
  }
}

}  // namespace

void distill_shard_stats(TensorView student, TensorView teacher, TensorView target,
                         VocabShard shard, const DistillOptions& options, TensorView partial,
                         Workspace, Stream) {
  dispatch_float(student.dtype, [&](auto storage) {
    stats_typed<decltype(storage)>(student, teacher, target, shard, options, partial);
  });
}

std::size_t distill_shard_workspace_size(int64_t) { return 0; }

void distill_shard_sums(TensorView student, TensorView teacher, TensorView target, VocabShard,
                        TensorView gathered, const DistillOptions& options, TensorView sums,
                        Workspace, Stream) {
  dispatch_float(student.dtype, [&](auto storage) {
    sums_typed<decltype(storage)>(student, teacher, target, gathered, options, sums);
  });
}

void distill_shard_loss(TensorView gathered, TensorView gathered_sums, TensorView target,
                        int64_t rows, VocabShard shard, const DistillOptions& options,
                        TensorView loss, Workspace, Stream) {
  if (gathered.dtype == DType::f64) {
    loss_typed<double>(gathered, gathered_sums, target, rows, shard, options, loss);
  } else {
    loss_typed<float>(gathered, gathered_sums, target, rows, shard, options, loss);
  }
}

void distill_shard_backward(TensorView student, TensorView teacher, TensorView target,
                            VocabShard shard, TensorView gathered, TensorView gathered_sums,
                            TensorView grad_output, const DistillOptions& options,
                            TensorView grad_student, Workspace, Stream) {
  dispatch_float(student.dtype, [&](auto storage) {
    backward_typed<decltype(storage)>(student, teacher, target, shard, gathered, gathered_sums,
                                      grad_output, options, grad_student);
  });
}

}  // namespace xent::cpu
