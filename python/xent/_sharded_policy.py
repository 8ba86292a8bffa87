"""The vocabulary-parallel forms of policy_loss and linear_policy_loss (docs/semantics.md §5, §7).

Every rank holds one vocabulary slice of the logits (or of the LM head), the same tokens and the
same per-token data. Per token, the merged ce records give lse, ℓ (the target's owner contributes
x̃_y) and H (from the merged Σ e^(x̃−max)·(x̃−max)): ce_shard_stats on the slice, one all_gather,
ce_shard_loss with its statistics. The per-token policy math (_policy_terms) then runs replicated
on every rank (N-sized, identical inputs, so identical c_ℓ, c_H and loss). The slice's gradient
c_ℓ·∂ℓ/∂x + c_H·∂H/∂x is formed in the forward, as unsharded, from the global lse and H:
ce_shard_backward with the per-row upstream −c_ℓ (it knows which rank owns the target) and, when
c_H is not zero, the entropy part of ce_logprob_backward (a second read of the slice; its target
term is given a zero coefficient, so any in-slice column stands for the target).

linear_policy_loss runs over row chunks of the local head (each chunk's logits within
workspace_bytes, every rank cutting the batch at the same rows). Every loss type but gspo: the
aggregation weights first (targets and sequences only), then per chunk its logits, records, one
all_gather of them, its tokens' policy math and at once its gradient in place, ∂hidden and
∂weight (∂bias): three products per chunk. gspo, whose sequence ratio needs all of a sequence's
tokens, runs two passes: the records of every chunk and one all_gather, the policy math, then per
chunk the logits again: four products per chunk, three when the batch is one chunk (its logits
kept from the first pass). ∂hidden is all-reduced unless reduce_hidden_grad=False.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from xent._linear_policy import LinearPolicyLossFunction
from xent._logprobs import _zero_ignored
from xent._ops import ops
from xent._policy import PolicyLossFunction, _aggregation_weights, _policy_terms
from xent._sharded_linear import _chunk_logits, _ChunkGrads, _head_layout
from xent._vocab_parallel import _gather_records, _refuse_dtensor, vocab_layout


def _ce_options(transform: tuple) -> tuple:
    """The ce options of a logprob: reduction none, no smoothing, no z-loss."""
    ignore_index, softcap, scale = transform
    return (ignore_index, "none", 0.0, 0.0, softcap, scale)


def _records(logits: Tensor, target: Tensor, transform: tuple, layout: tuple) -> Tensor:
    return ops.ce_shard_stats(logits, target, None, layout[0], layout[1], *_ce_options(transform))


def _statistics(gathered: Tensor, target: Tensor, transform: tuple, layout: tuple) -> tuple:
    """(lse, logprob, entropy) per token from the gathered records."""
    outputs = ops.ce_shard_loss(gathered, target, None, layout[1], *_ce_options(transform), True)
    return outputs[1], outputs[2], _zero_ignored(outputs[3], target, transform[0])


def _slice_gradient(
    logits: Tensor,
    target: Tensor,
    gathered: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    transform: tuple,
    layout: tuple,
    first_row: int = 0,
) -> Tensor:
    """∂loss/∂(local logits) of rows [first_row, first_row + n): c_ℓ·∂ℓ/∂x + c_H·∂H/∂x."""
    rows = slice(first_row, first_row + logits.shape[0])
    grad = ops.ce_shard_backward(
        logits,
        target,
        gathered,
        grad_logprob.neg(),
        None,
        None,
        layout[0],
        layout[1],
        first_row,
        *_ce_options(transform),
    )
    if grad_entropy is None or logits.shape[1] == 0:
        return grad
    # The entropy part needs no target: the target term gets c_ℓ = 0, so column 0 stands for it
    # on valid rows; ignored rows (c_H = 0 there too) take an ignore index of their own.
    valid = target[rows] != transform[0]
    local = torch.where(valid, torch.zeros_like(target[rows]), torch.full_like(target[rows], -1))
    grad += ops.ce_logprob_backward(
        logits,
        local,
        lse[rows],
        entropy[rows],
        torch.zeros_like(grad_entropy[rows]),
        grad_entropy[rows],
        -1,
        transform[1],
        transform[2],
    )
    return grad


def _policy_forward(
    logits: Tensor,
    target: Tensor,
    data: tuple,
    rest: tuple,
    layout: tuple,
    group: Any,
    wants_grad: bool,
) -> tuple:
    """((loss, logprob, entropy, *stats), the slice's gradient or None)."""
    sequence, divisor, transform, options = rest
    gathered = _gather_records(_records(logits, target, transform, layout), group)
    lse, logprob, entropy = _statistics(gathered, target, transform, layout)
    valid = target != transform[0]
    loss, grad_logprob, grad_entropy, *stats = _policy_terms(
        logprob, entropy, valid, *data, sequence, divisor, options
    )
    grad = None
    if wants_grad:
        grad = _slice_gradient(
            logits, target, gathered, lse, entropy, grad_logprob, grad_entropy, transform, layout
        )
    return (loss, logprob, entropy, *stats), grad


class _ShardedPolicyLoss(PolicyLossFunction):
    # logits [N, V_local]; plan: the other arguments of _policy_forward. The backward (the saved
    # gradient scaled by the upstream scalar) is PolicyLossFunction's.
    @staticmethod
    def forward(ctx: Any, logits: Tensor, plan: tuple):
        outputs, grad = _policy_forward(logits, *plan, True)
        ctx.save_for_backward(grad)
        ctx.scaled = False
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs


def policy_loss(
    logits2d: Tensor, target1d: Tensor, data: tuple, rest: tuple, wants_grad: bool, shard: tuple
) -> tuple:
    """The sharded form behind ``xent.policy_loss(..., process_group=pg)``: (loss, logprob,
    entropy, *stats), identical on every rank. logits2d [N, V_local] is this rank's slice; shard:
    (process_group, vocab_offset, vocab_size)."""
    function = "policy_loss"
    group, vocab_offset, vocab_size = shard
    _refuse_dtensor(function, "logits", logits2d)
    layout = vocab_layout(
        logits2d.shape[-1], group, logits2d.device, vocab_offset, vocab_size, function
    )
    plan = (target1d, data, rest, layout, group)
    if wants_grad:
        return _ShardedPolicyLoss.apply(logits2d, plan)
    return _policy_forward(logits2d, *plan, False)[0]


# ---- linear_policy_loss -------------------------------------------------------------------------


def _linear_records(operands: tuple, target: Tensor, linear: tuple, layout: tuple) -> tuple:
    """(records [N, 9] of every chunk, the single chunk's logits or None)."""
    hidden, weight, bias = operands
    transform, chunk, fp32_logits = linear
    rows = hidden.shape[0]
    if rows <= chunk:
        logits = _chunk_logits(hidden, weight, bias, fp32_logits)
        return _records(logits, target, transform, layout), logits
    parts = []
    for begin in range(0, rows, chunk):
        end = min(rows, begin + chunk)
        logits = _chunk_logits(hidden[begin:end], weight, bias, fp32_logits)
        parts.append(_records(logits, target[begin:end], transform, layout))
    return torch.cat(parts), None


def _linear_forward(
    operands: tuple,
    target: Tensor,
    data: tuple,
    rest: tuple,
    linear: tuple,
    layout: tuple,
    group: Any,
    wants: tuple,
    reduce_hidden_grad: bool,
) -> tuple:
    """((loss, logprob, entropy, *stats), (∂hidden, ∂weight, ∂bias))."""
    sequence, divisor, transform, options = rest
    chunk = linear[1]
    records, logits = _linear_records(operands, target, linear, layout)
    gathered = _gather_records(records, group)
    lse, logprob, entropy = _statistics(gathered, target, transform, layout)
    valid = target != transform[0]
    loss, grad_logprob, grad_entropy, *stats = _policy_terms(
        logprob, entropy, valid, *data, sequence, divisor, options
    )
    grads = (None, None, None)
    if any(wants):
        hidden, weight, bias = operands
        accumulated = _ChunkGrads(hidden, weight, bias, wants, chunk)
        for begin in range(0, hidden.shape[0], chunk):
            end = min(hidden.shape[0], begin + chunk)
            if logits is None:  # several chunks: the second pass forms them again
                chunk_logits = _chunk_logits(hidden[begin:end], weight, bias, linear[2])
            else:
                chunk_logits = logits
            g = _slice_gradient(
                chunk_logits,
                target,
                gathered,
                lse,
                entropy,
                grad_logprob,
                grad_entropy,
                transform,
                layout,
                begin,
            )
            accumulated.add(g, hidden[begin:end], weight, begin, end)
        grads = accumulated.finish(group, reduce_hidden_grad)
    return (loss, logprob, entropy, *stats), grads


def _linear_in_chunks(operands: tuple, *plan: Any) -> tuple:
    """_linear_forward (plan: its arguments after the operands) for every loss type but gspo over
    several row chunks: the aggregation
    weights first (from the targets and sequences alone), then per chunk its logits, records, one
    all_gather of them, its tokens' policy math and at once its gradient, ∂hidden and ∂W: three
    products per chunk, the logits never formed twice."""
    target, data, rest, linear, layout, group, wants, reduce_hidden_grad = plan
    sequence, divisor, transform, options = rest
    hidden, weight, bias = operands
    chunk, fp32_logits = linear[1], linear[2]
    valid = target != transform[0]
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    weights, _ = _aggregation_weights(valid, sequence, divisor, options.aggregation, dtype)
    accumulated = _ChunkGrads(hidden, weight, bias, wants, chunk) if any(wants) else None
    losses, logprobs, entropies, sums = [], [], [], []
    for begin in range(0, hidden.shape[0], chunk):
        rows = slice(begin, min(hidden.shape[0], begin + chunk))
        logits = _chunk_logits(hidden[rows], weight, bias, fp32_logits)
        block = target[rows]
        gathered = _gather_records(_records(logits, block, transform, layout), group)
        lse, logprob, entropy = _statistics(gathered, block, transform, layout)
        loss, grad_logprob, grad_entropy, *block_sums = _policy_terms(
            logprob,
            entropy,
            valid[rows],
            *(None if d is None else d[rows] for d in data),
            None,
            None,
            options,
            weights[rows],
        )
        if accumulated is not None:
            g = _slice_gradient(
                logits, block, gathered, lse, entropy, grad_logprob, grad_entropy, transform, layout
            )
            accumulated.add(g, hidden[rows], weight, rows.start, rows.stop)
        losses.append(loss)
        logprobs.append(logprob)
        entropies.append(entropy)
        sums.append(torch.stack(block_sums))
    stats = torch.stack(sums).sum(0) / valid.sum().clamp(min=1).to(dtype)
    grads = (None, None, None)
    if accumulated is not None:
        grads = accumulated.finish(group, reduce_hidden_grad)
    outputs = (torch.stack(losses).sum(), torch.cat(logprobs), torch.cat(entropies))
    return (*outputs, *stats.unbind()), grads


def _linear_schedule(plan: tuple) -> Any:
    """The chunked schedule of every loss type but gspo when the batch is several chunks, else the
    two passes (gspo's sequence ratio needs all its tokens' records first)."""
    target, rest, linear = plan[0], plan[2], plan[3]
    several = target.shape[0] > linear[1]
    return _linear_in_chunks if several and rest[3].loss_type != "gspo" else _linear_forward


class _ShardedLinearPolicyLoss(LinearPolicyLossFunction):
    # plan: the arguments of _linear_forward after the operands. The backward (the saved
    # gradients scaled by the upstream scalar) is LinearPolicyLossFunction's.
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, plan: tuple):
        outputs, grads = _linear_schedule(plan)((hidden, weight, bias), *plan)
        wants = plan[6]
        ctx.save_for_backward(*(g if w else None for g, w in zip(grads, wants)))
        ctx.scaled = False
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs


def linear_policy_loss(
    operands: tuple,
    target1d: Tensor,
    data: tuple,
    rest: tuple,
    wants: tuple,
    shard: tuple,
    head: tuple,
) -> tuple:
    """The sharded form behind ``xent.linear_policy_loss(..., process_group=pg)``: operands
    (hidden [N, H], the same on every rank; weight [V_local, H] and bias [V_local] or None, this
    rank's LM-head rows); shard: (process_group, vocab_offset, vocab_size); head:
    (workspace_bytes, fp32_logits, reduce_hidden_grad). Returns (loss, logprob, entropy, *stats),
    identical on every rank."""
    group, vocab_offset, vocab_size = shard
    workspace_bytes, fp32_logits, reduce_hidden_grad = head
    layout, chunk = _head_layout(
        "linear_policy_loss",
        (*operands, None),
        group,
        (workspace_bytes, fp32_logits, vocab_offset, vocab_size),
    )
    linear = (rest[2], chunk, bool(fp32_logits))
    if any(wants):
        plan = (target1d, data, rest, linear, layout, group, wants, bool(reduce_hidden_grad))
        return _ShardedLinearPolicyLoss.apply(*operands, plan)
    with torch.no_grad():
        plan = (target1d, data, rest, linear, layout, group, wants, False)
        return _linear_schedule(plan)(operands, *plan)[0]
