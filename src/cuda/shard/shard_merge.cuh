// The end of the one-CTA merge kernels of the vocabulary-parallel ops (ce_shard.cu,
// distill_shard.cu): each thread has counted its rows' N_valid and D and its first row with an
// out-of-range target; the CTA reduces them, thread 0 writes the batch totals the loss and
// gradient kernels read and records the error for check_errors.
#pragma once

#include <cub/block/block_reduce.cuh>

#include <climits>

#include "cuda/rows/ce_device.cuh"
#include "cuda/rows/ce_rows.cuh"

namespace xent::cuda {

constexpr int kShardMergeThreads = 1024;
using ShardMergeReduce = cub::BlockReduce<double, kShardMergeThreads>;

// What the totals and the error record need beyond the reduced counts.
struct ShardMergeBatch {
  Reduction reduction;
  float class_weight_sum;    // W of the batch
  const float* grad_output;  // scalar upstream of sum/mean, or null (1)
  const void* target;        // [N] (read for the error record only)
  DType target_dtype;
  int64_t vocab;
  int64_t ignore_index;
  OpCode op;
  DeviceErrorState* error;
};

struct ShardMergeMinimum {
  __device__ double operator()(double a, double b) const { return b < a ? b : a; }
};

__device__ __forceinline__ void finish_shard_merge(double valid, double divisor,
                                                   long long first_bad,
                                                   const ShardMergeBatch& batch,
                                                   CeBatchTotals* totals,
                                                   ShardMergeReduce::TempStorage& storage) {
  valid = ShardMergeReduce(storage).Sum(valid);
  __syncthreads();
  divisor = ShardMergeReduce(storage).Sum(divisor);
  __syncthreads();
  const double bad =
      ShardMergeReduce(storage).Reduce(static_cast<double>(first_bad), ShardMergeMinimum{});
  if (threadIdx.x != 0) return;
  CeBatchTotals t;
  t.valid_rows = valid;
  t.target_weight_sum = divisor;
  t.class_weight_sum = batch.class_weight_sum;
  const bool mean = batch.reduction == Reduction::mean;
  t.loss_factor = mean ? (divisor > 0 ? static_cast<float>(1.0 / divisor) : 0.0f) : 1.0f;
  t.z_factor = mean ? (valid > 0 ? static_cast<float>(1.0 / valid) : 0.0f) : 1.0f;
  t.upstream = batch.grad_output && batch.reduction != Reduction::none ? *batch.grad_output : 1.0f;
  *totals = t;
  DeviceErrorState* error = batch.error;
  if (bad < static_cast<double>(LLONG_MAX) && error->pending == 0) {
    const int64_t row = static_cast<int64_t>(bad);
    error->op = static_cast<int32_t>(batch.op);
    error->row = row;
    error->value = read_target(batch.target, batch.target_dtype, row);
    error->vocab = batch.vocab;
    error->ignore_index = batch.ignore_index;
    error->pending = 1;
  }
}

}  // namespace xent::cuda
