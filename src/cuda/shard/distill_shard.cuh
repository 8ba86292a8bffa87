// The merge of vocabulary-parallel distillation's records (distill_shard.cu), for the ops that
// run it outside xent/distill_shard.hpp: linear_distill's schedule (d) (chunk_plan.hpp) forms the
// records of its vocabulary blocks as if each block were a rank's slice, folds them into one
// record per row (common::fold_distill_record), and merges that one record (ranks = 1) here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/rows/distill_rows.cuh"
#include "xent/distill.hpp"

namespace xent::cuda {

struct DistillMergeRequest {
  const float* records = nullptr;  // [ranks·rows, kDistillShardStatsWidth], rank-major
  const float* sums = nullptr;     // [ranks·rows, kDistillShardSumsWidth] (jsd, tvd), or null
  int64_t rows = 0;
  int64_t ranks = 1;
  int64_t vocab = 0;                   // V of the whole row
  TensorView target;                   // [rows] global ids, or absent
  const DistillOptions& options;       // class weights not read (their sums are in the records)
  const float* grad_output = nullptr;  // scalar upstream of sum/mean, or null (1)
  OpCode op = OpCode::distill_forward;
};

// What the merge writes: the batch totals (N_valid, D, the upstream scalar) always; per row
// (null: not wanted) the gradient's constants, the loss parts of sum/mean, the loss of
// reduction none, and the merged w_y of the hard term.
struct DistillMergeOutputs {
  CeBatchTotals* totals = nullptr;
  DistillRowStatistics* statistics = nullptr;
  float* row_soft = nullptr;
  float* row_hard_loss = nullptr;
  float* row_hard_z = nullptr;
  float* row_total = nullptr;
  float* target_weight = nullptr;
};

// One CTA over the rows; also records an out-of-range target for check_errors.
void distill_merge_records(const DistillMergeRequest& request, const DistillMergeOutputs& out,
                           cudaStream_t stream);

}  // namespace xent::cuda
