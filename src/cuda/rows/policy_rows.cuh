// The per-token step of the fused linear policy loss on CUDA (docs/semantics.md §7 "Fused with the
// LM head"): between a chunk's statistics sweep (ce_rows) and its gradient sweep
// (ce_grad_from_lse), each row's policy math from common/policy_row.hpp; and, after the last
// chunk, the fixed-order sums of the per-row results into the loss and the statistics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/policy_row.hpp"
#include "xent/types.hpp"

namespace xent::cuda {

// Per-row results, [rows] fp32 each; ignored rows hold zeros.
struct PolicyRowResults {
  float* loss = nullptr;         // g·L
  float* clipped_low = nullptr;  // 0 or 1
  float* clipped_high = nullptr;
  float* kl = nullptr;
  float* ratio = nullptr;
};

// Pointers are chunk pointers (at the chunk's first row) unless said.
struct PolicyRowsArgs {
  int64_t rows = 0;
  const void* target = nullptr;
  DType target_dtype = DType::i64;
  int64_t ignore_index = -100;
  const float* logprob = nullptr;  // from ce_rows
  const float* entropy = nullptr;  // from ce_rows, or null when the step needs no H (read as 0)
  // The token data of PolicyTokens (fp32; null where the options say absent).
  const float* advantages = nullptr;
  const float* old_logprobs = nullptr;
  const float* ref_logprobs = nullptr;
  const float* rollout_logprobs = nullptr;
  const float* weight = nullptr;
  common::PolicyOptions<float> options;
  float* upstream = nullptr;      // −c_ℓ: the coefficient of the ce gradient (ce_grad_from_lse)
  float* grad_entropy = nullptr;  // c_H
  PolicyRowResults results;
};

void policy_rows(const PolicyRowsArgs& args, cudaStream_t stream);

// loss = Σ_n loss_n, stats = [Σ clipped_low, Σ clipped_high, Σ kl, Σ ratio] over all `rows`, in
// one fixed order (double): the same bits for the same inputs.
void policy_reduce(int64_t rows, const PolicyRowResults& results, float* loss, float* stats,
                   cudaStream_t stream);

}  // namespace xent::cuda
