// A CUDA GPU as a bench device: CUDA events on one stream, cudaMalloc'd memory, on-device random
// fills, the copy bandwidth B and the cuBLASLt GEMM floor F measured in the same run.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <new>
#include <stdexcept>
#include <string>
#include <tuple>

#include "bench/cublaslt_product.hpp"
#include "bench/device.hpp"
#include "bench/random.hpp"

namespace xent::bench {

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

template <class T>
__global__ void fill_uniform_kernel(T* data, int64_t count, float low, float span, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float value = low + span * uniform01(seed, static_cast<uint64_t>(i));
    if constexpr (sizeof(T) == 4) {
      data[i] = value;
    } else if constexpr (std::is_same_v<T, common::bf16_t>) {
      data[i] = common::to_bf16(value);
    } else {
      data[i] = common::to_f16(value);
    }
  }
}

__global__ void fill_targets_kernel(int64_t* data, int64_t count, int64_t vocab, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    data[i] =
        static_cast<int64_t>(mix64(seed + static_cast<uint64_t>(i)) % static_cast<uint64_t>(vocab));
}

int grid_for(int64_t count) {
  return static_cast<int>(std::clamp<int64_t>((count + 255) / 256, 1, 65535));
}

class CudaDevice final : public BenchDevice {
 public:
  CudaDevice() {
    check(cudaGetDevice(&index_), "cudaGetDevice");
    check(cudaGetDeviceProperties(&properties_, index_), "cudaGetDeviceProperties");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaDevice() override { cudaStreamDestroy(stream_); }

  Device device() const override { return Device{DeviceKind::cuda, index_}; }
  std::string name() const override { return properties_.name; }
  int default_repeat() const override { return 50; }
  int default_warmup() const override { return 5; }
  Stream stream() const override { return Stream{stream_}; }

  void* allocate(std::size_t bytes) override {
    void* data = nullptr;
    if (cudaMalloc(&data, bytes) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
      throw std::bad_alloc();
    }
    return data;
  }
  void release(void* data) override {
    cudaStreamSynchronize(stream_);
    cudaFree(data);
  }
  void zero(void* data, std::size_t bytes) override {
    check(cudaMemsetAsync(data, 0, bytes, stream_), "cudaMemsetAsync");
  }
  void fill_uniform(void* data, DType dtype, int64_t count, float low, float high,
                    uint64_t seed) override {
    const int grid = grid_for(count);
    switch (dtype) {
      case DType::bf16:
        fill_uniform_kernel<<<grid, 256, 0, stream_>>>(static_cast<common::bf16_t*>(data), count,
                                                       low, high - low, seed);
        break;
      case DType::f16:
        fill_uniform_kernel<<<grid, 256, 0, stream_>>>(static_cast<common::f16_t*>(data), count,
                                                       low, high - low, seed);
        break;
      default:
        fill_uniform_kernel<<<grid, 256, 0, stream_>>>(static_cast<float*>(data), count, low,
                                                       high - low, seed);
    }
    check(cudaGetLastError(), "fill kernel");
  }
  void fill_targets(void* data, int64_t count, int64_t vocab, uint64_t seed) override {
    fill_targets_kernel<<<grid_for(count), 256, 0, stream_>>>(static_cast<int64_t*>(data), count,
                                                              vocab, seed);
    check(cudaGetLastError(), "fill kernel");
  }
  void to_host(void* host, const void* data, std::size_t bytes) override {
    check(cudaMemcpyAsync(host, data, bytes, cudaMemcpyDeviceToHost, stream_), "copy to host");
    synchronize();
  }
  void from_host(void* data, const void* host, std::size_t bytes) override {
    check(cudaMemcpyAsync(data, host, bytes, cudaMemcpyHostToDevice, stream_), "copy to device");
    synchronize();
  }

  std::vector<double> time(const std::function<void(int)>& fn, int warmup, int repeat) override {
    for (int i = 0; i < warmup; ++i) fn(i);
    std::vector<cudaEvent_t> events(2 * static_cast<std::size_t>(repeat));
    for (cudaEvent_t& event : events) check(cudaEventCreate(&event), "cudaEventCreate");
    for (int i = 0; i < repeat; ++i) {
      check(cudaEventRecord(events[2 * i], stream_), "cudaEventRecord");
      fn(i);
      check(cudaEventRecord(events[2 * i + 1], stream_), "cudaEventRecord");
    }
    synchronize();
    std::vector<double> times;
    for (int i = 0; i < repeat; ++i) {
      float ms = 0;
      check(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]), "cudaEventElapsedTime");
      times.push_back(ms);
    }
    for (cudaEvent_t event : events) cudaEventDestroy(event);
    return times;
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }
  void begin_profiled_call() override {
    synchronize();
    check(cudaProfilerStart(), "cudaProfilerStart");
  }
  void end_profiled_call() override {
    synchronize();
    check(cudaProfilerStop(), "cudaProfilerStop");
  }

  std::size_t memory_in_use() override {
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
    return total_bytes - free_bytes;
  }
  std::size_t cache_bytes() const override {
    return static_cast<std::size_t>(properties_.l2CacheSize);
  }

  double copy_bandwidth() override {
    // 2 GiB each way when memory allows (>= 1 GiB always): far beyond L2, so B is HBM's.
    for (std::size_t bytes = std::size_t{2} << 30; bytes >= (std::size_t{1} << 30); bytes /= 2) {
      try {
        Buffer source(*this, bytes), destination(*this, bytes);
        fill_uniform(source.data(), DType::f32, static_cast<int64_t>(bytes / 4), -1, 1, 99);
        const auto times = time(
            [&](int) {
              check(cudaMemcpyAsync(destination.data(), source.data(), bytes,
                                    cudaMemcpyDeviceToDevice, stream_),
                    "cudaMemcpyAsync");
            },
            3, 20);
        return 2.0 * static_cast<double>(bytes) / (summarize(times).median_ms / 1e3);
      } catch (const std::bad_alloc&) {
      }
    }
    return 0;
  }

  double gemm_floor_ms(int64_t n, int64_t h, int64_t v, DType dtype, bool backward) override {
    const auto key = std::make_tuple(n, h, v, static_cast<int>(dtype), backward);
    if (const auto found = floors_.find(key); found != floors_.end()) return found->second;
    const std::size_t element = dtype_size(dtype);
    Buffer hidden(*this, static_cast<std::size_t>(n * h) * element);
    Buffer weight(*this, static_cast<std::size_t>(v * h) * element);
    // One N×V buffer is both the logits (written by h·Wᵀ) and G (read by the other two).
    Buffer logits(*this, static_cast<std::size_t>(n * v) * element);
    Buffer grad_hidden(*this, static_cast<std::size_t>(n * h) * element);
    Buffer grad_weight(*this, static_cast<std::size_t>(v * h) * 4);  // fp32 accumulation
    fill_uniform(hidden.data(), dtype, n * h, -1, 1, 7);
    fill_uniform(weight.data(), dtype, v * h, -0.05f, 0.05f, 8);
    const RowMajor h_view{hidden.data(), dtype, n, h}, w_view{weight.data(), dtype, v, h};
    const RowMajor g_view{logits.data(), dtype, n, v};
    const auto times = time(
        [&](int) {
          lt_product(h_view, false, w_view, true, logits.data(), dtype, stream_);  // h·Wᵀ
          if (!backward) return;
          lt_product(g_view, false, w_view, false, grad_hidden.data(), dtype, stream_);  // G·W
          lt_product(g_view, true, h_view, false, grad_weight.data(), DType::f32,
                     stream_);  // Gᵀ·h
        },
        3, 20);
    const double floor = summarize(times).median_ms;
    floors_[key] = floor;
    return floor;
  }

 private:
  int index_ = 0;
  cudaDeviceProp properties_{};
  cudaStream_t stream_ = nullptr;
  std::map<std::tuple<int64_t, int64_t, int64_t, int, bool>, double> floors_;
};

}  // namespace

std::unique_ptr<BenchDevice> make_cuda_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return nullptr;
  }
  return std::make_unique<CudaDevice>();
}

}  // namespace xent::bench
