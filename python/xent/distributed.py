"""Vocabulary-parallel losses over torch.distributed (docs/semantics.md §5).

For models whose LM head (or logits) is split by vocabulary across the ranks of a process group
(Megatron-style tensor parallelism): every rank holds the logits, or the LM-head rows, of one
contiguous slice [v0, v0 + V_local) of the vocabulary, the same rows (tokens) and the same global
targets. The result on every rank equals the single-device result on the concatenated vocabulary
(to fp32 rounding). Collectives are the framework's own (NCCL on GPUs, gloo on CPUs):

* one ``all_gather`` per forward of the [N, 9] fp32 partial records (max, sum-exp, entropy sum,
  logit sums, argmax, target logit and weight, class-weight sum) of every rank: O(N·P) bytes.
  One gather replaces the usual MAX then SUM all-reduces (plus a third for the argmax): the
  records are merged on each rank by the same code that merges the row kernels' CTAs, so ties,
  NaN rows and the argmax come out exactly as unsharded.
* none in the backward of ce: the gradient of each slice needs only the merged records.
* linear_cross_entropy: ∂hidden is the sum over ranks of each slice's G·W; it is all-reduced
  (SUM) unless ``reduce_hidden_grad=False``, for a caller whose tensor-parallel linear layer
  reduces it itself (then each rank's ∂hidden is its partial sum).

Passes over the local logits: a ce training step reads them twice and writes them once (the
statistics read, the collective, then the gradient's read and write), the floor for a sharded
loss, whose gradient needs the global lse. Sharded linear_cross_entropy runs in row chunks whose
logits fit ``workspace_bytes`` (xent/_sharded_linear.py). By default (reduction "sum"/"mean")
each chunk's logits stay in the workspace from their records to their gradient: one all_gather of
the chunk's records between them, three products per chunk, the gradients formed in the forward
and scaled in the backward (one all_gather in all when the batch is one chunk, as at the default
GPU budget; plus one scalar all_reduce of Σ w_y for "mean" with class weights). Reduction "none",
grad_in_forward=False, and "mean" with class weights and z-loss together run two passes instead:
records of every chunk and one all_gather, then the backward recomputes each chunk's logits (four
products per chunk; three with ``cache_logits=True``, which keeps pass 1's logits: N·V_local
more elements).

The vocabulary offset of each rank is either given (``vocab_offset=`` with ``vocab_size=``) or
derived from an ``all_gather`` of the local sizes in rank order at the first call, cached per
(group, local size).

distill: see ``distill`` below: one all_gather of [N, 13] records for forward_kl, reverse_kl
and soft_ce, two (the second of [N, 5] sums, after a second read of the local logits) for jsd and
tvd, none in the backward. With a top-k teacher (``teacher=xent.TopK(...)``), see
``distill_topk``: every rank holds the whole teacher (global ids), the ids' student logits are
summed over ranks from their owners, and the single-process top-k op runs on [N, k + 1] per-row
values. linear_distill is not sharded, with either teacher (process_group is not one of its
arguments): gather the heads, or compute the logits per rank and call distill.

policy_loss and linear_policy_loss (RL, docs/semantics.md §7): the ce records (one all_gather
for the batch) give each token's lse, ℓ and H; the per-token policy math runs replicated on every
rank and each slice's gradient is formed in the forward from the global lse and H
(xent/_sharded_policy.py). linear_policy_loss: per row chunk one product, the chunk's records,
their all_gather, the policy math and the chunk's gradients (three products per chunk); gspo
takes the records of every chunk first (its sequence ratio needs all of a sequence's tokens), then
forms each chunk's logits again (four products per chunk, three when the batch is one chunk).

DTensor inputs need no process_group: pass the DTensors themselves (logits Shard(-1), an LM head
Shard(0) with hidden Replicate) and xent/_dtensor.py runs this module on their mesh's group, the
offsets taken from the placements; its docstring lists the placements and the FSDP2 rule.

With process_group, a DTensor (an FSDP2-sharded LM head) is refused with an error, because its
local tensor is a slice of rows of the *parameter layout*, not necessarily the vocabulary slice
the loss must know. Either gather it (``weight.full_tensor()``, then call without process_group),
or pass its local vocabulary slice with the offset: ``weight.to_local()`` with
``vocab_offset=`` = the first row it holds (for ``Shard(0)`` placement: the sum of the row
counts of the lower ranks) and ``vocab_size=`` the full row count.
"""

from __future__ import annotations

from typing import Any

import torch

from xent._autograd import _no_double_backward
from xent._ops import ops
from xent._sharded_linear import linear_cross_entropy  # its own module: the chunk schedules
from xent._sharded_topk import distill_topk  # its own module: a composition of torch ops
from xent._vocab_parallel import _gather_records, _refuse_dtensor, vocab_layout

Tensor = torch.Tensor

__all__ = ["cross_entropy", "linear_cross_entropy", "distill", "distill_topk", "vocab_layout"]


class _ShardedCrossEntropy(torch.autograd.Function):
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale)
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        class_weight: Tensor | None,
        row_weight: Tensor | None,
        options: tuple,
        layout: tuple,
        group: Any,
        with_stats: bool,
    ):
        offset, vocab = layout
        partial = ops.ce_shard_stats(logits, target, class_weight, offset, vocab, *options)
        gathered = _gather_records(partial, group)
        outputs = ops.ce_shard_loss(gathered, target, row_weight, vocab, *options, with_stats)
        ctx.save_for_backward(logits, target, gathered, class_weight, row_weight)
        ctx.options, ctx.layout = options, layout
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *unused: Any):
        logits, target, gathered, class_weight, row_weight = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            with torch.no_grad():
                grad = ops.ce_shard_backward(
                    logits,
                    target,
                    gathered,
                    grad_loss,
                    class_weight,
                    row_weight,
                    ctx.layout[0],
                    ctx.layout[1],
                    0,
                    *ctx.options,
                )
            (grad,) = _no_double_backward("xent.cross_entropy", (grad,))
        return grad, None, None, None, None, None, None, None


def cross_entropy(
    logits2d: Tensor,
    target1d: Tensor,
    class_weight: Tensor | None,
    row_weight1d: Tensor | None,
    options: tuple,
    with_stats: bool,
    *,
    process_group: Any,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
) -> Any:
    """The sharded form behind ``xent.cross_entropy(..., process_group=pg)``.

    logits2d [N, V_local] is this rank's vocabulary slice; target1d [N] global ids; class_weight
    the local slice [V_local] of the class weights (or None). Returns the outputs tuple of
    xent::ce_forward (loss first), identical on every rank."""
    function = "cross_entropy"
    _refuse_dtensor(function, "logits", logits2d)
    _refuse_dtensor(function, "class_weight", class_weight)
    layout = vocab_layout(
        logits2d.shape[-1], process_group, logits2d.device, vocab_offset, vocab_size, function
    )
    if torch.is_grad_enabled() and logits2d.requires_grad:
        return _ShardedCrossEntropy.apply(
            logits2d,
            target1d,
            class_weight,
            row_weight1d,
            options,
            layout,
            process_group,
            with_stats,
        )
    partial = ops.ce_shard_stats(logits2d, target1d, class_weight, layout[0], layout[1], *options)
    gathered = _gather_records(partial, process_group)
    return ops.ce_shard_loss(gathered, target1d, row_weight1d, layout[1], *options, with_stats)


# ---- distill ------------------------------------------------------------------------------------

_TWO_PASS_KINDS = ("jsd", "tvd")  # xent::distill_shard_needs_sums


class _ShardedDistill(torch.autograd.Function):
    # options: (kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index,
    #           reduction, label_smoothing, z_loss), as DistillFunction.
    @staticmethod
    def forward(
        ctx: Any,
        student: Tensor,
        teacher: Tensor,
        target: Tensor,
        class_weight: Tensor | None,
        options: tuple,
        layout: tuple,
        group: Any,
    ):
        gathered, sums, loss = _distill_forward(
            student, teacher, target, class_weight, options, layout, group
        )
        ctx.save_for_backward(student, teacher, target, gathered, sums, class_weight)
        ctx.options, ctx.layout = options, layout
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor):
        student, teacher, target, gathered, sums, class_weight = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            with torch.no_grad():
                grad = ops.distill_shard_backward(
                    student,
                    teacher,
                    target,
                    gathered,
                    sums,
                    grad_loss,
                    class_weight,
                    ctx.layout[0],
                    ctx.layout[1],
                    *ctx.options,
                )
            (grad,) = _no_double_backward("xent.distill", (grad,))
        return grad, None, None, None, None, None, None


def _distill_forward(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
    options: tuple,
    layout: tuple,
    group: Any,
) -> tuple:
    """(gathered records, gathered sums or None, loss): pass 1 and its all_gather, then for jsd
    and tvd pass 2 and its all_gather."""
    offset, vocab = layout
    partial = ops.distill_shard_stats(
        student, teacher, target, class_weight, offset, vocab, *options
    )
    gathered = _gather_records(partial, group)
    sums = None
    if options[0] in _TWO_PASS_KINDS:
        sums = _gather_records(
            ops.distill_shard_sums(student, teacher, target, gathered, offset, vocab, *options),
            group,
        )
    loss = ops.distill_shard_loss(gathered, sums, target, student.shape[0], vocab, *options)
    return gathered, sums, loss


def distill(
    student2d: Tensor,
    teacher2d: Tensor,
    target1d: Tensor | None,
    class_weight: Tensor | None,
    options: tuple,
    *,
    process_group: Any,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """The sharded form behind ``xent.distill(..., process_group=pg)``.

    student2d, teacher2d [N, V_local] are this rank's vocabulary slice of the student and teacher
    logits; target1d [N] global ids (or None); class_weight the local slice [V_local] of the hard
    term's class weights (or None). Returns the loss, identical on every rank.

    Passes and collectives (xent/distill_shard.hpp):
    * forward_kl, reverse_kl, soft_ce: one read of the local student and teacher (slice lse and
      the divergence between the slice-renormalised distributions, the hard term's ce record), one
      all_gather of [N, 13] records; the loss follows by the chain rule over slices.
    * jsd, tvd: the same first read and gather (the global lse), then a second read of the local
      slices for the per-element sums (loss, Σ p_s·u, tvd's side sums) and a second all_gather of
      [N, 5] records.
    * backward: no collective; one read of student and teacher, one write of the gradient (the
      row constants — reverse_kl's KL, jsd's Σ p_s·u, tvd's side sums — come from the forward's
      gathered records)."""
    function = "distill"
    for name, tensor in (
        ("student_logits", student2d),
        ("teacher_logits", teacher2d),
        ("class_weight", class_weight),
    ):
        _refuse_dtensor(function, name, tensor)
    layout = vocab_layout(
        student2d.shape[-1], process_group, student2d.device, vocab_offset, vocab_size, function
    )
    if torch.is_grad_enabled() and student2d.requires_grad:
        return _ShardedDistill.apply(
            student2d, teacher2d, target1d, class_weight, options, layout, process_group
        )
    return _distill_forward(
        student2d, teacher2d, target1d, class_weight, options, layout, process_group
    )[2]
