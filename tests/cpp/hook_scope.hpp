// Forces paths of the CUDA backend for the lifetime of a scope through its one test hook
// (src/cuda/test_hook.hpp), restoring what was set before. GPU suites only.
#pragma once

#include "cuda/test_hook.hpp"

namespace xent::test {

class HookScope {
 public:
  HookScope() : saved_(cuda::test_hook()) {}
  ~HookScope() { cuda::test_hook() = saved_; }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;
  cuda::TestHook* operator->() const { return &cuda::test_hook(); }

 private:
  cuda::TestHook saved_;
};

}  // namespace xent::test
