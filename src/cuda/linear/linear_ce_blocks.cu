// The vocabulary-blocked passes of the CUDA linear_ce: pass 2 of schedule (c) (∂W block by block
// from the lse of pass 1) and schedule (d) whole (statistics by the fused product, then the
// blocks' gradients feeding ∂W and ∂h). docs/architecture.md names the schedules.
#include <cstdint>

#include "cuda/core/gemm.hpp"
#include "cuda/linear/linear_ce_call.hpp"
#include "cuda/linear/linear_support.hpp"
#include "cuda/rows/ce_grad.cuh"
#include "cuda/sm90/fused_grad.cuh"
#include "cuda/sm90/fused_stats.hpp"

namespace xent::cuda {

namespace {

// What the gradient of `tile` is formed of (linear_block_grad.cuh): its rows' targets, lse, row
// weights, upstream gradients and entropy terms.
BlockGradArgs block_grad_args(const CeBlockPass& pass, const BlockTile& tile) {
  const LinearCeCall& call = pass.call;
  const int64_t first = tile.first_row;
  BlockGradArgs args;
  static_cast<BlockGradTile&>(args) = tile.gradient;
  args.logits = tile.logits;
  args.logits_stride = tile.logits_stride;
  args.target = static_cast<const char*>(call.target.data) +
                static_cast<std::size_t>(first) * dtype_size(call.target.dtype);
  args.target_dtype = call.target.dtype;
  args.lse = pass.lse + first;
  args.row_weight = offset_rows<const float>(call.options.ce.row_weight, first);
  args.grad_output_rows =
      pass.per_row_upstream ? offset_rows<const float>(call.grad_output, first) : nullptr;
  args.entropy = offset_rows<const float>(call.entropy.entropy, first);
  args.grad_entropy = offset_rows<const float>(call.entropy.grad, first);
  args.options = pass.row_options;
  args.totals = pass.totals;
  return args;
}

}  // namespace

// Whether the blocks of this call form their gradients with the fused gradient product
// (fused_grad.cuh) instead of cuBLASLt logits and the elementwise block kernel: preferred for its
// hidden size (fused_grad_preferred), Hopper operands it takes (fused_operands_eligible), logits
// not all read from a cache (tiles outside a partial cache's rows take it).
bool fused_gradient_eligible(const LinearCeCall& call, bool all_cached) {
  return fused_grad_preferred(call.hidden.cols) && !all_cached &&
         fused_operands_eligible(call.hidden, call.weight, call.bias);
}

// The gradient of `tile` (rows of h, columns of W) by the fused gradient product, in the operand
// dtype with row stride tile.gradient.columns; false, having launched nothing, if it declines.
bool fused_tile_gradient(const CeBlockPass& pass, const BlockTile& tile, cudaStream_t stream) {
  const LinearCeCall& call = pass.call;
  FusedGradProduct product;
  product.dtype = call.hidden.dtype;
  const std::size_t element = dtype_size(product.dtype);
  product.hidden = static_cast<const char*>(call.hidden.data) +
                   static_cast<std::size_t>(tile.first_row) *
                       static_cast<std::size_t>(call.hidden.row_stride) * element;
  product.hidden_stride = call.hidden.row_stride;
  product.weight = static_cast<const char*>(call.weight.data) +
                   static_cast<std::size_t>(tile.gradient.first_column) *
                       static_cast<std::size_t>(call.weight.row_stride) * element;
  product.weight_stride = call.weight.row_stride;
  product.rows = tile.gradient.rows;
  product.columns = tile.gradient.columns;
  product.hidden_size = call.hidden.cols;
  product.first_column = tile.gradient.first_column;
  product.records = pass.records + tile.first_row;
  product.entropy = call.entropy.present();
  const CeOptions& ce = call.options.ce;
  if (ce.class_weight.present() && ce.label_smoothing != 0) {
    product.class_weight = static_cast<const float*>(ce.class_weight.data);
  }
  product.bias = call.bias.present() ? call.bias.data : nullptr;
  product.logit_scale = static_cast<float>(call.options.ce.logit_scale);
  product.softcap = call.options.ce.softcap ? static_cast<float>(*call.options.ce.softcap) : 0.0f;
  product.grad = tile.gradient.grad;
  product.grad_stride = tile.gradient.columns;
  product.rounded_logits = pass.plan.logits_dtype != DType::f32;
  return fused_grad_product(product, stream);
}

// The gradient records of all rows (ce_grad_records) into pass.records, from pass.lse.
void form_grad_records(const CeBlockPass& pass, cudaStream_t stream) {
  const LinearCeCall& call = pass.call;
  BlockTile all_rows;
  all_rows.gradient.rows = call.hidden.rows;
  all_rows.gradient.columns = call.weight.rows;
  all_rows.gradient.vocab = call.weight.rows;
  ce_grad_records(block_grad_args(pass, all_rows), pass.records, stream);
}

// ∂W block by block; each block's gradient comes from the lse of pass 1, through the fused
// gradient product where eligible, else elementwise (linear_block_grad.cuh) over cuBLASLt logits.
void run_block_pass(const CeBlockPass& pass, cudaStream_t stream, float* bias_sums) {
  const LinearCeCall& call = pass.call;
  BlockPassInputs inputs;
  inputs.hidden = call.hidden;
  inputs.weight = call.weight;
  inputs.bias = call.bias;
  if (pass.read_cache) inputs.logits_cache = call.options.logits_cache;
  inputs.weight_grad = call.grads.weight;
  inputs.add_to_weight_grad = call.grads.accumulate_weight;
  inputs.chunks = pass.plan.chunks;
  inputs.logits_dtype = pass.plan.logits_dtype;
  inputs.region = pass.region;
  inputs.scratch = pass.scratch;
  inputs.hidden_accumulator = pass.hidden_accumulator;
  inputs.hidden_grad = call.grads.hidden;
  inputs.bias_sums = bias_sums;
  const bool all_cached = pass.read_cache && call.options.logits_cache.rows == call.hidden.rows;
  if (pass.records && fused_gradient_eligible(call, all_cached)) {
    if (!pass.records_formed) form_grad_records(pass, stream);
    inputs.fused_gradient = [&](const BlockTile& tile, cudaStream_t on) {
      return fused_tile_gradient(pass, tile, on);
    };
  }
  auto block_gradient = [&](const BlockTile& tile, cudaStream_t on) {
    block_grad_from_lse(block_grad_args(pass, tile), on);
  };
  weight_gradient_by_blocks(inputs, block_gradient, stream);
}

// The batch pre-pass of every schedule: N_valid, D and the scalar upstream gradient.
void batch_totals(const LinearCeCall& call, CeBatchTotals* totals, cudaStream_t stream) {
  const Reduction reduction = call.options.ce.reduction;
  CeBatchRequest batch;
  batch.target = call.target.data;
  batch.target_dtype = call.target.dtype;
  batch.rows = call.hidden.rows;
  batch.vocab = call.weight.rows;
  batch.options = ce_row_options(call.options.ce);
  batch.grad_output = (reduction != Reduction::none && call.grad_output.present())
                          ? static_cast<const float*>(call.grad_output.data)
                          : nullptr;
  batch.op = call.op;
  ce_batch_totals(batch, totals, stream);
}

// Schedule (d) (chunk_plan.hpp): the fused statistics product writes the loss, the statistics
// and every row's lse without forming logits (skipped when a backward brings the forward's lse
// and entropy); then per vocabulary block the block's logits, its gradient from the lse, ∂W of
// the block and ∂h += G·W_block into an fp32 N×H accumulator in the chunk region, written to
// grads.hidden at the end. A backward given a logits cache reads its rows' logits there.
// False, having launched nothing, when the fused product declines.
bool run_statistics_blocks(const LinearCeCall& call, const LinearCePlan& plan, Workspace workspace,
                           cudaStream_t stream) {
  const ChunkPlan& chunks = plan.chunks;
  WorkspaceCarver carver(workspace);
  char* region = static_cast<char*>(carver.take(chunk_region_bytes(chunks)));
  auto* totals = static_cast<CeBatchTotals*>(carver.take(sizeof(CeBatchTotals)));
  const GemmScratch scratch{carver.take(chunks.gemm_workspace_bytes), chunks.gemm_workspace_bytes};
  auto* saved_lse = static_cast<float*>(carver.take(chunks.lse_bytes));
  auto* records = static_cast<CeGradRecord*>(carver.take(grad_record_bytes(call.hidden.rows)));
  const bool entropy_grad = call.entropy.present();
  if (entropy_grad) {
    saved_lse = static_cast<float*>(call.lse.data);  // read only
  } else {
    FusedStatistics statistics{call.hidden, call.weight, call.target, call.options.ce};
    statistics.bias = call.bias;
    if (call.loss) statistics.out.loss = *call.loss;
    if (call.stats) statistics.out.stats = *call.stats;
    if (statistics.out.stats.lse.present()) {
      saved_lse = static_cast<float*>(statistics.out.stats.lse.data);
    } else {
      statistics.out.stats.lse =
          vector(saved_lse, DType::f32, call.hidden.rows, call.hidden.device);
    }
    statistics.extras = fused_stats_needs_extras(call.options.ce, statistics.out.stats);
    // The block gradients read 16-bit logits (cuBLASLt's rounding of the same products): the lse
    // of those values keeps each row's softmax summing to one, so the gradient's error against
    // float64 is the cuBLASLt path's (decision 45), and the loss and statistics are theirs too.
    statistics.rounded_logits = plan.logits_dtype != DType::f32;
    statistics.workspace = Workspace{region, chunk_region_bytes(chunks)};
    statistics.op = call.op;
    if (!fused_statistics(statistics, stream)) return false;
  }
  batch_totals(call, totals, stream);
  const bool want_hidden = call.grads.hidden.present();
  CeBlockPass pass{call,
                   plan,
                   region,
                   saved_lse,
                   scratch,
                   totals,
                   ce_row_options(call.options.ce),
                   call.options.ce.reduction == Reduction::none && call.grad_output.present(),
                   call.op == OpCode::linear_ce_backward && call.options.logits_cache.present()};
  pass.records = records;
  if (want_hidden) {
    pass.hidden_accumulator =
        chunks.hidden_sums_in_weight_grad
            ? reinterpret_cast<float*>(static_cast<char*>(call.grads.weight.data) +
                                       chunks.hidden_sums_offset)
            : reinterpret_cast<float*>(region + align_up(chunks.tile_buffer_bytes) +
                                       align_up(chunks.accumulator_bytes));
  }
  // ∂bias from the blocks' gradients (this schedule's first pass forms none): in the output when
  // it is fp32, else in an fp32 accumulator (the plan's bias_accumulator_bytes).
  const LinearGradients bias_only{{}, {}, call.grads.bias};
  const GradientSums bias_sums =
      carve_gradient_sums(carver, bias_only, call.weight.rows, call.hidden.cols, chunks);
  run_block_pass(pass, stream, bias_sums.bias);
  finish_gradient_sums(bias_only, bias_sums, call.hidden.cols, true, stream);
  return true;
}

}  // namespace xent::cuda
