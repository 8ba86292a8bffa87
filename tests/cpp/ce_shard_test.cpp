// The vocabulary-parallel ce pieces (xent/shard.hpp): the vocabulary is split into uneven slices,
// each slice's partial records are computed on its own, the test gathers them by hand (what
// all_gather does between ranks) and the loss, every statistic and the gradient of each slice
// must match the float64 reference of the whole vocabulary.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ce_check.hpp"
#include "xent/shard.hpp"

namespace xent::test {
namespace {

struct ShardProblem {
  DType dtype = DType::f32;
  unsigned options = 0;
  Reduction reduction = Reduction::mean;
  std::vector<int64_t> widths{400, 7, 624};  // uneven; sums to V
  int64_t rows = 37;
};

DType record_dtype(DType input) { return input == DType::f64 ? DType::f64 : DType::f32; }

Matrix rows_of(const Matrix& m, int64_t begin, int64_t end) {
  Matrix out(end - begin, m.cols);
  for (int64_t r = begin; r < end; ++r)
    for (int64_t c = 0; c < m.cols; ++c) out.at(r - begin, c) = m.at(r, c);
  return out;
}

void check_shards(const ShardProblem& p, Rng& rng) {
  int64_t vocab = 0;
  for (const int64_t w : p.widths) vocab += w;
  const int64_t rows = p.rows, ranks = static_cast<int64_t>(p.widths.size());
  const int64_t ignore_index = -100;
  const std::vector<int64_t> target =
      make_targets(rng, rows, vocab, ignore_index, true, false, true);
  Matrix x = rng.matrix(rows, vocab, 2.0);
  for (int64_t n = 0; n < rows; n += 3)
    if (target[n] != ignore_index) x.at(n, target[n]) += 6.0;
  x = rounded(x, p.dtype);
  CeSetup setup = make_ce_setup(p.options, p.reduction, ignore_index, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, p.reduction, rows, false);
  const reference::CeResult ref = reference::ce(x, target, setup.spec, upstream);
  const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, p.reduction, rows, p.dtype);

  // Per-slice inputs; class weights are sliced with the vocabulary.
  std::vector<Tensor> logits, weights;
  std::vector<CeOptions> options;
  std::vector<int64_t> offsets;
  std::vector<double> gathered;
  int64_t offset = 0;
  for (const int64_t width : p.widths) {
    offsets.push_back(offset);
    logits.push_back(Tensor::of(columns(x, offset, width), p.dtype));
    CeOptions o = setup.options;
    if (!setup.spec.class_weight.empty()) {
      const std::vector<double> slice(setup.spec.class_weight.begin() + offset,
                                      setup.spec.class_weight.begin() + offset + width);
      weights.push_back(Tensor::of(slice, DType::f32));
      o.class_weight = weights.back().view();
    }
    options.push_back(o);
    Tensor partial = Tensor::matrix(record_dtype(p.dtype), rows, kCeShardStatsWidth);
    partial.poison();
    ce_shard_stats(logits.back().view(), target_tensor.view(), {offset, vocab}, o, partial.view());
    finish();
    const std::vector<double> records = partial.download();
    gathered.insert(gathered.end(), records.begin(), records.end());
    offset += width;
  }
  Matrix all_records(ranks * rows, kCeShardStatsWidth);
  all_records.values = gathered;
  const Tensor gathered_tensor = Tensor::of(all_records, record_dtype(p.dtype));
  const Scratch scratch(ce_shard_workspace_size(rows, test_device()));
  const double stat_tol = stat_tolerance(p.dtype, Family::logits, {}, ref.loss);

  // Loss and statistics from the gathered records (every rank computes the same).
  {
    SCOPED_TRACE("ce_shard_loss");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype),
           z_value = loss_tensor(p.reduction, rows, p.dtype);
    const DType result = result_dtype(p.dtype);
    Tensor lse = Tensor::vector(result, rows), logprob = Tensor::vector(result, rows),
           entropy = Tensor::vector(result, rows), argmax = Tensor::vector(DType::i64, rows),
           accuracy = Tensor::scalar(result);
    for (Tensor* t : {&loss, &z_value, &lse, &logprob, &entropy, &argmax, &accuracy}) t->poison();
    CeOutputs out;
    out.loss = loss.view();
    out.stats = {lse.view(),    logprob.view(),  entropy.view(),
                 argmax.view(), accuracy.view(), z_value.view()};
    ce_shard_loss(gathered_tensor.view(), target_tensor.view(), {0, vocab}, setup.options, out,
                  scratch.workspace());
    finish();
    EXPECT_TRUE(close("loss", loss.download(), ref.loss, stat_tol));
    EXPECT_TRUE(close("z_loss_value", z_value.download(), ref.z_loss_value, stat_tol));
    EXPECT_TRUE(close("lse", lse.download(), ref.lse, stat_tol));
    EXPECT_TRUE(close("logprob", logprob.download(), ref.logprob, stat_tol));
    EXPECT_TRUE(close("entropy", entropy.download(), ref.entropy, stat_tol));
    const std::vector<int64_t> arg = argmax.download_integers();
    for (int64_t n = 0; n < rows; ++n) {
      if (target[n] == ignore_index) {
        EXPECT_EQ(arg[n], -1) << "argmax of ignored row " << n;
        continue;
      }
      ASSERT_TRUE(arg[n] >= 0 && arg[n] < vocab) << "argmax row " << n << " = " << arg[n];
      const double chosen = ce_transformed(setup.spec, x.at(n, arg[n]));
      const double best = ref.transformed_max[n];
      EXPECT_TRUE(arg[n] == ref.argmax[n] || std::abs(chosen - best) <= 1e-6 * (1 + std::abs(best)))
          << "argmax row " << n << ": got " << arg[n] << ", expected " << ref.argmax[n];
    }
    EXPECT_NEAR(accuracy.download()[0], ref.accuracy, 1e-6);
  }

  // The gradient of each slice, stitched back together.
  SCOPED_TRACE("ce_shard_backward");
  Matrix grad(rows, vocab);
  for (int64_t s = 0; s < ranks; ++s) {
    // Slice 1 goes in two blocks of rows (first_row), as the row chunks of linear_ce do.
    const int64_t split = s == 1 ? rows / 2 : rows;
    for (const auto& [begin, end] : {std::pair{int64_t{0}, split}, std::pair{split, rows}}) {
      if (begin == end) continue;
      const Tensor block =
          Tensor::of(columns(rows_of(x, begin, end), offsets[s], p.widths[s]), p.dtype);
      Tensor g = Tensor::matrix(p.dtype, end - begin, p.widths[s]);
      g.poison();
      ce_shard_backward(block.view(), target_tensor.view(), {offsets[s], vocab},
                        gathered_tensor.view(), grad_output.view(), options[s], g.view(), begin,
                        scratch.workspace());
      finish();
      const std::vector<double> values = g.download();
      for (int64_t r = begin; r < end; ++r)
        for (int64_t c = 0; c < p.widths[s]; ++c)
          grad.at(r, offsets[s] + c) =
              values[static_cast<std::size_t>((r - begin) * p.widths[s] + c)];
    }
  }
  const double grad_tol =
      grad_tolerance(p.dtype, Family::logits, rounded(ref.grad.values, p.dtype), ref.grad.values);
  EXPECT_TRUE(close("grad_logits", grad.values, ref.grad.values, grad_tol));
}

using ShardParam = std::tuple<DType, unsigned, Reduction>;

class CeShardGrid : public ::testing::TestWithParam<ShardParam> {};

TEST_P(CeShardGrid, MatchesReferenceOfWholeVocabulary) {
  require_device();
  XENT_TEST_RNG(rng);
  ShardProblem p;
  std::tie(p.dtype, p.options, p.reduction) = GetParam();
  check_shards(p, rng);
}

std::vector<DType> shard_dtypes() {
  std::vector<DType> dtypes{DType::f32, DType::bf16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(Options, CeShardGrid,
                         ::testing::Combine(::testing::ValuesIn(shard_dtypes()),
                                            ::testing::ValuesIn(ce_option_sets_up_to_pairs()),
                                            kAllReductions),
                         ce_grid_name);

TEST(CeShard, EveryOptionOnOneSliceAndOnManySlices) {
  require_device();
  XENT_TEST_RNG(rng);
  for (const auto& widths :
       std::vector<std::vector<int64_t>>{{1031}, {1, 1, 1029}, {344, 344, 343}}) {
    SCOPED_TRACE(::testing::Message() << "slices " << widths.size());
    ShardProblem p;
    p.options = kAllCeOptions;
    p.widths = widths;
    check_shards(p, rng);
  }
}

TEST(CeShard, RejectsASliceOutsideTheVocabulary) {
  const Tensor logits = Tensor::of(Matrix(2, 4), DType::f32);
  const Tensor target = Tensor::of_integers({0, 1}, DType::i64);
  Tensor partial = Tensor::matrix(DType::f32, 2, kCeShardStatsWidth);
  expect_invalid(
      [&] {
        ce_shard_stats(logits.view(), target.view(), {7, 10}, {}, partial.view());
      },
      "vocab_offset", "7");
  expect_invalid(
      [&] {
        ce_shard_stats(logits.view(), target.view(), {0, 0}, {}, partial.view());
      },
      "vocab", "0");
  if (!on_gpu()) {
    const Tensor bad = Tensor::of_integers({0, 10}, DType::i64);
    expect_invalid(
        [&] {
          ce_shard_stats(logits.view(), bad.view(), {0, 10}, {}, partial.view());
        },
        "target", "10");
  }
}

}  // namespace
}  // namespace xent::test
