// Where schedule (d) of the fused linear losses (chunk_plan.hpp) may keep its fp32 N×H ∂h sums,
// as linear_ce.cu and linear_distill.cu tell the planner: the call's own outputs where they can
// hold them before they are written, and the switches that force a place (tests, measurements).
// Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/plan/chunk_plan.hpp"
#include "xent/linear_ce.hpp"

namespace xent::cuda {

// Bytes of the outputs that can serve as (d)'s scratch (ChunkRequest::weight_grad_bytes,
// weight_grad_row_bytes, hidden_grad_bytes); 0 where one cannot.
struct HiddenSumsScratch {
  std::size_t weight_grad_bytes = 0;
  std::size_t weight_grad_row_bytes = 0;
  std::size_t hidden_grad_bytes = 0;
};

// From the call's gradients: a ∂W written over (not added into) as one contiguous, 16-byte
// aligned buffer holds nothing until its rows are written; a contiguous, aligned 16-bit ∂h holds
// nothing until the end, room for the fp32 sums of its first N/2 rows.
HiddenSumsScratch hidden_sums_scratch(const LinearGradients& grads);

// What the workspace query assumes of a call of these sizes whose outputs can serve: ∂W of
// 16-bit or fp32 elements, ∂h 16-bit where the inputs are (half).
HiddenSumsScratch contiguous_hidden_sums_scratch(int64_t rows, int64_t hidden, int64_t vocab,
                                                 bool weight_16_bit, bool half);

// Sets the request's (d) fields of where its ∂h sums may go: `scratch`, and the places that the
// test hook forces (test_hook.hpp); otherwise the planner chooses.
void set_hidden_sums_places(ChunkRequest& request, const HiddenSumsScratch& scratch);

}  // namespace xent::cuda
