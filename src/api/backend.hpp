// Declarations of the backends' op sets; src/api dispatches to one of them by device.
#pragma once

#include "xent/xent.hpp"

namespace xent::cpu {
#include "api/backend_ops.inc"

// Distillation from a top-k teacher (no CUDA backend yet): loss and/or grad when present.
void distill_topk(TensorView student, const TopKTeacher& teacher, TensorView target,
                  const DistillOptions& options, TensorView loss, TensorView grad,
                  TensorView grad_output);
}  // namespace xent::cpu

#if defined(XENT_WITH_CUDA)
namespace xent::cuda {
#include "api/backend_ops.inc"

// Distillation from a top-k teacher (k <= kDistillTopKMaxK); the workspace is distill's
// (distill_workspace_size).
void distill_topk(TensorView student, const TopKTeacher& teacher, TensorView target,
                  const DistillOptions& options, TensorView loss, TensorView grad,
                  TensorView grad_output, Workspace workspace, Stream stream);
}  // namespace xent::cuda
#endif
