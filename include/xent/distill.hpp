// Distillation losses between student and teacher logits (docs/semantics.md §3).
#pragma once

#include <optional>

#include "xent/ce.hpp"

namespace xent {

enum class DistillKind : int8_t { forward_kl, reverse_kl, jsd, soft_ce, tvd };
const char* distill_kind_name(DistillKind kind);

struct DistillOptions {
  DistillKind kind = DistillKind::forward_kl;
  double temperature = 1.0;       // T > 0 divides student and teacher logits
  double beta = 0.5;              // jsd mixing weight, in [0, 1]
  std::optional<double> softcap;  // applied to both before T
  double soft_weight = 1.0;       // σ: weight of the distillation term
  double hard_weight = 0.0;       // α: weight of CE(student, target) at T = 1 (needs a target)
  // ce.ignore_index and ce.reduction govern the whole op; the other fields of ce configure the
  // hard-label term only.
  CeOptions ce;
};

struct DistillOutputs {
  TensorView loss;          // required: scalar (sum, mean) or [N] (none), result dtype (ce.hpp)
  TensorView grad_student;  // optional: ∂loss/∂student in the same pass (may alias student)
};

std::size_t distill_workspace_size(int64_t rows, int64_t vocab, const DistillOptions& options,
                                   Device device);

// student, teacher [N, V] of one dtype; target [N] or absent (then every row is valid).
void distill_forward(TensorView student, TensorView teacher, TensorView target,
                     const DistillOptions& options, const DistillOutputs& out,
                     TensorView grad_output = {}, Workspace workspace = {}, Stream stream = {});

void distill_backward(TensorView student, TensorView teacher, TensorView target,
                      TensorView grad_output, const DistillOptions& options,
                      TensorView grad_student, Workspace workspace = {}, Stream stream = {});

// A teacher given as its top-k log-probabilities per row (docs/semantics.md §3.1).
enum class TopKMass : int8_t { renormalize, tail, ignore };
const char* topk_mass_name(TopKMass mass);

// The most entries a row of a top-k teacher may have on a CUDA device (shared memory of the
// row kernel); the CPU takes any k.
constexpr int64_t kDistillTopKMaxK = 512;

struct TopKTeacher {
  TensorView ids;       // [N, k] int32 or int64: token ids, −1 for an absent entry
  TensorView logprobs;  // [N, k] float32 or float64: log P_t(id) under the whole teacher
  TopKMass mass = TopKMass::renormalize;  // what becomes of the teacher's mass outside the ids
};

// distill_forward / distill_backward with a top-k teacher; options.softcap and the temperature
// act on the student only (the teacher's log-probabilities are already a distribution), and
// tail / ignore need temperature 1. On a CUDA device: k <= kDistillTopKMaxK, no hard-label term
// yet, and the workspace of distill_workspace_size.
void distill_topk_forward(TensorView student, const TopKTeacher& teacher, TensorView target,
                          const DistillOptions& options, const DistillOutputs& out,
                          TensorView grad_output = {}, Workspace workspace = {},
                          Stream stream = {});

void distill_topk_backward(TensorView student, const TopKTeacher& teacher, TensorView target,
                           TensorView grad_output, const DistillOptions& options,
                           TensorView grad_student, Workspace workspace = {}, Stream stream = {});

}  // namespace xent
