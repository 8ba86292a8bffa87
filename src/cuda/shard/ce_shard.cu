// Vocabulary-parallel ce pieces, CUDA backend (xent/shard.hpp). Three kernels, no host
// synchronisation, CUDA-graph capturable:
//   ce_shard_stats_kernel   one cluster per row over the local slice, streamed (the slice is read
//                           once here and once more by the gradient: staging would buy nothing),
//                           with the row-statistics sweep and merges of the ce row kernel
//                           (row_stats.cuh, row_slice.cuh); thread 0 writes the partial record.
//   ce_shard_merge_kernel   one CTA over the N rows: merges each row's P gathered records
//                           (common/ce_shard.hpp), writes the per-row loss parts and statistics
//                           and reduces N_valid, D into the CeBatchTotals that ce_reduce and the
//                           gradient kernel read (the role ce_batch_totals plays unsharded).
//   ce_grad_from_lse        the ce gradient kernel with the slice's offset (ce_grad.cu).
// Workspace: [CeBatchTotals | row_loss | row_z_loss | row_correct | lse | target_weight], N each.
#include "api/shard_backend.hpp"
#include "common/ce_shard.hpp"
#include "cuda/rows/ce_device.cuh"
#include "cuda/shard/ce_shard.cuh"
#include "cuda/rows/ce_grad.cuh"
#include "cuda/rows/row_slice.cuh"
#include "cuda/rows/row_stats.cuh"
#include "cuda/shard/shard_merge.cuh"

namespace xent::cuda {
namespace {

using common::RowStats;
using common::ShardPartial;

// ---- pass 1: partial records of the local slice --------------------------------------------------

struct StatsParams {
  CeRowsArgs rows;  // logits (vocab: the local columns), target, options
  int64_t offset;
  float* partial;
  int64_t record_stride;  // floats from one row's record to the next (a ce record may sit in a
                          // wider one: the hard term of a distill record, ce_shard.cuh)
  int cluster;
  int64_t slice_elements;
  bool vector_ok;
};

template <class S>
__global__ void __launch_bounds__(kMaxThreads) ce_shard_stats_kernel(const StatsParams p) {
  __shared__ SharedStorage<RowStats<float>[kMaxThreads / 32]> warp_scratch_storage;
  __shared__ SharedStorage<ShardPartial<float>[kMaxCluster]> slot_storage;
  __shared__ SharedStorage<ShardPartial<float>> merged_storage;
  __shared__ float weight_scratch[32];
  cluster_arrive_started(p.cluster);
  const int rank = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.cluster));
  const int64_t row = blockIdx.x / static_cast<unsigned>(p.cluster);
  const CeRowsArgs& a = p.rows;
  const int64_t begin = rank * p.slice_elements;
  const int64_t length =
      begin < a.vocab ? (a.vocab - begin < p.slice_elements ? a.vocab - begin : p.slice_elements)
                      : 0;
  const CeRowOptions& o = a.options;
  const S* row_logits = static_cast<const S*>(a.logits) + row * a.row_stride + begin;
  const RowSlice<S> slice = stream_slice(row_logits, begin, length, p.vector_ok, true);
  common::Transform<float> t;
  t.scale = o.logit_scale;
  t.softcap = o.softcap;
  RowStats<float> stats;
  // Every field of the record, always: whether the caller wants the entropy or the argmax is
  // decided after the gather, and this pass is bound by its one HBM read.
  with_transform(t, [&](const auto& transform) {
    // Records always carry both sums (the merge runs the weighted form, common/ce_shard.hpp).
    stats = slice_row_stats<true, true>(slice, transform, o.class_weight, true, false);
  });
  ShardPartial<float> mine;
  mine.stats = block_merge(stats, warp_scratch_storage.get());
  // Σ w over this CTA's columns (the slice's share of W); its width without class weights.
  float weight_sum[1] = {0.0f};
  if (o.class_weight) {
    for (int64_t i = threadIdx.x; i < length; i += blockDim.x)
      weight_sum[0] += o.class_weight[begin + i];
  }
  block_sum(weight_sum, weight_scratch);
  if (threadIdx.x == 0) {
    mine.class_weight_sum = o.class_weight ? weight_sum[0] : static_cast<float>(length);
    const int64_t y = read_target(a.target, a.target_dtype, row);
    const int64_t local = y - p.offset;
    if (y != o.ignore_index && local >= begin && local < begin + length) {
      mine.target_logit = t.value(slice.element(local - begin));
      mine.target_weight = o.class_weight ? o.class_weight[local] : 1.0f;
    }
  }
  cluster_exchange(mine, slot_storage.get(), &merged_storage.get(), p.cluster,
                   ClusterPhase::first_exchange,
                   [](ShardPartial<float>& into, const ShardPartial<float>& other) {
                     into.stats.merge(other.stats);
                     into.target_logit += other.target_logit;
                     into.target_weight += other.target_weight;
                     into.class_weight_sum += other.class_weight_sum;
                   });
  if (threadIdx.x == 0 && rank == 0) {
    ShardPartial<float> record = merged_storage.get();
    if (record.stats.argmax >= 0) record.stats.argmax += p.offset;
    common::write_shard_record(p.partial + row * p.record_stride, record);
  }
}

// ---- merge of the gathered records -----------------------------------------------------------

struct MergeParams {
  const float* gathered;
  int64_t rows, ranks, vocab;
  const void* target;
  DType target_dtype;
  CeRowOptions options;
  const float* row_weight;
  const float* grad_output;  // scalar of sum/mean, or null
  OpCode op;
  DeviceErrorState* error;  // where an out-of-range target is recorded
  // Outputs (null: not wanted): the per-row outputs of the ce row kernel (bind_ce_outputs),
  // the totals, and lse and w_y of every row for the gradient.
  CeRowsArgs out;
  CeBatchTotals* totals;
  float *lse, *target_weight;
};

constexpr int kMergeThreads = kShardMergeThreads;

__global__ void __launch_bounds__(kMergeThreads) ce_shard_merge_kernel(const MergeParams p) {
  __shared__ ShardMergeReduce::TempStorage reduce_storage;
  const CeRowOptions& o = p.options;
  double valid = 0, divisor = 0;
  long long first_bad = LLONG_MAX;
  // W (the class-weight sum) is the same in every row's record; thread 0 takes it from row 0,
  // its own first row, and is the only thread that reads the batch. A register, not shared
  // memory: other threads never need it (a shared copy raced with their reads of the batch).
  float weight_sum = static_cast<float>(p.vocab);
  for (int64_t n = threadIdx.x; n < p.rows; n += kMergeThreads) {
    const ShardPartial<float> m = common::merge_shard_records(p.gathered, p.rows, p.ranks, n);
    if (n == 0) weight_sum = m.class_weight_sum;
    const int64_t y = read_target(p.target, p.target_dtype, n);
    const bool is_valid = y != o.ignore_index;
    const bool in_range = y >= 0 && y < p.vocab;
    const RowStats<float>& s = m.stats;
    const float lse = s.lse();
    const CeRowsArgs& rows_out = p.out;
    if (rows_out.entropy) {
      rows_out.entropy[n] = is_valid ? s.entropy() : common::IgnoredRow<float>::entropy;
    }
    float loss = 0, z = 0, logprob = 0, out_lse = 0, correct = 0;
    int64_t arg = -1;
    if (is_valid) {
      valid += 1;
      loss = z = logprob = quiet_nan();
      if (in_range) {
        divisor += m.target_weight;
        common::CeConstants<float> c;
        c.transform.scale = o.logit_scale;
        c.transform.softcap = o.softcap;
        c.smoothing = o.label_smoothing;
        c.z_loss = o.z_loss;
        c = common::shard_constants(c, p.vocab, m.class_weight_sum);
        const auto parts = common::ce_row_loss(c, s, lse, m.target_logit, m.target_weight);
        const float r = p.row_weight ? p.row_weight[n] : 1.0f;
        loss = r * parts.loss;
        z = r * parts.z_loss;
        logprob = m.target_logit - lse;
      } else if (n < first_bad) {
        first_bad = n;
      }
      out_lse = lse;
      arg = s.argmax;
      correct = s.argmax == y ? 1.0f : 0.0f;
    }
    if (rows_out.row_loss) rows_out.row_loss[n] = loss;
    if (rows_out.row_z_loss) rows_out.row_z_loss[n] = z;
    if (rows_out.row_total) rows_out.row_total[n] = loss + z;
    if (rows_out.row_correct) rows_out.row_correct[n] = correct;
    if (rows_out.lse) rows_out.lse[n] = out_lse;
    if (rows_out.logprob) rows_out.logprob[n] = logprob;
    if (rows_out.argmax) rows_out.argmax[n] = arg;
    if (p.lse) p.lse[n] = lse;
    if (p.target_weight) p.target_weight[n] = is_valid && in_range ? m.target_weight : 0.0f;
  }
  const ShardMergeBatch batch{o.reduction, weight_sum,     p.grad_output, p.target, p.target_dtype,
                              p.vocab,     o.ignore_index, p.op,          p.error};
  finish_shard_merge(valid, divisor, first_bad, batch, p.totals, reduce_storage);
}

struct ShardWorkspace {
  CeBatchTotals* totals;
  float *row_loss, *row_z_loss, *row_correct, *lse, *target_weight;
};

std::size_t array_bytes(int64_t rows) {
  return (static_cast<std::size_t>(rows) * sizeof(float) + 255) / 256 * 256;
}

ShardWorkspace carve(Workspace workspace, int64_t rows) {
  char* base = static_cast<char*>(workspace.data);
  const std::size_t array = array_bytes(rows);
  auto at = [&](int k) { return reinterpret_cast<float*>(base + 256 + k * array); };
  return {reinterpret_cast<CeBatchTotals*>(base), at(0), at(1), at(2), at(3), at(4)};
}

float* f32(TensorView view) { return view.present() ? static_cast<float*>(view.data) : nullptr; }

MergeParams merge_params(TensorView gathered, TensorView target, VocabShard shard,
                         const CeOptions& options, const ShardWorkspace& ws) {
  MergeParams p{};
  p.gathered = static_cast<const float*>(gathered.data);
  p.rows = target.rows;
  p.ranks = target.rows > 0 ? gathered.rows / target.rows : 0;
  p.vocab = shard.vocab;
  p.target = target.data;
  p.target_dtype = target.dtype;
  p.options = ce_row_options(options);
  p.row_weight = f32(options.row_weight);
  p.totals = ws.totals;
  p.lse = ws.lse;
  p.target_weight = ws.target_weight;
  return p;
}

void launch_merge(MergeParams p, cudaStream_t stream) {
  p.error = device_error_state();
  ce_shard_merge_kernel<<<1, kMergeThreads, 0, stream>>>(p);
  XENT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void ce_shard_records(TensorView logits, TensorView target, VocabShard shard,
                      const CeOptions& options, float* records, int64_t record_stride,
                      cudaStream_t stream) {
  if (logits.rows <= 0) return;
  DeviceGuard guard(logits.device.index);
  const std::size_t element = dtype_size(logits.dtype);
  SlicePlan plan = plan_row_slices(logits.cols, element, 1);
  plan.staged = false;  // read once in this pass: nothing to keep on chip
  plan.shared_bytes = 0;
  StatsParams p{};
  p.rows = ce_rows_args(logits, target, options, nullptr);
  p.offset = shard.offset;
  p.partial = records;
  p.record_stride = record_stride;
  p.cluster = plan.cluster;
  p.slice_elements = plan.slice_elements;
  p.vector_ok = rows_are_vector_aligned(logits.data, logits.row_stride, element);
  switch (logits.dtype) {
    case DType::f32:
      launch_row_kernel(ce_shard_stats_kernel<float>, p, logits.rows, plan, stream);
      break;
    case DType::bf16:
      launch_row_kernel(ce_shard_stats_kernel<bf16_t>, p, logits.rows, plan, stream);
      break;
    case DType::f16:
      launch_row_kernel(ce_shard_stats_kernel<f16_t>, p, logits.rows, plan, stream);
      break;
    default:
      throw Error(ErrorKind::invalid_argument,
                  std::string("ce_shard_stats: logits dtype unsupported on CUDA: got ") +
                      dtype_name(logits.dtype) + "; expected float32, bfloat16 or float16");
  }
}

void ce_shard_stats(TensorView logits, TensorView target, VocabShard shard,
                    const CeOptions& options, TensorView partial, Stream stream) {
  ce_shard_records(logits, target, shard, options, static_cast<float*>(partial.data),
                   kCeShardStatsWidth, stream_of(stream));
}

std::size_t ce_shard_workspace_size(int64_t rows) { return 256 + 5 * array_bytes(rows); }

void ce_shard_finish(TensorView gathered, TensorView target, VocabShard shard,
                     const CeOptions& options, const CeOutputs& out, Workspace workspace, OpCode op,
                     cudaStream_t stream) {
  const int64_t rows = target.rows;
  const ShardWorkspace ws = carve(workspace, rows);
  MergeParams p = merge_params(gathered, target, shard, options, ws);
  p.op = op;
  const CeReduceArgs r = bind_ce_outputs(p.out, out, options.reduction, rows, ws.row_loss,
                                         ws.row_z_loss, ws.row_correct, ws.totals);
  launch_merge(p, stream);
  ce_reduce(r, stream);
}

void ce_shard_loss(TensorView gathered, TensorView target, VocabShard shard,
                   const CeOptions& options, const CeOutputs& out, Workspace workspace,
                   Stream stream) {
  DeviceGuard guard(gathered.device.index);
  ce_shard_finish(gathered, target, shard, options, out, workspace, OpCode::ce_forward,
                  stream_of(stream));
}

void ce_shard_backward(TensorView logits, TensorView target, VocabShard shard, TensorView gathered,
                       TensorView grad_output, const CeOptions& options, TensorView grad_logits,
                       int64_t first_row, Workspace workspace, Stream stream) {
  DeviceGuard guard(logits.device.index);
  const cudaStream_t s = stream_of(stream);
  const ShardWorkspace ws = carve(workspace, target.rows);
  MergeParams p = merge_params(gathered, target, shard, options, ws);
  p.op = OpCode::ce_backward;
  p.grad_output = options.reduction != Reduction::none ? f32(grad_output) : nullptr;
  launch_merge(p, s);

  CeRowsArgs a = ce_rows_args(logits, target, options, ws.totals);
  // Per-row arrays of the batch start at the block's first row.
  a.target = static_cast<const char*>(target.data) + first_row * dtype_size(target.dtype);
  if (a.row_weight) a.row_weight += first_row;
  a.grad = grad_logits.data;
  a.grad_row_stride = grad_logits.row_stride;
  a.grad_output_rows =
      options.reduction == Reduction::none ? f32(grad_output) + first_row : nullptr;
  const CeGradShard slice{shard.offset, shard.vocab, ws.target_weight + first_row};
  ce_grad_from_lse(a, ws.lse + first_row, s, &slice);
}

}  // namespace xent::cuda
