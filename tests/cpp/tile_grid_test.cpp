// The fused products' tile grid (src/cuda/sm90/tile_grid.hpp): the tiles CUTLASS's persistent
// scheduler hands out under each swizzle, the swizzle of least padding, and the statistics
// product's row chunks.
#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>

#include "cuda/sm90/tile_grid.hpp"

namespace xent::cuda {
namespace {

TileGrid grid(int64_t rows, int64_t columns) {
  TileGrid g;
  g.rows = rows;
  g.columns = columns;
  return g;
}

TEST(TileGrid, ScheduledTilesPadToClustersAndSwizzleGroups) {
  // 8192 × 128256: 64 row tiles (whole groups of 16) and 501 column tiles (504 under 8).
  EXPECT_EQ(scheduled_tiles(grid(8192, 128256), 8), 64 * 504);
  EXPECT_EQ(scheduled_tiles(grid(8192, 128256), 1), 64 * 501);
  // 35 row tiles: 36 for the clusters of two, 48 for a swizzle of 8 (measured 48 / 32 of the
  // time of a 29-row-tile chunk: decision 50), 40 for 4.
  EXPECT_EQ(scheduled_tiles(grid(35 * 128, 128256), 8), 48 * 504);
  EXPECT_EQ(scheduled_tiles(grid(35 * 128, 128256), 4), 40 * 504);
  EXPECT_EQ(scheduled_tiles(grid(35 * 128, 128256), 1), 36 * 501);
  // A swizzle of 8 needs 6 CTA tiles in both modes, 4 needs 3, 2 needs 2.
  EXPECT_EQ(effective_swizzle(64, 5, 8), 4);
  EXPECT_EQ(effective_swizzle(64, 2, 8), 2);
  EXPECT_EQ(effective_swizzle(1, 500, 8), 1);
  EXPECT_EQ(effective_swizzle(64, 500, 2), 2);
  // A partial last tile counts whole; one output element is one cluster.
  EXPECT_EQ(scheduled_tiles(grid(1, 1), 8), 2);
}

TEST(TileGrid, LeastPaddingSwizzle) {
  // Full products of the docs/performance.md shapes keep the measured 8 (under 1 % padding).
  EXPECT_EQ(least_padding_swizzle(grid(8192, 128256)), 8);
  EXPECT_EQ(least_padding_swizzle(grid(8192, 256000)), 8);
  EXPECT_EQ(least_padding_swizzle(grid(32768, 128256)), 8);
  // Chunks of 35 and 19 row tiles, and a block gradient tile of 12 column tiles, narrow it.
  EXPECT_EQ(least_padding_swizzle(grid(35 * 128, 128256)), 2);
  EXPECT_EQ(least_padding_swizzle(grid(19 * 128, 256000)), 2);
  EXPECT_EQ(least_padding_swizzle(grid(8192, 3072)), 4);
  // Whatever it picks is within 1/32 of the fewest tiles any swizzle gives.
  for (int64_t rows : {1, 77, 128, 300, 2432, 4480, 4736, 8192, 32768}) {
    for (int64_t columns : {1, 129, 2816, 3072, 3328, 32003, 128256, 256000}) {
      const TileGrid g = grid(rows, columns);
      int64_t fewest = scheduled_tiles(g, 1);
      for (int s : {2, 4, 8}) fewest = std::min(fewest, scheduled_tiles(g, s));
      EXPECT_LE(32 * scheduled_tiles(g, least_padding_swizzle(g)), 33 * fewest)
          << rows << " x " << columns;
    }
  }
}

TEST(TileGrid, BalancedRowChunks) {
  // All rows when they fit.
  EXPECT_EQ(balanced_row_chunks(8192, 8192, 128, 16), 8192);
  EXPECT_EQ(balanced_row_chunks(300, 4096, 128, 16), 300);
  // 64 row tiles in chunks of at most 35: two of 32 (a whole group each) instead of 35 + 29.
  EXPECT_EQ(balanced_row_chunks(8192, 35 * 128, 128, 16), 32 * 128);
  // At most 19: four of 16 instead of three of 19 and one of 7.
  EXPECT_EQ(balanced_row_chunks(8192, 19 * 128, 128, 16), 16 * 128);
  // 256 row tiles in at most 37: seven even chunks would be 37 (padded to 48 under 8); eight of
  // 32 cost one more chunk and pad nothing.
  EXPECT_EQ(balanced_row_chunks(32768, 37 * 128, 128, 16), 32 * 128);
  // Fewer than a group fits: evened out on the row tile.
  EXPECT_EQ(balanced_row_chunks(8192, 10 * 128, 128, 16), 10 * 128);
  EXPECT_EQ(balanced_row_chunks(1000, 5 * 128, 128, 16), 4 * 128);
  // Not one row tile fits.
  EXPECT_EQ(balanced_row_chunks(8192, 100, 128, 16), 0);
  // Every chunk fits, and the chunks cover the rows.
  for (int64_t rows : {129, 1000, 4097, 8192, 32768, 65537}) {
    for (int64_t tiles : {1, 3, 15, 16, 17, 35, 37, 100}) {
      const int64_t chunk = balanced_row_chunks(rows, tiles * 128, 128, 16);
      if (rows <= tiles * 128) {
        EXPECT_EQ(chunk, rows);
      } else {
        EXPECT_GT(chunk, 0) << rows << " " << tiles;
        EXPECT_LE(chunk, tiles * 128) << rows << " " << tiles;
        EXPECT_EQ(chunk % 128, 0) << rows << " " << tiles;
      }
    }
  }
}

}  // namespace
}  // namespace xent::cuda
