// Vocabulary-parallel distillation, CUDA backend (xent/distill_shard.hpp). No host
// synchronisation, CUDA-graph capturable; every kernel but the two below is another file's:
//   pass 1    distill_rows (distill_rows.cu) on the local slice as if it were the whole
//             vocabulary: it exports each row's two lse (DistillRowStatistics) and, as its row
//             loss, the divergence between the slice-renormalised distributions (forward_kl,
//             reverse_kl, soft_ce); distill_shard_pack_kernel copies both into the records. The
//             hard term's ce record comes from ce_shard_records (ce_shard.cu), strided into them.
//   pass 2    distill_shard_sums_kernel (jsd, tvd): a CTA per row sweeps the local slice with the
//             global lse merged from the gathered records (common/distill_shard.hpp).
//   merge     distill_shard_merge_kernel: one CTA over the N rows merges each row's P records
//             into its loss parts and the gradient's row constants (DistillRowStatistics, w_y)
//             and reduces N_valid, D, W into the CeBatchTotals that distill_reduce and the
//             gradient read (the role ce_batch_totals plays unsharded).
//   loss      distill_reduce (distill.cu).
//   gradient  distill_block_grad (linear_distill_block_grad.cu) with the slice's first column:
//             the elementwise gradient of a vocabulary block from per-row statistics.
// Workspace: [CeBatchTotals | statistics | row_soft | row_hard_loss | row_hard_z | target_weight].
#include <algorithm>

#include "api/shard_backend.hpp"
#include "common/distill_shard.hpp"
#include "cuda/rows/ce_device.cuh"
#include "cuda/shard/ce_shard.cuh"
#include "cuda/rows/distill_rows.cuh"
#include "cuda/shard/distill_shard.cuh"
#include "cuda/linear/linear_distill_block_grad.cuh"
#include "cuda/rows/row_slice.cuh"
#include "cuda/shard/shard_merge.cuh"

namespace xent::cuda {
namespace {

using common::DistillKindCode;

struct ShardWorkspace {
  CeBatchTotals* totals;
  DistillRowStatistics* statistics;
  float *row_soft, *row_hard_loss, *row_hard_z, *target_weight;
};

std::size_t aligned(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

ShardWorkspace carve(Workspace workspace, int64_t rows) {
  char* base = static_cast<char*>(workspace.data);
  const std::size_t statistics =
      aligned(static_cast<std::size_t>(rows) * sizeof(DistillRowStatistics));
  const std::size_t array = aligned(static_cast<std::size_t>(rows) * sizeof(float));
  auto at = [&](int k) { return reinterpret_cast<float*>(base + 256 + statistics + k * array); };
  return {reinterpret_cast<CeBatchTotals*>(base),
          reinterpret_cast<DistillRowStatistics*>(base + 256),
          at(0),
          at(1),
          at(2),
          at(3)};
}

float* f32(TensorView view) { return view.present() ? static_cast<float*>(view.data) : nullptr; }

bool with_hard_term(const DistillOptions& options, TensorView target) {
  return options.hard_weight != 0.0 && target.present();
}

// ---- pass 1 ----------------------------------------------------------------------------------------

__global__ void distill_shard_pack_kernel(const DistillRowStatistics* statistics,
                                          const float* divergence, float* records, int64_t rows,
                                          bool empty_slice, bool zero_hard) {
  for (int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; n < rows;
       n += int64_t{gridDim.x} * blockDim.x) {
    float* record = records + n * kDistillShardStatsWidth;
    const float lse_s = empty_slice ? -INFINITY : statistics[n].lse_student;
    const float lse_t = empty_slice ? -INFINITY : statistics[n].lse_teacher;
    record[kDistillShardLseStudent] = lse_s;
    record[kDistillShardLseTeacher] = lse_t;
    record[kDistillShardDivergence] = divergence && !empty_slice ? divergence[n] : 0.0f;
    record[kDistillShardReserved] = 0.0f;
    if (zero_hard) {
      for (int k = 0; k < kCeShardStatsWidth; ++k) record[kDistillShardHard + k] = 0.0f;
    }
  }
}

void launch_pack(const ShardWorkspace& ws, bool separable, float* records, int64_t rows,
                 bool empty_slice, bool zero_hard, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((rows + 255) / 256, 1024));
  distill_shard_pack_kernel<<<blocks, 256, 0, stream>>>(
      ws.statistics, separable ? ws.row_soft : nullptr, records, rows, empty_slice, zero_hard);
  XENT_CUDA_CHECK_LAUNCH();
}

// ---- pass 2 (jsd, tvd) -------------------------------------------------------------------------------

constexpr int kSumThreads = 256;

struct SumsParams {
  const void* student;
  const void* teacher;
  int64_t student_stride, teacher_stride, columns, rows, ranks;
  const void* target;  // or null
  DType target_dtype;
  DistillRowOptions options;
  const float* gathered;
  float* sums;
  bool vector_ok;
};

template <class S>
__global__ void __launch_bounds__(kSumThreads) distill_shard_sums_kernel(const SumsParams p) {
  constexpr int kVec = kVectorElements<S>;
  __shared__ float scratch[kDistillSums * kSumThreads / 32];
  __shared__ float lse[2];
  const int64_t row = blockIdx.x;
  const DistillRowOptions& o = p.options;
  float* out = p.sums + row * kDistillShardSumsWidth;
  if (p.target && read_target(p.target, p.target_dtype, row) == o.ce.ignore_index) {
    if (threadIdx.x < kDistillShardSumsWidth) out[threadIdx.x] = 0.0f;
    return;
  }
  if (threadIdx.x == 0) common::merge_distill_lse(p.gathered, p.rows, p.ranks, row, lse[0], lse[1]);
  __syncthreads();
  const float lse_s = lse[0], lse_t = lse[1];
  const S* student = static_cast<const S*>(p.student) + row * p.student_stride;
  const S* teacher = static_cast<const S*>(p.teacher) + row * p.teacher_stride;
  const common::DistillConstants<float> dc =
      common::make_distill_constants(o.kind, o.temperature, o.softcap, o.beta);
  float sums[kDistillSums] = {};
  with_distill_transform(dc.transform, [&](const auto& transform) {
    with_distill_kind(dc.kind, [&](auto kind) {
      constexpr DistillKindCode kKind = decltype(kind)::value;
      if constexpr (common::distill_needs_sum_pu(kKind) && kKind != DistillKindCode::reverse_kl) {
        auto add = [&](float x, float t) {
          add_distill_sums<kKind>(
              dc, element_probs(transform.value(x), transform.value(t), lse_s, lse_t), sums);
        };
        const int64_t columns = p.columns;
        if (p.vector_ok) {
          for (int64_t j = threadIdx.x; j * kVec < columns; j += kSumThreads) {
            if ((j + 1) * kVec <= columns) {
              const Vector<S> s = unpack<S>(__ldg(reinterpret_cast<const uint4*>(student) + j));
              const Vector<S> t = unpack<S>(__ldg(reinterpret_cast<const uint4*>(teacher) + j));
#pragma unroll
              for (int k = 0; k < kVec; ++k) add(s.value[k], t.value[k]);
            } else {
              for (int64_t i = j * kVec; i < columns; ++i)
                add(load_float(student[i]), load_float(teacher[i]));
            }
          }
        } else {
          for (int64_t i = threadIdx.x; i < columns; i += kSumThreads) {
            add(load_float(student[i]), load_float(teacher[i]));
          }
        }
      }
    });
  });
  block_sum(sums, scratch);
  if (threadIdx.x == 0) {
    for (int k = 0; k < kDistillShardSumsWidth; ++k) out[k] = sums[k];
  }
}

// ---- merge of the gathered records ---------------------------------------------------------------

constexpr int kMergeThreads = kShardMergeThreads;

struct MergeParams {
  const float* gathered;
  const float* gathered_sums;  // jsd, tvd
  int64_t rows, ranks, vocab;
  const void* target;  // or null
  DType target_dtype;
  DistillRowOptions options;
  const float* row_weight;   // hard term, or null
  const float* grad_output;  // scalar of sum/mean, or null
  bool with_hard;
  OpCode op;
  DeviceErrorState* error;  // where an out-of-range target is recorded
  // Outputs (null: not wanted).
  CeBatchTotals* totals;
  DistillRowStatistics* statistics;
  float *row_soft, *row_hard_loss, *row_hard_z, *row_total, *target_weight;
};

__global__ void __launch_bounds__(kMergeThreads) distill_shard_merge_kernel(const MergeParams p) {
  __shared__ ShardMergeReduce::TempStorage reduce_storage;
  const DistillRowOptions& o = p.options;
  const auto kind = o.kind;
  common::CeConstants<float> hard_constants;
  hard_constants.transform.scale = o.ce.logit_scale;
  hard_constants.transform.softcap = o.ce.softcap;
  hard_constants.smoothing = o.ce.label_smoothing;
  hard_constants.z_loss = o.ce.z_loss;
  double valid = 0, divisor = 0;
  long long first_bad = LLONG_MAX;
  for (int64_t n = threadIdx.x; n < p.rows; n += kMergeThreads) {
    const int64_t y = p.target ? read_target(p.target, p.target_dtype, n) : 0;
    const bool is_valid = !p.target || y != o.ce.ignore_index;
    const bool in_range = !p.target || (y >= 0 && y < p.vocab);
    DistillRowStatistics stats{};
    float soft = 0, hard_loss = 0, hard_z = 0, target_weight = 0;
    if (is_valid) {
      valid += 1;
      if (!in_range) {
        soft = hard_loss = hard_z = quiet_nan();
        if (n < first_bad) first_bad = n;
      } else {
        const auto m =
            common::merge_distill_records(kind, p.gathered, p.gathered_sums, p.rows, p.ranks, n);
        stats.lse_student = m.lse_student;
        stats.lse_teacher = m.lse_teacher;
        stats.sum_prob_u = m.sum_prob_u;
        stats.tvd_above = m.tvd.above;
        stats.tvd_below = m.tvd.below;
        stats.tvd_equal = m.tvd.equal;
        soft = m.soft;
        target_weight = 1.0f;
        if (p.with_hard) {
          const auto h = common::merge_distill_hard(p.gathered, p.rows, p.ranks, n);
          target_weight = h.target_weight;
          stats.hard_lse = h.stats.lse();
          const auto c = common::shard_constants(hard_constants, p.vocab, h.class_weight_sum);
          const auto parts =
              common::ce_row_loss(c, h.stats, stats.hard_lse, h.target_logit, h.target_weight);
          const float r = p.row_weight ? p.row_weight[n] : 1.0f;
          hard_loss = r * parts.loss;
          hard_z = r * parts.z_loss;
        }
        divisor += target_weight;
      }
    }
    if (p.statistics) p.statistics[n] = stats;
    if (p.row_soft) p.row_soft[n] = soft;
    if (p.row_hard_loss) p.row_hard_loss[n] = hard_loss;
    if (p.row_hard_z) p.row_hard_z[n] = hard_z;
    if (p.target_weight) p.target_weight[n] = target_weight;
    if (p.row_total) {  // a term whose weight is 0 is left out (its NaN cannot matter)
      double total = 0;
      if (o.soft_weight != 0.0) total += o.soft_weight * soft;
      if (o.hard_weight != 0.0 && p.with_hard)
        total += o.hard_weight * (double{hard_loss} + hard_z);
      p.row_total[n] = static_cast<float>(total);
    }
  }
  // W rides in every row's hard record (ignored rows included): row 0's is the batch's.
  const float class_weight_sum =
      p.with_hard && p.rows > 0
          ? common::merge_distill_hard(p.gathered, p.rows, p.ranks, 0).class_weight_sum
          : static_cast<float>(p.vocab);
  const ShardMergeBatch batch{o.ce.reduction, class_weight_sum, p.grad_output,     p.target,
                              p.target_dtype, p.vocab,          o.ce.ignore_index, p.op,
                              p.error};
  finish_shard_merge(valid, divisor, first_bad, batch, p.totals, reduce_storage);
}

}  // namespace

void distill_merge_records(const DistillMergeRequest& request, const DistillMergeOutputs& out,
                           cudaStream_t stream) {
  MergeParams p{};
  p.gathered = request.records;
  p.gathered_sums = request.sums;
  p.rows = request.rows;
  p.ranks = request.ranks;
  p.vocab = request.vocab;
  p.target = request.target.present() ? request.target.data : nullptr;
  p.target_dtype = request.target.dtype;
  p.options = distill_row_options(request.options);
  p.row_weight = f32(request.options.ce.row_weight);
  p.grad_output = request.grad_output;
  p.with_hard = with_hard_term(request.options, request.target);
  p.op = request.op;
  p.error = device_error_state();
  p.totals = out.totals;
  p.statistics = out.statistics;
  p.row_soft = out.row_soft;
  p.row_hard_loss = out.row_hard_loss;
  p.row_hard_z = out.row_hard_z;
  p.row_total = out.row_total;
  p.target_weight = out.target_weight;
  distill_shard_merge_kernel<<<1, kMergeThreads, 0, stream>>>(p);
  XENT_CUDA_CHECK_LAUNCH();
}

namespace {

DistillMergeRequest merge_request(TensorView gathered, TensorView gathered_sums, TensorView target,
                                  int64_t rows, VocabShard shard, const DistillOptions& options,
                                  OpCode op) {
  return DistillMergeRequest{static_cast<const float*>(gathered.data),
                             f32(gathered_sums),
                             rows,
                             rows > 0 ? gathered.rows / rows : 0,
                             shard.vocab,
                             target,
                             options,
                             nullptr,
                             op};
}

}  // namespace

std::size_t distill_shard_workspace_size(int64_t rows) {
  return 256 + aligned(static_cast<std::size_t>(rows) * sizeof(DistillRowStatistics)) +
         4 * aligned(static_cast<std::size_t>(rows) * sizeof(float));
}

void distill_shard_stats(TensorView student, TensorView teacher, TensorView target,
                         VocabShard shard, const DistillOptions& options, TensorView partial,
                         Workspace workspace, Stream stream) {
  if (student.rows <= 0) return;
  DeviceGuard guard(student.device.index);
  const cudaStream_t s = stream_of(stream);
  const ShardWorkspace ws = carve(workspace, student.rows);
  const bool separable = !distill_shard_needs_sums(options.kind);
  const bool with_hard = with_hard_term(options, target);
  const bool empty_slice = student.cols == 0;
  if (!empty_slice) {
    // The slice alone, as a whole vocabulary: no target (every row; ignored ones are skipped by
    // the merge), no hard term, reduction none. It reads the totals' upstream only.
    XENT_CUDA_CHECK(cudaMemsetAsync(ws.totals, 0, sizeof(CeBatchTotals), s));
    // jsd and tvd need only the two lse here: as forward_kl without a row loss, the kernel
    // skips its loss sweep (a jsd one would form a log and two exponentials per element).
    DistillOptions local;
    local.kind = separable ? options.kind : DistillKind::forward_kl;
    local.temperature = options.temperature;
    local.beta = options.beta;
    local.softcap = options.softcap;
    local.ce.reduction = Reduction::none;
    DistillRowsArgs a;
    a.student = student.data;
    a.student_row_stride = student.row_stride;
    a.teacher = teacher.data;
    a.teacher_row_stride = teacher.row_stride;
    a.dtype = student.dtype;
    a.rows = student.rows;
    a.vocab = student.cols;
    a.options = distill_row_options(local);
    a.totals = ws.totals;
    a.row_soft = separable ? ws.row_soft : nullptr;  // the slice's divergence
    a.statistics = ws.statistics;
    distill_rows(a, s);
  }
  float* records = static_cast<float*>(partial.data);
  launch_pack(ws, separable, records, student.rows, empty_slice, !with_hard, s);
  if (with_hard) {
    ce_shard_records(student, target, shard, options.ce, records + kDistillShardHard,
                     kDistillShardStatsWidth, s);
  }
}

void distill_shard_sums(TensorView student, TensorView teacher, TensorView target, VocabShard,
                        TensorView gathered, const DistillOptions& options, TensorView sums,
                        Workspace, Stream stream) {
  if (student.rows <= 0) return;
  DeviceGuard guard(student.device.index);
  const std::size_t element = dtype_size(student.dtype);
  SumsParams p{};
  p.student = student.data;
  p.teacher = teacher.data;
  p.student_stride = student.row_stride;
  p.teacher_stride = teacher.row_stride;
  p.columns = student.cols;
  p.rows = student.rows;
  p.ranks = gathered.rows / student.rows;
  p.target = target.present() ? target.data : nullptr;
  p.target_dtype = target.dtype;
  p.options = distill_row_options(options);
  p.gathered = static_cast<const float*>(gathered.data);
  p.sums = static_cast<float*>(sums.data);
  p.vector_ok = rows_are_vector_aligned(student.data, student.row_stride, element) &&
                rows_are_vector_aligned(teacher.data, teacher.row_stride, element);
  const cudaStream_t s = stream_of(stream);
  const dim3 grid(static_cast<unsigned>(student.rows));
  switch (student.dtype) {
    case DType::f32:
      distill_shard_sums_kernel<float><<<grid, kSumThreads, 0, s>>>(p);
      break;
    case DType::bf16:
      distill_shard_sums_kernel<bf16_t><<<grid, kSumThreads, 0, s>>>(p);
      break;
    default:
      distill_shard_sums_kernel<f16_t><<<grid, kSumThreads, 0, s>>>(p);
      break;
  }
  XENT_CUDA_CHECK_LAUNCH();
}

void distill_shard_loss(TensorView gathered, TensorView gathered_sums, TensorView target,
                        int64_t rows, VocabShard shard, const DistillOptions& options,
                        TensorView loss, Workspace workspace, Stream stream) {
  DeviceGuard guard(gathered.device.index);
  const cudaStream_t s = stream_of(stream);
  const ShardWorkspace ws = carve(workspace, rows);
  const bool none = options.ce.reduction == Reduction::none;
  const bool with_hard = with_hard_term(options, target);
  DistillMergeOutputs out;
  out.totals = ws.totals;
  out.row_soft = ws.row_soft;
  out.row_hard_loss = with_hard ? ws.row_hard_loss : nullptr;
  out.row_hard_z = with_hard ? ws.row_hard_z : nullptr;
  out.row_total = none ? f32(loss) : nullptr;
  distill_merge_records(
      merge_request(gathered, gathered_sums, target, rows, shard, options, OpCode::distill_forward),
      out, s);
  if (none) return;
  DistillReduceArgs r;
  r.rows = rows;
  r.reduction = options.ce.reduction;
  r.soft_weight = options.soft_weight;
  r.hard_weight = options.hard_weight;
  r.row_soft = ws.row_soft;
  r.row_hard_loss = out.row_hard_loss;
  r.row_hard_z = out.row_hard_z;
  r.totals = ws.totals;
  r.loss = f32(loss);
  distill_reduce(r, s);
}

void distill_shard_backward(TensorView student, TensorView teacher, TensorView target,
                            VocabShard shard, TensorView gathered, TensorView gathered_sums,
                            TensorView grad_output, const DistillOptions& options,
                            TensorView grad_student, Workspace workspace, Stream stream) {
  DeviceGuard guard(student.device.index);
  const cudaStream_t s = stream_of(stream);
  const int64_t rows = student.rows;
  const ShardWorkspace ws = carve(workspace, rows);
  const bool none = options.ce.reduction == Reduction::none;
  DistillMergeRequest request = merge_request(gathered, gathered_sums, target, rows, shard, options,
                                              OpCode::distill_backward);
  request.grad_output = none ? nullptr : f32(grad_output);
  DistillMergeOutputs out;
  out.totals = ws.totals;
  out.statistics = ws.statistics;
  out.target_weight = ws.target_weight;
  distill_merge_records(request, out, s);

  DistillBlockGradArgs a;
  a.student = student.data;
  a.student_stride = student.row_stride;
  a.teacher = teacher.data;
  a.teacher_stride = teacher.row_stride;
  a.grad = grad_student.data;
  a.grad_stride = grad_student.row_stride;
  a.dtype = student.dtype;
  a.rows = rows;
  a.columns = student.cols;
  a.first_column = shard.offset;
  a.vocab = shard.vocab;
  a.target = target.present() ? target.data : nullptr;
  a.target_dtype = target.dtype;
  a.statistics = ws.statistics;
  a.row_weight = f32(options.ce.row_weight);
  a.grad_output_rows = none ? f32(grad_output) : nullptr;
  a.options = distill_row_options(options);
  a.totals = ws.totals;
  a.class_weight_first_column = shard.offset;
  a.target_weight = with_hard_term(options, target) ? ws.target_weight : nullptr;
  distill_block_grad(a, s);
}

}  // namespace xent::cuda
