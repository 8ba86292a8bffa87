// Distillation in two passes (three for jsd and tvd): the rows' statistics and loss streamed in
// one pass, then the gradient elementwise (distill_two_pass.cu says how, docs/archive/perf-notes.md
// decisions 70–72 why). distill_rows takes this path where it applies.
#pragma once

#include "cuda/rows/distill_rows.cuh"

namespace xent::cuda {

// Whether the two-pass form serves these rows: room for the per-row statistics (args.statistics
// or args.scratch_statistics), any kind but jsd and tvd with the hard-label term, and the test
// hook not forcing the row kernel.
bool distill_two_pass_applies(const DistillRowsArgs& args);

// The outputs of distill_rows (loss arrays, statistics, gradient), by the two passes.
void distill_rows_two_pass(const DistillRowsArgs& args, cudaStream_t stream);

}  // namespace xent::cuda
