// The partial-record kernel of vocabulary-parallel ce (ce_shard.cu), for callers whose records
// embed a ce record: the hard-label term of vocabulary-parallel distill (distill_shard.cu); and
// the finish of merged records for callers that form records their own way: the fused statistics
// product of linear_ce (fused_stats.cu).
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/device.cuh"
#include "xent/shard.hpp"

namespace xent::cuda {

// The ce records of the local slice `logits` [N, Vl] (fp32/bf16/fp16) written at `records` +
// n·record_stride (device memory, fp32, kCeShardStatsWidth columns each).
void ce_shard_records(TensorView logits, TensorView target, VocabShard shard,
                      const CeOptions& options, float* records, int64_t record_stride,
                      cudaStream_t stream);

// ce_shard_loss on the current device and `stream`, with `op` named in a recorded target error
// (ce_shard_loss itself reports ce_forward). Workspace: ce_shard_workspace_size(target.rows).
void ce_shard_finish(TensorView gathered, TensorView target, VocabShard shard,
                     const CeOptions& options, const CeOutputs& out, Workspace workspace, OpCode op,
                     cudaStream_t stream);

}  // namespace xent::cuda
