// Fused linear cross-entropy on CUDA (SPEC.md §2). Per row chunk (chunk_plan.cpp chooses its size):
//   1. L = h_chunk·Wᵀ (+ bias) by cuBLASLt into the chunk buffer (input dtype, or fp32);
//   2. the ce row kernel of ce_rows.cuh reads L once, writes per-row loss parts and statistics,
//      and, when gradients are wanted, G = ∂loss/∂L in place over L, with its final coefficients
//      (N_valid, D and the upstream gradient come from a pre-pass over all targets);
//   3. ∂h_chunk = G·W (written straight into grad hidden) and ∂W += Gᵀ·h_chunk into an fp32
//      accumulator (beta = 1 after the first chunk, or from the first one when ∂W is added into
//      the caller's buffer: accumulate_weight), ∂bias += column sums of G.
// For bf16 operands on Hopper, steps 1–2 are the per-row reference path where it applies
// (linear_reference.cuh): the fused product writes e^(x̃ − r)·slope against each row's target
// logit instead of L, a finish kernel the lse and one factor per row, which steps 3's products
// take on their small operands; no logits are written and no row kernel runs.
// When the budget leaves too little room for the V×H fp32 ∂W accumulator of a 16-bit weight
// gradient (or in-place accumulation over many small chunks costs more), the planner picks the
// vocabulary-blocked schedule (chunk_plan.cpp (c)): the loop above without ∂W, saving each row's
// lse, then per vocabulary block the block's logits again, its gradient elementwise
// (linear_block_grad.cuh) and ∂W of the block (the pass that linear_distill.cu shares,
// linear_block_pass.hpp).
// options.logits_cache: a forward without gradients writes the logits of all rows into the cache
// (one product, the row kernel reads them there); a backward reads every chunk's and block's logits
// from it instead of forming h·Wᵀ, and writes gradients into its own buffers (the cache stays
// intact for further backwards).
// The loss is one fixed-order reduction of the per-row arrays at the end; nothing synchronises
// with the host, so the op is graph-capturable.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "api/backend.hpp"
#include "cuda/ce_grad.cuh"
#include "cuda/ce_rows.cuh"
#include "cuda/fused_grad.cuh"
#include "cuda/fused_stats.hpp"
#include "cuda/gemm.hpp"
#include "cuda/hidden_sums.hpp"
#include "cuda/linear_block_grad.cuh"
#include "cuda/linear_block_pass.hpp"
#include "cuda/linear_ce_plan.hpp"
#include "cuda/linear_reference.cuh"
#include "cuda/weighted_row_sum.cuh"
#include "cuda/linear_streams.hpp"
#include "cuda/linear_support.hpp"

namespace xent::cuda {

namespace {

struct LinearCePlan {
  ChunkPlan chunks;
  DType logits_dtype = DType::bf16;
};

// One call of the op: the forward (loss, statistics, optional gradients) or the backward
// (gradients only, per-row or scalar upstream gradient).
struct LinearCeCall {
  TensorView hidden, weight, bias, target;
  const LinearCeOptions& options;
  TensorView grad_output{};
  const TensorView* loss = nullptr;
  const CeStats* stats = nullptr;
  LinearGradients grads{};
  OpCode op = OpCode::linear_ce_forward;
  // Backward with the entropy term (ce.hpp EntropyGradient): the forward's lse and H make every
  // chunk's gradient elementwise (ce_grad.cuh, block_grad_from_lse), one pass, no row statistics.
  TensorView lse{};
  EntropyGradient entropy{};
};

// What a call wants formed, as the planner sees it.
struct PlanWants {
  bool gradients = false;           // any gradient
  bool weight = false;              // ∂W
  bool weight_accumulator = false;  // ∂W in a 16-bit dtype (fp32 sums over chunks)
  bool bias_accumulator = false;    // ∂bias in a 16-bit dtype
  bool hidden = false;              // ∂h
  // The call may take schedule (d): it can form its statistics with the fused product
  // (fused_stats_eligible).
  bool statistics = false;
  // The outputs as (d)'s scratch for its ∂h sums.
  HiddenSumsScratch sums_scratch;
  // The per-row reference path's bytes per chunk row (linear_reference.cuh), or 0.
  std::size_t reference_row_bytes = 0;
  // The call's row chunks may take that path (reference_candidate): they are priced without the
  // row kernel (ChunkRequest::gradient_in_product).
  bool reference_priced = false;
};

// XENT_CUDA_BLOCK_TILES=0: blocks of all N rows wherever such a plan fits (measurements).
bool whole_row_blocks_switch() {
  const char* knob = std::getenv("XENT_CUDA_BLOCK_TILES");
  return knob && std::strcmp(knob, "0") == 0;
}

// The gradient records of every row (linear_block_grad.cuh, CeGradRecord) that the fused gradient
// product reads: part of every plan's fixed bytes, 32 per row.
std::size_t grad_record_bytes(int64_t rows) {
  return align_up(static_cast<std::size_t>(std::max<int64_t>(rows, 0)) * sizeof(CeGradRecord));
}

// The fused gradient product's tile and the current device's multiprocessors, so that the planner
// prices that product's waves (ChunkRequest::gradient_tile_rows), where (d)'s blocks may take it:
// 16-bit logits, a hidden size it is preferred for, the sm_90a kernel built, a compute
// capability 9.0 device at hand (the size query and the call then plan alike). Not set without
// one (CPU builds, tests). XENT_CUDA_PLAN_WAVES=0 plans without them (measurements, tests).
void set_gradient_tiles(ChunkRequest& request, DType dtype, const LinearCeOptions& options) {
  const char* knob = std::getenv("XENT_CUDA_PLAN_WAVES");
  if ((knob != nullptr && knob[0] == '0') || options.fp32_logits || dtype == DType::f32 ||
      !fused_grad_product_built() || !fused_grad_preferred(request.hidden)) {
    return;
  }
  int device = 0, major = 0, minor = 0, multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) !=
          cudaSuccess) {
    (void)cudaGetLastError();  // no device here: leave no error for the next check
    return;
  }
  if (major != 9 || minor != 0) return;  // the sm_90a product runs on 9.0 only
  request.gradient_tile_rows = kFusedTileRows;
  request.gradient_tile_columns = kFusedTileColumns;
  request.multiprocessors = multiprocessors;
}

// XENT_CUDA_PLAN_REFERENCE=0 prices every row chunk with the row kernel, as before decision 115
// (measurements); the reference path itself still runs where the plan allows it.
bool reference_pricing_enabled() {
  const char* knob = std::getenv("XENT_CUDA_PLAN_REFERENCE");
  return knob == nullptr || knob[0] != '0';
}

LinearCePlan plan_linear_ce(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                            const LinearCeOptions& options, const PlanWants& wants) {
  ChunkRequest request;
  request.rows = rows;
  request.hidden = hidden;
  request.vocab = vocab;
  request.logits_element_bytes = options.fp32_logits ? sizeof(float) : dtype_size(dtype);
  request.budget_bytes = options.workspace_budget;
  request.fixed_bytes = row_scratch_bytes(rows) + grad_record_bytes(rows);
  if (wants.reference_row_bytes > 0) {
    const bool smoothing = options.ce.label_smoothing != 0;
    request.fixed_bytes += reference_fixed_bytes(rows, hidden, smoothing);
    request.chunk_row_scratch_bytes = wants.reference_row_bytes;
    request.chunk_buffer_extra_bytes = reference_buffer_extra_bytes(vocab, hidden, smoothing);
  }
  // Only the gradient path pipelines (the forward-only path has no products to hide behind).
  request.gradient_in_product =
      wants.gradients && wants.reference_priced && reference_pricing_enabled();
  request.overlap = wants.gradients && linear_overlap_enabled();
  request.weight_gradient = wants.gradients && wants.weight;
  request.weight_accumulator = request.weight_gradient && wants.weight_accumulator;
  request.bias_accumulator_bytes =
      bias_accumulator_bytes(wants.gradients && wants.bias_accumulator, vocab);
  request.statistics_product = wants.gradients && wants.statistics;
  request.statistics_bytes = fused_stats_minimum_bytes(rows, vocab);
  request.hidden_gradient = wants.gradients && wants.hidden;
  request.prefer_statistics = fused_stats_forced();
  set_hidden_sums_places(request, wants.sums_scratch);
  request.whole_row_blocks = whole_row_blocks_switch();
  set_gradient_tiles(request, dtype, options);
  LinearCePlan plan;
  plan.chunks = plan_chunks(request);
  plan.logits_dtype = options.fp32_logits ? DType::f32 : dtype;
  return plan;
}

// The plan of a call with these gradients: a 16-bit ∂W or ∂bias needs an fp32 accumulator; an
// fp32 one (accumulate_weight's buffer included) is accumulated in place.
LinearCePlan plan_for_gradients(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                const LinearCeOptions& options, const LinearGradients& grads,
                                bool statistics, bool reference_priced,
                                std::size_t reference_row_bytes = 0) {
  PlanWants wants;
  wants.weight = grads.weight.present();
  wants.hidden = grads.hidden.present();
  const bool want_bias = grads.bias.present();
  wants.gradients = wants.weight || want_bias || wants.hidden;
  wants.weight_accumulator = wants.weight && grads.weight.dtype != DType::f32;
  wants.bias_accumulator = want_bias && grads.bias.dtype != DType::f32;
  wants.statistics = statistics;
  wants.sums_scratch = hidden_sums_scratch(grads);
  wants.reference_row_bytes = reference_row_bytes;
  wants.reference_priced = reference_priced;
  return plan_linear_ce(rows, hidden, vocab, dtype, options, wants);
}

// Whether a call planned as `plan` takes the per-row reference path with the plan `with_scratch`
// that holds its scratch: only where that changes neither the row-chunk schedule nor the number of
// chunks (each more chunk would cost a pass over the ∂W sums), with one chunk buffer.
bool reference_plan_accepted(const LinearCePlan& plan, const LinearCePlan& with_scratch) {
  const Schedule schedule = plan.chunks.schedule;
  return (schedule == Schedule::row_chunks || schedule == Schedule::row_chunks_accumulated) &&
         plan.chunks.buffer_count == 1 && with_scratch.chunks.fits_budget &&
         with_scratch.chunks.schedule == schedule &&
         with_scratch.chunks.chunk_count == plan.chunks.chunk_count &&
         with_scratch.chunks.buffer_count == 1;
}

// Whether a call of this dtype, options and gradients may form its row chunks by the per-row
// reference path, as far as its plan's inputs show (reference_candidate adds what only the call
// shows): its row chunks are then priced without the row kernel (PlanWants::reference_priced).
bool reference_path_possible(DType dtype, const LinearCeOptions& options,
                             const LinearGradients& grads) {
  const bool want_grad = grads.hidden.present() || grads.weight.present() || grads.bias.present();
  return want_grad && reference_path_enabled() && !options.logits_cache.present() &&
         !options.fp32_logits && !grads.bias.present() && reference_options_eligible(options.ce) &&
         dtype == DType::bf16;
}

}  // namespace

ChunkPlan linear_ce_chunk_plan(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                               const LinearCeOptions& options, const LinearGradients& grads,
                               bool statistics_product) {
  return plan_for_gradients(rows, hidden, vocab, dtype, options, grads, statistics_product,
                            reference_path_possible(dtype, options, grads))
      .chunks;
}

std::size_t linear_ce_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                     const LinearCeOptions& options, bool with_gradients) {
  // The query cannot see which gradients come, nor their dtypes, nor whether the call can take
  // the fused statistics product (device, alignment, bias): it reports the largest plan a call
  // of these sizes may choose (with and without fp32 accumulators for 16-bit ∂W and ∂bias, with
  // and without ∂h and schedule (d)). Each is within the budget whenever the budget holds the
  // smallest plan.
  std::size_t bytes = 0;
  const bool half = dtype != DType::f32;
  const bool candidate = fused_stats_candidate(dtype, options);
  // Each choice once: {false} where its other side cannot occur (the query runs per call, and
  // every plan costs the planner's scan of block widths).
  auto choices = [](bool possible) {
    return possible ? std::vector<bool>{false, true} : std::vector<bool>{false};
  };
  // A plan's bytes, and where a bf16 step may take the per-row reference path, its scratch (with
  // the ∂h product in it or in the ∂W output, and with the statistics form's sums at the hidden
  // sizes that take it) beside the same chunks.
  auto consider = [&](PlanWants wants) {
    const LinearCePlan plan = plan_linear_ce(rows, hidden, vocab, dtype, options, wants);
    bytes = std::max(bytes, plan.chunks.total_bytes);
    const Schedule schedule = plan.chunks.schedule;
    const bool row_chunks =
        schedule == Schedule::row_chunks || schedule == Schedule::row_chunks_accumulated;
    if (!with_gradients || dtype != DType::bf16 || !row_chunks) return;
    for (const bool product_in_scratch : {false, true}) {
      for (const bool row_statistics : choices(reference_statistics_preferred(hidden))) {
        wants.reference_row_bytes =
            reference_chunk_row_bytes(vocab, hidden, product_in_scratch, row_statistics);
        const LinearCePlan with_scratch =
            plan_linear_ce(rows, hidden, vocab, dtype, options, wants);
        if (reference_plan_accepted(plan, with_scratch)) {
          bytes = std::max(bytes, with_scratch.chunks.total_bytes);
        }
      }
    }
  };
  for (const bool weight : {false, true}) {
    for (const bool weight_16_bit : choices(half && weight)) {
      for (const bool bias : choices(half)) {
        for (const bool statistics : choices(candidate && with_gradients)) {
          for (const bool hidden_gradient : {true, false}) {
            // (d) may keep its ∂h sums in a contiguous ∂W (16-bit, or fp32) and ∂h output.
            for (const bool sums_in_outputs : choices(statistics && weight && hidden_gradient)) {
              PlanWants wants;
              wants.gradients = with_gradients;
              wants.weight = weight;
              wants.weight_accumulator = weight_16_bit;
              wants.bias_accumulator = bias;
              wants.hidden = hidden_gradient;
              wants.statistics = statistics;
              if (sums_in_outputs) {
                wants.sums_scratch =
                    contiguous_hidden_sums_scratch(rows, hidden, vocab, weight_16_bit, half);
              }
              consider(wants);
              // Row chunks priced as the per-row reference path (reference_path_possible).
              if (with_gradients && dtype == DType::bf16 && !bias && reference_path_enabled()) {
                wants.reference_priced = true;
                consider(wants);
              }
            }
          }
        }
      }
    }
  }
  // A forward without gradients may take the fused statistics product (fused_stats.hpp) when
  // its tile partials fit the budget: the caller's workspace must then hold them too.
  if (!with_gradients && fused_stats_candidate(dtype, options)) {
    bytes = std::max(bytes, fused_stats_workspace_bytes(rows, vocab, options.workspace_budget));
  }
  return bytes;
}

namespace {

// What pass 2 of the vocabulary-blocked schedule (linear_block_pass.hpp) needs of the call.
struct CeBlockPass {
  const LinearCeCall& call;
  const LinearCePlan& plan;
  void* region;             // tile buffer, then the block accumulator
  const float* lse;         // [N] from pass 1
  GemmScratch scratch;
  const CeBatchTotals* totals;
  CeRowOptions row_options;
  bool per_row_upstream;
  bool read_cache;
  float* hidden_accumulator = nullptr;  // schedule (d)
  CeGradRecord* records = nullptr;      // [N], for the fused gradient product
  bool records_formed = false;          // pass 1 formed them already, from the same lse
};

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

// Whether the blocks of this call form their gradients with the fused gradient product
// (fused_grad.cuh) instead of cuBLASLt logits and the elementwise block kernel: preferred for its
// hidden size (fused_grad_preferred), Hopper operands it takes (fused_operands_eligible), logits
// not read from a cache.
bool fused_gradient_eligible(const LinearCeCall& call, bool read_cache) {
  return fused_grad_preferred(call.hidden.cols) && !read_cache &&
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
void run_block_pass(const CeBlockPass& pass, cudaStream_t stream, float* bias_sums = nullptr) {
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
  if (pass.records && fused_gradient_eligible(call, pass.read_cache)) {
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
// grads.hidden at the end. False, having launched nothing, when the fused product declines.
bool run_statistics_blocks(const LinearCeCall& call, const LinearCePlan& plan,
                           Workspace workspace, cudaStream_t stream) {
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
                   false};
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

// How a call's row chunks take the per-row reference path (linear_reference.cuh).
struct ReferenceUse {
  bool on = false;
  // The ∂h product's fp32 rows in the memory of the 16-bit ∂W output (which holds nothing until
  // the chunk's ∂W product, or the end, writes it) instead of the chunk's scratch.
  bool hidden_product_in_weight_grad = false;
};

// Schedules (a)–(c): row chunks of logits by cuBLASLt and the ce row kernel (file comment), or
// (a) and (b) through the per-row reference path where `reference` says so.
void run_row_chunks(const LinearCeCall& call, const LinearCePlan& plan, Workspace workspace,
                    cudaStream_t stream, const ReferenceUse& reference = {}) {
  const int64_t rows = call.hidden.rows, hidden = call.hidden.cols, vocab = call.weight.rows;
  const LinearGradients& grads = call.grads;
  const bool want_hidden = grads.hidden.present(), want_weight = grads.weight.present(),
             want_bias = grads.bias.present();
  const bool want_grad = want_hidden || want_weight || want_bias;
  const CeOptions& ce = call.options.ce;
  const Reduction reduction = ce.reduction;
  const CeStats* stats = call.stats;

  const bool blocked = plan.chunks.schedule == Schedule::vocabulary_blocks;
  WorkspaceCarver carver(workspace);
  const std::size_t buffer_stride = align_up(plan.chunks.logits_buffer_bytes);
  void* chunk_buffer = carver.take(chunk_region_bytes(plan.chunks));
  auto* totals = static_cast<CeBatchTotals*>(carver.take(sizeof(CeBatchTotals)));
  const std::size_t row_array = static_cast<std::size_t>(rows) * sizeof(float);
  auto* row_loss = static_cast<float*>(carver.take(row_array));
  auto* row_z_loss = static_cast<float*>(carver.take(row_array));
  auto* row_correct = static_cast<float*>(carver.take(row_array));
  const GemmScratch scratch{carver.take(plan.chunks.gemm_workspace_bytes),
                            plan.chunks.gemm_workspace_bytes};
  const GradientSums sums = carve_gradient_sums(carver, grads, vocab, hidden, plan.chunks);
  float* saved_lse = blocked ? static_cast<float*>(carver.take(plan.chunks.lse_bytes)) : nullptr;
  auto* records = static_cast<CeGradRecord*>(carver.take(grad_record_bytes(rows)));
  float* reference_scale = nullptr;
  float* reference_targets = nullptr;
  int32_t* reference_fallback = nullptr;
  // Label smoothing on the reference path (linear_reference.cuh): k_n and Σ w·x̃ per row, w̄, U and
  // their partials.
  const bool reference_smoothing = reference.on && call.options.ce.label_smoothing != 0;
  float* reference_uniform = nullptr;
  float* reference_smoothing_sums = nullptr;
  float* reference_weight_sum = nullptr;
  float* reference_hidden_sum = nullptr;
  float* reference_sum_partials = nullptr;
  if (reference.on) {  // reference_fixed_bytes
    const std::size_t row_floats = align_up(static_cast<std::size_t>(rows) * sizeof(float));
    reference_scale = static_cast<float*>(carver.take(row_floats));
    reference_targets = static_cast<float*>(carver.take(row_floats));
    reference_fallback = static_cast<int32_t*>(
        carver.take(align_up(static_cast<std::size_t>(rows + 1) * sizeof(int32_t))));
    if (reference_smoothing) {
      const std::size_t hidden_floats = static_cast<std::size_t>(hidden) * sizeof(float);
      reference_uniform = static_cast<float*>(carver.take(row_floats));
      reference_smoothing_sums = static_cast<float*>(carver.take(row_floats));
      reference_weight_sum = static_cast<float*>(carver.take(hidden_floats));
      reference_hidden_sum = static_cast<float*>(carver.take(hidden_floats));
      reference_sum_partials =
          static_cast<float*>(carver.take(weighted_row_sum_scratch_bytes(hidden)));
    }
  }
  if (blocked && stats && stats->lse.present()) saved_lse = static_cast<float*>(stats->lse.data);
  const bool entropy_grad = call.entropy.present();
  if (blocked && entropy_grad) saved_lse = static_cast<float*>(call.lse.data);  // read only
  // The logits cache (linear_ce.hpp): filled by a forward without gradients, read by a backward.
  const TensorView& cache = call.options.logits_cache;
  const bool fill_cache = cache.present() && !want_grad && call.op == OpCode::linear_ce_forward;
  const bool read_cache = cache.present() && call.op == OpCode::linear_ce_backward;

  const CeRowOptions row_options = ce_row_options(ce);
  const bool per_row_upstream = reduction == Reduction::none && call.grad_output.present();
  batch_totals(call, totals, stream);

  const bool sum_or_mean = reduction != Reduction::none;
  const bool want_accuracy = stats && stats->accuracy.present();
  // Filling the cache needs no chunk buffer: all rows are one product into the cache.
  const int64_t chunk_rows = fill_cache ? std::max<int64_t>(rows, 1) : plan.chunks.chunk_rows;
  const DType operand_dtype = call.hidden.dtype;
  const bool narrow_gradient = plan.logits_dtype != operand_dtype;

  const GemmMatrix weight = gemm_matrix(call.weight, 0, vocab);
  auto buffer_of = [&](int64_t chunk) -> void* {
    return static_cast<char*>(chunk_buffer) + (chunk % plan.chunks.buffer_count) * buffer_stride;
  };
  auto first_row = [&](int64_t chunk) { return chunk * chunk_rows; };
  auto row_count = [&](int64_t chunk) { return std::min(chunk_rows, rows - chunk * chunk_rows); };
  const std::size_t logits_element = dtype_size(plan.logits_dtype);
  auto cache_at = [&](int64_t row, int64_t column) -> void* {
    return static_cast<char*>(cache.data) +
           (static_cast<std::size_t>(row) * static_cast<std::size_t>(cache.row_stride) +
            static_cast<std::size_t>(column)) * logits_element;
  };
  // Where a chunk's logits are (the cache, or the chunk buffer) and their row stride.
  auto logits_of = [&](int64_t chunk) -> void* {
    return fill_cache || read_cache ? cache_at(first_row(chunk), 0) : buffer_of(chunk);
  };
  const int64_t logits_stride = fill_cache || read_cache ? cache.row_stride : vocab;
  // Pass 1 of the blocked schedule forms no ∂W; its gradient is only needed for ∂h and ∂bias.
  const bool chunk_grad = want_grad && (!blocked || want_hidden || want_bias);

  // Stage 1: L = h_chunk·Wᵀ (+ bias).
  auto form_logits = [&](int64_t chunk) {
    GemmProduct forward;
    forward.a = gemm_matrix(call.hidden, first_row(chunk), row_count(chunk));
    forward.b = weight;
    forward.b_transposed = true;
    forward.c = GemmMatrix{logits_of(chunk), plan.logits_dtype, row_count(chunk), vocab,
                           logits_stride};
    forward.bias = call.bias.present() ? call.bias.data : nullptr;
    gemm(forward, scratch, stream);
  };

  // What the row kernel of a chunk takes: its logits, rows, outputs and gradient (in place).
  auto rows_args = [&](int64_t chunk) {
    const int64_t first = first_row(chunk);
    void* buffer = buffer_of(chunk);
    CeRowsArgs args;
    args.logits = logits_of(chunk);
    args.dtype = plan.logits_dtype;
    args.rows = row_count(chunk);
    args.vocab = vocab;
    args.row_stride = logits_stride;
    args.target = static_cast<const char*>(call.target.data) +
                  static_cast<std::size_t>(first) * dtype_size(call.target.dtype);
    args.target_dtype = call.target.dtype;
    args.row_weight = offset_rows<const float>(ce.row_weight, first);
    args.options = row_options;
    args.totals = totals;
    args.grad_output_rows =
        per_row_upstream ? offset_rows<const float>(call.grad_output, first) : nullptr;
    if (call.loss) {
      if (sum_or_mean) {
        args.row_loss = row_loss + first;
        args.row_z_loss = row_z_loss + first;
      } else {
        args.row_total = offset_rows<float>(*call.loss, first);
      }
    }
    if (stats) {
      if (stats->z_loss_value.present()) {
        args.row_z_loss = sum_or_mean ? row_z_loss + first
                                      : offset_rows<float>(stats->z_loss_value, first);
      }
      if (want_accuracy) args.row_correct = row_correct + first;
      args.lse = offset_rows<float>(stats->lse, first);
      args.logprob = offset_rows<float>(stats->logprob, first);
      args.entropy = offset_rows<float>(stats->entropy, first);
      args.argmax = offset_rows<int64_t>(stats->argmax, first);
    }
    if (saved_lse) args.lse = saved_lse + first;
    if (chunk_grad) {
      args.grad = buffer;
      args.grad_row_stride = vocab;
    }
    return args;
  };

  // Stage 2: the row kernel (loss parts, statistics, gradient in place).
  auto row_kernel = [&](int64_t chunk, cudaStream_t on) {
    const int64_t first = first_row(chunk);
    void* buffer = buffer_of(chunk);
    const CeRowsArgs args = rows_args(chunk);
    if (!entropy_grad) {
      ce_rows(args, on);
    } else if (chunk_grad) {
      ce_grad_from_lse(args, offset_rows<const float>(call.lse, first),
                       EntropyRows{offset_rows<const float>(call.entropy.entropy, first),
                                   offset_rows<const float>(call.entropy.grad, first)},
                       on);
    }
    // The products take operands of one dtype: fp32 chunk gradients of 16-bit inputs are rounded
    // to the input dtype in place (as F.cross_entropy's bf16 gradient would be).
    if (chunk_grad && narrow_gradient) {
      narrow_rows_in_place(buffer, args.rows, vocab, vocab, operand_dtype, on);
    }
  };

  // Stage 3: ∂h rows, ∂W and ∂bias from the chunk gradient (`fused`: formed by the fused
  // gradient product, in the operand dtype with row stride V).
  auto products = [&](int64_t chunk, bool fused) {
    GemmMatrix gradient{buffer_of(chunk), plan.logits_dtype, row_count(chunk), vocab, vocab};
    if (fused) {
      gradient.dtype = operand_dtype;
    } else if (narrow_gradient) {
      gradient.dtype = operand_dtype;
      gradient.stride = 2 * vocab;
    }
    const GemmMatrix hidden_rows = gemm_matrix(call.hidden, first_row(chunk), row_count(chunk));
    accumulate_chunk_gradients(gradient, hidden_rows, weight, grads, first_row(chunk), chunk == 0,
                               sums, scratch, stream);
  };

  // A backward that brings the forward's lse forms each chunk's gradient with the fused gradient
  // product where eligible (fused_grad.cuh) and the reference path does not run: no logits
  // written, no row kernel, the gradient in the operand dtype (row stride V) for the products.
  CeBlockPass fused_pass{call,   plan,        chunk_buffer,     nullptr, scratch,
                         totals, row_options, per_row_upstream, read_cache};
  fused_pass.lse = static_cast<const float*>(call.lse.data);
  fused_pass.records = records;
  const bool fused_chunks = !reference.on && call.op == OpCode::linear_ce_backward &&
                            call.lse.present() && chunk_grad && plan.chunks.buffer_count == 1 &&
                            fused_gradient_eligible(call, read_cache);
  if (fused_chunks) {
    form_grad_records(fused_pass, stream);  // after batch_totals, on this stream
    // Pass 2 of the blocked schedule reads the lse that the row kernel would have saved.
    if (saved_lse && saved_lse != fused_pass.lse) {
      XENT_CUDA_CHECK(cudaMemcpyAsync(saved_lse, fused_pass.lse,
                                      static_cast<std::size_t>(rows) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, stream));
    }
  }
  auto fused_chunk_gradient = [&](int64_t chunk) {
    BlockTile tile;
    tile.gradient.grad = buffer_of(chunk);
    tile.gradient.grad_stride = vocab;
    tile.gradient.dtype = operand_dtype;
    tile.gradient.rows = row_count(chunk);
    tile.gradient.columns = vocab;
    tile.gradient.first_column = 0;
    tile.gradient.vocab = vocab;
    tile.first_row = first_row(chunk);
    return fused_tile_gradient(fused_pass, tile, stream);
  };

  // Stages 1–3 of a chunk by the per-row reference path (linear_reference.cuh): its scratch
  // follows the chunk's exponentials in the (single) chunk buffer. False when it declines.
  auto reference_chunk_gradients = [&](int64_t chunk) {
    const int64_t first = first_row(chunk), count = row_count(chunk);
    ReferenceChunk part;
    part.rows = rows_args(chunk);
    part.hidden_rows = gemm_matrix(call.hidden, first, count);
    part.weight = weight;
    part.records = records + first;
    part.scratch = static_cast<char*>(buffer_of(chunk)) +
                   reference_scratch_offset(chunk_rows, vocab, logits_element,
                                            reference_smoothing);
    part.hidden_product = reference.hidden_product_in_weight_grad
                              ? static_cast<float*>(grads.weight.data)
                              : static_cast<float*>(part.scratch);
    part.scale = reference_scale + first;
    part.target_logits = reference_targets + first;
    part.fallback = reference_fallback;
    if (reference_smoothing) {
      part.uniform = reference_uniform + first;
      part.smoothing_sums = reference_smoothing_sums + first;
      part.weight_sum = reference_weight_sum;
      part.hidden_sum = reference_hidden_sum;
      part.sum_partials = reference_sum_partials;
    }
    part.grads = &grads;
    part.sums = &sums;
    part.first_row = first;
    part.first_chunk = chunk == 0;
    part.gemm_scratch = scratch;
    return reference_chunk(part, stream);
  };

  // With saved lse and H, pass 1 of the blocked schedule has nothing to do when it forms no
  // chunk gradient.
  const bool skip_chunks = entropy_grad && !chunk_grad;
  const int64_t chunks =
      fill_cache ? (rows > 0 ? 1 : 0) : (skip_chunks ? 0 : plan.chunks.chunk_count);
  if (plan.chunks.buffer_count == 1 || !want_grad || chunks == 0) {
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      if (reference.on && reference_chunk_gradients(chunk)) continue;
      if (fused_chunks && fused_chunk_gradient(chunk)) {
        products(chunk, true);
        continue;
      }
      if (!read_cache) form_logits(chunk);
      row_kernel(chunk, stream);
      if (chunk_grad) products(chunk, false);
    }
  } else {
    // Two buffers: the row kernel of chunk i+1 runs on a side stream while chunk i's products run
    // on the caller's stream. Caller-stream order L(0) L(1) P(0) L(2) P(1) ...; buffer i%2 is
    // rewritten by L(i+2) only after P(i), which waited for the row kernel of chunk i.
    SideStream side(stream);
    if (!read_cache) form_logits(0);
    side.fork();
    row_kernel(0, side.stream());
    side.mark_done();
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const bool has_next = chunk + 1 < chunks;
      if (has_next && !read_cache) form_logits(chunk + 1);
      side.wait_done();  // row kernel of `chunk`
      if (has_next) {
        side.fork();
        row_kernel(chunk + 1, side.stream());
        side.mark_done();
      }
      products(chunk, false);
    }
  }

  if (blocked && want_weight) {
    CeBlockPass pass{call,   plan,        chunk_buffer,     saved_lse, scratch,
                     totals, row_options, per_row_upstream, read_cache};
    pass.records = records;
    pass.records_formed = fused_chunks;
    run_block_pass(pass, stream);
  }
  finish_gradient_sums(grads, sums, hidden, plan.chunks.chunk_count > 0, stream);

  if (call.loss || want_accuracy || (stats && stats->z_loss_value.present() && sum_or_mean)) {
    CeReduceArgs reduce;
    reduce.rows = rows;
    reduce.reduction = reduction;
    reduce.totals = totals;
    if (sum_or_mean && call.loss) {
      reduce.row_loss = row_loss;
      reduce.row_z_loss = row_z_loss;
      reduce.loss = static_cast<float*>(call.loss->data);
    }
    if (sum_or_mean && stats && stats->z_loss_value.present()) {
      reduce.row_loss = row_loss;
      reduce.row_z_loss = row_z_loss;
      reduce.z_loss_value = static_cast<float*>(stats->z_loss_value.data);
    }
    if (want_accuracy) {
      reduce.row_correct = row_correct;
      reduce.accuracy = static_cast<float*>(stats->accuracy.data);
    }
    ce_reduce(reduce, stream);
  }
}

std::atomic<int64_t> schedule_runs[4];

// Whether a call may form its row chunks by the per-row reference path (linear_reference.cuh),
// its plan aside from the path's scratch: gradients formed in this call (a backward that brings
// the forward's lse forms its own, as the row kernel does: the path stages x in f16, decision
// 114, and a forward's lse from it must not meet logits rounded otherwise; not an entropy
// gradient), options the path forms, statistics where its statistics form is preferred, no
// logits cache, bf16 operands the fused products take and no bias (16-bit logits: the plan's
// schedule and chunks are reference_plan_accepted's).
bool reference_candidate(const LinearCeCall& call) {
  return reference_path_possible(call.hidden.dtype, call.options, call.grads) &&
         !call.entropy.present() && !call.bias.present() &&
         (!reference_statistics_wanted(call.stats) ||
          reference_statistics_preferred(call.hidden.cols)) &&
         fused_operands_eligible(call.hidden, call.weight, call.bias);
}

// Whether the reference path's fp32 ∂h product rows may lie in the ∂W output: a 16-bit ∂W written
// over (not added into), one contiguous buffer twice the bytes of N fp32 rows of H.
bool hidden_product_fits_weight_grad(const LinearCeCall& call) {
  const TensorView& weight_grad = call.grads.weight;
  return call.grads.hidden.present() && weight_grad.present() && !call.grads.accumulate_weight &&
         weight_grad.dtype != DType::f32 && weight_grad.row_stride == weight_grad.cols &&
         reinterpret_cast<std::uintptr_t>(weight_grad.data) % kWorkspaceAlignment == 0 &&
         weight_grad.rows >= 2 * call.hidden.rows;
}

void run_linear_ce(const LinearCeCall& call, Workspace workspace, cudaStream_t stream) {
  const int64_t rows = call.hidden.rows, hidden = call.hidden.cols, vocab = call.weight.rows;
  const DType dtype = call.hidden.dtype;
  const bool statistics = fused_stats_eligible(call.hidden, call.weight, call.bias, call.options);
  const bool candidate = reference_candidate(call);
  LinearCePlan plan = plan_for_gradients(rows, hidden, vocab, dtype, call.options, call.grads,
                                         statistics, candidate);
  if (plan.chunks.schedule == Schedule::statistics_blocks) {
    if (run_statistics_blocks(call, plan, workspace, stream)) {
      schedule_runs[static_cast<int>(Schedule::statistics_blocks)].fetch_add(1);
      return;
    }
    // The fused product declined these operands: the cuBLASLt schedules.
    plan = plan_for_gradients(rows, hidden, vocab, dtype, call.options, call.grads, false,
                              candidate);
  }
  if (!plan.chunks.fits_budget) {
    throw_budget_too_small(call.op, call.options.workspace_budget, plan.chunks.total_bytes);
  }
  // The per-row reference path where its scratch fits beside the same chunks
  // (reference_plan_accepted).
  ReferenceUse reference;
  if (candidate) {
    reference.hidden_product_in_weight_grad = hidden_product_fits_weight_grad(call);
    const LinearCePlan with_scratch = plan_for_gradients(
        rows, hidden, vocab, dtype, call.options, call.grads, statistics, true,
        reference_chunk_row_bytes(
            vocab, hidden,
            call.grads.hidden.present() && !reference.hidden_product_in_weight_grad,
            reference_statistics_wanted(call.stats)));
    reference.on = reference_plan_accepted(plan, with_scratch);
    if (reference.on) plan = with_scratch;
  }
  run_row_chunks(call, plan, workspace, stream, reference);
  schedule_runs[static_cast<int>(plan.chunks.schedule)].fetch_add(1);
}

}  // namespace

int64_t linear_ce_runs(Schedule schedule) {
  return schedule_runs[static_cast<int>(schedule)].load();
}

void linear_ce_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                       const LinearCeOptions& options, const LinearCeOutputs& out,
                       TensorView grad_output, Workspace workspace, Stream stream) {
  DeviceGuard guard(hidden.device.index);
  const LinearGradients& grads = out.grads;
  // Without gradients (and no logits cache to fill) the forward may be fused products on
  // Hopper, with no logits buffer (fused_stats.hpp says when); it declines (launching nothing)
  // where it cannot run or is not preferred.
  if (!grads.hidden.present() && !grads.weight.present() && !grads.bias.present() &&
      fused_stats_candidate(hidden.dtype, options)) {
    const bool logits_chunked =
        plan_linear_ce(hidden.rows, hidden.cols, weight.rows, hidden.dtype, options, PlanWants{})
            .chunks.chunk_count > 1;
    if (linear_ce_forward_fused_stats(hidden, weight, bias, target, options, out, logits_chunked,
                                      workspace, stream_of(stream))) {
      return;
    }
  }
  LinearCeCall call{hidden, weight, bias, target, options};
  call.grad_output = grad_output;
  call.loss = &out.loss;
  call.stats = &out.stats;
  call.grads = out.grads;
  call.op = OpCode::linear_ce_forward;
  run_linear_ce(call, workspace, stream_of(stream));
}

// Without an entropy gradient lse is not read: the row kernel re-derives it on chip from the chunk.
void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView lse, TensorView grad_output, const EntropyGradient& entropy,
                        const LinearCeOptions& options, const LinearGradients& grads,
                        Workspace workspace, Stream stream) {
  DeviceGuard guard(hidden.device.index);
  LinearCeCall call{hidden, weight, bias, target, options};
  call.grad_output = grad_output;
  call.lse = lse;
  call.entropy = entropy;
  call.grads = grads;
  call.op = OpCode::linear_ce_backward;
  run_linear_ce(call, workspace, stream_of(stream));
}

}  // namespace xent::cuda
