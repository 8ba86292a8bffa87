// What one xent-bench invocation measures: parsed from the command line, never from the
// environment, so a JSON record can name everything that shaped it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "xent/xent.hpp"

namespace xent::bench {

enum class Op { ce, linear_ce, distill, linear_distill };
enum class Mode { fwd, fwdbwd };
enum class DeviceChoice { best, cpu, cuda };

const char* op_name(Op op);
const char* mode_name(Mode mode);

// The CE options a run switches on; each on uses a fixed, documented value (see --help).
struct OptionSet {
  bool smoothing = false;
  bool z_loss = false;
  bool softcap = false;
  bool logit_scale = false;
  bool class_weight = false;
  bool row_weight = false;
  bool hard = false;  // distillation: α = σ = 0.5, the hard-label ce term beside the loss

  bool any() const {
    return smoothing || z_loss || softcap || logit_scale || class_weight || row_weight || hard;
  }
  std::string describe() const;  // "plain" or the comma list
};

// One measurement to take: an op at one shape with one set of options.
struct Case {
  Op op = Op::linear_ce;
  Mode mode = Mode::fwdbwd;
  DType dtype = DType::f32;
  int64_t n = 0, h = 0, v = 0;
  DistillKind kind = DistillKind::forward_kl;
  Reduction reduction = Reduction::mean;
  OptionSet options;
  std::size_t budget_bytes = std::size_t{512} << 20;
  bool fp32_logits = false;  // linear ops: chunk logits in fp32, not rounded to the input dtype
  std::string label;         // the suite row it belongs to, or empty
};

struct Config {
  DeviceChoice device = DeviceChoice::best;
  Case single;  // the case of --op/--n/...; zeros and dtype_given=false mean defaults
  bool dtype_given = false;
  std::vector<Case> cases;        // filled by resolve_cases once the device is known
  int repeat = 0;                 // 0: the device's default
  int warmup = -1;                // -1: the device's default
  bool naive = true;              // also time the naive (materialised logits) form
  bool check = true;              // compare xent against the naive form
  std::string json_path;          // empty: no JSON
  std::string compare;            // "torch": also run tools/compare_torch.py on the same cases
  std::string suite;              // the suite name, for the records
  double max_error = -1;          // >= 0: exit 1 unless every xent record ran and agrees within it
  bool profile_one_call = false;  // one extra xent call per case inside the profiler range
  bool help = false;
};

// Parses argv; throws UsageError with a message for the user on a bad flag or value.
struct UsageError {
  std::string message;
};
Config parse_command_line(int argc, char** argv);
void print_help();

// Fills config.cases: the suite's rows, or the single case with the device's default shape.
void resolve_cases(Config& config, DeviceKind device);

// docs/performance.md rows of a suite (perf-ce, perf-distill, perf-linear, perf); empty for an unknown name.
std::vector<Case> suite_cases(const std::string& name);

}  // namespace xent::bench
