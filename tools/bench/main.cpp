// xent-bench: times xent ops through the public API against a naive form in the same run.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "bench/config.hpp"
#include "bench/device.hpp"
#include "bench/measure.hpp"
#include "bench/record.hpp"

#ifndef XENT_SOURCE_DIR
#define XENT_SOURCE_DIR "."
#endif

using namespace xent::bench;

namespace {

std::unique_ptr<BenchDevice> open_device(DeviceChoice choice) {
#if defined(XENT_BENCH_CUDA)
  if (choice != DeviceChoice::cpu) {
    if (auto cuda = make_cuda_device()) return cuda;
    if (choice == DeviceChoice::cuda) throw UsageError{"--device cuda: no CUDA GPU is visible"};
  }
#else
  if (choice == DeviceChoice::cuda)
    throw UsageError{"--device cuda: this build has no CUDA backend (configure with nvcc)"};
#endif
  return make_cpu_device();
}

// Runs tools/compare_torch.py on the same cases; its records are appended to its own JSON file.
int run_torch_comparison(const Config& config) {
  int status = 0;
  for (const Case& c : config.cases) {
    std::string command = std::string("python3 '") + XENT_SOURCE_DIR + "/tools/compare_torch.py'" +
                          " --op " + op_name(c.op) + " --n " + std::to_string(c.n) + " --v " +
                          std::to_string(c.v) + " --dtype " +
                          (c.dtype == xent::DType::bf16  ? "bf16"
                           : c.dtype == xent::DType::f16 ? "fp16"
                                                         : "fp32") +
                          " --mode " + mode_name(c.mode);
    if (c.h > 0) command += " --h " + std::to_string(c.h);
    if (c.op == Op::distill || c.op == Op::linear_distill)
      command += std::string(" --kind ") + xent::distill_kind_name(c.kind);
    if (config.device == DeviceChoice::cpu) command += " --device cpu";
    if (!config.json_path.empty())
      command += " --json '" + config.json_path + ".torch.json' --append";
    std::fprintf(stderr, "[xent-bench] %s\n", command.c_str());
    if (std::system(command.c_str()) != 0) status = 1;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  Config config;
  std::unique_ptr<BenchDevice> device;
  try {
    config = parse_command_line(argc, argv);
    if (config.help) {
      print_help();
      return 0;
    }
    device = open_device(config.device);
    if (!config.suite.empty() && device->device().kind != xent::DeviceKind::cuda)
      throw UsageError{"--suite " + config.suite +
                       ": the docs/performance.md suites run on CUDA only"};
    resolve_cases(config, device->device().kind);
  } catch (const UsageError& error) {
    std::fprintf(stderr, "xent-bench: %s\n", error.message.c_str());
    return 2;
  }

  try {
    MeasureSettings settings;
    settings.repeat = config.repeat > 0 ? config.repeat : device->default_repeat();
    settings.warmup = config.warmup >= 0 ? config.warmup : device->default_warmup();
    settings.naive = config.naive && config.suite.empty();
    settings.check = config.check && settings.naive;
    settings.profile_one_call = config.profile_one_call;
    std::fprintf(stderr, "[xent-bench] device: %s\n", device->name().c_str());
    if (device->device().kind == xent::DeviceKind::cuda) {
      settings.copy_bandwidth = device->copy_bandwidth();
      std::fprintf(stderr, "[xent-bench] copy bandwidth B = %.1f GB/s\n",
                   settings.copy_bandwidth / 1e9);
    }
    std::vector<Record> records;
    for (const Case& c : config.cases) {
      measure_case(*device, c, settings, records);
      // After every case, so a run cut short keeps what it measured.
      if (!config.json_path.empty()) write_json(config.json_path, records);
    }
    print_table(records);
    std::fflush(stdout);  // the table first, then anything --compare prints
    if (!config.json_path.empty())
      std::fprintf(stderr, "[xent-bench] wrote %zu records to %s\n", records.size(),
                   config.json_path.c_str());
    int status = 0;
    if (config.max_error >= 0) {
      for (const Record& r : records) {
        if (r.impl != "xent") continue;
        const bool agrees = r.error.empty() && r.loss_rel_err <= config.max_error &&
                            (std::isnan(r.grad_rel_err) ? r.spec.mode == Mode::fwd
                                                        : r.grad_rel_err <= config.max_error);
        if (!agrees) {
          std::fprintf(stderr, "xent-bench: %s %s does not agree with the naive form within %g\n",
                       op_name(r.spec.op), mode_name(r.spec.mode), config.max_error);
          status = 1;
        }
      }
    }
    if (config.compare == "torch" && run_torch_comparison(config) != 0) status = 1;
    return status;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "xent-bench: %s\n", error.what());
    return 1;
  }
}
