// The first pass of linear_distill's schedule (d) (chunk_plan.hpp): every row's distillation
// statistics formed block by block of vocabulary columns, never from a whole row, so the products
// that form the logits keep all N rows (or large row tiles) however small the budget. Each tile of
// a block is taken as a rank's slice of vocabulary-parallel distillation (xent/distill_shard.hpp):
// distill_shard_stats forms its records (the slice's two lse, its divergence between the
// slice-renormalised distributions, the hard term's ce record), and they fold into one running
// record per row (common::fold_distill_record). jsd and tvd need the global lse before their
// per-element terms: a second sweep over the blocks adds up their sums (distill_shard_sums).
// distill_merge_records (distill_shard.cuh) then turns each row's record into its loss and the
// gradient's row constants, as it does for a single rank.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/linear/linear_support.hpp"
#include "xent/distill.hpp"

namespace xent::cuda {

struct DistillRecords {
  float* running = nullptr;       // [N, kDistillShardStatsWidth]: the columns swept so far
  float* tile = nullptr;          // [tile rows, kDistillShardStatsWidth]: one tile's block
  float* running_sums = nullptr;  // [N, kDistillShardSumsWidth] (jsd, tvd)
  float* tile_sums = nullptr;     // [tile rows, kDistillShardSumsWidth] (jsd, tvd)
  Workspace shard;                // distill_shard_stats' scratch for a tile
};

// Bytes of the records of N rows (tiles of up to N rows), each region on the workspace alignment.
std::size_t distill_records_bytes(int64_t rows, DistillKind kind);
DistillRecords carve_distill_records(WorkspaceCarver& carver, int64_t rows, DistillKind kind);

// The logits of one tile of one block.
struct DistillTile {
  TensorView student;  // [rows, columns]
  TensorView teacher;  // [rows, columns], the student's dtype
  TensorView target;   // [rows] global ids, or absent
  int64_t first_row = 0;
  int64_t first_column = 0;
  int64_t vocab = 0;
};

// Sweep 1: the tile's records over its block, folded into its rows' running records (the
// first block writes them). `options`: the call's (class weights over all of V).
void add_tile_records(const DistillRecords& records, const DistillTile& tile,
                      const DistillOptions& options, bool first_block, cudaStream_t stream);

// Sweep 2 (jsd, tvd; distill_shard_needs_sums), after sweep 1 over every block: the tile's sums
// with its rows' global lse from the running records, added up over the blocks.
void add_tile_sums(const DistillRecords& records, const DistillTile& tile,
                   const DistillOptions& options, bool first_block, cudaStream_t stream);

}  // namespace xent::cuda
