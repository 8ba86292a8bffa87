// scale_in_place on the CPU: the factor is host memory, so 1 is recognised before any loop.
#include "api/backend.hpp"
#include "cpu/tensor_access.hpp"

namespace xent::cpu {

void scale_in_place(TensorView data, TensorView factor, Stream /*stream*/) {
  const float scale = *static_cast<const float*>(factor.data);
  if (scale == 1.0f) return;
  const int64_t rows = data.ndim == 2 ? data.rows : 1;
  const int64_t cols = data.ndim == 2 ? data.cols : data.rows;
  const int64_t stride = data.ndim == 2 ? data.row_stride : cols;
  dispatch_float(data.dtype, [&](auto storage) {
    using S = decltype(storage);
    using T = ComputeType<S>;
    const T by = static_cast<T>(scale);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelWork)
    for (int64_t r = 0; r < rows; ++r) {
      S* row = static_cast<S*>(data.data) + r * stride;
      for (int64_t c = 0; c < cols; ++c) row[c] = from_compute<S>(to_compute<T>(row[c]) * by);
    }
  });
}

}  // namespace xent::cpu
