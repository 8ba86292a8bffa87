// What the fused Hopper products of linear_ce share (fused_stats_product.cu: the row statistics
// of x = h·Wᵀ; fused_grad_product.cu: the gradient of x from a saved lse): one CUTLASS sm_90a
// kernel, persistent and warp-specialised (TMA loads, wgmma, two consumer warpgroups cooperating
// on a 128×256 tile, K-tile 64, clusters of two CTAs), whose epilogue is an operator of our own
// called with each consumer thread's fp32 accumulators; the tile order; the rounding of x to the
// operands' dtype; the accumulator layout those epilogues walk.
//
// Included only by the translation units compiled for sm_90a with the CUTLASS headers
// (XENT_FUSED_SM90A; CMakeLists.txt).
#pragma once

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
#include <type_traits>

#include "cuda/core/device.cuh"
#include "cuda/sm90/tile_grid.hpp"

namespace xent::cuda::fused {

// Both consumer warpgroups on one 128×256 tile (the cooperative schedule), in clusters of two
// CTAs on neighbouring row tiles that share each W tile's load (TMA multicast): the ping-pong
// schedule with 64×256 tiles was slower even without an epilogue (decision 41).
using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
constexpr int kTileRows = cute::size<0>(TileShape{});
constexpr int kTileColumns = cute::size<1>(TileShape{});
// The tile grid's rules (tile_grid.hpp) are stated for this shape; host code without CUTLASS
// (fused_stats.cu's chunks) reads it there.
static_assert(TileGrid{}.tile_rows == kTileRows && TileGrid{}.tile_columns == kTileColumns &&
                  TileGrid{}.cluster_rows == cute::size<0>(ClusterShape{}) &&
                  TileGrid{}.cluster_columns == cute::size<1>(ClusterShape{}),
              "tile_grid.hpp's default shape must be the kernel's");

// Conversions of fp32 to a 16-bit S (bf16 or f16), rounding to nearest-even: the rounding of
// fused_product.cuh's round_logits and of a cuBLASLt product storing 16-bit logits.
template <class S>
struct Packed;
template <>
struct Packed<cutlass::bfloat16_t> {
  using Pair = __nv_bfloat162;
  using One = __nv_bfloat16;
  static CUTLASS_DEVICE Pair pair(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static CUTLASS_DEVICE One one(float a) { return __float2bfloat16_rn(a); }
};
template <>
struct Packed<cutlass::half_t> {
  using Pair = __half2;
  using One = __half;
  static CUTLASS_DEVICE Pair pair(float a, float b) { return __floats2half2_rn(a, b); }
  static CUTLASS_DEVICE One one(float a) { return __float2half_rn(a); }
};

template <class S, int kN>
CUTLASS_DEVICE void round_in_place(float (&x)[kN]) {
  static_assert(kN % 2 == 0, "pairs");
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kN; k += 2) {
    const typename Packed<S>::Pair pair = Packed<S>::pair(x[k], x[k + 1]);
    x[k] = __low2float(pair);
    x[k + 1] = __high2float(pair);
  }
}

// x rounded to nearest-even in place to bf16 (round_to 1) or f16 (2), as a cuBLASLt product
// storing 16-bit logits rounds them; 0 leaves it. A uniform branch per tile; each loop costs
// ~1.5 instructions per value (a packed convert and the unpacking), only when taken.
template <int kN>
CUTLASS_DEVICE void round_logits(float (&x)[kN], int round_to) {
  if (round_to == 1) {
    round_in_place<cutlass::bfloat16_t>(x);
  } else if (round_to == 2) {
    round_in_place<cutlass::half_t>(x);
  }
}

// A bias (docs/semantics.md §2) in the operands' 16-bit dtype: element i as a float. It is added to the
// product's fp32 value before that value's one rounding to the operands' dtype (docs/semantics.md §6: the
// float64 logits rounded once; a second rounding measured 1.6-1.8 × the entropy's error,
// decision 90): the statistics product adds it in its epilogue, the gradient product's consumers
// before they stage the tile (fused_epilogue_kernel.cuh).
struct HalfVector {
  const uint16_t* values = nullptr;  // null: none
  bool is_f16 = false;               // else bf16
  CUTLASS_DEVICE float operator[](int64_t i) const {
    const uint16_t bits = __ldg(values + i);
    return is_f16 ? __half2float(__ushort_as_half(bits))
                  : __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
};

// The wgmma accumulator layout (CUTLASS's GMMA::CLayout_64xN): in a warpgroup's 64-row slab,
// thread t = t0 + 4·t1 + 32·t2 (t0 < 4) holds rows t1 + 16·t2 and that + 8 (value mode 1),
// columns 2·t0 + {0, 1} (value mode 0) + 8·j (value mode 2). So one row of a tile lives in the 4
// lanes of a quad (lane bits 0–1), each holding a strided quarter of its columns, in pairs of
// adjacent columns. AccumulatorRows checks that layout (any other is refused at compile time)
// and walks it: for each row a thread holds, the row within the tile, and for each of its values
// (kValues per row, in increasing column order) the value and its column within the tile.
template <class FrgLayout, class TiledMma>
struct AccumulatorRows {
  static constexpr int kAtomN = cute::size<1>(typename TiledMma::AtomShape_MNK{});
  static_assert(cute::size<0>(typename TiledMma::AtomShape_MNK{}) == 64, "wgmma atom of 64 rows");
  static_assert(std::is_same_v<typename TiledMma::AtomLayoutC_TV, cute::GMMA::CLayout_64xN<kAtomN>>,
                "the fused epilogues assume the wgmma 64xN accumulator layout");
  static_assert(cute::rank<0>(FrgLayout{}) == 3 && cute::size<0, 0>(FrgLayout{}) == 2 &&
                    cute::size<0, 1>(FrgLayout{}) == 2 &&
                    cute::size<0, 2>(FrgLayout{}) == kAtomN / 8,
                "accumulator fragment ((2,2,N/8), MMA_M, MMA_N) expected");
  static_assert(cute::is_static<FrgLayout>::value, "static accumulator layout expected");
  static constexpr int kPairs = 2, kGroups = kAtomN / 8;
  static constexpr int kTilesM = cute::size<1>(FrgLayout{});
  static constexpr int kTilesN = cute::size<2>(FrgLayout{});
  static constexpr int kValues = kTilesN * kGroups * kPairs;  // of one row, per thread
  static constexpr int kRows = kTilesM * 2;                   // rows per thread

  // (m, n) of every accumulator value inside the tile, partitioned exactly like the values.
  template <class Coords>
  CUTLASS_DEVICE static int row_of(const Coords& coords, int r) {
    using namespace cute;
    return static_cast<int>(get<0>(coords(make_coord(make_coord(0, r % 2, 0), r / 2, 0))));
  }
  // f(k, column within the tile, accumulator value) for the kValues values of row r.
  template <class Coords, class Accumulators, class F>
  CUTLASS_DEVICE static void for_each_value(const Coords& coords, const Accumulators& acc, int r,
                                            F&& f) {
    using namespace cute;
    CUTLASS_PRAGMA_UNROLL
    for (int nn = 0; nn < kTilesN; ++nn) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kGroups; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int p = 0; p < kPairs; ++p) {
          const auto at = make_coord(make_coord(p, r % 2, j), r / 2, nn);
          f((nn * kGroups + j) * kPairs + p, static_cast<int>(get<1>(coords(at))), acc(at));
        }
      }
    }
  }
  // The column within the tile of value k of a row (k known at run time; the layout is
  // arithmetic).
  template <class Coords>
  CUTLASS_DEVICE static int column_of(const Coords& coords, int k) {
    using namespace cute;
    const int p = k % kPairs, j = (k / kPairs) % kGroups, nn = k / (kPairs * kGroups);
    return static_cast<int>(get<1>(coords(make_coord(make_coord(p, 0, j), 0, nn))));
  }
  // The inverse of column_of: the k of the value this thread holds at `column` of the tile (in
  // each of its rows), or -1 where another lane of the quad holds it or the column lies outside.
  // column = 2·t0 + p + 8·j + kAtomN·nn, and column_of(coords, 0) = 2·t0.
  template <class Coords>
  CUTLASS_DEVICE static int value_at(const Coords& coords, int column) {
    if (column < 0 || column >= kTilesN * kAtomN) return -1;
    const int within = column % kAtomN;
    if ((within & 6) != column_of(coords, 0)) return -1;
    return ((column / kAtomN) * kGroups + (within >> 3)) * kPairs + (within & 1);
  }
};

// The members CUTLASS's Sm90TmaWarpSpecializedAdapter needs of an operator-style epilogue (its
// DefaultEpilogue's form), for an epilogue whose arguments are its parameters and which needs no
// workspace, shared memory, C operand or tiled copies. Derived classes add operator().
template <class P>
class OperatorEpilogue {
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
  using Arguments = P;
  using Params = P;

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

  CUTLASS_HOST_DEVICE explicit OperatorEpilogue(Params const& params) : params_(params) {}

 protected:
  Params params_;
};

// CUTLASS's cooperative kernel as it is (the epilogue on the consumer warpgroups).
template <class Kernel>
using ConsumerEpilogueKernel = Kernel;

// The kernel of an operator epilogue E (E::Params is what it is launched with): CUTLASS's
// cooperative kernel, or KernelOf of it (fused_epilogue_kernel.cuh: the same kernel with the
// epilogue on warps of its own).
template <class Element, class E, template <class> class KernelOf = ConsumerEpilogueKernel>
struct Product {
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<E>;
  // h [rows, H] row-major is A (K-major); W [V, H] row-major is B as CUTLASS's column-major
  // [K, N] (K-major). 16-byte TMA alignment: 8 elements.
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8,
      Element, cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = KernelOf<
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The operands of one product x = A·Bᵀ: A [m, k] and B [n, k], row-major with these row strides
// (elements).
struct Operands {
  const void* a = nullptr;
  int64_t a_stride = 0;
  const void* b = nullptr;
  int64_t b_stride = 0;
  int64_t m = 0, n = 0, k = 0;
};

// Launches the product with epilogue E on `stream`. False (nothing launched) when CUTLASS cannot
// take these operands; a launch that then fails throws, naming `op`. `dependent_launch`: with
// programmatic dependent launch, for a kernel whose
// every thread that touches global memory first waits for the grids before it (or is ordered
// after one that did): its CTAs then start, set up and fetch their code while the kernel
// before it ends, which at 64 MiB's 212 short launches was each launch's ramp (decision 98).
template <class Element, class E, template <class> class KernelOf = ConsumerEpilogueKernel>
bool launch(const Operands& p, const typename E::Params& epilogue, const char* op,
            cudaStream_t stream, bool dependent_launch = false) {
  using Gemm = typename Product<Element, E, KernelOf>::Gemm;
  using Kernel = typename Product<Element, E, KernelOf>::Kernel;
  typename Kernel::StrideA stride_a{};
  typename Kernel::StrideB stride_b{};
  cute::get<0>(stride_a) = p.a_stride;
  cute::get<0>(stride_b) = p.b_stride;
  cute::get<2>(stride_a) = p.a_stride * p.m;
  cute::get<2>(stride_b) = p.b_stride * p.n;
  cutlass::KernelHardwareInfo hw_info;
  XENT_CUDA_CHECK(cudaGetDevice(&hw_info.device_id));
  hw_info.sm_count = multiprocessor_count(hw_info.device_id);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1},
      {static_cast<const Element*>(p.a), stride_a, static_cast<const Element*>(p.b), stride_b},
      epilogue,
      hw_info};
  using Raster =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;
  // The persistent scheduler's tile order: along M (consecutive clusters take the next row tiles
  // of one W column block) with a swizzle of 8 (eight column blocks interleaved), faster than
  // CUTLASS's heuristic and than along N (docs/archive/perf-notes.md, decision 43); a narrower one
  // where 8 would pad the tile grid (tile_grid.hpp: the padded tiles run the mainloop).
  args.scheduler.raster_order = Raster::AlongM;
  TileGrid grid;  // the kernel's tile and cluster (asserted above)
  grid.rows = p.m;
  grid.columns = p.n;
  args.scheduler.max_swizzle_size = least_padding_swizzle(grid);
  Gemm gemm;
  // The persistent scheduler without split-K or stream-K needs no workspace; refuse otherwise
  // rather than allocate behind the caller's back.
  if (Gemm::get_workspace_size(args) != 0) return false;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return false;
  const cutlass::Status status = gemm.run(stream, nullptr, dependent_launch);
  XENT_CUDA_CHECK_LAUNCH();
  if (status != cutlass::Status::kSuccess) {
    throw Error(ErrorKind::runtime, std::string(op) + ": a fused product failed to launch");
  }
  return true;
}

}  // namespace xent::cuda::fused
