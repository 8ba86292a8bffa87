// Fused linear cross-entropy, CPU backend (docs/semantics.md §2). Rows are processed in chunks sized by the
// workspace budget: chunk logits h·Wᵀ (+ bias), the §1 row math on them in place (turning them
// into G = ∂loss/∂x), then the gradient products. Never more than one chunk of logits exists.
#include <algorithm>

#include "api/backend.hpp"
#include "cpu/ce_rows.hpp"
#include "cpu/linear_layer.hpp"

namespace xent::cpu {
namespace {

bool any_gradient(const LinearGradients& grads) {
  return grads.hidden.present() || grads.weight.present() || grads.bias.present();
}

LinearShape linear_ce_shape(TensorView hidden, TensorView weight, bool with_gradients,
                            const LinearCeOptions& options) {
  LinearShape shape;
  shape.rows = hidden.rows;
  shape.hidden = hidden.cols;
  shape.vocab = weight.rows;
  shape.dtype = hidden.dtype;
  shape.with_gradients = with_gradients;
  shape.weight_dtype_accumulation =
      options.weight_grad_accumulation == WeightGradAccumulation::weight_dtype;
  return shape;
}

// Where a pass takes its chunk logits from: the product, the product stored on into the
// caller's logits cache (a forward without gradients), or the cache (a backward).
enum class CacheUse { none, fill, read };

// Runs `row_function(n, logits_row)` on every row, chunk by chunk, once the chunk logits are
// formed; when the pass has gradients the function leaves ∂loss/∂x in the row, and the chunk's
// products follow.
template <class S, class RowFunction>
void for_each_chunk(TensorView hidden, TensorView weight, TensorView bias,
                    const LinearGradients& grads, const LinearCeOptions& options,
                    CacheUse cache_use, Workspace workspace, RowFunction&& row_function) {
  using T = ComputeType<S>;
  const bool with_gradients = any_gradient(grads);
  const auto plan = plan_linear(linear_ce_shape(hidden, weight, with_gradients, options),
                                options.workspace_budget);
  WorkspaceCursor cursor(workspace, plan.total_bytes());
  LinearLayer<S> layer(hidden, weight, bias, plan.weight_copy, plan.bias_copy, cursor);
  std::unique_ptr<LinearGradientAccumulator<S>> accumulator;
  if (with_gradients) {
    accumulator = std::make_unique<LinearGradientAccumulator<S>>(
        grads, plan, cursor, layer.vocab(), layer.width(), options.weight_grad_accumulation);
  }
  T* logits = cursor.take<T>(plan.logits);
  T* hidden_copy = cursor.take<T>(plan.hidden_copy);
  const int64_t rows = hidden.rows, vocab = layer.vocab();
  for (int64_t row0 = 0; row0 < rows; row0 += plan.chunk_rows) {
    const int64_t count = std::min(plan.chunk_rows, rows - row0);
    if (cache_use == CacheUse::read) {
      layer.cached_logits(row0, count, hidden_copy, logits, options.logits_cache);
    } else {
      layer.logits(row0, count, hidden_copy, logits, !options.fp32_logits, options.batch_invariant);
    }
    if (cache_use == CacheUse::fill) {
      store_compute_rows(options.logits_cache, row0, count, logits, vocab);
    }
#pragma omp parallel for schedule(static) if (count * vocab >= kParallelWork)
    for (int64_t r = 0; r < count; ++r) row_function(row0 + r, logits + r * vocab);
    if (accumulator) accumulator->add_chunk(layer, row0, count, logits, hidden_copy);
  }
  if (accumulator) accumulator->finish();
}

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
