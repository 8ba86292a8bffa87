// Host side of the row-slice plan shared by the ce and distill row kernels (row_slice.cuh).
#include "cuda/rows/row_slice.cuh"

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace xent::cuda {

namespace {
// Staged slices: 64 KiB, three CTAs per multiprocessor.
constexpr std::size_t shared_slice_bytes() { return 64 * 1024; }
// Streamed slices (read from HBM, nothing staged) of a forward without gradient: shared memory
// does not limit them, and fewer CTAs per row cost fewer cluster exchanges. 128 KiB (a 65536-
// column bf16 row in one CTA, 131072 in a cluster of 2) was the fastest size measured
// (docs/archive/perf-notes.md, decisions 31 and 32).
constexpr std::size_t streamed_slice_bytes() { return 128 * 1024; }
constexpr int64_t round_up(int64_t value, int64_t step) { return (value + step - 1) / step * step; }

std::size_t max_shared_per_block() {
  int device = 0, bytes = 0;
  XENT_CUDA_CHECK(cudaGetDevice(&device));
  XENT_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // Leave room for the kernels' static shared memory (barriers, reduction scratch, slots).
  return static_cast<std::size_t>(bytes) - 4096;
}

// The smallest cluster whose slices are at most `target` bytes (kMaxCluster when none is), with
// the thread count of such slices; not yet decided whether they are staged.
SlicePlan plan_slices_of(int64_t vocab, std::size_t element, int inputs, std::size_t target,
                         int max_cluster) {
  const int64_t vec = 16 / static_cast<int64_t>(element);
  SlicePlan plan;
  auto slice_for = [&](int cluster) { return round_up((vocab + cluster - 1) / cluster, vec); };
  auto bytes_for = [&](int64_t slice) {
    return static_cast<std::size_t>(slice) * element * static_cast<std::size_t>(inputs);
  };
  plan.cluster = 0;
  for (int cluster = 1; cluster <= max_cluster; cluster *= 2) {
    if (bytes_for(slice_for(cluster)) <= target) {
      plan.cluster = cluster;
      break;
    }
  }
  if (plan.cluster == 0) plan.cluster = max_cluster;
  plan.slice_elements = slice_for(plan.cluster);
  const int64_t vectors = plan.slice_elements / vec;
  // At least four 16-byte vectors per thread: short rows (V <= 4096) then run in CTAs of 64-128
  // threads, so more rows (CTAs) share a multiprocessor instead of idle threads filling it.
  plan.threads = static_cast<int>(
      std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, round_up((vectors + 3) / 4, 32))));
  plan.staged = false;
  plan.shared_bytes = 0;
  return plan;
}
}  // namespace

void allow_dynamic_shared(const void* kernel, std::size_t bytes) {
  if (bytes == 0) return;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, std::size_t> allowed;
  int device = 0;
  XENT_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto [entry, first] = allowed.try_emplace({kernel, device}, 0);
  std::size_t& current = entry->second;
  if (first) {
    // What the kernel may take untouched is 48 KiB less its static shared memory (slots,
    // barriers), not 48 KiB: a plan just under 48 KiB would not launch.
    cudaFuncAttributes attributes{};
    XENT_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    current = static_cast<std::size_t>(attributes.maxDynamicSharedSizeBytes);
  }
  if (current >= bytes) return;
  XENT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
  current = bytes;
}

SlicePlan plan_row_slices(int64_t vocab, std::size_t element, int inputs, int max_cluster) {
  const bool hopper = hopper_paths();
  SlicePlan plan =
      plan_slices_of(vocab, element, inputs, shared_slice_bytes(), hopper ? max_cluster : 1);
  plan.hopper = hopper;
  const std::size_t bytes =
      static_cast<std::size_t>(plan.slice_elements) * element * static_cast<std::size_t>(inputs);
  const int64_t vectors = plan.slice_elements / (16 / static_cast<int64_t>(element));
  // Staged when the slice fits in shared memory and every staged piece (threads × 16 bytes) has
  // its own mbarrier (inputs share them).
  plan.staged = bytes <= max_shared_per_block() &&
                (vectors + plan.threads - 1) / plan.threads <= kMaxPieces / inputs;
  plan.shared_bytes = plan.staged ? bytes : 0;
  return plan;
}

SlicePlan plan_portable_long_row(int64_t vocab, std::size_t element) {
  const int64_t vec = 16 / static_cast<int64_t>(element);
  SlicePlan plan;
  plan.hopper = false;
  plan.cluster = 1;
  plan.threads = kWideThreads;
  plan.slice_elements = round_up(vocab, vec);
  // Whole pieces (kWideThreads vectors, 16 KiB) of whole vectors, as many as shared memory holds
  // beside the kernel's static shared memory, and at most the kPrefixGroups that stage_prefix
  // keeps in flight.
  constexpr std::size_t piece_bytes = std::size_t{kWideThreads} * 16;
  const int64_t pieces =
      std::min<int64_t>({static_cast<int64_t>(max_shared_per_block() / piece_bytes),
                         vocab / vec / kWideThreads, kPrefixGroups});
  plan.staged = true;
  plan.staged_vectors = static_cast<int>(pieces * kWideThreads);
  plan.shared_bytes = static_cast<std::size_t>(pieces) * piece_bytes;
  return plan;
}

std::size_t row_slice_shared_limit() { return max_shared_per_block(); }

SlicePlan plan_streamed_row_slices(int64_t vocab, std::size_t element) {
  const bool hopper = hopper_paths();
  SlicePlan plan =
      plan_slices_of(vocab, element, 1, streamed_slice_bytes(), hopper ? kMaxCluster : 1);
  plan.hopper = hopper;
  return plan;
}

int row_kernel_max_cluster(const void* kernel, int wanted, int threads, std::size_t shared_bytes) {
  if (!hopper_paths()) return 1;
  if (wanted <= kMaxCluster) return kMaxCluster;
  int device = 0;
  XENT_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, std::size_t>, int> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, device, threads, shared_bytes);
  if (const auto found = known.find(key); found != known.end()) return found->second;
  int cluster = kMaxCluster;
  // Non-portable sizes exist from compute capability 9.0; a kernel must opt in before the query.
  // A refusal (of the attribute or the query) leaves the portable limit; its error, which is not
  // sticky, is taken off the runtime's last-error slot so that no later check reports it.
  int major = 0;
  XENT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  bool allowed = false;
  if (major >= 9) {
    allowed = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
              cudaSuccess;
    if (!allowed) (void)cudaGetLastError();
  }
  if (allowed) {
    allow_dynamic_shared(kernel, shared_bytes);
    for (int size = std::min(wanted, kMaxNonPortableCluster); size > kMaxCluster; size /= 2) {
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(static_cast<unsigned>(size));
      config.blockDim = dim3(static_cast<unsigned>(threads));
      config.dynamicSmemBytes = shared_bytes;
      cudaLaunchAttribute attribute{};
      attribute.id = cudaLaunchAttributeClusterDimension;
      attribute.val.clusterDim.x = static_cast<unsigned>(size);
      attribute.val.clusterDim.y = 1;
      attribute.val.clusterDim.z = 1;
      config.attrs = &attribute;
      config.numAttrs = 1;
      int clusters = 0;
      const cudaError_t status = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
      if (status != cudaSuccess) (void)cudaGetLastError();
      if (status == cudaSuccess && clusters > 0) {
        cluster = size;
        break;
      }
    }
  }
  known[key] = cluster;
  return cluster;
}

}  // namespace xent::cuda
