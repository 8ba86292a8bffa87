// The records of linear_distill's schedule (d), block by block (linear_distill_records.cuh).
#include "cuda/linear/linear_distill_records.cuh"

#include <algorithm>

#include "api/shard_backend.hpp"
#include "common/distill_shard.hpp"
#include "cuda/core/device.cuh"
#include "cuda/core/gemm.hpp"

namespace xent::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kRecord = kDistillShardStatsWidth;
constexpr int64_t kSums = kDistillShardSumsWidth;

unsigned blocks_for(int64_t work) {
  return static_cast<unsigned>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 4096));
}

__global__ void fold_records_kernel(common::DistillKindCode kind, float* running, const float* tile,
                                    int64_t rows) {
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < rows;
       n += int64_t{gridDim.x} * blockDim.x) {
    common::fold_distill_record(kind, running + n * kRecord, tile + n * kRecord,
                                running + n * kRecord);
  }
}

__global__ void add_sums_kernel(float* running, const float* tile, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    running[i] += tile[i];
  }
}

std::size_t floats(int64_t rows, int64_t width) {
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(width) * sizeof(float);
}

// The call's options for one block: its class weights are the block's columns, as a rank's are
// its slice's.
DistillOptions block_options(const DistillOptions& options, const DistillTile& tile) {
  DistillOptions local = options;
  if (options.ce.class_weight.present()) {
    local.ce.class_weight =
        view_rows(options.ce.class_weight, tile.first_column, tile.student.cols);
  }
  return local;
}

TensorView record_rows(float* data, int64_t rows, int64_t width, Device device) {
  return matrix(data, DType::f32, rows, width, width, device);
}

}  // namespace

std::size_t distill_records_bytes(int64_t rows, DistillKind kind) {
  const bool sums = distill_shard_needs_sums(kind);
  return 2 * align_up(floats(rows, kRecord)) + (sums ? 2 * align_up(floats(rows, kSums)) : 0) +
         align_up(distill_shard_workspace_size(rows));
}

DistillRecords carve_distill_records(WorkspaceCarver& carver, int64_t rows, DistillKind kind) {
  DistillRecords records;
  records.running = static_cast<float*>(carver.take(floats(rows, kRecord)));
  records.tile = static_cast<float*>(carver.take(floats(rows, kRecord)));
  if (distill_shard_needs_sums(kind)) {
    records.running_sums = static_cast<float*>(carver.take(floats(rows, kSums)));
    records.tile_sums = static_cast<float*>(carver.take(floats(rows, kSums)));
  }
  const std::size_t shard = distill_shard_workspace_size(rows);
  records.shard = Workspace{carver.take(shard), shard};
  return records;
}

void add_tile_records(const DistillRecords& records, const DistillTile& tile,
                      const DistillOptions& options, bool first_block, cudaStream_t stream) {
  const int64_t rows = tile.student.rows;
  float* running = records.running + tile.first_row * kRecord;
  float* out = first_block ? running : records.tile;
  cuda::distill_shard_stats(tile.student, tile.teacher, tile.target,
                            VocabShard{tile.first_column, tile.vocab}, block_options(options, tile),
                            record_rows(out, rows, kRecord, tile.student.device), records.shard,
                            Stream{stream});
  if (first_block) return;
  fold_records_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
      static_cast<common::DistillKindCode>(options.kind), running, records.tile, rows);
  XENT_CUDA_CHECK_LAUNCH();
}

void add_tile_sums(const DistillRecords& records, const DistillTile& tile,
                   const DistillOptions& options, bool first_block, cudaStream_t stream) {
  const int64_t rows = tile.student.rows;
  float* running = records.running_sums + tile.first_row * kSums;
  float* out = first_block ? running : records.tile_sums;
  const Device device = tile.student.device;
  cuda::distill_shard_sums(
      tile.student, tile.teacher, tile.target, VocabShard{tile.first_column, tile.vocab},
      record_rows(records.running + tile.first_row * kRecord, rows, kRecord, device),
      block_options(options, tile), record_rows(out, rows, kSums, device), Workspace{},
      Stream{stream});
  if (first_block) return;
  add_sums_kernel<<<blocks_for(rows * kSums), kThreads, 0, stream>>>(running, records.tile_sums,
                                                                     rows * kSums);
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
