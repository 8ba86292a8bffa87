// Elementwise ce gradient of a vocabulary block (linear_block_grad.cuh). Memory-bound: the tile is
// read once and written once, 16-byte vectors where rows are aligned; a block of threads covers one
// row segment, so per-row coefficients are formed once per segment.
#include "cuda/ce_device.cuh"
#include "cuda/linear_block_grad.cuh"
#include "cuda/row_stats.cuh"

namespace xent::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVectorsPerThread = 2;

struct BlockGradParams {
  BlockGradArgs args;
  int64_t segments_per_row;
  bool vector_ok;
};

template <class S, bool kEntropy>
__global__ void __launch_bounds__(kThreads) block_grad_kernel(const BlockGradParams p) {
  constexpr int kVec = kVectorElements<S>;
  constexpr int64_t kSegment = int64_t{kThreads} * kVectorsPerThread * kVec;
  const BlockGradArgs& a = p.args;
  const CeRowOptions& o = a.options;
  const int64_t row = blockIdx.x / p.segments_per_row;
  const int64_t begin = (blockIdx.x % p.segments_per_row) * kSegment;
  const int64_t length = a.columns - begin < kSegment ? a.columns - begin : kSegment;
  const S* x = static_cast<const S*>(a.logits) + row * a.logits_stride + begin;
  S* grad = static_cast<S*>(a.grad) + row * a.grad_stride + begin;
  const int64_t target = read_target(a.target, a.target_dtype, row);
  const bool valid = target != o.ignore_index;
  const bool in_range = target >= 0 && target < a.vocab;
  if (!valid || !in_range) {  // zeros for ignored rows, NaN for out-of-range targets (SPEC §1)
    const S fill = store_float<S>(valid ? quiet_nan() : 0.0f);
    for (int64_t i = threadIdx.x; i < length; i += kThreads) grad[i] = fill;
    return;
  }
  const common::CeConstants<float> c = make_ce_constants(o, a.vocab, a.totals);
  const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  const float base = upstream * (a.row_weight ? a.row_weight[row] : 1.0f);
  const float target_weight = o.class_weight ? o.class_weight[target] : 1.0f;
  const common::CeGradRow<float> grad_row = common::ce_grad_row(
      c, a.lse[row], target, target_weight, base * a.totals->loss_factor,
      base * a.totals->z_factor);
  common::EntropyGradRow<float> entropy_row;
  if constexpr (kEntropy) {
    entropy_row = common::entropy_grad_row(a.grad_entropy[row], a.lse[row], a.entropy[row]);
  }
  const int64_t target_column = target - a.first_column - begin;  // may lie outside the segment
  const bool weighted = o.class_weight != nullptr && c.smoothing > 0;
  const float* class_weight = weighted ? o.class_weight + a.first_column + begin : nullptr;

  with_transform(c.transform, [&](const auto& transform) {
    auto element = [&](int64_t i, float value) {
      const float w = class_weight ? class_weight[i] : 1.0f;
      const float transformed = transform.value(value);
      const float prob = fast_exp(transformed - grad_row.lse);
      if constexpr (kEntropy) {
        return common::ce_entropy_grad_from_prob(grad_row, entropy_row, prob, transformed,
                                                 transform.slope(value), i == target_column, w);
      } else {
        return common::ce_grad_from_prob(grad_row, prob, transform.slope(value),
                                         i == target_column, w);
      }
    };
    if (p.vector_ok) {
      for (int64_t j = threadIdx.x; j * kVec < length; j += kThreads) {
        Vector<S> v;
        if ((j + 1) * kVec <= length) {
          v = unpack<S>(__ldg(reinterpret_cast<const uint4*>(x) + j));
#pragma unroll
          for (int k = 0; k < kVec; ++k) v.value[k] = element(j * kVec + k, v.value[k]);
          reinterpret_cast<uint4*>(grad)[j] = pack<S>(v);
        } else {
          for (int64_t i = j * kVec; i < length; ++i) {
            grad[i] = store_float<S>(element(i, load_float(x[i])));
          }
        }
      }
    } else {
      for (int64_t i = threadIdx.x; i < length; i += kThreads) {
        grad[i] = store_float<S>(element(i, load_float(x[i])));
      }
    }
  });
}

template <class S>
void launch_block_grad(const BlockGradParams& p, dim3 grid, cudaStream_t stream) {
  if (p.args.grad_entropy != nullptr) {
    block_grad_kernel<S, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    block_grad_kernel<S, false><<<grid, kThreads, 0, stream>>>(p);
  }
}

}  // namespace

void block_grad_from_lse(const BlockGradArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.columns <= 0) return;
  const std::size_t element = dtype_size(args.dtype);
  const int64_t segment =
      int64_t{kThreads} * kVectorsPerThread * (16 / static_cast<int64_t>(element));
  BlockGradParams p{};
  p.args = args;
  p.segments_per_row = (args.columns + segment - 1) / segment;
  p.vector_ok = rows_are_vector_aligned(args.logits, args.logits_stride, element) &&
                rows_are_vector_aligned(args.grad, args.grad_stride, element);
  const dim3 grid(static_cast<unsigned>(args.rows * p.segments_per_row));
  switch (args.dtype) {
    case DType::f32: launch_block_grad<float>(p, grid, stream); break;
    case DType::bf16: launch_block_grad<bf16_t>(p, grid, stream); break;
    default: launch_block_grad<f16_t>(p, grid, stream); break;
  }
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
