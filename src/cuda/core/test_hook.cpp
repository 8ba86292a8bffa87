#include "cuda/test_hook.hpp"

namespace xent::cuda {

TestHook& test_hook() {
  static TestHook hook;
  return hook;
}

}  // namespace xent::cuda
