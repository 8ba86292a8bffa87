// The one place tests force a path of the CUDA backend that the library would otherwise choose
// for itself (a schedule, a product, where a buffer lies). The library reads these fields at the
// points it decides, per call; nothing in it sets them, and their defaults force nothing. Users
// have no reason to touch it: it is not part of the API (include/xent), and the environment plays
// no part in any choice. Plain C++, so the test sources include it without device code.
#pragma once

#include <cstdint>

#include "cuda/plan/chunk_plan.hpp"

namespace xent::cuda {

// A choice the library makes by itself (planned), or forced off or on.
enum class Forced : int8_t { planned, off, on };

// Which cuBLASLt products are timed against the heuristic's other candidates (core/gemm.cu).
enum class GemmTuning : int8_t { planned, off, all };

struct TestHook {
  // The portable paths (core/arch.hpp) on every device: on runs them on a Hopper GPU, as an sm_80
  // GPU would (one CTA per row, cp.async staging, no clusters, no fused products).
  Forced portable_paths = Forced::planned;
  // Distillation on logits in two (three) passes over HBM (rows/distill_two_pass.cu); off keeps
  // every row on the row kernel. Only "off" is a forcing: on means the library's choice.
  Forced distill_two_pass = Forced::planned;
  // linear_distill's schedule (d): on wherever it fits the budget, off never.
  Forced distill_statistics_blocks = Forced::planned;
  // linear_ce's fused statistics product (sm90/fused_stats.cu): on wherever the call is eligible.
  Forced fused_statistics = Forced::planned;
  // The fused gradient product (sm90/fused_grad.cuh): on or off whatever the hidden size.
  Forced fused_gradient = Forced::planned;
  // Rows each consumer warp of the fused gradient product owns: 0 (its choice), 4 or 8.
  int fused_own_rows = 0;
  // linear_ce's per-row reference path (linear/linear_reference.cuh): off never takes it; on
  // takes its statistics form at every hidden size, not only from kReferenceStatisticsMinHidden.
  Forced reference_path = Forced::planned;
  // Where schedule (d) keeps its fp32 ∂h sums, and whether the first rows' go in the ∂h output.
  HiddenSums hidden_sums = HiddenSums::planned;
  HiddenSumsHead hidden_sums_head = HiddenSumsHead::planned;
  // At most this many (>= 1) of those first rows are staged before the in-place narrowing, so
  // that small test shapes run the in-place ranges too; 0 stages as many as fit.
  int64_t hidden_sums_staged_rows = 0;
  GemmTuning gemm_tuning = GemmTuning::planned;
};

// The process's hook. Tests set fields for the lifetime of a case and restore the defaults.
TestHook& test_hook();

}  // namespace xent::cuda
