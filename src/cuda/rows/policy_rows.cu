// The per-token step and the final sums of the fused linear policy loss (policy_rows.cuh). A few
// flops per row: one thread a row, and one CTA for the sums so their order is fixed.
#include "cuda/core/device.cuh"
#include "cuda/rows/block_reduce.cuh"
#include "cuda/rows/ce_device.cuh"
#include "cuda/rows/policy_rows.cuh"

namespace xent::cuda {
namespace {

constexpr int kRowThreads = 256;

__global__ void __launch_bounds__(kRowThreads) policy_rows_kernel(const PolicyRowsArgs a) {
  const int64_t n = blockIdx.x * int64_t{kRowThreads} + threadIdx.x;
  if (n >= a.rows) return;
  const PolicyRowResults& out = a.results;
  if (read_target(a.target, a.target_dtype, n) == a.ignore_index) {
    a.upstream[n] = 0;
    a.grad_entropy[n] = 0;
    out.loss[n] = out.clipped_low[n] = out.clipped_high[n] = out.kl[n] = out.ratio[n] = 0;
    return;
  }
  const common::PolicyOptions<float>& o = a.options;
  common::PolicyToken<float> t;
  t.logprob = a.logprob[n];
  t.entropy = a.entropy ? a.entropy[n] : 0.0f;
  t.advantage = a.advantages[n];
  if (o.has_old) t.old = a.old_logprobs[n];
  if (o.has_ref) t.ref = a.ref_logprobs[n];
  if (o.has_rollout) t.rollout = a.rollout_logprobs[n];
  t.weight = a.weight[n];
  const common::PolicyResult<float> r = common::policy_token(o, t);
  // loss_ce = −ℓ, so c_ℓ·∂ℓ/∂x is the ce gradient with coefficient −c_ℓ.
  a.upstream[n] = -r.grad_logprob;
  a.grad_entropy[n] = r.grad_entropy;
  out.loss[n] = r.loss;
  out.clipped_low[n] = r.clipped_low ? 1.0f : 0.0f;
  out.clipped_high[n] = r.clipped_high ? 1.0f : 0.0f;
  out.kl[n] = r.kl;
  out.ratio[n] = r.ratio;
}

struct PolicyReduceArgs {
  int64_t rows;
  PolicyRowResults results;
  float* loss;
  float* stats;
};

__global__ void __launch_bounds__(kBlockReduceThreads)
    policy_reduce_kernel(const PolicyReduceArgs a) {
  __shared__ double scratch[32];
  wait_for_previous_grid();  // launched as a dependent of the last chunk's kernels
  const float* columns[] = {a.results.loss, a.results.clipped_low, a.results.clipped_high,
                            a.results.kl, a.results.ratio};
  double sums[5] = {0, 0, 0, 0, 0};
  for (int64_t n = threadIdx.x; n < a.rows; n += kBlockReduceThreads) {
#pragma unroll
    for (int c = 0; c < 5; ++c) sums[c] += columns[c][n];
  }
#pragma unroll
  for (int c = 0; c < 5; ++c) sums[c] = block_reduce(sums[c], scratch);
  if (threadIdx.x != 0) return;
  *a.loss = static_cast<float>(sums[0]);
  if (a.stats) {
    for (int c = 0; c < 4; ++c) a.stats[c] = static_cast<float>(sums[c + 1]);
  }
}

}  // namespace

void policy_rows(const PolicyRowsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return;
  const auto blocks = static_cast<unsigned>((args.rows + kRowThreads - 1) / kRowThreads);
  policy_rows_kernel<<<blocks, kRowThreads, 0, stream>>>(args);
  XENT_CUDA_CHECK_LAUNCH();
}

void policy_reduce(int64_t rows, const PolicyRowResults& results, float* loss, float* stats,
                   cudaStream_t stream) {
  launch_finishing_kernel(policy_reduce_kernel, kBlockReduceThreads,
                          PolicyReduceArgs{rows, results, loss, stats}, stream);
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
