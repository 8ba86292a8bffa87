// Cross-entropy on logits, CUDA backend (docs/semantics.md §1): the batch pre-pass, the row kernel and the
// fixed-order reduction of ce_rows.cuh, over a workspace laid out as
//   [CeBatchTotals | row_loss[N] | row_z_loss[N] | row_correct[N]].
#include "api/backend.hpp"
#include "cuda/rows/ce_grad.cuh"
#include "cuda/rows/ce_rows.cuh"

namespace xent::cuda {
namespace {

struct CeWorkspace {
  CeBatchTotals* totals;
  float* row_loss;
  float* row_z_loss;
  float* row_correct;
};

CeWorkspace carve(Workspace workspace, int64_t rows) {
  const std::size_t array = (static_cast<std::size_t>(rows) * sizeof(float) + 255) / 256 * 256;
  char* base = static_cast<char*>(workspace.data);
  if (base == nullptr || workspace.bytes < ce_workspace_bytes(rows)) {
    throw Error(ErrorKind::invalid_argument,
                "ce: workspace too small: got " + std::to_string(workspace.bytes) +
                    " bytes; expected at least " + std::to_string(ce_workspace_bytes(rows)) +
                    " bytes");
  }
  return {reinterpret_cast<CeBatchTotals*>(base), reinterpret_cast<float*>(base + 256),
          reinterpret_cast<float*>(base + 256 + array),
          reinterpret_cast<float*>(base + 256 + 2 * array)};
}

float* f32(TensorView view) { return view.present() ? static_cast<float*>(view.data) : nullptr; }

void run_totals(TensorView logits, TensorView target, const CeOptions& options,
                TensorView grad_output, OpCode op, CeBatchTotals* totals, cudaStream_t stream) {
  CeBatchRequest request;
  request.target = target.data;
  request.target_dtype = target.dtype;
  request.rows = logits.rows;
  request.vocab = logits.cols;
  request.options = ce_row_options(options);
  request.grad_output = options.reduction != Reduction::none ? f32(grad_output) : nullptr;
  request.op = op;
  ce_batch_totals(request, totals, stream);
}

}  // namespace

CeRowsArgs ce_rows_args(TensorView logits, TensorView target, const CeOptions& options,
                        const CeBatchTotals* totals) {
  CeRowsArgs a;
  a.logits = logits.data;
  a.dtype = logits.dtype;
  a.rows = logits.rows;
  a.vocab = logits.cols;
  a.row_stride = logits.row_stride;
  a.target = target.data;
  a.target_dtype = target.dtype;
  a.row_weight = f32(options.row_weight);
  a.options = ce_row_options(options);
  a.totals = totals;
  return a;
}

std::size_t ce_workspace_size(int64_t rows, int64_t, const CeOptions&) {
  return ce_workspace_bytes(rows);
}

void ce_forward(TensorView logits, TensorView target, const CeOptions& options,
                const CeOutputs& out, TensorView grad_output, Workspace workspace, Stream stream) {
  DeviceGuard guard(logits.device.index);
  const cudaStream_t s = stream_of(stream);
  const int64_t rows = logits.rows;
  const CeWorkspace ws = carve(workspace, rows);
  const bool none = options.reduction == Reduction::none;
  run_totals(logits, target, options, grad_output, OpCode::ce_forward, ws.totals, s);

  CeRowsArgs a = ce_rows_args(logits, target, options, ws.totals);
  const CeReduceArgs r = bind_ce_outputs(a, out, options.reduction, rows, ws.row_loss,
                                         ws.row_z_loss, ws.row_correct, ws.totals);
  if (out.grad_logits.present()) {
    a.grad = out.grad_logits.data;
    a.grad_row_stride = out.grad_logits.row_stride;
    a.grad_output_rows = none ? f32(grad_output) : nullptr;
  }
  a.after_totals = true;  // run_totals was the launch just before
  ce_rows(a, s);
  ce_reduce(r, s);
}

CeReduceArgs bind_ce_outputs(CeRowsArgs& a, const CeOutputs& out, Reduction reduction, int64_t rows,
                             float* row_loss, float* row_z_loss, float* row_correct,
                             const CeBatchTotals* totals) {
  const bool none = reduction == Reduction::none;
  a.row_loss = row_loss;
  a.row_z_loss =
      none && out.stats.z_loss_value.present() ? f32(out.stats.z_loss_value) : row_z_loss;
  a.row_total = none ? f32(out.loss) : nullptr;
  a.row_correct = out.stats.accuracy.present() ? row_correct : nullptr;
  a.lse = f32(out.stats.lse);
  a.logprob = f32(out.stats.logprob);
  a.entropy = f32(out.stats.entropy);
  a.argmax = out.stats.argmax.present() ? static_cast<int64_t*>(out.stats.argmax.data) : nullptr;
  CeReduceArgs r;
  r.rows = rows;
  r.reduction = reduction;
  r.row_loss = row_loss;
  r.row_z_loss = none ? nullptr : row_z_loss;
  r.row_correct = a.row_correct;
  r.totals = totals;
  r.loss = none ? nullptr : f32(out.loss);
  r.z_loss_value = none ? nullptr : f32(out.stats.z_loss_value);
  r.accuracy = f32(out.stats.accuracy);
  return r;
}

void ce_backward(TensorView logits, TensorView target, TensorView lse, TensorView grad_output,
                 const EntropyGradient& entropy, const CeOptions& options, TensorView grad_logits,
                 Workspace workspace, Stream stream) {
  DeviceGuard guard(logits.device.index);
  const cudaStream_t s = stream_of(stream);
  const CeWorkspace ws = carve(workspace, logits.rows);
  run_totals(logits, target, options, grad_output, OpCode::ce_backward, ws.totals, s);
  CeRowsArgs a = ce_rows_args(logits, target, options, ws.totals);
  a.grad = grad_logits.data;
  a.grad_row_stride = grad_logits.row_stride;
  a.grad_output_rows = options.reduction == Reduction::none ? f32(grad_output) : nullptr;
  if (lse.present()) {  // validation requires it with an entropy gradient
    ce_grad_from_lse(a, f32(lse), EntropyRows{f32(entropy.entropy), f32(entropy.grad)}, s);
  } else {
    a.after_totals = true;  // run_totals was the launch just before
    ce_rows(a, s);
  }
}

}  // namespace xent::cuda
