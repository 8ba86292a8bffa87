// The CUDA cross-entropy row kernel (docs/semantics.md §1): one thread-block cluster per row, the row read
// from HBM once, statistics, loss, optional outputs and the gradient from the staged copy (a
// forward without gradient streams its slices: nothing reads them twice). Semantics come from
// src/common/ce_row.hpp; this file only moves data.
#include <cstdlib>

#include "cuda/rows/ce_device.cuh"
#include "cuda/rows/ce_rows.cuh"
#include "cuda/rows/row_slice.cuh"
#include "cuda/rows/row_stats.cuh"

namespace xent::cuda {
namespace {

using common::CeConstants;
using common::CeGradRow;
using common::RowStats;

struct CeKernelParams {
  CeRowsArgs args;
  int cluster;
  int64_t slice_elements;
  bool staged;
  int staged_vectors;  // >= 0: a staged prefix of this many vectors (plan_portable_long_row)
  bool bulk;           // staged by bulk copies (Hopper paths), else by cp.async
  bool deep_stream;    // streamed sweeps keep several loads in flight per thread
  bool lean_sums;      // the statistics skip the sums no output reads
  bool logits_vector_ok;
  bool grad_vector_ok;
};

// What a CTA contributes to its row: statistics of its slice and x̃_y when y falls in it.
struct CePartial {
  RowStats<float> stats;
  float target_logit;
};

// The row-wide values every CTA of the cluster needs for the gradient sweep.
struct CeRowShared {
  CePartial merged;
  CeGradRow<float> grad_row;
};

// Writes ∂loss/∂x of a slice from its staged (or re-read) logits. The class weight of a column
// enters only through label smoothing (kWeighted: weighted and ε > 0).
template <bool kWeighted, bool kPrefix = false, class S, class Transform>
__device__ __forceinline__ void ce_grad_sweep(const RowSlice<S>& slice, const Transform& transform,
                                              const CeGradRow<float>& row, int target_in_slice,
                                              const float* class_weight, S* grad,
                                              bool grad_vector_ok) {
  constexpr int kVec = kVectorElements<S>;
  const int vectors = static_cast<int>(slice.vectors());
  // p = 2^(x̃·log2(e) − lse·log2(e)): one fused multiply-add per element (see fast_exp2).
  const float scaled_lse = row.lse * kLog2e;
  // Only one vector of the row holds the target: the others skip the per-column comparison.
  const int target_vector = target_in_slice >= 0 ? target_in_slice / kVec : -1;
  // A staged prefix's streamed tail goes first (kPrefix): the statistics sweep read it last, so
  // its lines are the likeliest to be in L2 still.
  const int tail = kPrefix ? vectors - slice.staged_vectors : 0;
  for (int k = threadIdx.x; k < vectors; k += blockDim.x) {
    const int j = !kPrefix ? k : k < tail ? k + (vectors - tail) : k - tail;
    const Vector<S> x = slice.reload(j);  // this thread waited on its piece in the first sweep
    Vector<S> g;
    float w[kVec];
    if (kWeighted) {
      load_class_weights(class_weight, slice.begin + int64_t{j} * kVec,
                         (j + 1) * kVec <= slice.length, slice.length - j * kVec, w);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) w[k] = 1.0f;
    }
    auto element = [&](int k, bool is_target) {
      float value, slope;
      value_and_slope(transform, x.value[k], value, slope);
      const float p = fast_exp2(fmaf(value, kLog2e, -scaled_lse));
      return common::ce_grad_from_prob(row, p, slope, is_target, w[k]);
    };
#pragma unroll
    for (int k = 0; k < kVec; ++k) g.value[k] = element(k, false);
    if (j == target_vector) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (j * kVec + k == target_in_slice) g.value[k] = element(k, true);
      }
    }
    store_vector(grad, j, slice.length, grad_vector_ok, g);
  }
}

// At most 48 registers (5 CTAs of 256 threads): short rows run CTAs of 64-128 threads with small
// slices, and 76 registers (what nvcc chose unbounded) held those to 6 CTAs per multiprocessor.
// Only the softcap + class-weight gradient loop spills (one 4-byte slot).
// The kWideThreads instance (plan_portable_long_row) runs one CTA a multiprocessor.
template <class S, int kThreads = kMaxThreads, int kMinBlocks = 5>
__global__ void __launch_bounds__(kThreads, kMinBlocks) ce_rows_kernel(const CeKernelParams p) {
  extern __shared__ __align__(128) unsigned char dynamic_shared[];
  __shared__ uint64_t barriers[kMaxPieces];
  __shared__ SharedStorage<RowStats<float>[kThreads / 32]> warp_scratch_storage;
  __shared__ SharedStorage<CePartial[kMaxCluster]> slot_storage;
  __shared__ SharedStorage<CeRowShared> row_shared_storage;
  RowStats<float>* warp_scratch = warp_scratch_storage.get();
  CePartial* slots = slot_storage.get();
  CeRowShared& row_shared = row_shared_storage.get();

  cluster_arrive_started(p.cluster);
  const CeRowsArgs& a = p.args;
  const CeRowOptions& o = a.options;
  const int rank = static_cast<int>(blockIdx.x % static_cast<unsigned>(p.cluster));
  const int64_t row = blockIdx.x / static_cast<unsigned>(p.cluster);
  const int64_t begin = rank * p.slice_elements;
  const int64_t length =
      begin < a.vocab ? (a.vocab - begin < p.slice_elements ? a.vocab - begin : p.slice_elements)
                      : 0;
  const int64_t target = read_target(a.target, a.target_dtype, row);
  const bool valid = target != o.ignore_index;
  const bool in_range = target >= 0 && target < a.vocab;
  const bool want_gradient = a.grad != nullptr;
  S* grad = want_gradient ? static_cast<S*>(a.grad) + row * a.grad_row_stride + begin : nullptr;

  // An ignored row reads nothing: no loss, no statistics (common::IgnoredRow), a zero gradient.
  // Every CTA of its cluster leaves here alike, so none waits at a cluster barrier.
  if (!valid) {
    using Ignored = common::IgnoredRow<float>;
    if (rank == 0) {
      if (a.row_loss) a.row_loss[row] = Ignored::loss;
      if (a.row_z_loss) a.row_z_loss[row] = Ignored::loss;
      if (a.row_total) a.row_total[row] = Ignored::loss;
      if (a.row_correct) a.row_correct[row] = 0.0f;
      if (a.lse) a.lse[row] = Ignored::lse;
      if (a.logprob) a.logprob[row] = Ignored::logprob;
      if (a.entropy) a.entropy[row] = Ignored::entropy;
      if (a.argmax) a.argmax[row] = Ignored::argmax;
    }
    if (want_gradient) write_constant_row(grad, length, p.grad_vector_ok, 0.0f);
    // Every CTA waits for the pre-pass before it exits, so the end of this grid implies its end.
    wait_for_previous_grid();
    return;
  }

  const S* row_logits = static_cast<const S*>(a.logits) + row * a.row_stride + begin;
  S* const shared = reinterpret_cast<S*>(dynamic_shared);
  // Only the wide instance stages a prefix (plan_portable_long_row plans nothing else for it);
  // in the others the prefix code folds away.
  constexpr bool kWide = kThreads == kWideThreads;
  RowSlice<S> slice;
  if constexpr (kWide) {
    slice = stage_prefix(row_logits, begin, length, shared, p.staged_vectors);
  } else {
    slice = p.staged ? stage_slice(row_logits, begin, length, p.logits_vector_ok, shared, barriers,
                                   p.bulk)
                     : stream_slice(row_logits, begin, length, p.logits_vector_ok, p.deep_stream);
  }

  // The batch totals are read only after the sweep below: with after_totals the pre-pass that
  // forms them may still run beside this grid's first CTAs.
  CeConstants<float> c = make_ce_constants(o, a.vocab, nullptr);
  const float* class_weight = o.class_weight;
  // Entropy and label smoothing need the extra sums; plain rows skip them.
  const bool entropy = a.entropy != nullptr;
  const bool full = entropy || c.smoothing > 0;
  // The argmax is tracked only for the outputs that report it.
  const bool want_argmax = a.row_correct != nullptr || a.argmax != nullptr;
  RowStats<float> stats;
  with_transform(c.transform, [&](const auto& transform) {
    if (want_argmax) {
      stats = full ? slice_row_stats<true, true, kWide>(slice, transform, class_weight, entropy,
                                                        p.lean_sums)
                   : slice_row_stats<false, true, kWide>(slice, transform, class_weight);
    } else {
      stats = full ? slice_row_stats<true, false, kWide>(slice, transform, class_weight, entropy,
                                                         p.lean_sums)
                   : slice_row_stats<false, false, kWide>(slice, transform, class_weight);
    }
  });

  wait_for_previous_grid();
  c.class_weight_sum = a.totals->class_weight_sum;

  CePartial mine;
  mine.stats = block_merge(stats, warp_scratch);
  mine.target_logit = 0.0f;
  if (threadIdx.x == 0 && in_range && target >= begin && target < begin + length) {
    mine.target_logit = c.transform.value(slice.element(target - begin));
  }
  cluster_exchange(mine, slots, &row_shared.merged, p.cluster, ClusterPhase::first_exchange,
                   [](CePartial& into, const CePartial& other) {
                     into.stats.merge(other.stats);
                     into.target_logit += other.target_logit;  // one rank holds y, others add 0
                   });

  const RowStats<float>& row_stats = row_shared.merged.stats;
  if (threadIdx.x == 0) {
    const float lse = row_stats.lse();
    if (rank == 0) {
      if (a.entropy) a.entropy[row] = row_stats.entropy();
      const float r = a.row_weight ? a.row_weight[row] : 1.0f;
      float loss = quiet_nan(), z = quiet_nan(), logprob = quiet_nan();
      if (in_range) {
        const float target_logit = row_shared.merged.target_logit;
        const float target_weight = class_weight ? class_weight[target] : 1.0f;
        const auto parts = common::ce_row_loss(c, row_stats, lse, target_logit, target_weight);
        loss = r * parts.loss;
        z = r * parts.z_loss;
        logprob = target_logit - lse;
      }
      if (a.row_loss) a.row_loss[row] = loss;
      if (a.row_z_loss) a.row_z_loss[row] = z;
      if (a.row_total) a.row_total[row] = loss + z;
      if (a.row_correct) a.row_correct[row] = row_stats.argmax == target ? 1.0f : 0.0f;
      if (a.lse) a.lse[row] = lse;
      if (a.logprob) a.logprob[row] = logprob;
      if (a.argmax) a.argmax[row] = row_stats.argmax;
    }
    if (want_gradient && in_range) {
      const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
      const float r = a.row_weight ? a.row_weight[row] : 1.0f;
      const float target_weight = class_weight ? class_weight[target] : 1.0f;
      const float base = upstream * r;
      row_shared.grad_row = common::ce_grad_row(c, lse, target, target_weight,
                                                base * a.totals->loss_factor * a.grad_scale,
                                                base * a.totals->z_factor * a.grad_scale);
    }
  }
  __syncthreads();

  if (want_gradient) {
    if (!in_range) {
      write_constant_row(grad, length, p.grad_vector_ok, quiet_nan());
    } else {
      const CeGradRow<float> grad_row = row_shared.grad_row;
      const int target_in_slice =  // -1 when y lies in another CTA's slice
          target >= begin && target < begin + length ? static_cast<int>(target - begin) : -1;
      const bool weighted = class_weight != nullptr && c.smoothing > 0;
      with_transform(c.transform, [&](const auto& transform) {
        if (weighted) {
          ce_grad_sweep<true, kWide>(slice, transform, grad_row, target_in_slice, class_weight,
                                     grad, p.grad_vector_ok);
        } else {
          ce_grad_sweep<false, kWide>(slice, transform, grad_row, target_in_slice, nullptr, grad,
                                      p.grad_vector_ok);
        }
      });
    }
  }
}

}  // namespace

CeRowOptions ce_row_options(const CeOptions& options) {
  CeRowOptions o;
  o.ignore_index = options.ignore_index;
  o.reduction = options.reduction;
  o.label_smoothing = static_cast<float>(options.label_smoothing);
  o.z_loss = static_cast<float>(options.z_loss);
  o.softcap = options.softcap ? static_cast<float>(*options.softcap) : 0.0f;
  o.logit_scale = static_cast<float>(options.logit_scale);
  o.class_weight = options.class_weight.present()
                       ? static_cast<const float*>(options.class_weight.data)
                       : nullptr;
  return o;
}

void ce_rows(const CeRowsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return;
  const std::size_t element = dtype_size(args.dtype);
  // Without a gradient each element is read once: streamed slices read HBM directly and run more
  // CTAs per multiprocessor than staged ones, which only add the staging latency.
  SlicePlan plan = args.grad == nullptr ? plan_streamed_row_slices(args.vocab, element)
                                        : plan_row_slices(args.vocab, element, 1);
  const bool logits_vector_ok = rows_are_vector_aligned(args.logits, args.row_stride, element);
  if (args.grad != nullptr && !plan.hopper && !plan.staged && logits_vector_ok) {
    plan = plan_portable_long_row(args.vocab, element);
  }
  CeKernelParams p{};
  p.args = args;
  p.cluster = plan.cluster;
  p.slice_elements = plan.slice_elements;
  p.staged = plan.staged;
  p.staged_vectors = plan.staged_vectors;
  p.bulk = plan.hopper;
  p.deep_stream = true;
  p.lean_sums = true;
  p.logits_vector_ok = logits_vector_ok;
  p.grad_vector_ok =
      args.grad != nullptr && rows_are_vector_aligned(args.grad, args.grad_row_stride, element);
  const bool overlap = args.after_totals;
  auto launch = [&](auto kernel) {
    launch_row_kernel(kernel, p, args.rows, plan, stream, overlap);
  };
  const bool wide = plan.threads == kWideThreads;
  switch (args.dtype) {
    case DType::f32:
      wide ? launch(ce_rows_kernel<float, kWideThreads, 1>) : launch(ce_rows_kernel<float>);
      break;
    case DType::bf16:
      wide ? launch(ce_rows_kernel<bf16_t, kWideThreads, 1>) : launch(ce_rows_kernel<bf16_t>);
      break;
    case DType::f16:
      wide ? launch(ce_rows_kernel<f16_t, kWideThreads, 1>) : launch(ce_rows_kernel<f16_t>);
      break;
    default:
      throw Error(ErrorKind::invalid_argument,
                  std::string("ce_rows: logits dtype unsupported on CUDA: got ") +
                      dtype_name(args.dtype) + "; expected float32, bfloat16 or float16");
  }
}

}  // namespace xent::cuda
