// Elementwise ce gradient of a vocabulary block (linear_block_grad.cuh). Memory-bound: the tile is
// read once and written once, 16-byte vectors where rows are aligned; a block of threads covers one
// row segment, so per-row coefficients are formed once per segment (block_grad_tile.cuh).
#include "cuda/rows/ce_device.cuh"
#include "cuda/linear/linear_block_grad.cuh"
#include "cuda/rows/row_stats.cuh"

namespace xent::cuda {
namespace {

using CeBlockGradParams = BlockGradParams<BlockGradArgs>;

template <class S, bool kEntropy>
__global__ void __launch_bounds__(kBlockGradThreads) block_grad_kernel(const CeBlockGradParams p) {
  const BlockGradArgs& a = p.args;
  const CeRowOptions& o = a.options;
  const RowSegment segment = row_segment<S>(a.columns, p.segments_per_row);
  const int64_t row = segment.row, begin = segment.begin, length = segment.length;
  const S* x = static_cast<const S*>(a.logits) + row * a.logits_stride + begin;
  S* grad = static_cast<S*>(a.grad) + row * a.grad_stride + begin;
  const common::CeConstants<float> c = make_ce_constants(o, a.vocab, a.totals);
  const CeBlockRow r = ce_block_row<kEntropy>(a, row, c);
  if (!r.valid || !r.in_range) {
    fill_segment(grad, length, r.valid);
    return;
  }
  const int64_t target_column = r.target_column - begin;  // may lie outside the segment
  const bool weighted = o.class_weight != nullptr && c.smoothing > 0;
  const float* class_weight = weighted ? o.class_weight + a.first_column + begin : nullptr;

  with_transform(c.transform, [&](const auto& transform) {
    auto element = [&](int64_t i, float value) {
      const float w = class_weight ? class_weight[i] : 1.0f;
      return ce_block_grad<kEntropy>(r, transform, value, i == target_column, w);
    };
    write_segment(grad, length, p.vector_ok, element, x);
  });
}

template <class S>
void launch_block_grad(const CeBlockGradParams& p, dim3 grid, cudaStream_t stream) {
  if (p.args.grad_entropy != nullptr) {
    block_grad_kernel<S, true><<<grid, kBlockGradThreads, 0, stream>>>(p);
  } else {
    block_grad_kernel<S, false><<<grid, kBlockGradThreads, 0, stream>>>(p);
  }
}

template <bool kEntropy>
__global__ void __launch_bounds__(256)
    grad_records_kernel(const BlockGradArgs a, CeGradRecord* records) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= a.rows) return;
  const common::CeConstants<float> c = make_ce_constants(a.options, a.vocab, a.totals);
  records[row] = grad_record_of(ce_block_row<kEntropy>(a, row, c));
}

}  // namespace

void ce_grad_records(const BlockGradArgs& args, CeGradRecord* records, cudaStream_t stream) {
  if (args.rows <= 0) return;
  const unsigned blocks = static_cast<unsigned>((args.rows + 255) / 256);
  if (args.grad_entropy != nullptr) {
    grad_records_kernel<true><<<blocks, 256, 0, stream>>>(args, records);
  } else {
    grad_records_kernel<false><<<blocks, 256, 0, stream>>>(args, records);
  }
  XENT_CUDA_CHECK_LAUNCH();
}

void block_grad_from_lse(const BlockGradArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.columns <= 0) return;
  const std::size_t element = dtype_size(args.dtype);
  const CeBlockGradParams p =
      block_grad_params(args, rows_are_vector_aligned(args.logits, args.logits_stride, element) &&
                                  rows_are_vector_aligned(args.grad, args.grad_stride, element));
  const dim3 grid = block_grad_grid(p);
  switch (args.dtype) {
    case DType::f32:
      launch_block_grad<float>(p, grid, stream);
      break;
    case DType::bf16:
      launch_block_grad<bf16_t>(p, grid, stream);
      break;
    default:
      launch_block_grad<f16_t>(p, grid, stream);
      break;
  }
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
