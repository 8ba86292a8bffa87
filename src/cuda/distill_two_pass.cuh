// Forward and reverse KL without a hard-label term in two passes: the rows' statistics and
// divergence streamed in one pass, then the gradient elementwise (distill_two_pass.cu says how,
// docs/perf-notes.md decision 70 why). distill_rows takes this path where it applies.
#pragma once

#include "cuda/distill_rows.cuh"

namespace xent::cuda {

// Whether the two-pass form serves these rows: forward or reverse KL, no hard-label term, and
// room for the per-row statistics (args.statistics or args.scratch_statistics).
bool distill_two_pass_applies(const DistillRowsArgs& args);

// The outputs of distill_rows (loss arrays, statistics, gradient), by the two passes.
void distill_rows_two_pass(const DistillRowsArgs& args, cudaStream_t stream);

}  // namespace xent::cuda
