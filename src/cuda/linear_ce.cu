// Fused linear cross-entropy on CUDA (SPEC.md §2). Per row chunk (chunk_plan.cpp chooses its size):
//   1. L = h_chunk·Wᵀ (+ bias) by cuBLASLt into the chunk buffer (input dtype, or fp32);
//   2. the ce row kernel of ce_rows.cuh reads L once, writes per-row loss parts and statistics,
//      and, when gradients are wanted, G = ∂loss/∂L in place over L, with its final coefficients
//      (N_valid, D and the upstream gradient come from a pre-pass over all targets);
//   3. ∂h_chunk = G·W (written straight into grad hidden) and ∂W += Gᵀ·h_chunk into an fp32
//      accumulator (beta = 1 after the first chunk), ∂bias += column sums of G.
// The loss is one fixed-order reduction of the per-row arrays at the end; nothing synchronises
// with the host, so the op is graph-capturable.
#include "api/backend.hpp"
#include "cuda/ce_rows.cuh"
#include "cuda/gemm.hpp"
#include "cuda/linear_streams.hpp"
#include "cuda/linear_support.hpp"

namespace xent::cuda {

namespace {

// Arrays of the whole batch that the row kernel fills chunk by chunk.
std::size_t row_scratch_bytes(int64_t rows) {
  const std::size_t per_row = align_up(static_cast<std::size_t>(rows) * sizeof(float));
  return align_up(sizeof(CeBatchTotals)) + 3 * per_row;
}

template <class T>
T* offset_rows(const TensorView& view, int64_t first_row) {
  if (!view.present()) return nullptr;
  return reinterpret_cast<T*>(static_cast<char*>(view.data) +
                              static_cast<std::size_t>(first_row) * dtype_size(view.dtype));
}

struct LinearCePlan {
  ChunkPlan chunks;
  DType logits_dtype = DType::bf16;
};

// options.logits_cache_bytes is not used on CUDA: keeping the forward's logits for the backward
// needs memory that survives from one call to the next, and the op API has none (each call gets
// its own workspace, which callers free in between). Measured gain if it had: a 30 % shorter
// `none` forward + backward (docs/perf-notes.md); it needs an API-level cache handle.

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
};

LinearCePlan plan_linear_ce(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                            const LinearCeOptions& options, bool with_gradients,
                            bool weight_accumulator, bool bias_accumulator) {
  ChunkRequest request;
  request.rows = rows;
  request.hidden = hidden;
  request.vocab = vocab;
  request.logits_element_bytes = options.fp32_logits ? sizeof(float) : dtype_size(dtype);
  request.budget_bytes = options.workspace_budget;
  request.fixed_bytes = row_scratch_bytes(rows);
  // Only the gradient path pipelines (the forward-only path has no products to hide behind).
  request.overlap = with_gradients && linear_overlap_enabled();
  // A single chunk writes ∂W straight into the output (linear_support.hpp): no accumulator.
  const bool single_chunk = plan_chunks(request).chunk_count <= 1;
  if (weight_accumulator && !single_chunk) {
    request.accumulator_bytes += align_up(static_cast<std::size_t>(vocab) *
                                          static_cast<std::size_t>(hidden) * sizeof(float));
  }
  if (bias_accumulator) {
    request.accumulator_bytes += align_up(static_cast<std::size_t>(vocab) * sizeof(float));
  }
  LinearCePlan plan;
  plan.chunks = plan_chunks(request);
  plan.logits_dtype = options.fp32_logits ? DType::f32 : dtype;
  return plan;
}

}  // namespace

std::size_t linear_ce_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                     const LinearCeOptions& options, bool with_gradients) {
  // The query cannot see the gradient dtypes: it reserves fp32 accumulators for 16-bit inputs
  // (a caller passing fp32 grad weight/bias leaves them unused).
  const bool accumulate = with_gradients && dtype != DType::f32;
  return plan_linear_ce(rows, hidden, vocab, dtype, options, with_gradients, accumulate,
                        accumulate)
      .chunks.total_bytes;
}

namespace {

void run_linear_ce(const LinearCeCall& call, Workspace workspace, cudaStream_t stream) {
  const int64_t rows = call.hidden.rows, hidden = call.hidden.cols, vocab = call.weight.rows;
  const LinearGradients& grads = call.grads;
  const bool want_hidden = grads.hidden.present(), want_weight = grads.weight.present(),
             want_bias = grads.bias.present();
  const bool want_grad = want_hidden || want_weight || want_bias;
  const bool weight_accumulator = want_weight && grads.weight.dtype != DType::f32;
  const bool bias_accumulator = want_bias && grads.bias.dtype != DType::f32;
  const LinearCePlan plan = plan_linear_ce(rows, hidden, vocab, call.hidden.dtype, call.options,
                                           want_grad, weight_accumulator, bias_accumulator);
  const CeOptions& ce = call.options.ce;
  const Reduction reduction = ce.reduction;

  WorkspaceCarver carver(workspace);
  const std::size_t buffer_stride = align_up(plan.chunks.logits_buffer_bytes);
  void* chunk_buffer = carver.take(buffer_stride * plan.chunks.buffer_count);
  auto* totals = static_cast<CeBatchTotals*>(carver.take(sizeof(CeBatchTotals)));
  const std::size_t row_array = static_cast<std::size_t>(rows) * sizeof(float);
  auto* row_loss = static_cast<float*>(carver.take(row_array));
  auto* row_z_loss = static_cast<float*>(carver.take(row_array));
  auto* row_correct = static_cast<float*>(carver.take(row_array));
  const GemmScratch scratch{carver.take(plan.chunks.gemm_workspace_bytes),
                            plan.chunks.gemm_workspace_bytes};
  const GradientSums sums =
      carve_gradient_sums(carver, grads, vocab, hidden, plan.chunks.chunk_count <= 1);

  const CeRowOptions row_options = ce_row_options(ce);
  const bool per_row_upstream = reduction == Reduction::none && call.grad_output.present();
  CeBatchRequest batch;
  batch.target = call.target.data;
  batch.target_dtype = call.target.dtype;
  batch.rows = rows;
  batch.vocab = vocab;
  batch.options = row_options;
  batch.grad_output = (reduction != Reduction::none && call.grad_output.present())
                          ? static_cast<const float*>(call.grad_output.data)
                          : nullptr;
  batch.op = call.op;
  ce_batch_totals(batch, totals, stream);

  const bool sum_or_mean = reduction != Reduction::none;
  const CeStats* stats = call.stats;
  const bool want_accuracy = stats && stats->accuracy.present();
  const int64_t chunk_rows = plan.chunks.chunk_rows;
  const DType operand_dtype = call.hidden.dtype;
  const bool narrow_gradient = plan.logits_dtype != operand_dtype;

  const GemmMatrix weight = gemm_matrix(call.weight, 0, vocab);
  auto buffer_of = [&](int64_t chunk) -> void* {
    return static_cast<char*>(chunk_buffer) + (chunk % plan.chunks.buffer_count) * buffer_stride;
  };
  auto first_row = [&](int64_t chunk) { return chunk * chunk_rows; };
  auto row_count = [&](int64_t chunk) { return std::min(chunk_rows, rows - chunk * chunk_rows); };

  // Stage 1: L = h_chunk·Wᵀ (+ bias).
  auto form_logits = [&](int64_t chunk) {
    GemmProduct forward;
    forward.a = gemm_matrix(call.hidden, first_row(chunk), row_count(chunk));
    forward.b = weight;
    forward.b_transposed = true;
    forward.c = GemmMatrix{buffer_of(chunk), plan.logits_dtype, row_count(chunk), vocab, vocab};
    forward.bias = call.bias.present() ? call.bias.data : nullptr;
    gemm(forward, scratch, stream);
  };

  // Stage 2: the row kernel (loss parts, statistics, gradient in place).
  auto row_kernel = [&](int64_t chunk, cudaStream_t on) {
    const int64_t first = first_row(chunk);
    void* buffer = buffer_of(chunk);
    CeRowsArgs args;
    args.logits = buffer;
    args.dtype = plan.logits_dtype;
    args.rows = row_count(chunk);
    args.vocab = vocab;
    args.row_stride = vocab;
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
    if (want_grad) {
      args.grad = buffer;
      args.grad_row_stride = vocab;
    }
    ce_rows(args, on);
    // The products take operands of one dtype: fp32 chunk gradients of 16-bit inputs are rounded
    // to the input dtype in place (as F.cross_entropy's bf16 gradient would be).
    if (want_grad && narrow_gradient) {
      narrow_rows_in_place(buffer, args.rows, vocab, vocab, operand_dtype, on);
    }
  };

  // Stage 3: ∂h rows, ∂W and ∂bias from the chunk gradient.
  auto products = [&](int64_t chunk) {
    GemmMatrix gradient{buffer_of(chunk), plan.logits_dtype, row_count(chunk), vocab, vocab};
    if (narrow_gradient) {
      gradient.dtype = operand_dtype;
      gradient.stride = 2 * vocab;
    }
    const GemmMatrix hidden_rows = gemm_matrix(call.hidden, first_row(chunk), row_count(chunk));
    accumulate_chunk_gradients(gradient, hidden_rows, weight, grads, first_row(chunk), chunk == 0,
                               sums, scratch, stream);
  };

  const int64_t chunks = plan.chunks.chunk_count;
  if (plan.chunks.buffer_count == 1 || !want_grad) {
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      form_logits(chunk);
      row_kernel(chunk, stream);
      if (want_grad) products(chunk);
    }
  } else {
    // Two buffers: the row kernel of chunk i+1 runs on a side stream while chunk i's products run
    // on the caller's stream. Caller-stream order L(0) L(1) P(0) L(2) P(1) ...; buffer i%2 is
    // rewritten by L(i+2) only after P(i), which waited for the row kernel of chunk i.
    SideStream side(stream);
    form_logits(0);
    side.fork();
    row_kernel(0, side.stream());
    side.mark_done();
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const bool has_next = chunk + 1 < chunks;
      if (has_next) form_logits(chunk + 1);
      side.wait_done();  // row kernel of `chunk`
      if (has_next) {
        side.fork();
        row_kernel(chunk + 1, side.stream());
        side.mark_done();
      }
      products(chunk);
    }
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

}  // namespace

void linear_ce_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                       const LinearCeOptions& options, const LinearCeOutputs& out,
                       TensorView grad_output, Workspace workspace, Stream stream) {
  DeviceGuard guard(hidden.device.index);
  LinearCeCall call{hidden, weight, bias, target, options};
  call.grad_output = grad_output;
  call.loss = &out.loss;
  call.stats = &out.stats;
  call.grads = out.grads;
  call.op = OpCode::linear_ce_forward;
  run_linear_ce(call, workspace, stream_of(stream));
}

void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView /*lse: the row kernel re-derives it on chip from the chunk*/,
                        TensorView grad_output, const LinearCeOptions& options,
                        const LinearGradients& grads, Workspace workspace, Stream stream) {
  DeviceGuard guard(hidden.device.index);
  LinearCeCall call{hidden, weight, bias, target, options};
  call.grad_output = grad_output;
  call.grads = grads;
  call.op = OpCode::linear_ce_backward;
  run_linear_ce(call, workspace, stream_of(stream));
}

}  // namespace xent::cuda
