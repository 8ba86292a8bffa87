// Host reads of a top-k teacher's entries (docs/semantics.md §3.1), shared by its validation and
// the CPU backend.
#pragma once

#include <cstdint>

#include "xent/types.hpp"

namespace xent::api {

// ids [N, k] int32 or int64.
inline int64_t topk_id(const TensorView& ids, int64_t n, int64_t j) {
  const int64_t at = n * ids.row_stride + j;
  return ids.dtype == DType::i32 ? static_cast<const int32_t*>(ids.data)[at]
                                 : static_cast<const int64_t*>(ids.data)[at];
}

// logprobs [N, k] float32 or float64.
inline double topk_logprob(const TensorView& logprobs, int64_t n, int64_t j) {
  const int64_t at = n * logprobs.row_stride + j;
  return logprobs.dtype == DType::f32 ? static_cast<const float*>(logprobs.data)[at]
                                      : static_cast<const double*>(logprobs.data)[at];
}

}  // namespace xent::api
