// Row pieces of the vocabulary-parallel CPU backends (ce_shard.cpp, distill_shard.cpp): the ce
// record of one row of a slice, and the mean divisors from merged records.
#pragma once

#include "common/ce_shard.hpp"
#include "cpu/ce_rows.hpp"

namespace xent::cpu {

// The partial ce record of one row of the slice starting at global column `offset`: statistics
// of the local columns (argmax made global), and x̃_y, w_y when the global target y lies in the
// slice. `call` is made for the local columns (its W is the slice's Σ w, or its width).
template <class T, class S>
common::ShardPartial<T> ce_shard_row_record(const CeCall<T>& call, const S* x, int64_t target,
                                            int64_t ignore_index, int64_t offset) {
  common::ShardPartial<T> p;
  p.stats = ce_row_stats(call, x);
  if (p.stats.argmax >= 0) p.stats.argmax += offset;
  p.class_weight_sum = call.constants.class_weight_sum;
  const int64_t y = target - offset;
  if (target != ignore_index && y >= 0 && y < call.vocab) {
    p.target_logit = call.constants.transform.value(to_compute<T>(x[y]));
    p.target_weight = call.class_weight ? static_cast<T>(call.class_weight[y]) : T(1);
  }
  return p;
}

// Divisors of mean from merged counts: merged records carry w_y (1 without class weights), so
// D = Σ w_y over valid rows in every case.
template <class T>
void set_shard_divisors(CeCall<T>& call, const ValidCounts& counts) {
  if (call.reduction != Reduction::mean) return;
  call.loss_divisor = counts.target_weight_sum;
  call.z_divisor = static_cast<double>(counts.valid_rows);
  call.loss_factor =
      counts.target_weight_sum > 0 ? static_cast<T>(1.0 / counts.target_weight_sum) : T(0);
  call.z_factor = counts.valid_rows > 0 ? static_cast<T>(1.0 / counts.valid_rows) : T(0);
}

}  // namespace xent::cpu
