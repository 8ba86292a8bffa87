// GPU-only cases of the cuBLASLt products' algorithm choice (src/cuda/core/gemm.cu, docs/archive/perf-notes.md decision
// 58): the first call of a configuration that writes its output over times the heuristic's
// candidates in place and keeps the fastest, by default where the inner dimension is short
// (K ≤ 1024). What must hold whatever is chosen: the result of that first call is the product
// (the candidates' outputs are overwritten), an accumulating first call adds into its output once
// (it is not timed, so nothing runs on it twice), a call captured into a CUDA graph is not timed;
// small products, long inner dimensions (unless the test hook times all) and
// the test hook's gemm_tuning = off keep the heuristic's first answer. Each case uses a shape of its own,
// so the process-wide cache meets it fresh. A pinned product (batch_invariant, docs/semantics.md
// §1) takes one data-parallel algorithm for every M, so a row's bits do not depend on M, the row's
// position or the scratch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/core/gemm.hpp"
#include "support.hpp"
#include "hook_scope.hpp"

namespace xent::test {
namespace {

void cuda_ok(cudaError_t status) { ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status); }

// A row-major bf16 matrix on the device and its rounded values on the host.
struct Operand {
  std::vector<double> host;
  __nv_bfloat16* device = nullptr;
  int64_t rows = 0, cols = 0;
  Operand(Rng& rng, int64_t r, int64_t c) : rows(r), cols(c) {
    std::vector<__nv_bfloat16> staged(static_cast<std::size_t>(r * c));
    host.resize(staged.size());
    for (std::size_t i = 0; i < staged.size(); ++i) {
      staged[i] = __float2bfloat16(static_cast<float>(rng.normal()));
      host[i] = static_cast<double>(__bfloat162float(staged[i]));
    }
    cuda_ok(cudaMalloc(&device, staged.size() * sizeof(__nv_bfloat16)));
    cuda_ok(cudaMemcpy(device, staged.data(), staged.size() * sizeof(__nv_bfloat16),
                       cudaMemcpyHostToDevice));
  }
  ~Operand() { cudaFree(device); }
  cuda::GemmMatrix matrix() const { return {device, DType::bf16, rows, cols, cols}; }
};

// C[M,N] = A[M,K]·B[K,N] in fp32 with scratch, plus the float64 reference.
struct ProductCase {
  Operand a, b;
  float* c = nullptr;
  void* scratch = nullptr;
  int64_t m, n, k;
  static constexpr std::size_t kScratchBytes = std::size_t{4} << 20;
  ProductCase(Rng& rng, int64_t m_, int64_t n_, int64_t k_)
      : a(rng, m_, k_), b(rng, k_, n_), m(m_), n(n_), k(k_) {
    cuda_ok(cudaMalloc(&c, static_cast<std::size_t>(m * n) * sizeof(float)));
    cuda_ok(cudaMalloc(&scratch, kScratchBytes));
  }
  ~ProductCase() {
    cudaFree(c);
    cudaFree(scratch);
  }
  cuda::GemmProduct product(float beta) const {
    cuda::GemmProduct p;
    p.a = a.matrix();
    p.b = b.matrix();
    p.c = {c, DType::f32, m, n, n};
    p.beta = beta;
    return p;
  }
  cuda::GemmScratch gemm_scratch() const { return {scratch, kScratchBytes}; }
  cuda::GemmPlanState state() const { return cuda::gemm_plan_state(product(0.0f), gemm_scratch()); }
  // One call that writes C over (poisoned first), on the default stream; the cache's state after.
  cuda::GemmPlanState run_written_over() {
    fill_output(std::nanf(""));
    cuda::gemm(product(0.0f), gemm_scratch(), nullptr);
    cuda_ok(cudaDeviceSynchronize());
    return state();
  }
  void fill_output(float value) {
    std::vector<float> host(static_cast<std::size_t>(m * n), value);
    cuda_ok(cudaMemcpy(c, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  // Every element of C against `offset` + the float64 product (fp32 accumulation of K terms).
  void expect_product(double offset) const {
    std::vector<float> got(static_cast<std::size_t>(m * n));
    cuda_ok(cudaMemcpy(got.data(), c, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const double tolerance = 1e-5 * static_cast<double>(k);
    int64_t wrong = 0;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double want = offset;
        for (int64_t q = 0; q < k; ++q) {
          want += a.host[static_cast<std::size_t>(i * k + q)] *
                  b.host[static_cast<std::size_t>(q * n + j)];
        }
        const double value = got[static_cast<std::size_t>(i * n + j)];
        if (!(std::fabs(value - want) <= tolerance)) ++wrong;
      }
    }
    EXPECT_EQ(wrong, 0) << "of " << m * n << " elements (tolerance " << tolerance << ")";
  }
};

// 2·M·N·K ≥ 2^30 flops with N ≥ 520 and K at the default's limit: timed by default.
constexpr int64_t kM = 1100, kK = 1024;

TEST(CudaGemmTuning, WrittenOverProductIsTimedAndExact) {
  require_device();
  XENT_TEST_RNG(rng);
  ProductCase t(rng, kM, 520, kK);
  const cuda::GemmPlanState state = t.run_written_over();
  ASSERT_TRUE(state.cached);
  EXPECT_GE(state.candidates, 1);
  EXPECT_TRUE(state.tuned);
  EXPECT_GE(state.chosen, 0);
  EXPECT_LT(state.chosen, state.candidates);
  t.expect_product(0.0);
}

TEST(CudaGemmTuning, AccumulatingFirstCallAddsOnceAndWaits) {
  require_device();
  XENT_TEST_RNG(rng);
  ProductCase t(rng, kM, 528, kK);
  t.fill_output(3.0f);
  cuda::gemm(t.product(1.0f), t.gemm_scratch(), nullptr);
  cuda_ok(cudaDeviceSynchronize());
  cuda::GemmPlanState state = t.state();  // one configuration whatever beta
  ASSERT_TRUE(state.cached);
  EXPECT_EQ(state.tuned, state.candidates == 1);
  EXPECT_EQ(state.chosen, 0);
  t.expect_product(3.0);
  // The next call that writes over is the one timed.
  state = t.run_written_over();
  EXPECT_TRUE(state.tuned);
  t.expect_product(0.0);
}

TEST(CudaGemmTuning, CapturedCallIsNotTimed) {
  require_device();
  XENT_TEST_RNG(rng);
  ProductCase t(rng, kM, 536, kK);
  t.fill_output(std::nanf(""));
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cuda::gemm(t.product(0.0f), t.gemm_scratch(), stream);
  cuda_ok(cudaStreamEndCapture(stream, &graph));
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
  cuda_ok(cudaGraphLaunch(exec, stream));
  cuda_ok(cudaStreamSynchronize(stream));
  const cuda::GemmPlanState state = t.state();
  ASSERT_TRUE(state.cached);
  EXPECT_EQ(state.tuned, state.candidates == 1);
  EXPECT_EQ(state.chosen, 0);
  t.expect_product(0.0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Each of these keeps the heuristic's first answer, untimed.
void expect_first_answer(ProductCase& t) {
  const cuda::GemmPlanState state = t.run_written_over();
  EXPECT_TRUE(state.tuned);
  EXPECT_EQ(state.chosen, 0);
  t.expect_product(0.0);
}

TEST(CudaGemmTuning, SmallProductsLongInnerDimensionsAndTheSwitchKeepTheFirstAnswer) {
  require_device();
  XENT_TEST_RNG(rng);
  ProductCase small(rng, 64, 544, 96);  // 6.7 Mflop
  expect_first_answer(small);
  ProductCase long_inner(rng, 1000, 560, kK + 8);  // K > 1024: not timed by default
  expect_first_answer(long_inner);
  HookScope hook;  // the choice is read as a configuration is first met
  hook->gemm_tuning = cuda::GemmTuning::off;
  ProductCase switched_off(rng, kM, 552, kK);
  expect_first_answer(switched_off);
}

TEST(CudaGemmTuning, AllTimesLongInnerDimensions) {
  require_device();
  XENT_TEST_RNG(rng);
  HookScope hook;
  hook->gemm_tuning = cuda::GemmTuning::all;
  ProductCase t(rng, 1000, 568, kK + 8);
  const cuda::GemmPlanState state = t.run_written_over();
  ASSERT_TRUE(state.cached);
  EXPECT_TRUE(state.tuned);
  EXPECT_LT(state.chosen, state.candidates);
  t.expect_product(0.0);
}

// Pinned: one algorithm for every M (split-K 1, no reduction, no workspace, never timed), and
// the rows of a product of any M, at any position and with any scratch, bit-equal to those of the
// whole.
TEST(CudaGemmPinned, OneAlgorithmForEveryRowCountAndBitEqualRows) {
  require_device();
  XENT_TEST_RNG(rng);
  constexpr int64_t kRows = 1031, kColumns = 584, kInner = 1000;
  ProductCase whole(rng, kRows, kColumns, kInner);
  whole.fill_output(std::nanf(""));
  cuda::GemmProduct all = whole.product(0.0f);
  all.pinned = true;
  cuda::gemm(all, whole.gemm_scratch(), nullptr);
  cuda_ok(cudaDeviceSynchronize());
  const cuda::GemmPlanState chosen = cuda::gemm_plan_state(all, whole.gemm_scratch());
  ASSERT_TRUE(chosen.cached);
  EXPECT_TRUE(chosen.pinned);
  EXPECT_FALSE(chosen.pinned_fallback);
  EXPECT_TRUE(chosen.tuned);
  EXPECT_LE(chosen.split_k, 1);
  EXPECT_EQ(chosen.reduction_scheme, 0);
  EXPECT_EQ(chosen.workspace_bytes, 0u);
  whole.expect_product(0.0);
  std::vector<float> expected(static_cast<std::size_t>(kRows * kColumns));
  cuda_ok(cudaMemcpy(expected.data(), whole.c, expected.size() * sizeof(float),
                     cudaMemcpyDeviceToHost));

  float* piece_out = nullptr;
  cuda_ok(cudaMalloc(&piece_out, static_cast<std::size_t>(kRows * kColumns) * sizeof(float)));
  struct Piece {
    int64_t first, count;
    std::size_t scratch_bytes;
  };
  const Piece pieces[] = {{0, 1, 0},      {kRows - 1, 1, ProductCase::kScratchBytes},
                          {500, 1, 4096}, {3, 7, 0},
                          {100, 64, 0},   {0, kRows, ProductCase::kScratchBytes / 2}};
  for (const Piece& piece : pieces) {
    cuda::GemmProduct part = all;
    part.a = cuda::gemm_rows(all.a, piece.first, piece.count);
    part.c = {piece_out, DType::f32, piece.count, kColumns, kColumns};
    const cuda::GemmScratch scratch{whole.scratch, piece.scratch_bytes};
    std::vector<float> poison(static_cast<std::size_t>(piece.count * kColumns), std::nanf(""));
    cuda_ok(cudaMemcpy(piece_out, poison.data(), poison.size() * sizeof(float),
                       cudaMemcpyHostToDevice));
    cuda::gemm(part, scratch, nullptr);
    cuda_ok(cudaDeviceSynchronize());
    const cuda::GemmPlanState state = cuda::gemm_plan_state(part, scratch);
    ASSERT_TRUE(state.cached) << piece.first << "+" << piece.count;
    EXPECT_FALSE(state.pinned_fallback) << piece.count << " rows";
    EXPECT_EQ(state.algo_id, chosen.algo_id) << piece.count << " rows";
    EXPECT_EQ(state.tile_id, chosen.tile_id) << piece.count << " rows";
    std::vector<float> got(poison.size());
    cuda_ok(cudaMemcpy(got.data(), piece_out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    int64_t differing = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const float want = expected[static_cast<std::size_t>(piece.first * kColumns) + i];
      if (std::memcmp(&got[i], &want, sizeof(float)) != 0) ++differing;
    }
    EXPECT_EQ(differing, 0) << "rows " << piece.first << "+" << piece.count << " of " << got.size()
                            << " elements";
  }
  cudaFree(piece_out);
}

}  // namespace
}  // namespace xent::test
