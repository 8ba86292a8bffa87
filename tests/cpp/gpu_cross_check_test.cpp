// CUDA against the CPU backend on identical inputs, for every op (xent_gpu_tests only). Each
// backend is held to the reference tolerance, and the two to twice it between themselves.
#include <cstring>

#include "linear_check.hpp"

namespace xent::test {
namespace {

// A tensor in host memory with a CPU view, beside the device Tensor of the suites.
struct HostTensor {
  DType dtype = DType::f32;
  int ndim = -1;
  int64_t rows = 0, cols = 1;
  std::vector<unsigned char> bytes;

  static HostTensor of(const Matrix& m, DType d) {
    return {d, 2, m.rows, m.cols, encode(d, m.values)};
  }
  static HostTensor of(const std::vector<double>& v, DType d) {
    return {d, 1, static_cast<int64_t>(v.size()), 1, encode(d, v)};
  }
  static HostTensor of_integers(const std::vector<int64_t>& v) {
    HostTensor t{DType::i64, 1, static_cast<int64_t>(v.size()), 1, {}};
    t.bytes.resize(v.size() * 8);
    std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    return t;
  }
  static HostTensor output(DType d, int dims, int64_t r, int64_t c = 1) {
    return {d, dims, r, c, std::vector<unsigned char>(r * c * dtype_size(d), 0)};
  }
  TensorView view() {
    if (ndim < 0) return {};
    if (ndim == 0) return scalar(bytes.data(), dtype);
    if (ndim == 1) return vector(bytes.data(), dtype, rows);
    return matrix(bytes.data(), dtype, rows, cols);
  }
  std::vector<double> values() const { return decode(dtype, bytes); }
};

// Both backends within `tol` of the reference, and within 2·tol of each other.
void expect_agree(const std::string& what, const std::vector<double>& gpu,
                  const std::vector<double>& cpu, const std::vector<double>& ref, double tol) {
  EXPECT_TRUE(close(what + " (CUDA vs reference)", gpu, ref, tol));
  EXPECT_TRUE(close(what + " (CPU vs reference)", cpu, ref, tol));
  EXPECT_TRUE(close(what + " (CUDA vs CPU)", gpu, cpu, 2 * tol));
}

class CrossCheck : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { require_device(); }
};

TEST_P(CrossCheck, Ce) {
  XENT_TEST_RNG(rng);
  const DType dtype = GetParam();
  const int64_t rows = 257, vocab = 32003;
  const Matrix x = rounded(rng.matrix(rows, vocab, 2.5), dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  CeSetup setup = make_ce_setup(kSmoothing | kZLoss | kSoftcap | kClassWeight | kRowWeight,
                                Reduction::none, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, Reduction::none, rows, false);
  const reference::CeResult ref = reference::ce(x, target, setup.spec, upstream);

  // CUDA.
  const Tensor logits = Tensor::of(x, dtype),
               target_tensor = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, Reduction::none, rows);
  Tensor loss = Tensor::vector(DType::f32, rows), lse = Tensor::vector(DType::f32, rows),
         grad = Tensor::matrix(dtype, rows, vocab);
  const Scratch scratch(ce_workspace_size(rows, vocab, setup.options, test_device()));
  CeOutputs out;
  out.loss = loss.view();
  out.stats.lse = lse.view();
  out.grad_logits = grad.view();
  ce_forward(logits.view(), target_tensor.view(), setup.options, out, grad_output.view(),
             scratch.workspace());
  finish();

  // CPU, same inputs (class and row weights as host copies).
  HostTensor h_logits = HostTensor::of(x, dtype), h_target = HostTensor::of_integers(target);
  HostTensor h_grad_output = HostTensor::of(upstream.values, DType::f32);
  HostTensor h_class = HostTensor::of(setup.spec.class_weight, DType::f32);
  HostTensor h_row = HostTensor::of(setup.spec.row_weight, DType::f32);
  HostTensor h_loss = HostTensor::output(DType::f32, 1, rows),
             h_lse = HostTensor::output(DType::f32, 1, rows),
             h_grad = HostTensor::output(dtype, 2, rows, vocab);
  CeOptions cpu_options = setup.options;
  cpu_options.class_weight = h_class.view();
  cpu_options.row_weight = h_row.view();
  CeOutputs h_out;
  h_out.loss = h_loss.view();
  h_out.stats.lse = h_lse.view();
  h_out.grad_logits = h_grad.view();
  ce_forward(h_logits.view(), h_target.view(), cpu_options, h_out, h_grad_output.view());

  const double stat_tol = stat_tolerance(dtype, Family::logits, {}, ref.loss);
  expect_agree("loss", loss.download(), h_loss.values(), ref.loss, stat_tol);
  expect_agree("lse", lse.download(), h_lse.values(), ref.lse, stat_tol);
  expect_agree(
      "grad_logits", grad.download(), h_grad.values(), ref.grad.values,
      grad_tolerance(dtype, Family::logits, rounded(ref.grad.values, dtype), ref.grad.values));
}

TEST_P(CrossCheck, Distill) {
  XENT_TEST_RNG(rng);
  const DType dtype = GetParam();
  const int64_t rows = 129, vocab = 32003;
  const Matrix s = rounded(rng.matrix(rows, vocab, 2.0), dtype);
  const Matrix t = rounded(make_teacher(rng, s, 2.0), dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  for (const DistillKind kind : {DistillKind::forward_kl, DistillKind::reverse_kl, DistillKind::jsd,
                                 DistillKind::soft_ce, DistillKind::tvd}) {
    SCOPED_TRACE(distill_kind_name(kind));
    const DistillSetup setup =
        make_distill_setup(kind, kTemperature | kHardAndSoft, Reduction::mean, 0.5);
    const reference::Upstream upstream = make_upstream(rng, Reduction::mean, rows, false);
    const reference::DistillResult ref = reference::distill(s, t, &target, setup.spec, upstream);

    const Tensor student = Tensor::of(s, dtype), teacher = Tensor::of(t, dtype);
    const Tensor target_tensor = Tensor::of_integers(target, DType::i64);
    const Tensor grad_output = upstream_tensor(upstream, Reduction::mean, rows);
    Tensor loss = Tensor::scalar(DType::f32), grad = Tensor::matrix(dtype, rows, vocab);
    const Scratch scratch(distill_workspace_size(rows, vocab, setup.options, test_device()));
    distill_forward(student.view(), teacher.view(), target_tensor.view(), setup.options,
                    {loss.view(), grad.view()}, grad_output.view(), scratch.workspace());
    finish();

    HostTensor h_s = HostTensor::of(s, dtype), h_t = HostTensor::of(t, dtype),
               h_target = HostTensor::of_integers(target);
    HostTensor h_grad_output{DType::f32, 0, 1, 1, encode(DType::f32, upstream.values)};
    HostTensor h_loss = HostTensor::output(DType::f32, 0, 1),
               h_grad = HostTensor::output(dtype, 2, rows, vocab);
    distill_forward(h_s.view(), h_t.view(), h_target.view(), setup.options,
                    {h_loss.view(), h_grad.view()}, h_grad_output.view());

    const reference::DistillResult midpoint =
        tvd_ties_at_midpoint(s, t, &target, setup.spec, upstream, 1e-5);
    expect_agree("loss", loss.download(), h_loss.values(), ref.loss,
                 stat_tolerance(dtype, Family::logits, {}, ref.loss));
    expect_agree(
        "grad_student", grad.download(), h_grad.values(), ref.grad.values,
        grad_tolerance(dtype, Family::logits, rounded(ref.grad.values, dtype), ref.grad.values) +
            2 * relative_error(midpoint.grad.values, ref.grad.values));
  }
}

TEST_P(CrossCheck, LinearCe) {
  XENT_TEST_RNG(rng);
  const DType dtype = GetParam();
  const int64_t rows = 515, hidden = 192, vocab = 8191;
  const LinearLayer layer = make_linear_layer(rng, rows, hidden, vocab, true, 2.0, dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  CeSetup setup = make_ce_setup(kSmoothing | kZLoss, Reduction::none, -100, rows, vocab, rng);
  const reference::Upstream upstream = make_upstream(rng, Reduction::none, rows, false);
  const reference::LinearCeResult ref =
      reference::linear_ce(layer.hidden, layer.weight, layer.bias, target, setup.spec, upstream);
  const Matrix logits = reference::linear_logits(layer.hidden, layer.weight, layer.bias);
  const bool half = is_half(dtype);
  const reference::CeResult torch =
      half ? reference::ce(rounded(logits, dtype), target, setup.spec, upstream) : ref.ce;
  const reference::LinearGrads torch_grads =
      half ? rounded_linear_backward(torch.grad, layer, dtype, DType::f32) : ref.grads;
  LinearCeOptions options;
  options.ce = setup.options;

  const Tensor h = Tensor::of(layer.hidden, dtype), w = Tensor::of(layer.weight, dtype),
               b = Tensor::of(layer.bias, dtype), y = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, Reduction::none, rows);
  Tensor loss = Tensor::vector(DType::f32, rows), dh = Tensor::matrix(dtype, rows, hidden),
         dw = Tensor::matrix(DType::f32, vocab, hidden), db = Tensor::vector(DType::f32, vocab);
  const Scratch scratch(
      linear_ce_workspace_size(rows, hidden, vocab, dtype, options, test_device(), true));
  linear_ce_forward(h.view(), w.view(), b.view(), y.view(), options,
                    {loss.view(), {}, {dh.view(), dw.view(), db.view()}}, grad_output.view(),
                    scratch.workspace());
  finish();

  HostTensor hh = HostTensor::of(layer.hidden, dtype), hw = HostTensor::of(layer.weight, dtype),
             hb = HostTensor::of(layer.bias, dtype), hy = HostTensor::of_integers(target),
             hg = HostTensor::of(upstream.values, DType::f32);
  HostTensor h_loss = HostTensor::output(DType::f32, 1, rows),
             h_dh = HostTensor::output(dtype, 2, rows, hidden),
             h_dw = HostTensor::output(DType::f32, 2, vocab, hidden),
             h_db = HostTensor::output(DType::f32, 1, vocab);
  linear_ce_forward(hh.view(), hw.view(), hb.view(), hy.view(), options,
                    {h_loss.view(), {}, {h_dh.view(), h_dw.view(), h_db.view()}}, hg.view());

  expect_agree("loss", loss.download(), h_loss.values(), ref.ce.loss,
               stat_tolerance(dtype, Family::linear, torch.loss, ref.ce.loss));
  expect_agree(
      "grads.hidden", dh.download(), h_dh.values(), ref.grads.hidden.values,
      grad_tolerance(dtype, Family::linear, torch_grads.hidden.values, ref.grads.hidden.values));
  expect_agree(
      "grads.weight", dw.download(), h_dw.values(), ref.grads.weight.values,
      grad_tolerance(dtype, Family::linear, torch_grads.weight.values, ref.grads.weight.values));
  expect_agree("grads.bias", db.download(), h_db.values(), ref.grads.bias,
               grad_tolerance(dtype, Family::linear, torch_grads.bias, ref.grads.bias));
}

TEST_P(CrossCheck, LinearDistill) {
  XENT_TEST_RNG(rng);
  const DType dtype = GetParam();
  const int64_t rows = 259, hidden = 128, teacher_hidden = 96, vocab = 8191;
  const LinearLayer student = make_linear_layer(rng, rows, hidden, vocab, false, 2.0, dtype);
  const LinearLayer teacher =
      make_linear_layer(rng, rows, teacher_hidden, vocab, false, 2.0, dtype);
  const std::vector<int64_t> target = make_targets(rng, rows, vocab, -100, true, false, false);
  const DistillSetup setup =
      make_distill_setup(DistillKind::reverse_kl, kTemperature, Reduction::none, 0.5);
  const reference::Upstream upstream = make_upstream(rng, Reduction::none, rows, false);
  const Matrix s = reference::linear_logits(student.hidden, student.weight, {});
  const Matrix t = reference::linear_logits(teacher.hidden, teacher.weight, {});
  const reference::DistillResult ref = reference::distill(s, t, &target, setup.spec, upstream);
  const reference::LinearGrads ref_grads =
      reference::linear_backward(ref.grad, student.hidden, student.weight);
  const bool half = is_half(dtype);
  const reference::DistillResult torch =
      half ? reference::distill(rounded(s, dtype), rounded(t, dtype), &target, setup.spec, upstream)
           : ref;
  const reference::LinearGrads torch_grads =
      half ? rounded_linear_backward(torch.grad, student, dtype, dtype) : ref_grads;
  LinearDistillOptions options;
  options.distill = setup.options;

  const Tensor h = Tensor::of(student.hidden, dtype), w = Tensor::of(student.weight, dtype),
               th = Tensor::of(teacher.hidden, dtype), tw = Tensor::of(teacher.weight, dtype),
               y = Tensor::of_integers(target, DType::i64);
  const Tensor grad_output = upstream_tensor(upstream, Reduction::none, rows);
  Tensor loss = Tensor::vector(DType::f32, rows), dh = Tensor::matrix(dtype, rows, hidden),
         dw = Tensor::matrix(dtype, vocab, hidden);
  const Scratch scratch(linear_distill_workspace_size(rows, hidden, teacher_hidden, vocab, dtype,
                                                      options, test_device(), true));
  linear_distill_forward(h.view(), w.view(), Teacher{{}, th.view(), tw.view()}, y.view(), options,
                         {loss.view(), {dh.view(), dw.view(), {}}}, grad_output.view(),
                         scratch.workspace());
  finish();

  HostTensor hh = HostTensor::of(student.hidden, dtype), hw = HostTensor::of(student.weight, dtype),
             hth = HostTensor::of(teacher.hidden, dtype),
             htw = HostTensor::of(teacher.weight, dtype), hy = HostTensor::of_integers(target),
             hg = HostTensor::of(upstream.values, DType::f32);
  HostTensor h_loss = HostTensor::output(DType::f32, 1, rows),
             h_dh = HostTensor::output(dtype, 2, rows, hidden),
             h_dw = HostTensor::output(dtype, 2, vocab, hidden);
  linear_distill_forward(hh.view(), hw.view(), Teacher{{}, hth.view(), htw.view()}, hy.view(),
                         options, {h_loss.view(), {h_dh.view(), h_dw.view(), {}}}, hg.view());

  expect_agree("loss", loss.download(), h_loss.values(), ref.loss,
               stat_tolerance(dtype, Family::linear, torch.loss, ref.loss));
  expect_agree(
      "grads.hidden", dh.download(), h_dh.values(), ref_grads.hidden.values,
      grad_tolerance(dtype, Family::linear, torch_grads.hidden.values, ref_grads.hidden.values));
  expect_agree(
      "grads.weight", dw.download(), h_dw.values(), ref_grads.weight.values,
      grad_tolerance(dtype, Family::linear, torch_grads.weight.values, ref_grads.weight.values));
}

INSTANTIATE_TEST_SUITE_P(Gpu, CrossCheck, ::testing::Values(DType::f32, DType::bf16, DType::f16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return short_name(info.param);
                         });

}  // namespace
}  // namespace xent::test
