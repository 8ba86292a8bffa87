// Batch-wide steps around the ce row kernel: the pre-pass over the targets (N_valid, D, W and
// the mean factors, consumed on the device so no count ever travels to the host) and the final
// fixed-order reduction of per-row values. Both run as one CTA: N targets or N per-row floats
// are a few hundred KB at most, microseconds next to the N×V pass, and one CTA makes the order
// of every addition fixed (bitwise reproducible) without atomics.
#include "cuda/rows/block_reduce.cuh"
#include "cuda/rows/ce_rows.cuh"

namespace xent::cuda {
namespace {

constexpr int kThreads = kBlockReduceThreads;

__global__ void __launch_bounds__(kThreads)
    ce_batch_totals_kernel(const CeBatchRequest r, CeBatchTotals* totals, DeviceErrorState* error) {
  // A row kernel launched after this one with after_totals may start now: it reads the totals
  // only after wait_for_previous_grid.
  let_next_grid_start();
  __shared__ double double_scratch[32];
  __shared__ long long int_scratch[32];
  const float* class_weight = r.options.class_weight;
  long long valid = 0;
  long long first_bad = LLONG_MAX;
  double target_weight_sum = 0;
  // Targets in batches of kBatch per thread, every load of a batch issued before any is used:
  // one CTA walks all N targets, so it must keep many loads in flight, not one per iteration.
  constexpr int kBatch = 8;
  for (int64_t base = threadIdx.x; base < r.rows; base += int64_t{kThreads} * kBatch) {
    int64_t y[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t n = base + int64_t{b} * kThreads;
      y[b] = 0;
      if (n < r.rows && r.target != nullptr) {
        y[b] = r.target_dtype == DType::i32 ? int64_t{static_cast<const int32_t*>(r.target)[n]}
                                            : static_cast<const int64_t*>(r.target)[n];
      }
    }
    float w[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t n = base + int64_t{b} * kThreads;
      const bool counted = n < r.rows && (r.target == nullptr || y[b] != r.options.ignore_index);
      const bool in_range = y[b] >= 0 && y[b] < r.vocab;
      valid += counted ? 1 : 0;
      // An out-of-range row is NaN; it must not poison D and with it every other row's gradient.
      if (counted && !in_range && n < first_bad) first_bad = n;
      w[b] = counted && in_range ? (class_weight && r.target ? class_weight[y[b]] : 1.0f) : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) target_weight_sum += w[b];
  }
  double weight_sum = 0;
  if (class_weight) {
    for (int64_t i = threadIdx.x; i < r.vocab; i += kThreads) weight_sum += class_weight[i];
  }
  valid = block_reduce<long long>(valid, int_scratch);
  first_bad = block_reduce<long long>(first_bad, int_scratch, true);
  target_weight_sum = block_reduce<double>(target_weight_sum, double_scratch);
  weight_sum = block_reduce<double>(weight_sum, double_scratch);
  if (threadIdx.x != 0) return;

  CeBatchTotals t;
  t.valid_rows = static_cast<double>(valid);
  t.target_weight_sum = class_weight ? target_weight_sum : static_cast<double>(valid);
  t.class_weight_sum = class_weight ? static_cast<float>(weight_sum) : static_cast<float>(r.vocab);
  if (r.options.reduction == Reduction::mean) {
    t.loss_factor = t.target_weight_sum > 0 ? static_cast<float>(1.0 / t.target_weight_sum) : 0.0f;
    t.z_factor = valid > 0 ? static_cast<float>(1.0 / t.valid_rows) : 0.0f;
  } else {
    t.loss_factor = 1.0f;
    t.z_factor = 1.0f;
  }
  t.upstream = r.grad_output && r.options.reduction != Reduction::none ? *r.grad_output : 1.0f;
  *totals = t;

  if (first_bad != LLONG_MAX && error->pending == 0) {
    const int64_t y = r.target_dtype == DType::i32
                          ? int64_t{static_cast<const int32_t*>(r.target)[first_bad]}
                          : static_cast<const int64_t*>(r.target)[first_bad];
    error->op = static_cast<int32_t>(r.op);
    error->row = first_bad;
    error->value = y;
    error->vocab = r.vocab;
    error->ignore_index = r.options.ignore_index;
    error->pending = 1;
  }
}

__global__ void __launch_bounds__(kThreads) ce_reduce_kernel(const CeReduceArgs a) {
  __shared__ double scratch[32];
  wait_for_previous_grid();  // launched as a dependent of the row kernel (launch_finishing_kernel)
  double loss = 0, z = 0, correct = 0;
#pragma unroll 4
  for (int64_t n = threadIdx.x; n < a.rows; n += kThreads) {
    if (a.row_loss) loss += a.row_loss[n];
    if (a.row_z_loss) z += a.row_z_loss[n];
    if (a.row_correct) correct += a.row_correct[n];
  }
  loss = block_reduce(loss, scratch);
  z = block_reduce(z, scratch);
  correct = block_reduce(correct, scratch);
  if (threadIdx.x != 0) return;
  const CeBatchTotals& t = *a.totals;
  const bool mean = a.reduction == Reduction::mean;
  const double z_part = mean ? (t.valid_rows > 0 ? z / t.valid_rows : 0.0) : z;
  if (a.loss) {
    const double loss_part =
        mean ? (t.target_weight_sum > 0 ? loss / t.target_weight_sum : 0.0) : loss;
    *a.loss = static_cast<float>(loss_part + z_part);
  }
  if (a.z_loss_value) *a.z_loss_value = static_cast<float>(z_part);
  if (a.accuracy)
    *a.accuracy = t.valid_rows > 0 ? static_cast<float>(correct / t.valid_rows) : 0.0f;
}

}  // namespace

void ce_batch_totals(const CeBatchRequest& request, CeBatchTotals* totals, cudaStream_t stream) {
  ce_batch_totals_kernel<<<1, kThreads, 0, stream>>>(request, totals, device_error_state());
  XENT_CUDA_CHECK_LAUNCH();
}

void ce_reduce(const CeReduceArgs& args, cudaStream_t stream) {
  if (!args.loss && !args.z_loss_value && !args.accuracy) return;
  launch_finishing_kernel(ce_reduce_kernel, kThreads, args, stream);
}

std::size_t ce_workspace_bytes(int64_t rows) {
  const std::size_t array = (static_cast<std::size_t>(rows) * sizeof(float) + 255) / 256 * 256;
  return 256 + 3 * array;
}

}  // namespace xent::cuda
