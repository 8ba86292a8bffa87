// The fused gradient product (fused_grad.cuh): x = h·W_blockᵀ by the persistent, warp-specialised
// CUTLASS sm_90a kernel of fused_product.cuh, whose epilogue forms ∂loss/∂x of each accumulator
// value from its row's lse and stores the gradient in the operands' dtype: the block's logits
// never leave the SM.
//
// Compiled for sm_90a with the CUTLASS headers only (CMakeLists.txt); elsewhere a stub whose
// fused_grad_product_built() is false. Two instantiations (bf16, f16); the options, the transform
// and the entropy term are run-time values resolved once per tile.
#include "cuda/fused_grad.cuh"
#include "cuda/linear_ce_plan.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace xent::cuda {
namespace {
std::atomic<int64_t> fused_grad_launches{0};
}  // namespace
}  // namespace xent::cuda

#if defined(XENT_FUSED_SM90A)

#include "cuda/fused_product.cuh"
#include "cuda/row_stats.cuh"

namespace xent::cuda {
namespace {

struct GradEpilogueParams {
  const CeGradRecord* records = nullptr;
  void* grad = nullptr;
  int64_t grad_stride = 0;
  int64_t first_column = 0;
  float logit_scale = 1, softcap = 0;
  bool entropy = false;
  int round_to = 0;    // FusedGradProduct::rounded_logits: 1 bf16, 2 f16, 0 not rounded
  bool pairs = false;  // every pair of columns (2k, 2k+1) of every row is one aligned 4-byte word
  bool vectors = false;  // every row starts 16-byte aligned (8 columns of S)
  // Measurement only (fused::Measurement): the product without its epilogue, or without stores.
  bool skip = false;
  bool skip_stores = false;
};

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

// Lane t of a quad holds, per group g of 4 words (pairs of S), the words of columns
// 32g + 8i + 2t for i = 0..3 (the accumulator layout); after this 4×4 transpose within the quad
// (two xor-shuffle rounds, 4 shuffles a group) it holds columns 32g + 8t .. 32g + 8t + 7, so one
// 16-byte store per group writes 64 contiguous bytes of the row per quad. Measured on the H200
// (docs/perf-notes.md, decision 46): with the 4-byte stores of the accumulator layout (16 bytes
// of a row per quad and instruction) the fused gradient took +1.0 / −0.4 / −1.7 % of the time
// of the cuBLASLt product and elementwise kernel at the three linear_ce shapes, with these
// 0 / −1.6 / −7.0 %.
// `live`: the lanes taking part (whole quads).
CUTLASS_DEVICE void quad_transpose(uint32_t (&w)[4], int lane, unsigned live) {
  const bool hi = lane & 2;
  uint32_t r0 = __shfl_xor_sync(live, hi ? w[0] : w[2], 2);
  uint32_t r1 = __shfl_xor_sync(live, hi ? w[1] : w[3], 2);
  const uint32_t n0 = hi ? r0 : w[0], n1 = hi ? r1 : w[1];
  const uint32_t n2 = hi ? w[2] : r0, n3 = hi ? w[3] : r1;
  const bool lo = lane & 1;
  r0 = __shfl_xor_sync(live, lo ? n0 : n1, 1);
  r1 = __shfl_xor_sync(live, lo ? n2 : n3, 1);
  w[0] = lo ? r0 : n0;
  w[1] = lo ? n1 : r0;
  w[2] = lo ? r1 : n2;
  w[3] = lo ? n3 : r1;
}

// One row's kN values (fused::AccumulatorRows order) as S, by 16-byte stores: `quad_out` is the
// row's tile start plus 8 columns per quad lane (lane t of the quad writes columns 32g + 8t);
// `live`: the lanes storing a row (whole quads).
template <class Rows, class P, int kN, class S>
CUTLASS_DEVICE void store_vectors(const float (&value)[kN], S* quad_out, unsigned live) {
  static_assert(Rows::kTilesN == 1 && Rows::kGroups % 4 == 0 && kN == Rows::kGroups * 2,
                "one 256-column atom per row: word j holds columns 8j + 2t, 8j + 2t + 1");
  const int lane = static_cast<int>(threadIdx.x & 3);
  CUTLASS_PRAGMA_UNROLL
  for (int g = 0; g < Rows::kGroups / 4; ++g) {
    uint32_t w[4];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      const typename P::Pair pair = P::pair(value[8 * g + 2 * i], value[8 * g + 2 * i + 1]);
      memcpy(&w[i], &pair, sizeof pair);
    }
    quad_transpose(w, lane, live);
    *reinterpret_cast<uint4*>(quad_out + 32 * g) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// The gradient epilogue: called once per output tile by each consumer thread with its
// accumulators (fused::OperatorEpilogue). A thread holds two rows of the tile, 64 values each,
// in pairs of adjacent columns; each row's gradient is formed in registers and stored as S, in
// 16-byte vectors (store_vectors) wherever the rows are aligned.
template <class S>
class GradEpilogue : public fused::OperatorEpilogue<GradEpilogueParams> {
 public:
  using OperatorEpilogue::OperatorEpilogue;

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK block_shape,
                                 BlockCoordMNKL block_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    using Rows = fused::AccumulatorRows<FrgLayout, TiledMma>;
    using P = Packed<S>;
    constexpr int kValues = Rows::kValues;
    const GradEpilogueParams& a = params_;
    const int rows = static_cast<int>(get<0>(problem_shape_mnkl));
    const int cols = static_cast<int>(get<1>(problem_shape_mnkl));
    const int row0 = static_cast<int>(get<0>(block_coord_mnkl)) * size<0>(block_shape);
    const int col0 = static_cast<int>(get<1>(block_coord_mnkl)) * size<1>(block_shape);
    // The scheduler pads the tile grid to whole swizzle groups and clusters: such tiles hold no
    // part of x and must write nothing.
    if (a.skip || col0 >= cols || row0 >= rows) return;
    // The last column tile of a block that is not a multiple of the tile holds columns ≥ the
    // block's (TMA fills them with zeros): only that tile checks columns per pair.
    const bool whole_tile = col0 + static_cast<int>(size<1>(block_shape)) <= cols;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thr_mma.partition_C(make_identity_tensor(take<0, 2>(block_shape)));
    CUTE_STATIC_ASSERT_V(size(coords) == size(accumulators));
    // Both rows' records first, so their loads are in flight together.
    CeGradRecord records[Rows::kRows] = {};
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Rows::kRows; ++r) {
      const int row = row0 + Rows::row_of(coords, r);
      if (row < rows) {
        const float4* record = reinterpret_cast<const float4*>(a.records + row);
        records[r].coefs = __ldg(record);
        records[r].more = __ldg(record + 1);
      }
    }
    common::Transform<float> row_transform;
    row_transform.scale = a.logit_scale;
    row_transform.softcap = a.softcap;

    with_transform(row_transform, [&](const auto& transform) {
      auto tile = [&](auto entropy) {
        constexpr bool kEntropy = decltype(entropy)::value;
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < Rows::kRows; ++r) {
          const int row = row0 + Rows::row_of(coords, r);
          // The lanes whose row exists (whole quads: a quad holds one row), for the shuffles of
          // the vector stores: the rows past the last of the batch leave the warp here.
          const unsigned live = __ballot_sync(0xffffffffu, row < rows);
          if (row >= rows) continue;
          float value[kValues];
          Rows::for_each_value(coords, accumulators, r, [&](int k, int, float x) { value[k] = x; });
          fused::round_logits(value, a.round_to);
          const CeBlockRow block_row = block_row_of(records[r], a.first_column + col0);
          // The target's column within this tile, or -1: a row's target lies in one column tile,
          // so a warp's 8 rows hold one in at most 8 of V / 256 tiles. The values are formed
          // without the target term, and only where a lane of the warp holds its row's target (a
          // warp-uniform branch) is that one value formed again with it, from its logit picked out
          // before: the common path has no compare per value.
          const int64_t target = block_row.target_column;
          const int target_in_tile =
              block_row.valid && block_row.in_range && target >= 0 && target < size<1>(block_shape)
                  ? static_cast<int>(target) : -1;
          const bool warp_holds_target = __any_sync(live, target_in_tile >= 0);
          if (!block_row.valid || !block_row.in_range) {
            const float fill = block_row.valid ? quiet_nan() : 0.0f;  // SPEC §1: NaN row
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < kValues; ++k) value[k] = fill;
          } else {
            // The k of the target's value in this lane, or -1: compares against immediates.
            const int target_k = Rows::value_at(coords, target_in_tile);
            float target_logit = 0;
            if (warp_holds_target) {
              CUTLASS_PRAGMA_UNROLL
              for (int k = 0; k < kValues; ++k) {
                if (k == target_k) target_logit = value[k];
              }
            }
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < kValues; ++k) {
              value[k] = ce_block_grad<kEntropy>(block_row, transform, value[k], false, 1.0f);
            }
            if (warp_holds_target) {
              const float target_grad =
                  ce_block_grad<kEntropy>(block_row, transform, target_logit, true, 1.0f);
              CUTLASS_PRAGMA_UNROLL
              for (int k = 0; k < kValues; ++k) {
                if (k == target_k) value[k] = target_grad;
              }
            }
          }
          if (a.skip_stores) {  // keeps the values live: one store per row, never taken
            float sum = 0;
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < kValues; ++k) sum += value[k];
            if (sum == 1.25e38f) static_cast<float*>(a.grad)[row] = sum;
            continue;
          }
          // 16-byte vectors where rows are 16-byte aligned, pairs of S where 4-byte aligned;
          // in the block's last tile, only columns of the block.
          auto* out = static_cast<typename P::One*>(a.grad) +
                      static_cast<int64_t>(row) * a.grad_stride + col0;
          if (a.vectors && whole_tile) {
            store_vectors<Rows, P>(value, out + Rows::column_of(coords, 0) * 4, live);
          } else if (a.pairs && whole_tile) {
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < kValues; k += 2) {
              *reinterpret_cast<typename P::Pair*>(out + Rows::column_of(coords, k)) =
                  P::pair(value[k], value[k + 1]);
            }
          } else {
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < kValues; ++k) {
              const int column = Rows::column_of(coords, k);
              if (col0 + column < cols) out[column] = P::one(value[k]);
            }
          }
        }
      };
      if (a.entropy) {
        tile(std::true_type{});
      } else {
        tile(std::false_type{});
      }
    });
  }
};

template <class Element>
bool launch(const FusedGradProduct& p, cudaStream_t stream) {
  GradEpilogueParams epilogue;
  epilogue.records = p.records;
  epilogue.grad = p.grad;
  epilogue.grad_stride = p.grad_stride;
  epilogue.first_column = p.first_column;
  epilogue.logit_scale = p.logit_scale;
  epilogue.softcap = p.softcap;
  epilogue.entropy = p.entropy;
  epilogue.round_to = !p.rounded_logits ? 0 : p.dtype == DType::bf16 ? 1 : 2;
  epilogue.pairs = reinterpret_cast<std::uintptr_t>(p.grad) % 4 == 0 && p.grad_stride % 2 == 0;
  epilogue.vectors =
      reinterpret_cast<std::uintptr_t>(p.grad) % 16 == 0 && p.grad_stride % 8 == 0;
  epilogue.skip = fused::measurement().skip_gradient;
  epilogue.skip_stores = fused::measurement().skip_gradient_stores;
  const fused::Operands operands{p.hidden, p.hidden_stride, p.weight,   p.weight_stride,
                                 p.rows,   p.columns,       p.hidden_size};
  return fused::launch<Element, GradEpilogue<Element>>(operands, epilogue, "linear_ce", stream);
}

}  // namespace

bool fused_grad_product_built() { return true; }

bool fused_grad_product(const FusedGradProduct& product, cudaStream_t stream) {
  if (product.rows <= 0 || product.columns <= 0) return true;  // nothing to form
  bool launched = false;
  switch (product.dtype) {
    case DType::bf16: launched = launch<cutlass::bfloat16_t>(product, stream); break;
    case DType::f16: launched = launch<cutlass::half_t>(product, stream); break;
    default: break;
  }
  if (launched) fused_grad_launches.fetch_add(1, std::memory_order_relaxed);
  return launched;
}

}  // namespace xent::cuda

#else  // not built for sm_90a, or no CUTLASS headers

namespace xent::cuda {

bool fused_grad_product_built() { return false; }

bool fused_grad_product(const FusedGradProduct&, cudaStream_t) { return false; }

}  // namespace xent::cuda

#endif

namespace xent::cuda {

int64_t fused_grad_count() { return fused_grad_launches.load(std::memory_order_relaxed); }

bool fused_grad_preferred(int64_t hidden_size) {
  const char* knob = std::getenv("XENT_CUDA_FUSED_GRAD");  // read per call: tests switch it
  if (knob != nullptr && (knob[0] == '0' || knob[0] == '1')) return knob[0] == '1';
  return hidden_size <= kFusedGradMaxHidden;
}

}  // namespace xent::cuda
