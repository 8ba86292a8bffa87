// Where the bench runs: memory, random data, timing and the ceilings of one device. The CPU and
// CUDA implementations live in cpu_device.cpp and cuda_device.cu; the ops see only this class.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "xent/types.hpp"

namespace xent::bench {

class BenchDevice {
 public:
  virtual ~BenchDevice() = default;

  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  virtual int default_repeat() const = 0;
  virtual int default_warmup() const = 0;

  virtual void* allocate(std::size_t bytes) = 0;  // throws std::bad_alloc when it cannot
  virtual void release(void* data) = 0;
  virtual void zero(void* data, std::size_t bytes) = 0;
  // Uniform values in [low, high) rounded to dtype; the same seed gives the same data.
  virtual void fill_uniform(void* data, DType dtype, int64_t count, float low, float high,
                            uint64_t seed) = 0;
  // int64 targets uniform in [0, vocab).
  virtual void fill_targets(void* data, int64_t count, int64_t vocab, uint64_t seed) = 0;
  virtual void to_host(void* host, const void* data, std::size_t bytes) = 0;
  virtual void from_host(void* data, const void* host, std::size_t bytes) = 0;

  // Runs fn `warmup` times, then `repeat` timed times; returns each time in milliseconds.
  // fn receives the repetition index so it can rotate among input copies.
  virtual std::vector<double> time(const std::function<void(int)>& fn, int warmup, int repeat) = 0;
  virtual void synchronize() = 0;
  // Bracket the one op call a profiler should capture (CUDA: cudaProfilerStart/Stop, seen by
  // `ncu --profile-from-start off`), so warm-up, timing, fills and ceilings stay out of it.
  // Both synchronize; no-ops where there is no profiler API.
  virtual void begin_profiled_call() {}
  virtual void end_profiled_call() {}
  virtual Stream stream() const { return {}; }

  // Bytes of device memory in use now (CUDA: total − free); 0 where it cannot be read.
  virtual std::size_t memory_in_use() = 0;
  // Bytes that fit in the last-level cache: inputs smaller than this are rotated among copies.
  virtual std::size_t cache_bytes() const = 0;

  // Copy bandwidth B in bytes/s (read + written over time) of a >= 1 GiB copy; 0 when not
  // measured (the CPU).
  virtual double copy_bandwidth() { return 0; }
  // cuBLASLt time in ms of the products of a fused linear op of this shape: h·Wᵀ (N×V), G·W (N×H)
  // and Gᵀ·h (V×H) with fwdbwd, h·Wᵀ alone with fwd; 0 when not measured.
  virtual double gemm_floor_ms(int64_t, int64_t, int64_t, DType, bool) { return 0; }
};

std::unique_ptr<BenchDevice> make_cpu_device();
#if defined(XENT_BENCH_CUDA)
// nullptr when no GPU is visible.
std::unique_ptr<BenchDevice> make_cuda_device();
#endif

// An allocation on a bench device, released on scope exit.
class Buffer {
 public:
  Buffer() = default;
  Buffer(BenchDevice& device, std::size_t bytes)
      : device_(&device), data_(bytes ? device.allocate(bytes) : nullptr), bytes_(bytes) {}
  Buffer(Buffer&& other) noexcept { swap(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    swap(other);
    return *this;
  }
  ~Buffer() {
    if (data_) device_->release(data_);
  }
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void swap(Buffer& other) {
    std::swap(device_, other.device_);
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
  }
  BenchDevice* device_ = nullptr;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Median, p20 and p80 of a sample (linear interpolation between order statistics).
struct TimeSummary {
  double median_ms = 0, p20_ms = 0, p80_ms = 0;
  int samples = 0;
};
TimeSummary summarize(std::vector<double> times_ms);

}  // namespace xent::bench
