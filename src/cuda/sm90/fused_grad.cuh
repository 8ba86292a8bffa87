// The fused gradient product of linear_ce on Hopper, where the lse is known:
// x = h·W_blockᵀ on tensor cores for a tile of rows and a block of vocabulary columns, whose
// epilogue turns each fp32 accumulator into the §1 gradient ∂loss/∂x from the row's saved lse
// (linear_block_grad.cuh's ce_block_row and ce_block_grad, the formula of the elementwise block
// kernel) and stores only that, in the operands' dtype. It replaces, in pass 2 of the blocked
// schedules (chunk_plan.hpp (c) and (d)), the cuBLASLt product that wrote the block's logits and
// the elementwise pass that read them and wrote the gradient over them: of the three transfers of
// the block (logits written, read, gradient written) one remains.
//
//   fused_grad_product.cu  the CUTLASS sm_90a mainloop of fused_product.cuh in the kernel of
//                          fused_epilogue_kernel.cuh (the gradient formed on warps of their own
//                          beside the next tile's mainloop, decision 56); a stub elsewhere
//                          (fused_grad_product_built() false).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/linear/linear_block_grad.cuh"

namespace xent::cuda {

struct FusedGradProduct {
  // The tile's rows of h, [rows, hidden_size], row stride in elements.
  const void* hidden = nullptr;
  int64_t hidden_stride = 0;
  // The block's rows of W, [columns, hidden_size].
  const void* weight = nullptr;
  int64_t weight_stride = 0;
  DType dtype = DType::bf16;  // of both operands and of the gradient written
  int64_t rows = 0, columns = 0, hidden_size = 0;
  int64_t first_column = 0;  // the block's first column of V
  // The tile's rows of the call's gradient records (ce_grad_records, made with first_column 0).
  const CeGradRecord* records = nullptr;
  bool entropy = false;  // the records carry the entropy term (EntropyGradient)
  // [V] class weights, where the label-smoothing term carries them (−(ε/V)·c·w_i per column);
  // null otherwise (without smoothing a row's class weight w_y is in its record). Not with the
  // reference form.
  const float* class_weight = nullptr;
  // [V] bias in `dtype`, added to x before its one rounding (fused_product.cuh), or null. Not
  // with the reference form.
  const void* bias = nullptr;
  float logit_scale = 1, softcap = 0;  // docs/semantics.md §1 transform (softcap 0: none)
  void* grad = nullptr;                // [rows, columns], row stride grad_stride, in `dtype`
  int64_t grad_stride = 0;
  // x rounded to the operands' dtype before the gradient, as the cuBLASLt path's 16-bit logits
  // are (the lse in the records was formed from such logits); false for fp32 chunk logits, which
  // the product declines (its staged tile is 16-bit).
  bool rounded_logits = true;
  // The reference form (linear_reference.cuh): each valid row's record holds a reference r in
  // place of its lse, with coefficients (1, 0, 0), so the product writes e^(x̃ − r)·slope. With
  // `partials` it also writes, per row and per 256-column tile of the block, the tile's
  // Σ e^(x̃ − r) (before the slope) at partials[row · partial_stride + tile] (0 for ignored rows),
  // and the raw logit of each row's target at target_logits[row] (by the tile that holds it).
  // This form forms x̃ from x rounded to f16 whatever `dtype` (decision 114), so r must be rounded
  // so too. Not with `entropy`.
  float* partials = nullptr;
  int64_t partial_stride = 0;
  float* target_logits = nullptr;
  // The reference form with the row statistics (entropy, argmax): three more arrays shaped as
  // `partials`, one after the other from here (rows · partial_stride elements each): per row and
  // tile Σ e^(x̃ − r)·(x̃ − r), the largest x̃ and its column of V (int32; the first NaN, else the
  // first of the largest, as RowStats), or null.
  float* statistic_partials = nullptr;
};

// Whether this build holds the sm_90a kernel.
bool fused_grad_product_built();

// Launches the product on `stream`. False (nothing launched) when the kernel cannot take these
// operands or is not built: the caller falls back to the cuBLASLt product and the block kernel.
bool fused_grad_product(const FusedGradProduct& product, cudaStream_t stream);

// Whether a call with hidden size H forms its gradients with the fused product where eligible:
// up to H = 4096 it was faster than the cuBLASLt product and the elementwise kernel, or level;
// above, not measured (docs/archive/perf-notes.md, decisions 46 and 56). The test hook forces it
// on for every H, or off.
constexpr int64_t kFusedGradMaxHidden = 4096;
bool fused_grad_preferred(int64_t hidden_size);

// How many of the 16 rows each consumer warp stages it forms itself on a CTA's tiles but its
// last (0, 4 or 8; the epilogue warps form the others, fused_epilogue_kernel.cuh). 0 at every H:
// with the epilogue warps at the launch's full register count they keep up alone
// (docs/archive/perf-notes.md, decision 92). The test hook forces 0, 4 or 8.
int fused_grad_own_rows();

}  // namespace xent::cuda
