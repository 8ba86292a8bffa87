// Distillation on logits, CUDA backend (docs/semantics.md §3): batch pre-pass (ce_batch_totals, which also
// gives D and W for the hard-label term), the distill row kernel (or the two passes of
// distill_two_pass.cuh), and a fixed-order reduction, over a workspace laid out as
// [CeBatchTotals | row_soft[N] | row_hard_loss[N] | row_hard_z[N] | statistics[N]].
#include "api/backend.hpp"
#include "cuda/rows/distill_rows.cuh"

namespace xent::cuda {
namespace {

constexpr int kReduceThreads = 1024;

__device__ double block_sum_double(double value, double* scratch) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kReduceThreads / 32; ++w) value += scratch[w];
  }
  return value;
}

__global__ void __launch_bounds__(kReduceThreads) distill_reduce_kernel(const DistillReduceArgs a) {
  __shared__ double scratch[32];
  wait_for_previous_grid();  // launched as a dependent of the row kernel (launch_finishing_kernel)
  double soft = 0, hard = 0, hard_z = 0;
  for (int64_t n = threadIdx.x; n < a.rows; n += kReduceThreads) {
    if (a.row_soft) soft += a.row_soft[n];
    if (a.row_hard_loss) hard += a.row_hard_loss[n];
    if (a.row_hard_z) hard_z += a.row_hard_z[n];
  }
  soft = block_sum_double(soft, scratch);
  hard = block_sum_double(hard, scratch);
  hard_z = block_sum_double(hard_z, scratch);
  if (threadIdx.x != 0) return;
  const CeBatchTotals& t = *a.totals;
  const bool mean = a.reduction == Reduction::mean;
  double total = 0;
  if (a.soft_weight != 0.0) {
    total += a.soft_weight * (mean ? (t.valid_rows > 0 ? soft / t.valid_rows : 0.0) : soft);
  }
  if (a.hard_weight != 0.0 && a.row_hard_loss) {
    const double ce = mean ? (t.target_weight_sum > 0 ? hard / t.target_weight_sum : 0.0) +
                                 (t.valid_rows > 0 ? hard_z / t.valid_rows : 0.0)
                           : hard + hard_z;
    total += a.hard_weight * ce;
  }
  *a.loss = static_cast<float>(total);
}

struct DistillWorkspace {
  CeBatchTotals* totals;
  float* row_soft;
  float* row_hard_loss;
  float* row_hard_z;
  DistillRowStatistics* statistics;  // the two-pass form's per-row statistics
};

DistillWorkspace carve(Workspace workspace, int64_t rows, const char* function) {
  const std::size_t array = (static_cast<std::size_t>(rows) * sizeof(float) + 255) / 256 * 256;
  char* base = static_cast<char*>(workspace.data);
  if (base == nullptr || workspace.bytes < distill_workspace_bytes(rows)) {
    throw Error(ErrorKind::invalid_argument,
                std::string(function) + ": workspace too small: got " +
                    std::to_string(workspace.bytes) + " bytes; expected at least " +
                    std::to_string(distill_workspace_bytes(rows)) + " bytes");
  }
  return {reinterpret_cast<CeBatchTotals*>(base), reinterpret_cast<float*>(base + 256),
          reinterpret_cast<float*>(base + 256 + array),
          reinterpret_cast<float*>(base + 256 + 2 * array),
          reinterpret_cast<DistillRowStatistics*>(base + 256 + 3 * array)};
}

float* f32(TensorView view) { return view.present() ? static_cast<float*>(view.data) : nullptr; }

// Pre-pass, row kernel and (for sum/mean) the reduction; `loss` and `grad` may be absent.
void run_distill(TensorView student, TensorView teacher, TensorView target,
                 const DistillOptions& options, TensorView loss, TensorView grad,
                 TensorView grad_output, Workspace workspace, Stream stream, OpCode op) {
  DeviceGuard guard(student.device.index);
  const cudaStream_t s = stream_of(stream);
  const int64_t rows = student.rows;
  const DistillWorkspace ws = carve(workspace, rows, op_name(op));
  const Reduction reduction = options.ce.reduction;
  const bool none = reduction == Reduction::none;

  const CeBatchRequest request =
      distill_batch_request(target, rows, student.cols, options, grad_output, op);
  ce_batch_totals(request, ws.totals, s);

  const bool with_hard = options.hard_weight != 0.0 && target.present();
  DistillRowsArgs a;
  a.student = student.data;
  a.student_row_stride = student.row_stride;
  a.teacher = teacher.data;
  a.teacher_row_stride = teacher.row_stride;
  a.dtype = student.dtype;
  a.rows = rows;
  a.vocab = student.cols;
  a.target = request.target;
  a.target_dtype = target.dtype;
  a.row_weight = f32(options.ce.row_weight);
  a.options = distill_row_options(options);
  a.totals = ws.totals;
  a.grad_output_rows = none ? f32(grad_output) : nullptr;
  a.scratch_statistics = ws.statistics;
  if (loss.present()) {
    a.row_soft = ws.row_soft;
    a.row_hard_loss = with_hard ? ws.row_hard_loss : nullptr;
    a.row_hard_z = with_hard ? ws.row_hard_z : nullptr;
    a.row_total = none ? f32(loss) : nullptr;
  }
  if (grad.present()) {
    a.grad = grad.data;
    a.grad_row_stride = grad.row_stride;
  }
  distill_rows(a, s);

  if (loss.present() && !none) {
    DistillReduceArgs r;
    r.rows = rows;
    r.reduction = reduction;
    r.soft_weight = options.soft_weight;
    r.hard_weight = options.hard_weight;
    r.row_soft = ws.row_soft;
    r.row_hard_loss = a.row_hard_loss;
    r.row_hard_z = a.row_hard_z;
    r.totals = ws.totals;
    r.loss = f32(loss);
    distill_reduce(r, s);
  }
}

}  // namespace

CeBatchRequest distill_batch_request(TensorView target, int64_t rows, int64_t vocab,
                                     const DistillOptions& options, TensorView grad_output,
                                     OpCode op) {
  CeBatchRequest request;
  request.target = target.present() ? target.data : nullptr;
  request.target_dtype = target.dtype;
  request.rows = rows;
  request.vocab = vocab;
  request.options = ce_row_options(options.ce);
  request.grad_output = options.ce.reduction == Reduction::none ? nullptr : f32(grad_output);
  request.op = op;
  return request;
}

void distill_reduce(const DistillReduceArgs& args, cudaStream_t stream) {
  if (!args.loss) return;
  launch_finishing_kernel(distill_reduce_kernel, kReduceThreads, args, stream);
}

std::size_t distill_workspace_bytes(int64_t rows) {
  const std::size_t array = (static_cast<std::size_t>(rows) * sizeof(float) + 255) / 256 * 256;
  return 256 + 3 * array + static_cast<std::size_t>(rows) * sizeof(DistillRowStatistics);
}

std::size_t distill_workspace_size(int64_t rows, int64_t, const DistillOptions&) {
  return distill_workspace_bytes(rows);
}

void distill_forward(TensorView student, TensorView teacher, TensorView target,
                     const DistillOptions& options, const DistillOutputs& out,
                     TensorView grad_output, Workspace workspace, Stream stream) {
  run_distill(student, teacher, target, options, out.loss, out.grad_student, grad_output, workspace,
              stream, OpCode::distill_forward);
}

void distill_backward(TensorView student, TensorView teacher, TensorView target,
                      TensorView grad_output, const DistillOptions& options,
                      TensorView grad_student, Workspace workspace, Stream stream) {
  run_distill(student, teacher, target, options, TensorView{}, grad_student, grad_output, workspace,
              stream, OpCode::distill_backward);
}

}  // namespace xent::cuda
