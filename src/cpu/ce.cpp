// Cross-entropy on logits, CPU backend (SPEC.md §1): rows in parallel with OpenMP, per-row results
// reduced afterwards in row order so every run gives the same bits.
#include <vector>

#include "api/backend.hpp"
#include "cpu/ce_rows.hpp"

namespace xent::cpu {
namespace {

template <class T>
T scalar_upstream(TensorView grad_output) {
  return grad_output.present() ? read_scalar<T>(grad_output, 0) : T(1);
}

template <class T>
T row_upstream(TensorView grad_output, Reduction reduction, int64_t row, T scalar) {
  if (reduction != Reduction::none) return scalar;
  return grad_output.present() ? read_scalar<T>(grad_output, row) : T(1);
}

template <class S>
void ce_forward_typed(TensorView logits, TensorView target, const CeOptions& options,
                      const CeOutputs& out, TensorView grad_output) {
  using T = ComputeType<S>;
  const int64_t rows = logits.rows, vocab = logits.cols;
  const auto counts = count_valid_rows(target, rows, options.ignore_index, options.class_weight);
  const auto call = make_ce_call<T>(options, vocab, counts);
  const CeStats& stats = out.stats;
  const CeRowRequest request{stats.entropy.present(), out.grad_logits.present()};
  const T scalar = scalar_upstream<T>(grad_output);

  std::vector<T> loss(rows), z_loss(rows);
  std::vector<char> correct(rows);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const S* x = row_pointer<S>(logits, n);
    S* grad = request.gradient ? row_pointer<S>(out.grad_logits, n) : nullptr;
    const auto r = ce_process_row(call, x, read_target(target, n), n, request,
                                  row_upstream(grad_output, options.reduction, n, scalar), grad);
    loss[n] = r.loss;
    z_loss[n] = r.z_loss;
    correct[n] = r.correct;
    write_f32(stats.lse, n, r.lse);
    write_f32(stats.logprob, n, r.logprob);
    write_f32(stats.entropy, n, r.entropy);
    if (stats.argmax.present()) static_cast<int64_t*>(stats.argmax.data)[n] = r.argmax;
    if (options.reduction == Reduction::none) {
      write_f32(out.loss, n, static_cast<double>(r.loss) + r.z_loss);
      write_f32(stats.z_loss_value, n, r.z_loss);
    }
  }

  if (options.reduction != Reduction::none) {
    write_f32(out.loss, 0, reduce_ce_loss(call, loss, z_loss));
    write_f32(stats.z_loss_value, 0, reduce_z_loss(call, z_loss));
  }
  if (stats.accuracy.present()) {
    int64_t hits = 0;
    for (int64_t n = 0; n < rows; ++n) hits += correct[n];
    write_f32(stats.accuracy, 0,
              counts.valid_rows > 0 ? static_cast<double>(hits) / counts.valid_rows : 0.0);
  }
}

template <class S>
void ce_backward_typed(TensorView logits, TensorView target, TensorView lse,
                       TensorView grad_output, const CeOptions& options,
                       TensorView grad_logits) {
  using T = ComputeType<S>;
  const int64_t rows = logits.rows, vocab = logits.cols;
  const auto counts = count_valid_rows(target, rows, options.ignore_index, options.class_weight);
  const auto call = make_ce_call<T>(options, vocab, counts);
  const T scalar = scalar_upstream<T>(grad_output);
  // The saved lse is fp32; fp64 inputs recompute it so their gradient keeps fp64 precision.
  const bool use_saved_lse = lse.present() && !std::is_same_v<T, double>;

#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) {
    const S* x = row_pointer<S>(logits, n);
    S* grad = row_pointer<S>(grad_logits, n);
    const int64_t y = read_target(target, n);
    if (y == call.ignore_index) {
      zero_row(grad, vocab);
      continue;
    }
    const T row_lse = use_saved_lse ? read_scalar<T>(lse, n) : ce_row_stats(call, x).lse();
    const T upstream = row_upstream(grad_output, options.reduction, n, scalar);
    const T r = call.row_weight ? static_cast<T>(call.row_weight[n]) : T(1);
    ce_write_row_gradient(call, x, grad, row_lse, y, upstream * r * call.loss_factor,
                          upstream * r * call.z_factor);
  }
}

}  // namespace

std::size_t ce_workspace_size(int64_t, int64_t, const CeOptions&) { return 0; }

void ce_forward(TensorView logits, TensorView target, const CeOptions& options,
                const CeOutputs& out, TensorView grad_output, Workspace, Stream) {
  dispatch_float(logits.dtype, [&](auto storage) {
    ce_forward_typed<decltype(storage)>(logits, target, options, out, grad_output);
  });
}

void ce_backward(TensorView logits, TensorView target, TensorView lse, TensorView grad_output,
                 const CeOptions& options, TensorView grad_logits, Workspace, Stream) {
  dispatch_float(logits.dtype, [&](auto storage) {
    ce_backward_typed<decltype(storage)>(logits, target, lse, grad_output, options,
                                         grad_logits);
  });
}

void check_errors(Device, Stream) {}

}  // namespace xent::cpu
