// GPU-only: a cuBLASLt product with a bias into a 16-bit output (src/cuda/core/gemm.cu: the bias
// epilogue, no split-K) rounds each value once, as the float64 model of docs/semantics.md §6 does:
// every element is the 16-bit rounding of a number within the fp32 accumulation's error of the
// exact h·wᵀ + b. A second rounding (of the product before the bias is added) fails that for
// about a quarter of the elements: what split-K algorithms with the epilogue did, and algorithms
// that add the product into an output filled with the bias (docs/archive/perf-notes.md, note 149).
// The shapes are those of the linear losses' tests and block logits, aligned and not (each
// choosing other kernels): hidden rows times a block of weight rows (transposed), the bias read
// from the block's first column on (below 16-byte alignment: copied to the scratch first, or
// without scratch added as c's starting value), the first call of a product timed (tuned) or
// not, and the later calls.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <vector>

#include "cuda/core/gemm.hpp"
#include "support.hpp"

namespace xent::test {
namespace {

// The exponent of one ulp of the 16-bit format at `value` (f16's subnormals: 2⁻²⁴).
int ulp_exponent(double value, DType dtype) {
  const int digits = dtype == DType::bf16 ? 8 : 11;  // significand bits, the implicit one included
  int exponent = 0;
  std::frexp(value, &exponent);  // |value| in [2^(exponent − 1), 2^exponent)
  return dtype == DType::f16 ? std::max(exponent - digits, -24) : exponent - digits;
}

// The 16-bit value nearest to `value` (ties to even), from the double directly.
double round_exactly(double value, DType dtype) {
  if (value == 0 || !std::isfinite(value)) return value;
  const int shift = ulp_exponent(value, dtype);
  return std::ldexp(std::nearbyint(std::ldexp(value, -shift)), shift);
}

struct BiasCase {
  DType dtype;
  int64_t rows, hidden, columns;
  int64_t first_column;  // of the bias vector the block reads from
};

std::string case_name(const ::testing::TestParamInfo<BiasCase>& info) {
  const BiasCase& c = info.param;
  std::ostringstream name;
  name << short_name(c.dtype) << "_M" << c.rows << "_K" << c.hidden << "_N" << c.columns << "_at"
       << c.first_column;
  return name.str();
}

// Runs the product of case `c` twice (the first call may time the candidates) with `scratch_bytes`
// of scratch, and checks every value against float64: the rounding of a number within the fp32
// sum's error of the exact h·wᵀ + b, or, with `rounded_twice`, within half a 16-bit ulp of the
// product more (the product rounded before the bias is added: the fallback without scratch for
// an unaligned bias).
void check_product(const BiasCase& c, std::size_t scratch_bytes, bool rounded_twice) {
  XENT_TEST_RNG(rng);
  const int64_t m = c.rows, k = c.hidden, n = c.columns, vocab = c.first_column + n + 5;
  Matrix h(m, k), w(vocab, k);
  for (double& v : h.values) v = rng.normal();
  for (double& v : w.values) v = rng.normal(0.3);
  std::vector<double> bias = rng.uniform_vector(vocab, -1.0, 1.0);
  h = rounded(h, c.dtype);
  w = rounded(w, c.dtype);
  bias = rounded(bias, c.dtype);
  const Tensor hidden = Tensor::of(h, c.dtype);
  const Tensor weight = Tensor::of(w, c.dtype);
  const Tensor bias_tensor = Tensor::of(bias, c.dtype);
  Tensor out = Tensor::matrix(c.dtype, m, n);
  const Tensor scratch = Tensor::vector(DType::f32, int64_t{1} << 20);

  cuda::GemmProduct product;
  product.a = {hidden.view().data, c.dtype, m, k, k};
  product.b = {static_cast<const char*>(weight.view().data) +
                   static_cast<std::size_t>(c.first_column * k) * dtype_size(c.dtype),
               c.dtype, n, k, k};
  product.b_transposed = true;
  product.c = {out.view().data, c.dtype, m, n, n};
  product.bias = static_cast<const char*>(bias_tensor.view().data) +
                 static_cast<std::size_t>(c.first_column) * dtype_size(c.dtype);
  const cuda::GemmScratch gemm_scratch{scratch_bytes > 0 ? scratch.view().data : nullptr,
                                       scratch_bytes};

  for (const char* call : {"first call", "second call"}) {
    SCOPED_TRACE(call);
    out.poison();
    cuda::gemm(product, gemm_scratch, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<double> got = out.download();
    int64_t other = 0, beyond = 0;
    std::ostringstream first;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const double b = bias[static_cast<std::size_t>(c.first_column + j)];
        double exact = b, magnitude = 0;
        for (int64_t q = 0; q < k; ++q) {
          const double term = h.at(i, q) * w.at(c.first_column + j, q);
          exact += term;
          magnitude += std::fabs(term);
        }
        const double value = got[static_cast<std::size_t>(i * n + j)];
        if (value == round_exactly(exact, c.dtype)) continue;
        ++other;
        // From an fp32 sum of k terms and the bias, the value is the rounding of a number within
        // (k + 1)·2⁻²³·(Σ|terms| + |b|) of the exact one (an fp32 ulp a step, which covers an
        // accumulator that truncates); near a cancellation that spans several 16-bit ulps.
        double slack = static_cast<double>(k + 1) * std::ldexp(magnitude + 1.0, -23);
        if (rounded_twice) slack += std::ldexp(1.0, ulp_exponent(exact - b, c.dtype) - 1);
        const double lowest = round_exactly(exact - slack, c.dtype);
        const double highest = round_exactly(exact + slack, c.dtype);
        if (value < lowest || value > highest) {
          if (beyond++ == 0) {
            first << "row " << i << " column " << j << ": " << value << " where the exact value "
                  << exact << " rounds to " << round_exactly(exact, c.dtype) << " (" << lowest
                  << " .. " << highest << " within the fp32 sum's error)";
          }
        }
      }
    }
    EXPECT_EQ(beyond, 0) << beyond << " of " << m * n << " values not the exact value rounded "
                         << (rounded_twice ? "at most twice" : "once") << " (first: " << first.str()
                         << "); " << other << " differ from the nearest";
  }
}

class CudaGemmBias : public ::testing::TestWithParam<BiasCase> {};

TEST_P(CudaGemmBias, RoundsOnceWithTheProduct) {
  require_device();
  check_product(GetParam(), std::size_t{4} << 20, false);
}

INSTANTIATE_TEST_SUITE_P(
    Blocks, CudaGemmBias,
    ::testing::Values(
        // The linear losses' test shapes (N 300, H 72, a block of V 4099): heuristic's choice.
        BiasCase{DType::bf16, 300, 72, 1000, 37}, BiasCase{DType::f16, 300, 72, 1000, 37},
        BiasCase{DType::bf16, 300, 72, 4099, 0}, BiasCase{DType::bf16, 300, 128, 2053, 0},
        // Shapes where the heuristic offers split-K algorithms (note 149), and decision 90's.
        BiasCase{DType::bf16, 77, 64, 129, 0}, BiasCase{DType::bf16, 64, 40, 257, 3},
        BiasCase{DType::f16, 200, 1032, 2051, 0},
        // Aligned shapes whose algorithms rounded twice with the bias as c's starting value.
        BiasCase{DType::bf16, 2048, 256, 1536, 0}, BiasCase{DType::bf16, 8, 64, 4096, 0},
        // ≥ 2³⁰ flops with K ≤ 1024: the first call times the candidates (decision 58).
        BiasCase{DType::bf16, 1100, 512, 1000, 37},
        // A bias 16-byte aligned but not 32: read in place (37, 3: copied to the scratch first).
        BiasCase{DType::bf16, 300, 72, 1000, 8}, BiasCase{DType::f16, 64, 40, 257, 24}),
    case_name);

// A bias below 16-byte alignment with no scratch to copy it to: the product is added onto c
// filled with the bias (no fault, no epilogue), which may round the product before the bias.
TEST(CudaGemmBiasUnaligned, WithoutScratchAddsOntoTheFilledBias) {
  require_device();
  check_product(BiasCase{DType::bf16, 300, 72, 1000, 37}, 0, true);
  check_product(BiasCase{DType::f16, 64, 40, 257, 3}, 0, true);
}

}  // namespace
}  // namespace xent::test
