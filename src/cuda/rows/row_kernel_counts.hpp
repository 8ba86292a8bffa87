// Counters of the row kernels' less common launch forms, for tests that assert a path ran (a host
// header: test sources include it without the device code of the kernels).
#pragma once

#include <cstdint>

namespace xent::cuda {

// How many distill_rows launches of this process ran clusters larger than the portable 8 (the
// non-portable cluster of long rows, distill_rows.cu, docs/archive/perf-notes.md decision 65).
int64_t distill_rows_wide_cluster_launches();

// How many distill_rows calls of this process took the two-pass form (distill_two_pass.cuh).
int64_t distill_two_pass_launches();

}  // namespace xent::cuda
