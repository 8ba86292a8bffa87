// The distillation harness shared by the distill and linear_distill suites: option sets, inputs,
// and the run of distill_forward / distill_backward against the float64 reference.
#pragma once

#include <string>

#include "ce_check.hpp"

namespace xent::test {

// Options of docs/semantics.md §3 as bits, so suites can enumerate each alone and all pairs.
enum DistillOptionBit : unsigned {
  kTemperature = 1u << 0,     // T = 2
  kDistillSoftcap = 1u << 1,  // softcap on both student and teacher
  kHardAndSoft = 1u << 2,     // α·CE(s, y) + σ·distill, the CE part with smoothing and z-loss
  kNoTarget = 1u << 3,        // target absent: every row valid
};
constexpr unsigned kDistillOptionCount = 4;
std::string distill_options_label(unsigned options);
// None, each alone, and every pair that is valid (hard weight needs a target).
std::vector<unsigned> distill_option_sets_up_to_pairs();

struct DistillSetup {
  DistillOptions options;
  reference::DistillSpec spec;
};
DistillSetup make_distill_setup(DistillKind kind, unsigned options, Reduction reduction,
                                double beta);

// Class and row weights (uniform in [0.5, 1.5]) on the hard-label term of `setup`, in its spec
// and its options; the options point into the returned tensors, which must outlive the runs.
struct HardWeightTensors {
  Tensor class_weight, row_weight;
};
HardWeightTensors add_hard_weights(DistillSetup& setup, Rng& rng, int64_t rows, int64_t vocab);

struct DistillProblem {
  DType dtype = DType::f32;
  int64_t rows = 37;
  int64_t vocab = 1031;
  int64_t row_stride = -1;         // of student and grad_student
  int64_t teacher_row_stride = 0;  // 0: row_stride's; a wider teacher of V' shared columns
  DistillKind kind = DistillKind::forward_kl;
  unsigned options = 0;
  double beta = 0.5;
  Reduction reduction = Reduction::mean;
  bool ignored_rows = true;
  bool all_ignored = false;
  bool nan_row = false;   // one student row holds a NaN
  bool in_place = false;  // grad_student aliases student
  bool unit_grad_output = false;
  double logit_sd = 2.0;
  double teacher_sd = 0.0;    // > 0: a teacher independent of the student, this peaked
  bool hard_weights = false;  // class and row weights on the hard term (with kHardAndSoft)
};

void check_distill(const DistillProblem& problem, Rng& rng);

// tvd has a kink at p_s = p_t, where the side a backend takes depends on rounding: the reference
// with near-ties (within `band`) at the midpoint subgradient, to bound that freedom. Returns the
// reference itself for the other kinds.
reference::DistillResult tvd_ties_at_midpoint(const Matrix& student, const Matrix& teacher,
                                              const std::vector<int64_t>* target,
                                              reference::DistillSpec spec,
                                              const reference::Upstream& upstream, double band);

// Student logits and a teacher correlated with them (as a real teacher is).
Matrix make_teacher(Rng& rng, const Matrix& student, double sd);

}  // namespace xent::test
