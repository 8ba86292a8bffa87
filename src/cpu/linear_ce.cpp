// Fused linear cross-entropy, CPU backend (docs/semantics.md §2). Rows are processed in chunks sized by the
// workspace budget: chunk logits h·Wᵀ (+ bias), the §1 row math on them in place (turning them
// into G = ∂loss/∂x), then the gradient products. Never more than one chunk of logits exists.
#include "api/backend.hpp"
#include "cpu/ce_rows.hpp"
#include "cpu/linear_chunks.hpp"

namespace xent::cpu {
namespace {

template <class S>
void linear_ce_forward_typed(TensorView hidden, TensorView weight, TensorView bias,
                             TensorView target, const LinearCeOptions& options,
                             const LinearCeOutputs& out, TensorView grad_output,
                             Workspace workspace) {
  using T = ComputeType<S>;
  const CeOptions& ce = options.ce;
  const int64_t rows = hidden.rows, vocab = weight.rows;
  const auto counts = count_valid_rows(target, rows, ce.ignore_index, ce.class_weight);
  const auto call = make_ce_call<T>(ce, vocab, counts);
  const CeRowRequest request{any_gradient(out.grads)};
  CeResults<T> results(out.loss, out.stats, ce.reduction, rows);
  const bool fill_cache = options.logits_cache.present() && !any_gradient(out.grads);
  for_each_chunk<S>(
      hidden, weight, bias, out.grads, options, fill_cache ? CacheUse::fill : CacheUse::none,
      workspace, [&](int64_t n, T* logits_row) {
        results.store(n,
                      ce_process_row(call, logits_row, read_target(target, n), n, request,
                                     upstream_of_row<T>(grad_output, ce.reduction, n), logits_row));
      });
  results.finish(call, counts);
}

template <class S>
void linear_ce_backward_typed(TensorView hidden, TensorView weight, TensorView bias,
                              TensorView target, TensorView lse, TensorView grad_output,
                              const EntropyGradient& entropy, const LinearCeOptions& options,
                              const LinearGradients& grads, Workspace workspace) {
  using T = ComputeType<S>;
  const CeOptions& ce = options.ce;
  const int64_t rows = hidden.rows, vocab = weight.rows;
  const auto counts = count_valid_rows(target, rows, ce.ignore_index, ce.class_weight);
  const auto call = make_ce_call<T>(ce, vocab, counts);
  // The per-row g_n of `none` is folded into G before the products (docs/semantics.md §2: never rescale a
  // summed ∂W).
  for_each_chunk<S>(hidden, weight, bias, grads, options,
                    options.logits_cache.present() ? CacheUse::read : CacheUse::none, workspace,
                    [&](int64_t n, T* logits_row) {
                      ce_backward_row(call, logits_row, logits_row, read_target(target, n), n, lse,
                                      upstream_of_row<T>(grad_output, ce.reduction, n), entropy);
                    });
}

}  // namespace

std::size_t linear_ce_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                     const LinearCeOptions& options, bool with_gradients) {
  LinearShape shape;
  shape.rows = rows;
  shape.hidden = hidden;
  shape.vocab = vocab;
  shape.dtype = dtype;
  shape.with_gradients = with_gradients;
  shape.weight_dtype_accumulation =
      options.weight_grad_accumulation == WeightGradAccumulation::weight_dtype;
  return plan_linear(shape, options.workspace_budget).total_bytes();
}

void linear_ce_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                       const LinearCeOptions& options, const LinearCeOutputs& out,
                       TensorView grad_output, Workspace workspace, Stream) {
  dispatch_float(hidden.dtype, [&](auto storage) {
    linear_ce_forward_typed<decltype(storage)>(hidden, weight, bias, target, options, out,
                                               grad_output, workspace);
  });
}

void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView lse, TensorView grad_output, const EntropyGradient& entropy,
                        const LinearCeOptions& options, const LinearGradients& grads,
                        Workspace workspace, Stream) {
  dispatch_float(hidden.dtype, [&](auto storage) {
    linear_ce_backward_typed<decltype(storage)>(hidden, weight, bias, target, lse, grad_output,
                                                entropy, options, grads, workspace);
  });
}

}  // namespace xent::cpu
