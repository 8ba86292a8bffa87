// Vocabulary-parallel distillation (docs/semantics.md §3 and §5): the pieces a rank runs on its slice
// [offset, offset + cols) of the vocabulary of student and teacher logits, with no communication
// in the core. The caller (python/xent/distributed.py) gathers the per-row records between ranks.
//
// Every kind's loss splits by slices once the global log-sum-exps are known. forward_kl, reverse_kl
// and soft_ce split further, by the chain rule of the divergence over the partition of the
// vocabulary into slices: with q^r, σ^r the teacher and student distributions renormalised on
// slice r and w_r, v_r the teacher and student mass of slice r (e^(lse^r − lse)),
//   KL(p_t‖p_s) = Σ_r w_r·(log w_r − log v_r) + Σ_r w_r·KL(q^r‖σ^r)
//   KL(p_s‖p_t) = Σ_r v_r·(log v_r − log w_r) + Σ_r v_r·KL(σ^r‖q^r)
//   CE(p_t, p_s) = −Σ_r w_r·log v_r + Σ_r w_r·CE(q^r, σ^r),
// so each slice sends its two lse and its local divergence, and the merge needs nothing else: one
// collective. Every term is the slice's own (non-negative for the KLs), never a difference of two
// large sums. jsd (log of the mixture) and tvd (|p_t − p_s|) do not split that way: they need the
// global lse before their per-element terms, hence a second pass and a second small collective.
//
//   1. distill_shard_stats     reads the local student and teacher once: one record per row
//                              (kDistillShardStatsWidth columns, below).
//   2. all_gather              the records of every rank → [P·N, width] (O(N·P) bytes).
//   3. distill_shard_sums      jsd and tvd only: with the merged global lse, one more read of the
//                              local student and teacher → [N, kDistillShardSumsWidth] sums;
//                              then a second all_gather of them.
//   4. distill_shard_loss      merges the records (and sums) into the loss; reads no logits.
//   5. distill_shard_backward  merges again and writes the gradient of the local student slice:
//                              one read of student and teacher, one write. The gradient's row
//                              constants (reverse_kl's KL, jsd's Σ p_s·u, tvd's side sums) come
//                              from the forward's records: no collective in the backward.
#pragma once

#include "xent/distill.hpp"
#include "xent/shard.hpp"

namespace xent {

// Columns of one pass-1 record (fp32 for fp32/bf16/fp16 logits, fp64 for fp64 logits).
enum DistillShardColumn : int64_t {
  kDistillShardLseStudent = 0,  // lse of the slice's transformed student logits (−inf if empty)
  kDistillShardLseTeacher,      // lse of the slice's transformed teacher logits
  kDistillShardDivergence,      // the kind's divergence between the slice-renormalised
                                // distributions (forward_kl, reverse_kl, soft_ce); 0 otherwise
  kDistillShardReserved,        // 0 (keeps the hard-term record 16-byte aligned in fp32)
  kDistillShardHard,            // first column of the hard-label term's ce record
                                // (xent/shard.hpp layout); zeros without a hard term
  kDistillShardStatsWidth = kDistillShardHard + kCeShardStatsWidth
};

// Columns of one pass-2 record (jsd, tvd): sums over the slice with the global lse.
enum DistillShardSumColumn : int64_t {
  kDistillSumLoss = 0,  // Σ of the per-element loss terms
  kDistillSumProbU,     // Σ p_s·u (jsd's gradient)
  kDistillSumAbove,     // tvd: Σ p_s where p_s > p_t
  kDistillSumBelow,     // tvd: Σ p_s where p_s < p_t
  kDistillSumEqual,     // tvd: Σ p_s where p_s = p_t
  kDistillShardSumsWidth
};

// True for the kinds that need pass 2 (distill_shard_sums) and its collective: jsd and tvd.
bool distill_shard_needs_sums(DistillKind kind);

// student, teacher [N, Vl] (the local slice); target [N] global ids or absent; the class weights
// of options.ce are the local slice [Vl]. partial [N, kDistillShardStatsWidth].
void distill_shard_stats(TensorView student, TensorView teacher, TensorView target,
                         VocabShard shard, const DistillOptions& options, TensorView partial,
                         Workspace workspace = {}, Stream stream = {});

// Bytes of workspace the distill_shard entry points need (0 on the CPU).
std::size_t distill_shard_workspace_size(int64_t rows, Device device);

// jsd and tvd: gathered [P·N, kDistillShardStatsWidth] (rank-major, rank p's row n at p·N + n);
// sums [N, kDistillShardSumsWidth].
void distill_shard_sums(TensorView student, TensorView teacher, TensorView target, VocabShard shard,
                        TensorView gathered, const DistillOptions& options, TensorView sums,
                        Workspace workspace = {}, Stream stream = {});

// The loss (scalar for sum/mean, [N] for none) of the N = `rows` rows from the gathered records
// [P·N, kDistillShardStatsWidth], and for jsd and tvd the gathered sums [P·N,
// kDistillShardSumsWidth] (absent for the other kinds). target is [N] or absent. The class
// weights of options.ce are not read (their sums arrive in the records).
void distill_shard_loss(TensorView gathered, TensorView gathered_sums, TensorView target,
                        int64_t rows, VocabShard shard, const DistillOptions& options,
                        TensorView loss, Workspace workspace = {}, Stream stream = {});

// The gradient of the local student slice for the upstream gradient (scalar for sum/mean, [N] for
// none). options.ce.class_weight is the local slice, as in distill_shard_stats.
void distill_shard_backward(TensorView student, TensorView teacher, TensorView target,
                            VocabShard shard, TensorView gathered, TensorView gathered_sums,
                            TensorView grad_output, const DistillOptions& options,
                            TensorView grad_student, Workspace workspace = {}, Stream stream = {});

}  // namespace xent
