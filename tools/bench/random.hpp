// Counter-based random numbers: element i of a fill depends only on (seed, i), so a fill is
// reproducible and parallel on the CPU and on the GPU alike.
#pragma once

#include <cstdint>

#include "common/numeric.hpp"

namespace xent::bench {

XENT_HD uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) with 24 random bits.
XENT_HD float uniform01(uint64_t seed, uint64_t index) {
  return static_cast<float>(mix64(seed * 0x2545f4914f6cdd1dull + index) >> 40) * 0x1.0p-24f;
}

}  // namespace xent::bench
