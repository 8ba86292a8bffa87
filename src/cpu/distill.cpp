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
  auto d = make_distill_rows<T>(options, target, rows, vocab, loss, grad_output);
  const bool has_target = target.present();
#pragma omp parallel for schedule(static) if (2 * rows * vocab >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    const auto r = distill_process_row<T>(
        d.call, row_pointer<const S>(student, n), row_pointer<const S>(teacher, n),
        has_target ? read_target(target, n) : 0, has_target, n, d.upstream(n),
        grad.present() ? row_pointer<S>(grad, n) : static_cast<S*>(nullptr), loss.present());
    d.finish_row(n, r);
  }
  d.finish();
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
