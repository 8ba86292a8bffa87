// Elementwise distillation gradient of a vocabulary block (linear_distill_block_grad.cuh); also
// the gradient of a rank's slice in vocabulary-parallel distill (distill_shard.cu).
// Memory-bound: the student and teacher tiles are read once and the gradient written once, in
// 16-byte vectors where rows are aligned; a block of threads covers one row segment, so the
// per-row constants (three divisions for tvd, the hard term's coefficients) are formed once per
// segment (block_grad_tile.cuh), and the kind and transform are resolved at compile time as in the
// row kernel.
#include "cuda/linear/linear_distill_block_grad.cuh"

namespace xent::cuda {
namespace {

using DistillBlockGradParams = BlockGradParams<DistillBlockGradArgs>;

template <class S>
__global__ void __launch_bounds__(kBlockGradThreads)
    distill_block_grad_kernel(const DistillBlockGradParams p) {
  const DistillBlockGradArgs& a = p.args;
  const DistillRowOptions& o = a.options;
  const RowSegment segment = row_segment<S>(a.columns, p.segments_per_row);
  const int64_t row = segment.row, begin = segment.begin, length = segment.length;
  const S* student = static_cast<const S*>(a.student) + row * a.student_stride + begin;
  const S* teacher = static_cast<const S*>(a.teacher) + row * a.teacher_stride + begin;
  S* grad = static_cast<S*>(a.grad) + row * a.grad_stride + begin;
  const bool has_target = a.target != nullptr;
  const int64_t target = has_target ? read_target(a.target, a.target_dtype, row) : 0;
  const bool valid = !has_target || target != o.ce.ignore_index;
  const bool in_range = !has_target || (target >= 0 && target < a.vocab);
  if (!valid || !in_range) {
    fill_segment(grad, length, valid);
    return;
  }

  const common::DistillConstants<float> dc =
      common::make_distill_constants(o.kind, o.temperature, o.softcap, o.beta);
  const common::CeConstants<float> hc = make_ce_constants(o.ce, a.vocab, a.totals);
  const bool with_hard = o.hard_weight != 0.0 && has_target;
  const DistillRowStatistics stats = a.statistics[row];
  const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  DistillGradRow grad_row;
  grad_row.lse_student = stats.lse_student;
  grad_row.lse_teacher = stats.lse_teacher;
  grad_row.sum_prob_u = stats.sum_prob_u;
  if (dc.kind == common::DistillKindCode::tvd) {
    common::TvdSums<float> sums;
    sums.above = stats.tvd_above;
    sums.below = stats.tvd_below;
    sums.equal = stats.tvd_equal;
    grad_row.tvd = common::tvd_grad_row(sums);
  }
  grad_row.soft_coef = distill_soft_coef(o, a.totals, upstream);
  common::CeGradRow<float> hard_row{};
  if (with_hard) {
    const float r = a.row_weight ? a.row_weight[row] : 1.0f;
    const float target_weight = a.target_weight     ? a.target_weight[row]
                                : o.ce.class_weight ? o.ce.class_weight[target]
                                                    : 1.0f;
    hard_row =
        distill_hard_grad_row(o, hc, a.totals, stats.hard_lse, target, target_weight, upstream, r);
  }
  DistillHardColumns hard_columns;                               // columns of this segment
  hard_columns.target_column = target - a.first_column - begin;  // may lie outside the segment
  hard_columns.class_weight =
      with_hard && o.ce.class_weight && hc.smoothing > 0
          ? o.ce.class_weight + (a.first_column - a.class_weight_first_column) + begin
          : nullptr;
  hard_columns.columns = length;

  with_distill_transform(dc.transform, [&](const auto& transform) {
    with_distill_kind(dc.kind, [&](auto kind) {
      constexpr common::DistillKindCode kKind = decltype(kind)::value;
      auto element = [&](int64_t i, float x, float t) {
        const ElementProbs e = element_probs(transform.value(x), transform.value(t),
                                             grad_row.lse_student, grad_row.lse_teacher);
        return distill_element_grad<kKind>(dc, grad_row, transform, x, e, with_hard, hc, hard_row,
                                           hard_columns, i);
      };
      write_segment(grad, length, p.vector_ok, element, student, teacher);
    });
  });
}

}  // namespace

void distill_block_grad(const DistillBlockGradArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.columns <= 0) return;
  const std::size_t element = dtype_size(args.dtype);
  const DistillBlockGradParams p = block_grad_params(
      args, rows_are_vector_aligned(args.student, args.student_stride, element) &&
                rows_are_vector_aligned(args.teacher, args.teacher_stride, element) &&
                rows_are_vector_aligned(args.grad, args.grad_stride, element));
  const dim3 grid = block_grad_grid(p);
  switch (args.dtype) {
    case DType::f32:
      distill_block_grad_kernel<float><<<grid, kBlockGradThreads, 0, stream>>>(p);
      break;
    case DType::bf16:
      distill_block_grad_kernel<bf16_t><<<grid, kBlockGradThreads, 0, stream>>>(p);
      break;
    default:
      distill_block_grad_kernel<f16_t><<<grid, kBlockGradThreads, 0, stream>>>(p);
      break;
  }
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace xent::cuda
