// scale_in_place on CUDA: every thread reads the factor first and the grid returns at once when it
// is exactly 1, so the backward of a loss whose gradient was formed in the forward moves no bytes
// for `loss.backward()` and one read + one write of the gradient otherwise. No host
// synchronisation: the factor is never copied to the host.
#include <algorithm>

#include "api/backend.hpp"
#include "cuda/core/device.cuh"

namespace xent::cuda {
namespace {

constexpr int kThreads = 256;

struct ScaleParams {
  void* data;
  const float* factor;
  int64_t rows, cols, row_stride;
  bool flat_vectors;  // contiguous and 16-byte aligned: the whole tensor moves in 16-byte vectors
};

template <class S>
__global__ void __launch_bounds__(kThreads) scale_kernel(ScaleParams p) {
  const float by = *p.factor;
  if (by == 1.0f) return;
  S* data = static_cast<S*>(p.data);
  const int64_t threads = int64_t{gridDim.x} * kThreads;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (p.flat_vectors) {
    constexpr int kWidth = kVectorElements<S>;
    const int64_t total = p.rows * p.cols;
    const int64_t vectors = total / kWidth;
    uint4* packed = reinterpret_cast<uint4*>(data);
    for (int64_t i = first; i < vectors; i += threads) {
      Vector<S> v = unpack<S>(packed[i]);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) v.value[k] *= by;
      packed[i] = pack<S>(v);
    }
    for (int64_t i = vectors * kWidth + first; i < total; i += threads) {
      data[i] = store_float<S>(load_float(data[i]) * by);
    }
    return;
  }
  const int64_t total = p.rows * p.cols;
  for (int64_t i = first; i < total; i += threads) {
    S& element = data[(i / p.cols) * p.row_stride + i % p.cols];
    element = store_float<S>(load_float(element) * by);
  }
}

}  // namespace

void scale_in_place(TensorView data, TensorView factor, Stream stream) {
  const int64_t rows = data.ndim == 2 ? data.rows : 1;
  const int64_t cols = data.ndim == 2 ? data.cols : data.rows;
  const int64_t stride = data.ndim == 2 ? data.row_stride : cols;
  if (rows * cols == 0) return;
  DeviceGuard guard(data.device.index);
  const int sms = multiprocessor_count(data.device.index);
  const bool contiguous = rows == 1 || stride == cols;
  const ScaleParams p{data.data, static_cast<const float*>(factor.data),
                      rows,      cols,
                      stride,    contiguous && reinterpret_cast<uintptr_t>(data.data) % 16 == 0};
  // A few waves of resident blocks: enough loads in flight to stream the tensor when the factor
  // is not 1, and a launch that retires in microseconds when it is.
  const int64_t wanted = (rows * cols + kThreads * 8 - 1) / (kThreads * 8);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(wanted, int64_t{sms} * 8));
  const cudaStream_t s = stream_of(stream);
  switch (data.dtype) {
    case DType::f32:
      scale_kernel<float><<<grid, kThreads, 0, s>>>(p);
      break;
    case DType::bf16:
      scale_kernel<bf16_t><<<grid, kThreads, 0, s>>>(p);
      break;
    case DType::f16:
      scale_kernel<f16_t><<<grid, kThreads, 0, s>>>(p);
      break;
    default:
      break;  // validated: no other dtype reaches a CUDA backend
  }
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
