// The elementwise ce gradient from a saved lse (backward of reduction none, or any reduction when
// the forward kept lse): logits read once, gradient written once.
#pragma once

#include "cuda/rows/ce_rows.cuh"

namespace xent::cuda {

// The entropy term of a backward (ce.hpp EntropyGradient) on the device, [rows] fp32 each
// (chunk pointers); both null for the plain gradient.
struct EntropyRows {
  const float* entropy = nullptr;  // H of the forward
  const float* grad = nullptr;     // g_H
  bool present() const { return grad != nullptr; }
};

// A vocabulary slice (ce_shard.cu): args.vocab columns starting at global column `offset` of a
// vocabulary of `vocab`; targets are global ids, w_y of each row comes merged from every rank
// (totals->class_weight_sum holds the global W).
struct CeGradShard {
  int64_t offset = 0;
  int64_t vocab = 0;
  const float* target_weight = nullptr;  // [rows]
};

// Uses args.logits/target/row_weight/options/totals/grad_output_rows/grad/grad_scale; `lse` is
// [rows] fp32 on the device (entries of ignored rows are not read). A present `entropy` adds
// its term in the same pass (a separate kernel instance, so the plain one keeps its speed).
void ce_grad_from_lse(const CeRowsArgs& args, const float* lse, const EntropyRows& entropy,
                      cudaStream_t stream, const CeGradShard* shard = nullptr);
inline void ce_grad_from_lse(const CeRowsArgs& args, const float* lse, cudaStream_t stream,
                             const CeGradShard* shard = nullptr) {
  ce_grad_from_lse(args, lse, EntropyRows{}, stream, shard);
}

}  // namespace xent::cuda
