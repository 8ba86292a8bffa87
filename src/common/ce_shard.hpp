// The partial record of one row over one vocabulary slice (xent/shard.hpp) and its merge across
// ranks, written once for both backends. A record is RowStats plus the slice's share of the
// target (x̃_y, w_y: non-zero on the one rank holding y) and of the class-weight sum W; records
// merge with RowStats::merge (any order gives the same statistics; the argmax tie keeps the
// lower column, as in the unsharded op) and plain sums for the rest.
#pragma once

#include "common/ce_row.hpp"
#include "xent/shard.hpp"

namespace xent::common {

template <class T>
struct ShardPartial {
  RowStats<T> stats;
  T target_logit = 0;
  T target_weight = 0;     // w_y (1 without class weights) once merged
  T class_weight_sum = 0;  // W (V without class weights) once merged
};

// The argmax travels bit-cast in a record column (exact for any index, unlike a float value).
template <class T>
XENT_HD T index_to_column(int64_t index) {
  if constexpr (sizeof(T) == 4) {
    return bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(index)));
  } else {
#if defined(__CUDA_ARCH__)
    return __longlong_as_double(index);
#else
    T value;
    std::memcpy(&value, &index, sizeof value);
    return value;
#endif
  }
}

template <class T>
XENT_HD int64_t column_to_index(T value) {
  if constexpr (sizeof(T) == 4) {
    return static_cast<int32_t>(float_to_bits(value));
  } else {
#if defined(__CUDA_ARCH__)
    return __double_as_longlong(value);
#else
    int64_t index;
    std::memcpy(&index, &value, sizeof index);
    return index;
#endif
  }
}

template <class T>
XENT_HD void write_shard_record(T* record, const ShardPartial<T>& p) {
  record[kShardMax] = p.stats.max;
  record[kShardSumExp] = p.stats.sum_exp;
  record[kShardSumExpShift] = p.stats.sum_exp_shift;
  record[kShardSumLogits] = p.stats.sum_logits;
  record[kShardSumWeightedLogits] = p.stats.sum_weighted_logits;
  record[kShardArgmax] = index_to_column<T>(p.stats.argmax);
  record[kShardTargetLogit] = p.target_logit;
  record[kShardTargetWeight] = p.target_weight;
  record[kShardClassWeightSum] = p.class_weight_sum;
}

template <class T>
XENT_HD ShardPartial<T> read_shard_record(const T* record) {
  ShardPartial<T> p;
  p.stats.max = record[kShardMax];
  p.stats.sum_exp = record[kShardSumExp];
  p.stats.sum_exp_shift = record[kShardSumExpShift];
  p.stats.sum_logits = record[kShardSumLogits];
  p.stats.sum_weighted_logits = record[kShardSumWeightedLogits];
  p.stats.argmax = column_to_index(record[kShardArgmax]);
  p.target_logit = record[kShardTargetLogit];
  p.target_weight = record[kShardTargetWeight];
  p.class_weight_sum = record[kShardClassWeightSum];
  return p;
}

// Row `row` of `ranks` gathered records (rank-major: rank p's row at p·rows + row), merged in
// rank order. `stride` is the width of a gathered row: a ce record may sit inside a wider one
// (the hard-label term of a distill record, xent/distill_shard.hpp), `gathered` then points at
// its first column.
template <class T>
XENT_HD ShardPartial<T> merge_shard_records(const T* gathered, int64_t rows, int64_t ranks,
                                            int64_t row, int64_t stride = kCeShardStatsWidth) {
  ShardPartial<T> total;
  for (int64_t p = 0; p < ranks; ++p) {
    const ShardPartial<T> part = read_shard_record(gathered + (p * rows + row) * stride);
    total.stats.merge(part.stats);
    total.target_logit += part.target_logit;
    total.target_weight += part.target_weight;
    total.class_weight_sum += part.class_weight_sum;
  }
  return total;
}

// The constants of a merged row: global V for ε/V and the merged W. Records always carry the
// weighted logit sum (w ≡ 1 without class weights), so the row math runs in its weighted form.
template <class T>
XENT_HD CeConstants<T> shard_constants(CeConstants<T> c, int64_t vocab, T class_weight_sum) {
  c.vocab = static_cast<T>(vocab);
  c.class_weight_sum = class_weight_sum;
  c.weighted = true;
  return c;
}

}  // namespace xent::common
