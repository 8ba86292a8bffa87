// The naive form on the CPU, written from docs/semantics.md §1–§4: materialise, then loop over rows.
#include <cmath>
#include <cstring>

#include "bench/naive.hpp"
#include "bench/naive_math.hpp"
#include "common/numeric.hpp"

#if defined(XENT_WITH_OPENBLAS)
#include <cblas.h>
#endif

namespace xent::bench {

namespace {

float load(const TensorView& view, int64_t index) {
  switch (view.dtype) {
    case DType::f32:
      return static_cast<const float*>(view.data)[index];
    case DType::bf16:
      return common::to_float(static_cast<const common::bf16_t*>(view.data)[index]);
    case DType::f16:
      return common::to_float(static_cast<const common::f16_t*>(view.data)[index]);
    default:
      return 0;
  }
}

void store(const TensorView& view, int64_t index, float value) {
  switch (view.dtype) {
    case DType::f32:
      static_cast<float*>(view.data)[index] = value;
      break;
    case DType::bf16:
      static_cast<common::bf16_t*>(view.data)[index] = common::to_bf16(value);
      break;
    case DType::f16:
      static_cast<common::f16_t*>(view.data)[index] = common::to_f16(value);
      break;
    default:
      break;
  }
}

// fp32 view of an input: the input itself when it is fp32, else a converted copy in scratch.
const float* widen(const TensorView& view, float* copy) {
  if (view.dtype == DType::f32) return static_cast<const float*>(view.data);
  const int64_t count = view.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) copy[i] = load(view, i);
  return copy;
}

void narrow(const float* values, const TensorView& view) {
  if (view.dtype == DType::f32 && static_cast<const void*>(values) == view.data) return;
  const int64_t count = view.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) store(view, i, values[i]);
}

// C[m×n] = op(A)·op(B), row-major, fp32.
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
          const float* b, float* c) {
  const int64_t lda = transpose_a ? m : k, ldb = transpose_b ? k : n;
#if defined(XENT_WITH_OPENBLAS)
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f,
              c, static_cast<int>(n));
#else
  auto at = [&](int64_t i, int64_t p) { return transpose_a ? a[p * lda + i] : a[i * lda + p]; };
  auto bt = [&](int64_t p, int64_t j) { return transpose_b ? b[j * ldb + p] : b[p * ldb + j]; };
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * n;
    for (int64_t j = 0; j < n; ++j) row[j] = 0;
    for (int64_t p = 0; p < k; ++p) {
      const float scale = at(i, p);
      for (int64_t j = 0; j < n; ++j) row[j] += scale * bt(p, j);
    }
  }
#endif
}

struct Totals {
  double loss = 0, z = 0, denominator = 0, valid = 0;
};

double upstream(const Inputs& in, Reduction reduction, int64_t row) {
  return reduction == Reduction::none && in.grad_output.present() ? load(in.grad_output, row) : 1.0;
}

naive::CeParams ce_params(const Case& c, const Inputs& in) {
  naive::CeParams p;
  p.smoothing = c.options.smoothing ? kSmoothing : 0;
  p.z_loss = c.options.z_loss ? kZLoss : 0;
  p.softcap = c.options.softcap ? kSoftcap : 0;
  p.scale = c.options.logit_scale ? kLogitScale : 1;
  p.vocab = double(c.v);
  p.weight_sum = double(c.v);
  if (in.class_weight.present()) {
    p.weight_sum = 0;
    for (int64_t i = 0; i < c.v; ++i) p.weight_sum += load(in.class_weight, i);
  }
  return p;
}

// docs/semantics.md §1 on materialised logits x (fp32 rows); writes row_* and, when grad != nullptr, ∂/∂x.
void cross_entropy(const Case& c, const Inputs& in, const float* x, const NaiveScratch& s,
                   float* grad, Totals& totals) {
  const int64_t n_rows = c.n, vocab = c.v;
  const naive::CeParams params = ce_params(c, in);
  const bool weighted = in.class_weight.present();
  auto class_weight = [&](int64_t i) { return weighted ? double(load(in.class_weight, i)) : 1.0; };
  auto row_weight = [&](int64_t n) {
    return in.row_weight.present() ? double(load(in.row_weight, n)) : 1.0;
  };
  const auto* target = static_cast<const int64_t*>(in.target.data);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < n_rows; ++n) {
    const float* row = x + n * vocab;
    double max = -INFINITY, sum = 0, weighted_logits = 0;
    for (int64_t i = 0; i < vocab; ++i) max = std::fmax(max, naive::ce_transformed(params, row[i]));
    for (int64_t i = 0; i < vocab; ++i) {
      const double v = naive::ce_transformed(params, row[i]);
      sum += std::exp(v - max);
      weighted_logits += class_weight(i) * v;
    }
    const double lse = max + std::log(sum);
    const int64_t y = target[n];
    const double loss = naive::ce_row_loss(params, lse, naive::ce_transformed(params, row[y]),
                                           class_weight(y), weighted_logits);
    s.row_loss[n] = row_weight(n) * loss;
    s.row_z[n] = row_weight(n) * params.z_loss * lse * lse;
    s.row_lse[n] = lse;
    s.row_denominator[n] = class_weight(y);
  }
  for (int64_t n = 0; n < n_rows; ++n) {
    totals.loss += s.row_loss[n];
    totals.z += s.row_z[n];
    totals.denominator += s.row_denominator[n];
    totals.valid += 1;
  }
  if (!grad) return;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < n_rows; ++n) {
    const double g = upstream(in, c.reduction, n) * row_weight(n);
    double coef = g, z_coef = g;
    if (c.reduction == Reduction::mean) {
      coef = totals.denominator > 0 ? coef / totals.denominator : 0;
      z_coef = totals.valid > 0 ? z_coef / totals.valid : 0;
    }
    const int64_t y = target[n];
    for (int64_t i = 0; i < vocab; ++i)
      grad[n * vocab + i] = static_cast<float>(
          naive::ce_gradient(params, coef, z_coef, s.row_lse[n], x[n * vocab + i], i == y,
                             class_weight(y), class_weight(i)));
  }
}

// docs/semantics.md §3 on materialised student and teacher logits (fp32 rows), temperature 1.
void distillation(const Case& c, const float* s_logits, const float* t_logits,
                  const NaiveScratch& s, float* grad, const Inputs& in, Totals& totals) {
  const int64_t n_rows = c.n, vocab = c.v;
  const double cap = c.options.softcap ? kSoftcap : 0, beta = 0.5;
  const int kind = static_cast<int>(c.kind);
  auto lse_of = [&](const float* row) {
    double max = -INFINITY, sum = 0;
    for (int64_t i = 0; i < vocab; ++i)
      max = std::fmax(max, naive::distill_transformed(cap, row[i]));
    for (int64_t i = 0; i < vocab; ++i)
      sum += std::exp(naive::distill_transformed(cap, row[i]) - max);
    return max + std::log(sum);
  };
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < n_rows; ++n) {
    const float* srow = s_logits + n * vocab;
    const float* trow = t_logits + n * vocab;
    const double lse_s = lse_of(srow), lse_t = lse_of(trow);
    double loss = 0, sum_pd = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      const double log_ps = naive::distill_transformed(cap, srow[i]) - lse_s;
      const double log_pt = naive::distill_transformed(cap, trow[i]) - lse_t;
      const naive::DistillTerm term = naive::distill_term(kind, beta, log_ps, log_pt);
      loss += term.loss;
      const double ps = std::exp(log_ps);
      sum_pd += ps == 0 ? 0 : ps * term.d;
    }
    s.row_loss[n] = loss;
    s.row_z[n] = 0;
    s.row_lse[n] = sum_pd;  // the distill gradient needs Σ p_s·d, not lse
    s.row_denominator[n] = 1;
  }
  for (int64_t n = 0; n < n_rows; ++n) {
    totals.loss += s.row_loss[n];
    totals.denominator += 1;
    totals.valid += 1;
  }
  if (!grad) return;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < n_rows; ++n) {
    const float* srow = s_logits + n * vocab;
    const float* trow = t_logits + n * vocab;
    double coef = upstream(in, c.reduction, n);
    if (c.reduction == Reduction::mean) coef /= totals.valid;
    const double lse_s = lse_of(srow), lse_t = lse_of(trow);
    for (int64_t i = 0; i < vocab; ++i) {
      const double log_ps = naive::distill_transformed(cap, srow[i]) - lse_s;
      const double log_pt = naive::distill_transformed(cap, trow[i]) - lse_t;
      grad[n * vocab + i] = static_cast<float>(
          coef * naive::distill_dlogit(kind, beta, log_ps, log_pt, s.row_lse[n]) *
          naive::distill_slope(cap, srow[i]));
    }
  }
}

void write_loss(const Case& c, const NaiveScratch& s, const Totals& totals,
                const TensorView& loss) {
  auto* out = static_cast<float*>(loss.data);
  if (c.reduction == Reduction::none) {
    for (int64_t n = 0; n < c.n; ++n) out[n] = static_cast<float>(s.row_loss[n] + s.row_z[n]);
  } else if (c.reduction == Reduction::sum) {
    out[0] = static_cast<float>(totals.loss + totals.z);
  } else {
    const double main = totals.denominator > 0 ? totals.loss / totals.denominator : 0;
    const double z = totals.valid > 0 ? totals.z / totals.valid : 0;
    out[0] = static_cast<float>(main + z);
  }
}

}  // namespace

void naive_cpu(const Case& c, const Inputs& in, const Outputs& out, void* scratch) {
  const NaiveScratch s = naive_layout(c, scratch, DeviceKind::cpu);
  const bool grads = c.mode == Mode::fwdbwd;
  Totals totals;
  const float* logits = nullptr;
  const float* teacher = nullptr;
  const float* hidden = nullptr;
  const float* weight = nullptr;
  if (is_linear(c.op)) {
    hidden = widen(in.hidden, s.hidden);
    weight = widen(in.weight, s.weight);
    gemm(false, true, c.n, c.v, c.h, hidden, weight, s.logits);  // x = h·Wᵀ
    logits = s.logits;
    if (c.op == Op::linear_distill) {
      const float* t_hidden = widen(in.teacher_hidden, s.teacher_hidden);
      const float* t_weight = widen(in.teacher_weight, s.teacher_weight);
      gemm(false, true, c.n, c.v, c.h, t_hidden, t_weight, s.teacher);
      teacher = s.teacher;
    }
  } else {
    logits = widen(in.logits, s.logits);
    if (c.op == Op::distill) teacher = widen(in.teacher, s.teacher);
  }
  if (is_distill(c.op)) {
    distillation(c, logits, teacher, s, grads ? s.grad : nullptr, in, totals);
  } else {
    cross_entropy(c, in, logits, s, grads ? s.grad : nullptr, totals);
  }
  write_loss(c, s, totals, out.loss);
  if (!grads) return;
  if (is_linear(c.op)) {
    float* grad_hidden = s.grad_hidden ? s.grad_hidden : static_cast<float*>(out.grad_hidden.data);
    float* grad_weight = s.grad_weight ? s.grad_weight : static_cast<float*>(out.grad_weight.data);
    gemm(false, false, c.n, c.h, c.v, s.grad, weight, grad_hidden);  // ∂h = G·W
    gemm(true, false, c.v, c.h, c.n, s.grad, hidden, grad_weight);   // ∂W = Gᵀ·h
    narrow(grad_hidden, out.grad_hidden);
    narrow(grad_weight, out.grad_weight);
  } else {
    narrow(s.grad, out.grad_logits);
  }
}

}  // namespace xent::bench
