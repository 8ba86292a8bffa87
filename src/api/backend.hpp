// Declarations of the backends' op sets; src/api dispatches to one of them by device.
#pragma once

#include "xent/xent.hpp"

namespace xent::cpu {
#include "api/backend_ops.inc"
}  // namespace xent::cpu

#if defined(XENT_WITH_CUDA)
namespace xent::cuda {
#include "api/backend_ops.inc"
}  // namespace xent::cuda
#endif
