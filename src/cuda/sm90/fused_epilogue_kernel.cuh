// A fused product whose epilogue runs on warps of its own (docs/archive/perf-notes.md, decisions 55
// to 57). CUTLASS's cooperative kernel runs each tile's epilogue on the two consumer warpgroups
// after their mainloop, while the tensor cores wait: with the gradient epilogue a large share of
// the kernel at small H. Here the consumers only round the tile's accumulators to 16 bits and
// store them to shared memory, and go on to the next tile's mainloop; the three warps of the
// producer warpgroup that CUTLASS's kernel leaves idle read the tile back row by row and run the
// epilogue beside that mainloop.
//
// The kernel keeps everything of CUTLASS's cooperative kernel but its operator(): the arguments,
// parameters, shared storage, mainloop collective (TMA loads, wgmma) and persistent tile
// scheduler, so GemmUniversalAdapter launches it as it launches that kernel.
//
// The epilogue operator E (fused_grad_product.cu) provides:
//   Element                the 16-bit type of the staged tile (the operands' type);
//   SharedStorage          holding `StagedTile<Element> tile` (the builder leaves room for it);
//   void prepare(TileAt)   per tile of this CTA, before the tile is waited for (prefetches);
//   void rows(TileAt, SharedStorage&)  the epilogue of the staged tile, by the 3 epilogue
//                          warps (TileAt::warp 0–2);
//   bool shares(TileAt) const  whether the consumers form a share of this tile's rows themselves
//                          (where the epilogue warps alone would pace the kernel, and on the
//                          CTA's last tile, which no mainloop of the consumers follows);
//   void prepare_own(TileAt), void own_rows(TileAt, SharedStorage&)  the same for a consumer
//                          warp's share (TileAt::warp 0–7): of the 16 rows it staged, which it
//                          reads back itself once the tile is handed over;
// and optionally
//   fused::HalfVector staged_bias(int64_t& first) const  a bias the consumers add to each value
//                          before they round it for the tile (x rounded once, fused_product.cuh),
//                          none where .values is null; `first` is the product's first column of V.
//
// Included only by translation units compiled for sm_90a with the CUTLASS headers.
#pragma once

#include <cute/arch/copy_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/sm90/fused_product.cuh"

namespace xent::cuda::fused {

// One output tile in 16 bits: kTileRows rows of kTileColumns values. Row r's 16-byte chunk c
// (columns 8c .. 8c + 7) sits at chunk c ^ (r % 8) of the row: a consumer warp's stores (8 rows,
// 4 lanes a row, one 4-byte pair each, all in chunk c) then fall in 32 different banks, and a
// warp reading one row (a chunk per lane) reads 512 contiguous bytes.
template <class Element>
struct StagedTile {
  static_assert(sizeof(Element) == 2, "16-bit tiles");
  static constexpr int kRows = kTileRows, kColumns = kTileColumns;
  static CUTLASS_DEVICE int offset(int row, int column) {
    return row * kColumns + (((column >> 3) ^ (row & 7)) << 3) + (column & 7);
  }
  // The 8 values of row `row`, columns 8·chunk .. 8·chunk + 7, as one 16-byte word.
  CUTLASS_DEVICE uint4 chunk(int row, int chunk) const {
    return *reinterpret_cast<const uint4*>(values + row * kColumns + ((chunk ^ (row & 7)) << 3));
  }
  // chunk(first + r, chunk) for a group's first row `first`, a multiple of 4, and r < 4 known at
  // compile time: then (first + r) % 8 = (first % 8) | r, and the XOR splits into a part per
  // group and a constant per row.
  CUTLASS_DEVICE uint4 group_chunk(int first, int r, int chunk) const {
    const int group_chunk = chunk ^ (first & 4);
    return *reinterpret_cast<const uint4*>(values + (first + r) * kColumns +
                                           ((group_chunk ^ r) << 3));
  }
  alignas(128) Element values[kRows * kColumns];
  // The hand-over of `values` between the consumers and the epilogue warps (the kernel below):
  // `full` completes a phase once every consumer thread has stored its part of a tile, `empty`
  // once every epilogue thread has read it. mbarriers rather than named barriers' bar.arrive →
  // bar.sync: both order the same and cost the same, but compute-sanitizer's racecheck models
  // only the mbarrier form (docs/archive/perf-notes.md, decisions 57, 59 and 60).
  uint64_t full, empty;
};

// The 8 16-bit values of a staged chunk as floats.
template <class S>
CUTLASS_DEVICE void unpack_chunk(const uint4& chunk, float (&value)[8]) {
  const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<S, cutlass::bfloat16_t>) {
      value[2 * i] = __uint_as_float(words[i] << 16);
      value[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    } else {
      __half2 pair;
      memcpy(&pair, &words[i], sizeof pair);
      const float2 both = __half22float2(pair);
      value[2 * i] = both.x;
      value[2 * i + 1] = both.y;
    }
  }
}

// (a, b) as one 4-byte word of a pair of S.
template <class S>
CUTLASS_DEVICE uint32_t round_pair(float a, float b) {
  const typename Packed<S>::Pair pair = Packed<S>::pair(a, b);
  uint32_t word;
  memcpy(&word, &pair, sizeof word);
  return word;
}

// x, which the compiler cannot see through: what is formed from it is formed where it is used.
CUTLASS_DEVICE int opaque(int x) {
  asm volatile("mov.b32 %0, %0;" : "+r"(x));
  return x;
}

// The warps that run the epilogue: warps 1–3 of the producer warpgroup (EpilogueWarpsKernel).
constexpr int kEpilogueWarps = 3;

// The bias an epilogue operator E asks its consumers to stage (E::staged_bias), or none.
template <class E>
CUTLASS_DEVICE HalfVector staged_bias_of(const E& epilogue, int64_t& first) {
  if constexpr (requires { epilogue.staged_bias(first); }) {
    return epilogue.staged_bias(first);
  } else {
    first = 0;
    return HalfVector{};
  }
}

// Where a tile lies: its first row and column in the product, and the product's extent.
struct TileAt {
  int row0 = 0, col0 = 0;
  int rows = 0, cols = 0;  // of the whole product x
  // Of the calling thread among the epilogue warps (0–2), or among the consumer warps (0–7; warp
  // q staged rows 16q .. 16q + 15 of the tile).
  int warp = 0, lane = 0;
  bool last = false;  // the CTA's last tile (both sides know it from the static scheduler)
};

template <class Base>
struct EpilogueWarpsKernel : Base {
  using typename Base::ClusterShape;
  using typename Base::CollectiveEpilogue;  // CUTLASS's adapter, derived from E
  using typename Base::CollectiveMainloop;
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::TiledMma;
  using typename Base::TileScheduler;
  using typename Base::TileShape;
  using Element = typename CollectiveEpilogue::Element;
  using Tile = StagedTile<Element>;

  static constexpr uint32_t kWarpgroup = cutlass::NumThreadsPerWarpGroup;
  // The epilogue runs on warps 1–3 of the producer warpgroup, idle in CUTLASS's kernel (warp 0
  // issues the TMA loads). A fourth warpgroup would need 512 threads, and ptxas then compiles
  // every instruction within 128 registers per thread, below the consumers' wgmma (it needs
  // ≥ 154 with the 128 × 256 accumulators), whatever setmaxnreg grants later.
  static_assert(kEpilogueWarps == cutlass::NumWarpsPerWarpGroup - 1, "warps 1-3 of warpgroup 0");
  static constexpr uint32_t kEpilogueThreads = kEpilogueWarps * cutlass::NumThreadsPerWarp;
  // Registers per thread: every warpgroup keeps the 168 the CTA is launched with (65536 per 384
  // threads, rounded down to 8). ptxas compiles the whole kernel within those 168 whatever a
  // later setmaxnreg.inc grants (the SASS of the consumers with 208 never went past R169), while a
  // setmaxnreg.dec binds the code after it: at 88 the epilogue warps' loop spilled and could
  // form only four rows at once (decision 92). The consumers, with the 128 × 256 accumulators
  // (128 per thread) and the mainloop's state, fit in 168 without spills.
  static_assert(Base::MaxThreadsPerBlock == 3 * kWarpgroup && Base::NumMMAThreads == 2 * kWarpgroup,
                "producer warpgroup 0, consumer warpgroups 1 and 2");
  static_assert(!Base::IsSchedDynamicPersistent, "the static persistent scheduler");
  static_assert(cute::size<0>(TileShape{}) == Tile::kRows &&
                    cute::size<1>(TileShape{}) == Tile::kColumns,
                "the staged tile is the output tile");

  // The hand-over's arrivals: every consumer thread on `full`, every epilogue thread on `empty`.
  // One per thread, not one per warp after a __syncwarp: racecheck does not carry a __syncwarp
  // into the barrier's ordering (decision 60), and the cost did not show.
  using HandOver = cutlass::arch::ClusterBarrier;
  static constexpr uint32_t kFullArrivals = Base::NumMMAThreads;
  static constexpr uint32_t kEmptyArrivals = kEpilogueThreads;

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    enum Role { kProducer = 0, kConsumer0 = 1, kConsumer1 = 2 };
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int thread_idx = static_cast<int>(threadIdx.x);
    const int warp_idx = cutlass::canonical_warp_idx_sync();
    const int warp_in_group = warp_idx % 4;
    const int role = cutlass::canonical_warp_group_idx();
    const int lane_predicate = elect_one_sync();
    const uint32_t block_rank = block_rank_in_cluster();

    if (warp_idx == 0 && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
    }

    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    typename MainloopPipeline::Params pipeline_params;
    if (role == kProducer && warp_in_group == 0) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    }
    if (role == kConsumer0 || role == kConsumer1) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    }
    pipeline_params.is_leader = thread_idx % kWarpgroup == 0;
    pipeline_params.num_consumers = Base::NumMMAThreads;
    pipeline_params.num_producers = Base::NumProducerThreads;
    pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(shared.pipelines.mainloop, pipeline_params, ClusterShape{});
    Tile& tile = shared.tensors.epilogue.tile;
    if (warp_idx == 0 && lane_predicate) {
      HandOver::init(&tile.full, kFullArrivals);
      HandOver::init(&tile.empty, kEmptyArrivals);
      cutlass::arch::fence_barrier_init();
    }

    // Every CTA of the cluster sees the pipeline's barriers initialised before any use.
    cluster_arrive_relaxed();
    cluster_wait();

    const auto problem = append<4>(params.problem_shape, Int<1>{});
    const TileShape tile_shape{};
    CollectiveMainloop mainloop;
    const auto load_inputs = mainloop.load_init(problem, params.mainloop);
    const auto gA = get<0>(load_inputs);
    const auto gB = get<1>(load_inputs);
    TileScheduler scheduler{params.scheduler};
    auto work = scheduler.initial_work_tile_info(ClusterShape{});
    const int rows = static_cast<int>(get<0>(problem)), cols = static_cast<int>(get<1>(problem));
    const int k_tiles = static_cast<int>(size<3>(gA));
    // Tiles of the padded grid (tile_grid.hpp) hold no part of x: both sides skip their
    // hand-over, so neither waits for the other.
    auto holds_x = [&](const auto& w) {
      return w.M_idx * Tile::kRows < rows && w.N_idx * Tile::kColumns < cols;
    };
    CollectiveEpilogue epilogue(params.epilogue, shared.tensors.epilogue);
    // Both sides count the tiles handed over: the t-th (from 0) is phase t of `full`, and phase t
    // of `empty` says it was read (a wait names a phase by its parity).
    uint32_t handed = 0;

    if (role == kProducer) {
      cutlass::arch::wait_on_dependent_grids();
      if (warp_in_group == 0) {
        auto state = cutlass::make_producer_start_state<MainloopPipeline>();
        while (work.is_valid()) {
          const auto blk =
              make_coord(idx2crd(work.M_idx, shape<2>(gA)), idx2crd(work.N_idx, shape<2>(gB)), _,
                         idx2crd(work.L_idx, shape<4>(gB)));
          auto k_iter = make_coord_iterator(shape<3>(gA));
          mainloop.load(params.mainloop, pipeline, state, load_inputs, blk, k_iter, k_tiles,
                        cutlass::canonical_lane_idx(), block_rank, shared.tensors.mainloop);
          state.advance(k_tiles);
          work = get<0>(scheduler.fetch_next_work(work));
        }
        mainloop.load_tail(pipeline, state);
      } else {
        TileAt at;
        at.rows = rows;
        at.cols = cols;
        at.warp = warp_in_group - 1;
        at.lane = cutlass::canonical_lane_idx();
        while (work.is_valid()) {
          const auto next = get<0>(scheduler.fetch_next_work(work));
          if (holds_x(work)) {
            at.row0 = work.M_idx * Tile::kRows;
            at.col0 = work.N_idx * Tile::kColumns;
            at.last = !next.is_valid();
            epilogue.prepare(at);
            HandOver::wait(&tile.full, handed % 2);
            epilogue.rows(at, shared.tensors.epilogue);
            HandOver::arrive(&tile.empty);  // read: the consumers may store the next tile
            ++handed;
          }
          work = next;
        }
      }
    } else {
      const int mma_thread = thread_idx - static_cast<int>(kWarpgroup);
      TiledMma tiled_mma;
      typename CollectiveMainloop::PipelineState state;
      while (work.is_valid()) {
        auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(tile_shape));
        mainloop.mma(pipeline, state, accumulators, k_tiles, mma_thread, shared.tensors.mainloop,
                     params.mainloop);
        mainloop.mma_tail(pipeline, state, k_tiles);
        state.advance(k_tiles);
        const auto next = get<0>(scheduler.fetch_next_work(work));
        if (holds_x(work)) {
          // The staging addresses and the share's setup follow from the thread's index; taken
          // through an opaque copy per tile, they are formed here rather than hoisted out of the
          // loop and kept (or spilled) across the mainloop, whose registers are all taken.
          const int thread = opaque(mma_thread);
          TileAt own;
          own.row0 = work.M_idx * Tile::kRows;
          own.col0 = work.N_idx * Tile::kColumns;
          own.rows = rows;
          own.cols = cols;
          own.warp = thread / cutlass::NumThreadsPerWarp;
          own.lane = thread % cutlass::NumThreadsPerWarp;
          own.last = !next.is_valid();
          const bool shares = epilogue.shares(own);
          if (shares) epilogue.prepare_own(own);
          if (handed > 0) HandOver::wait(&tile.empty, (handed - 1) % 2);  // the last one is read
          int64_t bias_first = 0;
          const HalfVector bias = staged_bias_of(epilogue, bias_first);
          stage(accumulators, tiled_mma, thread, tile, bias, bias_first + own.col0,
                cols - own.col0);
          HandOver::arrive(&tile.full);
          ++handed;
          if (shares) epilogue.own_rows(own, shared.tensors.epilogue);
        }
        work = next;
      }
    }
#endif
  }

  // The consumer thread's accumulators, rounded to Element, into the staged tile by stmatrix:
  // one instruction stores four 8 × 8 matrices of 16-bit values, each row of one at an address
  // a lane gives, and the wgmma layout is the matrices' register layout (thread t holds row
  // t / 4, columns 2·(t % 4) + {0, 1} of each 8-column chunk c, in its rows 16q + t / 4 and
  // 16q + 8 + t / 4 for consumer warp q). A matrix row is 8 values of one row: one 16-byte chunk
  // of the staged tile, so the tile's layout stays as it is. Sixteen stores per thread where 4-byte
  // stores took 64 (decision 107). Lane l gives row l % 8 of matrix l / 8: matrices 0 and 1 are
  // chunk c of the warp's two row halves, 2 and 3 chunk c + 1, so its row is 16q + 8·((l / 8) % 2)
  // + l % 8 and its chunk (c + l / 16) ^ (l % 8), which for even c is c ^ k with k = (l / 16) ^
  // (l % 8) < 8: 8·(c / 8) + ((c % 8) ^ k). Each lane forms 4 addresses (c % 8 = 0, 2, 4, 6), and
  // every store is one of them plus 128 bytes per 8 chunks.
  // With `bias` (a bias for the tile's columns from V's column bias_first, bias_columns of them
  // inside the product) each value gets its column's bias before its one rounding.
  template <class Accumulators>
  static CUTLASS_DEVICE void stage(const Accumulators& accumulators, const TiledMma& tiled_mma,
                                   int mma_thread, Tile& tile, const HalfVector& bias,
                                   int64_t bias_first, int bias_columns) {
    using namespace cute;
    using Rows = AccumulatorRows<decltype(accumulators.layout()), TiledMma>;
    // Two consumer warpgroups of 64 rows, so consumer warp q holds rows 16q .. 16q + 15 (the
    // wgmma layout): the rows TileAt and the epilogue's share assume.
    static_assert(Rows::kRows == 2, "a consumer thread holds two rows of the tile");
    static_assert(Rows::kValues % 16 == 0, "whole groups of 8 pairs per row");
    constexpr int kPairs = Rows::kValues / 2;
    auto thr_mma = tiled_mma.get_thread_slice(mma_thread);
    const Tensor coords = thr_mma.partition_C(make_identity_tensor(take<0, 2>(TileShape{})));
    float value[Rows::kRows][Rows::kValues];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Rows::kRows; ++r) {
      Rows::for_each_value(coords, accumulators, r, [&](int k, int, float x) { value[r][k] = x; });
      if (bias.values != nullptr) {
        Rows::for_each_value(coords, accumulators, r, [&](int k, int col, float) {
          if (col < bias_columns) value[r][k] += bias[bias_first + col];
        });
      }
    }
    const int lane = mma_thread % cutlass::NumThreadsPerWarp;
    const int row =
        16 * (mma_thread / cutlass::NumThreadsPerWarp) + 8 * ((lane >> 3) & 1) + (lane & 7);
    const int k = (lane >> 4) ^ (lane & 7);
    Element* const row_start = tile.values + row * Tile::kColumns;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 8; e += 2) {
      Element* const chunk_e = row_start + ((e ^ k) << 3);  // chunk c = e + 8i: + 64·i values
      CUTLASS_PRAGMA_UNROLL
      for (int c = e; c < kPairs; c += 8) {
        cute::SM90_U32x4_STSM_N::copy(round_pair<Element>(value[0][2 * c], value[0][2 * c + 1]),
                                      round_pair<Element>(value[1][2 * c], value[1][2 * c + 1]),
                                      round_pair<Element>(value[0][2 * c + 2], value[0][2 * c + 3]),
                                      round_pair<Element>(value[1][2 * c + 2], value[1][2 * c + 3]),
                                      *reinterpret_cast<cute::uint128_t*>(chunk_e + (c - e) * 8));
      }
    }
  }
};

}  // namespace xent::cuda::fused
