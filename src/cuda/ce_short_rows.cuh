// The register-resident path of the CUDA cross-entropy row kernel for short rows (SPEC.md §1):
// a warp (or a pair of warps) per row, the row held in registers between the statistics and the
// gradient. ce_rows() (ce_rows.cu) takes it when the row fits; same arguments, same outputs.
#pragma once

#include <cuda_runtime.h>

#include "cuda/ce_rows.cuh"

namespace xent::cuda {

// The longest row (columns) the short-row kernel takes for `dtype` with the current setting of
// XENT_CUDA_SHORT_ROWS (unset: every row that fits, 8192 16-bit or 4096 fp32 columns; "0": none,
// the cluster kernel for every row; a number: at most that many columns, for A/B runs).
int64_t short_row_limit(DType dtype);

// Runs ce_rows' work on the short-row kernel; args.vocab must be ≤ short_row_limit(args.dtype).
void ce_short_rows(const CeRowsArgs& args, cudaStream_t stream);

}  // namespace xent::cuda
