// scale_in_place: the upstream scalar applied to a gradient formed in the forward pass, read on the
// device; 1 leaves the data untouched, and strided rows keep their padding.
#include "support.hpp"

namespace xent::test {
namespace {

class ScaleInPlace : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { require_device(); }
};

std::vector<double> scaled(const std::vector<double>& values, DType dtype, double factor) {
  std::vector<double> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    out[i] = round_to(
        dtype, static_cast<double>(static_cast<float>(values[i]) * static_cast<float>(factor)));
  }
  return out;
}

TEST_P(ScaleInPlace, MatchesHostProduct) {
  XENT_TEST_RNG(rng);
  const DType dtype = GetParam();
  // 1 must leave the values as they are; the others scale, 0 included. Row strides: dense,
  // padded (the scalar path), and an odd width whose rows are not 16-byte aligned.
  for (const double factor : {1.0, -1.75, 0.0}) {
    for (const int64_t stride : {int64_t{-1}, int64_t{1041}}) {
      SCOPED_TRACE(::testing::Message() << "factor " << factor << ", stride " << stride);
      const Matrix values = rounded(rng.matrix(37, 1031, 2.0), dtype);
      Tensor data = Tensor::of(values, dtype, stride);
      Tensor by = Tensor::of(std::vector<double>{factor}, DType::f32);
      const TensorView factor_view = scalar(by.view().data, DType::f32, test_device());
      scale_in_place(data.view(), factor_view);
      finish();
      EXPECT_TRUE(close("scaled", data.download(), scaled(values.values, dtype, factor), 0.0));
      EXPECT_TRUE(data.padding_untouched());
    }
  }
}

TEST_P(ScaleInPlace, Vector) {
  XENT_TEST_RNG(rng);
  const DType dtype = GetParam();
  const std::vector<double> values = rounded(rng.uniform_vector(1003, -4, 4), dtype);
  Tensor data = Tensor::of(values, dtype);
  Tensor by = Tensor::of(std::vector<double>{0.5}, DType::f32);
  scale_in_place(data.view(), scalar(by.view().data, DType::f32, test_device()));
  finish();
  EXPECT_TRUE(close("scaled", data.download(), scaled(values, dtype, 0.5), 0.0));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ScaleInPlace,
                         ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const auto& info) { return short_name(info.param); });

TEST(ScaleInPlaceErrors, FactorMustBeAnFp32Scalar) {
  require_device();
  Tensor data = Tensor::matrix(DType::f32, 3, 5);
  Tensor wide = Tensor::vector(DType::f32, 2);
  expect_invalid([&] { scale_in_place(data.view(), wide.view()); }, "factor", "[2]");
  Tensor half = Tensor::scalar(DType::bf16);
  expect_invalid([&] { scale_in_place(data.view(), half.view()); }, "factor", "bfloat16");
  expect_invalid([&] { scale_in_place(data.view(), TensorView{}); }, "factor", "absent");
}

}  // namespace
}  // namespace xent::test
