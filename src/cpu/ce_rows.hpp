// Cross-entropy of one row on the CPU (docs/semantics.md §1): the loss, the statistics and the gradient of a
// row, from the shared row math of src/common. Used by ce, by the hard-label term of distill and by
// the chunks of linear_ce, which all differ only in where their rows come from.
#pragma once

#include <cstdint>
#include <vector>

#include "common/ce_row.hpp"
#include "cpu/tensor_access.hpp"
#include "xent/ce.hpp"

namespace xent::cpu {

// Valid rows of a call and the mean divisors derived from them; counted before any row is
// processed so every gradient coefficient is known in the same pass as the loss.
struct ValidCounts {
  int64_t valid_rows = 0;        // N_valid
  double target_weight_sum = 0;  // Σ_{valid n} w_{y_n} (class weights), else N_valid
};

inline ValidCounts count_valid_rows(TensorView target, int64_t rows, int64_t ignore_index,
                                    TensorView class_weight) {
  ValidCounts counts;
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t y = target.present() ? read_target(target, n) : 0;
    if (target.present() && y == ignore_index) continue;
    ++counts.valid_rows;
    counts.target_weight_sum +=
        class_weight.present() && target.present() ? read_scalar<double>(class_weight, y) : 1.0;
  }
  return counts;
}

// Everything about a CE call that does not depend on the row.
template <class T>
struct CeCall {
  common::CeConstants<T> constants;
  const float* class_weight = nullptr;  // [V] or null
  const float* row_weight = nullptr;    // [N] or null, indexed by the global row
  int64_t ignore_index = -100;
  int64_t vocab = 0;
  Reduction reduction = Reduction::mean;
  // Multipliers turning the upstream gradient into c_n: 1/D and 1/N_valid for mean, 1 otherwise;
  // 0 when the divisor is 0 (the N_valid = 0 deviation of docs/semantics.md §1).
  T loss_factor = 1;
  T z_factor = 1;
  double loss_divisor = 0;  // D and N_valid of mean (0: that part of the mean is 0)
  double z_divisor = 0;
};

template <class T>
CeCall<T> make_ce_call(const CeOptions& options, int64_t vocab, const ValidCounts& counts) {
  CeCall<T> call;
  auto& c = call.constants;
  c.transform.scale = static_cast<T>(options.logit_scale);
  c.transform.softcap = options.softcap ? static_cast<T>(*options.softcap) : T(0);
  c.smoothing = static_cast<T>(options.label_smoothing);
  c.z_loss = static_cast<T>(options.z_loss);
  c.vocab = static_cast<T>(vocab);
  c.weighted = options.class_weight.present();
  if (c.weighted) {
    call.class_weight = static_cast<const float*>(options.class_weight.data);
    double sum = 0;
    for (int64_t i = 0; i < vocab; ++i) sum += call.class_weight[i];
    c.class_weight_sum = static_cast<T>(sum);
  } else {
    c.class_weight_sum = static_cast<T>(vocab);
  }
  if (options.row_weight.present()) {
    call.row_weight = static_cast<const float*>(options.row_weight.data);
  }
  call.ignore_index = options.ignore_index;
  call.vocab = vocab;
  call.reduction = options.reduction;
  if (options.reduction == Reduction::mean) {
    const double divisor =
        c.weighted ? counts.target_weight_sum : static_cast<double>(counts.valid_rows);
    call.loss_divisor = divisor;
    call.z_divisor = static_cast<double>(counts.valid_rows);
    call.loss_factor = divisor > 0 ? static_cast<T>(1.0 / divisor) : T(0);
    call.z_factor = counts.valid_rows > 0 ? static_cast<T>(1.0 / counts.valid_rows) : T(0);
  }
  return call;
}

// The result of a row; the initial values are those of an ignored row.
template <class T>
struct CeRowResult {
  using Ignored = common::IgnoredRow<T>;
  bool valid = false;
  T loss = Ignored::loss;    // r_n·ℓ_n
  T z_loss = Ignored::loss;  // r_n·ζ_n
  T lse = Ignored::lse;
  T logprob = Ignored::logprob;
  T entropy = Ignored::entropy;
  int64_t argmax = Ignored::argmax;
  bool correct = false;
};

// What a caller wants from a row beyond the loss and its statistics.
struct CeRowRequest {
  bool gradient = false;  // write ∂loss/∂x into `grad`
};

// Row statistics over blocks of kStatsBlock elements merged in order: a float sum of V terms
// in one running total drifts by ~V ulps, blocks keep it near V/kStatsBlock + kStatsBlock
// (measured: lse error on V = 1031 from ~2e-6 down to ~3e-7).
constexpr int64_t kStatsBlock = 128;

template <class T, class AddElement>
common::RowStats<T> blocked_row_stats(int64_t vocab, AddElement&& add_element) {
  common::RowStats<T> total;
  for (int64_t begin = 0; begin < vocab; begin += kStatsBlock) {
    common::RowStats<T> block;
    const int64_t end = begin + kStatsBlock < vocab ? begin + kStatsBlock : vocab;
    for (int64_t i = begin; i < end; ++i) add_element(block, i);
    total.merge(block);
  }
  return total;
}

template <class T, class S>
common::RowStats<T> ce_row_stats(const CeCall<T>& call, const S* x) {
  const auto& transform = call.constants.transform;
  if (call.class_weight) {
    return blocked_row_stats<T>(call.vocab, [&](common::RowStats<T>& stats, int64_t i) {
      stats.add(transform.value(to_compute<T>(x[i])), i, static_cast<T>(call.class_weight[i]));
    });
  }
  return blocked_row_stats<T>(call.vocab, [&](common::RowStats<T>& stats, int64_t i) {
    stats.add(transform.value(to_compute<T>(x[i])), i, T(1));
  });
}

// Writes the gradient of a valid row; `grad` may alias `x` (each element is read before written).
// `entropy` (may be null) adds the entropy term of the row (ce.hpp EntropyGradient).
template <class T, class S, class G>
void ce_write_row_gradient(const CeCall<T>& call, const S* x, G* grad, T lse, int64_t target,
                           T coef, T z_coef, const common::EntropyGradRow<T>* entropy = nullptr) {
  const auto& c = call.constants;
  const T target_weight = call.class_weight ? static_cast<T>(call.class_weight[target]) : T(1);
  const auto row = common::ce_grad_row(c, lse, target, target_weight, coef, z_coef);
  for (int64_t i = 0; i < call.vocab; ++i) {
    const T w = call.class_weight ? static_cast<T>(call.class_weight[i]) : T(1);
    const T xi = to_compute<T>(x[i]);
    grad[i] = from_compute<G>(entropy ? common::ce_entropy_grad_element(c, row, *entropy, xi, i, w)
                                      : common::ce_grad_element(c, row, xi, i, w));
  }
}

template <class G>
void zero_row(G* grad, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i) grad[i] = from_compute<G>(0.0f);
}

// One row: loss, statistics and (on request) its gradient scaled by `upstream` (g or g_n).
// `row` is the global row index (row weights); the hard-label term of distill passes α·g.
template <class T, class S, class G>
CeRowResult<T> ce_process_row(const CeCall<T>& call, const S* x, int64_t target, int64_t row,
                              const CeRowRequest& request, T upstream, G* grad) {
  CeRowResult<T> result;
  result.valid = target != call.ignore_index;
  if (!result.valid) {
    if (request.gradient) zero_row(grad, call.vocab);
    return result;
  }
  const auto stats = ce_row_stats(call, x);
  const T lse = stats.lse();
  result.entropy = stats.entropy();
  const auto& c = call.constants;
  const T target_logit = c.transform.value(to_compute<T>(x[target]));
  const T target_weight = call.class_weight ? static_cast<T>(call.class_weight[target]) : T(1);
  const auto loss = common::ce_row_loss(c, stats, lse, target_logit, target_weight);
  const T r = call.row_weight ? static_cast<T>(call.row_weight[row]) : T(1);
  result.loss = r * loss.loss;
  result.z_loss = r * loss.z_loss;
  result.lse = lse;
  result.logprob = target_logit - lse;
  result.argmax = stats.argmax;
  result.correct = stats.argmax == target;
  if (request.gradient) {
    ce_write_row_gradient(call, x, grad, lse, target, upstream * r * call.loss_factor,
                          upstream * r * call.z_factor);
  }
  return result;
}

// The §1 reduction of per-row r·ℓ and r·ζ, summed in row order (deterministic), in double.
template <class T>
double reduce_ce_loss(const CeCall<T>& call, const std::vector<T>& loss,
                      const std::vector<T>& z_loss) {
  double loss_sum = 0, z_sum = 0;
  for (std::size_t n = 0; n < loss.size(); ++n) {
    loss_sum += loss[n];
    z_sum += z_loss[n];
  }
  if (call.reduction == Reduction::mean) {
    return (call.loss_divisor > 0 ? loss_sum / call.loss_divisor : 0.0) +
           (call.z_divisor > 0 ? z_sum / call.z_divisor : 0.0);
  }
  return loss_sum + z_sum;
}

template <class T>
double reduce_z_loss(const CeCall<T>& call, const std::vector<T>& z_loss) {
  double sum = 0;
  for (const T v : z_loss) sum += v;
  if (call.reduction == Reduction::mean) {
    return call.z_divisor > 0 ? sum / call.z_divisor : 0.0;
  }
  return sum;
}

// The upstream gradient of row n: g (scalar, sum/mean) or g_n (none); 1 when absent.
template <class T>
T upstream_of_row(TensorView grad_output, Reduction reduction, int64_t row) {
  if (!grad_output.present()) return T(1);
  return read_scalar<T>(grad_output, reduction == Reduction::none ? row : 0);
}

// The gradient of one row from its logits, for backward passes. `saved_lse` (the forward's, in
// the result dtype; may be absent) skips the statistics. A present `entropy` adds the entropy
// term, with S = lse − H from the saved statistics (or the recomputed ones).
template <class T, class S, class G>
void ce_backward_row(const CeCall<T>& call, const S* x, G* grad, int64_t target, int64_t row,
                     TensorView saved_lse, T upstream, const EntropyGradient& entropy = {}) {
  if (target == call.ignore_index) {
    zero_row(grad, call.vocab);
    return;
  }
  T lse = 0, entropy_value = 0;
  if (saved_lse.present()) {
    lse = read_scalar<T>(saved_lse, row);
    if (entropy.present()) entropy_value = read_scalar<T>(entropy.entropy, row);
  } else {
    const auto stats = ce_row_stats(call, x);
    lse = stats.lse();
    entropy_value = stats.entropy();
  }
  const T r = call.row_weight ? static_cast<T>(call.row_weight[row]) : T(1);
  common::EntropyGradRow<T> entropy_row;
  if (entropy.present()) {
    entropy_row = common::entropy_grad_row(read_scalar<T>(entropy.grad, row), lse, entropy_value);
  }
  ce_write_row_gradient(call, x, grad, lse, target, upstream * r * call.loss_factor,
                        upstream * r * call.z_factor, entropy.present() ? &entropy_row : nullptr);
}

// Per-row results of a forward call, kept until every row is done and then reduced in row
// order, so the result does not depend on the thread schedule.
template <class T>
class CeResults {
 public:
  CeResults(TensorView loss, const CeStats& stats, Reduction reduction, int64_t rows)
      : loss_out_(loss),
        stats_(stats),
        reduction_(reduction),
        loss_(rows),
        z_loss_(rows),
        correct_(rows) {}

  // Called once per row, from any thread.
  void store(int64_t n, const CeRowResult<T>& r) {
    loss_[n] = r.loss;
    z_loss_[n] = r.z_loss;
    correct_[n] = r.correct;
    write_result(stats_.lse, n, r.lse);
    write_result(stats_.logprob, n, r.logprob);
    write_result(stats_.entropy, n, r.entropy);
    if (stats_.argmax.present()) static_cast<int64_t*>(stats_.argmax.data)[n] = r.argmax;
    if (reduction_ == Reduction::none) {
      write_result(loss_out_, n, static_cast<double>(r.loss) + r.z_loss);
      write_result(stats_.z_loss_value, n, r.z_loss);
    }
  }

  void finish(const CeCall<T>& call, const ValidCounts& counts) {
    if (reduction_ != Reduction::none) {
      write_result(loss_out_, 0, reduce_ce_loss(call, loss_, z_loss_));
      write_result(stats_.z_loss_value, 0, reduce_z_loss(call, z_loss_));
    }
    if (stats_.accuracy.present()) {
      int64_t hits = 0;
      for (const char c : correct_) hits += c;
      write_result(stats_.accuracy, 0,
                   counts.valid_rows > 0 ? static_cast<double>(hits) / counts.valid_rows : 0.0);
    }
  }

 private:
  TensorView loss_out_;
  CeStats stats_;
  Reduction reduction_;
  std::vector<T> loss_, z_loss_;
  std::vector<char> correct_;
};

}  // namespace xent::cpu
