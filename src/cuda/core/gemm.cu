// cuBLASLt products of the fused linear losses. A row-major C[M,N] = op(A)·op(B) is the column-
// major Cᵀ[N,M] = op(B)ᵀ·op(A)ᵀ, so cuBLAS sees B's storage as its first operand and A's as its
// second, with no copies: h·Wᵀ becomes the "TN" form, the fastest for tensor cores.
#include "cuda/core/gemm.hpp"

#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/core/device.cuh"
#include "cuda/test_hook.hpp"

namespace xent::cuda {

namespace {

void check_cublas(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw Error(ErrorKind::runtime, std::string("cuBLASLt error in ") + call + ": status " +
                                      std::to_string(static_cast<int>(status)));
}
#define XENT_CUBLAS_CHECK(call) check_cublas((call), #call)

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      throw Error(ErrorKind::runtime,
                  std::string("gemm: dtype ") + dtype_name(dtype) + " has no matrix-product path");
  }
}

// Largest power of two (up to 256) dividing the address: cuBLASLt's heuristic must be told, or
// it may pick a kernel that assumes 256-byte aligned operands.
uint32_t alignment_of_value(uintptr_t address) {
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}
uint32_t alignment_of(const void* pointer) {
  return alignment_of_value(reinterpret_cast<uintptr_t>(pointer));
}

// The alignment of a bias that cuBLASLt's bias epilogue reads (gemm()), and the granule in which
// a copy of one takes scratch.
constexpr uint32_t kBiasAlignment = 16;
constexpr std::size_t kScratchAlignment = 256;

// A pinned product (GemmProduct::pinned) chooses its algorithm at this many rows of c, whatever
// the call's (docs/archive/perf-notes.md, notes 132 and 139): large enough for the chunks of
// a long batch, where the time is.
constexpr int64_t kPinnedRows = 4096;
// The alignment a pinned product asks of each operand, so that the choice does not move with the
// address of a row: 16 bytes (what the TMA kernels need), or less where the row stride or the
// base is less aligned (then every row start may be).
constexpr uint32_t kPinnedAlignment = 16;
uint32_t pinned_alignment(const GemmMatrix& m) {
  const auto stride_bytes = static_cast<uintptr_t>(m.stride) * dtype_size(m.dtype);
  return std::min({kPinnedAlignment, alignment_of_value(stride_bytes), alignment_of(m.data)});
}

// How many of the heuristic's answers a configuration keeps, and so may time (decision 58).
constexpr int kCandidates = 8;
// Below this many flops a product is not timed: its candidates differ by less than the noise.
constexpr double kTuneMinFlops = 1073741824.0;
// By default only products with an inner dimension up to this are timed. Their time goes largely
// to writing the output, where the candidates differ most and the fastest alone is the fastest in
// the call. With a long inner dimension they differ by less than what timing one alone misjudges
// on a GPU at its power limit (docs/archive/perf-notes.md, decision 58).
constexpr int64_t kTuneMaxInner = 1024;
// A candidate replaces the heuristic's first answer only when this much faster, so candidates
// within the run-to-run noise do not flip the choice between processes.
constexpr float kTuneMargin = 0.98f;

// One cached product configuration: descriptors, the heuristic's candidates and the one in use.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_c = nullptr;
  cublasLtMatmulHeuristicResult_t candidates[kCandidates] = {};
  int candidate_count = 0;
  int chosen = 0;
  bool tuned = false;  // timed, or never to be timed (switched off, one candidate, too small,
                       // or an inner dimension beyond the default's limit)
  bool has_bias = false;
  bool pinned = false;
  bool pinned_fallback = false;
  ~Plan() {
    if (layout_c) cublasLtMatrixLayoutDestroy(layout_c);
    if (layout_b) cublasLtMatrixLayoutDestroy(layout_b);
    if (layout_a) cublasLtMatrixLayoutDestroy(layout_a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// A pinned configuration's algorithm: the first of the heuristic's answers at kPinnedRows rows
// that is data-parallel and also fits a single row (so that it fits the rows between too); none
// when there is no such answer.
struct PinnedAlgo {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};

struct Cache {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;  // per device
  std::map<std::string, std::unique_ptr<Plan>> plans;
  std::map<std::string, PinnedAlgo> pinned;  // per pinned configuration (pinned_key_of)
};

Cache& cache() {
  static Cache* instance = new Cache();  // never destroyed: handles outlive static teardown order
  return *instance;
}

cublasLtHandle_t handle_for(Cache& c, int device) {
  auto found = c.handles.find(device);
  if (found != c.handles.end()) return found->second;
  cublasLtHandle_t handle = nullptr;
  XENT_CUBLAS_CHECK(cublasLtCreate(&handle));
  c.handles.emplace(device, handle);
  return handle;
}

// The product in cuBLAS's terms (column-major, first operand = our B).
struct ColumnMajorProduct {
  int64_t m, n, k;
  cublasOperation_t trans_first, trans_second;
  const GemmMatrix* first;   // our B
  const GemmMatrix* second;  // our A
};

ColumnMajorProduct to_column_major(const GemmProduct& p) {
  ColumnMajorProduct cm{};
  cm.m = p.c.cols;
  cm.n = p.c.rows;
  cm.k = p.a_transposed ? p.a.rows : p.a.cols;
  // Our row-major B[K,N] read column-major is already op(B)ᵀ: no transpose; B stored [N,K]
  // (b_transposed) needs one. The same holds for A.
  cm.trans_first = p.b_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  cm.trans_second = p.a_transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  cm.first = &p.b;
  cm.second = &p.a;
  return cm;
}

std::string key_of(int device, const GemmProduct& p, const ColumnMajorProduct& cm,
                   std::size_t workspace_bytes) {
  return std::to_string(device) + ':' + std::to_string(cm.m) + ',' + std::to_string(cm.n) + ',' +
         std::to_string(cm.k) + ':' + std::to_string(cm.trans_first) +
         std::to_string(cm.trans_second) + ':' + std::to_string(static_cast<int>(p.a.dtype)) +
         std::to_string(static_cast<int>(p.b.dtype)) + std::to_string(static_cast<int>(p.c.dtype)) +
         ':' + std::to_string(p.a.stride) + ',' + std::to_string(p.b.stride) + ',' +
         std::to_string(p.c.stride) + ':' + std::to_string(alignment_of(p.a.data)) + ',' +
         std::to_string(alignment_of(p.b.data)) + ',' + std::to_string(alignment_of(p.c.data)) +
         ':' + (p.bias ? std::to_string(alignment_of(p.bias)) : std::string("-")) + ':' +
         std::to_string(workspace_bytes);
}

// A pinned product's configuration: key_of without M (the rows of c, cuBLAS's n) or the scratch,
// with the alignments a pinned product asks for instead of its pointers'.
std::string pinned_key_of(int device, const GemmProduct& p, const ColumnMajorProduct& cm) {
  return "pinned:" + std::to_string(device) + ':' + std::to_string(cm.m) + ',' +
         std::to_string(cm.k) + ':' + std::to_string(cm.trans_first) +
         std::to_string(cm.trans_second) + ':' + std::to_string(static_cast<int>(p.a.dtype)) +
         std::to_string(static_cast<int>(p.b.dtype)) + std::to_string(static_cast<int>(p.c.dtype)) +
         ':' + std::to_string(p.a.stride) + ',' + std::to_string(p.b.stride) + ',' +
         std::to_string(p.c.stride) + ':' + std::to_string(pinned_alignment(p.a)) + ',' +
         std::to_string(pinned_alignment(p.b)) + ',' + std::to_string(pinned_alignment(p.c)) + ':' +
         (p.bias ? std::to_string(std::min(kPinnedAlignment, alignment_of(p.bias)))
                 : std::string("-"));
}

// The plan cache's key: a pinned plan is one per M of its configuration (its layouts), whatever
// the scratch and the operands' addresses.
std::string plan_key(int device, const GemmProduct& p, const ColumnMajorProduct& cm,
                     std::size_t workspace_bytes) {
  if (p.pinned) return pinned_key_of(device, p, cm) + ':' + std::to_string(cm.n);
  return key_of(device, p, cm, workspace_bytes);
}

// Which products are timed against the heuristic's other candidates: by default only those whose
// inner dimension is short (kTuneMaxInner); the tests force none or every product large enough
// through the test hook. Read as each configuration is first met.
enum class Tuning { off, short_inner, all };
Tuning tuning_mode() {
  switch (test_hook().gemm_tuning) {
    case GemmTuning::off:
      return Tuning::off;
    case GemmTuning::all:
      return Tuning::all;
    default:
      return Tuning::short_inner;
  }
}

// The descriptors of a product: its operation (with the bias epilogue for an fp32 c) and layouts.
std::unique_ptr<Plan> describe(const GemmProduct& p, const ColumnMajorProduct& cm) {
  auto plan = std::make_unique<Plan>();
  // fp32 operands use CUBLAS_COMPUTE_32F, which never rounds to TF32 (docs/semantics.md §6: TF32 off).
  XENT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  XENT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                   &cm.trans_first, sizeof cm.trans_first));
  XENT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                   &cm.trans_second, sizeof cm.trans_second));
  // The bias epilogue, into a 16-bit c too: without split-K (find_candidates) it rounds each
  // value once with the product's sum, where adding the product into c filled with the bias
  // (beta = 1) rounds twice in most algorithms (docs/archive/perf-notes.md, note 149).
  if (p.bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    XENT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &epilogue, sizeof epilogue));
    const cudaDataType_t bias_type = cuda_type(p.a.dtype);
    XENT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type));
    plan->has_bias = true;
  }
  const GemmMatrix& first = *cm.first;
  const GemmMatrix& second = *cm.second;
  // A stored row-major [rows, cols] is column-major [cols, rows] with ld = stride.
  XENT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_a, cuda_type(first.dtype), first.cols,
                                               first.rows, first.stride));
  XENT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_b, cuda_type(second.dtype),
                                               second.cols, second.rows, second.stride));
  XENT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->layout_c, cuda_type(p.c.dtype), p.c.cols,
                                               p.c.rows, p.c.stride));
  return plan;
}

// The heuristic's answers for `plan`'s descriptors into plan->candidates; false when none. A
// pinned product asks for no workspace and no reduction (so split-K 1: split-K's partial sums
// need one) and for the alignments pinned_alignment gives.
bool find_candidates(cublasLtHandle_t handle, Plan& plan, const GemmProduct& p,
                     const ColumnMajorProduct& cm, std::size_t workspace_bytes) {
  cublasLtMatmulPreference_t preference = nullptr;
  XENT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t max_workspace = p.pinned ? 0 : workspace_bytes;
  const uint32_t align_first =
                     p.pinned ? pinned_alignment(*cm.first) : alignment_of(cm.first->data),
                 align_second =
                     p.pinned ? pinned_alignment(*cm.second) : alignment_of(cm.second->data),
                 align_c = p.pinned ? pinned_alignment(p.c) : alignment_of(p.c.data);
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                       &max_workspace, sizeof max_workspace);
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                       &align_first, sizeof align_first);
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                       &align_second, sizeof align_second);
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                       &align_c, sizeof align_c);
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                       &align_c, sizeof align_c);
  // Split-K partial sums only in fp32 (the workspace), never in a 16-bit output: with a small
  // workspace the heuristic otherwise took split-K kernels that reduce in the output type (or in
  // place in it), rounding each partial to bf16, which put the chunked ∂h = G·W (K = V) well
  // above one rounding's error against float64. A pinned product, or a bias into a 16-bit c
  // (whose epilogue rounds once only without split-K, describe()): no reduction at all.
  if (p.pinned || p.c.dtype != DType::f32) {
    const bool none = p.pinned || p.bias != nullptr;
    const uint32_t reductions =
        none ? CUBLASLT_REDUCTION_SCHEME_NONE
             : CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                         &reductions, sizeof reductions);
  }
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan.desc, plan.layout_a, plan.layout_b, plan.layout_c, plan.layout_c, preference,
      kCandidates, plan.candidates, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) return false;
  plan.candidate_count = found;
  return true;
}

std::unique_ptr<Plan> make_plan(cublasLtHandle_t handle, const GemmProduct& p,
                                const ColumnMajorProduct& cm, std::size_t workspace_bytes) {
  std::unique_ptr<Plan> plan = describe(p, cm);
  if (!find_candidates(handle, *plan, p, cm, workspace_bytes)) return nullptr;
  const double flops =
      2.0 * static_cast<double>(cm.m) * static_cast<double>(cm.n) * static_cast<double>(cm.k);
  const Tuning mode = tuning_mode();
  plan->tuned = plan->candidate_count == 1 || flops < kTuneMinFlops || mode == Tuning::off ||
                (mode == Tuning::short_inner && cm.k > kTuneMaxInner);
  return plan;
}

template <class T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  T value{};
  std::size_t written = 0;
  XENT_CUBLAS_CHECK(
      cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof value, &written));
  return value;
}

// Whether an algorithm keeps every element's sum in one kernel's k loop: split-K 1 and no
// reduction (so no partial sums in an order that the shape decides), and no workspace (a
// stream-K kernel keeps its partial tiles there).
bool data_parallel(const cublasLtMatmulHeuristicResult_t& result) {
  return result.workspaceSize == 0 &&
         algo_config<int32_t>(result.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1 &&
         algo_config<uint32_t>(result.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) ==
             CUBLASLT_REDUCTION_SCHEME_NONE;
}

// The product `p` with `rows` rows of c (and of a): the shape at which a pinned algorithm is
// chosen and checked.
GemmProduct with_rows(const GemmProduct& p, int64_t rows) {
  GemmProduct shaped = p;
  shaped.a.rows = rows;
  shaped.c.rows = rows;
  return shaped;
}

// Whether `algo` runs the product `p` as it is (cublasLtMatmulAlgoCheck), data-parallel.
bool algo_fits(cublasLtHandle_t handle, const GemmProduct& p, const cublasLtMatmulAlgo_t& algo) {
  const ColumnMajorProduct cm = to_column_major(p);
  const std::unique_ptr<Plan> shaped = describe(p, cm);
  cublasLtMatmulHeuristicResult_t result{};
  if (cublasLtMatmulAlgoCheck(handle, shaped->desc, shaped->layout_a, shaped->layout_b,
                              shaped->layout_c, shaped->layout_c, &algo,
                              &result) != CUBLAS_STATUS_SUCCESS) {
    return false;
  }
  result.algo = algo;
  return data_parallel(result);
}

// (PinnedAlgo says which.)
PinnedAlgo choose_pinned(cublasLtHandle_t handle, const GemmProduct& p) {
  const GemmProduct canonical = with_rows(p, kPinnedRows);
  const ColumnMajorProduct cm = to_column_major(canonical);
  const std::unique_ptr<Plan> plan = describe(canonical, cm);
  PinnedAlgo pinned;
  if (!find_candidates(handle, *plan, canonical, cm, 0)) return pinned;
  for (int i = 0; i < plan->candidate_count; ++i) {
    const cublasLtMatmulHeuristicResult_t& candidate = plan->candidates[i];
    if (data_parallel(candidate) && algo_fits(handle, with_rows(p, 1), candidate.algo)) {
      pinned.found = true;
      pinned.algo = candidate.algo;
      return pinned;
    }
  }
  return pinned;
}

// The plan of a pinned product at its own M: the configuration's algorithm (chosen on first use),
// checked at this M; where it does not fit, the heuristic's first answer for this M under the
// same limits (a deterministic rule, but no longer the same kernel for every M: reported as
// pinned_fallback). Never timed.
std::unique_ptr<Plan> make_pinned_plan(cublasLtHandle_t handle, Cache& c, int device,
                                       const GemmProduct& p, const ColumnMajorProduct& cm) {
  const std::string key = pinned_key_of(device, p, cm);
  auto found = c.pinned.find(key);
  if (found == c.pinned.end()) found = c.pinned.emplace(key, choose_pinned(handle, p)).first;
  const PinnedAlgo& pinned = found->second;
  std::unique_ptr<Plan> plan = describe(p, cm);
  plan->pinned = true;
  plan->tuned = true;
  if (pinned.found) {
    cublasLtMatmulHeuristicResult_t result{};
    if (cublasLtMatmulAlgoCheck(handle, plan->desc, plan->layout_a, plan->layout_b, plan->layout_c,
                                plan->layout_c, &pinned.algo, &result) == CUBLAS_STATUS_SUCCESS) {
      result.algo = pinned.algo;
      if (data_parallel(result)) {
        plan->candidates[0] = result;
        plan->candidate_count = 1;
        return plan;
      }
    }
  }
  if (!find_candidates(handle, *plan, p, cm, 0)) return nullptr;
  plan->pinned_fallback = true;
  return plan;
}

cublasStatus_t run_product(cublasLtHandle_t handle, const Plan& plan, int candidate,
                           const GemmProduct& product, const ColumnMajorProduct& cm,
                           GemmScratch scratch, cudaStream_t stream) {
  const cublasLtMatmulHeuristicResult_t& algo = plan.candidates[candidate];
  return cublasLtMatmul(handle, plan.desc, &product.alpha, cm.first->data, plan.layout_a,
                        cm.second->data, plan.layout_b, &product.beta, product.c.data,
                        plan.layout_c, const_cast<void*>(product.c.data), plan.layout_c, &algo.algo,
                        scratch.data, algo.workspaceSize, stream);
}

// Times every candidate on the product's own operands and keeps the fastest (decision 58). Only
// for a product that writes its output over (beta = 0): the candidates' outputs are then
// overwritten by the call that follows. Not while the stream is captured into a CUDA graph,
// where the events cannot be waited on; the next uncaptured call tunes instead.
void tune(cublasLtHandle_t handle, Plan& plan, const GemmProduct& product,
          const ColumnMajorProduct& cm, GemmScratch scratch, cudaStream_t stream) {
  // beta first: an accumulating call of an untimed configuration returns without an API call.
  if (product.beta != 0.0f) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  XENT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  const int count = plan.candidate_count;
  constexpr int kRounds = 3;
  // Events per (round, candidate), recorded back to back: one host wait for all of them.
  const int event_count = kRounds * count + 1;
  cudaEvent_t events[kRounds * kCandidates + 1] = {};
  for (int e = 0; e < event_count; ++e) XENT_CUDA_CHECK(cudaEventCreate(&events[e]));
  bool runs[kCandidates] = {};
  for (int i = 0; i < count; ++i) {  // untimed round: clocks, caches, and who can run at all
    runs[i] = run_product(handle, plan, i, product, cm, scratch, stream) == CUBLAS_STATUS_SUCCESS;
  }
  XENT_CUDA_CHECK(cudaEventRecord(events[0], stream));
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < count; ++i) {
      if (runs[i]) run_product(handle, plan, i, product, cm, scratch, stream);
      XENT_CUDA_CHECK(cudaEventRecord(events[1 + round * count + i], stream));
    }
  }
  XENT_CUDA_CHECK(cudaEventSynchronize(events[event_count - 1]));
  float best[kCandidates] = {};
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < count; ++i) {
      float ms = 0.0f;
      XENT_CUDA_CHECK(
          cudaEventElapsedTime(&ms, events[round * count + i], events[1 + round * count + i]));
      best[i] = round == 0 ? ms : std::min(best[i], ms);
    }
  }
  for (int e = 0; e < event_count; ++e) cudaEventDestroy(events[e]);
  int fastest = -1;
  for (int i = 0; i < count; ++i) {
    if (runs[i] && (fastest < 0 || best[i] < best[fastest])) fastest = i;
  }
  plan.tuned = true;
  if (fastest < 0) return;  // none runs: the call below reports the heuristic's first
  plan.chosen = runs[0] && best[fastest] > kTuneMargin * best[0] ? 0 : fastest;
}

// The bias of a product for which cuBLASLt offers no algorithm with the bias epilogue: c is
// filled with the bias rows and the product adds into it (beta = 1), which into a 16-bit c may
// round twice (note 149).
template <class C, class B>
__global__ void fill_bias_kernel(C* c, int64_t rows, int64_t cols, int64_t stride, const B* bias) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / cols, col = i % cols;
    c[row * stride + col] = store_float<C>(load_float(bias[col]));
  }
}

template <class B>
void fill_bias_to(const GemmMatrix& c, const B* bias, cudaStream_t stream) {
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((c.rows * c.cols + threads - 1) / threads, 65536);
  void* data = const_cast<void*>(c.data);
  switch (c.dtype) {
    case DType::f32:
      fill_bias_kernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(data), c.rows, c.cols,
                                                       c.stride, bias);
      break;
    case DType::bf16:
      fill_bias_kernel<<<blocks, threads, 0, stream>>>(static_cast<bf16_t*>(data), c.rows, c.cols,
                                                       c.stride, bias);
      break;
    default:
      fill_bias_kernel<<<blocks, threads, 0, stream>>>(static_cast<f16_t*>(data), c.rows, c.cols,
                                                       c.stride, bias);
  }
  XENT_CUDA_CHECK_LAUNCH();
}

void fill_bias(const GemmMatrix& c, const void* bias, DType bias_dtype, cudaStream_t stream) {
  if (c.rows == 0 || c.cols == 0) return;
  switch (bias_dtype) {
    case DType::f32:
      fill_bias_to(c, static_cast<const float*>(bias), stream);
      break;
    case DType::bf16:
      fill_bias_to(c, static_cast<const bf16_t*>(bias), stream);
      break;
    default:
      fill_bias_to(c, static_cast<const f16_t*>(bias), stream);
  }
}

}  // namespace

void gemm(const GemmProduct& requested, GemmScratch scratch, cudaStream_t stream) {
  if (requested.c.rows == 0 || requested.c.cols == 0) return;
  GemmProduct product = requested;
  // cuBLASLt's bias epilogue reads the bias in 16-byte vectors: from a lower alignment (a view at
  // an odd offset, a block of fewer than eight columns) it faults. Such a bias is copied to the
  // front of the scratch, which then serves cuBLASLt from past the copy; where the scratch cannot
  // hold it, the product adds onto c filled with the bias (below), as without an epilogue.
  bool fill_unaligned_bias = false;
  if (product.bias && alignment_of(product.bias) < kBiasAlignment) {
    const std::size_t bytes =
        static_cast<std::size_t>(product.c.cols) * dtype_size(product.a.dtype);
    const std::size_t held =
        (bytes + kScratchAlignment - 1) / kScratchAlignment * kScratchAlignment;
    if (scratch.data != nullptr && alignment_of(scratch.data) >= kBiasAlignment &&
        scratch.bytes >= held) {
      XENT_CUDA_CHECK(
          cudaMemcpyAsync(scratch.data, product.bias, bytes, cudaMemcpyDeviceToDevice, stream));
      product.bias = scratch.data;
      scratch = GemmScratch{static_cast<char*>(scratch.data) + held, scratch.bytes - held};
    } else {
      fill_unaligned_bias = true;
    }
  }
  const ColumnMajorProduct cm = to_column_major(product);
  int device = 0;
  XENT_CUDA_CHECK(cudaGetDevice(&device));
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const cublasLtHandle_t handle = handle_for(c, device);

  if (product.pinned && product.a_transposed) {
    throw Error(ErrorKind::runtime, "gemm: a pinned product takes a untransposed");
  }
  if (product.bias && product.beta != 0.0f) {
    throw Error(ErrorKind::runtime, "gemm: a product with a bias writes c over (beta 0)");
  }
  GemmProduct effective = product;
  if (fill_unaligned_bias) effective.bias = nullptr;
  auto make = [&](const GemmProduct& p) {
    return p.pinned ? make_pinned_plan(handle, c, device, p, cm)
                    : make_plan(handle, p, cm, scratch.bytes);
  };
  std::string key = plan_key(device, effective, cm, scratch.bytes);
  auto found = c.plans.find(key);
  if (found == c.plans.end()) {
    std::unique_ptr<Plan> plan = make(effective);
    if (!plan && effective.bias) {
      // No fused-bias kernel for this combination: the plain product onto c filled with the
      // bias (below).
      effective.bias = nullptr;
      plan = make(effective);
    }
    if (!plan) {
      throw Error(ErrorKind::runtime,
                  "gemm: cuBLASLt offers no algorithm for " + key + " (device:m,n,k:...)");
    }
    found = c.plans.emplace(key, std::move(plan)).first;
  }
  Plan& plan = *found->second;
  if (plan.has_bias) {
    XENT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &product.bias, sizeof product.bias));
  }
  if (!plan.tuned) tune(handle, plan, product, cm, scratch, stream);
  if (product.bias && !plan.has_bias) {
    // c = the bias rows, then c += the product (after tune(), whose candidates write c over).
    fill_bias(product.c, product.bias, product.a.dtype, stream);
    GemmProduct onto = product;
    onto.bias = nullptr;
    onto.beta = 1.0f;
    XENT_CUBLAS_CHECK(run_product(handle, plan, plan.chosen, onto, cm, scratch, stream));
    return;
  }
  XENT_CUBLAS_CHECK(run_product(handle, plan, plan.chosen, product, cm, scratch, stream));
}

GemmPlanState gemm_plan_state(const GemmProduct& product, GemmScratch scratch) {
  const ColumnMajorProduct cm = to_column_major(product);
  int device = 0;
  XENT_CUDA_CHECK(cudaGetDevice(&device));
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  const auto found = c.plans.find(plan_key(device, product, cm, scratch.bytes));
  if (found == c.plans.end()) return {};
  const Plan& plan = *found->second;
  GemmPlanState state{true, plan.candidate_count, plan.chosen, plan.tuned};
  state.pinned = plan.pinned;
  state.pinned_fallback = plan.pinned_fallback;
  if (plan.pinned) {
    const cublasLtMatmulHeuristicResult_t& result = plan.candidates[plan.chosen];
    state.algo_id = algo_config<int32_t>(result.algo, CUBLASLT_ALGO_CONFIG_ID);
    state.tile_id =
        static_cast<int>(algo_config<uint32_t>(result.algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
    state.split_k = algo_config<int32_t>(result.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
    state.reduction_scheme =
        static_cast<int>(algo_config<uint32_t>(result.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME));
    state.workspace_bytes = result.workspaceSize;
  }
  return state;
}

}  // namespace xent::cuda
