// The tile grid of the fused Hopper products (fused_product.cuh) as CUTLASS's persistent
// scheduler lays it out, and the tile order that wastes the fewest tiles. Plain C++ (no CUDA or
// CUTLASS headers): unit-tested on the CPU.
//
// The scheduler (CUTLASS 4.2, PersistentTileSchedulerSm90Params) rounds the grid of CTA tiles up,
// along each mode, to whole clusters and then to whole swizzle groups times the cluster. A padded
// tile runs the whole mainloop on zero-filled loads (only the epilogues skip it), so padding
// costs product time in proportion: a 19-row-tile chunk under a swizzle of 8 with clusters of
// two row tiles runs 32 row tiles (docs/archive/perf-notes.md decision 50).
#pragma once

#include <cstdint>

namespace xent::cuda {

// The defaults are the fused products' tile and cluster (fused_product.cuh asserts them).
struct TileGrid {
  int64_t rows = 0, columns = 0;  // the product's output, m × n
  int64_t tile_rows = 128, tile_columns = 256;
  int64_t cluster_rows = 2, cluster_columns = 1;
};

// The widest swizzle the products take (decision 43); its groups of clusters span this many row
// tiles, which a chunk of whole groups never pads.
constexpr int kWidestSwizzle = 8;
constexpr int64_t swizzle_group_row_tiles(const TileGrid& g) {
  return kWidestSwizzle * g.cluster_rows;
}

namespace tile_grid_detail {
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
}  // namespace tile_grid_detail

// The swizzle the scheduler applies when allowed at most `max_swizzle` (CUTLASS's rule: 8 only
// where both modes have at least 6 CTA tiles, 4 at least 3, 2 at least 2).
constexpr int effective_swizzle(int64_t ctas_m, int64_t ctas_n, int max_swizzle) {
  const int64_t smaller = ctas_m < ctas_n ? ctas_m : ctas_n;
  if (max_swizzle >= 8 && smaller >= 6) return 8;
  if (max_swizzle >= 4 && smaller >= 3) return 4;
  if (max_swizzle >= 2 && smaller >= 2) return 2;
  return 1;
}

// Tiles the scheduler hands out (those past the output included) under `max_swizzle`.
constexpr int64_t scheduled_tiles(const TileGrid& g, int max_swizzle) {
  using namespace tile_grid_detail;
  const int64_t ctas_m = round_up(ceil_div(g.rows, g.tile_rows), g.cluster_rows);
  const int64_t ctas_n = round_up(ceil_div(g.columns, g.tile_columns), g.cluster_columns);
  const int64_t swizzle = effective_swizzle(ctas_m, ctas_n, max_swizzle);
  return round_up(ctas_m, swizzle * g.cluster_rows) * round_up(ctas_n, swizzle * g.cluster_columns);
}

// The largest swizzle (8, 4, 2, 1) whose scheduled tiles are within 1/32 of the fewest any
// swizzle gives: a wide swizzle keeps operand tiles in L2 (decision 43), but not at the price of
// a padded third of a chunk.
constexpr int least_padding_swizzle(const TileGrid& g) {
  constexpr int kSwizzles[] = {kWidestSwizzle, 4, 2, 1};  // widest first
  int64_t tiles[4] = {};
  int64_t fewest = 0;
  for (int i = 0; i < 4; ++i) {
    tiles[i] = scheduled_tiles(g, kSwizzles[i]);
    if (i == 0 || tiles[i] < fewest) fewest = tiles[i];
  }
  for (int i = 0; i < 4; ++i) {
    if (32 * tiles[i] <= 33 * fewest) return kSwizzles[i];
  }
  return 1;
}

// Rows per product when `rows` are split into products of at most `max_rows` (a multiple of
// tile_rows): the fewest chunks, evened out on the row tile, and on whole groups of
// `group_tiles` row tiles (a swizzle group of clusters, which pads nothing) where that still fits
// or costs at most one more chunk. 0 when not even one row tile fits.
constexpr int64_t balanced_row_chunks(int64_t rows, int64_t max_rows, int64_t tile_rows,
                                      int64_t group_tiles) {
  using namespace tile_grid_detail;
  if (rows <= max_rows) return rows;
  const int64_t fit = max_rows / tile_rows;
  if (fit == 0) return 0;
  const int64_t total = ceil_div(rows, tile_rows);
  const int64_t count = ceil_div(total, fit);
  const int64_t even = ceil_div(total, count);
  const int64_t up = round_up(even, group_tiles);
  if (up <= fit) return up * tile_rows;
  const int64_t down = fit / group_tiles * group_tiles;
  if (down > 0 && ceil_div(total, down) <= count + 1) return down * tile_rows;
  return even * tile_rows;
}

}  // namespace xent::cuda
