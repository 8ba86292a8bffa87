// The CUDA chunk planner is plain C++: its budget arithmetic and chunk choices are checked here,
// on the CPU, for the docs/performance.md shapes and for budgets down to a single row.
#include "cuda/plan/chunk_plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace xent::cuda {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr double kBlocksBias = 1.05;  // (c)'s predicted time over the bare model (chunk_plan.cpp)

ChunkRequest request_for(int64_t rows, int64_t hidden, int64_t vocab, std::size_t budget) {
  ChunkRequest request;
  request.rows = rows;
  request.hidden = hidden;
  request.vocab = vocab;
  request.logits_element_bytes = 2;
  request.budget_bytes = budget;
  request.fixed_bytes = static_cast<std::size_t>(rows) * 16;
  return request;
}

void expect_covers_rows(const ChunkPlan& plan, int64_t rows) {
  ASSERT_GT(plan.chunk_rows, 0);
  EXPECT_GE(plan.chunk_rows * plan.chunk_count, rows);
  EXPECT_LT((plan.chunk_count - 1) * plan.chunk_rows, rows) << "an empty trailing chunk";
}

class ChunkPlanBudget
    : public ::testing::TestWithParam<std::tuple<std::tuple<int64_t, int64_t, int64_t>, int>> {};

TEST_P(ChunkPlanBudget, StaysWithinBudgetAndCoversEveryRow) {
  const auto [shape, budget_mib] = GetParam();
  const auto [rows, hidden, vocab] = shape;
  const std::size_t budget = static_cast<std::size_t>(budget_mib) * kMiB;
  const ChunkPlan plan = plan_chunks(request_for(rows, hidden, vocab, budget));
  ASSERT_TRUE(plan.fits_budget);
  expect_covers_rows(plan, rows);
  EXPECT_LE(plan.total_bytes, budget);
  EXPECT_GE(plan.logits_buffer_bytes,
            static_cast<std::size_t>(plan.chunk_rows) * static_cast<std::size_t>(vocab) * 2);
  // The planner must use the budget, not a fixed small chunk: the next balanced step up (one chunk
  // fewer) would not have fitted.
  if (plan.chunk_count > 1) {
    const int64_t fewer = plan.chunk_count - 1;
    const int64_t bigger_rows = (rows + fewer - 1) / fewer;
    const std::size_t bigger =
        static_cast<std::size_t>(bigger_rows) * static_cast<std::size_t>(vocab) * 2 +
        plan.gemm_workspace_bytes + plan.fixed_bytes;
    // Or the chunk is on the 128-row tile grid and one more tile would not fit (the planner rounds
    // down to the grid when that costs at most an eighth of the rows).
    const std::size_t one_more_tile =
        static_cast<std::size_t>(plan.chunk_rows + 128) * static_cast<std::size_t>(vocab) * 2 +
        plan.gemm_workspace_bytes + plan.fixed_bytes;
    const bool tile_limited = plan.chunk_rows % 128 == 0 && one_more_tile > budget;
    EXPECT_TRUE(bigger > budget || tile_limited)
        << "chunk_rows " << plan.chunk_rows << " leaves budget unused";
  }
}

INSTANTIATE_TEST_SUITE_P(
    PerfShapes, ChunkPlanBudget,
    ::testing::Combine(
        ::testing::Values(std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
                          std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
                          std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256}),
                          std::make_tuple(int64_t{65536}, int64_t{4096}, int64_t{256000}),
                          std::make_tuple(int64_t{37}, int64_t{67}, int64_t{1031})),
        ::testing::Values(64, 512, 1024)));

TEST(ChunkPlan, DefaultBudgetKeepsTheWeightGradientComputeBound) {
  // 512 MiB, bf16, V = 128256: the ∂W product must see K >= 1024 rows per chunk (chunk_plan.cpp).
  const ChunkPlan plan = plan_chunks(request_for(8192, 4096, 128256, 512 * kMiB));
  EXPECT_GE(plan.chunk_rows, 1024);
  EXPECT_EQ(plan.chunk_rows % 128, 0) << "chunks off the 128-row product tile";
  EXPECT_LE(plan.chunk_count, 5);
}

TEST(ChunkPlan, ChunksAreBalanced) {
  // 10000 rows in 4 chunks: 2560 each (tile-rounded), not 3×3000 + 1000.
  ChunkRequest request = request_for(10000, 64, 32768, 0);
  request.fixed_bytes = 0;
  request.budget_bytes = std::size_t{3000} * 32768 * 2 + (4 * kMiB);
  const ChunkPlan plan = plan_chunks(request);
  expect_covers_rows(plan, 10000);
  EXPECT_EQ(plan.chunk_count, 4);
  EXPECT_EQ(plan.chunk_rows, 2560);
}

TEST(ChunkPlan, SingleRowBudgetStillRuns) {
  ChunkRequest request = request_for(37, 67, 1031, 0);
  request.budget_bytes = minimum_budget_bytes(request);
  const ChunkPlan plan = plan_chunks(request);
  EXPECT_TRUE(plan.fits_budget);
  EXPECT_EQ(plan.chunk_rows, 1);
  EXPECT_EQ(plan.chunk_count, 37);
  EXPECT_LE(plan.total_bytes, request.budget_bytes);
}

TEST(ChunkPlan, BudgetBelowOneRowIsReported) {
  ChunkRequest request = request_for(37, 67, 1031, 0);
  request.budget_bytes = minimum_budget_bytes(request) - 1;
  const ChunkPlan plan = plan_chunks(request);
  EXPECT_FALSE(plan.fits_budget);
  EXPECT_EQ(plan.chunk_rows, 1);
}

// ---- the budget bounds the fp32 ∂W accumulator too (16-bit weight gradients) -----------------

ChunkRequest training_request(int64_t rows, int64_t hidden, int64_t vocab, std::size_t budget) {
  ChunkRequest request = request_for(rows, hidden, vocab, budget);
  request.weight_accumulator = true;
  request.bias_accumulator_bytes = align_up(static_cast<std::size_t>(vocab) * 4);
  return request;
}

// linear_distill with the teacher as hidden + weight: two logits buffers per row, two logits
// products per chunk, 32 bytes of row statistics kept by the blocked schedule.
ChunkRequest distill_request(ChunkRequest request) {
  request.logits_buffers_per_row = 2;
  request.products_per_logits_chunk = 2;
  request.saved_row_bytes = 32;
  return request;
}

class ChunkPlanTrainingBudget : public ChunkPlanBudget {};

TEST_P(ChunkPlanTrainingBudget, EverythingFitsTheBudget) {
  const auto [shape, budget_mib] = GetParam();
  const auto [rows, hidden, vocab] = shape;
  const std::size_t budget = static_cast<std::size_t>(budget_mib) * kMiB;
  for (const bool distill : {false, true}) {
    SCOPED_TRACE(distill ? "distillation (teacher hidden + weight)" : "cross-entropy");
    ChunkRequest request = training_request(rows, hidden, vocab, budget);
    if (distill) request = distill_request(request);
    const ChunkPlan plan = plan_chunks(request);
    ASSERT_TRUE(plan.fits_budget);
    expect_covers_rows(plan, rows);
    EXPECT_LE(plan.total_bytes, budget);
    const std::size_t full_accumulator = static_cast<std::size_t>(vocab) * hidden * 4;
    switch (plan.schedule) {
      case Schedule::row_chunks:
        EXPECT_EQ(plan.chunk_count, 1) << "a 16-bit ∂W over several chunks needs fp32 sums";
        break;
      case Schedule::row_chunks_accumulated:
        EXPECT_GE(plan.accumulator_bytes, full_accumulator);
        break;
      case Schedule::vocabulary_blocks:
        ASSERT_GT(plan.block_columns, 0);
        EXPECT_GE(plan.block_columns * plan.block_count, vocab);
        EXPECT_LT((plan.block_count - 1) * plan.block_columns, vocab) << "an empty last block";
        EXPECT_GE(plan.tile_rows * plan.tile_count, rows);
        EXPECT_EQ(plan.accumulator_bytes == 0, plan.tile_count == 1)
            << "only whole-row-count tiles write ∂W of a block without an accumulator";
        EXPECT_GE(plan.lse_bytes, static_cast<std::size_t>(rows) * request.saved_row_bytes);
        // Every logits buffer of a row has its tile, the teacher's on the next aligned boundary.
        EXPECT_GE(plan.tile_buffer_bytes, static_cast<std::size_t>(plan.tile_rows) *
                                              plan.block_columns * 2 *
                                              request.logits_buffers_per_row);
        EXPECT_LT(plan.accumulator_bytes, full_accumulator);
        EXPECT_GE(chunk_region_bytes(plan), plan.tile_buffer_bytes + plan.accumulator_bytes);
        break;
      case Schedule::statistics_blocks:
        ADD_FAILURE() << "(d) taken for a request that offers no statistics product";
        break;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    PerfShapes, ChunkPlanTrainingBudget,
    ::testing::Combine(
        ::testing::Values(std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
                          std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
                          std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256}),
                          std::make_tuple(int64_t{37}, int64_t{67}, int64_t{1031})),
        ::testing::Values(64, 512, 1024, 4096)));

// The schedule choices the cost model predicts (chunk_plan.cpp) for the docs/performance.md shapes.
TEST(ChunkPlan, AccumulatorLargerThanTheBudgetGivesVocabularyBlocks) {
  // (8192, 4096, 128256): the V×H fp32 accumulator alone is 2004 MiB.
  const ChunkPlan plan = plan_chunks(training_request(8192, 4096, 128256, 512 * kMiB));
  EXPECT_EQ(plan.schedule, Schedule::vocabulary_blocks);
  EXPECT_EQ(plan.tile_rows, 8192) << "all rows of a block fit: ∂W of a block in one product";
  EXPECT_EQ(plan.accumulator_bytes, 0u);
  EXPECT_GE(plan.chunk_rows, 1024);
  EXPECT_LE(plan.total_bytes, 512 * kMiB);
}

// The model's price of operands read more than once (chunk_plan.cpp reread_ms): 0.6 of the
// traffic of W per extra row chunk or row tile and of h per extra vocabulary block, for each of
// `products` products, 16-bit operands, B = 3 TB/s.
double reread_ms(int products, int64_t chunks, int64_t blocks, int64_t tiles, int64_t rows,
                 int64_t hidden, int64_t vocab) {
  const double weight_ms = 0.6 * double(vocab) * hidden * 2 / 3e12 * 1e3;
  const double hidden_ms = 0.6 * double(rows) * hidden * 2 / 3e12 * 1e3;
  auto extra = [](int64_t count) { return double(std::max<int64_t>(count - 1, 0)); };
  return products * ((extra(chunks) + extra(tiles)) * weight_ms + extra(blocks) * hidden_ms);
}

// Both passes of a blocked plan (c) with `products` products per pass.
double blocks_reread_ms(const ChunkPlan& plan, int products, int64_t rows, int64_t hidden,
                        int64_t vocab) {
  return reread_ms(products, plan.chunk_count, 0, 0, rows, hidden, vocab) +
         reread_ms(products, 0, plan.block_count, plan.tile_count, rows, hidden, vocab);
}

TEST(ChunkPlan, DistillationBlocksFormBlockGradientsFromRowStatistics) {
  // (8192, 4096, 128256), teacher hidden + weight, 512 MiB: the blocked schedule with every row in
  // one tile of student and teacher block logits; 6 products (student and teacher logits twice,
  // ∂h, ∂W) and 6 passes over N×V (each pass reads two buffers and writes one gradient).
  const ChunkPlan plan =
      plan_chunks(distill_request(training_request(8192, 4096, 128256, 512 * kMiB)));
  EXPECT_EQ(plan.schedule, Schedule::vocabulary_blocks);
  EXPECT_EQ(plan.tile_rows, 8192);
  EXPECT_EQ(plan.tile_count, 1);
  EXPECT_EQ(plan.accumulator_bytes, 0u);
  EXPECT_GE(plan.lse_bytes, std::size_t{8192} * 32);
  EXPECT_LE(plan.total_bytes, 512 * kMiB);
  const double product_ms = 2.0 * 8192 * 128256 * 4096 / 700e12 * 1e3;  // 12.3 ms
  const double pass_ms = 8192.0 * 128256 * 2 / 3e12 * 1e3;              // 0.70 ms
  // (c) is priced with the model's measured bias against (d) (1.05, chunk_plan.cpp).
  EXPECT_NEAR(plan.predicted_ms / kBlocksBias,
              6 * product_ms + 6 * pass_ms + blocks_reread_ms(plan, 3, 8192, 4096, 128256), 1.0);
  // Against the 4 products the op cannot avoid: about 1.7, where recomputing whole rows per
  // block took 6 (docs/archive/perf-notes.md).
  EXPECT_LT(plan.predicted_ms / kBlocksBias, 1.8 * 4 * product_ms);
  // With teacher logits (one buffer, no teacher product): 4 products and 4 passes, as for ce.
  ChunkRequest logits = training_request(8192, 4096, 128256, 512 * kMiB);
  logits.saved_row_bytes = 32;
  const ChunkPlan from_logits = plan_chunks(logits);
  EXPECT_EQ(from_logits.schedule, Schedule::vocabulary_blocks);
  EXPECT_NEAR(from_logits.predicted_ms / kBlocksBias,
              4 * product_ms + 4 * pass_ms + blocks_reread_ms(from_logits, 2, 8192, 4096, 128256),
              0.5);
}

TEST(ChunkPlan, LargeBudgetKeepsTheAccumulatedRowChunks) {
  // (8192, 2304, 256000) at 3 GiB: a 2250 MiB accumulator and ~1600-row chunks (6 accumulator
  // passes, +9 ms) beat one more product (+14 ms). At 4 GiB all 8192 rows are one chunk: no
  // accumulator at all.
  const ChunkPlan plan = plan_chunks(training_request(8192, 2304, 256000, 3072 * kMiB));
  EXPECT_EQ(plan.schedule, Schedule::row_chunks_accumulated);
  EXPECT_GE(plan.chunk_rows, 1024);
  EXPECT_LE(plan.total_bytes, 3072 * kMiB);
  const ChunkPlan single = plan_chunks(training_request(8192, 2304, 256000, 4096 * kMiB));
  EXPECT_EQ(single.schedule, Schedule::row_chunks);
  EXPECT_EQ(single.chunk_count, 1);
}

TEST(ChunkPlan, SmallChunksBesideTheAccumulatorLoseToBlocks) {
  // (32768, 768, 128256): a 376 MiB accumulator leaves ~400-row chunks at 512 MiB (82 accumulator
  // passes, +21 ms predicted) against one extra product (+9 ms): blocks. At 1 GiB chunks of ~2500
  // rows make the accumulator cheap: row chunks.
  const ChunkPlan tight = plan_chunks(training_request(32768, 768, 128256, 512 * kMiB));
  EXPECT_EQ(tight.schedule, Schedule::vocabulary_blocks);
  const ChunkPlan roomy = plan_chunks(training_request(32768, 768, 128256, 1024 * kMiB));
  EXPECT_EQ(roomy.schedule, Schedule::row_chunks_accumulated);
  EXPECT_GE(roomy.chunk_rows, 2048);
}

TEST(ChunkPlan, SmallBudgetTilesRowsIntoABlockAccumulator) {
  // 64 MiB still holds all 8192 rows of a ~3700-column block: no accumulator.
  const ChunkPlan all_rows = plan_chunks(training_request(8192, 4096, 128256, 64 * kMiB));
  EXPECT_EQ(all_rows.schedule, Schedule::vocabulary_blocks);
  EXPECT_EQ(all_rows.tile_rows, 8192);
  EXPECT_LE(all_rows.total_bytes, 64 * kMiB);
  // 16 MiB and 65536 rows: not even 128 columns of all rows fit, so row tiles accumulate.
  const ChunkPlan plan = plan_chunks(training_request(65536, 4096, 256000, 16 * kMiB));
  EXPECT_EQ(plan.schedule, Schedule::vocabulary_blocks);
  EXPECT_LT(plan.tile_rows, 65536);
  EXPECT_GT(plan.accumulator_bytes, 0u);
  EXPECT_LE(plan.total_bytes, 16 * kMiB);
}

TEST(ChunkPlan, Fp32WeightGradientOrOneChunkNeedsNoAccumulator) {
  ChunkRequest request = request_for(8192, 4096, 128256, 512 * kMiB);  // fp32 ∂W: in place
  const ChunkPlan fp32_weight = plan_chunks(request);
  EXPECT_EQ(fp32_weight.schedule, Schedule::row_chunks);
  EXPECT_EQ(fp32_weight.accumulator_bytes, 0u);
  EXPECT_GT(fp32_weight.chunk_count, 1);
  const ChunkPlan one_chunk = plan_chunks(training_request(512, 4096, 128256, 512 * kMiB));
  EXPECT_EQ(one_chunk.schedule, Schedule::row_chunks);
  EXPECT_EQ(one_chunk.chunk_count, 1);
  EXPECT_EQ(one_chunk.accumulator_bytes, 0u);
}

TEST(ChunkPlan, WeightSumsInTheOutputKeepRowChunksWithoutAnAccumulator) {
  // WeightGradAccumulation::weight_dtype: a 16-bit ∂W summed in its output over the row chunks,
  // at every budget (64 MiB: ~200-row chunks where the fp32 accumulator forces blocks), with its
  // 16-bit traffic per chunk (half an accumulator pass) in the predicted time. Statistics blocks
  // are not taken even where preferred (their block ∂W would need a block accumulator).
  for (const std::size_t budget : {16 * kMiB, 64 * kMiB, 256 * kMiB, 1024 * kMiB}) {
    ChunkRequest request = training_request(8192, 4096, 128256, budget);
    request.weight_gradient = true;
    request.weight_accumulator = false;
    request.weight_sums_in_output = true;
    request.statistics_product = true;
    request.statistics_bytes = 4 * kMiB;
    request.prefer_statistics = true;
    const ChunkPlan plan = plan_chunks(request);
    SCOPED_TRACE(budget / kMiB);
    EXPECT_EQ(plan.schedule, Schedule::row_chunks);
    EXPECT_EQ(plan.accumulator_bytes, 0u);
    EXPECT_TRUE(plan.fits_budget);
    EXPECT_LE(plan.total_bytes, budget);
    expect_covers_rows(plan, 8192);
    if (budget == 64 * kMiB) {
      EXPECT_GE(plan.chunk_count, 30);
      EXPECT_LE(plan.chunk_count, 64);
    }
    ChunkRequest fp32_sums = request;
    fp32_sums.weight_sums_in_output = false;
    fp32_sums.weight_gradient = true;
    fp32_sums.statistics_product = false;
    const ChunkPlan in_place = plan_chunks(fp32_sums);  // the same chunks, an fp32 ∂W in place
    if (in_place.schedule == Schedule::row_chunks && in_place.chunk_count == plan.chunk_count &&
        plan.chunk_count > 1) {
      const double acc_ms = 8.0 * 128256 * 4096 / 3e12 * 1e3;
      EXPECT_NEAR(in_place.predicted_ms - plan.predicted_ms, plan.chunk_count * acc_ms / 2, 1e-6);
    }
  }
  // The smallest budget is the one-row row-chunk plan's.
  ChunkRequest request = training_request(8192, 4096, 128256, 0);
  request.weight_accumulator = false;
  request.weight_sums_in_output = true;
  EXPECT_EQ(minimum_budget_bytes(request), plan_chunks(request).total_bytes);
}

TEST(ChunkPlan, PredictedTimeFollowsTheModel) {
  // Blocks: 4 products + 4 passes over N×V; accumulated rows: 3 products + 2 passes + one
  // accumulator pass (8·V·H bytes) per chunk; both with their operands' re-reads.
  // P = 700 TFLOP/s, B = 3 TB/s (chunk_plan.cpp).
  const double product_ms = 2.0 * 8192 * 128256 * 4096 / 700e12 * 1e3;  // 12.3 ms
  const double pass_ms = 8192.0 * 128256 * 2 / 3e12 * 1e3;              // 0.70 ms
  const ChunkPlan blocks = plan_chunks(training_request(8192, 4096, 128256, 512 * kMiB));
  EXPECT_NEAR(blocks.predicted_ms / kBlocksBias,
              4 * product_ms + 4 * pass_ms + blocks_reread_ms(blocks, 2, 8192, 4096, 128256), 0.5);
  const double product2_ms = 2.0 * 8192 * 256000 * 2304 / 700e12 * 1e3;  // 13.8 ms
  const double pass2_ms = 8192.0 * 256000 * 2 / 3e12 * 1e3;              // 1.40 ms
  const double accumulator_ms = 8.0 * 256000 * 2304 / 3e12 * 1e3;        // 1.57 ms
  const ChunkPlan rows = plan_chunks(training_request(8192, 2304, 256000, 3072 * kMiB));
  EXPECT_NEAR(rows.predicted_ms,
              3 * product2_ms + 2 * pass2_ms + rows.chunk_count * accumulator_ms +
                  reread_ms(3, rows.chunk_count, 0, 0, 8192, 2304, 256000),
              0.5);
}

// ---- schedule (d): the fused statistics product, then blocks with an fp32 ∂h accumulator ------

// A training call that can form its statistics with the fused product (bf16, ∂h and ∂W wanted);
// the product's least workspace as fused_stats_minimum_bytes gives it for these sizes (one
// 128-row tile of 24-byte partials per 256 columns, 52 bytes of record and finish per row).
ChunkRequest statistics_request(int64_t rows, int64_t hidden, int64_t vocab, std::size_t budget) {
  ChunkRequest request = training_request(rows, hidden, vocab, budget);
  request.bias_accumulator_bytes = 0;  // the fused product takes no bias
  request.statistics_product = true;
  request.hidden_gradient = true;
  request.statistics_bytes =
      static_cast<std::size_t>(std::min<int64_t>(rows, 128)) * ((vocab + 255) / 256) * 24 +
      static_cast<std::size_t>(rows) * 52 + 4096;
  return request;
}

std::size_t hidden_accumulator_of(int64_t rows, int64_t hidden) {
  return align_up(static_cast<std::size_t>(rows) * static_cast<std::size_t>(hidden) * 4);
}

class StatisticsBlocksBudget : public ChunkPlanBudget {};

TEST_P(StatisticsBlocksBudget, FitsTheBudgetWithTheHiddenAccumulator) {
  const auto [shape, budget_mib] = GetParam();
  const auto [rows, hidden, vocab] = shape;
  const std::size_t budget = static_cast<std::size_t>(budget_mib) * kMiB;
  ChunkRequest request = statistics_request(rows, hidden, vocab, budget);
  request.prefer_statistics = true;
  const ChunkPlan plan = plan_chunks(request);
  ASSERT_TRUE(plan.fits_budget);
  EXPECT_LE(plan.total_bytes, budget);
  const std::size_t hidden_accumulator = hidden_accumulator_of(rows, hidden);
  // (d) runs wherever its ∂h accumulator leaves room for the smallest blocks; else the plan is
  // one of (a)–(c), which need no N×H accumulator.
  if (plan.schedule != Schedule::statistics_blocks) {
    EXPECT_GT(hidden_accumulator + std::size_t{32} * kMiB, budget)
        << "the ∂h accumulator fits with room to spare, yet (d) was not taken";
    return;
  }
  EXPECT_EQ(plan.hidden_accumulator_bytes, hidden_accumulator);
  EXPECT_EQ(plan.chunk_count, 0) << "(d) forms no row chunks of logits";
  ASSERT_GT(plan.block_columns, 0);
  EXPECT_GE(plan.block_columns * plan.block_count, vocab);
  EXPECT_LT((plan.block_count - 1) * plan.block_columns, vocab) << "an empty last block";
  EXPECT_GE(plan.tile_rows * plan.tile_count, rows);
  EXPECT_GE(plan.lse_bytes, static_cast<std::size_t>(rows) * 4);
  // The chunk region holds pass 1's partials, then the tile, the block accumulator and ∂h.
  EXPECT_GE(chunk_region_bytes(plan), request.statistics_bytes);
  EXPECT_GE(chunk_region_bytes(plan),
            plan.tile_buffer_bytes + plan.accumulator_bytes + plan.hidden_accumulator_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    PerfShapes, StatisticsBlocksBudget,
    ::testing::Combine(
        ::testing::Values(std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
                          std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
                          std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256}),
                          std::make_tuple(int64_t{37}, int64_t{67}, int64_t{1031})),
        ::testing::Values(64, 256, 512, 1024)));

TEST(ChunkPlan, StatisticsBlocksReplaceRowChunksAtMidBudgets) {
  // At 512 MiB every docs/performance.md shape holds its ∂h accumulator (128 / 72 / 96 MiB) and blocks of
  // all rows: 4 products and 2 passes over N×V, against (c)'s 4 products and 4 passes.
  for (const auto& [rows, hidden, vocab] :
       {std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
        std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
        std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256})}) {
    SCOPED_TRACE(::testing::Message() << rows << ", " << hidden << ", " << vocab);
    const ChunkRequest request = statistics_request(rows, hidden, vocab, 512 * kMiB);
    const ChunkPlan plan = plan_chunks(request);
    EXPECT_EQ(plan.schedule, Schedule::statistics_blocks);
    EXPECT_LE(plan.tile_count, 2) << "blocks of (nearly) all rows: ∂W of a block in one product";
    EXPECT_EQ(plan.hidden_accumulator_bytes, hidden_accumulator_of(rows, hidden));
    ChunkRequest without = request;
    without.statistics_product = false;
    const ChunkPlan blocks = plan_chunks(without);
    EXPECT_NE(blocks.schedule, Schedule::statistics_blocks);
    EXPECT_LT(plan.predicted_ms, blocks.predicted_ms);
    // The model: 4 products, the block gradient's read and write of N×V, the ∂h accumulator's
    // read and write (8·N·H bytes) per block after the first, h re-read per block and W per row
    // tile (reread_ms), the block accumulator's (8·V·H)
    // per tile when a block has several, 6 µs per launch (4 per tile).
    const double product_ms = 2.0 * rows * vocab * hidden / 700e12 * 1e3;
    const double pass_ms = double(rows) * vocab * 2 / 3e12 * 1e3;
    const double hidden_ms = 8.0 * rows * hidden / 3e12 * 1e3;
    const double block_accumulator_ms =
        plan.tile_count > 1 ? plan.tile_count * 8.0 * vocab * hidden / 3e12 * 1e3 : 0.0;
    const double launches_ms = 4 * plan.block_count * plan.tile_count * 6e-3;
    EXPECT_NEAR(plan.predicted_ms,
                4 * product_ms + 2 * pass_ms + (plan.block_count - 1) * hidden_ms +
                    block_accumulator_ms + launches_ms +
                    reread_ms(4, 0, plan.block_count, plan.tile_count, rows, hidden, vocab),
                0.01);
  }
}

TEST(ChunkPlan, RowChunksWithTheGradientInTheProductArePricedWithoutTheRowKernel) {
  // linear_ce's per-row reference path forms the chunk gradient in the logits product's epilogue:
  // its row chunks pay half a pass over N×V where the row kernel's read and write cost two.
  // At (32768, 768, 128256) with 632 MiB (the ∂W accumulator + 256 MiB) that makes 37 row chunks
  // cheaper than (d), as measured (decision 115: 41.6 against 45.7 ms on an H100).
  ChunkRequest request = statistics_request(32768, 768, 128256, 632 * kMiB);
  const ChunkPlan blocks = plan_chunks(request);
  EXPECT_EQ(blocks.schedule, Schedule::statistics_blocks);
  request.gradient_in_product = true;
  const ChunkPlan reference = plan_chunks(request);
  EXPECT_EQ(reference.schedule, Schedule::row_chunks_accumulated);
  EXPECT_EQ(reference.chunk_count, 37);
  EXPECT_LT(reference.predicted_ms, blocks.predicted_ms);
  // The same row chunks priced either way differ by 1.5 passes over N×V, nothing else.
  request.statistics_product = false;
  request.gradient_in_product = false;
  const ChunkPlan row_kernel = plan_chunks(request);
  ASSERT_EQ(row_kernel.schedule, Schedule::row_chunks_accumulated);
  ASSERT_EQ(row_kernel.chunk_count, reference.chunk_count);
  const double pass_ms = 32768.0 * 128256 * 2 / 3e12 * 1e3;
  EXPECT_NEAR(row_kernel.predicted_ms - reference.predicted_ms, 1.5 * pass_ms, 0.01);
  // The default budget's plans do not move: one chunk at the first two shapes, three at the last.
  for (const auto& [rows, hidden, vocab, chunks] :
       {std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}, int64_t{1}),
        std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}, int64_t{1}),
        std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256}, int64_t{3})}) {
    SCOPED_TRACE(::testing::Message() << rows << ", " << hidden << ", " << vocab);
    ChunkRequest at_default = statistics_request(rows, hidden, vocab, 4096 * kMiB);
    at_default.gradient_in_product = true;
    const ChunkPlan plan = plan_chunks(at_default);
    EXPECT_NE(plan.schedule, Schedule::statistics_blocks);
    EXPECT_EQ(plan.chunk_count, chunks);
  }
}

TEST(ChunkPlan, StatisticsBlocksNeedTheirHiddenAccumulator) {
  // 64 MiB holds none of the three ∂h accumulators (128 / 72 / 96 MiB): without the ∂W output
  // to hold them (next test), (c) stays, even when asked for (d).
  for (const auto& [rows, hidden, vocab] :
       {std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
        std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
        std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256})}) {
    ChunkRequest request = statistics_request(rows, hidden, vocab, 64 * kMiB);
    request.prefer_statistics = true;
    const ChunkPlan plan = plan_chunks(request);
    EXPECT_EQ(plan.schedule, Schedule::vocabulary_blocks);
    EXPECT_TRUE(plan.fits_budget);
  }
  // Without ∂h (a frozen input) no accumulator is needed: (d) fits 64 MiB.
  ChunkRequest weight_only = statistics_request(8192, 4096, 128256, 64 * kMiB);
  weight_only.hidden_gradient = false;
  const ChunkPlan plan = plan_chunks(weight_only);
  EXPECT_EQ(plan.schedule, Schedule::statistics_blocks);
  EXPECT_EQ(plan.hidden_accumulator_bytes, 0u);
  EXPECT_LE(plan.total_bytes, 64 * kMiB);
}

// The request of a call whose 16-bit ∂W output (V×H, written over) may hold (d)'s ∂h sums.
ChunkRequest with_weight_grad_output(ChunkRequest request) {
  request.weight_grad_row_bytes = static_cast<std::size_t>(request.hidden) * 2;
  request.weight_grad_bytes =
      static_cast<std::size_t>(request.vocab) * request.weight_grad_row_bytes;
  return request;
}

// Where the sums are, against the blocks: no block before deferred_first_block reaches their
// rows, the first deferred block does, and they end inside ∂W.
void expect_sums_after_written_blocks(const ChunkPlan& plan, const ChunkRequest& request) {
  ASSERT_TRUE(plan.hidden_sums_in_weight_grad);
  EXPECT_EQ(plan.hidden_accumulator_bytes, 0u) << "no ∂h sums in the workspace";
  EXPECT_EQ(plan.hidden_sums_offset % 16, 0u);
  // The first rows' sums, if any, within the ∂h output (N·H·2 bytes hold N/2 fp32 rows).
  EXPECT_GE(plan.hidden_sums_head_rows, 0);
  EXPECT_LE(plan.hidden_sums_head_rows,
            static_cast<int64_t>(request.hidden_grad_bytes / (request.hidden * 4)));
  const std::size_t sums =
      static_cast<std::size_t>(request.rows - plan.hidden_sums_head_rows) * request.hidden * 4;
  EXPECT_LE(plan.hidden_sums_offset + sums, request.weight_grad_bytes);
  EXPECT_GT(plan.hidden_sums_offset + sums + 16, request.weight_grad_bytes) << "the last bytes";
  const int64_t first_row =
      static_cast<int64_t>(plan.hidden_sums_offset / request.weight_grad_row_bytes);
  EXPECT_LE(plan.deferred_first_block * plan.block_columns, first_row)
      << "a block written in the first sweep reaches the sums";
  EXPECT_LT(plan.deferred_first_block, plan.block_count) << "no block is deferred";
  EXPECT_GT((plan.deferred_first_block + 1) * plan.block_columns, first_row)
      << "a block deferred that never reaches the sums";
}

TEST(ChunkPlan, StatisticsBlocksKeepHiddenSumsInTheWeightGradient) {
  // At 64 MiB the three docs/performance.md shapes take (d) with the sums in the last 2N rows of ∂W (and at
  // 128 MiB the first two): the workspace holds the block tile alone, and the model prefers it
  // to (c), whose small row chunks re-read W twice each (measured 1.69 / 1.74 / 2.46 F against
  // (c)'s 1.88 / 2.44 / 2.56 at 64 MiB, docs/archive/perf-notes.md decision 49). At 128 MiB the third
  // shape measured within 4 % either way, and the model keeps (c).
  for (const auto& [rows, hidden, vocab] :
       {std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
        std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
        std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256})}) {
    for (const std::size_t budget : {64 * kMiB, 128 * kMiB}) {
      if (rows == 32768 && budget > 64 * kMiB) continue;
      SCOPED_TRACE(::testing::Message()
                   << rows << ", " << hidden << ", " << vocab << " at " << budget / kMiB << " MiB");
      const ChunkRequest request =
          with_weight_grad_output(statistics_request(rows, hidden, vocab, budget));
      const ChunkPlan plan = plan_chunks(request);
      ASSERT_EQ(plan.schedule, Schedule::statistics_blocks);
      EXPECT_TRUE(plan.fits_budget);
      EXPECT_LE(plan.total_bytes, budget);
      expect_sums_after_written_blocks(plan, request);
      // Without ∂W to hold them: (c), or (d) with the sums in a workspace that then leaves
      // narrower blocks; the plan taken is predicted faster (against (c) with the model's 5 %
      // bias of decision 45).
      ChunkRequest without = request;
      without.weight_grad_bytes = 0;
      const ChunkPlan other = plan_chunks(without);
      EXPECT_FALSE(other.hidden_sums_in_weight_grad);
      EXPECT_LT(plan.predicted_ms, 1.05 * other.predicted_ms);
    }
  }
}

// Empty wave slots of the fused gradient product over a plan's pass 2, counted launch by launch
// (each row tile of each block, the deferred blocks twice): 128 × 256 tiles, one a multiprocessor.
double idle_waves(const ChunkPlan& plan, const ChunkRequest& request, int sms) {
  double idle = 0;
  auto launch = [&](int64_t rows, int64_t columns) {
    const double waves = static_cast<double>(((rows + 127) / 128) * ((columns + 255) / 256)) / sms;
    idle += std::ceil(waves) - waves;
  };
  for (int64_t block = 0; block < plan.block_count; ++block) {
    const int64_t columns =
        std::min(plan.block_columns, request.vocab - block * plan.block_columns);
    const int runs = block >= plan.deferred_first_block ? 2 : 1;
    for (int run = 0; run < runs; ++run) {
      for (int64_t first = 0; first < request.rows; first += plan.tile_rows) {
        launch(std::min(plan.tile_rows, request.rows - first), columns);
      }
    }
  }
  return idle;
}

TEST(ChunkPlan, FusedGradientWavesAreCountedAndSteerTheBlockWidth) {
  // At 64 MiB (8192, 4096, 128256) took 39 blocks of 3328 columns: 64 × 13 tiles a launch, 6.3
  // waves on 132 multiprocessors, of which 7 run (docs/archive/perf-notes.md decision 94). Priced, the
  // planner tries every width on the 256-column grid (3584 came from no block count before) and
  // takes blocks with fewer empty slots; unpriced (no tile given), the plan is as before.
  const ChunkRequest unpriced =
      with_weight_grad_output(statistics_request(8192, 4096, 128256, 64 * kMiB));
  ChunkRequest priced = unpriced;
  priced.gradient_tile_rows = 128;
  priced.gradient_tile_columns = 256;
  priced.multiprocessors = 132;
  const ChunkPlan before = plan_chunks(unpriced);
  const ChunkPlan after = plan_chunks(priced);
  ASSERT_EQ(before.schedule, Schedule::statistics_blocks);
  ASSERT_EQ(after.schedule, Schedule::statistics_blocks);
  EXPECT_EQ(before.block_columns, 3328);
  EXPECT_EQ(after.block_columns % 256, 0);
  EXPECT_LE(after.total_bytes, priced.budget_bytes);
  EXPECT_LT(idle_waves(after, priced, 132), idle_waves(before, priced, 132));
  // 36 blocks of 3584 columns (14 tiles, 6.8 waves a launch): 285 slots where 315 ran.
  EXPECT_EQ(after.block_columns, 3584);
  EXPECT_GT(after.predicted_ms, 0);
  // Every multiprocessor count gives a plan within the budget.
  for (const int sms : {1, 78, 114, 132, 144}) {
    priced.multiprocessors = sms;
    EXPECT_LE(plan_chunks(priced).total_bytes, priced.budget_bytes) << sms;
  }
}

// A request that asks for (d), with the ∂W output, its ∂h sums placed as `place` asks.
ChunkRequest sums_request(int64_t rows, int64_t hidden, int64_t vocab, std::size_t budget,
                          HiddenSums place) {
  ChunkRequest request = with_weight_grad_output(statistics_request(rows, hidden, vocab, budget));
  request.prefer_statistics = true;
  request.hidden_sums = place;
  return request;
}

// linear_distill's (d): no fused product; its first pass forms every row's records block by block
// from the blocks' student and teacher logits (two products and a read of both tiles per sweep;
// `sweeps` 2 for jsd and tvd), keeping `records` bytes beside the chunk region.
ChunkRequest distill_statistics_request(int64_t rows, int64_t hidden, int64_t vocab,
                                        std::size_t budget, int sweeps, std::size_t records) {
  ChunkRequest request =
      with_weight_grad_output(distill_request(training_request(rows, hidden, vocab, budget)));
  request.bias_accumulator_bytes = 0;
  request.statistics_product = true;
  request.hidden_gradient = true;
  request.statistics_products = 2.0 * sweeps;
  request.statistics_passes = 2.0 * sweeps;
  request.statistics_records_bytes = records;
  request.hidden_grad_bytes = static_cast<std::size_t>(rows) * static_cast<std::size_t>(hidden) * 2;
  return request;
}

TEST(ChunkPlan, DistillationStatisticsBlocksAtSmallBudgets) {
  // At 64 MiB (c)'s row chunks of student and teacher logits hold 64–128 rows, whose products
  // re-read both weights per chunk; (d) keeps all rows (or large row tiles) per product and is
  // taken, its records beside the region and within the budget.
  for (const auto& [rows, hidden, vocab] :
       {std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
        std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
        std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256})}) {
    SCOPED_TRACE(::testing::Message() << rows << ", " << hidden << ", " << vocab);
    const std::size_t records = static_cast<std::size_t>(rows) * 160;
    const ChunkRequest request =
        distill_statistics_request(rows, hidden, vocab, 64 * kMiB, 1, records);
    const ChunkPlan plan = plan_chunks(request);
    ASSERT_EQ(plan.schedule, Schedule::statistics_blocks);
    EXPECT_TRUE(plan.fits_budget);
    EXPECT_LE(plan.total_bytes, 64 * kMiB);
    EXPECT_EQ(plan.statistics_records_bytes, align_up(records));
    EXPECT_EQ(plan.chunk_count, 0);
    EXPECT_GE(plan.block_columns * plan.block_count, vocab);
    EXPECT_GE(plan.tile_rows * plan.tile_count, rows);
    // The region holds a tile of both buffers (pass 1 forms the teacher's logits beside the
    // student's), without the records.
    EXPECT_GE(chunk_region_bytes(plan), plan.tile_buffer_bytes);
    EXPECT_GE(plan.total_bytes, chunk_region_bytes(plan) + plan.lse_bytes + align_up(records));
    ChunkRequest without = request;
    without.statistics_product = false;
    const ChunkPlan blocks = plan_chunks(without);
    EXPECT_EQ(blocks.schedule, Schedule::vocabulary_blocks);
    EXPECT_LT(plan.predicted_ms, blocks.predicted_ms);
    // A second sweep (jsd, tvd) costs its two products and two reads of N×V more, for the same
    // block shape (asked for: at the third shape the model then prefers (c)).
    ChunkRequest two_sweeps = request;
    two_sweeps.statistics_products = 4;
    two_sweeps.statistics_passes = 4;
    two_sweeps.prefer_statistics = true;
    const ChunkPlan twice = plan_chunks(two_sweeps);
    ASSERT_EQ(twice.schedule, Schedule::statistics_blocks);
    ASSERT_EQ(twice.block_columns, plan.block_columns);
    ASSERT_EQ(twice.tile_rows, plan.tile_rows);
    const double product_ms = 2.0 * rows * vocab * hidden / 700e12 * 1e3;
    const double pass_ms = double(rows) * vocab * 2 / 3e12 * 1e3;
    const double reread_per_product_ms =
        reread_ms(1, 0, plan.block_count, plan.tile_count, rows, hidden, vocab);
    EXPECT_NEAR(twice.predicted_ms - plan.predicted_ms,
                2 * product_ms + 2 * pass_ms + 2 * reread_per_product_ms, 0.01);
  }
  // The records never come out of the region: a budget that holds the region alone does not fit.
  const ChunkRequest request =
      distill_statistics_request(8192, 4096, 128256, 64 * kMiB, 1, 48 * kMiB);
  const ChunkPlan plan = plan_chunks(request);
  if (plan.schedule == Schedule::statistics_blocks) {
    EXPECT_LE(chunk_region_bytes(plan) + align_up(48 * kMiB), 64 * kMiB);
  }
}

TEST(ChunkPlan, HiddenSumsGoWhereAskedWhenTheyFit) {
  // 512 MiB holds the sums in the workspace too; each place when forced, and the model's
  // choice between them is the cheaper one.
  ChunkRequest request = sums_request(8192, 4096, 128256, 512 * kMiB, HiddenSums::workspace);
  const ChunkPlan in_workspace = plan_chunks(request);
  EXPECT_FALSE(in_workspace.hidden_sums_in_weight_grad);
  EXPECT_EQ(in_workspace.hidden_accumulator_bytes, hidden_accumulator_of(8192, 4096));
  EXPECT_EQ(in_workspace.deferred_first_block, in_workspace.block_count);
  request.hidden_sums = HiddenSums::weight_grad;
  const ChunkPlan in_weight_grad = plan_chunks(request);
  expect_sums_after_written_blocks(in_weight_grad, request);
  request.hidden_sums = HiddenSums::planned;
  const ChunkPlan planned = plan_chunks(request);
  EXPECT_EQ(planned.hidden_sums_in_weight_grad,
            in_weight_grad.predicted_ms < in_workspace.predicted_ms);
  // A ∂W smaller than the sums (V < 2N rows of a 16-bit ∂W), or no ∂h: the workspace, even when
  // ∂W is asked for.
  EXPECT_FALSE(plan_chunks(sums_request(4096, 64, 8000, 64 * kMiB, HiddenSums::weight_grad))
                   .hidden_sums_in_weight_grad);
  ChunkRequest no_hidden = request;
  no_hidden.hidden_gradient = false;
  no_hidden.hidden_sums = HiddenSums::weight_grad;
  EXPECT_FALSE(plan_chunks(no_hidden).hidden_sums_in_weight_grad);
}

TEST(ChunkPlan, HiddenSumsOfTheFirstRowsInTheHiddenGradientHalveTheDeferredBlocks) {
  // A contiguous 16-bit ∂h output holds the fp32 sums of N/2 rows (whole row tiles of them):
  // ∂W then holds the others', which reach half as many of its rows, and about half as many
  // blocks wait for ∂h. The planner takes it where the blocks spared outweigh splitting each
  // block's ∂h product at the head's last row: at (32768, 768, 128256), whose blocks have row
  // tiles that end there (measured −6.4 % at 64 MiB, docs/archive/perf-notes.md decision 52); not at the
  // other two, whose whole-row blocks would split every ∂h product to spare 3 blocks.
  for (const auto& [rows, hidden, vocab] :
       {std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
        std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
        std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256})}) {
    SCOPED_TRACE(::testing::Message() << rows << ", " << hidden << ", " << vocab);
    ChunkRequest request = sums_request(rows, hidden, vocab, 64 * kMiB, HiddenSums::weight_grad);
    const ChunkPlan alone = plan_chunks(request);
    request.hidden_grad_bytes = static_cast<std::size_t>(rows) * hidden * 2;
    request.hidden_sums_head = HiddenSumsHead::always;
    const ChunkPlan split = plan_chunks(request);
    ASSERT_EQ(split.schedule, Schedule::statistics_blocks);
    EXPECT_EQ(alone.hidden_sums_head_rows, 0);
    const int64_t half = rows / 2;
    EXPECT_EQ(split.hidden_sums_head_rows,
              split.tile_count > 1 ? half / split.tile_rows * split.tile_rows : half);
    expect_sums_after_written_blocks(split, request);
    ASSERT_EQ(split.block_columns, alone.block_columns) << "the blocks do not change";
    const int64_t deferred_alone = alone.block_count - alone.deferred_first_block;
    const int64_t deferred_split = split.block_count - split.deferred_first_block;
    EXPECT_LE(deferred_split, deferred_alone / 2 + 1);
    request.hidden_sums_head = HiddenSumsHead::planned;
    const ChunkPlan planned = plan_chunks(request);
    EXPECT_EQ(planned.hidden_sums_head_rows > 0, rows == 32768);
    EXPECT_LE(planned.predicted_ms, alone.predicted_ms + 1e-9) << "taken only where cheaper";
    request.hidden_sums_head = HiddenSumsHead::never;
    EXPECT_EQ(plan_chunks(request).hidden_sums_head_rows, 0);
  }
}

TEST(ChunkPlan, InPlaceNarrowingRangesNeverReadWhatTheyOrAnEarlierRangeWrote) {
  EXPECT_TRUE(in_place_narrowing_ranges(0, 10).empty()) << "row 0 would overlap itself";
  EXPECT_TRUE(in_place_narrowing_ranges(10, 10).empty());
  const std::vector<std::pair<int64_t, int64_t>> expected{{3, 6}, {6, 12}, {12, 13}};
  EXPECT_EQ(in_place_narrowing_ranges(3, 13), expected);
  // Byte intervals in units of H·2: fp32 row r occupies [2r, 2r + 2), 16-bit row r [r, r + 1).
  for (int64_t staged : {1, 2, 5, 64}) {
    for (int64_t rows : {1, 2, 3, 7, 64, 100, 4096, 16385}) {
      if (staged > rows) continue;
      int64_t next = staged;
      for (const auto& [first, last] : in_place_narrowing_ranges(staged, rows)) {
        EXPECT_EQ(first, next) << "ranges follow each other";
        EXPECT_GT(last, first);
        EXPECT_LE(last, 2 * first) << "writes [first, last) end where its reads [2·first, …) start";
        next = last;
      }
      EXPECT_EQ(next, rows) << "every row narrowed";
    }
  }
}

// One deferred block at least, whatever the block width: the sums reach at least one row.
TEST(ChunkPlan, HiddenSumsInOneBlockDeferItWhole) {
  const ChunkRequest request = sums_request(37, 67, 1031, 512 * kMiB, HiddenSums::weight_grad);
  const ChunkPlan plan = plan_chunks(request);
  ASSERT_EQ(plan.schedule, Schedule::statistics_blocks);
  EXPECT_EQ(plan.block_count, 1);
  expect_sums_after_written_blocks(plan, request);
  EXPECT_EQ(plan.deferred_first_block, 0);
}

TEST(ChunkPlan, PreferredStatisticsBlocksOverrideTheModel) {
  // (32768, 768, 128256) at 1 GiB: the accumulated row chunks (b) are predicted faster; asked
  // for (d), the planner takes it since it fits.
  ChunkRequest request = statistics_request(32768, 768, 128256, 1024 * kMiB);
  const ChunkPlan chosen = plan_chunks(request);
  request.prefer_statistics = true;
  const ChunkPlan preferred = plan_chunks(request);
  EXPECT_EQ(preferred.schedule, Schedule::statistics_blocks);
  EXPECT_LE(preferred.total_bytes, 1024 * kMiB);
  if (chosen.schedule != Schedule::statistics_blocks) {
    EXPECT_LE(chosen.predicted_ms, preferred.predicted_ms);
  }
}

TEST(ChunkPlan, SmallestTrainingPlanReportsItsOwnBytes) {
  ChunkRequest request = training_request(37, 67, 1031, 0);
  request.budget_bytes = minimum_budget_bytes(request);
  const ChunkPlan plan = plan_chunks(request);
  EXPECT_TRUE(plan.fits_budget);
  EXPECT_LE(plan.total_bytes, request.budget_bytes);
  request.budget_bytes = 1024;  // far below: the smallest plan, flagged
  const ChunkPlan below = plan_chunks(request);
  EXPECT_FALSE(below.fits_budget);
  EXPECT_GT(below.total_bytes, request.budget_bytes);
  expect_covers_rows(below, 37);
}

// A call below the smallest plan names the bytes it needs (the plan it got, priced with the
// products' scratch share of its budget); a budget of exactly those bytes must then run, though
// the scratch share of that larger budget would not fit beside the chunks.
TEST(ChunkPlan, TheBytesAFailedPlanNamesAreEnough) {
  for (const int64_t rows : {1, 7, 37, 300}) {
    for (const int64_t vocab : {64, 1031, 50000}) {
      for (const std::size_t element : {std::size_t{2}, std::size_t{4}}) {
        for (const bool accumulator : {false, true}) {
          ChunkRequest request = request_for(rows, 29, vocab, 1);
          request.logits_element_bytes = element;
          request.weight_gradient = true;
          request.weight_accumulator = accumulator;
          const ChunkPlan failed = plan_chunks(request);
          ASSERT_FALSE(failed.fits_budget);
          request.budget_bytes = failed.total_bytes;
          const ChunkPlan plan = plan_chunks(request);
          EXPECT_TRUE(plan.fits_budget)
              << rows << " x " << vocab << ", " << element << " B logits, accumulator "
              << accumulator << ": " << plan.total_bytes << " > " << request.budget_bytes;
          EXPECT_LE(plan.total_bytes, request.budget_bytes);
        }
      }
    }
  }
}

TEST(ChunkPlan, TeacherLogitsDoubleThePerRowCost) {
  ChunkRequest request = request_for(8192, 2304, 256000, 512 * kMiB);
  const ChunkPlan student_only = plan_chunks(request);
  request.logits_buffers_per_row = 2;
  const ChunkPlan with_teacher = plan_chunks(request);
  EXPECT_LE(with_teacher.total_bytes, request.budget_bytes);
  EXPECT_LT(with_teacher.chunk_rows, student_only.chunk_rows);
  EXPECT_GE(with_teacher.logits_buffer_bytes,
            static_cast<std::size_t>(with_teacher.chunk_rows) * 256000 * 2 * 2);
}

TEST(ChunkPlan, NoRowsNoChunks) {
  const ChunkPlan plan = plan_chunks(request_for(0, 64, 1000, 64 * kMiB));
  EXPECT_EQ(plan.chunk_count, 0);
  EXPECT_TRUE(plan.fits_budget);
}

// ---- more budget is never predicted slower ----------------------------------------------------

// One call's request: dtype (logit bytes), ∂W 16-bit (accumulator) or fp32, ∂h, the fused
// statistics product, the outputs as (d)'s scratch, and the fused gradient's waves priced.
struct CallShape {
  int64_t rows, hidden, vocab;
  std::size_t element;
  bool weight_16_bit, hidden_gradient, statistics, scratch, waves;
};

ChunkRequest call_request(const CallShape& call, std::size_t budget) {
  ChunkRequest request = request_for(call.rows, call.hidden, call.vocab, budget);
  request.logits_element_bytes = call.element;
  request.fixed_bytes = static_cast<std::size_t>(call.rows) * 48;
  request.weight_gradient = true;
  request.weight_accumulator = call.weight_16_bit;
  request.hidden_gradient = call.hidden_gradient;
  request.statistics_product = call.statistics;
  request.statistics_bytes = static_cast<std::size_t>(std::min<int64_t>(call.rows, 128)) *
                                 ((call.vocab + 255) / 256) * 24 +
                             static_cast<std::size_t>(call.rows) * 52 + 4096;
  if (call.scratch) {
    request.weight_grad_row_bytes =
        static_cast<std::size_t>(call.hidden) * (call.weight_16_bit ? 2 : 4);
    request.weight_grad_bytes =
        static_cast<std::size_t>(call.vocab) * request.weight_grad_row_bytes;
    request.hidden_grad_bytes = static_cast<std::size_t>(call.rows * call.hidden) * call.element;
  }
  if (call.waves) {
    request.gradient_tile_rows = 128;
    request.gradient_tile_columns = 256;
    request.multiprocessors = 132;
  }
  return request;
}

std::vector<CallShape> monotone_calls() {
  std::vector<CallShape> calls;
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {8192, 4096, 128256}, {8192, 2304, 256000}, {32768, 768, 128256}, {37, 67, 1031},
      {1, 4096, 128256},    {65536, 64, 5003},    {3001, 1000, 200003}, {129, 8191, 32001}};
  for (const auto& [rows, hidden, vocab] : shapes) {
    for (int variant = 0; variant < 6; ++variant) {
      const bool fp32 = variant == 5;
      calls.push_back({rows, hidden, vocab, fp32 ? std::size_t{4} : std::size_t{2},
                       variant != 2 && !fp32, variant != 3, variant != 4 && !fp32, variant % 2 == 0,
                       variant < 2});
    }
  }
  return calls;
}

std::string describe(const CallShape& call) {
  std::ostringstream text;
  text << "(" << call.rows << ", " << call.hidden << ", " << call.vocab << ") element "
       << call.element << " ∂W 16-bit " << call.weight_16_bit << " ∂h " << call.hidden_gradient
       << " statistics " << call.statistics << " scratch " << call.scratch << " waves "
       << call.waves;
  return text.str();
}

TEST(ChunkPlan, MoreBudgetIsNeverPredictedSlower) {
  // From the smallest budget that runs to 8 GiB in steps of a sixteenth: every plan fits, and
  // its predicted time never rises with the budget (a smaller budget's plan fits a larger one).
  for (const CallShape& call : monotone_calls()) {
    SCOPED_TRACE(describe(call));
    const std::size_t smallest = minimum_budget_bytes(call_request(call, 0));
    double previous = INFINITY;
    std::size_t previous_budget = 0;
    for (std::size_t budget = smallest; budget <= (std::size_t{8} << 30);
         budget += std::max<std::size_t>(budget / 16, 1)) {
      const ChunkPlan plan = plan_chunks(call_request(call, budget));
      ASSERT_TRUE(plan.fits_budget) << budget;
      ASSERT_LE(plan.total_bytes, budget);
      ASSERT_LE(plan.predicted_ms, previous)
          << "at " << budget << " bytes against " << previous_budget;
      previous = plan.predicted_ms;
      previous_budget = budget;
    }
  }
}

void expect_same_plan(const ChunkPlan& a, const ChunkPlan& b) {
  EXPECT_EQ(a.schedule, b.schedule);
  EXPECT_EQ(a.chunk_rows, b.chunk_rows);
  EXPECT_EQ(a.block_columns, b.block_columns);
  EXPECT_EQ(a.tile_rows, b.tile_rows);
  EXPECT_EQ(a.hidden_sums_in_weight_grad, b.hidden_sums_in_weight_grad);
  EXPECT_EQ(a.hidden_sums_head_rows, b.hidden_sums_head_rows);
  EXPECT_EQ(a.total_bytes, b.total_bytes);
  EXPECT_EQ(a.predicted_ms, b.predicted_ms);
}

TEST(ChunkPlan, APlanDependsOnlyOnItsRequest) {
  // The same call planned twice, and again after more calls than the planner keeps (256).
  const std::vector<CallShape> calls = monotone_calls();
  const CallShape call = calls[0];
  const ChunkRequest request = call_request(call, 195 * kMiB);
  const ChunkPlan first = plan_chunks(request);
  expect_same_plan(plan_chunks(request), first);
  for (std::size_t budget = 64; budget < 64 + 300; ++budget) {
    plan_chunks(call_request(calls[budget % calls.size()], budget * kMiB));
  }
  expect_same_plan(plan_chunks(request), first);
}

TEST(ChunkPlan, PlansOfTheMeasuredCurve) {
  // Logged for docs/archive/perf-notes.md: bf16, ∂W 16-bit and ∂h, the fused statistics product,
  // the outputs as scratch and the waves of 132 multiprocessors priced (an H200's call).
  for (const auto& [rows, hidden, vocab] :
       {std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
        std::make_tuple(int64_t{8192}, int64_t{2304}, int64_t{256000}),
        std::make_tuple(int64_t{32768}, int64_t{768}, int64_t{128256})}) {
    for (const std::size_t mib : {64, 128, 256, 512, 1024, 2048, 4096}) {
      const CallShape call{rows, hidden, vocab, 2, true, true, true, true, true};
      const ChunkPlan plan = plan_chunks(call_request(call, mib * kMiB));
      EXPECT_TRUE(plan.fits_budget);
      std::printf(
          "(%lld, %lld, %lld) %5zu MiB: schedule %c, %.2f ms, rows %lld, columns %lld, "
          "tile %lld x %lld, sums in dW %d, head %lld\n",
          static_cast<long long>(rows), static_cast<long long>(hidden),
          static_cast<long long>(vocab), mib, "abcd"[static_cast<int>(plan.schedule)],
          plan.predicted_ms, static_cast<long long>(plan.chunk_rows),
          static_cast<long long>(plan.block_columns), static_cast<long long>(plan.tile_rows),
          static_cast<long long>(plan.tile_count),
          static_cast<int>(plan.hidden_sums_in_weight_grad),
          static_cast<long long>(plan.hidden_sums_head_rows));
    }
  }
}

}  // namespace
}  // namespace xent::cuda
