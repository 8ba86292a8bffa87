// The partial-record kernel of vocabulary-parallel ce (ce_shard.cu), for callers whose records
// embed a ce record: the hard-label term of vocabulary-parallel distill (distill_shard.cu).
#pragma once

#include <cuda_runtime.h>

#include "xent/shard.hpp"

namespace xent::cuda {

// The ce records of the local slice `logits` [N, Vl] (fp32/bf16/fp16) written at `records` +
// n·record_stride (device memory, fp32, kCeShardStatsWidth columns each).
void ce_shard_records(TensorView logits, TensorView target, VocabShard shard,
                      const CeOptions& options, float* records, int64_t record_stride,
                      cudaStream_t stream);

}  // namespace xent::cuda
