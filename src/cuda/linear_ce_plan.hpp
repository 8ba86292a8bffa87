// The chunk plan the CUDA linear_ce takes for a call (linear_ce.cu). Plain C++, so the GPU test
// suite can assert which schedule (chunk_plan.hpp) its workspace budgets force.
#pragma once

#include <cstdint>

#include "cuda/chunk_plan.hpp"
#include "xent/linear_ce.hpp"

namespace xent::cuda {

// Of `grads` only which gradients are present and their dtypes are read.
ChunkPlan linear_ce_chunk_plan(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                               const LinearCeOptions& options, const LinearGradients& grads);

}  // namespace xent::cuda
