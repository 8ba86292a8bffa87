// How the row kernels (ce_rows.cu, distill_rows.cu) hold a row on chip: the row is split into
// slices, one per CTA of a thread-block cluster; each CTA copies its slice into shared memory
// once with the bulk-copy engine (cp.async.bulk, completing on one mbarrier per piece so the
// statistics sweep starts on the first piece while the rest is in flight), the CTAs exchange
// partial statistics through distributed shared memory, and the gradient sweep reads the staged
// slice instead of HBM. Rows too long for the cluster's shared memory are read from HBM twice
// ("streaming" slices, same kernels).
//
// The portable paths (core/arch.hpp; sm_80 and every non-Hopper GPU) run the same kernels with
// one CTA per row (cluster 1: no exchange between CTAs), the slice staged by cp.async, and
// ordinary launches. A ce row with a gradient too long for one CTA's shared memory runs in one
// CTA of kWideThreads a multiprocessor that stages as much of it as fits (in pieces the
// statistics sweep consumes as they land) and streams the rest twice, the streamed tail first
// in the gradient sweep, while its lines are still in L2 (plan_portable_long_row). The Hopper instructions are compiled only into sm_90 code; sm_80 code traps
// if it ever reaches them, which no portable plan lets happen.
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>

#include "common/ce_row.hpp"
#include "cuda/core/device.cuh"

namespace xent::cuda {

// Host-side plan of a row kernel launch.
struct SlicePlan {
  int cluster = 1;               // CTAs per row
  int threads = 256;             // per CTA
  int64_t slice_elements = 0;    // columns per CTA (a multiple of the 16-byte vector)
  bool staged = true;            // slice held in shared memory (else read twice from HBM)
  std::size_t shared_bytes = 0;  // dynamic shared memory per CTA
  bool hopper = true;            // clusters, bulk copies, dependent launches (hopper_paths)
  int staged_vectors = -1;       // >= 0: only this prefix staged (pieces of threads vectors)
};

inline constexpr int kMaxThreads = 256;
inline constexpr int kWideThreads = 1024;  // a portable long row's CTA: one a multiprocessor
inline constexpr int kMaxPieces = 64;      // mbarriers per CTA: pieces of threads × 16 bytes
inline constexpr int kMaxCluster = 8;      // portable cluster size
// The largest cluster Hopper runs once a kernel allows non-portable sizes. Only the distill
// kernel takes it (its exchange pulls, so it keeps no slot per rank): two staged inputs of a row
// of 256000 bf16 columns are 128 KiB slices in a cluster of 8, one CTA per multiprocessor,
// where 16 gives 64 KiB slices and three (docs/archive/perf-notes.md, decision 65).
inline constexpr int kMaxNonPortableCluster = 16;

// `inputs` rows are staged per CTA (1 for ce, 2 for distill), each of `element` bytes a column.
// On the portable paths the cluster is 1 whatever `max_cluster` says.
// A slice of <= 64 KiB lets three CTAs share a multiprocessor, so one CTA's loads overlap
// another's arithmetic; up to 192 KiB is still staged (one CTA per multiprocessor) before
// falling back to streaming. `max_cluster`: kMaxCluster, or up to kMaxNonPortableCluster for a
// kernel launched with non-portable clusters allowed (row_kernel_max_cluster).
SlicePlan plan_row_slices(int64_t vocab, std::size_t element, int inputs,
                          int max_cluster = kMaxCluster);

// The largest cluster (a power of two, kMaxCluster at least) that `kernel` can run on the current
// device with `threads` threads and `shared_bytes` of dynamic shared memory per CTA, at most
// `wanted`: larger than kMaxCluster only where the device reports a whole such cluster fits
// (cudaOccupancyMaxActiveClusters), after allowing non-portable sizes for the kernel. Cached per
// kernel, device and size. 1 on the portable paths.
int row_kernel_max_cluster(const void* kernel, int wanted, int threads, std::size_t shared_bytes);
// A portable ce row with a gradient that plan_row_slices would stream twice (16-byte aligned
// rows): one CTA of kWideThreads, the longest prefix of whole pieces that one CTA's shared
// memory holds staged, the rest streamed.
SlicePlan plan_portable_long_row(int64_t vocab, std::size_t element);
// The slices of a ce forward without gradient, streamed from HBM (never staged): larger than
// plan_row_slices' (row_slice.cu says why).
SlicePlan plan_streamed_row_slices(int64_t vocab, std::size_t element);
// The dynamic shared memory a row kernel's CTA may take on the current device (what
// plan_row_slices stages a slice within): kernels that keep more than the slice there check
// their total against it.
std::size_t row_slice_shared_limit();

// Raises `kernel`'s dynamic shared-memory limit on the current device to at least `bytes`, once
// per kernel, device and size: later calls (e.g. inside CUDA-graph capture, after warm-up) then
// make no runtime call at all.
void allow_dynamic_shared(const void* kernel, std::size_t bytes);

// Launches `kernel` over rows × plan.cluster CTAs as clusters of plan.cluster. overlap_previous:
// a programmatic dependent launch (device.cuh), for a kernel that reads what the grid before it
// wrote only after wait_for_previous_grid, and calls it in every CTA before that CTA exits. A
// portable plan launches plainly (one CTA per row, stream-ordered).
template <class Params>
void launch_row_kernel(void (*kernel)(Params), const Params& params, int64_t rows,
                       const SlicePlan& plan, cudaStream_t stream, bool overlap_previous = false) {
  if (rows <= 0) return;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel), plan.shared_bytes);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(rows * plan.cluster));
  config.blockDim = dim3(static_cast<unsigned>(plan.threads));
  config.dynamicSmemBytes = plan.shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = !plan.hopper ? 0 : overlap_previous ? 2 : 1;
  XENT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params));
}

// ---- device side ---------------------------------------------------------------------------------

// Shared-memory room for a T whose default member initialisers __shared__ cannot run.
template <class T>
struct SharedStorage {
  alignas(T) unsigned char bytes[sizeof(T)];
  __device__ __forceinline__ T& get() { return *reinterpret_cast<T*>(bytes); }
};

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// One 16-byte shared-memory load. Written as plain C++ (a uint4 read, then unpacked through an
// S* view) nvcc split it into eight 2-byte loads for bf16, with 4-way bank conflicts: 8× the
// shared-memory instructions of the statistics and gradient sweeps (seen in the PTX of v2).
__device__ __forceinline__ uint4 load_shared_vector(const uint4* pointer) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(shared_address(pointer))
               : "memory");
  return v;
}

// Waits for a staged piece. The suspend-time hint lets the hardware park the waiting warp until
// the bytes land: without it try_wait returns after a short, system-dependent time, and a CTA
// waiting ~1-2 µs for its first piece spun through the retry loop, taking issue slots from the
// CTAs sharing the multiprocessor (ncu on v3: a third of the issued instructions were not the
// sweeps').
__device__ __forceinline__ void wait_piece(uint64_t* barrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  (void)barrier;
  __trap();  // sm_80 code stages with cp.async and never waits on a piece
#else
  const uint32_t address = shared_address(barrier);
  constexpr uint32_t kSuspendHintNs = 10'000'000;
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0, %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(address), "r"(kSuspendHintNs)
        : "memory");
  }
#endif
}

// The row and the columns that CTA blockIdx.x covers in a launch of `cluster` CTAs per row
// (launch_row_kernel), each CTA `slice_elements` columns of a row of `vocab`; the last slices of
// a short row may be empty.
struct ClusterSlice {
  int rank;  // within the row's cluster
  int64_t row;
  int64_t begin;   // first column
  int64_t length;  // columns
};
__device__ __forceinline__ ClusterSlice cluster_slice(int cluster, int64_t slice_elements,
                                                      int64_t vocab) {
  ClusterSlice c;
  c.rank = static_cast<int>(blockIdx.x % static_cast<unsigned>(cluster));
  c.row = blockIdx.x / static_cast<unsigned>(cluster);
  c.begin = c.rank * slice_elements;
  c.length =
      c.begin < vocab ? (vocab - c.begin < slice_elements ? vocab - c.begin : slice_elements) : 0;
  return c;
}

// stage_prefix keeps kPrefixGroups cp.async groups committed ahead of the statistics sweep: its
// pieces, then empty groups up to that count. The sweep's p-th piece is then complete once at
// most kPrefixGroups − 1 groups are pending, and committing one more (empty) group after each
// piece keeps that so for the next: one constant wait operand for any number of pieces.
inline constexpr int kPrefixGroups = 16;
__device__ __forceinline__ void wait_next_piece() {
  asm volatile("cp.async.wait_group 15;\n\tcp.async.commit_group;" ::: "memory");
  static_assert(kPrefixGroups == 16, "the wait operand above is kPrefixGroups - 1");
}

// One CTA's part of a row. Vector j covers columns begin + j·kVec ... of the row.
template <class S>
struct RowSlice {
  static constexpr int kVec = kVectorElements<S>;
  const S* global = nullptr;  // the slice's first element in HBM
  const S* staged = nullptr;  // its copy in shared memory, or null (streaming)
  int64_t begin = 0;          // row column of the first element
  int64_t length = 0;         // elements in the slice
  bool vector_ok = false;     // `global` moves in 16-byte vectors
  bool bulk = false;          // staged pieces arrive on mbarriers (wait before the first use)
  uint64_t* barriers = nullptr;
  int bulk_vectors = 0;          // vectors covered by the bulk copies (0 when not bulk); 32-bit,
                                 // so the per-vector wait test is one comparison (slices < 2^31 B)
  bool deep_stream = false;      // streamed: several loads in flight per thread (slice_row_stats)
  int staged_vectors = INT_MAX;  // vectors held in `staged` (a prefix: stage_prefix)
  bool async_pieces = false;     // staged pieces land on cp.async groups (stage_prefix)

  __device__ int64_t vectors() const { return (length + kVec - 1) / kVec; }

  // Vector j as floats; elements past `length` are unspecified (callers mask by column).
  // `piece` is the index of the piece that holds j (j / blockDim.x).
  __device__ __forceinline__ Vector<S> load(int64_t j, int64_t piece) const {
    if (staged && static_cast<int>(j) < staged_vectors) {
      if (static_cast<int>(j) < bulk_vectors) wait_piece(&barriers[static_cast<int>(piece)]);
      if (async_pieces) wait_next_piece();
      return unpack<S>(load_shared_vector(reinterpret_cast<const uint4*>(staged) + j));
    }
    if (vector_ok && (j + 1) * kVec <= length) {
      return unpack<S>(__ldg(reinterpret_cast<const uint4*>(global) + j));
    }
    Vector<S> v;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t i = j * kVec + k;
      v.value[k] = i < length ? load_float(global[i]) : 0.0f;
    }
    return v;
  }

  // Vector j again, after the sweep that waited on its piece (no barrier wait).
  __device__ __forceinline__ Vector<S> reload(int64_t j) const {
    if (staged && static_cast<int>(j) < staged_vectors) {
      return unpack<S>(load_shared_vector(reinterpret_cast<const uint4*>(staged) + j));
    }
    return load(j, 0);
  }

  // Element i (0 <= i < length) as a float, from wherever the slice lives; call only after the
  // sweep that waited on every piece (the staged copy is complete then).
  __device__ __forceinline__ float element(int64_t i) const {
    return load_float(staged && i < int64_t{staged_vectors} * kVec ? staged[i] : global[i]);
  }
};

// Starts staging `length` elements at `global` into `shared` (16-byte aligned). With `bulk`
// (Hopper paths) thread 0 issues bulk copies whose pieces then arrive asynchronously on mbarriers;
// otherwise every thread copies the vectors it will sweep with cp.async (sm_80) and waits for
// them, so the slice is complete on return. The unaligned tail (or everything, when `global` is
// not 16-byte aligned) is copied by all threads. Ends with a __syncthreads.
template <class S>
__device__ RowSlice<S> stage_slice(const S* global, int64_t begin, int64_t length, bool vector_ok,
                                   S* shared, uint64_t* barriers, bool bulk) {
  RowSlice<S> slice;
  slice.global = global;
  slice.staged = shared;
  slice.begin = begin;
  slice.length = length;
  slice.vector_ok = vector_ok;
  slice.barriers = barriers;
  const int64_t bulk_bytes = vector_ok ? (length * int64_t{sizeof(S)}) / 16 * 16 : 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  bulk = false;
#endif
  if (!bulk) {
    // Each thread's vectors j = threadIdx.x + k·blockDim.x are those its sweeps read.
    const int64_t vectors = bulk_bytes / 16;
    for (int64_t j = threadIdx.x; j < vectors; j += blockDim.x) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                       shared_address(reinterpret_cast<const uint4*>(shared) + j)),
                   "l"(reinterpret_cast<const uint4*>(global) + j)
                   : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  }
  slice.bulk = bulk && bulk_bytes > 0;
  slice.bulk_vectors = slice.bulk ? static_cast<int>(bulk_bytes / 16) : 0;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  const int64_t piece_bytes = int64_t{blockDim.x} * 16;
  if (slice.bulk && threadIdx.x == 0) {
    const int pieces = static_cast<int>((bulk_bytes + piece_bytes - 1) / piece_bytes);
    for (int p = 0; p < pieces; ++p) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&barriers[p]))
                   : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int p = 0; p < pieces; ++p) {
      const int64_t offset = int64_t{p} * piece_bytes;
      const uint32_t bytes = static_cast<uint32_t>(
          bulk_bytes - offset < piece_bytes ? bulk_bytes - offset : piece_bytes);
      const uint32_t barrier = shared_address(&barriers[p]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(barrier),
                   "r"(bytes)
                   : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(shared_address(reinterpret_cast<const char*>(shared) + offset)),
          "l"(reinterpret_cast<const char*>(global) + offset), "r"(bytes), "r"(barrier)
          : "memory");
    }
  }
#endif
  // Elements the bulk copies do not cover: all of them on the scalar path, else the tail.
  const int64_t first_scalar = bulk_bytes / int64_t{sizeof(S)};
  for (int64_t i = first_scalar + threadIdx.x; i < length; i += blockDim.x) shared[i] = global[i];
  __syncthreads();
  return slice;
}

// A slice read straight from HBM (rows too long to stage).
template <class S>
__device__ RowSlice<S> stream_slice(const S* global, int64_t begin, int64_t length, bool vector_ok,
                                    bool deep = false) {
  RowSlice<S> slice;
  slice.deep_stream = deep;
  slice.global = global;
  slice.begin = begin;
  slice.length = length;
  slice.vector_ok = vector_ok;
  return slice;
}

// Starts staging the first `prefix_vectors` 16-byte vectors (whole pieces of blockDim.x vectors,
// at most kPrefixGroups pieces; `global` 16-byte aligned) into `shared` by cp.async, one commit group a
// piece; every thread copies the vectors its statistics sweep reads, which waits on each piece
// in turn (RowSlice::load), so the sweep starts on the first piece while the rest is in flight.
// The rest of the slice is streamed. No barrier here: another thread's vectors may be read only
// after the statistics sweep and a __syncthreads.
template <class S>
__device__ RowSlice<S> stage_prefix(const S* global, int64_t begin, int64_t length, S* shared,
                                    int prefix_vectors) {
  RowSlice<S> slice = stream_slice(global, begin, length, /*vector_ok=*/true, /*deep=*/true);
  slice.staged = shared;
  slice.staged_vectors = prefix_vectors;
  slice.async_pieces = true;
  const int pieces = prefix_vectors / static_cast<int>(blockDim.x);
  for (int p = 0; p < kPrefixGroups; ++p) {
    if (p < pieces) {
      const int j = p * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                       shared_address(reinterpret_cast<const uint4*>(shared) + j)),
                   "l"(reinterpret_cast<const uint4*>(global) + j)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  return slice;
}

// Writes vector j of a gradient slice (columns past `length` untouched).
template <class S>
__device__ __forceinline__ void store_vector(S* global, int64_t j, int64_t length, bool vector_ok,
                                             const Vector<S>& v) {
  constexpr int kVec = kVectorElements<S>;
  if (vector_ok && (j + 1) * kVec <= length) {
    reinterpret_cast<uint4*>(global)[j] = pack<S>(v);
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const int64_t i = j * kVec + k;
    if (i < length) global[i] = store_float<S>(v.value[k]);
  }
}

// Writes `value` to every column of a gradient slice.
template <class S>
__device__ void write_constant_row(S* grad, int64_t length, bool vector_ok, float value) {
  constexpr int kVec = kVectorElements<S>;
  Vector<S> v;
#pragma unroll
  for (int k = 0; k < kVec; ++k) v.value[k] = value;
  for (int64_t j = threadIdx.x; j * kVec < length; j += blockDim.x) {
    store_vector(grad, j, length, vector_ok, v);
  }
}

// ---- reductions (fixed shapes, so every run adds in the same order) -------------------------------

__device__ __forceinline__ common::RowStats<float> shuffle_down(const common::RowStats<float>& s,
                                                                int offset) {
  common::RowStats<float> o;
  o.max = __shfl_down_sync(0xffffffffu, s.max, offset);
  o.sum_exp = __shfl_down_sync(0xffffffffu, s.sum_exp, offset);
  o.sum_exp_shift = __shfl_down_sync(0xffffffffu, s.sum_exp_shift, offset);
  o.sum_logits = __shfl_down_sync(0xffffffffu, s.sum_logits, offset);
  o.sum_weighted_logits = __shfl_down_sync(0xffffffffu, s.sum_weighted_logits, offset);
  o.argmax = __shfl_down_sync(0xffffffffu, s.argmax, offset);
  return o;
}

// Merges the statistics of a warp; the result is valid in lane 0. When every lane's statistics
// are ordinary (max not NaN or +Inf, finite sums) the lanes agree on the warp max first, rescale
// their own sums to it (one ex2 each) and add: the same quantities as RowStats::merge's tree (ties
// keep the lower column; an all -inf row keeps its first column), ~90 instructions instead of
// five rounds of a merge with two precise exponentials (~350 per warp, a sixth of a short row's
// instructions in ncu). Lanes with NaN or ±Inf take RowStats::merge, which defines those rows.
__device__ __forceinline__ common::RowStats<float> warp_merge(common::RowStats<float> s) {
  constexpr unsigned kAll = 0xffffffffu;
  const bool ordinary = s.max == s.max && s.max < common::infinity<float>() && s.sum_exp <= FLT_MAX;
  if (!__all_sync(kAll, ordinary)) {
    for (int offset = 16; offset > 0; offset /= 2) s.merge(shuffle_down(s, offset));
    return s;
  }
  float m = s.max;
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(kAll, m, offset));
  float sum_exp = 0.0f, sum_exp_shift = 0.0f;
  if (s.sum_exp > 0) {  // then s.max and m are finite
    const float shift = s.max - m;
    const float alpha = fast_exp(shift);
    sum_exp = alpha * s.sum_exp;
    sum_exp_shift = alpha * (s.sum_exp_shift + shift * s.sum_exp);
  }
  float sum_logits = s.sum_logits, sum_weighted = s.sum_weighted_logits;
  long long candidate = s.argmax >= 0 && s.max == m ? s.argmax : LLONG_MAX;
  for (int offset = 16; offset > 0; offset /= 2) {
    sum_exp += __shfl_down_sync(kAll, sum_exp, offset);
    sum_exp_shift += __shfl_down_sync(kAll, sum_exp_shift, offset);
    sum_logits += __shfl_down_sync(kAll, sum_logits, offset);
    sum_weighted += __shfl_down_sync(kAll, sum_weighted, offset);
    const long long other = __shfl_down_sync(kAll, candidate, offset);
    candidate = other < candidate ? other : candidate;
  }
  common::RowStats<float> merged;
  merged.max = m;
  merged.sum_exp = sum_exp;
  merged.sum_exp_shift = sum_exp_shift;
  merged.sum_logits = sum_logits;
  merged.sum_weighted_logits = sum_weighted;
  merged.argmax = candidate == LLONG_MAX ? -1 : candidate;
  return merged;
}

// Merges the statistics of every thread; the result is valid in thread 0. `scratch` holds one
// entry per warp. Ends with the CTA synchronised (scratch may be reused afterwards by thread 0).
// The per-warp results are merged by warp 0 in one more warp_merge (no serial loop in thread 0
// while the other warps wait at the barrier).
__device__ __forceinline__ common::RowStats<float> block_merge(common::RowStats<float> s,
                                                               common::RowStats<float>* scratch) {
  s = warp_merge(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = s;
  __syncthreads();
  if (warp == 0) {
    const int warps = (blockDim.x + 31) / 32;
    s = lane < warps ? scratch[lane] : common::RowStats<float>{};
    s = warp_merge(s);
  }
  return s;
}

// Sums of K floats over the CTA; valid in thread 0. `scratch` holds 32·K floats.
template <int K>
__device__ __forceinline__ void block_sum(float (&values)[K], float* scratch) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int offset = 16; offset > 0; offset /= 2) {
      values[k] += __shfl_down_sync(0xffffffffu, values[k], offset);
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[warp * K + k] = values[k];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const int warps = (blockDim.x + 31) / 32;
    for (int w = 1; w < warps; ++w) {
#pragma unroll
      for (int k = 0; k < K; ++k) values[k] += scratch[w * K + k];
    }
  }
}

// Cluster exchanges push: thread 0 of every CTA writes its value into slot[rank] of every CTA of
// the cluster (distributed shared memory), one cluster barrier (release / acquire) makes all of
// them visible, and each CTA merges its own slots in rank order (identical in every CTA). After
// the barrier no CTA touches another's shared memory, so a CTA may leave as soon as it is done:
// with the former pull (read the other ranks' slots after the barrier) every CTA had to wait at
// a last cluster barrier for the slowest CTA of the cluster before exiting (ncu: barrier and
// membar stalls growing with the cluster size, docs/archive/perf-notes.md v6).
//
// A CTA may write into another's shared memory only once that CTA has started: the kernel
// calls cluster_arrive_started() first thing, and the first exchange waits on that phase before
// pushing (by then every CTA has long started, so the wait costs nothing).
__device__ __forceinline__ void cluster_arrive_started(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if (cluster > 1) __trap();  // portable plans have one CTA per row
#else
  if (cluster > 1) asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

enum class ClusterPhase { first_exchange, later_exchange };

// `slots` is an array of kMaxCluster values in this CTA's shared memory, used by this exchange
// only (a kernel with two exchanges gives each its own). `mine` is thread 0's value; the merge
// lands in `result`, visible to all threads on return.
template <class P, class Merge>
__device__ __forceinline__ void cluster_exchange(const P& mine, P* slots, P* result, int cluster,
                                                 ClusterPhase phase, Merge merge) {
  namespace cg = cooperative_groups;
  if (cluster == 1) {
    if (threadIdx.x == 0) *result = mine;
    __syncthreads();
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  (void)slots, (void)phase, (void)merge;
  __trap();
#else
  cg::cluster_group group = cg::this_cluster();
  const unsigned rank = group.block_rank();
  // The value goes to this CTA's own slot first, so it is not held in registers across the wait
  // and the copies (holding distill's three RowStats there made nvcc double its registers).
  if (threadIdx.x == 0) slots[rank] = mine;
  if (phase == ClusterPhase::first_exchange) {
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
  }
  if (threadIdx.x == 0) {
    for (int r = 0; r < cluster; ++r) {
      if (r != static_cast<int>(rank)) *group.map_shared_rank(&slots[rank], r) = slots[rank];
    }
  }
  group.sync();
  if (threadIdx.x == 0) {
    P merged = slots[0];
    for (int r = 1; r < cluster; ++r) merge(merged, slots[r]);
    *result = merged;
  }
  __syncthreads();
#endif
}

// The pulling form of the exchange, kept for the distill kernel: every CTA publishes `mine`
// (thread 0's value) in `slot` and, after one cluster barrier, thread 0 reads every rank's slot
// and merges them in rank order (identical in every CTA); the result lands in `result`, visible
// to all threads on return. The caller ends the kernel with cluster_finish() so that no CTA
// leaves while another still reads its slot. The push form above measured faster for ce
// (16384 × 131072 / 262144 fwd+grad 0.60 → 0.69 / 0.64 of B) but slower for distill
// (forward_kl 16384 × 131072 0.326 → 0.263) in the same run, for a reason not yet found.
template <class P, class Merge>
__device__ __forceinline__ void cluster_exchange_pull(const P& mine, P* slot, P* result,
                                                      int cluster, Merge merge) {
  namespace cg = cooperative_groups;
  if (threadIdx.x == 0) *slot = mine;
  if (cluster == 1) {
    __syncthreads();
    if (threadIdx.x == 0) *result = *slot;
    __syncthreads();
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  (void)merge;
  __trap();
#else
  cg::cluster_group group = cg::this_cluster();
  group.sync();
  if (threadIdx.x == 0) {
    P merged = *group.map_shared_rank(slot, 0);
    for (int r = 1; r < cluster; ++r) merge(merged, *group.map_shared_rank(slot, r));
    *result = merged;
  }
  __syncthreads();
#endif
}

__device__ __forceinline__ void cluster_finish(int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if (cluster > 1) __trap();
#else
  if (cluster > 1) cooperative_groups::this_cluster().sync();
#endif
}

}  // namespace xent::cuda
