// The calls a user of the public API makes for one case: forward only, or forward and backward
// (one call that forms the gradients in the forward for sum/mean; forward then backward with the
// per-row upstream gradient for none, as autograd does).
#pragma once

#include "bench/problem.hpp"

namespace xent::bench {

std::size_t xent_workspace_bytes(const Problem& problem, Device device);

void run_xent(const Problem& problem, const Inputs& in, const Outputs& out, Workspace workspace,
              Stream stream);

}  // namespace xent::bench
