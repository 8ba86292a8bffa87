// The docs/performance.md rows as bench cases (bf16, forward + backward unless said).
#include "bench/config.hpp"

namespace xent::bench {

namespace {

Case make(Op op, int64_t n, int64_t h, int64_t v, const char* label, Mode mode = Mode::fwdbwd,
          DistillKind kind = DistillKind::forward_kl) {
  Case c;
  c.op = op;
  c.mode = mode;
  c.dtype = DType::bf16;
  c.n = n;
  c.h = h;
  c.v = v;
  c.kind = kind;
  c.label = label;
  return c;
}

// docs/performance.md's every-option row: label smoothing, z-loss and softcap together, the options
// compare_torch.py's row passes too, so the kernel and the Python figures of a row compare
// (`--options all` adds logit scale, class and row weights).
OptionSet every_option() {
  OptionSet o;
  o.smoothing = o.z_loss = o.softcap = true;
  return o;
}

void add_ce(std::vector<Case>& cases) {
  for (const int64_t v : {32768, 131072, 262144}) {
    cases.push_back(make(Op::ce, 16384, 0, v, "perf-ce"));
    cases.push_back(make(Op::ce, 16384, 0, v, "perf-ce no grad", Mode::fwd));
    Case every = make(Op::ce, 16384, 0, v, "perf-ce every option");
    every.options = every_option();
    cases.push_back(every);
  }
  // Shapes where a row-per-block kernel has too little (small V) or too few rows (small N) to
  // fill the GPU: they show whether the kernel adapts.
  cases.push_back(make(Op::ce, 262144, 0, 4096, "perf-ce small V"));
  cases.push_back(make(Op::ce, 262144, 0, 4096, "perf-ce small V no grad", Mode::fwd));
  Case small_every = make(Op::ce, 262144, 0, 4096, "perf-ce small V every option");
  small_every.options = every_option();
  cases.push_back(small_every);
  // The seed benchmark's vocabularies (docs/performance.md "ce, small V"), where a row is too short to
  // keep a CTA busy (docs/archive/perf-notes.md decision 30: the short-row kernel tried for them).
  for (const int64_t v : {1024, 4096, 8192}) {
    cases.push_back(make(Op::ce, 16384, 0, v, "perf-ce small V"));
  }
  cases.push_back(make(Op::ce, 256, 0, 262144, "perf-ce small N"));
  cases.push_back(make(Op::ce, 128, 0, 131072, "perf-ce small N"));
}

void add_distill(std::vector<Case>& cases) {
  for (const DistillKind kind : {DistillKind::forward_kl, DistillKind::reverse_kl, DistillKind::jsd,
                                 DistillKind::soft_ce, DistillKind::tvd}) {
    cases.push_back(make(Op::distill, 4096, 0, 32768, "perf-distill", Mode::fwdbwd, kind));
    cases.push_back(make(Op::distill, 16384, 0, 131072, "perf-distill", Mode::fwdbwd, kind));
  }
}

void add_linear(std::vector<Case>& cases) {
  cases.push_back(make(Op::linear_ce, 8192, 4096, 128256, "perf-linear"));
  cases.push_back(make(Op::linear_ce, 8192, 2304, 256000, "perf-linear"));
  cases.push_back(make(Op::linear_ce, 32768, 768, 128256, "perf-linear"));
  // The same shape under a smaller budget: the budget must be honoured at a modest time cost.
  Case small_budget = make(Op::linear_ce, 8192, 4096, 128256, "perf-linear budget 128 MiB");
  small_budget.budget_bytes = std::size_t{128} << 20;
  cases.push_back(small_budget);
  // docs/performance.md: mean with z-loss, smoothing and softcap on, at the first shape.
  Case with_options =
      make(Op::linear_ce, 8192, 4096, 128256, "perf-linear z-loss smoothing softcap");
  with_options.options.z_loss = with_options.options.smoothing = with_options.options.softcap =
      true;
  cases.push_back(with_options);
}

}  // namespace

std::vector<Case> suite_cases(const std::string& name) {
  std::vector<Case> cases;
  if (name == "perf-ce" || name == "perf") add_ce(cases);
  if (name == "perf-distill" || name == "perf") add_distill(cases);
  if (name == "perf-linear" || name == "perf") add_linear(cases);
  return cases;
}

}  // namespace xent::bench
