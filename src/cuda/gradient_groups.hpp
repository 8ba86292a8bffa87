// How linear_distill's row chunks share their ∂h and ∂W products (linear_distill.cu). Plain C++
// (no CUDA headers): unit-tested on the CPU with the chunk planner.
#pragma once

#include <cstdint>

namespace xent::cuda {

// The row chunks of the schedules that accumulate ∂W (row_chunks with an fp32 weight,
// row_chunks_accumulated), with the teacher's logits in a buffer of their own: each ∂W product
// reads and rewrites V×H fp32, about 2.3 ms a chunk at (8192, 2304, 256000) on an H100
// (docs/perf-notes.md, decisions 80 and 81). The teacher's buffer is needed only while a chunk's
// gradient is formed, so the region planned for one chunk of `chunk_rows` rows of both sides
// also holds k student chunks of `sub_rows` rows and one teacher buffer ((k + 1)·sub_rows ≤
// 2·chunk_rows), and ∂h and ∂W run once per group of k chunks. k (at most 8) is the smallest
// that gives the fewest groups; k = 1 is the plain row chunks.
struct GradientGroups {
  int64_t sub_rows = 0;    // rows of one student chunk (logits product, distillation passes)
  int64_t group_rows = 0;  // rows of one ∂h and ∂W product: k·sub_rows
};
constexpr GradientGroups group_gradient_chunks(int64_t rows, int64_t chunk_rows,
                                               int largest = 8) {
  GradientGroups best{chunk_rows, chunk_rows};
  if (rows <= chunk_rows || chunk_rows < 1) return best;
  int64_t fewest = (rows + chunk_rows - 1) / chunk_rows;
  for (int k = 2; k <= largest; ++k) {
    int64_t sub = 2 * chunk_rows / (k + 1);
    // Whole 8-row steps keep every student chunk 16-byte aligned where the rows are.
    if (sub >= 64) sub = sub / 8 * 8;
    if (sub < 1) break;
    const int64_t groups = (rows + k * sub - 1) / (k * sub);
    if (groups < fewest) {
      fewest = groups;
      best = {sub, k * sub};
    }
  }
  return best;
}

}  // namespace xent::cuda
