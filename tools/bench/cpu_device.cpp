// The CPU as a bench device: wall-clock timing, host memory, OpenMP fills.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <thread>

#include "bench/device.hpp"
#include "bench/random.hpp"

namespace xent::bench {

namespace {

std::string cpu_model_name() {
  std::ifstream info("/proc/cpuinfo");
  std::string line;
  while (std::getline(info, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "cpu";
}

class CpuDevice final : public BenchDevice {
 public:
  Device device() const override { return Device{DeviceKind::cpu, 0}; }
  std::string name() const override {
    return cpu_model_name() + " (" + std::to_string(std::thread::hardware_concurrency()) +
           " threads)";
  }
  int default_repeat() const override { return 3; }
  int default_warmup() const override { return 1; }

  void* allocate(std::size_t bytes) override {
    // 64-byte alignment: whole cache lines, and what vectorised loops and BLAS prefer.
    void* data = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!data) throw std::bad_alloc();
    return data;
  }
  void release(void* data) override { std::free(data); }
  void zero(void* data, std::size_t bytes) override { std::memset(data, 0, bytes); }

  void fill_uniform(void* data, DType dtype, int64_t count, float low, float high,
                    uint64_t seed) override {
    const float span = high - low;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const float value = low + span * uniform01(seed, static_cast<uint64_t>(i));
      switch (dtype) {
        case DType::f32:
          static_cast<float*>(data)[i] = value;
          break;
        case DType::bf16:
          static_cast<common::bf16_t*>(data)[i] = common::to_bf16(value);
          break;
        case DType::f16:
          static_cast<common::f16_t*>(data)[i] = common::to_f16(value);
          break;
        case DType::f64:
          static_cast<double*>(data)[i] = value;
          break;
        default:
          break;
      }
    }
  }
  void fill_targets(void* data, int64_t count, int64_t vocab, uint64_t seed) override {
    auto* targets = static_cast<int64_t*>(data);
    for (int64_t i = 0; i < count; ++i)
      targets[i] = static_cast<int64_t>(mix64(seed + static_cast<uint64_t>(i)) %
                                        static_cast<uint64_t>(vocab));
  }
  void to_host(void* host, const void* data, std::size_t bytes) override {
    std::memcpy(host, data, bytes);
  }
  void from_host(void* data, const void* host, std::size_t bytes) override {
    std::memcpy(data, host, bytes);
  }

  std::vector<double> time(const std::function<void(int)>& fn, int warmup, int repeat) override {
    for (int i = 0; i < warmup; ++i) fn(i);
    std::vector<double> times;
    for (int i = 0; i < repeat; ++i) {
      const auto start = std::chrono::steady_clock::now();
      fn(i);
      const auto stop = std::chrono::steady_clock::now();
      times.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
    }
    return times;
  }
  void synchronize() override {}
  std::size_t memory_in_use() override { return 0; }
  std::size_t cache_bytes() const override { return 0; }  // CPU runs are far from cache-sized
};

}  // namespace

std::unique_ptr<BenchDevice> make_cpu_device() { return std::make_unique<CpuDevice>(); }

TimeSummary summarize(std::vector<double> times_ms) {
  TimeSummary summary;
  summary.samples = static_cast<int>(times_ms.size());
  if (times_ms.empty()) return summary;
  std::sort(times_ms.begin(), times_ms.end());
  auto quantile = [&](double q) {
    const double position = q * static_cast<double>(times_ms.size() - 1);
    const auto below = static_cast<std::size_t>(position);
    const auto above = std::min(below + 1, times_ms.size() - 1);
    const double fraction = position - static_cast<double>(below);
    return times_ms[below] * (1 - fraction) + times_ms[above] * fraction;
  };
  summary.median_ms = quantile(0.5);
  summary.p20_ms = quantile(0.2);
  summary.p80_ms = quantile(0.8);
  return summary;
}

}  // namespace xent::bench
