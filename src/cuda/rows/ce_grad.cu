// The ce backward from a saved lse (docs/semantics.md §1): with the row statistics known, the gradient is
// elementwise, so the logits are read once and the gradient written once by a flat grid of
// tiles (no per-row reduction, no cluster). Per-row coefficients come from common::ce_grad_row.
#include "cuda/rows/ce_device.cuh"
#include "cuda/rows/ce_grad.cuh"
#include "cuda/rows/row_slice.cuh"
#include "cuda/rows/row_stats.cuh"

namespace xent::cuda {
namespace {

using common::CeConstants;
using common::CeGradRow;

constexpr int kThreads = 256;
constexpr int kVectorsPerThread = 4;  // 4 independent 16-byte loads in flight per thread

struct CeGradParams {
  CeRowsArgs args;  // logits, target, options, totals, grad_output_rows, grad
  const float* lse;
  EntropyRows entropy;  // read only by the kEntropy instance
  int64_t tiles_per_row;
  bool logits_vector_ok;
  bool grad_vector_ok;
  CeGradShard shard;  // offset 0, vocab = args.vocab, no target weights: the whole vocabulary
};

template <class S, bool kEntropy>
__global__ void __launch_bounds__(kThreads) ce_grad_from_lse_kernel(const CeGradParams p) {
  constexpr int kVec = kVectorElements<S>;
  constexpr int64_t kTile = int64_t{kThreads} * kVectorsPerThread * kVec;
  const CeRowsArgs& a = p.args;
  const CeRowOptions& o = a.options;
  const int64_t row = blockIdx.x / p.tiles_per_row;
  const int64_t begin = (blockIdx.x % p.tiles_per_row) * kTile;
  const int64_t length = a.vocab - begin < kTile ? a.vocab - begin : kTile;
  const int64_t global_target = read_target(a.target, a.target_dtype, row);
  const int64_t target = global_target - p.shard.offset;  // local column (outside when elsewhere)
  S* grad = static_cast<S*>(a.grad) + row * a.grad_row_stride + begin;
  const S* x = static_cast<const S*>(a.logits) + row * a.row_stride + begin;
  const bool valid = global_target != o.ignore_index;
  const bool in_range = global_target >= 0 && global_target < p.shard.vocab;

  if (!valid || !in_range) {
    Vector<S> v;
#pragma unroll
    for (int k = 0; k < kVec; ++k) v.value[k] = valid ? quiet_nan() : 0.0f;
    for (int64_t j = threadIdx.x; j * kVec < length; j += kThreads) {
      store_vector(grad, j, length, p.grad_vector_ok, v);
    }
    return;
  }

  const CeConstants<float> c = make_ce_constants(o, p.shard.vocab, a.totals);
  const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  const float r = a.row_weight ? a.row_weight[row] : 1.0f;
  const float target_weight = p.shard.target_weight ? p.shard.target_weight[row]
                              : o.class_weight      ? o.class_weight[target]
                                                    : 1.0f;
  const float base = upstream * r;
  const CeGradRow<float> grad_row = common::ce_grad_row(c, p.lse[row], target, target_weight,
                                                        base * a.totals->loss_factor * a.grad_scale,
                                                        base * a.totals->z_factor * a.grad_scale);
  common::EntropyGradRow<float> entropy_row;
  if constexpr (kEntropy) {
    entropy_row = common::entropy_grad_row(p.entropy.grad[row] * a.grad_scale, p.lse[row],
                                           p.entropy.entropy[row]);
  }

  Vector<S> values[kVectorsPerThread];
#pragma unroll
  for (int u = 0; u < kVectorsPerThread; ++u) {
    const int64_t j = threadIdx.x + int64_t{u} * kThreads;
    if (p.logits_vector_ok && (j + 1) * kVec <= length) {
      values[u] = unpack<S>(__ldg(reinterpret_cast<const uint4*>(x) + j));
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const int64_t i = j * kVec + k;
        values[u].value[k] = i < length ? load_float(x[i]) : 0.0f;
      }
    }
  }
  const int target_in_tile =  // -1 when y lies in another tile
      target >= begin && target < begin + length ? static_cast<int>(target - begin) : -1;
  const bool weighted = o.class_weight != nullptr && c.smoothing > 0;
  with_transform(c.transform, [&](const auto& transform) {
#pragma unroll
    for (int u = 0; u < kVectorsPerThread; ++u) {
      const int j = threadIdx.x + u * kThreads;
      if (j * kVec >= length) continue;
      float w[kVec];
      if (weighted) {
        load_class_weights(o.class_weight, begin + int64_t{j} * kVec, (j + 1) * kVec <= length,
                           length - int64_t{j} * kVec, w);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) w[k] = 1.0f;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const int i = j * kVec + k;
        float value, slope;
        value_and_slope(transform, values[u].value[k], value, slope);
        const float prob = fast_exp(value - grad_row.lse);
        if constexpr (kEntropy) {
          values[u].value[k] = common::ce_entropy_grad_from_prob(grad_row, entropy_row, prob, value,
                                                                 slope, i == target_in_tile, w[k]);
        } else {
          values[u].value[k] =
              common::ce_grad_from_prob(grad_row, prob, slope, i == target_in_tile, w[k]);
        }
      }
      store_vector(grad, j, length, p.grad_vector_ok, values[u]);
    }
  });
}

template <class S>
void launch_ce_grad(const CeGradParams& p, dim3 grid, cudaStream_t stream) {
  if (p.entropy.present()) {
    ce_grad_from_lse_kernel<S, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    ce_grad_from_lse_kernel<S, false><<<grid, kThreads, 0, stream>>>(p);
  }
}

}  // namespace

void ce_grad_from_lse(const CeRowsArgs& args, const float* lse, const EntropyRows& entropy,
                      cudaStream_t stream, const CeGradShard* shard) {
  if (args.rows <= 0) return;
  const std::size_t element = dtype_size(args.dtype);
  const int64_t tile = int64_t{kThreads} * kVectorsPerThread * (16 / static_cast<int64_t>(element));
  CeGradParams p{};
  p.args = args;
  p.lse = lse;
  p.entropy = entropy;
  p.tiles_per_row = (args.vocab + tile - 1) / tile;
  p.shard.vocab = args.vocab;
  if (shard != nullptr) p.shard = *shard;
  p.logits_vector_ok = rows_are_vector_aligned(args.logits, args.row_stride, element);
  p.grad_vector_ok = rows_are_vector_aligned(args.grad, args.grad_row_stride, element);
  const dim3 grid(static_cast<unsigned>(args.rows * p.tiles_per_row));
  switch (args.dtype) {
    case DType::f32:
      launch_ce_grad<float>(p, grid, stream);
      break;
    case DType::bf16:
      launch_ce_grad<bf16_t>(p, grid, stream);
      break;
    case DType::f16:
      launch_ce_grad<f16_t>(p, grid, stream);
      break;
    default:
      throw Error(ErrorKind::invalid_argument, "ce_backward: unsupported logits dtype");
  }
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
