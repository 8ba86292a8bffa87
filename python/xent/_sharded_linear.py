"""The sharded form of linear_cross_entropy (xent.distributed, docs/semantics.md §5): row chunks of the local
LM-head slice, in one of two schedules.

* in-forward (the default for reduction "sum"/"mean" when a gradient is wanted): per row chunk,
  one product for the chunk logits, their records, one ``all_gather`` of the chunk's [n, 9]
  records, then at once the chunk's loss gradient from the merged records while its logits are
  still in the workspace, and ∂hidden, ∂weight (∂bias) from it: three products per chunk, the
  logits never recomputed nor kept past their chunk. Collectives: one all_gather per row chunk
  (one in all at the default GPU budget, where the whole batch is one chunk), one scalar
  all_reduce of the local Σ w_y with class weights and "mean" (the divisor D must be known before
  the first chunk's gradient), and the ∂hidden all_reduce in the backward, which only scales the
  saved gradients by the upstream scalar (one backward per graph, as unsharded).
* two-pass (reduction "none", grad_in_forward=False, no gradient wanted, and "mean" with both
  class weights and z-loss, whose two parts have different divisors): pass 1 computes each chunk's
  records (one product), one all_gather of all records; the backward recomputes each chunk's
  logits (four products per chunk; three with ``cache_logits=True``, which keeps pass 1's
  logits: N·V_local more elements).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from xent._autograd import _apply_upstream, _no_double_backward, _scale_saved
from xent._ops import ops
from xent._vocab_parallel import _fail, _gather_records, _refuse_dtensor, group_facts, vocab_layout

Tensor = torch.Tensor

_DEFAULT_BUDGET = 512 << 20
_RECORD_WIDTH = 9  # kCeShardStatsWidth


def _widest_slice(local_vocab: int, group: Any, device: torch.device) -> int:
    """The largest local vocabulary of the group (one all_reduce MAX at the first call, cached
    per group and local size). Row chunks are sized by it, so that every rank cuts the batch at
    the same rows: the in-forward schedule gathers once per chunk, and ranks whose chunks
    differed would issue mismatched collectives."""
    widest = group_facts(group)
    key = ("widest", int(local_vocab))
    if key not in widest:
        if dist.get_world_size(group) == 1:
            widest[key] = int(local_vocab)
        else:
            size = torch.tensor([int(local_vocab)], dtype=torch.int64, device=device)
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
            widest[key] = int(size.item())
    return widest[key]


def _chunk_rows(rows: int, local_vocab: int, element: int, budget: int) -> int:
    """Rows per chunk so that a chunk's logits and their gradient fit the budget."""
    per_row = max(1, 2 * local_vocab * element)
    return max(1, min(rows, budget // per_row)) if rows > 0 else 1


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, fp32_logits: bool) -> Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return logits.float() if fp32_logits else logits


class _ChunkGrads:
    """∂hidden, ∂weight, ∂bias accumulated over row chunks. ∂W and ∂bias accumulate in fp32
    (docs/semantics.md §2), written once in their dtype. With 16-bit layers each chunk's Gᵀ·h product is
    rounded to 16 bits before it is added (a torch.mm output); a single chunk (the whole batch
    within workspace_bytes) has no such rounding. An fp32-output product (addmm's out_dtype, CUDA
    only) would remove it."""

    def __init__(
        self, hidden: Tensor, weight: Tensor, bias: Tensor | None, wants: tuple, chunk: int
    ):
        want_hidden, want_weight, want_bias = wants
        self.single = hidden.shape[0] <= chunk
        self.hidden = torch.empty_like(hidden) if want_hidden else None
        self.weight = None
        if want_weight and not self.single:
            self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        self.bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        )
        self.wants, self.weight_dtype = wants, weight.dtype
        self.bias_dtype = bias.dtype if bias is not None else None

    def add(self, g: Tensor, h: Tensor, weight: Tensor, begin: int, end: int) -> None:
        g = g.to(h.dtype)
        if self.wants[0]:
            torch.mm(g, weight, out=self.hidden[begin:end])
        if self.wants[1]:
            if self.single:
                self.weight = torch.mm(g.t(), h)
            else:
                self.weight += torch.mm(g.t(), h).float()
        if self.wants[2]:
            self.bias += g.float().sum(0)

    def finish(self, group: Any, reduce_hidden_grad: bool) -> tuple:
        """(∂hidden, ∂weight, ∂bias) in their dtypes; ∂hidden all-reduced when asked."""
        if self.hidden is not None and reduce_hidden_grad and dist.get_world_size(group) > 1:
            dist.all_reduce(self.hidden, op=dist.ReduceOp.SUM, group=group)
        weight = self.weight.to(self.weight_dtype) if self.weight is not None else None
        bias = self.bias.to(self.bias_dtype) if self.bias is not None else None
        return self.hidden, weight, bias


def _in_forward_possible(options: tuple, class_weight: Tensor | None) -> bool:
    """Whether one gradient scale serves the whole loss: c_n = r_n/D for the ce part and
    r_n/N_valid for the z part must be one factor (D = N_valid without class weights)."""
    reduction, z_loss = options[1], options[3]
    return reduction == "sum" or class_weight is None or z_loss == 0


def _mean_scale(
    target: Tensor, class_weight: Tensor | None, options: tuple, layout: tuple, group: Any
) -> Tensor:
    """1/D of "mean" (0 when D = 0), on the device: D = N_valid, or Σ w_y over valid rows with
    class weights (each rank adds the rows whose target its slice holds; one scalar all_reduce)."""
    ignore_index = options[0]
    valid = target != ignore_index
    if class_weight is None:
        divisor = valid.sum().to(torch.float64)
    else:
        local = target - layout[0]
        inside = valid & (local >= 0) & (local < class_weight.shape[0])
        if class_weight.shape[0] > 0:
            picked = class_weight[local.clamp(0, class_weight.shape[0] - 1)]
            divisor = torch.where(inside, picked, 0.0).to(torch.float64).sum()
        else:  # an empty slice holds no target
            divisor = torch.zeros((), dtype=torch.float64, device=target.device)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(divisor, op=dist.ReduceOp.SUM, group=group)
    return torch.where(divisor > 0, 1.0 / divisor.clamp(min=1e-300), 0.0).to(torch.float32)


def _reduced_outputs(
    parts: tuple, target: Tensor, options: tuple, with_stats: bool, scale: Any
) -> tuple:
    """The outputs of ce_shard_loss for the whole batch from its chunks' "none" outputs."""
    reduction = options[1]
    rows = (
        torch.cat([p[0] for p in parts]) if parts else target.new_empty((0,), dtype=torch.float32)
    )
    loss = rows.sum() if reduction == "sum" else rows.sum() * scale
    if not with_stats:
        empty = loss.new_empty((0,))
        return (loss, empty, empty, empty, empty.long(), empty, empty)
    lse, logprob, entropy, argmax = (torch.cat([p[i] for p in parts]) for i in range(1, 5))
    valid = target != options[0]
    n_valid = valid.sum()
    hits = ((argmax == target) & valid).sum()
    accuracy = torch.where(n_valid > 0, hits / n_valid.clamp(min=1), 0.0).to(loss.dtype)
    z_rows = torch.cat([p[6] for p in parts])
    z_value = z_rows.sum() if reduction == "sum" else z_rows.sum() / n_valid.clamp(min=1)
    return (loss, lse, logprob, entropy, argmax, accuracy, z_value.to(loss.dtype))


class _ShardedLinearCrossEntropy(torch.autograd.Function):
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale)
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        class_weight: Tensor | None,
        row_weight: Tensor | None,
        options: tuple,
        layout: tuple,
        group: Any,
        with_stats: bool,
        wants: tuple,
        chunk: int,
        fp32_logits: bool,
        reduce_hidden_grad: bool,
        cache_logits: bool,
        in_forward: bool,
    ):
        ctx.group, ctx.reduce_hidden_grad, ctx.in_forward = group, reduce_hidden_grad, in_forward
        ctx.scaled = False
        if in_forward:
            outputs, grads = _forward_with_gradient(
                hidden,
                weight,
                bias,
                target,
                class_weight,
                row_weight,
                options,
                layout,
                group,
                with_stats,
                wants,
                chunk,
                fp32_logits,
            )
            ctx.save_for_backward(*grads.finish(group, False))
        else:
            outputs, gathered, kept = _forward_records(
                hidden,
                weight,
                bias,
                target,
                class_weight,
                row_weight,
                options,
                layout,
                group,
                with_stats,
                chunk,
                fp32_logits,
                cache_logits,
            )
            ctx.save_for_backward(hidden, weight, bias, target, gathered, class_weight, row_weight)
            ctx.options, ctx.layout, ctx.wants = options, layout, wants
            ctx.chunk, ctx.fp32_logits, ctx.kept = chunk, fp32_logits, kept
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *unused: Any):
        if ctx.in_forward:
            grad_hidden, grad_weight, grad_bias = _apply_upstream(
                _scale_saved(ctx, "xent.linear_cross_entropy"), grad_loss
            )
            if (
                grad_hidden is not None
                and ctx.reduce_hidden_grad
                and dist.get_world_size(ctx.group) > 1
            ):
                with torch.no_grad():
                    dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
            grads = (grad_hidden, grad_weight, grad_bias)
        else:
            grads = _backward_recompute(ctx, grad_loss)
        grads = _no_double_backward("xent.linear_cross_entropy", grads)
        return (*grads,) + (None,) * 13


def _forward_with_gradient(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    options: tuple,
    layout: tuple,
    group: Any,
    with_stats: bool,
    wants: tuple,
    chunk: int,
    fp32_logits: bool,
) -> tuple:
    """The in-forward schedule: per chunk, records, their all_gather, the chunk's gradient for an
    upstream of 1 (reduction "sum" scaled by 1/D for "mean") and its products."""
    offset, vocab = layout
    rows = hidden.shape[0]
    scale = (
        _mean_scale(target, class_weight, options, layout, group)
        if options[1] == "mean"
        else torch.ones((), dtype=torch.float32, device=hidden.device)
    )
    per_row = (options[0], "none") + tuple(options[2:])
    summed = (options[0], "sum") + tuple(options[2:])
    grads = _ChunkGrads(hidden, weight, bias, wants, chunk)
    parts = []
    with torch.no_grad():
        for begin in range(0, rows, chunk):
            end = min(rows, begin + chunk)
            h, y = hidden[begin:end], target[begin:end]
            r = row_weight[begin:end] if row_weight is not None else None
            logits = _chunk_logits(h, weight, bias, fp32_logits)
            gathered = _gather_records(
                ops.ce_shard_stats(logits, y, class_weight, offset, vocab, *options), group
            )
            parts.append(ops.ce_shard_loss(gathered, y, r, vocab, *per_row, with_stats))
            g = ops.ce_shard_backward(
                logits, y, gathered, scale, class_weight, r, offset, vocab, 0, *summed
            )
            del logits
            grads.add(g, h, weight, begin, end)
    return _reduced_outputs(parts, target, options, with_stats, scale), grads


def _forward_records(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    options: tuple,
    layout: tuple,
    group: Any,
    with_stats: bool,
    chunk: int,
    fp32_logits: bool,
    cache_logits: bool,
) -> tuple:
    """Pass 1 of the two-pass schedule: one product per chunk, records only (the chunk logits
    are dropped unless cache_logits keeps them for the backward), one all_gather in all."""
    offset, vocab = layout
    rows = hidden.shape[0]
    parts, kept = [], []
    for begin in range(0, rows, chunk):
        end = min(rows, begin + chunk)
        logits = _chunk_logits(hidden[begin:end], weight, bias, fp32_logits)
        parts.append(
            ops.ce_shard_stats(logits, target[begin:end], class_weight, offset, vocab, *options)
        )
        if cache_logits:
            kept.append(logits)
    partial = (
        (torch.cat(parts) if len(parts) != 1 else parts[0])
        if parts
        else hidden.new_empty(
            (0, _RECORD_WIDTH),
            dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32,
        )
    )
    gathered = _gather_records(partial, group)
    outputs = ops.ce_shard_loss(gathered, target, row_weight, vocab, *options, with_stats)
    return outputs, gathered, kept


def _backward_recompute(ctx: Any, grad_loss: Tensor) -> tuple:
    """Pass 2 of the two-pass schedule: each chunk's logits again (or pass 1's, kept), its loss
    gradient for the real upstream gradient, then ∂h, ∂W, ∂bias."""
    hidden, weight, bias, target, gathered, class_weight, row_weight = ctx.saved_tensors
    offset, vocab = ctx.layout
    rows, chunk = hidden.shape[0], ctx.chunk
    grads = _ChunkGrads(hidden, weight, bias, ctx.wants, chunk)
    with torch.no_grad():
        for begin in range(0, rows, chunk):
            end = min(rows, begin + chunk)
            h = hidden[begin:end]
            logits = (
                ctx.kept.pop(0) if ctx.kept else _chunk_logits(h, weight, bias, ctx.fp32_logits)
            )
            g = ops.ce_shard_backward(
                logits,
                target,
                gathered,
                grad_loss,
                class_weight,
                row_weight,
                offset,
                vocab,
                begin,
                *ctx.options,
            )
            del logits
            grads.add(g, h, weight, begin, end)
        return grads.finish(ctx.group, ctx.reduce_hidden_grad)


def _head_layout(function: str, tensors: tuple, group: Any, sizes: tuple) -> tuple:
    """(layout, rows per chunk) of a sharded LM head, after the checks every sharded linear op
    makes. tensors: (hidden [N, H], weight [V_local, H], bias, class_weight or None); sizes:
    (workspace_bytes, fp32_logits, vocab_offset, vocab_size)."""
    hidden2d, weight = tensors[0], tensors[1]
    workspace_bytes, fp32_logits, vocab_offset, vocab_size = sizes
    for name, tensor in zip(("hidden", "weight", "bias", "class_weight"), tensors):
        _refuse_dtensor(function, name, tensor)
    if weight.dim() != 2 or hidden2d.dim() != 2 or weight.shape[1] != hidden2d.shape[1]:
        _fail(
            function,
            "weight",
            "shape mismatch",
            tuple(weight.shape),
            f"(V_local, {hidden2d.shape[-1]}) (the local LM-head rows, H of hidden)",
        )
    layout = vocab_layout(weight.shape[0], group, weight.device, vocab_offset, vocab_size, function)
    budget = int(workspace_bytes) if workspace_bytes else _DEFAULT_BUDGET
    element = 4 if fp32_logits else hidden2d.element_size()
    widest = _widest_slice(weight.shape[0], group, weight.device)
    return layout, _chunk_rows(hidden2d.shape[0], widest, element, budget)


def linear_cross_entropy(
    hidden2d: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target1d: Tensor,
    class_weight: Tensor | None,
    row_weight1d: Tensor | None,
    options: tuple,
    with_stats: bool,
    wants: tuple,
    *,
    process_group: Any,
    workspace_bytes: int = 0,
    fp32_logits: bool = False,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
    cache_logits: bool = False,
    grad_in_forward: bool = True,
) -> Any:
    """The sharded form behind ``xent.linear_cross_entropy(..., process_group=pg)``.

    weight [V_local, H] (and bias [V_local]) are this rank's rows of the LM head; hidden [N, H]
    the same on every rank. ∂hidden is all-reduced over the group unless reduce_hidden_grad is
    False (then it is this rank's partial sum, for a tensor-parallel layer that reduces it).
    Schedules and collectives: see this module's docstring. cache_logits applies to the two-pass
    schedule (the in-forward one never recomputes)."""
    layout, chunk = _head_layout(
        "linear_cross_entropy",
        (hidden2d, weight, bias, class_weight),
        process_group,
        (workspace_bytes, fp32_logits, vocab_offset, vocab_size),
    )
    if any(wants):
        in_forward = (
            bool(grad_in_forward)
            and options[1] != "none"
            and _in_forward_possible(options, class_weight)
        )
        return _ShardedLinearCrossEntropy.apply(
            hidden2d,
            weight,
            bias,
            target1d,
            class_weight,
            row_weight1d,
            options,
            layout,
            process_group,
            with_stats,
            wants,
            chunk,
            bool(fp32_logits),
            bool(reduce_hidden_grad),
            bool(cache_logits),
            in_forward,
        )
    with torch.no_grad():
        return _forward_records(
            hidden2d,
            weight,
            bias,
            target1d,
            class_weight,
            row_weight1d,
            options,
            layout,
            process_group,
            with_stats,
            chunk,
            bool(fp32_logits),
            False,
        )[0]
