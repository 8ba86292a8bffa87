// A bandwidth probe of the CUDA ce and distill kernels against a device-to-device copy measured
// in the same process (docs/performance.md's ratio), for kernel work between full xent-bench runs. Disabled
// by default (it needs ~15 GiB and a few seconds); scripts/gpu-check.sh runs it with
// --gtest_also_run_disabled_tests --gtest_filter='*BandwidthProbe*'. It checks nothing but that
// the ops run; the numbers are printed as a table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "support.hpp"

namespace xent::test {
namespace {

void check(cudaError_t status, const char* what) {
  ASSERT_EQ(status, cudaSuccess) << what << ": " << cudaGetErrorString(status);
}

// Median milliseconds of `body` over `repeat` runs after 2 warm-ups, timed with CUDA events.
double median_ms(const std::function<void()>& body, int repeat = 15) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 2; ++i) body();
  std::vector<double> times;
  for (int i = 0; i < repeat; ++i) {
    cudaEventRecord(start);
    body();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Device buffer of `bytes` filled with random bf16 values in about N(0, 2) (a 64 MiB random
// block replicated: never zeros, far beyond L2 in total).
void* random_buffer(std::size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  const std::size_t block = std::min<std::size_t>(bytes, 64u << 20);
  std::vector<uint16_t> host(block / 2);
  std::mt19937 engine(1234);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (auto& v : host) {
    const float f = normal(engine);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  cudaMemcpy(p, host.data(), block, cudaMemcpyHostToDevice);
  for (std::size_t offset = block; offset < bytes; offset += block) {
    cudaMemcpy(static_cast<char*>(p) + offset, p, std::min(block, bytes - offset),
               cudaMemcpyDeviceToDevice);
  }
  return p;
}

TEST(CudaRowKernels, DISABLED_BandwidthProbe) {
  require_device();
  // Copy ceiling: 2 GiB device-to-device, bytes read + written over time.
  const std::size_t copy_bytes = std::size_t{2} << 30;
  void* a = random_buffer(copy_bytes);
  void* b = random_buffer(copy_bytes);
  ASSERT_TRUE(a && b);
  const double copy_ms =
      median_ms([&] { cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice); });
  const double copy_bw = 2.0 * copy_bytes / (copy_ms * 1e-3);
  cudaFree(a);
  cudaFree(b);
  std::printf("copy: %.3f ms, B = %.0f GB/s\n", copy_ms, copy_bw / 1e9);
  std::printf("%-34s %8s %10s %8s\n", "case", "ms", "GB/s", "of B");

  // docs/performance.md's rows, then a small vocabulary and a small batch (no cliff there either).
  for (const auto& [rows, vocab] :
       {std::pair<int64_t, int64_t>{16384, 32768}, std::pair<int64_t, int64_t>{16384, 131072},
        std::pair<int64_t, int64_t>{16384, 262144}, std::pair<int64_t, int64_t>{65536, 4096},
        std::pair<int64_t, int64_t>{256, 131072}}) {
    const std::size_t bytes = static_cast<std::size_t>(rows * vocab) * 2;
    void* logits = random_buffer(bytes);
    void* grad = nullptr;
    check(cudaMalloc(&grad, bytes), "grad");
    std::vector<int64_t> targets(rows);
    std::mt19937_64 engine(7);
    for (auto& t : targets) t = static_cast<int64_t>(engine() % vocab);
    Tensor target = Tensor::of_integers(targets, DType::i64);
    float* scalars = nullptr;
    check(cudaMalloc(&scalars, 64 + rows * 4 * 2 + vocab * 4), "scalars");
    const Device device = test_device();
    const TensorView x = matrix(logits, DType::bf16, rows, vocab, -1, device);
    const TensorView g = matrix(grad, DType::bf16, rows, vocab, -1, device);
    for (int variant = 0; variant < 3; ++variant) {
      CeOptions options;
      CeOutputs out;
      out.loss = scalar(scalars, DType::f32, device);
      if (variant != 1) out.grad_logits = g;
      if (variant == 2) {  // every option on
        options.label_smoothing = 0.1;
        options.z_loss = 1e-4;
        options.softcap = 30.0;
        options.logit_scale = 0.5;
        std::vector<float> weights(vocab, 1.0f);
        float* cw = scalars + 16 + rows * 2;
        cudaMemcpy(cw, weights.data(), vocab * 4, cudaMemcpyHostToDevice);
        cudaMemcpy(scalars + 16, weights.data(), rows * 4, cudaMemcpyHostToDevice);
        options.class_weight = vector(cw, DType::f32, vocab, device);
        options.row_weight = vector(scalars + 16, DType::f32, rows, device);
        out.stats.lse = vector(scalars + 16 + rows, DType::f32, rows, device);
      }
      const Scratch scratch(ce_workspace_size(rows, vocab, options, device));
      const double ms =
          median_ms([&] { ce_forward(x, target.view(), options, out, {}, scratch.workspace()); });
      check(cudaGetLastError(), "ce_forward");
      const double moved = variant == 1 ? bytes : 2.0 * bytes;
      const char* names[] = {"fwd+grad", "no grad", "fwd+grad all options"};
      char label[64];
      std::snprintf(label, sizeof label, "ce %s %lldx%lld", names[variant],
                    static_cast<long long>(rows), static_cast<long long>(vocab));
      std::printf("%-34s %8.3f %10.0f %8.3f\n", label, ms, moved / (ms * 1e-3) / 1e9,
                  moved / (ms * 1e-3) / copy_bw);
    }
    cudaFree(scalars);
    cudaFree(logits);
    cudaFree(grad);
  }

  for (const auto& [drows, vocab] :
       {std::pair<int64_t, int64_t>{4096, 32768}, std::pair<int64_t, int64_t>{16384, 131072}}) {
    const std::size_t bytes = static_cast<std::size_t>(drows * vocab) * 2;
    void* student = random_buffer(bytes);
    void* teacher = random_buffer(bytes);
    void* grad = nullptr;
    check(cudaMalloc(&grad, bytes), "grad");
    float* loss = nullptr;
    check(cudaMalloc(&loss, 64), "loss");
    const Device device = test_device();
    for (const DistillKind kind : {DistillKind::forward_kl, DistillKind::reverse_kl,
                                   DistillKind::jsd, DistillKind::soft_ce, DistillKind::tvd}) {
      DistillOptions options;
      options.kind = kind;
      DistillOutputs out;
      out.loss = scalar(loss, DType::f32, device);
      out.grad_student = matrix(grad, DType::bf16, drows, vocab, -1, device);
      const Scratch scratch(distill_workspace_size(drows, vocab, options, device));
      const double ms = median_ms([&] {
        distill_forward(matrix(student, DType::bf16, drows, vocab, -1, device),
                        matrix(teacher, DType::bf16, drows, vocab, -1, device), {}, options, out,
                        {}, scratch.workspace());
      });
      check(cudaGetLastError(), "distill_forward");
      const double moved = 3.0 * bytes;
      char label[64];
      std::snprintf(label, sizeof label, "distill %s %lldx%lld", distill_kind_name(kind),
                    static_cast<long long>(drows), static_cast<long long>(vocab));
      std::printf("%-34s %8.3f %10.0f %8.3f\n", label, ms, moved / (ms * 1e-3) / 1e9,
                  moved / (ms * 1e-3) / copy_bw);
    }
    cudaFree(loss);
    cudaFree(student);
    cudaFree(teacher);
    cudaFree(grad);
  }
  std::fflush(stdout);
}

}  // namespace
}  // namespace xent::test
