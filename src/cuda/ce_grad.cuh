// The elementwise ce gradient from a saved lse (backward of reduction none, or any reduction when
// the forward kept lse): logits read once, gradient written once.
#pragma once

#include "cuda/ce_rows.cuh"

namespace xent::cuda {

// Uses args.logits/target/row_weight/options/totals/grad_output_rows/grad/grad_scale; `lse` is
// [rows] fp32 on the device (entries of ignored rows are not read).
void ce_grad_from_lse(const CeRowsArgs& args, const float* lse, cudaStream_t stream);

}  // namespace xent::cuda
