// distill with a top-k teacher (docs/semantics.md §3.1): every kind and topk_mass with each option
// and every reduction against the float64 reference, the special rows (absent entries, a row with
// no entry, ids covering the vocabulary), then the errors.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "distill_check.hpp"
#if XENT_TEST_ON_GPU
#include "hook_scope.hpp"
#endif

namespace xent::test {
namespace {

const std::vector<DistillKind> kKinds = {DistillKind::forward_kl, DistillKind::reverse_kl,
                                         DistillKind::jsd, DistillKind::soft_ce, DistillKind::tvd};
const std::vector<TopKMass> kMasses = {TopKMass::renormalize, TopKMass::tail, TopKMass::ignore};

struct TopKProblem {
  DType dtype = DType::f32;
  int64_t rows = 23;
  int64_t vocab = 517;
  int64_t k = 20;
  DistillKind kind = DistillKind::forward_kl;
  TopKMass mass = TopKMass::renormalize;
  unsigned options = 0;
  Reduction reduction = Reduction::mean;
  DType id_dtype = DType::i64;
  bool absent_entries = true;  // some rows end early (−1), one row has none
  bool in_place = false;
  int64_t row_stride = -1;  // of student and grad: V' columns of a wider student (§3.2)
  bool bad_ids = false;     // GPU: row 1 holds an id twice, row 3 one past V (NaN rows)
};

// The rows a bad_ids problem makes NaN on a GPU (the CPU reports the ids instead).
constexpr int64_t kBadRows[] = {1, 3};

// The device's copy of the ids: with bad_ids, row 1's second entry repeats its first and row 3's
// first is V (the reference is formed from the valid ids; those rows are checked apart).
reference::TopKSpec device_topk(reference::TopKSpec spec, const TopKProblem& p) {
  if (!p.bad_ids) return spec;
  spec.ids[1 * p.k + 1] = spec.ids[1 * p.k];
  spec.ids[3 * p.k] = p.vocab;
  return spec;
}

// With bad_ids: every value of the bad rows NaN, which are then given the reference's values
// so that the other rows are compared as usual.
std::vector<double> checked_bad_rows(std::vector<double> out, const std::vector<double>& expected,
                                     int64_t cols, const TopKProblem& p) {
  if (!p.bad_ids) return out;
  for (const int64_t n : kBadRows) {
    int64_t finite = 0;
    for (int64_t i = n * cols; i < (n + 1) * cols; ++i) {
      finite += std::isnan(out[i]) ? 0 : 1;
      out[i] = expected[i];
    }
    EXPECT_EQ(finite, 0) << "values of bad row " << n << " not NaN";
  }
  return out;
}

// The teacher's top-k of a full teacher, its log-probabilities rounded to float32, in a shuffled
// order, with absent entries.
reference::TopKSpec make_topk(Rng& rng, const Matrix& teacher, const TopKProblem& p) {
  reference::TopKSpec spec;
  spec.k = p.k;
  spec.mass = p.mass;
  for (int64_t n = 0; n < teacher.rows; ++n) {
    std::vector<double> v(teacher.cols);
    for (int64_t i = 0; i < teacher.cols; ++i) v[i] = teacher.at(n, i);
    const double lse = reference::log_sum_exp(v);
    std::vector<int64_t> order(teacher.cols);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + p.k, order.end(),
                      [&](int64_t a, int64_t b) { return v[a] > v[b]; });
    int64_t present = p.k;
    if (p.absent_entries && n % 5 == 1) present = rng.integer(1, p.k - 1);
    if (p.absent_entries && n == 2) present = 0;
    std::vector<int64_t> slots(p.k);
    std::iota(slots.begin(), slots.end(), 0);
    for (int64_t j = p.k - 1; j > 0; --j) std::swap(slots[j], slots[rng.integer(0, j)]);
    std::vector<int64_t> ids(p.k, -1);
    std::vector<double> logprobs(p.k, 0.0);
    for (int64_t j = 0; j < present; ++j) {
      ids[slots[j]] = order[j];
      logprobs[slots[j]] = round_to(DType::f32, v[order[j]] - lse);
    }
    spec.ids.insert(spec.ids.end(), ids.begin(), ids.end());
    spec.logprobs.insert(spec.logprobs.end(), logprobs.begin(), logprobs.end());
  }
  return spec;
}

struct TopKTensors {
  Tensor ids, logprobs;
  TopKTeacher view(TopKMass mass) const { return {ids.view(), logprobs.view(), mass}; }
};

TopKTensors topk_tensors(const reference::TopKSpec& spec, int64_t rows, DType id_dtype) {
  TopKTensors t;
  t.ids = Tensor::matrix(id_dtype, rows, spec.k);
  t.ids.upload_integers(spec.ids);
  Matrix logprobs(rows, spec.k);
  logprobs.values = spec.logprobs;
  t.logprobs = Tensor::of(logprobs, DType::f32);
  return t;
}

void check_topk(const TopKProblem& p, Rng& rng) {
  const int64_t rows = p.rows, vocab = p.vocab;
  DistillSetup setup = make_distill_setup(p.kind, p.options, p.reduction, 0.5);
  const bool with_target = !(p.options & kNoTarget);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  Matrix student = rounded(rng.matrix(rows, vocab, 2.0), p.dtype);
  const Matrix teacher = make_teacher(rng, student, 2.0);
  const reference::TopKSpec topk = make_topk(rng, teacher, p);
  const TopKTensors topk_t = topk_tensors(device_topk(topk, p), rows, p.id_dtype);
  const TopKTeacher view = topk_t.view(p.mass);

  const reference::Upstream upstream = make_upstream(rng, p.reduction, rows, false);
  const auto* tgt = with_target ? &target : nullptr;
  const reference::DistillResult ref =
      reference::distill_topk(student, topk, tgt, setup.spec, upstream);

  Tensor student_tensor = Tensor::of(student, p.dtype, p.row_stride);
  const Tensor target_tensor = with_target ? Tensor::of_integers(target, DType::i64) : Tensor();
  const Tensor grad_output = upstream_tensor(upstream, p.reduction, rows, p.dtype);
  const Scratch scratch(distill_workspace_size(rows, vocab, setup.options, test_device()));
  const double loss_tol = stat_tolerance(p.dtype, Family::logits, {}, ref.loss);
  // tvd's near-ties may land on either side (distill_check.cpp): the slack of the reference
  // with them at the midpoint, for a band of the rounding of a float probability.
  double largest = 0.0;
  for (const double v : student.values) largest = std::max(largest, std::abs(v));
  reference::DistillSpec tie_spec = setup.spec;
  tie_spec.tvd_tie_band = p.kind == DistillKind::tvd ? 8 * 0x1p-23 * (largest + 8.0) : 0.0;
  const reference::DistillResult midpoint =
      reference::distill_topk(student, topk, tgt, tie_spec, upstream);
  const double grad_tol =
      grad_tolerance(p.dtype, Family::logits, rounded(ref.grad.values, p.dtype), ref.grad.values) +
      2 * relative_error(midpoint.grad.values, ref.grad.values);
  {
    SCOPED_TRACE("distill_topk_forward, loss only");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    DistillOutputs out;
    out.loss = loss.view();
    distill_topk_forward(student_tensor.view(), view, target_tensor.view(), setup.options, out, {},
                         scratch.workspace());
    finish();
    EXPECT_TRUE(
        close("loss", checked_bad_rows(loss.download(), ref.loss, 1, p), ref.loss, loss_tol));
  }
  Tensor grad_storage = p.in_place ? Tensor() : Tensor::matrix(p.dtype, rows, vocab, p.row_stride);
  Tensor& grad = p.in_place ? student_tensor : grad_storage;
  {
    SCOPED_TRACE("distill_topk_forward, with gradient");
    Tensor loss = loss_tensor(p.reduction, rows, p.dtype);
    DistillOutputs out;
    out.loss = loss.view();
    out.grad_student = grad.view();
    distill_topk_forward(student_tensor.view(), view, target_tensor.view(), setup.options, out,
                         grad_output.view(), scratch.workspace());
    finish();
    EXPECT_TRUE(
        close("loss", checked_bad_rows(loss.download(), ref.loss, 1, p), ref.loss, loss_tol));
    EXPECT_TRUE(close("grad_student", checked_bad_rows(grad.download(), ref.grad.values, vocab, p),
                      ref.grad.values, grad_tol));
    EXPECT_TRUE(grad.padding_untouched()) << "grad_student written outside its columns";
  }
  {
    SCOPED_TRACE("distill_topk_backward");
    grad.poison();
    if (p.in_place) student_tensor.upload(student.values);
    distill_topk_backward(student_tensor.view(), view, target_tensor.view(), grad_output.view(),
                          setup.options, grad.view(), scratch.workspace());
    finish();
    EXPECT_TRUE(close("grad_student", checked_bad_rows(grad.download(), ref.grad.values, vocab, p),
                      ref.grad.values, grad_tol));
    EXPECT_TRUE(grad.padding_untouched()) << "grad_student written outside its columns";
  }
}

bool valid_combination(DistillKind kind, TopKMass mass, unsigned options) {
  if (mass == TopKMass::ignore && kind != DistillKind::forward_kl && kind != DistillKind::soft_ce)
    return false;
  return !(mass != TopKMass::renormalize && (options & kTemperature));
}

using TopKParam = std::tuple<DType, DistillKind, TopKMass, unsigned, Reduction>;

class DistillTopK : public ::testing::TestWithParam<TopKParam> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(DistillTopK, MatchesReference) {
  XENT_TEST_RNG(rng);
  TopKProblem p;
  std::tie(p.dtype, p.kind, p.mass, p.options, p.reduction) = GetParam();
  check_topk(p, rng);
}

std::string mass_label(TopKMass mass) { return topk_mass_name(mass); }

// Every valid (kind, topk_mass, option) in fp32 and bf16 with every reduction.
std::vector<TopKParam> topk_grid() {
  std::vector<TopKParam> grid;
  for (const DType dtype : {DType::f32, DType::bf16})
    for (const DistillKind kind : kKinds)
      for (const TopKMass mass : kMasses)
        for (const unsigned options : {0u, unsigned{kTemperature}, unsigned{kDistillSoftcap},
                                       unsigned{kHardAndSoft}, unsigned{kNoTarget}})
          for (const Reduction reduction : {Reduction::none, Reduction::sum, Reduction::mean})
            if (valid_combination(kind, mass, options))
              grid.emplace_back(dtype, kind, mass, options, reduction);
  return grid;
}

INSTANTIATE_TEST_SUITE_P(EachOption, DistillTopK, ::testing::ValuesIn(topk_grid()),
                         [](const ::testing::TestParamInfo<TopKParam>& info) {
                           return short_name(std::get<0>(info.param)) + "_" +
                                  distill_kind_name(std::get<1>(info.param)) + "_" +
                                  mass_label(std::get<2>(info.param)) + "_" +
                                  distill_options_label(std::get<3>(info.param)) + "_" +
                                  reduction_label(std::get<4>(info.param));
                         });

// Every valid (kind, topk_mass) on float64 inputs (float32 on a GPU), `adjust` setting the case's other fields.
template <class Adjust>
void check_each_kind_and_mass(Rng& rng, Adjust&& adjust) {
  for (const DistillKind kind : kKinds) {
    for (const TopKMass mass : kMasses) {
      if (!valid_combination(kind, mass, 0)) continue;
      TopKProblem p;
      p.dtype = on_gpu() ? DType::f32 : DType::f64;  // float64 is a CPU dtype
      p.kind = kind;
      p.mass = mass;
      adjust(p);
      check_topk(p, rng);
    }
  }
}

TEST(DistillTopKCases, Float64Int32InPlace) {
  require_device();
  XENT_TEST_RNG(rng);
  check_each_kind_and_mass(rng, [](TopKProblem& p) {
    p.id_dtype = DType::i32;
    p.in_place = true;
    p.reduction = Reduction::none;
  });
}

// k = V: the ids cover the vocabulary, so there is no tail category.
TEST(DistillTopKCases, IdsCoverTheVocabulary) {
  require_device();
  XENT_TEST_RNG(rng);
  check_each_kind_and_mass(rng, [](TopKProblem& p) {
    p.vocab = 29;
    p.k = 29;
    p.absent_entries = false;
  });
}

// The V' shared columns of a wider student (docs/semantics.md §3.2): the student and its
// gradient read and written through their own row stride, the NaN-poisoned columns past V' never
// read nor written.
TEST(DistillTopKCases, SharedColumnsOfAWiderStudent) {
  require_device();
  XENT_TEST_RNG(rng);
  check_each_kind_and_mass(rng, [](TopKProblem& p) {
    p.row_stride = p.vocab + 11;
    p.reduction = Reduction::sum;
  });
}

// ---- the CUDA row kernel's paths (rows/distill_topk.cu) ------------------------------------------

// Each mass with and without the hard-label term on bf16 rows of `vocab`, `adjust` setting the
// case's other fields.
template <class Adjust>
void check_each_mass_and_hard(Rng& rng, int64_t vocab, Adjust&& adjust) {
  for (const TopKMass mass : kMasses) {
    for (const unsigned options : {0u, unsigned{kHardAndSoft}}) {
      TopKProblem p;
      p.dtype = DType::bf16;
      p.rows = 3;
      p.vocab = vocab;
      p.k = 64;
      p.mass = mass;
      p.kind = mass == TopKMass::renormalize ? DistillKind::reverse_kl : DistillKind::forward_kl;
      p.options = options;
      p.reduction = Reduction::none;
      adjust(p);
      SCOPED_TRACE(testing::Message() << "V " << vocab << ", " << topk_mass_name(mass)
                                      << (options ? ", hard term" : ""));
      check_topk(p, rng);
    }
  }
}

// Rows split over a cluster of CTAs on Hopper (131071: 4 slices, 262147: 8), the tail mass in
// place; a row too long to stage in a cluster of 8 (streamed from HBM twice).
TEST(DistillTopKRows, LongRowsOverClusters) {
  if (!on_gpu()) GTEST_SKIP() << "the CUDA row kernel's plans";
  XENT_TEST_RNG(rng);
  for (const int64_t vocab : {131071, 262147}) {
    check_each_mass_and_hard(rng, vocab,
                             [](TopKProblem& p) { p.in_place = p.mass == TopKMass::tail; });
  }
  TopKProblem p;
  p.dtype = DType::bf16;
  p.rows = 2;
  p.vocab = 1000003;
  p.k = 64;
  p.mass = TopKMass::tail;
  p.options = kHardAndSoft;
  p.reduction = Reduction::sum;
  check_topk(p, rng);
}

// Rows that start off the 16-byte grid (odd V, an odd row stride: scalar staging and stores)
// and k at its maximum.
TEST(DistillTopKRows, MisalignedRowsAndLargestK) {
  require_device();
  XENT_TEST_RNG(rng);
  check_each_mass_and_hard(rng, 1031, [](TopKProblem& p) { p.row_stride = p.vocab + 3; });
  check_each_mass_and_hard(rng, 4099, [](TopKProblem& p) {
    p.k = kDistillTopKMaxK;
    p.in_place = true;
  });
}

// A duplicated id and an id past V make their rows NaN on a GPU, every mass.
TEST(DistillTopKRows, BadIdsGiveNaNRows) {
  if (!on_gpu()) GTEST_SKIP() << "the CPU reports the ids (DistillTopKErrors)";
  XENT_TEST_RNG(rng);
  check_each_mass_and_hard(rng, 2053, [](TopKProblem& p) {
    p.rows = 5;
    p.options = kNoTarget;
    p.absent_entries = false;
    p.bad_ids = true;
  });
}

#if XENT_TEST_ON_GPU
// The portable paths forced on any GPU: one CTA a row, staged by cp.async (40000 bf16) or
// streamed twice (131071).
TEST(DistillTopKRows, PortablePaths) {
  require_device();
  HookScope hook;
  hook->portable_paths = cuda::Forced::on;
  XENT_TEST_RNG(rng);
  for (const int64_t vocab : {40000, 131071}) {
    check_each_mass_and_hard(rng, vocab,
                             [](TopKProblem& p) { p.in_place = p.mass != TopKMass::tail; });
  }
}
#endif

// ---- errors ------------------------------------------------------------------------------------

struct ErrorCall {
  Rng rng{fresh_seed()};
  Tensor student = Tensor::of(rng.matrix(4, 13, 1.0), DType::f32);
  Tensor ids = Tensor::matrix(DType::i64, 4, 3);
  Tensor logprobs = Tensor::of(Matrix(4, 3), DType::f32);
  Tensor loss = Tensor::scalar(DType::f32);
  DistillOptions options;
  TopKMass mass = TopKMass::renormalize;

  ErrorCall() {
    ids.upload_integers({0, 1, 2, 3, 4, -1, 5, -1, -1, 6, 7, 8});
    Matrix l(4, 3);
    for (double& v : l.values) v = -2.0;
    logprobs.upload(l.values);
  }
  std::string run() {
    try {
      DistillOutputs out;
      out.loss = loss.view();
      distill_topk_forward(student.view(), {ids.view(), logprobs.view(), mass}, {}, options, out);
    } catch (const Error& e) {
      EXPECT_TRUE(loss.untouched()) << "the loss was written before the error";
      return e.what();
    }
    return "no error";
  }
};

void expect_error(ErrorCall& call, const std::string& part) {
  const std::string message = call.run();
  EXPECT_NE(message.find(part), std::string::npos) << message;
}

// The values of ids and logprobs are checked on the host: CPU tensors only.
TEST(DistillTopKErrors, Messages) {
  if (on_gpu()) GTEST_SKIP() << "value checks read host memory";
  {
    ErrorCall c;
    c.ids.upload_integers({0, 1, 13, 3, 4, -1, 5, -1, -1, 6, 7, 8});
    expect_error(c, "teacher.ids out of range: got ids[0, 2] = 13");
  }
  {
    ErrorCall c;
    c.ids.upload_integers({0, 1, 2, 3, 4, -1, 5, -1, -1, 6, 7, -2});
    expect_error(c, "ids[3, 2] = -2");
  }
  {
    ErrorCall c;
    c.ids.upload_integers({0, 1, 2, 3, 4, -1, 5, -1, 5, 6, 7, 8});
    expect_error(c, "duplicate id");
  }
  {
    ErrorCall c;
    Matrix l(4, 3);
    for (double& v : l.values) v = -1.0;
    l.values[4] = 0.5;
    c.logprobs.upload(l.values);
    expect_error(c, "teacher.logprobs above 0: got logprobs[1, 1] = 0.5");
  }
  {
    ErrorCall c;
    c.logprobs = Tensor::of(Matrix(4, 2), DType::f32);
    expect_error(c, "teacher.logprobs");
  }
  {
    ErrorCall c;
    c.ids = Tensor::matrix(DType::i64, 3, 3);
    c.ids.upload_integers({0, 1, 2, 3, 4, 5, 6, 7, 8});
    expect_error(c, "teacher.ids");
  }
  {
    ErrorCall c;
    c.mass = TopKMass::tail;
    c.options.temperature = 2.0;
    expect_error(c, "renormalize");
  }
  {
    ErrorCall c;
    c.mass = TopKMass::ignore;
    c.options.kind = DistillKind::jsd;
    expect_error(c, "not defined with topk_mass ignore");
  }
}

}  // namespace
}  // namespace xent::test
