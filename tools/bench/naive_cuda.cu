// The naive form on a GPU, as a framework would run it unfused: logits materialised in fp32 (by
// cuBLASLt for the linear ops, by an upcast copy otherwise), one block per row for the softmax
// statistics, a second sweep for the gradient, then the backward products from the rounded G.
// Element formulas come from naive_math.hpp (double precision: a reference, not a contender).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "bench/cublaslt_product.hpp"
#include "bench/naive.hpp"
#include "bench/naive_math.hpp"

namespace xent::bench {

namespace {

constexpr int kThreads = 256;

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("naive ") + what + ": " + cudaGetErrorString(status));
}

template <class Combine>
__device__ double block_reduce(double value, Combine combine) {
  __shared__ double partial[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    value = combine(value, __shfl_down_sync(0xffffffffu, value, offset));
  __syncthreads();  // the previous reduction's readers are done with `partial`
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = value;
  __syncthreads();
  value = partial[0];
  for (int w = 1; w < kThreads / 32; ++w) value = combine(value, partial[w]);
  return value;  // every thread gets the result
}

__device__ double block_sum(double value) {
  return block_reduce(value, [](double a, double b) { return a + b; });
}
__device__ double block_max(double value) {
  return block_reduce(value, [](double a, double b) { return fmax(a, b); });
}

__device__ float load(const float* p, int64_t i) { return p[i]; }
__device__ float load(const common::bf16_t* p, int64_t i) { return common::to_float(p[i]); }
__device__ float load(const common::f16_t* p, int64_t i) { return common::to_float(p[i]); }
__device__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ void store(common::bf16_t* p, int64_t i, float v) { p[i] = common::to_bf16(v); }
__device__ void store(common::f16_t* p, int64_t i, float v) { p[i] = common::to_f16(v); }

template <class In, class Out>
__global__ void convert_kernel(const In* in, Out* out, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x)
    store(out, i, load(in, i));
}

// fp32 <-> input dtype copies (the .float() and .to(dtype) of a framework).
void convert(const void* in, DType in_dtype, void* out, DType out_dtype, int64_t count,
             cudaStream_t stream) {
  const int grid = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 65535));
  auto launch = [&](auto* typed_out) {
    switch (in_dtype) {
      case DType::bf16:
        convert_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const common::bf16_t*>(in),
                                                      typed_out, count);
        break;
      case DType::f16:
        convert_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const common::f16_t*>(in),
                                                      typed_out, count);
        break;
      default:
        convert_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(in), typed_out,
                                                      count);
    }
  };
  switch (out_dtype) {
    case DType::bf16:
      launch(static_cast<common::bf16_t*>(out));
      break;
    case DType::f16:
      launch(static_cast<common::f16_t*>(out));
      break;
    default:
      launch(static_cast<float*>(out));
  }
  check_launch("convert");
}

// totals: [0] Σ r·ℓ, [1] Σ r·ζ, [2] D, [3] N_valid, [4] W = Σ w_i.
__global__ void class_weight_sum_kernel(const float* class_weight, int64_t vocab, double* totals) {
  double sum = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    sum += class_weight ? class_weight[i] : 1.0;
  sum = block_sum(sum);
  if (threadIdx.x == 0) totals[4] = sum;
}

__global__ void ce_stats_kernel(const float* x, int64_t vocab, naive::CeParams p,
                                const double* totals, const int64_t* target,
                                const float* class_weight, const float* row_weight,
                                double* row_loss, double* row_z, double* row_lse,
                                double* row_denominator) {
  const int64_t n = blockIdx.x;
  const float* row = x + n * vocab;
  p.weight_sum = totals[4];
  double max = -INFINITY;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    max = fmax(max, naive::ce_transformed(p, row[i]));
  max = block_max(max);
  double sum = 0, weighted = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const double v = naive::ce_transformed(p, row[i]);
    sum += exp(v - max);
    weighted += (class_weight ? class_weight[i] : 1.0) * v;
  }
  sum = block_sum(sum);
  weighted = block_sum(weighted);
  if (threadIdx.x != 0) return;
  const double lse = max + log(sum);
  const int64_t y = target[n];
  const double w_y = class_weight ? class_weight[y] : 1.0;
  const double r = row_weight ? row_weight[n] : 1.0;
  row_loss[n] = r * naive::ce_row_loss(p, lse, naive::ce_transformed(p, row[y]), w_y, weighted);
  row_z[n] = r * p.z_loss * lse * lse;
  row_lse[n] = lse;
  row_denominator[n] = w_y;
}

__global__ void totals_kernel(int64_t rows, const double* row_loss, const double* row_z,
                              const double* row_denominator, bool distill, double* totals) {
  double loss = 0, z = 0, denominator = 0;
  for (int64_t n = threadIdx.x; n < rows; n += blockDim.x) {
    loss += row_loss[n];
    if (!distill) {
      z += row_z[n];
      denominator += row_denominator[n];
    }
  }
  loss = block_sum(loss);
  z = block_sum(z);
  denominator = block_sum(denominator);
  if (threadIdx.x != 0) return;
  totals[0] = loss;
  totals[1] = z;
  totals[2] = distill ? double(rows) : denominator;
  totals[3] = double(rows);
}

__global__ void loss_kernel(Reduction reduction, int64_t rows, const double* row_loss,
                            const double* row_z, bool distill, const double* totals, float* loss) {
  if (reduction == Reduction::none) {
    for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < rows;
         n += int64_t{gridDim.x} * blockDim.x)
      loss[n] = static_cast<float>(row_loss[n] + (distill ? 0.0 : row_z[n]));
    return;
  }
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (reduction == Reduction::sum) {
    loss[0] = static_cast<float>(totals[0] + totals[1]);
  } else {
    loss[0] = static_cast<float>((totals[2] > 0 ? totals[0] / totals[2] : 0) +
                                 (totals[3] > 0 ? totals[1] / totals[3] : 0));
  }
}

// Upstream coefficient of row n: g_n (none) or 1, times r_n, over D (or N_valid for z) for mean.
__device__ void row_coefficients(Reduction reduction, const float* grad_output,
                                 const float* row_weight, const double* totals, int64_t n,
                                 double& coef, double& z_coef) {
  const double g = (reduction == Reduction::none && grad_output ? grad_output[n] : 1.0) *
                   (row_weight ? row_weight[n] : 1.0);
  coef = g;
  z_coef = g;
  if (reduction == Reduction::mean) {
    coef = totals[2] > 0 ? g / totals[2] : 0;
    z_coef = totals[3] > 0 ? g / totals[3] : 0;
  }
}

__global__ void ce_grad_kernel(const float* x, int64_t vocab, naive::CeParams p,
                               const double* totals, const int64_t* target,
                               const float* class_weight, const float* row_weight,
                               const float* grad_output, Reduction reduction, const double* row_lse,
                               float* grad) {
  const int64_t n = blockIdx.x;
  p.weight_sum = totals[4];
  double coef, z_coef;
  row_coefficients(reduction, grad_output, row_weight, totals, n, coef, z_coef);
  const int64_t y = target[n];
  const double w_y = class_weight ? class_weight[y] : 1.0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    grad[n * vocab + i] =
        static_cast<float>(naive::ce_gradient(p, coef, z_coef, row_lse[n], x[n * vocab + i], i == y,
                                              w_y, class_weight ? class_weight[i] : 1.0));
}

__device__ double row_lse_of(const float* row, int64_t vocab, double softcap) {
  double max = -INFINITY, sum = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    max = fmax(max, naive::distill_transformed(softcap, row[i]));
  max = block_max(max);
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x)
    sum += exp(naive::distill_transformed(softcap, row[i]) - max);
  return max + log(block_sum(sum));
}

// Row arrays for distillation: row_loss, row_lse = Σ p_s·d, row_z = lse_s, row_denominator = lse_t.
__global__ void distill_stats_kernel(const float* s, const float* t, int64_t vocab, int kind,
                                     double softcap, double beta, double* row_loss, double* row_z,
                                     double* row_lse, double* row_denominator) {
  const int64_t n = blockIdx.x;
  const float* srow = s + n * vocab;
  const float* trow = t + n * vocab;
  const double lse_s = row_lse_of(srow, vocab, softcap), lse_t = row_lse_of(trow, vocab, softcap);
  double loss = 0, sum_pd = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const double log_ps = naive::distill_transformed(softcap, srow[i]) - lse_s;
    const double log_pt = naive::distill_transformed(softcap, trow[i]) - lse_t;
    const naive::DistillTerm term = naive::distill_term(kind, beta, log_ps, log_pt);
    loss += term.loss;
    const double ps = exp(log_ps);
    sum_pd += ps == 0 ? 0 : ps * term.d;
  }
  loss = block_sum(loss);
  sum_pd = block_sum(sum_pd);
  if (threadIdx.x != 0) return;
  row_loss[n] = loss;
  row_lse[n] = sum_pd;
  row_z[n] = lse_s;
  row_denominator[n] = lse_t;
}

__global__ void distill_grad_kernel(const float* s, const float* t, int64_t vocab, int kind,
                                    double softcap, double beta, const double* totals,
                                    const float* grad_output, Reduction reduction,
                                    const double* row_z, const double* row_lse,
                                    const double* row_denominator, float* grad) {
  const int64_t n = blockIdx.x;
  double coef, unused;
  row_coefficients(reduction, grad_output, nullptr, totals, n, coef, unused);
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float x = s[n * vocab + i];
    const double log_ps = naive::distill_transformed(softcap, x) - row_z[n];
    const double log_pt =
        naive::distill_transformed(softcap, t[n * vocab + i]) - row_denominator[n];
    grad[n * vocab + i] =
        static_cast<float>(coef * naive::distill_dlogit(kind, beta, log_ps, log_pt, row_lse[n]) *
                           naive::distill_slope(softcap, x));
  }
}

RowMajor as_row_major(const TensorView& view) {
  return RowMajor{view.data, view.dtype, view.rows, view.cols};
}

}  // namespace

void naive_cuda(const Case& c, const Inputs& in, const Outputs& out, void* scratch,
                Stream stream_handle) {
  const auto stream = static_cast<cudaStream_t>(stream_handle.handle);
  const NaiveScratch s = naive_layout(c, scratch, DeviceKind::cuda);
  const bool grads = c.mode == Mode::fwdbwd;
  const bool distill = is_distill(c.op);
  const int64_t nv = c.n * c.v;
  const float* logits = nullptr;
  const float* teacher = nullptr;
  if (is_linear(c.op)) {
    lt_product(as_row_major(in.hidden), false, as_row_major(in.weight), true, s.logits, DType::f32,
               stream);
    logits = s.logits;
    if (c.op == Op::linear_distill) {
      lt_product(as_row_major(in.teacher_hidden), false, as_row_major(in.teacher_weight), true,
                 s.teacher, DType::f32, stream);
      teacher = s.teacher;
    }
  } else if (c.dtype == DType::f32) {
    logits = static_cast<const float*>(in.logits.data);
    if (distill) teacher = static_cast<const float*>(in.teacher.data);
  } else {
    convert(in.logits.data, c.dtype, s.logits, DType::f32, nv, stream);
    logits = s.logits;
    if (distill) {
      convert(in.teacher.data, c.dtype, s.teacher, DType::f32, nv, stream);
      teacher = s.teacher;
    }
  }

  const auto* target = static_cast<const int64_t*>(in.target.data);
  const auto* class_weight = static_cast<const float*>(in.class_weight.data);
  const auto* row_weight = static_cast<const float*>(in.row_weight.data);
  const auto* grad_output = static_cast<const float*>(in.grad_output.data);
  const unsigned rows = static_cast<unsigned>(c.n);
  const double softcap = c.options.softcap ? kSoftcap : 0, beta = 0.5;
  naive::CeParams params;
  params.smoothing = c.options.smoothing ? kSmoothing : 0;
  params.z_loss = c.options.z_loss ? kZLoss : 0;
  params.softcap = softcap;
  params.scale = c.options.logit_scale ? kLogitScale : 1;
  params.vocab = double(c.v);
  if (distill) {
    distill_stats_kernel<<<rows, kThreads, 0, stream>>>(logits, teacher, c.v, int(c.kind), softcap,
                                                        beta, s.row_loss, s.row_z, s.row_lse,
                                                        s.row_denominator);
  } else {
    class_weight_sum_kernel<<<1, kThreads, 0, stream>>>(class_weight, c.v, s.totals);
    ce_stats_kernel<<<rows, kThreads, 0, stream>>>(logits, c.v, params, s.totals, target,
                                                   class_weight, row_weight, s.row_loss, s.row_z,
                                                   s.row_lse, s.row_denominator);
  }
  totals_kernel<<<1, kThreads, 0, stream>>>(c.n, s.row_loss, s.row_z, s.row_denominator, distill,
                                            s.totals);
  loss_kernel<<<c.reduction == Reduction::none ? 256 : 1, kThreads, 0, stream>>>(
      c.reduction, c.n, s.row_loss, s.row_z, distill, s.totals, static_cast<float*>(out.loss.data));
  check_launch("row kernels");
  if (!grads) return;
  if (distill) {
    distill_grad_kernel<<<rows, kThreads, 0, stream>>>(
        logits, teacher, c.v, int(c.kind), softcap, beta, s.totals, grad_output, c.reduction,
        s.row_z, s.row_lse, s.row_denominator, s.grad);
  } else {
    ce_grad_kernel<<<rows, kThreads, 0, stream>>>(logits, c.v, params, s.totals, target,
                                                  class_weight, row_weight, grad_output,
                                                  c.reduction, s.row_lse, s.grad);
  }
  check_launch("gradient kernel");
  if (!is_linear(c.op)) {
    convert(s.grad, DType::f32, out.grad_logits.data, c.dtype, nv, stream);
    return;
  }
  // ∂h = G·W and ∂W = Gᵀ·h from G in the operands' dtype (fp32 G when the inputs are fp32).
  const void* g = s.grad;
  if (c.dtype != DType::f32) {
    convert(s.grad, DType::f32, s.grad_narrow, c.dtype, nv, stream);
    g = s.grad_narrow;
  }
  const RowMajor g_view{g, c.dtype, c.n, c.v};
  lt_product(g_view, false, as_row_major(in.weight), false, out.grad_hidden.data, c.dtype, stream);
  lt_product(g_view, true, as_row_major(in.hidden), false, out.grad_weight.data, c.dtype, stream);
}

}  // namespace xent::bench
