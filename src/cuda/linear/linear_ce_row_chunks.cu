// Fused linear cross-entropy on CUDA (docs/semantics.md §2). Per row chunk (chunk_plan.cpp chooses its size):
//   1. L = h_chunk·Wᵀ (+ bias) by cuBLASLt into the chunk buffer (input dtype, or fp32);
//   2. the ce row kernel of ce_rows.cuh reads L once, writes per-row loss parts and statistics,
//      and, when gradients are wanted, G = ∂loss/∂L in place over L, with its final coefficients
//      (N_valid, D and the upstream gradient come from a pre-pass over all targets);
//   3. ∂h_chunk = G·W (written straight into grad hidden) and ∂W += Gᵀ·h_chunk into an fp32
//      accumulator (beta = 1 after the first chunk, or from the first one when ∂W is added into
//      the caller's buffer: accumulate_weight), ∂bias += column sums of G.
// For bf16 operands on Hopper, steps 1–2 are the per-row reference path where it applies
// (linear_reference.cuh): the fused product writes e^(x̃ − r)·slope against each row's target
// logit instead of L, a finish kernel the lse and one factor per row, which steps 3's products
// take on their small operands; no logits are written and no row kernel runs.
// When the budget leaves too little room for the V×H fp32 ∂W accumulator of a 16-bit weight
// gradient (or in-place accumulation over many small chunks costs more), the planner picks the
// vocabulary-blocked schedule (chunk_plan.cpp (c)): the loop above without ∂W, saving each row's
// lse, then per vocabulary block the block's logits again, its gradient elementwise
// (linear_block_grad.cuh) and ∂W of the block (the pass that linear_distill.cu shares,
// linear_block_pass.hpp).
// options.logits_cache, rows [0, R) of the logits (linear_ce.hpp): a forward without gradients
// writes those rows' logits into the cache (one product, the row kernel reads them there) and
// forms the other rows in chunks as without a cache; a backward keeps the plan's chunks and tiles,
// reads those within the cached rows from the cache instead of forming h·Wᵀ, forms those after
// them as without a cache, and for the one across row R copies its cached rows into the chunk
// buffer and forms only the others there; it writes gradients into its own buffers (the cache
// stays intact for further backwards).
// The loss is one fixed-order reduction of the per-row arrays at the end; nothing synchronises
#include <algorithm>
#include <cstdint>

#include "cuda/core/gemm.hpp"
#include "cuda/linear/linear_ce_call.hpp"
#include "cuda/linear/linear_reference.cuh"
#include "cuda/linear/linear_support.hpp"
#include "cuda/linear/weighted_row_sum.cuh"
#include "cuda/plan/hidden_sums.hpp"
#include "cuda/rows/ce_grad.cuh"
#include "cuda/sm90/fused_grad.cuh"
#include "cuda/sm90/fused_stats.hpp"

namespace xent::cuda {

// Schedules (a)–(c): row chunks of logits by cuBLASLt and the ce row kernel (file comment), or
// (a) and (b) through the per-row reference path where `reference` says so.
void run_row_chunks(const LinearCeCall& call, const LinearCePlan& plan, Workspace workspace,
                    cudaStream_t stream, const ReferenceUse& reference) {
  const int64_t rows = call.hidden.rows, hidden = call.hidden.cols, vocab = call.weight.rows;
  const LinearGradients& grads = call.grads;
  const bool want_hidden = grads.hidden.present(), want_weight = grads.weight.present(),
             want_bias = grads.bias.present();
  const bool want_grad = want_hidden || want_weight || want_bias;
  const CeOptions& ce = call.options.ce;
  const Reduction reduction = ce.reduction;
  const CeStats* stats = call.stats;

  const bool blocked = plan.chunks.schedule == Schedule::vocabulary_blocks;
  WorkspaceCarver carver(workspace);
  void* chunk_buffer = carver.take(chunk_region_bytes(plan.chunks));
  auto* totals = static_cast<CeBatchTotals*>(carver.take(sizeof(CeBatchTotals)));
  const std::size_t row_array = static_cast<std::size_t>(rows) * sizeof(float);
  auto* row_loss = static_cast<float*>(carver.take(row_array));
  auto* row_z_loss = static_cast<float*>(carver.take(row_array));
  auto* row_correct = static_cast<float*>(carver.take(row_array));
  const GemmScratch scratch{carver.take(plan.chunks.gemm_workspace_bytes),
                            plan.chunks.gemm_workspace_bytes};
  const GradientSums sums = carve_gradient_sums(carver, grads, vocab, hidden, plan.chunks);
  float* saved_lse = blocked ? static_cast<float*>(carver.take(plan.chunks.lse_bytes)) : nullptr;
  auto* records = static_cast<CeGradRecord*>(carver.take(grad_record_bytes(rows)));
  float* reference_scale = nullptr;
  float* reference_targets = nullptr;
  int32_t* reference_fallback = nullptr;
  // Label smoothing on the reference path (linear_reference.cuh): k_n and Σ w·x̃ per row, w̄, U and
  // their partials.
  const bool reference_smoothing = reference.on && call.options.ce.label_smoothing != 0;
  float* reference_uniform = nullptr;
  float* reference_smoothing_sums = nullptr;
  float* reference_weight_sum = nullptr;
  float* reference_hidden_sum = nullptr;
  float* reference_sum_partials = nullptr;
  if (reference.on) {  // reference_fixed_bytes
    const std::size_t row_floats = align_up(static_cast<std::size_t>(rows) * sizeof(float));
    reference_scale = static_cast<float*>(carver.take(row_floats));
    reference_targets = static_cast<float*>(carver.take(row_floats));
    reference_fallback = static_cast<int32_t*>(
        carver.take(align_up(static_cast<std::size_t>(rows + 1) * sizeof(int32_t))));
    if (reference_smoothing) {
      const std::size_t hidden_floats = static_cast<std::size_t>(hidden) * sizeof(float);
      reference_uniform = static_cast<float*>(carver.take(row_floats));
      reference_smoothing_sums = static_cast<float*>(carver.take(row_floats));
      reference_weight_sum = static_cast<float*>(carver.take(hidden_floats));
      reference_hidden_sum = static_cast<float*>(carver.take(hidden_floats));
      reference_sum_partials =
          static_cast<float*>(carver.take(weighted_row_sum_scratch_bytes(hidden)));
    }
  }
  if (blocked && stats && stats->lse.present()) saved_lse = static_cast<float*>(stats->lse.data);
  const bool entropy_grad = call.entropy.present();
  if (blocked && entropy_grad) saved_lse = static_cast<float*>(call.lse.data);  // read only
  // The logits cache (linear_ce.hpp): filled by a forward without gradients, read by a backward.
  const TensorView& cache = call.options.logits_cache;
  const bool fill_cache = cache.present() && !want_grad && call.op == OpCode::linear_ce_forward;
  const bool read_cache = cache.present() && call.op == OpCode::linear_ce_backward;
  const int64_t cached_rows = fill_cache || read_cache ? cache.rows : 0;
  const bool all_cached = read_cache && cached_rows == rows;

  const CeRowOptions row_options = ce_row_options(ce);
  const bool per_row_upstream = reduction == Reduction::none && call.grad_output.present();
  batch_totals(call, totals, stream);

  const bool sum_or_mean = reduction != Reduction::none;
  const bool want_accuracy = stats && stats->accuracy.present();
  // Filling the cache needs no chunk buffer for the cached rows: they are one product into the
  // cache (the lead chunk), and the rows after them follow in chunks of the plan. Otherwise all
  // chunks are the plan's, from row 0 (its ∂W accumulation counts on them); a backward reads
  // those within the cached rows from the cache.
  const int64_t chunk_rows = std::max<int64_t>(plan.chunks.chunk_rows, 1);
  const int64_t lead_rows = fill_cache ? cached_rows : 0;
  const int64_t lead = lead_rows > 0 ? 1 : 0;
  const DType operand_dtype = call.hidden.dtype;
  const bool narrow_gradient = plan.logits_dtype != operand_dtype;

  const GemmMatrix weight = gemm_matrix(call.weight, 0, vocab);
  auto first_row = [&](int64_t chunk) {
    return chunk < lead ? 0 : lead_rows + (chunk - lead) * chunk_rows;
  };
  auto row_count = [&](int64_t chunk) {
    return chunk < lead ? lead_rows : std::min(chunk_rows, rows - first_row(chunk));
  };
  auto cached = [&](int64_t chunk) {
    return chunk < lead || (read_cache && first_row(chunk) + row_count(chunk) <= cached_rows);
  };
  const std::size_t logits_element = dtype_size(plan.logits_dtype);
  auto cache_at = [&](int64_t row, int64_t column) -> void* {
    return static_cast<char*>(cache.data) +
           (static_cast<std::size_t>(row) * static_cast<std::size_t>(cache.row_stride) +
            static_cast<std::size_t>(column)) *
               logits_element;
  };
  // Where a chunk's logits are (the cache, or the chunk buffer) and their row stride.
  auto logits_of = [&](int64_t chunk) -> void* {
    return cached(chunk) ? cache_at(first_row(chunk), 0) : chunk_buffer;
  };
  auto logits_stride = [&](int64_t chunk) { return cached(chunk) ? cache.row_stride : vocab; };
  // Pass 1 of the blocked schedule forms no ∂W; its gradient is only needed for ∂h and ∂bias.
  const bool chunk_grad = want_grad && (!blocked || want_hidden || want_bias);

  // Stage 1: L = h_chunk·Wᵀ (+ bias). In a backward, a chunk across the cache's last row takes
  // its cached rows' logits from the cache (a copy into the chunk buffer) and forms the others.
  auto form_logits = [&](int64_t chunk) {
    const int64_t first = first_row(chunk), count = row_count(chunk);
    const int64_t held = read_cache ? std::clamp<int64_t>(cached_rows - first, 0, count) : 0;
    if (held > 0) {
      const std::size_t row_bytes = static_cast<std::size_t>(vocab) * logits_element;
      XENT_CUDA_CHECK(cudaMemcpy2DAsync(chunk_buffer, row_bytes, cache_at(first, 0),
                                        static_cast<std::size_t>(cache.row_stride) * logits_element,
                                        row_bytes, static_cast<std::size_t>(held),
                                        cudaMemcpyDeviceToDevice, stream));
    }
    GemmProduct forward;
    forward.a = gemm_matrix(call.hidden, first + held, count - held);
    forward.b = weight;
    forward.b_transposed = true;
    forward.c = GemmMatrix{
        static_cast<char*>(logits_of(chunk)) + static_cast<std::size_t>(held) * logits_element *
                                                   static_cast<std::size_t>(logits_stride(chunk)),
        plan.logits_dtype, count - held, vocab, logits_stride(chunk)};
    forward.bias = call.bias.present() ? call.bias.data : nullptr;
    // A batch-invariant forward: one algorithm whatever the chunk's rows (docs/semantics.md §1);
    // with the row kernel's plan from V and dtype alone, a row's values do not depend on the rows
    // beside it. The backward keeps the default products.
    forward.pinned = call.options.batch_invariant && call.op == OpCode::linear_ce_forward;
    gemm(forward, scratch, stream);
  };
  // Whether a backward's chunk reads any row from the cache (then it takes no fused gradient,
  // which would form them again).
  auto touches_cache = [&](int64_t chunk) { return read_cache && first_row(chunk) < cached_rows; };

  // What the row kernel of a chunk takes: its logits, rows, outputs and gradient (in place).
  auto rows_args = [&](int64_t chunk) {
    const int64_t first = first_row(chunk);
    void* buffer = chunk_buffer;
    CeRowsArgs args;
    args.logits = logits_of(chunk);
    args.dtype = plan.logits_dtype;
    args.rows = row_count(chunk);
    args.vocab = vocab;
    args.row_stride = logits_stride(chunk);
    args.target = static_cast<const char*>(call.target.data) +
                  static_cast<std::size_t>(first) * dtype_size(call.target.dtype);
    args.target_dtype = call.target.dtype;
    args.row_weight = offset_rows<const float>(ce.row_weight, first);
    args.options = row_options;
    args.totals = totals;
    args.grad_output_rows =
        per_row_upstream ? offset_rows<const float>(call.grad_output, first) : nullptr;
    if (call.loss) {
      if (sum_or_mean) {
        args.row_loss = row_loss + first;
        args.row_z_loss = row_z_loss + first;
      } else {
        args.row_total = offset_rows<float>(*call.loss, first);
      }
    }
    if (stats) {
      if (stats->z_loss_value.present()) {
        args.row_z_loss =
            sum_or_mean ? row_z_loss + first : offset_rows<float>(stats->z_loss_value, first);
      }
      if (want_accuracy) args.row_correct = row_correct + first;
      args.lse = offset_rows<float>(stats->lse, first);
      args.logprob = offset_rows<float>(stats->logprob, first);
      args.entropy = offset_rows<float>(stats->entropy, first);
      args.argmax = offset_rows<int64_t>(stats->argmax, first);
    }
    if (saved_lse) args.lse = saved_lse + first;
    if (chunk_grad) {
      args.grad = buffer;
      args.grad_row_stride = vocab;
    }
    return args;
  };

  // Stage 2: the row kernel (loss parts, statistics, gradient in place).
  auto row_kernel = [&](int64_t chunk, cudaStream_t on) {
    const int64_t first = first_row(chunk);
    void* buffer = chunk_buffer;
    const CeRowsArgs args = rows_args(chunk);
    if (!entropy_grad) {
      ce_rows(args, on);
    } else if (chunk_grad) {
      ce_grad_from_lse(args, offset_rows<const float>(call.lse, first),
                       EntropyRows{offset_rows<const float>(call.entropy.entropy, first),
                                   offset_rows<const float>(call.entropy.grad, first)},
                       on);
    }
    // The products take operands of one dtype: fp32 chunk gradients of 16-bit inputs are rounded
    // to the input dtype in place (as F.cross_entropy's bf16 gradient would be).
    if (chunk_grad && narrow_gradient) {
      narrow_rows_in_place(buffer, args.rows, vocab, vocab, operand_dtype, on);
    }
  };

  // Stage 3: ∂h rows, ∂W and ∂bias from the chunk gradient (`fused`: formed by the fused
  // gradient product, in the operand dtype with row stride V).
  auto products = [&](int64_t chunk, bool fused) {
    GemmMatrix gradient{chunk_buffer, plan.logits_dtype, row_count(chunk), vocab, vocab};
    if (fused) {
      gradient.dtype = operand_dtype;
    } else if (narrow_gradient) {
      gradient.dtype = operand_dtype;
      gradient.stride = 2 * vocab;
    }
    const GemmMatrix hidden_rows = gemm_matrix(call.hidden, first_row(chunk), row_count(chunk));
    accumulate_chunk_gradients(gradient, hidden_rows, weight, grads, first_row(chunk), chunk == 0,
                               sums, scratch, stream);
  };

  // A backward that brings the forward's lse forms each chunk's gradient with the fused gradient
  // product where eligible (fused_grad.cuh) and the reference path does not run: no logits
  // written, no row kernel, the gradient in the operand dtype (row stride V) for the products.
  CeBlockPass fused_pass{call,   plan,        chunk_buffer,     nullptr,   scratch,
                         totals, row_options, per_row_upstream, read_cache};
  fused_pass.lse = static_cast<const float*>(call.lse.data);
  fused_pass.records = records;
  const bool fused_chunks = !reference.on && call.op == OpCode::linear_ce_backward &&
                            call.lse.present() && chunk_grad &&
                            fused_gradient_eligible(call, all_cached);
  if (fused_chunks) {
    form_grad_records(fused_pass, stream);  // after batch_totals, on this stream
    // Pass 2 of the blocked schedule reads the lse that the row kernel would have saved.
    if (saved_lse && saved_lse != fused_pass.lse) {
      XENT_CUDA_CHECK(cudaMemcpyAsync(saved_lse, fused_pass.lse,
                                      static_cast<std::size_t>(rows) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream));
    }
  }
  auto fused_chunk_gradient = [&](int64_t chunk) {
    BlockTile tile;
    tile.gradient.grad = chunk_buffer;
    tile.gradient.grad_stride = vocab;
    tile.gradient.dtype = operand_dtype;
    tile.gradient.rows = row_count(chunk);
    tile.gradient.columns = vocab;
    tile.gradient.first_column = 0;
    tile.gradient.vocab = vocab;
    tile.first_row = first_row(chunk);
    return fused_tile_gradient(fused_pass, tile, stream);
  };

  // Stages 1–3 of a chunk by the per-row reference path (linear_reference.cuh): its scratch
  // follows the chunk's exponentials in the (single) chunk buffer. False when it declines.
  auto reference_chunk_gradients = [&](int64_t chunk) {
    const int64_t first = first_row(chunk), count = row_count(chunk);
    ReferenceChunk part;
    part.rows = rows_args(chunk);
    part.hidden_rows = gemm_matrix(call.hidden, first, count);
    part.weight = weight;
    part.records = records + first;
    part.scratch = static_cast<char*>(chunk_buffer) +
                   reference_scratch_offset(chunk_rows, vocab, logits_element, reference_smoothing);
    part.hidden_product = reference.hidden_product_in_weight_grad
                              ? static_cast<float*>(grads.weight.data)
                              : static_cast<float*>(part.scratch);
    part.scale = reference_scale + first;
    part.target_logits = reference_targets + first;
    part.fallback = reference_fallback;
    if (reference_smoothing) {
      part.uniform = reference_uniform + first;
      part.smoothing_sums = reference_smoothing_sums + first;
      part.weight_sum = reference_weight_sum;
      part.hidden_sum = reference_hidden_sum;
      part.sum_partials = reference_sum_partials;
    }
    part.grads = &grads;
    part.sums = &sums;
    part.first_row = first;
    part.first_chunk = chunk == 0;
    part.gemm_scratch = scratch;
    return reference_chunk(part, stream);
  };

  // With saved lse and H, pass 1 of the blocked schedule has nothing to do when it forms no
  // chunk gradient.
  const bool skip_chunks = entropy_grad && !chunk_grad;
  const int64_t chunks = fill_cache ? lead + (rows - lead_rows + chunk_rows - 1) / chunk_rows
                                    : (skip_chunks ? 0 : plan.chunks.chunk_count);
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    if (reference.on && reference_chunk_gradients(chunk)) continue;
    if (fused_chunks && !touches_cache(chunk) && fused_chunk_gradient(chunk)) {
      products(chunk, true);
      continue;
    }
    if (!cached(chunk) || fill_cache) form_logits(chunk);
    row_kernel(chunk, stream);
    if (chunk_grad) products(chunk, false);
  }

  if (blocked && want_weight) {
    CeBlockPass pass{call,   plan,        chunk_buffer,     saved_lse, scratch,
                     totals, row_options, per_row_upstream, read_cache};
    pass.records = records;
    pass.records_formed = fused_chunks;
    run_block_pass(pass, stream);
  }
  finish_gradient_sums(grads, sums, hidden, plan.chunks.chunk_count > 0, stream);

  if (call.loss || want_accuracy || (stats && stats->z_loss_value.present() && sum_or_mean)) {
    CeReduceArgs reduce;
    reduce.rows = rows;
    reduce.reduction = reduction;
    reduce.totals = totals;
    if (sum_or_mean && call.loss) {
      reduce.row_loss = row_loss;
      reduce.row_z_loss = row_z_loss;
      reduce.loss = static_cast<float*>(call.loss->data);
    }
    if (sum_or_mean && stats && stats->z_loss_value.present()) {
      reduce.row_loss = row_loss;
      reduce.row_z_loss = row_z_loss;
      reduce.z_loss_value = static_cast<float*>(stats->z_loss_value.data);
    }
    if (want_accuracy) {
      reduce.row_correct = row_correct;
      reduce.accuracy = static_cast<float*>(stats->accuracy.data);
    }
    ce_reduce(reduce, stream);
  }
}

}  // namespace xent::cuda
