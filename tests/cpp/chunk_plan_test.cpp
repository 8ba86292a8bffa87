// The CUDA chunk planner is plain C++: its budget arithmetic and chunk choices are checked here,
// on the CPU, for the PERF.md shapes and for budgets down to a single row.
#include "cuda/chunk_plan.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <tuple>

namespace xent::cuda {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

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
    EXPECT_GT(bigger, budget) << "chunk_rows " << plan.chunk_rows << " leaves budget unused";
  }
}

INSTANTIATE_TEST_SUITE_P(
    PerfShapes, ChunkPlanBudget,
    ::testing::Combine(::testing::Values(std::make_tuple(int64_t{8192}, int64_t{4096}, int64_t{128256}),
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

TEST(ChunkPlan, AccumulatorsSitOnTopOfTheBudget) {
  ChunkRequest request = request_for(8192, 4096, 128256, 512 * kMiB);
  const ChunkPlan without = plan_chunks(request);
  request.accumulator_bytes = std::size_t{128256} * 4096 * 4;
  const ChunkPlan with = plan_chunks(request);
  EXPECT_EQ(with.chunk_rows, without.chunk_rows);
  EXPECT_EQ(with.total_bytes, without.total_bytes + align_up(request.accumulator_bytes));
}

TEST(ChunkPlan, OverlapOnlyWhenHalvedChunksStayEfficient) {
  ChunkRequest request = request_for(32768, 768, 128256, 1024 * kMiB);
  request.overlap = true;
  const ChunkPlan large = plan_chunks(request);  // 1 GiB: two buffers of >= 1024 rows fit
  EXPECT_EQ(large.buffer_count, 2);
  EXPECT_GE(large.chunk_rows, 1024);
  EXPECT_LE(large.total_bytes, request.budget_bytes);
  request.budget_bytes = 64 * kMiB;  // 64 MiB: halving would starve the ∂W product
  EXPECT_EQ(plan_chunks(request).buffer_count, 1);
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

}  // namespace
}  // namespace xent::cuda
