// linear_ce's chunk gradient against a per-row reference (docs/archive/perf-notes.md, decisions 84–85):
// schedules (a) and (b) without the ce row kernel. Per row chunk:
//   1. r_n = x̃ of row n's target, one dot product per row (reference_records: the gradient
//      records of the fused product with r_n in place of the lse and coefficients (1, 0, 0));
//   2. the fused gradient product (fused_grad.cuh, its reference form) writes
//      E = e^(x̃ − r)·slope in 16 bits over the chunk buffer, and per row and 256-column tile
//      Σ e^(x̃ − r), and the target's logit: the logits are never written, and x̃ is formed
//      from x rounded to f16 (11 significant bits; bf16's 8 were most of the gradients' error
//      against float64, decision 114), r likewise;
//   3. the finish: lse = r + ln Σ, the row's loss and statistics, and its gradient as
//      s_n·E'_n, s_n = prob_coef·e^(r − lse), E' being E with the target column set to
//      g_y / s_n (the §1 target term kept exact as the row kernel keeps it);
//   4. ∂h = s ⊙ (E'·W) (cuBLASLt into fp32 scratch, scaled once into ∂h) and
//      ∂W += E'ᵀ·(s ⊙ h) (h scaled per row into a 16-bit copy; cuBLASLt as in every schedule).
// A row whose Σ is not below kMaxReferenceSum (a loss above ≈ 60 nats, where E could overflow
// 16 bits or the products' fp32 sums) or below kMinReferenceSum (a logit past f16's range), or
// whose target lies outside [0, V), is formed again in full by two fallback kernels on the CUDA
// cores (its logits, its statistics, its exact gradient with s_n = 1): slow, and only for such
// rows; nothing synchronises with the host.
//
// Label smoothing without a softcap: its uniform term of the gradient, −k_n·w_i with
// k_n = c_n·(ε/V)·a (a the logit scale, w ≡ 1 unweighted), is not a factor of E but it is rank 1.
// So E' and s_n carry every other term, and
//   ∂h_n = s_n·(E'·W)_n − k_n·w̄,  w̄ = Σ_i w_i·W_i (fp32, once per call; weighted_row_sum.cuh),
//   ∂W_i += Σ_n E'_ni·s_n·h_n − w_i·U,  U = Σ_n k_n·h_n over the chunk's rows,
// the last term as kUniformRows more rows of the chunk's ∂W product: E rows (w_hi, w_hi, w_lo)
// beside B rows (−U_hi, −U_lo, −U_hi), hi/lo the 16-bit value and its 16-bit remainder, so the
// term keeps ≈ 16 significant bits and costs no pass over ∂W. The loss's Σ_i w_i·x̃_i is
// a·(h_n·w̄). With a softcap the term carries each element's slope: not rank 1, not taken.
//
// Statistics: lse and logprob from the finish; entropy, argmax and accuracy from the product's
// statistics form, which also writes per row and tile Σ e^(x̃ − r)·(x̃ − r) and the largest x̃
// with its column (H = ln Σ − Σ e^(x̃ − r)·(x̃ − r) / Σ, RowStats's shifted form with r for the
// max).
//
// Options: every one of docs/semantics.md §1 (label smoothing without a softcap); operands as the fused
// products take them
// (fused_operands_eligible) but without a bias (its ∂bias = Σ_n s_n·E'_n would be one more pass
// over E'); the row-chunk schedules with one chunk buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/rows/ce_rows.cuh"
#include "cuda/core/gemm.hpp"
#include "cuda/linear/linear_block_grad.cuh"
#include "cuda/plan/linear_ce_plan.hpp"
#include "cuda/linear/linear_support.hpp"

namespace xent::cuda {

// Σ e^(x̃ − r) of a row at or above which the row takes the fallback: e^60 keeps every E ≤ e^60,
// the ∂h product's fp32 sums far from overflow, and s_n ≥ prob_coef·e^-60, where s_n·h stays a
// normal 16-bit number for any |h| ≥ 1e-6 at prob_coef ≥ 1e-6.
constexpr float kMaxReferenceSum = 1.1420073898156842e26f;  // e^60
// Σ below which a row takes the fallback too: its target's own term e^(x̃_y − r) ≈ 1 is missing
// (a logit past f16's range, in which the product stages x: decision 114).
constexpr float kMinReferenceSum = 8.7565107626965203e-27f;  // e^-60

// Columns of the fallback's slices of a row (each a work item of its kernels), and the floats
// each keeps: max, Σ e^(x̃ − max), Σ e^(x̃ − max)·(x̃ − max), argmax (RowStats).
constexpr int kReferenceFallbackSplit = 16;
constexpr int kSliceFields = 4;

// Rows that extend a chunk's ∂W product by label smoothing's uniform term (three used; eight
// keep K on the products' 8-row grid of 16-byte loads).
constexpr int64_t kUniformRows = 8;

// Whether a call with these options may take the reference path (not the operands, the plan or
// the test hook, whose reference_path = off turns the path off and = on takes the statistics
// form at every H).
bool reference_options_eligible(const CeOptions& options);
// Whether the call asks for entropy, argmax or accuracy (the product's statistics form).
bool reference_statistics_wanted(const CeStats* stats);
// Whether such a call with hidden size H takes the statistics form (kReferenceStatisticsMinHidden,
// linear_ce_plan.hpp).
bool reference_statistics_preferred(int64_t hidden);
bool reference_path_enabled();

// Bytes per chunk row of the path's scratch, beside the chunk's 16-bit exponentials in the
// chunk buffer: per row the larger of the tile sums (four per tile with the statistics), the
// 16-bit scaled h row, the fallback's slice statistics and, when it is kept there, the fp32 ∂h
// product row (else it lies in the ∂W output, which holds nothing yet when a 16-bit ∂W is
// written once or summed in the workspace), and 256 bytes that keep the scratch 256-byte
// aligned.
std::size_t reference_chunk_row_bytes(int64_t vocab, int64_t hidden, bool hidden_product_in_scratch,
                                      bool statistics);
// Bytes of the per-row arrays for all rows (scales, target logits, the fallback's row list) and,
// with label smoothing, its per-row and H-long arrays (k_n, Σ w·x̃, w̄, U, their partials).
std::size_t reference_fixed_bytes(int64_t rows, int64_t hidden, bool smoothing);
// Bytes of the chunk buffer beyond its rows with label smoothing (kUniformRows rows of V after the
// chunk's E rows and of H after its scaled h rows, with their alignment), else 0.
std::size_t reference_buffer_extra_bytes(int64_t vocab, int64_t hidden, bool smoothing);
// Where the path's scratch starts in a chunk buffer of `chunk_rows` rows of V elements.
std::size_t reference_scratch_offset(int64_t chunk_rows, int64_t vocab, std::size_t element,
                                     bool smoothing);

struct ReferenceChunk {
  // The chunk as the ce row kernel would take it: logits is the chunk buffer (row stride V), which
  // receives E; target, row weights, upstream gradients, options, totals and the per-row outputs
  // (row_loss, row_z_loss, row_total, lse, logprob) as there. grad and grad_scale as there too
  // (grad is only checked to be the buffer).
  // With label smoothing the buffer holds kUniformRows rows of V after the chunk's rows.
  CeRowsArgs rows;
  GemmMatrix hidden_rows;           // h of the chunk's rows
  GemmMatrix weight;                // W [V, H]
  CeGradRecord* records = nullptr;  // [rows] of the chunk
  void* scratch = nullptr;          // rows × (reference_chunk_row_bytes − 256), 256-aligned
  float* hidden_product = nullptr;  // [rows, H] fp32: the scratch, or the ∂W output's memory
  float* scale = nullptr;           // [rows] of the chunk
  float* target_logits = nullptr;   // [rows] of the chunk
  int32_t* fallback = nullptr;      // [rows + 1]: a count, then chunk rows
  // Label smoothing (null without it): k_n and Σ_i w_i·x̃_i of the chunk's rows (k_n = 0 for the
  // fallback's rows, whose exact gradient has the term), w̄ (formed by the first chunk), U, and
  // weighted_row_sum's partials.
  float* uniform = nullptr;
  float* smoothing_sums = nullptr;
  float* weight_sum = nullptr;
  float* hidden_sum = nullptr;
  float* sum_partials = nullptr;
  // The gradients: ∂h rows [first_row, first_row + rows) of grads.hidden, ∂W into sums.weight
  // (accumulate_chunk_gradients' rules).
  const LinearGradients* grads = nullptr;
  const GradientSums* sums = nullptr;
  int64_t first_row = 0;
  bool first_chunk = true;
  GemmScratch gemm_scratch;
};

// The chunk's loss parts, statistics and gradients (steps 1–4). False when the fused product
// declines these operands: only the chunk's records were written, and the caller forms the chunk
// the other way.
bool reference_chunk(const ReferenceChunk& chunk, cudaStream_t stream);

}  // namespace xent::cuda
