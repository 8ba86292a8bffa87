// The vocabulary-blocked passes of linear_distill (linear_distill_passes.hpp): pass 2 of schedules
// (c) and (d), the block gradients from each row's statistics; and schedule (d) whole, whose pass
// 1 forms those statistics block by block too (linear_distill_records.cuh), so that no pass holds
// whole rows and the products keep all N rows however small the budget.
#include <algorithm>

#include "api/shard_backend.hpp"
#include "cuda/shard/distill_shard.cuh"
#include "cuda/linear/linear_block_pass.hpp"
#include "cuda/linear/linear_distill_block_grad.cuh"
#include "cuda/linear/linear_distill_passes.hpp"
#include "cuda/linear/linear_distill_records.cuh"
#include "cuda/linear/linear_support.hpp"

namespace xent::cuda {

namespace {

// hidden rows [first, first + count) · weight rows [first_column, first_column + columns)ᵀ into
// `buffer` ([count, columns], the chunk logits dtype).
void form_logits(const DistillPasses& pass, const TensorView& hidden, const TensorView& weight,
                 int64_t first, int64_t count, int64_t first_column, int64_t columns, void* buffer,
                 cudaStream_t stream) {
  GemmProduct product;
  product.a = gemm_matrix(hidden, first, count);
  product.b = gemm_matrix(weight, first_column, columns);
  product.b_transposed = true;
  product.c = GemmMatrix{buffer, pass.plan.logits_dtype, count, columns, columns};
  gemm(product, pass.scratch, stream);
}

}  // namespace

const void* teacher_rows(const DistillPasses& pass, int64_t first, int64_t count,
                         int64_t first_column, int64_t columns, void* buffer, int64_t& stride,
                         cudaStream_t stream) {
  const Teacher& teacher = pass.call.teacher;
  const DType logits_dtype = pass.plan.logits_dtype;
  if (!teacher.logits.present()) {
    form_logits(pass, teacher.hidden, teacher.weight, first, count, first_column, columns, buffer,
                stream);
    stride = columns;
    return buffer;
  }
  const char* source = static_cast<const char*>(gemm_matrix(teacher.logits, first, count).data) +
                       static_cast<std::size_t>(first_column) * dtype_size(teacher.logits.dtype);
  if (pass.plan.teacher_buffer) {
    convert_rows(source, teacher.logits.dtype, teacher.logits.row_stride, buffer, logits_dtype,
                 columns, count, columns, stream);
    stride = columns;
    return buffer;
  }
  stride = teacher.logits.row_stride;
  return source;
}

void run_block_pass(const DistillPasses& pass, void* region, const DistillRowStatistics* statistics,
                    float* hidden_sums, cudaStream_t stream) {
  const LinearDistillCall& call = pass.call;
  BlockPassInputs inputs;
  inputs.hidden_accumulator = hidden_sums;
  inputs.hidden_grad = call.grads.hidden;
  inputs.hidden = call.student_hidden;
  inputs.weight = call.student_weight;
  inputs.weight_grad = call.grads.weight;
  inputs.add_to_weight_grad = call.grads.accumulate_weight;
  inputs.chunks = pass.plan.chunks;
  inputs.logits_dtype = pass.plan.logits_dtype;
  inputs.region = region;
  inputs.scratch = pass.scratch;
  // The teacher tile is formed (or converted) into the tile region's second buffer after the
  // student product, as in the row chunks.
  auto block_gradient = [&](const BlockTile& tile, cudaStream_t on) {
    const int64_t first = tile.first_row;
    DistillBlockGradArgs args;
    static_cast<BlockGradTile&>(args) = tile.gradient;
    args.teacher = teacher_rows(pass, first, args.rows, args.first_column, args.columns,
                                tile.second_buffer, args.teacher_stride, on);
    args.student = tile.logits;
    args.student_stride = tile.logits_stride;
    if (call.target.present()) {
      args.target = static_cast<const char*>(call.target.data) +
                    static_cast<std::size_t>(first) * dtype_size(call.target.dtype);
      args.target_dtype = call.target.dtype;
    }
    args.statistics = statistics + first;
    args.row_weight = offset_rows<const float>(call.options.distill.ce.row_weight, first);
    args.grad_output_rows =
        pass.per_row_upstream ? offset_rows<const float>(call.grad_output, first) : nullptr;
    args.options = pass.row_options;
    args.totals = pass.totals;
    distill_block_grad(args, on);
  };
  weight_gradient_by_blocks(inputs, block_gradient, stream);
}

namespace {

// The tile of rows [first, first + count) and columns [first_column, first_column + columns):
// the student's logits formed into `student_buffer`, the teacher's formed, converted or read in
// place (teacher_rows).
DistillTile form_tile(const DistillPasses& pass, int64_t first, int64_t count, int64_t first_column,
                      int64_t columns, void* student_buffer, void* teacher_buffer,
                      cudaStream_t stream) {
  const LinearDistillCall& call = pass.call;
  const DType logits_dtype = pass.plan.logits_dtype;
  const Device device = call.student_hidden.device;
  form_logits(pass, call.student_hidden, call.student_weight, first, count, first_column, columns,
              student_buffer, stream);
  int64_t teacher_stride = 0;
  const void* teacher = teacher_rows(pass, first, count, first_column, columns, teacher_buffer,
                                     teacher_stride, stream);
  DistillTile tile;
  tile.student = matrix(student_buffer, logits_dtype, count, columns, columns, device);
  tile.teacher = matrix(teacher, logits_dtype, count, columns, teacher_stride, device);
  if (call.target.present()) tile.target = view_rows(call.target, first, count);
  tile.first_row = first;
  tile.first_column = first_column;
  tile.vocab = call.student_weight.rows;
  return tile;
}

}  // namespace

// Schedule (d) (chunk_plan.hpp): no row chunk at all. Pass 1 forms every row's records block by
// block (linear_distill_records.cuh) and merges them into the loss parts, the batch totals and
// the row statistics; pass 2 is the blocked schedule's, with ∂h summed over the blocks in fp32
// (in the workspace, or in outputs not yet written: chunk_plan.hpp HiddenSums).
void run_statistics_blocks(const LinearDistillCall& call, const LinearDistillPlan& plan,
                           Workspace workspace, cudaStream_t stream) {
  const ChunkPlan& chunks = plan.chunks;
  const int64_t rows = call.student_hidden.rows, vocab = call.student_weight.rows;
  const DistillOptions& distill = call.options.distill;
  WorkspaceCarver carver(workspace);
  CeBatchTotals* totals = nullptr;
  const DistillRowLosses losses = carve_row_losses(carver, rows, totals);
  const GemmScratch scratch{carver.take(chunks.gemm_workspace_bytes), chunks.gemm_workspace_bytes};
  char* region = static_cast<char*>(carver.take(chunk_region_bytes(chunks)));
  auto* statistics = static_cast<DistillRowStatistics*>(carver.take(chunks.lse_bytes));
  const DistillRecords records = carve_distill_records(carver, rows, distill.kind);

  const DistillRowOptions row_options = distill_row_options(distill);
  const Reduction reduction = distill.ce.reduction;
  const bool sum_or_mean = reduction != Reduction::none;
  const DistillPasses pass{call,   plan,        scratch,
                           totals, row_options, !sum_or_mean && call.grad_output.present()};
  // The tiles of pass 1 take the places pass 2's take (linear_block_pass.cu).
  char* student_buffer = region;
  char* teacher_buffer = region + align_up(static_cast<std::size_t>(chunks.tile_rows) *
                                           static_cast<std::size_t>(chunks.block_columns) *
                                           dtype_size(plan.logits_dtype));
  auto sweep = [&](auto&& add_tile) {
    for (int64_t block = 0; block < chunks.block_count; ++block) {
      const int64_t first_column = block * chunks.block_columns;
      const int64_t columns = std::min(chunks.block_columns, vocab - first_column);
      for (int64_t t = 0; t < chunks.tile_count; ++t) {
        const int64_t first = t * chunks.tile_rows;
        const int64_t count = std::min(chunks.tile_rows, rows - first);
        add_tile(form_tile(pass, first, count, first_column, columns, student_buffer,
                           teacher_buffer, stream),
                 block == 0);
      }
    }
  };
  sweep([&](const DistillTile& tile, bool first_block) {
    add_tile_records(records, tile, distill, first_block, stream);
  });
  const bool with_sums = distill_shard_needs_sums(distill.kind);
  if (with_sums) {
    sweep([&](const DistillTile& tile, bool first_block) {
      add_tile_sums(records, tile, distill, first_block, stream);
    });
  }

  const bool hard_term = row_options.hard_weight > 0 && call.target.present();
  DistillMergeRequest merge{
      records.running, with_sums ? records.running_sums : nullptr, rows, 1, vocab, call.target,
      distill};
  merge.grad_output = sum_or_mean && call.grad_output.present()
                          ? static_cast<const float*>(call.grad_output.data)
                          : nullptr;
  merge.op = call.op;
  DistillMergeOutputs merged;
  merged.totals = totals;
  merged.statistics = statistics;
  if (call.loss) {
    if (sum_or_mean) {
      merged.row_soft = losses.soft;
      if (hard_term) {
        merged.row_hard_loss = losses.hard_loss;
        merged.row_hard_z = losses.hard_z;
      }
    } else {
      merged.row_total = static_cast<float*>(call.loss->data);
    }
  }
  distill_merge_records(merge, merged, stream);

  float* hidden_sums = nullptr;
  if (call.grads.hidden.present()) {
    hidden_sums = chunks.hidden_sums_in_weight_grad
                      ? reinterpret_cast<float*>(static_cast<char*>(call.grads.weight.data) +
                                                 chunks.hidden_sums_offset)
                      : reinterpret_cast<float*>(region + align_up(chunks.tile_buffer_bytes) +
                                                 align_up(chunks.accumulator_bytes));
  }
  run_block_pass(pass, region, statistics, hidden_sums, stream);

  reduce_distill_loss(pass, losses, stream);
}

DistillRowLosses carve_row_losses(WorkspaceCarver& carver, int64_t rows, CeBatchTotals*& totals) {
  totals = static_cast<CeBatchTotals*>(carver.take(sizeof(CeBatchTotals)));
  const std::size_t row_array = static_cast<std::size_t>(rows) * sizeof(float);
  DistillRowLosses losses;
  losses.soft = static_cast<float*>(carver.take(row_array));
  losses.hard_loss = static_cast<float*>(carver.take(row_array));
  losses.hard_z = static_cast<float*>(carver.take(row_array));
  return losses;
}

void reduce_distill_loss(const DistillPasses& pass, const DistillRowLosses& losses,
                         cudaStream_t stream) {
  const LinearDistillCall& call = pass.call;
  const Reduction reduction = call.options.distill.ce.reduction;
  if (!call.loss || reduction == Reduction::none) return;
  const bool hard_term = pass.row_options.hard_weight > 0 && call.target.present();
  DistillReduceArgs reduce;
  reduce.rows = call.student_hidden.rows;
  reduce.reduction = reduction;
  reduce.soft_weight = pass.row_options.soft_weight;
  reduce.hard_weight = hard_term ? pass.row_options.hard_weight : 0.0;
  reduce.row_soft = losses.soft;
  reduce.row_hard_loss = hard_term ? losses.hard_loss : nullptr;
  reduce.row_hard_z = hard_term ? losses.hard_z : nullptr;
  reduce.totals = pass.totals;
  reduce.loss = static_cast<float*>(call.loss->data);
  distill_reduce(reduce, stream);
}

}  // namespace xent::cuda
