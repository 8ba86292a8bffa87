// Fused linear cross-entropy (docs/semantics.md §2): the loss of x = h·Wᵀ (+ bias) without holding N×V logits.
#pragma once

#include "xent/ce.hpp"

namespace xent {

// How a 16-bit ∂W is summed over row chunks (docs/semantics.md §2, "Accumulation in the weight's
// dtype"). fp32: in an fp32 accumulator, rounded once at the end (on CUDA a V×H fp32 buffer in
// the workspace, or a slower schedule where the budget cannot hold it). weight_dtype: each chunk's
// product is added straight into the 16-bit ∂W output (fp32 math inside the product, one rounding
// per chunk): no accumulator, at an error that grows with the number of chunks. Opt-in only. No
// effect on an fp32 or fp64 ∂W (accumulate_weight's buffer included), which is summed in place.
enum class WeightGradAccumulation { fp32, weight_dtype };

struct LinearCeOptions {
  CeOptions ce;  // every option of §1
  // Bytes of extra memory the op may use. On CUDA it bounds everything beyond the inputs and
  // outputs: chunk buffers and the fp32 accumulators of 16-bit weight/bias gradients (a budget
  // too small for those accumulators selects a slower schedule that needs only small ones). On
  // the CPU it bounds the chunk buffers; fp32 copies of a 16-bit weight and the accumulators of
  // its gradients come on top (nothing comes on top for fp32 and fp64 layers).
  std::size_t workspace_budget = std::size_t{512} << 20;
  bool fp32_logits = false;  // keep chunk logits in fp32 instead of rounding to the input dtype
  WeightGradAccumulation weight_grad_accumulation = WeightGradAccumulation::fp32;
  // Optional [R, V] buffer (R ≤ N) in the chunk-logits dtype (fp32 with fp32_logits, else the
  // input dtype), owned by the caller: the logits of rows [0, R). A forward that forms no gradient
  // fills it with the logits it computes for those rows; a backward given it reads their logits
  // from it instead of recomputing h·Wᵀ and recomputes the other rows' as without a cache. It
  // trades R×V memory for R/N of one product in `none` training, so it is off unless the caller
  // opts in; R < N keeps part of the saving within a memory budget.
  TensorView logits_cache;
  // Each row's forward values (loss, lse, logprob, entropy) are bit-identical whatever the number
  // of rows in the call, the row's position and the workspace budget: the logits product runs in
  // an order fixed per (V, H, dtype) (docs/semantics.md §1). Gradients are not covered.
  bool batch_invariant = false;
};

// Gradients of the linear layer; each absent view is not computed. grad weight/bias are
// accumulated in fp32 across chunks and written once in their own dtype (fp32 keeps them exact).
// On CUDA a `weight` that is written over (not accumulate_weight), contiguous and 16-byte aligned
// may serve as scratch before its rows are written (small budgets keep fp32 sums of ∂h in its
// last rows), and so may a contiguous, aligned 16-bit `hidden` before the end of the call (the
// sums of its first rows), so neither may alias any input; their contents are only the
// gradients once the call completes. The same holds for linear_distill.
struct LinearGradients {
  TensorView hidden;  // [N, H]
  TensorView weight;  // [V, H]
  TensorView bias;    // [V]
  // ∂W is ADDED into `weight` instead of written over it: a caller's fp32 gradient buffer kept
  // across micro-batches (Megatron's main_grad), so no separate gradient and no add pass are
  // needed. `weight` must then be float32 [V, H] whatever the layer dtype (float64 for float64
  // layers on the CPU, whose math is float64), on the op's device; it is never zero-filled or
  // overwritten (an empty batch adds nothing), and the products accumulate into it in place,
  // with no fp32 accumulator in the workspace. Linear distillation takes it too.
  bool accumulate_weight = false;
};

struct LinearCeOutputs {
  TensorView loss;  // required: scalar (sum, mean) or [N] (none); fp32 (fp64 inputs: fp64)
  CeStats stats;
  LinearGradients grads;  // optional: gradients formed during the forward
};

// Bytes of workspace for these sizes: what the planner chooses within options.workspace_budget
// (on the CPU plus the fp32 copies and accumulators that a 16-bit layer needs, see above).
std::size_t linear_ce_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                     const LinearCeOptions& options, Device device,
                                     bool with_gradients);

// hidden [N, H], weight [V, H], bias [V] or absent, target [N]. On the CPU an empty workspace
// makes the op allocate what it needs itself.
void linear_ce_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                       const LinearCeOptions& options, const LinearCeOutputs& out,
                       TensorView grad_output = {}, Workspace workspace = {}, Stream stream = {});

// Recomputes the chunk logits and folds the per-row upstream gradient in before the products.
void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView lse, TensorView grad_output, const LinearCeOptions& options,
                        const LinearGradients& grads, Workspace workspace = {}, Stream stream = {});

// linear_ce_backward with the entropy term of ce.hpp's EntropyGradient (reduction none, lse of
// the forward required): G = ∂loss/∂x + Σ_n g_H,n·∂H_n/∂x is formed in one pass per chunk.
void linear_ce_backward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                        TensorView lse, TensorView grad_output, const EntropyGradient& entropy,
                        const LinearCeOptions& options, const LinearGradients& grads,
                        Workspace workspace = {}, Stream stream = {});

}  // namespace xent
