// The CUDA distillation row kernel (docs/semantics.md §3): one cluster per row, student and teacher slices
// staged on chip once, then the sweeps of common/distill_row.hpp over shared memory: statistics;
// loss terms and the row sums the gradient needs (Σ p_s·u, or tvd's per-side sums); gradient,
// with the hard-label ce term fused in. forward_kl and soft_ce need no row sum before their
// gradient, so their loss and gradient share one sweep. On request the kernel exports the row's
// statistics (DistillRowStatistics), from which linear_distill forms the gradient of a
// vocabulary block later with the same per-element code (distill_element_grad). distill_rows
// hands the rows to the two-pass form (distill_two_pass.cuh) wherever it applies: the row kernel
// serves jsd and tvd with the hard-label term, and callers without room for the statistics.
#include <atomic>

#include "cuda/rows/ce_device.cuh"
#include "cuda/rows/distill_rows.cuh"
#include "cuda/rows/distill_two_pass.cuh"
#include "cuda/rows/row_kernel_counts.hpp"
#include "cuda/rows/row_slice.cuh"
#include "cuda/rows/row_stats.cuh"

namespace xent::cuda {
namespace {

using common::CeConstants;
using common::CeGradRow;
using common::DistillConstants;
using common::DistillKindCode;
using common::RowStats;

struct DistillKernelParams {
  DistillRowsArgs args;
  int cluster;
  int64_t slice_elements;
  bool staged;
  bool bulk;  // staged by bulk copies (Hopper paths), else by cp.async
  bool student_vector_ok;
  bool teacher_vector_ok;
  bool grad_vector_ok;
};

struct DistillPartial {
  RowStats<float> student;
  RowStats<float> teacher;
  RowStats<float> hard;  // ce statistics of the student (hard term only)
  float hard_target_logit;
};

struct DistillSums {
  float value[kDistillSums];
};
constexpr int kSums = kDistillSums;

struct DistillRowShared {
  DistillPartial stats;
  DistillSums sums;
  CeGradRow<float> hard_row;
  float soft_coef;
};

// One sweep over the slice: accumulates the loss sums (kLoss) and/or writes the gradient
// (kGrad) from the row constants in `row`. The kind is a template argument: with it fixed in the
// constants, the switches of common::distill_term_from_probs / distill_grad_from_probs fold away
// instead of running per element.
template <DistillKindCode kKind, bool kLoss, bool kGrad, class S, class Transform>
__device__ __forceinline__ void distill_sweep(
    const RowSlice<S>& student, const RowSlice<S>& teacher, const Transform& transform,
    DistillConstants<float> dc, const DistillGradRow& row, DistillSums& partial, bool with_hard,
    const CeConstants<float>& hc, const CeGradRow<float>& hard_row,
    const DistillHardColumns& hard_columns, S* grad, bool grad_vector_ok) {
  constexpr int kVec = kVectorElements<S>;
  dc.kind = kKind;
  const int vectors = static_cast<int>(student.vectors());
  for (int j = threadIdx.x; j < vectors; j += blockDim.x) {
    Vector<S> s = student.reload(j);  // sweep 1 waited on every piece this thread reads
    const Vector<S> t = teacher.reload(j);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int i = j * kVec + k;
      const float x = s.value[k];
      const ElementProbs e = element_probs(transform.value(x), transform.value(t.value[k]),
                                           row.lse_student, row.lse_teacher);
      if (kLoss && i < student.length) add_distill_sums<kKind>(dc, e, partial.value);
      if (kGrad) {
        s.value[k] = distill_element_grad<kKind>(dc, row, transform, x, e, with_hard, hc, hard_row,
                                                 hard_columns, i);
      }
    }
    if (kGrad) store_vector(grad, j, student.length, grad_vector_ok, s);
  }
}

template <class S>
__global__ void __launch_bounds__(kMaxThreads) distill_rows_kernel(const DistillKernelParams p) {
  extern __shared__ __align__(128) unsigned char dynamic_shared[];
  __shared__ uint64_t barriers[kMaxPieces];
  __shared__ SharedStorage<RowStats<float>[kMaxThreads / 32]> scratch_storage;
  __shared__ float sum_scratch[kSums * kMaxThreads / 32];
  __shared__ SharedStorage<DistillPartial> stats_slot_storage;
  __shared__ SharedStorage<DistillSums> sums_slot_storage;
  __shared__ SharedStorage<DistillRowShared> row_shared_storage;
  RowStats<float>* scratch = scratch_storage.get();
  DistillRowShared& row_shared = row_shared_storage.get();

  const DistillRowsArgs& a = p.args;
  const DistillRowOptions& o = a.options;
  const int rank = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.cluster));
  const int64_t row = blockIdx.x / static_cast<unsigned>(p.cluster);
  const int64_t begin = rank * p.slice_elements;
  const int64_t length =
      begin < a.vocab ? (a.vocab - begin < p.slice_elements ? a.vocab - begin : p.slice_elements)
                      : 0;
  const bool has_target = a.target != nullptr;
  const int64_t target = has_target ? read_target(a.target, a.target_dtype, row) : 0;
  const bool valid = !has_target || target != o.ce.ignore_index;
  const bool in_range = !has_target || (target >= 0 && target < a.vocab);
  S* grad = a.grad ? static_cast<S*>(a.grad) + row * a.grad_row_stride + begin : nullptr;

  if (!valid || !in_range) {
    // Ignored: zero loss and gradient. Out of range (flagged by the pre-pass): NaN, visibly.
    const float fill = valid ? quiet_nan() : 0.0f;
    if (rank == 0 && threadIdx.x == 0) {
      if (a.row_soft) a.row_soft[row] = fill;
      if (a.row_hard_loss) a.row_hard_loss[row] = fill;
      if (a.row_hard_z) a.row_hard_z[row] = fill;
      if (a.row_total) a.row_total[row] = fill;
    }
    if (a.statistics && rank == 0 && threadIdx.x == 0) a.statistics[row] = DistillRowStatistics{};
    if (grad) write_constant_row(grad, length, p.grad_vector_ok, fill);
    return;
  }

  const S* student_row = static_cast<const S*>(a.student) + row * a.student_row_stride + begin;
  const S* teacher_row = static_cast<const S*>(a.teacher) + row * a.teacher_row_stride + begin;
  S* staged_student = reinterpret_cast<S*>(dynamic_shared);
  S* staged_teacher = staged_student + p.slice_elements;
  const RowSlice<S> student = p.staged
                                  ? stage_slice(student_row, begin, length, p.student_vector_ok,
                                                staged_student, barriers, p.bulk)
                                  : stream_slice(student_row, begin, length, p.student_vector_ok);
  const RowSlice<S> teacher = p.staged
                                  ? stage_slice(teacher_row, begin, length, p.teacher_vector_ok,
                                                staged_teacher, barriers + kMaxPieces / 2, p.bulk)
                                  : stream_slice(teacher_row, begin, length, p.teacher_vector_ok);

  const DistillConstants<float> dc =
      common::make_distill_constants(o.kind, o.temperature, o.softcap, o.beta);
  const bool with_hard = o.hard_weight != 0.0 && has_target;
  const CeConstants<float> hc = make_ce_constants(o.ce, a.vocab, a.totals);
  const float* class_weight = o.ce.class_weight;

  // Sweep 1: row statistics of the student and teacher (and of the student for the ce term).
  RowStats<float> s_stats, t_stats, h_stats;
  with_distill_transform(dc.transform, [&](const auto& transform) {
    slice_pair_row_stats(student, teacher, transform, s_stats, t_stats);
  });
  if (with_hard) {
    with_transform(hc.transform, [&](const auto& transform) {
      h_stats = hc.smoothing > 0 ? slice_row_stats<true, false>(student, transform, class_weight)
                                 : slice_row_stats<false, false>(student, transform, class_weight);
    });
  }
  DistillPartial mine;
  mine.student = block_merge(s_stats, scratch);
  __syncthreads();
  mine.teacher = block_merge(t_stats, scratch);
  if (with_hard) {
    __syncthreads();
    mine.hard = block_merge(h_stats, scratch);
  }
  mine.hard_target_logit = 0.0f;
  if (threadIdx.x == 0 && with_hard && target >= begin && target < begin + length) {
    mine.hard_target_logit = hc.transform.value(student.element(target - begin));
  }
  cluster_exchange_pull(mine, &stats_slot_storage.get(), &row_shared.stats, p.cluster,
                        [](DistillPartial& into, const DistillPartial& other) {
                          into.student.merge(other.student);
                          into.teacher.merge(other.teacher);
                          into.hard.merge(other.hard);
                          into.hard_target_logit += other.hard_target_logit;
                        });
  const RowStats<float>& hs = row_shared.stats.hard;
  const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  const float r = a.row_weight ? a.row_weight[row] : 1.0f;
  const float target_weight = with_hard && class_weight ? class_weight[target] : 1.0f;
  if (threadIdx.x == 0 && a.grad) {
    row_shared.soft_coef = distill_soft_coef(o, a.totals, upstream);
    if (with_hard) {
      row_shared.hard_row =
          distill_hard_grad_row(o, hc, a.totals, hs.lse(), target, target_weight, upstream, r);
    }
  }
  __syncthreads();

  // Sweeps 2 and 3: loss terms and row sums, then the gradient; one sweep when the gradient
  // needs no row sum (forward_kl, soft_ce). Exported statistics need the row sums too.
  const bool want_loss = a.row_soft != nullptr || a.row_total != nullptr;
  const bool needs_row_sums = common::distill_needs_sum_pu(dc.kind);
  const bool loss_sweep = want_loss || ((a.grad || a.statistics) && needs_row_sums);
  const bool fused = a.grad && !needs_row_sums;
  DistillHardColumns hard_columns;  // columns of this slice
  hard_columns.target_column =
      with_hard && target >= begin && target < begin + length ? target - begin : -1;
  hard_columns.class_weight =
      with_hard && class_weight && hc.smoothing > 0 ? class_weight + student.begin : nullptr;
  hard_columns.columns = student.length;
  const CeGradRow<float> hard_row = with_hard ? row_shared.hard_row : CeGradRow<float>{};
  DistillGradRow grad_row;
  grad_row.lse_student = row_shared.stats.student.lse();
  grad_row.lse_teacher = row_shared.stats.teacher.lse();
  grad_row.soft_coef = a.grad ? row_shared.soft_coef : 0.0f;
  DistillSums partial{};
  with_distill_transform(dc.transform, [&](const auto& transform) {
    with_distill_kind(dc.kind, [&](auto kind) {
      constexpr DistillKindCode kKind = decltype(kind)::value;
      if constexpr (!common::distill_needs_sum_pu(kKind)) {  // forward_kl, soft_ce
        if (fused && want_loss) {
          distill_sweep<kKind, true, true>(student, teacher, transform, dc, grad_row, partial,
                                           with_hard, hc, hard_row, hard_columns, grad,
                                           p.grad_vector_ok);
          return;
        }
        if (fused) {
          distill_sweep<kKind, false, true>(student, teacher, transform, dc, grad_row, partial,
                                            with_hard, hc, hard_row, hard_columns, grad,
                                            p.grad_vector_ok);
          return;
        }
      }
      if (loss_sweep) {
        distill_sweep<kKind, true, false>(student, teacher, transform, dc, grad_row, partial,
                                          with_hard, hc, hard_row, hard_columns, grad,
                                          p.grad_vector_ok);
      }
    });
  });
  if (loss_sweep) {
    block_sum(partial.value, sum_scratch);
    cluster_exchange_pull(partial, &sums_slot_storage.get(), &row_shared.sums, p.cluster,
                          [](DistillSums& into, const DistillSums& other) {
#pragma unroll
                            for (int k = 0; k < kSums; ++k) into.value[k] += other.value[k];
                          });
    grad_row.sum_prob_u = row_shared.sums.value[1];
    common::TvdSums<float> tvd_sums;
    tvd_sums.above = row_shared.sums.value[2];
    tvd_sums.below = row_shared.sums.value[3];
    tvd_sums.equal = row_shared.sums.value[4];
    if (dc.kind == DistillKindCode::tvd) grad_row.tvd = common::tvd_grad_row(tvd_sums);
  }
  if (a.grad && !fused) {
    with_distill_transform(dc.transform, [&](const auto& transform) {
      with_distill_kind(dc.kind, [&](auto kind) {
        constexpr DistillKindCode kKind = decltype(kind)::value;
        if constexpr (common::distill_needs_sum_pu(kKind)) {  // reverse_kl, jsd, tvd
          distill_sweep<kKind, false, true>(student, teacher, transform, dc, grad_row, partial,
                                            with_hard, hc, hard_row, hard_columns, grad,
                                            p.grad_vector_ok);
        }
      });
    });
  }
  if (a.statistics && threadIdx.x == 0 && rank == 0) {
    DistillRowStatistics exported;
    exported.lse_student = grad_row.lse_student;
    exported.lse_teacher = grad_row.lse_teacher;
    if (loss_sweep) {
      exported.sum_prob_u = row_shared.sums.value[1];
      exported.tvd_above = row_shared.sums.value[2];
      exported.tvd_below = row_shared.sums.value[3];
      exported.tvd_equal = row_shared.sums.value[4];
    }
    exported.hard_lse = with_hard ? hs.lse() : 0.0f;
    a.statistics[row] = exported;
  }

  if (threadIdx.x == 0 && rank == 0) {
    const float soft = loss_sweep ? row_shared.sums.value[0] : 0.0f;
    float hard_loss = 0.0f, hard_z = 0.0f;
    if (with_hard) {
      const auto parts =
          common::ce_row_loss(hc, hs, hs.lse(), row_shared.stats.hard_target_logit, target_weight);
      hard_loss = r * parts.loss;
      hard_z = r * parts.z_loss;
    }
    if (a.row_soft) a.row_soft[row] = soft;
    if (a.row_hard_loss) a.row_hard_loss[row] = hard_loss;
    if (a.row_hard_z) a.row_hard_z[row] = hard_z;
    if (a.row_total) {
      double total = 0;
      if (o.soft_weight != 0.0) total += o.soft_weight * soft;
      if (o.hard_weight != 0.0) total += o.hard_weight * (double{hard_loss} + hard_z);
      a.row_total[row] = static_cast<float>(total);
    }
  }
  cluster_finish(p.cluster);
}

}  // namespace

DistillRowOptions distill_row_options(const DistillOptions& options) {
  DistillRowOptions o;
  o.kind = static_cast<common::DistillKindCode>(options.kind);
  o.temperature = static_cast<float>(options.temperature);
  o.beta = static_cast<float>(options.beta);
  o.softcap = options.softcap ? static_cast<float>(*options.softcap) : 0.0f;
  o.soft_weight = options.soft_weight;
  o.hard_weight = options.hard_weight;
  o.ce = ce_row_options(options.ce);
  return o;
}

namespace {
std::atomic<int64_t> wide_cluster_launches{0};
}  // namespace

int64_t distill_rows_wide_cluster_launches() { return wide_cluster_launches.load(); }

// The kernel instantiation for a dtype (the cluster query needs the function itself).
static const void* distill_kernel_of(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return reinterpret_cast<const void*>(distill_rows_kernel<float>);
    case DType::bf16:
      return reinterpret_cast<const void*>(distill_rows_kernel<bf16_t>);
    default:
      return reinterpret_cast<const void*>(distill_rows_kernel<f16_t>);
  }
}

void distill_rows(const DistillRowsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return;
  if (distill_two_pass_applies(args)) {
    distill_rows_two_pass(args, stream);
    return;
  }
  const std::size_t element = dtype_size(args.dtype);
  SlicePlan plan = plan_row_slices(args.vocab, element, 2);
  if (plan.cluster == kMaxCluster && plan.staged) {
    // Staged rows whose slices exceed the 64 KiB target in a cluster of 8 (two bf16 inputs of
    // more than 131072 columns): a cluster of 16 halves them, so two or three CTAs share a
    // multiprocessor instead of one (decision 65), where the device runs such clusters. Rows too
    // long to stage in a cluster of 8 keep streaming.
    const SlicePlan wider = plan_row_slices(args.vocab, element, 2, kMaxNonPortableCluster);
    if (wider.cluster > kMaxCluster && wider.staged &&
        row_kernel_max_cluster(distill_kernel_of(args.dtype), wider.cluster, wider.threads,
                               wider.shared_bytes) >= wider.cluster) {
      plan = wider;
      wide_cluster_launches.fetch_add(1, std::memory_order_relaxed);
    }
  }
  DistillKernelParams p{};
  p.args = args;
  p.cluster = plan.cluster;
  p.slice_elements = plan.slice_elements;
  p.staged = plan.staged;
  p.bulk = plan.hopper;
  p.student_vector_ok = rows_are_vector_aligned(args.student, args.student_row_stride, element);
  p.teacher_vector_ok = rows_are_vector_aligned(args.teacher, args.teacher_row_stride, element);
  p.grad_vector_ok =
      args.grad != nullptr && rows_are_vector_aligned(args.grad, args.grad_row_stride, element);
  switch (args.dtype) {
    case DType::f32:
      launch_row_kernel(distill_rows_kernel<float>, p, args.rows, plan, stream);
      break;
    case DType::bf16:
      launch_row_kernel(distill_rows_kernel<bf16_t>, p, args.rows, plan, stream);
      break;
    case DType::f16:
      launch_row_kernel(distill_rows_kernel<f16_t>, p, args.rows, plan, stream);
      break;
    default:
      throw Error(ErrorKind::invalid_argument,
                  std::string("distill_rows: student dtype unsupported on CUDA: got ") +
                      dtype_name(args.dtype) + "; expected float32, bfloat16 or float16");
  }
}

}  // namespace xent::cuda
