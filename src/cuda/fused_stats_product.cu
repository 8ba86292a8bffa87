// The fused statistics product (fused_stats.hpp): x = h·Wᵀ by a persistent, warp-specialised
// CUTLASS sm_90a kernel (TMA loads, wgmma, two consumer warpgroups cooperating on a 128×256 tile,
// K-tile 64) whose epilogue reduces each accumulator tile to per-row tile partials in registers
// and quad shuffles: the logits never leave the SM.
//
// This translation unit alone is compiled for sm_90a (wgmma has no sm_90 or portable form; see
// CMakeLists.txt); built for anything else, or without the CUTLASS headers, it is a stub whose
// fused_stats_product_built() is false. Two instantiations (bf16, f16); softcap, scale and the
// target are runtime values, so the compile cost stays two kernels.
#include "cuda/fused_stats.hpp"

#if defined(XENT_FUSED_STATS_SM90A)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <type_traits>

#include "common/ce_row.hpp"
#include "cuda/device.cuh"
#include "cuda/row_slice.cuh"
#include "cuda/row_stats.cuh"

namespace xent::cuda {
namespace {

// Both consumer warpgroups on one 128×256 tile (the cooperative schedule), in clusters of two
// CTAs on neighbouring row tiles that share each W tile's load (TMA multicast). Measured on the
// H200 (decision 41): the ping-pong schedule with 64×256 tiles ran slower even without an
// epilogue; clusters of two ran 0–2 % faster than single CTAs.
using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
static_assert(cute::size<1>(TileShape{}) == kFusedTileColumns, "fused_stats.hpp tile width");

struct StatsEpilogueParams {
  float* partials = nullptr;
  int64_t tiles = 0;
  const void* target = nullptr;
  bool target_int64 = true;
  float logit_scale = 1, softcap = 0;
  bool extras = false;  // Σe·d, Σx̃ and the argmax too (entropy, smoothing, argmax, accuracy)
  bool skip = false;  // measurement only: the product without its epilogue (Measurement)
  // FusedStatsProduct::rounded_logits: x rounded to the operands' dtype first (1 bf16, 2 f16).
  int round_to = 0;
};

// x rounded to nearest-even in place, as a cuBLASLt product storing 16-bit logits rounds them
// (FusedStatsProduct::rounded_logits). A uniform branch per tile; each loop costs ~1.5
// instructions per value (a packed convert and the unpacking), only when taken.
template <int kN>
CUTLASS_DEVICE void round_logits(float (&x)[kN], int round_to) {
  static_assert(kN % 2 == 0, "pairs");
  if (round_to == 1) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kN; k += 2) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(x[k], x[k + 1]);
      x[k] = __low2float(pair);
      x[k + 1] = __high2float(pair);
    }
  } else if (round_to == 2) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kN; k += 2) {
      const __half2 pair = __floats2half2_rn(x[k], x[k + 1]);
      x[k] = __low2float(pair);
      x[k + 1] = __high2float(pair);
    }
  }
}

// Statistics of the kN values one thread holds of a row in a tile whose columns all lie inside
// the vocabulary, when they are ordinary (finite max and sums): the max by four fmaxf chains,
// e^(v−m) as 2^(v·log2(e) − m·log2(e)) on the ex2 unit (the row kernels' form, row_stats.cuh),
// four partial sums. kExtras also forms Σe·(v−m), Σv (entropy, label smoothing) and `where`, the
// index of the first value equal to the max (argmax, accuracy). About 4 instructions per value
// without extras, 8 with, against ~30 for the exact per-element path, whose code for 64 values
// per row, unrolled, also overflowed the instruction cache (decision 41, docs/perf-notes.md).
// False when something is not ordinary (NaN, ±Inf, or a part that is all -inf): the caller then
// runs exact_row_stats, which defines those cases as RowStats::add does.
template <bool kExtras, int kN>
CUTLASS_DEVICE bool lean_row_stats(const float (&v)[kN], common::RowStats<float>& stats,
                                   int& where) {
  static_assert(kN % 4 == 0, "four chains");
  float max4[4] = {-common::infinity<float>(), -common::infinity<float>(),
                   -common::infinity<float>(), -common::infinity<float>()};
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kN; ++k) max4[k % 4] = fmaxf(max4[k % 4], v[k]);  // fmaxf drops NaN
  const float m = fmaxf(fmaxf(max4[0], max4[1]), fmaxf(max4[2], max4[3]));
  if (!(m > -common::infinity<float>() && m < common::infinity<float>())) return false;
  const float m_log2e = m * kLog2e;
  float sum4[4] = {0, 0, 0, 0}, shift4[4] = {0, 0, 0, 0}, logits4[4] = {0, 0, 0, 0};
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kN; ++k) {
    const float e = fast_exp2(fmaf(v[k], kLog2e, -m_log2e));
    sum4[k % 4] += e;
    if constexpr (kExtras) {
      // A -inf value gives 0·-inf = NaN here, caught below.
      shift4[k % 4] = fmaf(e, v[k] - m, shift4[k % 4]);
      logits4[k % 4] += v[k];
    }
  }
  stats.max = m;
  stats.sum_exp = (sum4[0] + sum4[1]) + (sum4[2] + sum4[3]);
  if (!(stats.sum_exp <= FLT_MAX)) return false;  // a NaN value (dropped by fmaxf) or overflow
  if constexpr (kExtras) {
    stats.sum_exp_shift = (shift4[0] + shift4[1]) + (shift4[2] + shift4[3]);
    if (stats.sum_exp_shift != stats.sum_exp_shift) return false;  // a -inf value
    stats.sum_logits = (logits4[0] + logits4[1]) + (logits4[2] + logits4[3]);
    stats.sum_weighted_logits = stats.sum_logits;
    where = 0;
    CUTLASS_PRAGMA_UNROLL
    for (int k = kN - 1; k >= 0; --k) {
      if (v[k] == m) where = k;
    }
  }
  return true;
}

// The exact per-element statistics (RowStats::add's cases: NaN takes the argmax, -inf adds
// nothing), for the vocabulary's last, partial tile and for values lean_row_stats declines.
// Columns ≥ V enter no statistic.
template <int kN, class ForEachValue>
CUTLASS_DEVICE void exact_row_stats(const float (&value)[kN], ForEachValue&& for_each_value,
                                    int cols, common::RowStats<float>& stats) {
  float max = -common::infinity<float>();
  int argmax = -1;
  for_each_value([&](int k, int col, float) {
    const float v = value[k];
    if (col < cols && (v > max || argmax < 0 || (v != v && max == max))) {
      max = v;
      argmax = col;
    }
  });
  stats = common::RowStats<float>();
  stats.max = max;
  stats.argmax = argmax;
  for_each_value([&](int k, int col, float) {
    const float v = value[k];
    if (col >= cols) return;
    stats.sum_logits += v;
    if (v != -common::infinity<float>()) {  // e^-inf = 0; v − max would be NaN
      const float d = v - max;
      const float e = ::exp2f(d * kLog2e);
      stats.sum_exp += e;
      stats.sum_exp_shift += e * d;
    }
  });
  stats.sum_weighted_logits = stats.sum_logits;
}

// The quad merge of lean statistics without extras: the quad's max, each lane's sum rescaled to
// it with one ex2, two shuffled sums (RowStats::merge would form two precise exponentials per
// round). Valid in every lane.
CUTLASS_DEVICE void quad_merge_lean(common::RowStats<float>& stats) {
  constexpr unsigned kAll = 0xffffffffu;
  float m = stats.max;
  m = fmaxf(m, __shfl_xor_sync(kAll, m, 1));
  m = fmaxf(m, __shfl_xor_sync(kAll, m, 2));
  float sum = stats.sum_exp * fast_exp2((stats.max - m) * kLog2e);
  sum += __shfl_xor_sync(kAll, sum, 1);
  sum += __shfl_xor_sync(kAll, sum, 2);
  stats.max = m;
  stats.sum_exp = sum;
}

// Operator-style epilogue (the form Sm90TmaWarpSpecializedAdapter wraps; see CUTLASS's
// DefaultEpilogue): called once per output tile by each consumer thread with its accumulators.
class StatsEpilogue {
 public:
  using ElementC = float;
  using ElementD = float;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = void;  // named by GemmUniversalAdapter, not used by 3.x kernels
  struct SharedStorage {};
  using TensorStorage = SharedStorage;
  using Arguments = StatsEpilogueParams;
  using Params = StatsEpilogueParams;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static std::size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE explicit StatsEpilogue(Params const& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK block_shape,
                                 BlockCoordMNKL block_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    // The wgmma accumulator layout (CUTLASS's GMMA::CLayout_64xN): in a warpgroup's 64-row slab,
    // thread t = t0 + 4·t1 + 32·t2 (t0 < 4) holds rows t1 + 16·t2 and that + 8 (value mode 1),
    // columns 2·t0 + {0, 1} (value mode 0) + 8·j (value mode 2). So one row of a tile lives in
    // the 4 lanes of a quad (lane bits 0–1), each holding a strided quarter of its columns: the
    // per-row reduction is in registers, then two xor-shuffles. Refuse any other layout.
    constexpr int kAtomN = size<1>(typename TiledMma::AtomShape_MNK{});
    static_assert(size<0>(typename TiledMma::AtomShape_MNK{}) == 64, "wgmma atom of 64 rows");
    static_assert(std::is_same_v<typename TiledMma::AtomLayoutC_TV, GMMA::CLayout_64xN<kAtomN>>,
                  "the statistics epilogue assumes the wgmma 64xN accumulator layout");
    static_assert(rank<0>(FrgLayout{}) == 3 && size<0, 0>(FrgLayout{}) == 2 &&
                      size<0, 1>(FrgLayout{}) == 2 && size<0, 2>(FrgLayout{}) == kAtomN / 8,
                  "accumulator fragment ((2,2,N/8), MMA_M, MMA_N) expected");
    static_assert(is_static<FrgLayout>::value, "static accumulator layout expected");
    constexpr int kPairs = 2, kGroups = kAtomN / 8;
    constexpr int kTilesM = size<1>(FrgLayout{}), kTilesN = size<2>(FrgLayout{});
    constexpr int kValues = kTilesN * kGroups * kPairs;  // of one row, per thread

    const int rows = static_cast<int>(get<0>(problem_shape_mnkl));
    const int cols = static_cast<int>(get<1>(problem_shape_mnkl));
    const int m_block = static_cast<int>(get<0>(block_coord_mnkl));
    const int n_block = static_cast<int>(get<1>(block_coord_mnkl));
    // The scheduler pads the tile grid to whole swizzle groups and clusters: tiles past the last
    // column tile (or past the last row: their rows fail `row < rows` below) hold no columns of
    // x and must write nothing (their partial would land in the next row's).
    if (params_.skip || n_block >= params_.tiles) return;
    const int row0 = m_block * size<0>(block_shape);
    const int col0 = n_block * size<1>(block_shape);
    // The last column tile of a vocabulary that is not a multiple of the tile holds columns ≥ V
    // (TMA fills them with zeros); only that tile checks columns per element.
    const bool whole_tile = col0 + static_cast<int>(size<1>(block_shape)) <= cols;

    // (m, n) of every accumulator value inside the tile, partitioned exactly like the values.
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thr_mma.partition_C(make_identity_tensor(take<0, 2>(block_shape)));
    CUTE_STATIC_ASSERT_V(size(coords) == size(accumulators));

    common::Transform<float> row_transform;
    row_transform.scale = params_.logit_scale;
    row_transform.softcap = params_.softcap;
    const bool quad_leader = (thread_idx & 3) == 0;

    // The softcap and the scale are resolved once per tile (row_stats.cuh's with_transform), so
    // each element's code holds only the transform it needs.
    with_transform(row_transform, [&](const auto& transform) {
      CUTLASS_PRAGMA_UNROLL
      for (int mm = 0; mm < kTilesM; ++mm) {
        CUTLASS_PRAGMA_UNROLL
        for (int half = 0; half < 2; ++half) {
          const int row = row0 + get<0>(coords(make_coord(make_coord(0, half, 0), mm, 0)));
          int64_t y = -1;
          if (row < rows) {
            y = params_.target_int64 ? static_cast<const int64_t*>(params_.target)[row]
                                     : static_cast<const int32_t*>(params_.target)[row];
          }
          // Every value of this row the thread holds, in increasing column order: f(k, column, x).
          auto for_each_value = [&](auto&& f) {
            CUTLASS_PRAGMA_UNROLL
            for (int nn = 0; nn < kTilesN; ++nn) {
              CUTLASS_PRAGMA_UNROLL
              for (int j = 0; j < kGroups; ++j) {
                CUTLASS_PRAGMA_UNROLL
                for (int p = 0; p < kPairs; ++p) {
                  const auto at = make_coord(make_coord(p, half, j), mm, nn);
                  f((nn * kGroups + j) * kPairs + p, col0 + get<1>(coords(at)), accumulators(at));
                }
              }
            }
          };
          // The column of value k (k from 0 to kValues − 1 at run time; the layout is arithmetic).
          auto column_of = [&](int k) {
            const int p = k % kPairs, j = (k / kPairs) % kGroups, nn = k / (kPairs * kGroups);
            const auto at = make_coord(make_coord(p, half, j), mm, nn);
            return col0 + static_cast<int>(get<1>(coords(at)));
          };
          float value[kValues];
          for_each_value([&](int k, int, float x) { value[k] = x; });
          round_logits(value, params_.round_to);
          CUTLASS_PRAGMA_UNROLL
          for (int k = 0; k < kValues; ++k) value[k] = transform.value(value[k]);

          common::RowStats<float> stats;
          bool lean = false;
          if (whole_tile) {
            int where = 0;
            lean = params_.extras ? lean_row_stats<true>(value, stats, where)
                                  : lean_row_stats<false>(value, stats, where);
            stats.argmax = params_.extras ? column_of(where) : col0;  // col0: never read
          }
          if (!lean) exact_row_stats(value, for_each_value, cols, stats);
          float target_logit = 0;  // x̃_y in the one lane holding column y, else 0
          if (y >= col0 && y < col0 + static_cast<int64_t>(size<1>(block_shape)) && y < cols) {
            for_each_value([&](int k, int col, float) {
              if (col == y) target_logit = value[k];
            });
          }
          // The quad's four column quarters, merged into its first lane.
          if (__all_sync(0xffffffffu, lean) && !params_.extras) {
            quad_merge_lean(stats);
          } else {
            CUTLASS_PRAGMA_UNROLL
            for (int offset = 2; offset > 0; offset >>= 1) stats.merge(shuffle_down(stats, offset));
          }
          CUTLASS_PRAGMA_UNROLL
          for (int offset = 2; offset > 0; offset >>= 1) {
            target_logit += __shfl_down_sync(0xffffffffu, target_logit, offset);
          }
          if (quad_leader && row < rows) {
            float* record =
                params_.partials + (static_cast<int64_t>(row) * params_.tiles + n_block) *
                                       kTilePartialWidth;
            // 24-byte records on a 256-byte aligned base: three aligned 8-byte stores.
            reinterpret_cast<float2*>(record)[0] = make_float2(stats.max, stats.sum_exp);
            reinterpret_cast<float2*>(record)[1] =
                make_float2(stats.sum_exp_shift, stats.sum_logits);
            reinterpret_cast<float2*>(record)[2] = make_float2(
                common::bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(stats.argmax))),
                target_logit);
          }
        }
      }
    });
  }

 private:
  Params params_;
};
static_assert(kTileMax == 0 && kTileSumExp == 1 && kTileSumExpShift == 2 && kTileSumLogits == 3 &&
                  kTileArgmax == 4 && kTileTargetLogit == 5 && kTilePartialWidth == 6,
              "the epilogue's stores follow the FusedTileColumn order");

using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<StatsEpilogue>;

template <class Element>
struct StatsProduct {
  // h [rows, H] row-major is A (K-major); W [V, H] row-major is B as CUTLASS's column-major
  // [K, N] (K-major). 16-byte TMA alignment: 8 elements.
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The persistent scheduler's tile order: along M (consecutive clusters take the next row tiles
// of one W column block) with a swizzle of 8 (eight column blocks interleaved), measured on the
// H200 against CUTLASS's heuristic (along M here, swizzle 1) and along N: 1.5–4.4 % faster at the
// three linear_ce shapes (docs/perf-notes.md, decision 43).
// Measurement switches, read once: XENT_CUDA_FUSED_SKIP=1 makes the epilogue return at once (the
// product's time without it; the results are then wrong); XENT_CUDA_FUSED_RASTER=h|m|n (h:
// CUTLASS's heuristic) and XENT_CUDA_FUSED_SWIZZLE=1|2|4|8 replace the order above.
struct Measurement {
  bool skip = false;
  char raster = 'm';
  int swizzle = 8;
};
const Measurement& measurement() {
  static const Measurement m = [] {
    Measurement m;
    const char* skip = std::getenv("XENT_CUDA_FUSED_SKIP");
    const char* raster = std::getenv("XENT_CUDA_FUSED_RASTER");
    const char* swizzle = std::getenv("XENT_CUDA_FUSED_SWIZZLE");
    m.skip = skip != nullptr && skip[0] == '1';
    if (raster != nullptr && (raster[0] == 'h' || raster[0] == 'm' || raster[0] == 'n')) {
      m.raster = raster[0];
    }
    if (swizzle != nullptr) m.swizzle = std::max(1, std::atoi(swizzle));
    return m;
  }();
  return m;
}

template <class Element>
bool launch(const FusedStatsProduct& p, cudaStream_t stream) {
  using Gemm = typename StatsProduct<Element>::Gemm;
  using Kernel = typename StatsProduct<Element>::Kernel;
  typename Kernel::StrideA stride_a{};
  typename Kernel::StrideB stride_b{};
  cute::get<0>(stride_a) = p.hidden_stride;
  cute::get<0>(stride_b) = p.weight_stride;
  cute::get<2>(stride_a) = p.hidden_stride * p.rows;
  cute::get<2>(stride_b) = p.weight_stride * p.vocab;
  StatsEpilogueParams epilogue;
  epilogue.partials = p.partials;
  epilogue.tiles = p.tiles;
  epilogue.target = p.target;
  epilogue.target_int64 = p.target_int64;
  epilogue.logit_scale = p.logit_scale;
  epilogue.softcap = p.softcap;
  epilogue.extras = p.extras;
  epilogue.round_to = !p.rounded_logits ? 0 : p.dtype == DType::bf16 ? 1 : 2;
  epilogue.skip = measurement().skip;
  cutlass::KernelHardwareInfo hw_info;
  XENT_CUDA_CHECK(cudaGetDevice(&hw_info.device_id));
  hw_info.sm_count = multiprocessor_count(hw_info.device_id);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(p.rows), static_cast<int>(p.vocab), static_cast<int>(p.hidden_size), 1},
      {static_cast<const Element*>(p.hidden), stride_a, static_cast<const Element*>(p.weight),
       stride_b},
      epilogue,
      hw_info};
  using Raster =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;
  if (measurement().raster == 'm') args.scheduler.raster_order = Raster::AlongM;
  if (measurement().raster == 'n') args.scheduler.raster_order = Raster::AlongN;
  args.scheduler.max_swizzle_size = measurement().swizzle;
  Gemm gemm;
  // The persistent scheduler without split-K or stream-K needs no workspace; refuse otherwise
  // rather than allocate behind the caller's back.
  if (Gemm::get_workspace_size(args) != 0) return false;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return false;
  const cutlass::Status status = gemm.run(stream);
  XENT_CUDA_CHECK_LAUNCH();
  if (status != cutlass::Status::kSuccess) {
    throw Error(ErrorKind::runtime,
                "linear_ce_forward: the fused statistics product failed to launch");
  }
  return true;
}

}  // namespace

bool fused_stats_product_built() { return true; }

bool fused_stats_product(const FusedStatsProduct& product, cudaStream_t stream) {
  switch (product.dtype) {
    case DType::bf16: return launch<cutlass::bfloat16_t>(product, stream);
    case DType::f16: return launch<cutlass::half_t>(product, stream);
    default: return false;
  }
}

}  // namespace xent::cuda

#else  // not built for sm_90a, or no CUTLASS headers

namespace xent::cuda {

bool fused_stats_product_built() { return false; }

bool fused_stats_product(const FusedStatsProduct&, cudaStream_t) { return false; }

}  // namespace xent::cuda

#endif
