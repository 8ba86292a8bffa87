// Cross-entropy on logits, CPU backend (docs/semantics.md §1): rows in parallel with OpenMP, per-row results
// reduced afterwards in row order so every run gives the same bits.
#include "api/backend.hpp"
#include "cpu/ce_rows.hpp"

namespace xent::cpu {
namespace {

template <class S>
void ce_forward_typed(TensorView logits, TensorView target, const CeOptions& options,
                      const CeOutputs& out, TensorView grad_output) {
  using T = ComputeType<S>;
  const int64_t rows = logits.rows, vocab = logits.cols;
  const auto counts = count_valid_rows(target, rows, options.ignore_index, options.class_weight);
  const auto call = make_ce_call<T>(options, vocab, counts);
  const CeRowRequest request{out.grad_logits.present()};
  CeResults<T> results(out.loss, out.stats, options.reduction, rows);

#pragma omp parallel for schedule(static) if (rows * vocab >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    S* grad = request.gradient ? row_pointer<S>(out.grad_logits, n) : nullptr;
    results.store(
        n, ce_process_row(call, row_pointer<const S>(logits, n), read_target(target, n), n, request,
                          upstream_of_row<T>(grad_output, options.reduction, n), grad));
  }
  results.finish(call, counts);
}

template <class S>
void ce_backward_typed(TensorView logits, TensorView target, TensorView lse, TensorView grad_output,
                       const EntropyGradient& entropy, const CeOptions& options,
                       TensorView grad_logits) {
  using T = ComputeType<S>;
  const int64_t rows = logits.rows, vocab = logits.cols;
  const auto counts = count_valid_rows(target, rows, options.ignore_index, options.class_weight);
  const auto call = make_ce_call<T>(options, vocab, counts);

#pragma omp parallel for schedule(static) if (rows * vocab >= kParallelWork)
  for (int64_t n = 0; n < rows; ++n) {
    ce_backward_row(call, row_pointer<const S>(logits, n), row_pointer<S>(grad_logits, n),
                    read_target(target, n), n, lse,
                    upstream_of_row<T>(grad_output, options.reduction, n), entropy);
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
                 const EntropyGradient& entropy, const CeOptions& options, TensorView grad_logits,
                 Workspace, Stream) {
  dispatch_float(logits.dtype, [&](auto storage) {
    ce_backward_typed<decltype(storage)>(logits, target, lse, grad_output, entropy, options,
                                         grad_logits);
  });
}

void check_errors(Device, Stream) {}

}  // namespace xent::cpu
