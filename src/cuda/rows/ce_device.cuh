// Device-side pieces of a ce row shared by the ce and distill row kernels (the hard-label term
// of distill is §1 cross-entropy on the student row).
#pragma once

#include "common/ce_row.hpp"
#include "cuda/rows/ce_rows.cuh"

namespace xent::cuda {

__device__ __forceinline__ int64_t read_target(const void* target, DType dtype, int64_t row) {
  return dtype == DType::i32 ? int64_t{static_cast<const int32_t*>(target)[row]}
                             : static_cast<const int64_t*>(target)[row];
}

__device__ __forceinline__ common::CeConstants<float> make_ce_constants(
    const CeRowOptions& o, int64_t vocab, const CeBatchTotals* totals) {
  common::CeConstants<float> c;
  c.transform.scale = o.logit_scale;
  c.transform.softcap = o.softcap;
  c.smoothing = o.label_smoothing;
  c.z_loss = o.z_loss;
  c.vocab = static_cast<float>(vocab);
  c.weighted = o.class_weight != nullptr;
  c.class_weight_sum = totals != nullptr ? totals->class_weight_sum : 0.0f;  // null: set later
  return c;
}

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

}  // namespace xent::cuda
