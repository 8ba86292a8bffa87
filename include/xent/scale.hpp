// Scaling a gradient in place by an upstream gradient that lives on the device.
#pragma once

#include "xent/types.hpp"

namespace xent {

// data [N, V] or [N] (fp32, bf16, fp16; fp64 on the CPU) *= factor (an fp32 scalar on data's
// device). A gradient formed in the forward pass for an upstream gradient of 1 (sum and mean
// reductions) becomes the gradient for the real upstream scalar this way. The factor is read on
// the device, never copied to the host (no synchronisation, CUDA-graph capturable); when it is
// exactly 1 — the common `loss.backward()` — the kernel returns without touching `data`, so the
// backward of a fused loss moves no bytes.
void scale_in_place(TensorView data, TensorView factor, Stream stream = {});

}  // namespace xent
