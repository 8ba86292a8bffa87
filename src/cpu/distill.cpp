// Distillation losses on logits, CPU backend (docs/semantics.md §3): rows in parallel, per-row losses
// reduced afterwards in row order.
#include <vector>

#include "api/backend.hpp"
#include "cpu/distill_rows.hpp"

namespace xent::cpu {
namespace {

template <class S>
void distill_typed(TensorView student, TensorView teacher, TensorView target,
                   const DistillOptions& options, TensorView loss, TensorView grad,
                   TensorView grad_output) {
  using T = ComputeType<S>;
  const int64_t rows = student.rows, vocab = student.cols;
  const Reduction reduction = options.ce.reduction;
  const auto counts =
      count_valid_rows(target, rows, options.ce.ignore_index, options.ce.class_weight);
  const auto call = make_distill_call<T>(options, vocab, counts);
  const bool has_target = target.present();
  const bool want_loss = loss.present();
  const T scalar =
      grad_output.present() && reduction != Reduction::none ? read_scalar<T>(grad_output, 0) : T(1);

  std::vector<T> soft(rows), hard_loss(rows), hard_z(rows);
#pragma omp parallel for schedule(static) if (2 * rows * vocab >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    const T upstream = reduction == Reduction::none && grad_output.present()
                           ? read_scalar<T>(grad_output, n)
                           : scalar;
    const auto r = distill_process_row<T>(
        call, row_pointer<const S>(student, n), row_pointer<const S>(teacher, n),
        has_target ? read_target(target, n) : 0, has_target, n, upstream,
        grad.present() ? row_pointer<S>(grad, n) : static_cast<S*>(nullptr), want_loss);
    soft[n] = r.soft;
    hard_loss[n] = r.hard_loss;
    hard_z[n] = r.hard_z_loss;
    if (want_loss && reduction == Reduction::none) write_result(loss, n, distill_row_loss(call, r));
  }
  if (want_loss && reduction != Reduction::none) {
    write_result(loss, 0, reduce_distill_loss(call, reduction, soft, hard_loss, hard_z));
  }
}

void distill_dispatch(TensorView student, TensorView teacher, TensorView target,
                      const DistillOptions& options, TensorView loss, TensorView grad,
                      TensorView grad_output) {
  dispatch_float(student.dtype, [&](auto storage) {
    distill_typed<decltype(storage)>(student, teacher, target, options, loss, grad, grad_output);
  });
}

}  // namespace

std::size_t distill_workspace_size(int64_t, int64_t, const DistillOptions&) { return 0; }

void distill_forward(TensorView student, TensorView teacher, TensorView target,
                     const DistillOptions& options, const DistillOutputs& out,
                     TensorView grad_output, Workspace, Stream) {
  distill_dispatch(student, teacher, target, options, out.loss, out.grad_student, grad_output);
}

void distill_backward(TensorView student, TensorView teacher, TensorView target,
                      TensorView grad_output, const DistillOptions& options,
                      TensorView grad_student, Workspace, Stream) {
  distill_dispatch(student, teacher, target, options, TensorView{}, grad_student, grad_output);
}

}  // namespace xent::cpu
