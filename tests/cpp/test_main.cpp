// main() of the test binaries and the seeds of docs/semantics.md §6's "fresh random inputs": one seed per run,
// printed before anything else, from which every test derives its own, so a failure seen once
// (in CI, or in a sweep over many seeds) replays exactly.
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>

#include "support.hpp"
#if XENT_TEST_ON_GPU
#include "cuda/test_hook.hpp"
#endif

namespace xent::test {
namespace {

uint64_t g_run_seed = 0;
uint64_t g_iteration_seed = 0;  // run seed + gtest_repeat iteration
uint64_t g_draws = 0;           // fresh_seed() calls in the current test

uint64_t parse_seed(const char* text, const char* source) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (end == text || *end != '\0') {
    std::cerr << "xent tests: " << source << " must be a decimal integer, got '" << text << "'\n";
    std::exit(2);
  }
  return value;
}

// splitmix64's finaliser: neighbouring run seeds (a sweep's seed, seed + 1, ...) and similar test
// names give unrelated generator seeds.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t name_hash(const std::string& name) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

class SeedPrinter : public ::testing::EmptyTestEventListener {
  void OnTestIterationStart(const ::testing::UnitTest&, int iteration) override {
    g_iteration_seed = g_run_seed + static_cast<uint64_t>(iteration);
    if (iteration > 0 || GTEST_FLAG_GET(repeat) != 1) {
      std::cout << "xent tests: iteration " << iteration << ", XENT_TEST_SEED=" << g_iteration_seed
                << std::endl;
    }
  }
  void OnTestStart(const ::testing::TestInfo&) override { g_draws = 0; }
};

}  // namespace

uint64_t run_seed() { return g_iteration_seed; }

void set_run_seed(uint64_t seed) { g_run_seed = g_iteration_seed = seed; }

uint64_t fresh_seed() {
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name =
      test ? std::string(test->test_suite_name()) + "." + test->name() : std::string();
  return mix(g_iteration_seed ^ mix(name_hash(name) + g_draws++));
}

int run_tests(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const char* source = "a random seed";
  uint64_t seed = 0;
  bool chosen = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--seed=", 7) == 0) {
      seed = parse_seed(argv[i] + 7, "--seed");
      source = "--seed";
      chosen = true;
#if XENT_TEST_ON_GPU
    } else if (std::strcmp(argv[i], "--portable-paths") == 0) {
      // The whole suite on the portable paths, as a non-Hopper GPU runs it (core/arch.hpp).
      cuda::test_hook().portable_paths = cuda::Forced::on;
#endif
    } else {
      std::cerr << "xent tests: unknown argument '" << argv[i]
                << "' (expected --seed=N, --portable-paths (GPU suite) or gtest flags)\n";
      return 2;
    }
  }
#if XENT_TEST_ON_GPU
  // The same for a run that cannot pass arguments (ctest): XENT_TEST_PORTABLE_PATHS=1.
  if (const char* portable = std::getenv("XENT_TEST_PORTABLE_PATHS");
      portable && std::strcmp(portable, "1") == 0) {
    cuda::test_hook().portable_paths = cuda::Forced::on;
  }
#endif
  const char* environment = std::getenv("XENT_TEST_SEED");
  if (!chosen && environment && *environment) {
    seed = parse_seed(environment, "XENT_TEST_SEED");
    source = "XENT_TEST_SEED";
    chosen = true;
  }
  if (!chosen) {
    std::random_device device;
    seed = device() % 1000000000u;  // short enough to copy from a log
  }
  set_run_seed(seed);
  // gtest_discover_tests parses the listing: nothing else may be printed then.
  if (GTEST_FLAG_GET(list_tests)) return RUN_ALL_TESTS();
  std::cout << "xent tests: XENT_TEST_SEED=" << seed << " (" << source
            << "; replay with XENT_TEST_SEED=" << seed << " or --seed=" << seed << ")" << std::endl;
#if XENT_TEST_ON_GPU
  if (cuda::test_hook().portable_paths == cuda::Forced::on) {
    std::cout << "xent tests: the portable paths forced on every device" << std::endl;
  }
#endif
  ::testing::UnitTest::GetInstance()->listeners().Append(new SeedPrinter);
  return RUN_ALL_TESTS();
}

}  // namespace xent::test

int main(int argc, char** argv) { return xent::test::run_tests(argc, argv); }
