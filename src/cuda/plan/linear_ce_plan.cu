// Planning of the CUDA linear_ce (docs/architecture.md, "Schedules"): which schedule a call runs
// and with how many rows of logits at once (chunk_plan.cpp prices the candidates), and the
// workspace query, which reports the largest plan a call of these sizes may choose.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "api/backend.hpp"
#include "cuda/linear/linear_block_grad.cuh"
#include "cuda/linear/linear_reference.cuh"
#include "cuda/linear/linear_support.hpp"
#include "cuda/plan/linear_ce_plan.hpp"
#include "cuda/plan/linear_ce_planning.hpp"
#include "cuda/rows/ce_rows.cuh"
#include "cuda/sm90/fused_grad.cuh"
#include "cuda/sm90/fused_stats.hpp"

namespace xent::cuda {

namespace {

// The fused gradient product's tile and the current device's multiprocessors, so that the planner
// prices that product's waves (ChunkRequest::gradient_tile_rows), where (d)'s blocks may take it:
// 16-bit logits, a hidden size it is preferred for, the sm_90a kernel built, a device on the
// Hopper paths at hand (the size query and the call then plan alike). Not set without one (CPU
// builds, tests).
void set_gradient_tiles(ChunkRequest& request, DType dtype, const LinearCeOptions& options) {
  if (options.fp32_logits || dtype == DType::f32 || !fused_grad_product_built() ||
      !fused_grad_preferred(request.hidden)) {
    return;
  }
  int device = 0, multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess) {
    (void)cudaGetLastError();  // no device here: leave no error for the next check
    return;
  }
  if (!hopper_paths(device)) return;  // sm_90a code: compute capability 9.0 only
  request.gradient_tile_rows = kFusedTileRows;
  request.gradient_tile_columns = kFusedTileColumns;
  request.multiprocessors = multiprocessors;
}

}  // namespace

// The gradient records of every row (linear_block_grad.cuh, CeGradRecord) that the fused gradient
// product reads: part of every plan's fixed bytes, 32 per row.
std::size_t grad_record_bytes(int64_t rows) {
  return align_up(static_cast<std::size_t>(std::max<int64_t>(rows, 0)) * sizeof(CeGradRecord));
}

LinearCePlan plan_linear_ce(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                            const LinearCeOptions& options, const PlanWants& wants) {
  ChunkRequest request;
  request.rows = rows;
  request.hidden = hidden;
  request.vocab = vocab;
  request.logits_element_bytes = options.fp32_logits ? sizeof(float) : dtype_size(dtype);
  request.budget_bytes = options.workspace_budget;
  request.fixed_bytes = row_scratch_bytes(rows) + grad_record_bytes(rows);
  if (wants.reference_row_bytes > 0) {
    const bool smoothing = options.ce.label_smoothing != 0;
    request.fixed_bytes += reference_fixed_bytes(rows, hidden, smoothing);
    request.chunk_row_scratch_bytes = wants.reference_row_bytes;
    request.chunk_buffer_extra_bytes = reference_buffer_extra_bytes(vocab, hidden, smoothing);
  }
  // Only the gradient path pipelines (the forward-only path has no products to hide behind).
  request.gradient_in_product = wants.gradients && wants.reference_priced;
  request.weight_gradient = wants.gradients && wants.weight;
  // weight_dtype: a 16-bit ∂W is summed in the caller's output, so no fp32 accumulator is counted
  // (docs/semantics.md §2); an fp32 ∂W has none to drop.
  const bool sixteen_bit_weight = request.weight_gradient && wants.weight_accumulator;
  const bool in_output = options.weight_grad_accumulation == WeightGradAccumulation::weight_dtype;
  request.weight_accumulator = sixteen_bit_weight && !in_output;
  request.weight_sums_in_output = sixteen_bit_weight && in_output;
  request.bias_accumulator_bytes =
      bias_accumulator_bytes(wants.gradients && wants.bias_accumulator, vocab);
  request.statistics_product = wants.gradients && wants.statistics;
  request.statistics_bytes = fused_stats_minimum_bytes(rows, vocab);
  request.hidden_gradient = wants.gradients && wants.hidden;
  request.prefer_statistics = fused_stats_forced();
  set_hidden_sums_places(request, wants.sums_scratch);
  set_gradient_tiles(request, dtype, options);
  LinearCePlan plan;
  plan.chunks = plan_chunks(request);
  plan.logits_dtype = options.fp32_logits ? DType::f32 : dtype;
  return plan;
}

// The plan of a call with these gradients: a 16-bit ∂W or ∂bias needs an fp32 accumulator; an
// fp32 one (accumulate_weight's buffer included) is accumulated in place.
LinearCePlan plan_for_gradients(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                const LinearCeOptions& options, const LinearGradients& grads,
                                bool statistics, bool reference_priced,
                                std::size_t reference_row_bytes) {
  PlanWants wants;
  wants.weight = grads.weight.present();
  wants.hidden = grads.hidden.present();
  const bool want_bias = grads.bias.present();
  wants.gradients = wants.weight || want_bias || wants.hidden;
  wants.weight_accumulator = wants.weight && grads.weight.dtype != DType::f32;
  wants.bias_accumulator = want_bias && grads.bias.dtype != DType::f32;
  wants.statistics = statistics;
  wants.sums_scratch = hidden_sums_scratch(grads);
  wants.reference_row_bytes = reference_row_bytes;
  wants.reference_priced = reference_priced;
  return plan_linear_ce(rows, hidden, vocab, dtype, options, wants);
}

// Whether a call planned as `plan` takes the per-row reference path with the plan `with_scratch`
// that holds its scratch: only where that changes neither the row-chunk schedule nor the number of
// chunks (each more chunk would cost a pass over the ∂W sums), with one chunk buffer.
bool reference_plan_accepted(const LinearCePlan& plan, const LinearCePlan& with_scratch) {
  const Schedule schedule = plan.chunks.schedule;
  return (schedule == Schedule::row_chunks || schedule == Schedule::row_chunks_accumulated) &&
         with_scratch.chunks.fits_budget && with_scratch.chunks.schedule == schedule &&
         with_scratch.chunks.chunk_count == plan.chunks.chunk_count;
}

// Whether a call of this dtype, options and gradients may form its row chunks by the per-row
// reference path, as far as its plan's inputs show (reference_candidate adds what only the call
// shows): its row chunks are then priced without the row kernel (PlanWants::reference_priced).
bool reference_path_possible(DType dtype, const LinearCeOptions& options,
                             const LinearGradients& grads) {
  const bool want_grad = grads.hidden.present() || grads.weight.present() || grads.bias.present();
  return want_grad && reference_path_enabled() && !options.logits_cache.present() &&
         !options.fp32_logits && !grads.bias.present() && reference_options_eligible(options.ce) &&
         dtype == DType::bf16;
}

LinearCeOptions without_cache(const LinearCeOptions& options) {
  LinearCeOptions uncached = options;
  uncached.logits_cache = TensorView{};
  return uncached;
}

ChunkPlan linear_ce_chunk_plan(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                               const LinearCeOptions& options, const LinearGradients& grads,
                               bool statistics_product) {
  return plan_for_gradients(rows, hidden, vocab, dtype, options, grads, statistics_product,
                            reference_path_possible(dtype, options, grads))
      .chunks;
}

std::size_t linear_ce_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                     const LinearCeOptions& options, bool with_gradients) {
  // The query cannot see which gradients come, nor their dtypes, nor whether the call can take
  // the fused statistics product (device, alignment, bias): it reports the largest plan a call
  // of these sizes may choose (with and without fp32 accumulators for 16-bit ∂W and ∂bias, with
  // and without ∂h and schedule (d)). Each is within the budget whenever the budget holds the
  // smallest plan.
  std::size_t bytes = 0;
  const bool half = dtype != DType::f32;
  // A call with gradients reads a logits cache and writes none, so the cache keeps it off no
  // plan of schedule (d) (linear_ce.cu).
  const bool candidate = fused_stats_candidate(dtype, without_cache(options));
  // Each choice once: {false} where its other side cannot occur (the query runs per call, and
  // every plan costs the planner's scan of block widths).
  auto choices = [](bool possible) {
    return possible ? std::vector<bool>{false, true} : std::vector<bool>{false};
  };
  // A plan's bytes, and where a bf16 step may take the per-row reference path, its scratch (with
  // the ∂h product in it or in the ∂W output, and with the statistics form's sums at the hidden
  // sizes that take it) beside the same chunks.
  auto consider = [&](PlanWants wants) {
    const LinearCePlan plan = plan_linear_ce(rows, hidden, vocab, dtype, options, wants);
    bytes = std::max(bytes, plan.chunks.total_bytes);
    const Schedule schedule = plan.chunks.schedule;
    const bool row_chunks =
        schedule == Schedule::row_chunks || schedule == Schedule::row_chunks_accumulated;
    if (!with_gradients || dtype != DType::bf16 || !row_chunks) return;
    for (const bool product_in_scratch : {false, true}) {
      for (const bool row_statistics : choices(reference_statistics_preferred(hidden))) {
        wants.reference_row_bytes =
            reference_chunk_row_bytes(vocab, hidden, product_in_scratch, row_statistics);
        const LinearCePlan with_scratch =
            plan_linear_ce(rows, hidden, vocab, dtype, options, wants);
        if (reference_plan_accepted(plan, with_scratch)) {
          bytes = std::max(bytes, with_scratch.chunks.total_bytes);
        }
      }
    }
  };
  for (const bool weight : {false, true}) {
    for (const bool weight_16_bit : choices(half && weight)) {
      for (const bool bias : choices(half)) {
        for (const bool statistics : choices(candidate && with_gradients)) {
          for (const bool hidden_gradient : {true, false}) {
            // (d) may keep its ∂h sums in a contiguous ∂W (16-bit, or fp32) and ∂h output.
            for (const bool sums_in_outputs : choices(statistics && weight && hidden_gradient)) {
              PlanWants wants;
              wants.gradients = with_gradients;
              wants.weight = weight;
              wants.weight_accumulator = weight_16_bit;
              wants.bias_accumulator = bias;
              wants.hidden = hidden_gradient;
              wants.statistics = statistics;
              if (sums_in_outputs) {
                wants.sums_scratch =
                    contiguous_hidden_sums_scratch(rows, hidden, vocab, weight_16_bit, half);
              }
              consider(wants);
              // Row chunks priced as the per-row reference path (reference_path_possible).
              if (with_gradients && dtype == DType::bf16 && !bias && reference_path_enabled()) {
                wants.reference_priced = true;
                consider(wants);
              }
            }
          }
        }
      }
    }
  }
  // A forward without gradients may take the fused statistics product (fused_stats.hpp) when
  // its tile partials fit the budget: the caller's workspace must then hold them too.
  if (!with_gradients && fused_stats_candidate(dtype, options)) {
    bytes = std::max(bytes, fused_stats_workspace_bytes(rows, vocab, options.workspace_budget));
  }
  return bytes;
}

}  // namespace xent::cuda
