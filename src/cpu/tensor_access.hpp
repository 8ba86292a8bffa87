// Typed access to TensorView elements on the host, and the dispatch from a runtime DType to a
// storage type with its compute type (float for fp32/bf16/fp16, double for fp64).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/numeric.hpp"
#include "xent/types.hpp"

namespace xent::cpu {

using common::bf16_t;
using common::f16_t;

// Elements of work below which a loop runs on one thread. An OpenMP region costs microseconds
// on an idle machine but milliseconds on a loaded one, and the suites run hundreds of small
// cases.
constexpr int64_t kParallelWork = int64_t{1} << 18;

template <class Storage>
using ComputeType = std::conditional_t<std::is_same_v<Storage, double>, double, float>;

template <class T>
inline T to_compute(float v) {
  return static_cast<T>(v);
}
template <class T>
inline T to_compute(double v) {
  return static_cast<T>(v);
}
template <class T>
inline T to_compute(bf16_t v) {
  return static_cast<T>(common::to_float(v));
}
template <class T>
inline T to_compute(f16_t v) {
  return static_cast<T>(common::to_float(v));
}

template <class Storage, class T>
inline Storage from_compute(T v) {
  if constexpr (std::is_same_v<Storage, bf16_t>) {
    return common::to_bf16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<Storage, f16_t>) {
    return common::to_f16(static_cast<float>(v));
  } else {
    return static_cast<Storage>(v);
  }
}

// The value a compute-type number takes once stored in `Storage` (rounding of chunk logits).
template <class Storage, class T>
inline T round_to(T v) {
  return to_compute<T>(from_compute<Storage>(v));
}

template <class Storage>
inline Storage* row_pointer(const TensorView& view, int64_t row) {
  return static_cast<Storage*>(view.data) + row * view.row_stride;
}

// Calls f(Storage{}) with the storage type of a floating dtype (logits, hidden, weight).
template <class F>
decltype(auto) dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16:
      return f(bf16_t{});
    case DType::f16:
      return f(f16_t{});
    case DType::f64:
      return f(double{});
    default:
      return f(float{});
  }
}

// Reads element i of a 1-D or 0-D view of any numeric dtype as T (targets, weights, gradients).
template <class T>
inline T read_scalar(const TensorView& view, int64_t i) {
  switch (view.dtype) {
    case DType::f32:
      return static_cast<T>(static_cast<const float*>(view.data)[i]);
    case DType::f64:
      return static_cast<T>(static_cast<const double*>(view.data)[i]);
    case DType::bf16:
      return static_cast<T>(common::to_float(static_cast<const bf16_t*>(view.data)[i]));
    case DType::f16:
      return static_cast<T>(common::to_float(static_cast<const f16_t*>(view.data)[i]));
    case DType::i64:
      return static_cast<T>(static_cast<const int64_t*>(view.data)[i]);
    case DType::i32:
      return static_cast<T>(static_cast<const int32_t*>(view.data)[i]);
  }
  return T(0);
}

inline int64_t read_target(const TensorView& target, int64_t i) {
  return target.dtype == DType::i32 ? static_cast<const int32_t*>(target.data)[i]
                                    : static_cast<const int64_t*>(target.data)[i];
}

// Writes element i of a result (loss, statistic): float32, or float64 for float64 inputs
// (validated in src/api).
inline void write_result(const TensorView& view, int64_t i, double value) {
  if (!view.present()) return;
  if (view.dtype == DType::f64) {
    static_cast<double*>(view.data)[i] = value;
  } else {
    static_cast<float*>(view.data)[i] = static_cast<float>(value);
  }
}

}  // namespace xent::cpu
