// The cross-entropy gradient of one vocabulary block of logits, elementwise from a saved lse: the
// second pass of the vocabulary-blocked linear_ce schedule (chunk_plan.hpp, schedule (c)). The same
// per-row coefficients and element formula as the ce row kernel (common::ce_grad_row,
// common::ce_grad_from_prob), so both passes form one gradient.
#pragma once

#include "cuda/linear/block_grad_tile.cuh"
#include "cuda/rows/ce_device.cuh"
#include "cuda/rows/ce_rows.cuh"

namespace xent::cuda {

// The tile's gradient and geometry (BlockGradTile; grad may alias logits), and what it is
// formed of.
struct BlockGradArgs : BlockGradTile {
  const void* logits = nullptr;  // tile: [rows, columns] with logits_stride (row 0 = first row)
  int64_t logits_stride = 0;
  const void* target = nullptr;  // tile rows
  DType target_dtype = DType::i64;
  const float* lse = nullptr;               // tile rows, from the first pass
  const float* row_weight = nullptr;        // tile rows or null
  const float* grad_output_rows = nullptr;  // tile rows (reduction none) or null
  // Tile rows of the entropy term (ce.hpp EntropyGradient), or null: the forward's H and g_H.
  const float* entropy = nullptr;
  const float* grad_entropy = nullptr;
  CeRowOptions options;
  const CeBatchTotals* totals = nullptr;
};

void block_grad_from_lse(const BlockGradArgs& args, cudaStream_t stream);

// The per-row part of a block's gradient, formed once per row (segment) by block_grad_kernel and
// by the fused gradient product's epilogue (fused_grad.cuh), so both form one gradient.
struct CeBlockRow {
  bool valid = false;     // the target is not ignore_index
  bool in_range = false;  // ... and lies in [0, V): else the row is NaN (docs/semantics.md §1)
  common::CeGradRow<float> grad{};
  common::EntropyGradRow<float> entropy{};
  int64_t target_column = 0;  // target − first_column: the block column of y (may lie outside)
};

// Row `row` of the tile (0 = the tile's first row). Reads the entropy rows only with kEntropy.
template <bool kEntropy>
__device__ __forceinline__ CeBlockRow ce_block_row(const BlockGradArgs& a, int64_t row,
                                                   const common::CeConstants<float>& c) {
  CeBlockRow r;
  const int64_t target = read_target(a.target, a.target_dtype, row);
  r.valid = target != a.options.ignore_index;
  r.in_range = target >= 0 && target < a.vocab;
  if (!r.valid || !r.in_range) return r;
  const float upstream = a.grad_output_rows ? a.grad_output_rows[row] : a.totals->upstream;
  const float base = upstream * (a.row_weight ? a.row_weight[row] : 1.0f);
  const float target_weight = a.options.class_weight ? a.options.class_weight[target] : 1.0f;
  r.grad = common::ce_grad_row(c, a.lse[row], target, target_weight, base * a.totals->loss_factor,
                               base * a.totals->z_factor);
  if constexpr (kEntropy) {
    r.entropy = common::entropy_grad_row(a.grad_entropy[row], a.lse[row], a.entropy[row]);
  }
  r.target_column = target - a.first_column;
  return r;
}

// A row's CeBlockRow as 32 bytes, formed once per call for every row (ce_grad_records) and read
// with two 16-byte loads by the fused gradient product's epilogue: per-row loads there (target,
// lse, row weight, upstream, batch totals: two dependent rounds per row) are latency no
// mainloop hides. coefs: lse, prob_coef, target_coef, smoothing_coef; more: the target (int32
// bits), the state (0 ordinary, 1 ignored, 2 out-of-range target), g_H and S of the entropy term.
struct CeGradRecord {
  float4 coefs;
  float4 more;
};

__device__ __forceinline__ CeGradRecord grad_record_of(const CeBlockRow& r) {
  CeGradRecord record;
  record.coefs =
      make_float4(r.grad.lse, r.grad.prob_coef, r.grad.target_coef, r.grad.smoothing_coef);
  const float state = !r.valid ? 1.0f : !r.in_range ? 2.0f : 0.0f;
  record.more = make_float4(__int_as_float(static_cast<int32_t>(r.target_column)), state,
                            r.entropy.coef, r.entropy.mean_logit);
  return record;
}

// The row of a record made with first_column 0, for a block starting at `first_column`.
__device__ __forceinline__ CeBlockRow block_row_of(const CeGradRecord& record,
                                                   int64_t first_column) {
  CeBlockRow r;
  r.valid = record.more.y != 1.0f;
  r.in_range = record.more.y == 0.0f;
  const int64_t target = __float_as_int(record.more.x);
  r.grad.lse = record.coefs.x;
  r.grad.prob_coef = record.coefs.y;
  r.grad.target_coef = record.coefs.z;
  r.grad.smoothing_coef = record.coefs.w;
  r.grad.target = target;
  r.entropy.coef = record.more.z;
  r.entropy.mean_logit = record.more.w;
  r.target_column = target - first_column;
  return r;
}

// records[n] for the args.rows rows of args (its first_column must be 0): ce_block_row of each.
void ce_grad_records(const BlockGradArgs& args, CeGradRecord* records, cudaStream_t stream);

// ∂loss/∂x of one logit `value` of a valid, in-range row, through `transform` (with_transform),
// with class weight w of its column (1 without class weights or smoothing).
template <bool kEntropy, class Transform>
__device__ __forceinline__ float ce_block_grad(const CeBlockRow& r, const Transform& transform,
                                               float value, bool is_target, float w) {
  const float transformed = transform.value(value);
  // p = 2^(x̃·log2 e − lse·log2 e): one FFMA and the ex2 per value, the lse term formed once per
  // row where the caller's loop unrolls (as the ce row kernel forms it).
  const float prob = fast_exp2(fmaf(transformed, kLog2e, -r.grad.lse * kLog2e));
  if constexpr (kEntropy) {
    return common::ce_entropy_grad_from_prob(r.grad, r.entropy, prob, transformed,
                                             transform.slope(value), is_target, w);
  } else {
    return common::ce_grad_from_prob(r.grad, prob, transform.slope(value), is_target, w);
  }
}

}  // namespace xent::cuda
