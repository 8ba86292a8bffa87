// Vocabulary-parallel distillation (xent/distill_shard.hpp): the vocabulary is split into uneven
// slices, each slice's records are computed on its own, the test gathers them by hand (what
// all_gather does between ranks), runs pass 2 for jsd and tvd, and the loss and the gradient of
// each slice must match the float64 reference of the whole vocabulary; again from the records
// folded into one per row (common::fold_distill_record, as linear_distill's blocked pass does).
#include <cmath>
#include <limits>
#include <vector>

#include "common/distill_shard.hpp"
#include "distill_check.hpp"
#include "xent/distill_shard.hpp"

namespace xent::test {
namespace {

const std::vector<DistillKind> kKinds = {DistillKind::forward_kl, DistillKind::reverse_kl,
                                         DistillKind::jsd, DistillKind::soft_ce, DistillKind::tvd};

struct DistillShardProblem {
  DType dtype = DType::f32;
  DistillKind kind = DistillKind::forward_kl;
  unsigned options = 0;
  Reduction reduction = Reduction::mean;
  // Uneven, odd, summing to V; small, as a seed sweep runs the grid a thousand times.
  std::vector<int64_t> widths{257, 7, 333};
  int64_t rows = 23;
  bool class_weight = false;  // class weights on the hard term (sliced with the vocabulary)
  double teacher_sd = 0.0;    // > 0: an independent, this peaked teacher
  bool nan_row = false;       // a NaN in one student row (inside the first slice)
  double beta = 0.5;          // jsd
};

DType record_dtype(DType input) { return input == DType::f64 ? DType::f64 : DType::f32; }

// The rank-major concatenation of per-rank records [N, width] → [P·N, width].
Tensor gathered_of(const std::vector<std::vector<double>>& parts, int64_t rows, int64_t width,
                   DType dtype) {
  Matrix all(static_cast<int64_t>(parts.size()) * rows, width);
  all.values.clear();
  for (const auto& part : parts) all.values.insert(all.values.end(), part.begin(), part.end());
  return Tensor::of(all, record_dtype(dtype));
}

// Every slice's records [N, width] folded into one record per row in slice order, in the
// records' own precision (the argmax travels bit-cast in it).
template <class T>
std::vector<double> folded_in(const std::vector<std::vector<double>>& records, int64_t rows,
                              DistillKind kind) {
  const std::size_t width = kDistillShardStatsWidth;
  std::vector<T> folded(records[0].begin(), records[0].end());
  for (std::size_t s = 1; s < records.size(); ++s) {
    const std::vector<T> part(records[s].begin(), records[s].end());
    for (int64_t n = 0; n < rows; ++n) {
      T* row = folded.data() + static_cast<std::size_t>(n) * width;
      common::fold_distill_record(static_cast<common::DistillKindCode>(kind), row,
                                  part.data() + static_cast<std::size_t>(n) * width, row);
    }
  }
  return std::vector<double>(folded.begin(), folded.end());
}

Matrix folded_records(const std::vector<std::vector<double>>& records, int64_t rows,
                      DistillKind kind, DType dtype) {
  Matrix m(rows, kDistillShardStatsWidth);
  m.values = record_dtype(dtype) == DType::f64 ? folded_in<double>(records, rows, kind)
                                               : folded_in<float>(records, rows, kind);
  return m;
}

void check_distill_shards(const DistillShardProblem& p, Rng& rng) {
  int64_t vocab = 0;
  for (const int64_t w : p.widths) vocab += w;
  const int64_t rows = p.rows, ranks = static_cast<int64_t>(p.widths.size());
  DistillSetup setup = make_distill_setup(p.kind, p.options, p.reduction, p.beta);
  const bool with_target = !(p.options & kNoTarget);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, true);
  Matrix student = rng.matrix(rows, vocab, 2.0);
  Matrix teacher =
      p.teacher_sd > 0 ? rng.matrix(rows, vocab, p.teacher_sd) : make_teacher(rng, student, 2.0);
  const int64_t nan_row = p.nan_row && (!with_target || target[3] != -100) ? 3 : -1;
  if (nan_row >= 0) student.at(nan_row, 2) = std::numeric_limits<double>::quiet_NaN();
  student = rounded(student, p.dtype);
  teacher = rounded(teacher, p.dtype);
  std::vector<double> class_weight;
  if (p.class_weight) {
    class_weight = rng.uniform_vector(vocab, 0.5, 1.5);
    setup.spec.ce.class_weight = class_weight;
  }
  const reference::Upstream upstream = make_upstream(rng, p.reduction, rows, false);
  const auto* target_ptr = with_target ? &target : nullptr;
  const reference::DistillResult ref =
      reference::distill(student, teacher, target_ptr, setup.spec, upstream);
  const Tensor target_tensor = with_target ? Tensor::of_integers(target, DType::i64) : Tensor();
  const Tensor grad_output = upstream_tensor(upstream, p.reduction, rows, p.dtype);
  const Scratch scratch(distill_shard_workspace_size(rows, test_device()));

  // Pass 1 on every slice; class weights are sliced with the vocabulary.
  std::vector<Tensor> students, teachers, weights;
  std::vector<DistillOptions> options;
  std::vector<int64_t> offsets;
  std::vector<std::vector<double>> records;
  int64_t offset = 0;
  for (const int64_t width : p.widths) {
    offsets.push_back(offset);
    students.push_back(Tensor::of(columns(student, offset, width), p.dtype));
    teachers.push_back(Tensor::of(columns(teacher, offset, width), p.dtype));
    DistillOptions o = setup.options;
    if (p.class_weight) {
      weights.push_back(Tensor::of(
          std::vector<double>(class_weight.begin() + offset, class_weight.begin() + offset + width),
          DType::f32));
      o.ce.class_weight = weights.back().view();
    }
    options.push_back(o);
    Tensor partial = Tensor::matrix(record_dtype(p.dtype), rows, kDistillShardStatsWidth);
    partial.poison();
    distill_shard_stats(students.back().view(), teachers.back().view(), target_tensor.view(),
                        {offset, vocab}, o, partial.view(), scratch.workspace());
    finish();
    records.push_back(partial.download());
    offset += width;
  }
  const Tensor gathered = gathered_of(records, rows, kDistillShardStatsWidth, p.dtype);

  // Pass 2 (jsd, tvd): every slice's sums against the lse of `merged`.
  auto slice_sums = [&](const Tensor& merged) {
    std::vector<std::vector<double>> sums;
    for (int64_t s = 0; s < ranks; ++s) {
      Tensor part = Tensor::matrix(record_dtype(p.dtype), rows, kDistillShardSumsWidth);
      part.poison();
      distill_shard_sums(students[s].view(), teachers[s].view(), target_tensor.view(),
                         {offsets[s], vocab}, merged.view(), options[s], part.view(),
                         scratch.workspace());
      finish();
      sums.push_back(part.download());
    }
    return sums;
  };
  Tensor gathered_sums;
  if (distill_shard_needs_sums(p.kind)) {
    gathered_sums = gathered_of(slice_sums(gathered), rows, kDistillShardSumsWidth, p.dtype);
  }

  // tvd's near-ties may land on either side (see check_distill): the band of the probabilities'
  // error in the compute type, from one ulp of the largest |logit| in log p = v − lse.
  double largest = 0.0;
  for (const Matrix* m : {&student, &teacher})
    for (double v : m->values)
      if (std::isfinite(v)) largest = std::max(largest, std::abs(v));
  const double ulp = p.dtype == DType::f64 ? 0x1p-52 : 0x1p-23;
  const double slice_band = 8 * ulp * (largest + 8.0);

  // The loss and every slice's gradient from `merged` (the records of every rank, or one record
  // per row folded from all of them) and its sums; `band` bounds the relative error of the
  // probabilities the backward forms from `merged` (tvd's tie model).
  auto check_merged = [&](const Tensor& merged, const Tensor& merged_sums, double band) {
    const bool loss_all_nan = nan_row >= 0 && p.reduction != Reduction::none;
    {
      SCOPED_TRACE("distill_shard_loss");
      Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
      loss.poison();
      distill_shard_loss(merged.view(), merged_sums.view(), target_tensor.view(), rows, {0, vocab},
                         setup.options, loss.view(), scratch.workspace());
      finish();
      std::vector<double> out = loss.download();
      std::vector<double> expected = ref.loss;
      if (loss_all_nan) {
        EXPECT_TRUE(std::isnan(out[0])) << "a NaN student logit must make the loss NaN";
      } else {
        if (nan_row >= 0) {
          EXPECT_TRUE(std::isnan(out[nan_row])) << "NaN row loss " << out[nan_row];
          out[nan_row] = expected[nan_row] = 0;
        }
        EXPECT_TRUE(
            close("loss", out, expected, stat_tolerance(p.dtype, Family::logits, {}, expected)));
      }
    }

    SCOPED_TRACE("distill_shard_backward");
    Matrix grad(rows, vocab);
    for (int64_t s = 0; s < ranks; ++s) {
      Tensor g = Tensor::matrix(p.dtype, rows, p.widths[s]);
      g.poison();
      distill_shard_backward(students[s].view(), teachers[s].view(), target_tensor.view(),
                             {offsets[s], vocab}, merged.view(), merged_sums.view(),
                             grad_output.view(), options[s], g.view(), scratch.workspace());
      finish();
      const std::vector<double> values = g.download();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < p.widths[s]; ++c)
          grad.at(r, offsets[s] + c) = values[static_cast<std::size_t>(r * p.widths[s] + c)];
    }
    std::vector<double> expected = ref.grad.values;
    if (nan_row >= 0) {
      bool any_nan = false;
      for (int64_t i = 0; i < vocab; ++i) {
        any_nan |= std::isnan(grad.at(nan_row, i));
        grad.at(nan_row, i) = expected[static_cast<std::size_t>(nan_row * vocab + i)] = 0;
      }
      EXPECT_TRUE(any_nan) << "the NaN row's gradient must show the NaN";
    }
    std::vector<double> midpoint =
        tvd_ties_at_midpoint(student, teacher, target_ptr, setup.spec, upstream, band).grad.values;
    if (nan_row >= 0) {
      for (int64_t i = 0; i < vocab; ++i)
        midpoint[static_cast<std::size_t>(nan_row * vocab + i)] = 0;
    }
    const double grad_tol =
        grad_tolerance(p.dtype, Family::logits, rounded(expected, p.dtype), expected) +
        2 * relative_error(midpoint, expected);
    EXPECT_TRUE(close("grad_student", grad.values, expected, grad_tol));
  };
  {
    SCOPED_TRACE("records of every rank");
    check_merged(gathered, gathered_sums, slice_band);
  }
  // One record per row, folded slice after slice (linear_distill's vocabulary-blocked pass does
  // this on the GPU), and the sums added up: the same loss and gradients.
  SCOPED_TRACE("records folded into one");
  const Tensor folded =
      Tensor::of(folded_records(records, rows, p.kind, p.dtype), record_dtype(p.dtype));
  // The sums formed against the folded record's lse (as linear_distill's second sweep does), not
  // the gathered ones: the backward classifies each element of tvd against its own lse, and sums
  // from another lse may count a near-tie on the other side (or as equal), which leaves Σ p_s·u
  // short of that element's p_s/2 in the whole row's gradient.
  Tensor folded_sums;
  if (distill_shard_needs_sums(p.kind)) {
    std::vector<double> total(static_cast<std::size_t>(rows * kDistillShardSumsWidth), 0.0);
    for (const std::vector<double>& sums : slice_sums(folded)) {
      for (std::size_t i = 0; i < sums.size(); ++i) total[i] += sums[i];
    }
    Matrix m(rows, kDistillShardSumsWidth);
    m.values = total;
    folded_sums = Tensor::of(m, record_dtype(p.dtype));
  }
  // Each fold rounds the lse of student and teacher once more in the records' precision, and an
  // error δ in an lse is a relative error δ in every probability of its row, so a near-tie of tvd
  // may flip further out than in the slices' band: widen it by the fold's own error, measured
  // against the slices' lse merged in float64.
  double fold_error = 0.0;
  const std::vector<double> folded_values = folded.download();
  for (int64_t n = 0; n < rows; ++n) {
    double error = 0.0;
    for (const int64_t field : {kDistillShardLseStudent, kDistillShardLseTeacher}) {
      const auto at = static_cast<std::size_t>(n * kDistillShardStatsWidth + field);
      double top = -std::numeric_limits<double>::infinity(), sum = 0.0;
      for (const auto& record : records) top = std::max(top, record[at]);
      if (!std::isfinite(top)) continue;  // the NaN row, or every slice empty
      for (const auto& record : records) sum += std::exp(record[at] - top);
      error += std::abs(folded_values[at] - (top + std::log(sum)));
    }
    if (std::isfinite(error)) fold_error = std::max(fold_error, error);
  }
  check_merged(folded, folded_sums, slice_band + 2 * fold_error);
}

using DistillShardParam = std::tuple<DType, DistillKind, unsigned, Reduction>;

class DistillShardGrid : public ::testing::TestWithParam<DistillShardParam> {};

TEST_P(DistillShardGrid, MatchesReferenceOfWholeVocabulary) {
  require_device();
  XENT_TEST_RNG(rng);
  DistillShardProblem p;
  std::tie(p.dtype, p.kind, p.options, p.reduction) = GetParam();
  check_distill_shards(p, rng);
}

std::string grid_name(const ::testing::TestParamInfo<DistillShardParam>& info) {
  return short_name(std::get<0>(info.param)) + "_" + distill_kind_name(std::get<1>(info.param)) +
         "_" + distill_options_label(std::get<2>(info.param)) + "_" +
         reduction_label(std::get<3>(info.param));
}

std::vector<DType> shard_dtypes() {
  std::vector<DType> dtypes{DType::f32, DType::bf16};
  if (!on_gpu()) dtypes.push_back(DType::f64);
  return dtypes;
}

INSTANTIATE_TEST_SUITE_P(Options, DistillShardGrid,
                         ::testing::Combine(::testing::ValuesIn(shard_dtypes()),
                                            ::testing::ValuesIn(kKinds),
                                            ::testing::ValuesIn(distill_option_sets_up_to_pairs()),
                                            kAllReductions),
                         grid_name);

// Special cases, every kind: one slice and slices of one column, class weights on the hard term,
// a peaked teacher (most probabilities underflow), a NaN student row.
TEST(DistillShard, SpecialCasesOfEveryKind) {
  require_device();
  XENT_TEST_RNG(rng);
  for (const DistillKind kind : kKinds) {
    SCOPED_TRACE(distill_kind_name(kind));
    for (const auto& widths :
         std::vector<std::vector<int64_t>>{{1031}, {1, 1, 1029}, {344, 344, 343}}) {
      SCOPED_TRACE(::testing::Message() << "slices " << widths.size());
      DistillShardProblem p;
      p.kind = kind;
      p.options = kTemperature | kDistillSoftcap | kHardAndSoft;
      p.widths = widths;
      check_distill_shards(p, rng);
    }
    DistillShardProblem weighted;
    weighted.kind = kind;
    weighted.options = kHardAndSoft;
    weighted.class_weight = true;
    for (const Reduction reduction : {Reduction::none, Reduction::sum, Reduction::mean}) {
      SCOPED_TRACE("class weights");
      weighted.reduction = reduction;
      check_distill_shards(weighted, rng);
    }
    DistillShardProblem peaked;
    peaked.kind = kind;
    peaked.teacher_sd = 30.0;
    {
      SCOPED_TRACE("peaked teacher");
      check_distill_shards(peaked, rng);
    }
    DistillShardProblem nan;
    nan.kind = kind;
    nan.nan_row = true;
    for (const Reduction reduction : {Reduction::none, Reduction::mean}) {
      SCOPED_TRACE("NaN row");
      nan.reduction = reduction;
      check_distill_shards(nan, rng);
    }
  }
}

TEST(DistillShard, JsdBetaEdges) {
  require_device();
  XENT_TEST_RNG(rng);
  for (const double beta : {0.0, 0.25, 1.0}) {
    SCOPED_TRACE(::testing::Message() << "beta " << beta);
    DistillShardProblem p;
    p.kind = DistillKind::jsd;
    p.beta = beta;
    for (const Reduction reduction : {Reduction::none, Reduction::mean}) {
      p.reduction = reduction;
      check_distill_shards(p, rng);
    }
  }
}

TEST(DistillShard, RejectsBadRecordsAndKinds) {
  const Tensor logits = Tensor::of(Matrix(2, 4), DType::f32);
  const Tensor target = Tensor::of_integers({0, 1}, DType::i64);
  Tensor partial = Tensor::matrix(DType::f32, 2, kDistillShardStatsWidth);
  DistillOptions options;
  expect_invalid(
      [&] {
        distill_shard_stats(logits.view(), logits.view(), target.view(), {7, 10}, options,
                            partial.view());
      },
      "vocab_offset", "7");
  Tensor narrow = Tensor::matrix(DType::f32, 2, kCeShardStatsWidth);
  expect_invalid(
      [&] {
        distill_shard_stats(logits.view(), logits.view(), target.view(), {0, 10}, options,
                            narrow.view());
      },
      "partial", "9");
  Tensor sums = Tensor::matrix(DType::f32, 2, kDistillShardSumsWidth);
  expect_invalid(
      [&] {
        distill_shard_sums(logits.view(), logits.view(), target.view(), {0, 10}, partial.view(),
                           options, sums.view());
      },
      "kind", "forward_kl");
  options.kind = DistillKind::jsd;
  Tensor loss = Tensor::scalar(DType::f32);
  expect_invalid(
      [&] {
        distill_shard_loss(partial.view(), Tensor().view(), target.view(), 2, {0, 10}, options,
                           loss.view());
      },
      "gathered_sums", "absent");
}

}  // namespace
}  // namespace xent::test
