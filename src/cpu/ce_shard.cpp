// Vocabulary-parallel ce pieces, CPU backend (xent/shard.hpp): the partial records of a slice
// from the ce row statistics (cpu/ce_rows.hpp), their merge and the §1 loss and gradient from
// the merged records (common/ce_shard.hpp). Rows in parallel; reductions in row order.
#include "api/shard_backend.hpp"
#include "cpu/shard_rows.hpp"

namespace xent::cpu {
namespace {

template <class T>
const T* records_of(TensorView view) {
  return static_cast<const T*>(view.data);
}

// The row math of the local slice: local columns for the statistics sweep, W and D filled in
// from the merged records by the callers that need them.
template <class T>
CeCall<T> slice_call(const CeOptions& options, int64_t local_vocab) {
  return make_ce_call<T>(options, local_vocab, ValidCounts{});
}

template <class S>
void stats_typed(TensorView logits, TensorView target, VocabShard shard, const CeOptions& options,
                 TensorView partial) {
  using T = ComputeType<S>;
  const int64_t rows = logits.rows, local = logits.cols;
  const CeCall<T> call = slice_call<T>(options, local);
  T* out = static_cast<T*>(partial.data);

#pragma omp parallel for schedule(static) if (rows * local >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    const auto p = ce_shard_row_record(call, row_pointer<const S>(logits, n),
                                       read_target(target, n), options.ignore_index, shard.offset);
    common::write_shard_record(out + n * kCeShardStatsWidth, p);
  }
}

// Merged records of every row, and the call whose divisors D and N_valid they imply.
template <class T>
struct MergedRows {
  std::vector<common::ShardPartial<T>> rows;
  ValidCounts counts;
};

template <class T>
MergedRows<T> merge_rows(TensorView gathered, TensorView target, int64_t ignore_index) {
  const int64_t rows = target.rows;
  const int64_t ranks = rows > 0 ? gathered.rows / rows : 0;
  MergedRows<T> merged;
  merged.rows.resize(static_cast<std::size_t>(rows));
  for (int64_t n = 0; n < rows; ++n) {
    merged.rows[n] = common::merge_shard_records(records_of<T>(gathered), rows, ranks, n);
    if (read_target(target, n) == ignore_index) continue;
    ++merged.counts.valid_rows;
    merged.counts.target_weight_sum += merged.rows[n].target_weight;
  }
  return merged;
}

template <class T>
void loss_typed(TensorView gathered, TensorView target, VocabShard shard, const CeOptions& options,
                const CeOutputs& out) {
  const int64_t rows = target.rows;
  const MergedRows<T> merged = merge_rows<T>(gathered, target, options.ignore_index);
  CeCall<T> call = slice_call<T>(options, shard.vocab);
  set_shard_divisors(call, merged.counts);
  CeResults<T> results(out.loss, out.stats, options.reduction, rows);
  for (int64_t n = 0; n < rows; ++n) {
    const auto& m = merged.rows[n];
    CeRowResult<T> r;
    const int64_t y = read_target(target, n);
    r.valid = y != options.ignore_index;
    r.entropy = r.valid ? m.stats.entropy() : common::IgnoredRow<T>::entropy;
    if (r.valid) {
      const auto c = common::shard_constants(call.constants, shard.vocab, m.class_weight_sum);
      const T lse = m.stats.lse();
      const auto loss = common::ce_row_loss(c, m.stats, lse, m.target_logit, m.target_weight);
      const T weight = call.row_weight ? static_cast<T>(call.row_weight[n]) : T(1);
      r.loss = weight * loss.loss;
      r.z_loss = weight * loss.z_loss;
      r.lse = lse;
      r.logprob = m.target_logit - lse;
      r.argmax = m.stats.argmax;
      r.correct = m.stats.argmax == y;
    }
    results.store(n, r);
  }
  results.finish(call, merged.counts);
}

template <class S>
void backward_typed(TensorView logits, TensorView target, VocabShard shard, TensorView gathered,
                    TensorView grad_output, const CeOptions& options, TensorView grad_logits,
                    int64_t first_row) {
  using T = ComputeType<S>;
  const int64_t rows = logits.rows, local = logits.cols;
  const MergedRows<T> merged = merge_rows<T>(gathered, target, options.ignore_index);
  CeCall<T> call = slice_call<T>(options, local);
  set_shard_divisors(call, merged.counts);

#pragma omp parallel for schedule(static) if (rows * local >= kParallelWork)
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t n = first_row + k;  // the row of the batch
    S* grad = row_pointer<S>(grad_logits, k);
    const int64_t y = read_target(target, n);
    if (y == options.ignore_index) {
      zero_row(grad, local);
      continue;
    }
    const S* x = row_pointer<const S>(logits, k);
    const auto& m = merged.rows[n];
    const auto c = common::shard_constants(call.constants, shard.vocab, m.class_weight_sum);
    const T upstream = upstream_of_row<T>(grad_output, options.reduction, n);
    const T r = call.row_weight ? static_cast<T>(call.row_weight[n]) : T(1);
    // Target index local to the slice (outside [0, local) when another rank holds y).
    const auto row =
        common::ce_grad_row(c, m.stats.lse(), y - shard.offset, m.target_weight,
                            upstream * r * call.loss_factor, upstream * r * call.z_factor);
    for (int64_t i = 0; i < local; ++i) {
      const T w = call.class_weight ? static_cast<T>(call.class_weight[i]) : T(1);
      grad[i] = from_compute<S>(common::ce_grad_element(c, row, to_compute<T>(x[i]), i, w));
    }
  }
}

}  // namespace

void ce_shard_stats(TensorView logits, TensorView target, VocabShard shard,
                    const CeOptions& options, TensorView partial, Stream) {
  dispatch_float(logits.dtype, [&](auto storage) {
    stats_typed<decltype(storage)>(logits, target, shard, options, partial);
  });
}

std::size_t ce_shard_workspace_size(int64_t) { return 0; }

void ce_shard_loss(TensorView gathered, TensorView target, VocabShard shard,
                   const CeOptions& options, const CeOutputs& out, Workspace, Stream) {
  if (gathered.dtype == DType::f64) {
    loss_typed<double>(gathered, target, shard, options, out);
  } else {
    loss_typed<float>(gathered, target, shard, options, out);
  }
}

void ce_shard_backward(TensorView logits, TensorView target, VocabShard shard, TensorView gathered,
                       TensorView grad_output, const CeOptions& options, TensorView grad_logits,
                       int64_t first_row, Workspace, Stream) {
  dispatch_float(logits.dtype, [&](auto storage) {
    backward_typed<decltype(storage)>(logits, target, shard, gathered, grad_output, options,
                                      grad_logits, first_row);
  });
}

}  // namespace xent::cpu
