// Internal entry points of the CUDA distillation row kernel (docs/semantics.md §3), shared by distill on
// logits and by the chunked linear_distill, which feeds it chunks of student and teacher logits.
// The steps mirror ce_rows.cuh: ce_batch_totals over the whole batch (N_valid, and D/W for the
// hard-label term), distill_rows per chunk (student and teacher rows read from HBM once, the
// gradient with respect to the student written once, optionally over the student buffer), and
// distill_reduce for the scalar loss.
#pragma once

#include <type_traits>

#include "common/distill_row.hpp"
#include "cuda/rows/ce_device.cuh"
#include "cuda/rows/ce_rows.cuh"
#include "cuda/rows/row_stats.cuh"
#include "xent/distill.hpp"

namespace xent::cuda {

struct DistillRowOptions {
  common::DistillKindCode kind = common::DistillKindCode::forward_kl;
  float temperature = 1;
  float beta = 0.5f;
  float softcap = 0;       // 0: off; applied to student and teacher before T
  double soft_weight = 1;  // σ
  double hard_weight = 0;  // α (the hard term needs a target)
  CeRowOptions ce;         // ignore_index and reduction of the whole op; the rest: hard term
};
DistillRowOptions distill_row_options(const DistillOptions& options);

// What the gradient of any column of a row needs beyond the column's own logits, exported by the
// row kernel so that a later pass (the vocabulary-blocked linear_distill schedule,
// linear_distill_block_grad.cuh) can form the gradient of a block of columns elementwise.
struct DistillRowStatistics {
  float lse_student = 0;  // of the transformed student row
  float lse_teacher = 0;
  float sum_prob_u = 0;  // Σ p_s·u (reverse_kl, jsd)
  float tvd_above = 0;   // common::TvdSums (tvd)
  float tvd_below = 0;
  float tvd_equal = 0;
  float hard_lse = 0;  // lse of the hard-label ce term (its own transform)
  float unused = 0;    // 32 bytes a row
};

struct DistillRowsArgs {
  const void* student = nullptr;  // chunk [rows, vocab], fp32/bf16/fp16
  int64_t student_row_stride = 0;
  const void* teacher = nullptr;  // chunk [rows, vocab], same dtype as the student
  int64_t teacher_row_stride = 0;
  DType dtype = DType::bf16;
  int64_t rows = 0;
  int64_t vocab = 0;
  const void* target = nullptr;  // chunk [rows], or null: every row valid, no hard term
  DType target_dtype = DType::i64;
  const float* row_weight = nullptr;  // chunk [rows] or null (hard term only)
  DistillRowOptions options;
  const CeBatchTotals* totals = nullptr;    // from ce_batch_totals over the whole batch
  const float* grad_output_rows = nullptr;  // chunk: g_n of reduction none, or null

  // Outputs (chunk pointers, fp32, each optional).
  float* row_soft = nullptr;       // d_n, the distillation loss of the row (0 when ignored)
  float* row_hard_loss = nullptr;  // r_n·ℓ_n of the hard term
  float* row_hard_z = nullptr;     // r_n·ζ_n of the hard term
  float* row_total = nullptr;      // σ·d_n + α·r_n·(ℓ_n + ζ_n): the loss of reduction none
  // ∂loss/∂student (student dtype), or null; may be exactly the student buffer (in place).
  void* grad = nullptr;
  int64_t grad_row_stride = 0;
  // Per-row statistics of the gradient (chunk pointer), or null. Zeros for ignored rows.
  DistillRowStatistics* statistics = nullptr;
  // Room for the rows' statistics when `statistics` is null (chunk pointer), or null: with it
  // forward and reverse KL may take the two-pass form (distill_two_pass.cuh).
  DistillRowStatistics* scratch_statistics = nullptr;
};

void distill_rows(const DistillRowsArgs& args, cudaStream_t stream);

struct DistillReduceArgs {
  int64_t rows = 0;  // the whole batch
  Reduction reduction = Reduction::mean;
  double soft_weight = 1;
  double hard_weight = 0;
  const float* row_soft = nullptr;
  const float* row_hard_loss = nullptr;  // null when there is no hard term
  const float* row_hard_z = nullptr;
  const CeBatchTotals* totals = nullptr;
  float* loss = nullptr;  // scalar of sum/mean
};

// σ·(Σ d_n, divided by N_valid for mean) + α·(the §1 reduction of the hard term), fixed order.
void distill_reduce(const DistillReduceArgs& args, cudaStream_t stream);

// The batch pre-pass request of distill on logits (and of a top-k teacher): the scalar upstream
// gradient only for sum/mean.
CeBatchRequest distill_batch_request(TensorView target, int64_t rows, int64_t vocab,
                                     const DistillOptions& options, TensorView grad_output,
                                     OpCode op);

// Bytes of device workspace distill on logits uses: totals, three per-row arrays and the rows'
// statistics (DistillRowStatistics, for the two-pass form).
std::size_t distill_workspace_bytes(int64_t rows);

// ---- device pieces shared by the row kernel and the blocked gradient ---------------------------

// e^x and log y of the jsd terms (common::log_mixture) on the ex2 and lg2 units. log m is formed
// as max(a, b) + log(1 + e^(−|a−b|)): ex2.approx (≤ 2^-22 relative) of a value in [0, 1] and
// lg2.approx (≤ 2^-22 absolute for arguments in [1, 2]) keep log m within ~3e-7 absolute on every
// element, the size of the fp32 rounding of log p = v − lse itself. The precise expf, expf and
// logf it replaces were most of jsd's per-element instructions, twice per element (loss and
// gradient sweeps).
struct FastExpLog {
  __device__ __forceinline__ float exp(float x) const { return fast_exp(x); }
  __device__ __forceinline__ float log(float y) const {
    float log2_y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(log2_y) : "f"(y));
    return log2_y * 0.6931471805599453f;
  }
};

// Calls f(transform) with the softcap branch resolved at compile time (see with_transform).
template <class F>
__device__ __forceinline__ void with_distill_transform(const common::DistillTransform<float>& t,
                                                       F&& f) {
  if (t.softcap > 0) {
    f(t);
  } else if (t.inv_temperature == 1.0f) {
    f(IdentityTransform{});
  } else {
    common::DistillTransform<float> plain;
    plain.inv_temperature = t.inv_temperature;
    plain.softcap = 0.0f;
    f(plain);
  }
}

// Calls f(std::integral_constant<DistillKindCode, kind>) for the runtime kind, so that the
// per-element switches of common/distill_row.hpp fold away.
template <class F>
__device__ __forceinline__ void with_distill_kind(common::DistillKindCode kind, F&& f) {
  using common::DistillKindCode;
  switch (kind) {
    case DistillKindCode::forward_kl:
      f(std::integral_constant<DistillKindCode, DistillKindCode::forward_kl>{});
      break;
    case DistillKindCode::reverse_kl:
      f(std::integral_constant<DistillKindCode, DistillKindCode::reverse_kl>{});
      break;
    case DistillKindCode::jsd:
      f(std::integral_constant<DistillKindCode, DistillKindCode::jsd>{});
      break;
    case DistillKindCode::soft_ce:
      f(std::integral_constant<DistillKindCode, DistillKindCode::soft_ce>{});
      break;
    case DistillKindCode::tvd:
      f(std::integral_constant<DistillKindCode, DistillKindCode::tvd>{});
      break;
  }
}

// log-probabilities and probabilities of one element of the student and teacher rows.
struct ElementProbs {
  float log_ps, log_pt, ps, pt;
};
__device__ __forceinline__ ElementProbs element_probs(float vs, float vt, float lse_s,
                                                      float lse_t) {
  ElementProbs e;
  e.log_ps = vs - lse_s;
  e.log_pt = vt - lse_t;
  e.ps = fast_exp(e.log_ps);
  e.pt = fast_exp(e.log_pt);
  return e;
}

// Row sums of a loss sweep, in this order: Σ term, Σ p_s·u, and tvd's Σ p_s above, below and
// equal to p_t (the columns of xent/distill_shard.hpp's pass-2 records).
constexpr int kDistillSums = 5;

// Adds one element's loss term and the row sums its gradient needs (kind fixed).
template <common::DistillKindCode kKind>
__device__ __forceinline__ void add_distill_sums(const common::DistillConstants<float>& dc,
                                                 const ElementProbs& e,
                                                 float (&sums)[kDistillSums]) {
  if constexpr (kKind == common::DistillKindCode::tvd) {
    // tvd's gradient takes the per-side sums, never Σ p_s·u: only the loss and the sums.
    const float diff = e.pt - e.ps;
    sums[0] += 0.5f * (diff < 0 ? -diff : diff);
    common::TvdSums<float> one;
    one.add_probs(e.ps, e.pt);
    sums[2] += one.above;
    sums[3] += one.below;
    sums[4] += one.equal;
  } else {
    common::DistillConstants<float> fixed = dc;
    fixed.kind = kKind;
    const auto term =
        common::distill_term_from_probs(fixed, e.log_ps, e.log_pt, e.ps, e.pt, FastExpLog{});
    sums[0] += term.loss;
    sums[1] += term.prob_u;
  }
}

// The row constants of the soft gradient: what the row kernel holds after its loss sweep, and
// what a blocked pass re-forms from DistillRowStatistics (the same values, so both passes form
// one gradient).
struct DistillGradRow {
  float lse_student = 0;
  float lse_teacher = 0;
  float sum_prob_u = 0;
  common::TvdGradRow<float> tvd;
  float soft_coef = 0;  // g·σ (divided by N_valid for mean)
};

__device__ __forceinline__ float distill_soft_coef(const DistillRowOptions& o,
                                                   const CeBatchTotals* totals, float upstream) {
  const bool mean = o.ce.reduction == Reduction::mean;
  const double valid_rows = totals->valid_rows;
  const float soft_factor =
      mean ? (valid_rows > 0 ? static_cast<float>(o.soft_weight / valid_rows) : 0.0f)
           : static_cast<float>(o.soft_weight);
  return upstream * soft_factor;
}

// Coefficients of the hard-label ce term of a row (docs/semantics.md §3: α·CE at the §1 options). `target` is
// in the caller's column numbering; `target_weight` is w_y (1 without class weights).
__device__ __forceinline__ common::CeGradRow<float> distill_hard_grad_row(
    const DistillRowOptions& o, const common::CeConstants<float>& hc, const CeBatchTotals* totals,
    float hard_lse, int64_t target, float target_weight, float upstream, float row_weight) {
  const float coef = static_cast<float>(o.hard_weight) * upstream * row_weight;
  return common::ce_grad_row(hc, hard_lse, target, target_weight, coef * totals->loss_factor,
                             coef * totals->z_factor);
}

// ∂(d_n)/∂ṽs of one element (before the row coefficient and the chain rule), kind fixed.
template <common::DistillKindCode kKind>
__device__ __forceinline__ float distill_soft_grad(const common::DistillConstants<float>& dc,
                                                   const DistillGradRow& row,
                                                   const ElementProbs& e) {
  if constexpr (kKind == common::DistillKindCode::tvd) {
    return common::tvd_grad_from_row(row.tvd, e.ps, e.pt);
  } else {
    common::DistillConstants<float> fixed = dc;
    fixed.kind = kKind;
    return common::distill_grad_from_probs(fixed, e.log_ps, e.log_pt, e.ps, e.pt, row.sum_prob_u,
                                           FastExpLog{});
  }
}

// Where the hard-label ce term of a row finds its per-element inputs. The class weight and the
// target comparison are formed inside distill_element_grad's hard branch, from the column index:
// formed by the caller before the call, nvcc hoisted the weight's index arithmetic, 64-bit bounds
// compare and a predicated load out of the branch, so every element of a row without a hard term
// paid ~7 instructions (16 per element instead of 9 in the bf16 forward_kl gradient sweep).
struct DistillHardColumns {
  int64_t target_column = -1;           // in the caller's column numbering; may lie outside
  const float* class_weight = nullptr;  // indexed by column; null unless smoothing weighs classes
  int64_t columns = 0;                  // columns at or past this have no weight to read
};

// The gradient of one student element x (raw logit) at `column` with respect to x: the soft part
// through the distillation transform, plus the hard-label ce part when the row has one. `e` holds
// the element's probabilities under `transform`.
template <common::DistillKindCode kKind, class Transform, class Index>
__device__ __forceinline__ float distill_element_grad(
    const common::DistillConstants<float>& dc, const DistillGradRow& row,
    const Transform& transform, float x, const ElementProbs& e, bool with_hard,
    const common::CeConstants<float>& hc, const common::CeGradRow<float>& hard_row,
    const DistillHardColumns& hard, Index column) {
  float g = row.soft_coef * distill_soft_grad<kKind>(dc, row, e) * transform.slope(x);
  if (with_hard) {
    const float w = hard.class_weight && column < hard.columns ? hard.class_weight[column] : 1.0f;
    const float p = fast_exp(hc.transform.value(x) - hard_row.lse);
    g += common::ce_grad_from_prob(hard_row, p, hc.transform.slope(x), column == hard.target_column,
                                   w);
  }
  return g;
}

}  // namespace xent::cuda
