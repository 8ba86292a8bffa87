// What every suite needs: fresh random inputs with the seed in the failure trace, storage in the
// dtypes the ops take (on the CPU, or on a CUDA device in the GPU test binary), NaN-poisoned
// outputs so an element the op forgot to write fails, and the tolerances of docs/semantics.md §6.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "reference.hpp"
#include "xent/xent.hpp"

namespace xent::test {

using reference::Matrix;

// ---- device -----------------------------------------------------------------------------------

// The device the suites run on: the CPU in xent_tests, CUDA device 0 in xent_gpu_tests.
Device test_device();
bool on_gpu();
// Fails the current test when the binary is the GPU one and no CUDA device is usable, so a GPU
// run on a machine without one can never pass silently.
void require_device();

// ---- randomness -------------------------------------------------------------------------------

// Seeds. A run has one seed: `--seed=N` on the command line, else XENT_TEST_SEED from the
// environment, else a random one; main() prints it first, so any failure can be replayed. With
// --gtest_repeat=K, iteration k uses seed + k (printed per iteration). Every test derives its own
// generator seeds from the run's seed and its full name, so one test replays alone:
// `XENT_TEST_SEED=N xent_tests --gtest_filter=ThatTest`.
uint64_t run_seed();
void set_run_seed(uint64_t seed);
// The next generator seed of the current test (the first, second, ... call in a test differ).
uint64_t fresh_seed();
// Replaces gtest_main: reads the seed, prints it, runs the tests.
int run_tests(int argc, char** argv);

class Rng {
 public:
  explicit Rng(uint64_t seed) : seed_(seed), engine_(seed) {}
  uint64_t seed() const { return seed_; }
  double normal(double sd = 1.0);
  double uniform(double lo, double hi);
  int64_t integer(int64_t lo, int64_t hi);  // inclusive
  Matrix matrix(int64_t rows, int64_t cols, double sd);
  std::vector<double> uniform_vector(int64_t length, double lo, double hi);

 private:
  uint64_t seed_;
  std::mt19937_64 engine_;
};

// Declares `rng` with a fresh seed and puts the run's seed in every failure message of the scope.
#define XENT_TEST_RNG(rng)                           \
  ::xent::test::Rng rng(::xent::test::fresh_seed()); \
  SCOPED_TRACE(::testing::Message() << "XENT_TEST_SEED=" << ::xent::test::run_seed())

// ---- dtypes -----------------------------------------------------------------------------------

bool is_half(DType dtype);  // bf16 or fp16
// The dtype of an op's results (loss, statistics, grad_output) for inputs of `input`.
inline DType result_dtype(DType input) { return input == DType::f64 ? DType::f64 : DType::f32; }
double round_to(DType dtype, double value);
std::vector<double> rounded(std::vector<double> values, DType dtype);
Matrix rounded(Matrix m, DType dtype);
// Columns [begin, begin + width) of m: one rank's vocabulary slice in the sharded suites.
Matrix columns(const Matrix& m, int64_t begin, int64_t width);
std::string short_name(DType dtype);

// ---- tensors ----------------------------------------------------------------------------------

// Storage of one op argument on the test device, with a host mirror. Padding of strided matrices
// is poisoned and must stay so.
class Tensor {
 public:
  Tensor() = default;  // absent
  static Tensor matrix(DType dtype, int64_t rows, int64_t cols, int64_t row_stride = -1);
  static Tensor vector(DType dtype, int64_t length);
  static Tensor scalar(DType dtype);
  static Tensor of(const Matrix& values, DType dtype, int64_t row_stride = -1);
  static Tensor of(const std::vector<double>& values, DType dtype);
  static Tensor of_integers(const std::vector<int64_t>& values, DType dtype);

  bool present() const { return ndim_ >= 0; }
  DType dtype() const { return dtype_; }
  TensorView view() const;

  void upload(const std::vector<double>& dense);  // rows × cols values, row-major
  void upload_integers(const std::vector<int64_t>& values);
  void poison();                         // every byte, padding included
  std::vector<double> download() const;  // dense, padding left out
  std::vector<int64_t> download_integers() const;
  bool untouched() const;  // still entirely poisoned
  bool padding_untouched() const;

 private:
  Tensor(DType dtype, int ndim, int64_t rows, int64_t cols, int64_t stride);
  std::size_t bytes() const;
  void push() const;  // host mirror -> device
  void pull() const;  // device -> host mirror

  DType dtype_ = DType::f32;
  int ndim_ = -1;
  int64_t rows_ = 0, cols_ = 1, stride_ = 1;
  mutable std::vector<unsigned char> host_;
  std::shared_ptr<void> device_;  // CUDA memory in the GPU binary
};

// Host bytes of `values` stored as `dtype`, and back: for views on the CPU inside the GPU binary
// (the CUDA-vs-CPU cross-checks).
std::vector<unsigned char> encode(DType dtype, const std::vector<double>& values);
std::vector<double> decode(DType dtype, const std::vector<unsigned char>& bytes);

// Workspace memory on the test device (empty when bytes is 0).
class Scratch {
 public:
  explicit Scratch(std::size_t bytes);
  Workspace workspace() const { return {data_.get(), bytes_}; }

 private:
  std::shared_ptr<void> data_;
  std::size_t bytes_ = 0;
};

// Waits for the device and surfaces its error flag (a no-op on the CPU).
void finish(Stream stream = {});

// ---- comparisons ------------------------------------------------------------------------------

double norm(const std::vector<double>& v);
// ‖out − ref‖ / ‖ref‖ (‖out − ref‖ alone when ref is zero); NaN when out has a NaN.
double relative_error(const std::vector<double>& out, const std::vector<double>& ref);

enum class Family { logits, linear };
// docs/semantics.md §6 for outputs in the input dtype (gradients): fp32 1e-5 (logits) / 1e-4 (linear); fp64
// far tighter; bf16/fp16: what PyTorch loses at that dtype (`torch_like` against `ref`) + 1e-3.
double grad_tolerance(DType input, Family family, const std::vector<double>& torch_like,
                      const std::vector<double>& ref);
// The same for results (loss, statistics): fp32 rounding bounds those of 32- and 16-bit inputs,
// fp64 results of fp64 inputs are held to fp64 accuracy. An empty `torch_like` means PyTorch
// loses nothing beyond fp32 here.
// u of a dtype: round to nearest moves a value by at most u·|value| (bf16 2^-8, fp16 2^-11).
double unit_roundoff(DType dtype);
double stat_tolerance(DType input, Family family, const std::vector<double>& torch_like,
                      const std::vector<double>& ref);

// Relative error within `tol`, sizes equal, and no NaN or Inf where the reference is finite.
::testing::AssertionResult close(const std::string& what, const std::vector<double>& out,
                                 const std::vector<double>& ref, double tol);

// Expects `call` to throw xent::Error of kind invalid_argument whose message names `argument`
// and the offending `value`.
void expect_invalid(const std::function<void()>& call, const std::string& argument,
                    const std::string& value);

// `values` (rows of `cols`) without row `skip` (none when negative): a NaN row checked on its own.
std::vector<double> without_row(const std::vector<double>& values, int64_t cols, int64_t skip);

// Helpers to build parameter names.
std::string reduction_label(Reduction reduction);

// Every reduction, for parametrised grids.
inline const auto kAllReductions =
    ::testing::Values(Reduction::none, Reduction::sum, Reduction::mean);

// "plain", or the names of the set bits of `options` joined by "_" (names[bit] for each bit).
std::string options_label(unsigned options, const char* const* names, unsigned count);
// Every option alone, every pair, and none, over `count` option bits, without `excluded` (a
// pair that is an error case, tested as such; 0 for none).
std::vector<unsigned> option_sets_up_to_pairs(unsigned count, unsigned excluded = 0);

}  // namespace xent::test
