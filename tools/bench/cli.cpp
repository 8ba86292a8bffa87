// Command-line parsing of xent-bench. Every bad flag or value is a UsageError (exit code 2).
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "bench/config.hpp"

namespace xent::bench {

const char* op_name(Op op) {
  switch (op) {
    case Op::ce:
      return "ce";
    case Op::linear_ce:
      return "linear_ce";
    case Op::distill:
      return "distill";
    case Op::linear_distill:
      return "linear_distill";
  }
  return "?";
}

const char* mode_name(Mode mode) { return mode == Mode::fwd ? "fwd" : "fwdbwd"; }

std::string OptionSet::describe() const {
  if (smoothing && z_loss && softcap && logit_scale && class_weight && row_weight) return "all";
  std::string out;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!out.empty()) out += ",";
    out += name;
  };
  add(smoothing, "smoothing");
  add(z_loss, "z_loss");
  add(softcap, "softcap");
  add(logit_scale, "logit_scale");
  add(class_weight, "class_weight");
  add(row_weight, "row_weight");
  add(hard, "hard");
  return out.empty() ? "plain" : out;
}

void print_help() {
  std::printf(
      "xent-bench: times xent losses against a naive form that materialises the logits.\n"
      "\n"
      "usage: xent-bench [flags]            (no flags: linear_ce fwd+bwd at the device's\n"
      "                                      default shape, xent against naive)\n"
      "  --op ce|linear_ce|distill|linear_distill   op to measure (default linear_ce)\n"
      "  --device cpu|cuda      device (default: CUDA when compiled in and a GPU is visible)\n"
      "  --dtype bf16|fp16|fp32 input dtype (default fp32 on the CPU, bf16 on CUDA)\n"
      "  --n N --h H --v V      rows (tokens), hidden size, vocabulary size\n"
      "                         defaults CPU: ce/distill 1024 x 32000; linear 1024, 256, 32000\n"
      "                                 CUDA: ce/distill 8192 x 131072; linear 8192, 4096, 128256\n"
      "  --kind K               distill kind: forward_kl|reverse_kl|jsd|soft_ce|tvd\n"
      "  --reduction R          none|sum|mean (default mean)\n"
      "  --options LIST         comma list of smoothing (eps 0.1), z_loss (1e-4), softcap (30),\n"
      "                         logit_scale (0.5), class_weight (random in [0.5, 1.5]),\n"
      "                         row_weight (random in [0, 2]), or all; distillation:\n"
      "                         softcap, and hard (alpha = sigma = 0.5: the hard-label ce\n"
      "                         term, with smoothing, z_loss, class_weight, row_weight for\n"
      "                         it; needs --no-naive)\n"
      "  --budget-mib M         workspace budget of the fused linear ops (default 512)\n"
      "  --fp32-logits          linear ops: keep chunk logits in fp32 instead of rounding them\n"
      "                         to the input dtype (options.fp32_logits)\n"
      "  --mode fwd|fwdbwd      forward only, or forward and backward (default fwdbwd)\n"
      "  --repeat K             timed repetitions (default 3 CPU, 50 CUDA)\n"
      "  --warmup K             untimed repetitions first (default 1 CPU, 5 CUDA)\n"
      "  --suite S              perf-ce|perf-distill|perf-linear|perf: the docs/performance.md "
      "rows (CUDA)\n"
      "  --no-naive             skip the naive form (no time, memory or agreement for it)\n"
      "  --profile-one-call     per case, one more xent call between cudaProfilerStart and\n"
      "                         cudaProfilerStop, after the first call and before the timed\n"
      "                         ones (for ncu --profile-from-start off; scripts/gpu-profile.sh)\n"
      "  --json FILE            write every measurement as a JSON array of records\n"
      "  --max-error E          exit 1 unless every xent run succeeds and agrees with the\n"
      "                         naive form within relative error E (loss and gradients)\n"
      "  --compare torch        also run tools/compare_torch.py on the same cases\n"
      "  --help                 this text\n"
      "\n"
      "Times are median, p20, p80 over the repetitions. 'extra MiB' is memory beyond the\n"
      "inputs and their gradients. On CUDA the run also measures the copy bandwidth B and,\n"
      "for linear ops, the cuBLASLt GEMM floor F; ratio is min bytes / time / B (ce,\n"
      "distill) or time / F (linear ops). Exit code 2 on a bad flag, 1 on a failed run.\n");
}

namespace {

std::string flag_value(int argc, char** argv, int& i, const std::string& flag,
                       const std::string& inline_value, bool has_inline) {
  if (has_inline) return inline_value;
  if (i + 1 >= argc) throw UsageError{flag + " needs a value"};
  return argv[++i];
}

int64_t parse_positive(const std::string& flag, const std::string& text, int64_t max_value) {
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || value <= 0 || value > max_value) {
    std::ostringstream message;
    message << flag << ": got '" << text << "'; expected an integer in [1, " << max_value << "]";
    throw UsageError{message.str()};
  }
  return value;
}

template <class Enum>
Enum parse_choice(const std::string& flag, const std::string& text,
                  std::initializer_list<std::pair<const char*, Enum>> choices) {
  std::string names;
  for (const auto& [name, value] : choices) {
    if (text == name) return value;
    names += names.empty() ? name : std::string("|") + name;
  }
  throw UsageError{flag + ": got '" + text + "'; expected one of " + names};
}

OptionSet parse_options(const std::string& text) {
  OptionSet set;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item == "all") {
      set = {true, true, true, true, true, true};
    } else if (item == "smoothing") {
      set.smoothing = true;
    } else if (item == "z_loss") {
      set.z_loss = true;
    } else if (item == "softcap") {
      set.softcap = true;
    } else if (item == "logit_scale") {
      set.logit_scale = true;
    } else if (item == "class_weight") {
      set.class_weight = true;
    } else if (item == "row_weight") {
      set.row_weight = true;
    } else if (item == "hard") {
      set.hard = true;
    } else if (item != "plain" && item != "none") {
      throw UsageError{"--options: got '" + item +
                       "'; expected a comma list of smoothing, z_loss, softcap, logit_scale, "
                       "class_weight, row_weight, hard, all"};
    }
  }
  return set;
}

}  // namespace

Config parse_command_line(int argc, char** argv) {
  Config config;
  Case& c = config.single;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string inline_value;
    bool has_inline = false;
    if (const auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      has_inline = true;
    }
    auto value = [&] { return flag_value(argc, argv, i, flag, inline_value, has_inline); };
    if (flag == "--help" || flag == "-h") {
      config.help = true;
    } else if (flag == "--op") {
      c.op = parse_choice<Op>(flag, value(),
                              {{"ce", Op::ce},
                               {"linear_ce", Op::linear_ce},
                               {"distill", Op::distill},
                               {"linear_distill", Op::linear_distill}});
    } else if (flag == "--device") {
      config.device = parse_choice<DeviceChoice>(
          flag, value(), {{"cpu", DeviceChoice::cpu}, {"cuda", DeviceChoice::cuda}});
    } else if (flag == "--dtype") {
      c.dtype = parse_choice<DType>(
          flag, value(), {{"bf16", DType::bf16}, {"fp16", DType::f16}, {"fp32", DType::f32}});
      config.dtype_given = true;
    } else if (flag == "--n") {
      c.n = parse_positive(flag, value(), int64_t{1} << 24);
    } else if (flag == "--h") {
      c.h = parse_positive(flag, value(), int64_t{1} << 17);
    } else if (flag == "--v") {
      c.v = parse_positive(flag, value(), int64_t{1} << 22);
    } else if (flag == "--kind") {
      c.kind = parse_choice<DistillKind>(flag, value(),
                                         {{"forward_kl", DistillKind::forward_kl},
                                          {"reverse_kl", DistillKind::reverse_kl},
                                          {"jsd", DistillKind::jsd},
                                          {"soft_ce", DistillKind::soft_ce},
                                          {"tvd", DistillKind::tvd}});
    } else if (flag == "--reduction") {
      c.reduction = parse_choice<Reduction>(
          flag, value(),
          {{"none", Reduction::none}, {"sum", Reduction::sum}, {"mean", Reduction::mean}});
    } else if (flag == "--options") {
      c.options = parse_options(value());
    } else if (flag == "--budget-mib") {
      c.budget_bytes = static_cast<std::size_t>(parse_positive(flag, value(), 1 << 20)) << 20;
    } else if (flag == "--fp32-logits") {
      c.fp32_logits = true;
    } else if (flag == "--mode") {
      c.mode = parse_choice<Mode>(flag, value(), {{"fwd", Mode::fwd}, {"fwdbwd", Mode::fwdbwd}});
    } else if (flag == "--repeat") {
      config.repeat = static_cast<int>(parse_positive(flag, value(), 100000));
    } else if (flag == "--warmup") {
      const std::string text = value();
      config.warmup = text == "0" ? 0 : static_cast<int>(parse_positive(flag, text, 1000));
    } else if (flag == "--suite") {
      config.suite = value();
      if (suite_cases(config.suite).empty())
        throw UsageError{"--suite: got '" + config.suite +
                         "'; expected one of perf-ce|perf-distill|perf-linear|perf"};
    } else if (flag == "--no-naive") {
      config.naive = false;
      config.check = false;
    } else if (flag == "--profile-one-call") {
      config.profile_one_call = true;
    } else if (flag == "--max-error") {
      const std::string text = value();
      char* end = nullptr;
      config.max_error = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(config.max_error >= 0))
        throw UsageError{"--max-error: got '" + text + "'; expected a non-negative number"};
    } else if (flag == "--json") {
      config.json_path = value();
    } else if (flag == "--compare") {
      config.compare = parse_choice<std::string>(flag, value(), {{"torch", std::string("torch")}});
    } else {
      throw UsageError{"unknown flag '" + flag + "' (see --help)"};
    }
  }
  if (c.op != Op::distill && c.op != Op::linear_distill && c.kind != DistillKind::forward_kl)
    throw UsageError{"--kind applies to --op distill and linear_distill only"};
  if (c.fp32_logits && c.op != Op::linear_ce && c.op != Op::linear_distill)
    throw UsageError{"--fp32-logits applies to --op linear_ce and linear_distill only"};
  const bool distillation = c.op == Op::distill || c.op == Op::linear_distill;
  if (distillation && !c.options.hard &&
      (c.options.smoothing || c.options.z_loss || c.options.logit_scale || c.options.class_weight ||
       c.options.row_weight))
    throw UsageError{
        "--options: distillation takes softcap, and hard with the ce options of "
        "its hard-label term; got '" +
        c.options.describe() + "'"};
  if (c.options.hard && !distillation)
    throw UsageError{"--options hard applies to --op distill and linear_distill only"};
  if (c.options.hard && (c.options.logit_scale || c.options.softcap))
    throw UsageError{
        "--options hard: the naive form and these runs take smoothing, z_loss, "
        "class_weight and row_weight beside it; got '" +
        c.options.describe() + "'"};
  if (c.options.hard && config.naive)
    throw UsageError{"--options hard: the naive form has no hard-label term; add --no-naive"};
  return config;
}

void resolve_cases(Config& config, DeviceKind device) {
  if (!config.suite.empty()) {
    config.cases = suite_cases(config.suite);
    return;
  }
  Case c = config.single;
  const bool cuda = device == DeviceKind::cuda;
  const bool linear = c.op == Op::linear_ce || c.op == Op::linear_distill;
  if (!config.dtype_given) c.dtype = cuda ? DType::bf16 : DType::f32;
  if (c.n == 0) c.n = cuda ? 8192 : 1024;
  if (c.v == 0) c.v = cuda ? (linear ? 128256 : 131072) : 32000;
  if (c.h == 0) c.h = linear ? (cuda ? 4096 : 256) : 0;
  if (!linear) c.h = 0;
  config.cases = {c};
}

}  // namespace xent::bench
