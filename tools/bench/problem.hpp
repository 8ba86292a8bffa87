// The tensors of one measured case and the xent options they imply. A Problem owns its device
// buffers; its views are what both xent and the naive form read and write.
#pragma once

#include <vector>

#include "bench/config.hpp"
#include "bench/device.hpp"

namespace xent::bench {

// Fixed values of the switchable options (documented in --help and bench/README.md).
inline constexpr double kSmoothing = 0.1;
inline constexpr double kZLoss = 1e-4;
inline constexpr double kSoftcap = 30.0;
inline constexpr double kLogitScale = 0.5;

// Inputs of any op; views an op does not use stay absent.
struct Inputs {
  TensorView logits;          // ce: logits; distill: student logits
  TensorView teacher;         // distill: teacher logits
  TensorView hidden;          // linear ops: (student) hidden
  TensorView weight;          // linear ops: (student) weight
  TensorView teacher_hidden;  // linear_distill
  TensorView teacher_weight;  // linear_distill
  TensorView target;          // int64 [N]
  TensorView class_weight;    // fp32 [V] when the option is on
  TensorView row_weight;      // fp32 [N] when the option is on
  TensorView grad_output;     // fp32 [N] for reduction none (fwdbwd), else absent
};

// Outputs of any op; the gradients are the "input gradients" (not counted as extra memory).
struct Outputs {
  TensorView loss;         // fp32 scalar or [N]
  TensorView lse;          // fp32 [N]: what the backward of reduction none needs
  TensorView grad_logits;  // ce, distill
  TensorView grad_hidden;  // linear ops
  TensorView grad_weight;  // linear ops
};

class Problem {
 public:
  // Allocates `copies` sets of random inputs (rotated through when they fit in cache), one set
  // of gradient outputs; fwd mode allocates no gradients.
  Problem(BenchDevice& device, const Case& c, int copies);

  const Case& spec() const { return case_; }
  int copies() const { return static_cast<int>(inputs_.size()); }
  const Inputs& inputs(int copy) const { return inputs_[static_cast<std::size_t>(copy)]; }
  const Outputs& gradients() const { return gradients_; }
  std::size_t input_bytes() const { return input_bytes_; }  // one copy
  // The same without allocating anything: decides how many copies to make.
  static std::size_t input_bytes(const Case& c);

  // Loss and lse views on fresh buffers (owned by the Problem), for one implementation.
  Outputs make_outputs(const Outputs& gradients);

  CeOptions ce_options(const Inputs& in) const;
  DistillOptions distill_options(const Inputs& in) const;

 private:
  TensorView add_matrix(DType dtype, int64_t rows, int64_t cols, float low, float high);
  TensorView add_vector(DType dtype, int64_t length, float low, float high);

  BenchDevice& device_;
  Case case_;
  std::vector<Buffer> buffers_;
  std::vector<Inputs> inputs_;
  Outputs gradients_;
  std::size_t input_bytes_ = 0;
  uint64_t seed_ = 1;
};

bool is_linear(Op op);
bool is_distill(Op op);
bool has_hidden_grad(const Case& c);
std::size_t elements_bytes(int64_t count, DType dtype);

}  // namespace xent::bench
