// Vocabulary-parallel cross-entropy (docs/semantics.md §5): the pieces a rank runs on its own slice
// [offset, offset + cols) of the vocabulary, with no communication library in the core. The
// caller (python/xent/distributed.py) moves the per-row partial statistics between ranks:
//
//   1. ce_shard_stats     reads the local logits once: one partial record per row (below).
//   2. all_gather         the [N, kCeShardStatsWidth] records of every rank → [P·N, width]
//                         (O(N·P) bytes; one collective per forward, none in the backward).
//   3. ce_shard_loss      merges the P records of each row (common::RowStats::merge, the same
//                         merge the row kernels use between CTAs) into the loss and the optional
//                         statistics; it reads no logits.
//   4. ce_shard_backward  merges again (N·P records, negligible) and writes the gradient of the
//                         local slice: one read of the logits, one write.
// A training step therefore reads the local logits twice and writes them once: the floor for a
// sharded loss, whose gradient needs the global lse, known only after a collective.
#pragma once

#include "xent/ce.hpp"

namespace xent {

// The local slice of the vocabulary: columns [offset, offset + cols of the logits) of `vocab`.
struct VocabShard {
  int64_t offset = 0;  // v0: global id of the first local column
  int64_t vocab = 0;   // V: global vocabulary size (targets are global ids, smoothing uses ε/V)
};

// Columns of one partial record (fp32 for fp32/bf16/fp16 logits, fp64 for fp64 logits). The
// argmax column holds the global column index bit-cast (int32 in fp32 records, int64 in fp64
// records), so gathering moves it exactly; -1 when the slice is empty.
enum CeShardColumn : int64_t {
  kShardMax = 0,            // max of x̃ over the slice
  kShardSumExp,             // Σ e^(x̃−max)
  kShardSumExpShift,        // Σ e^(x̃−max)·(x̃−max)   (entropy)
  kShardSumLogits,          // Σ x̃
  kShardSumWeightedLogits,  // Σ w_i·x̃_i (w ≡ 1 without class weights)
  kShardArgmax,             // first global column of the max (bit-cast)
  kShardTargetLogit,        // x̃_y when y is in the slice, else 0
  kShardTargetWeight,       // w_y (1 unweighted) when y is in the slice, else 0
  kShardClassWeightSum,     // Σ w_i over the slice (its column count unweighted)
  kCeShardStatsWidth
};

// logits [N, Vl] (the local slice), target [N] global ids; options.class_weight is the local
// slice of the class weights [Vl]; row_weight is not read. partial [N, kCeShardStatsWidth].
void ce_shard_stats(TensorView logits, TensorView target, VocabShard shard,
                    const CeOptions& options, TensorView partial, Stream stream = {});

// Bytes of workspace ce_shard_loss / ce_shard_backward need (0 on the CPU).
std::size_t ce_shard_workspace_size(int64_t rows, Device device);

// gathered [P·N, kCeShardStatsWidth]: the partial records of P ranks, rank-major (rank p's row n
// at p·N + n), P ≥ 1. options.class_weight is not read (its sums arrive in the records);
// row_weight [N] is. out.grad_logits must be absent.
void ce_shard_loss(TensorView gathered, TensorView target, VocabShard shard,
                   const CeOptions& options, const CeOutputs& out, Workspace workspace = {},
                   Stream stream = {});

// The gradient of the local slice for the upstream gradient (scalar for sum/mean, [N] for none).
// logits and grad_logits [n, Vl] may be a block of rows [first_row, first_row + n) of the batch
// that target, gathered, row_weight and grad_output describe (the row chunks of a sharded
// linear_ce): the mean divisors D and N_valid are always those of the whole batch.
void ce_shard_backward(TensorView logits, TensorView target, VocabShard shard, TensorView gathered,
                       TensorView grad_output, const CeOptions& options, TensorView grad_logits,
                       int64_t first_row = 0, Workspace workspace = {}, Stream stream = {});

}  // namespace xent
