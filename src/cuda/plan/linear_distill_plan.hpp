// The chunk plan the CUDA linear_distill takes for a call (linear_distill.cu). Plain C++, so the
// GPU test suite can assert which schedule (chunk_plan.hpp) its workspace budgets force.
#pragma once

#include <cstdint>

#include "cuda/plan/chunk_plan.hpp"
#include "xent/linear_distill.hpp"

namespace xent::cuda {

// teacher_hidden > 0: the teacher comes as hidden + weight; else as logits of
// teacher_logits_dtype. Of `grads` only which gradients are present and their dtypes are read.
ChunkPlan linear_distill_chunk_plan(int64_t rows, int64_t student_hidden, int64_t teacher_hidden,
                                    int64_t vocab, DType dtype, const LinearDistillOptions& options,
                                    DType teacher_logits_dtype, const LinearGradients& grads);

// How many linear_distill calls of this process ran each schedule: tests assert which one ran.
int64_t linear_distill_runs(Schedule schedule);

}  // namespace xent::cuda
