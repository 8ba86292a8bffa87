// What the CUDA linear_ce's planning (linear_ce_plan.cu) gives its runners (linear/linear_ce*.cu):
// the plan of a call, what the planner is asked, and the choices between the row-chunk paths.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/plan/chunk_plan.hpp"
#include "cuda/plan/hidden_sums.hpp"
#include "xent/linear_ce.hpp"

namespace xent::cuda {

struct LinearCePlan {
  ChunkPlan chunks;
  DType logits_dtype = DType::bf16;
};

// What a call wants formed, as the planner sees it.
struct PlanWants {
  bool gradients = false;           // any gradient
  bool weight = false;              // ∂W
  bool weight_accumulator = false;  // ∂W in a 16-bit dtype (fp32 sums over chunks)
  bool bias_accumulator = false;    // ∂bias in a 16-bit dtype
  bool hidden = false;              // ∂h
  // The call may take schedule (d): it can form its statistics with the fused product
  // (fused_stats_eligible).
  bool statistics = false;
  // The outputs as (d)'s scratch for its ∂h sums.
  HiddenSumsScratch sums_scratch;
  // The per-row reference path's bytes per chunk row (linear_reference.cuh), or 0.
  std::size_t reference_row_bytes = 0;
  // The call's row chunks may take that path (reference_candidate): they are priced without the
  // row kernel (ChunkRequest::gradient_in_product).
  bool reference_priced = false;
};

// The gradient records of every row that the fused gradient product reads (32 bytes a row).
std::size_t grad_record_bytes(int64_t rows);

LinearCePlan plan_linear_ce(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                            const LinearCeOptions& options, const PlanWants& wants);

// The plan of a call with these gradients: a 16-bit ∂W or ∂bias needs an fp32 accumulator; an
// fp32 one (accumulate_weight's buffer included) is accumulated in place.
LinearCePlan plan_for_gradients(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                const LinearCeOptions& options, const LinearGradients& grads,
                                bool statistics, bool reference_priced,
                                std::size_t reference_row_bytes = 0);

// Whether a call planned as `plan` takes the per-row reference path with the plan `with_scratch`.
bool reference_plan_accepted(const LinearCePlan& plan, const LinearCePlan& with_scratch);

// The options without the logits cache: what a call that only reads a cache is planned and sized
// with (a cache keeps a forward that fills it off the fused products; a reader, off none).
LinearCeOptions without_cache(const LinearCeOptions& options);

// Whether a call of this dtype, options and gradients may form its row chunks by the per-row
// reference path, as far as its plan's inputs show.
bool reference_path_possible(DType dtype, const LinearCeOptions& options,
                             const LinearGradients& grads);

}  // namespace xent::cuda
