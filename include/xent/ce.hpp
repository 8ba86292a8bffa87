// Cross-entropy on logits (docs/semantics.md §1).
#pragma once

#include <optional>

#include "xent/types.hpp"

namespace xent {

struct CeOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
  double label_smoothing = 0.0;   // ε in [0, 1]
  double z_loss = 0.0;            // λ >= 0, weight of λ·lse²
  std::optional<double> softcap;  // s > 0: x̃ = s·tanh(x/s)
  double logit_scale = 1.0;       // a > 0, applied before anything else
  TensorView class_weight;        // optional [V] fp32, non-negative
  TensorView row_weight;          // optional [N] fp32
};

// Optional per-row and scalar statistics; an absent view is not computed. Floating results here
// and in every op's outputs (loss, grad_output, a saved lse) are fp32, or fp64 for fp64 inputs
// (the compute type: fp64 math stays fp64); validation rejects any other dtype.
struct CeStats {
  TensorView lse;           // [N], 0 for ignored rows
  TensorView logprob;       // [N], x̃_y − lse, 0 for ignored rows
  TensorView entropy;       // [N], 0 for ignored rows
  TensorView argmax;        // [N] int64, −1 for ignored rows
  TensorView accuracy;      // scalar
  TensorView z_loss_value;  // the z-loss part alone, shaped and reduced like the loss
};

struct CeOutputs {
  TensorView loss;  // required: scalar (sum, mean) or [N] (none); fp32 (fp64 inputs: fp64)
  CeStats stats;
  TensorView grad_logits;  // optional: ∂loss/∂logits written in the same pass (may alias logits)
};

// Bytes of workspace the op needs for these sizes on that device (0 on the CPU).
std::size_t ce_workspace_size(int64_t rows, int64_t vocab, const CeOptions& options, Device device);

// logits [N, V] (fp32, bf16, fp16; fp64 on the CPU), target [N] (int64 or int32).
// When out.grad_logits is present the gradient is formed in the same pass, scaled by grad_output
// (shaped and typed like the loss; absent means 1).
void ce_forward(TensorView logits, TensorView target, const CeOptions& options,
                const CeOutputs& out, TensorView grad_output = {}, Workspace workspace = {},
                Stream stream = {});

// The gradient from the logits and the upstream gradient (scalar for sum/mean, [N] for none).
// lse [N] from the forward skips recomputing the row statistics; it may be absent.
void ce_backward(TensorView logits, TensorView target, TensorView lse, TensorView grad_output,
                 const CeOptions& options, TensorView grad_logits, Workspace workspace = {},
                 Stream stream = {});

// The entropy statistic as a differentiable output (semantics §1, differentiable log-probability
// and entropy), for a backward of reduction none: the backward adds Σ_n g_H,n·∂H_n/∂logits to the
// loss gradient, in the same pass over the logits. Requires the forward's lse. Ignored rows get
// no gradient from it.
struct EntropyGradient {
  TensorView entropy;  // [N] fp32: stats.entropy of the forward (with lse it gives Σ p·x̃)
  TensorView grad;     // [N] fp32: g_H, the upstream gradient of the entropy
  bool present() const { return grad.present(); }
};

// ce_backward with the entropy term; an absent `entropy` is the plain ce_backward.
void ce_backward(TensorView logits, TensorView target, TensorView lse, TensorView grad_output,
                 const EntropyGradient& entropy, const CeOptions& options, TensorView grad_logits,
                 Workspace workspace = {}, Stream stream = {});

}  // namespace xent
