// The row-chunk loop of the fused linear ops on the CPU (linear_ce, linear_policy): chunk logits
// h·Wᵀ (+ bias), a row function on them in place, then the chunk's gradient products.
#pragma once

#include <algorithm>
#include <memory>

#include "cpu/linear_layer.hpp"
#include "xent/linear_ce.hpp"

namespace xent::cpu {

inline bool any_gradient(const LinearGradients& grads) {
  return grads.hidden.present() || grads.weight.present() || grads.bias.present();
}

inline LinearShape linear_ce_shape(TensorView hidden, TensorView weight, bool with_gradients,
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
// caller's logits cache (a forward without gradients), or the cache (a backward). The cache
// holds rows [0, R) (linear_ce.hpp); the other rows always come from the product.
enum class CacheUse { none, fill, read };

// Runs `row_function(n, logits_row)` on every row, chunk by chunk, once the chunk logits are
// formed; when the pass has gradients the function leaves ∂loss/∂x in the row, and the chunk's
// products follow. With a cache of R rows no chunk crosses row R, so each chunk is either read
// from the cache or formed by the product.
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
  const int64_t cached_rows = cache_use == CacheUse::none ? 0 : options.logits_cache.rows;
  for (int64_t row0 = 0, count = 0; row0 < rows; row0 += count) {
    const bool cached = row0 < cached_rows;
    count = std::min(plan.chunk_rows, (cached ? cached_rows : rows) - row0);
    if (cached && cache_use == CacheUse::read) {
      layer.cached_logits(row0, count, hidden_copy, logits, options.logits_cache);
    } else {
      layer.logits(row0, count, hidden_copy, logits, !options.fp32_logits, options.batch_invariant);
    }
    if (cached && cache_use == CacheUse::fill) {
      store_compute_rows(options.logits_cache, row0, count, logits, vocab);
    }
#pragma omp parallel for schedule(static) if (count * vocab >= kParallelWork)
    for (int64_t r = 0; r < count; ++r) row_function(row0 + r, logits + r * vocab);
    if (accumulator) accumulator->add_chunk(layer, row0, count, logits, hidden_copy);
  }
  if (accumulator) accumulator->finish();
}

}  // namespace xent::cpu
