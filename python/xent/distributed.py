"""Vocabulary-parallel losses over torch.distributed (SPEC §5).

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
logits fit ``workspace_bytes``: pass 1 (forward) computes the chunk logits (one product) and
their records, then the collective; pass 2 (backward) recomputes the chunk logits and forms the
loss gradient, ∂hidden and ∂weight (four products per chunk in all; three with
``cache_logits=True``, which keeps pass 1's logits: N·V_local more elements). Unsharded
linear_cross_entropy forms its gradient in the forward (three products); a sharded one cannot,
since the gradient needs the global lse, known only after the collective.

The vocabulary offset of each rank is either given (``vocab_offset=`` with ``vocab_size=``) or
derived from an ``all_gather`` of the local sizes in rank order at the first call, cached per
(group, local size).

Distillation (``xent.distill``) is not sharded yet: ``process_group`` raises there.

FSDP2 / DTensor: a DTensor (an FSDP2-sharded LM head) is refused with an error, because its
local tensor is a slice of rows of the *parameter layout*, not necessarily the vocabulary slice
the loss must know. Either gather it (``weight.full_tensor()``, then call without process_group),
or pass its local vocabulary slice with the offset: ``weight.to_local()`` with
``vocab_offset=`` = the first row it holds (for ``Shard(0)`` placement: the sum of the row
counts of the lower ranks) and ``vocab_size=`` the full row count.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from xent._autograd import _no_double_backward
from xent._ops import ops

Tensor = torch.Tensor

__all__ = ["cross_entropy", "linear_cross_entropy", "vocab_layout"]

_LAYOUTS: dict = {}


def _fail(function: str, argument: str, problem: str, got, expected: str):
    raise ValueError(f"{function}: {argument} {problem}: got {got}; expected {expected}")


def _refuse_dtensor(function: str, name: str, tensor: Optional[Tensor]) -> None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without the DTensor package
        return
    if isinstance(tensor, DTensor):
        raise TypeError(
            f"{function}: {name} is a DTensor (placements {tensor.placements}); with "
            "process_group the loss expects the local vocabulary slice as a plain tensor. Either "
            f"gather it ({name}.full_tensor()) and call without process_group, or pass "
            f"{name}.to_local() with vocab_offset= (the first vocabulary row it holds) and "
            "vocab_size= (see xent.distributed's docstring, FSDP2 recipe)")


def vocab_layout(local_vocab: int, process_group, device: torch.device, vocab_offset=None,
                 vocab_size=None, function: str = "vocab_layout"):
    """(offset, global V) of this rank's slice: given, or from one all_gather of the local sizes
    (rank order), cached per (group, local size)."""
    if vocab_offset is not None and vocab_size is not None:
        offset, vocab = int(vocab_offset), int(vocab_size)
    else:
        key = (id(process_group), int(local_vocab))
        if key not in _LAYOUTS:
            world = dist.get_world_size(process_group)
            mine = torch.tensor([int(local_vocab)], dtype=torch.int64, device=device)
            sizes = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(sizes, mine, group=process_group)
            sizes = [int(s.item()) for s in sizes]
            rank = dist.get_rank(process_group)
            _LAYOUTS[key] = (sum(sizes[:rank]), sum(sizes))
        offset, vocab = _LAYOUTS[key]
        if vocab_offset is not None and int(vocab_offset) != offset:
            _fail(function, "vocab_offset", "disagrees with the gathered layout", vocab_offset,
                  f"{offset} (the sum of the lower ranks' sizes), or give vocab_size too")
        if vocab_size is not None and int(vocab_size) != vocab:
            _fail(function, "vocab_size", "disagrees with the gathered layout", vocab_size,
                  f"{vocab} (the sum of every rank's size), or give vocab_offset too")
    if not (0 <= offset and offset + local_vocab <= vocab):
        _fail(function, "vocab_offset", "out of range", offset,
              f"0 <= offset and offset + {local_vocab} <= vocab_size = {vocab}")
    return offset, vocab


def _gather_records(partial: Tensor, process_group) -> Tensor:
    """[P·N, 9] rank-major from every rank's [N, 9] (one collective)."""
    world = dist.get_world_size(process_group)
    if world == 1:
        return partial
    gathered = partial.new_empty((world * partial.shape[0], partial.shape[1]))
    dist.all_gather_into_tensor(gathered, partial.contiguous(), group=process_group)
    return gathered


class _ShardedCrossEntropy(torch.autograd.Function):
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale)
    @staticmethod
    def forward(ctx, logits, target, class_weight, row_weight, options, layout, group,
                with_stats):
        offset, vocab = layout
        partial = ops.ce_shard_stats(logits, target, class_weight, offset, vocab, *options)
        gathered = _gather_records(partial, group)
        outputs = ops.ce_shard_loss(gathered, target, row_weight, vocab, *options, with_stats)
        ctx.save_for_backward(logits, target, gathered, class_weight, row_weight)
        ctx.options, ctx.layout = options, layout
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        logits, target, gathered, class_weight, row_weight = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            with torch.no_grad():
                grad = ops.ce_shard_backward(logits, target, gathered, grad_loss, class_weight,
                                             row_weight, ctx.layout[0], ctx.layout[1], 0,
                                             *ctx.options)
            (grad,) = _no_double_backward("xent.cross_entropy", (grad,))
        return grad, None, None, None, None, None, None, None


def cross_entropy(logits2d: Tensor, target1d: Tensor, class_weight: Optional[Tensor],
                  row_weight1d: Optional[Tensor], options: tuple, with_stats: bool, *,
                  process_group, vocab_offset=None, vocab_size=None):
    """The sharded form behind ``xent.cross_entropy(..., process_group=pg)``.

    logits2d [N, V_local] is this rank's vocabulary slice; target1d [N] global ids; class_weight
    the local slice [V_local] of the class weights (or None). Returns the outputs tuple of
    xent::ce_forward (loss first), identical on every rank."""
    function = "cross_entropy"
    _refuse_dtensor(function, "logits", logits2d)
    _refuse_dtensor(function, "class_weight", class_weight)
    layout = vocab_layout(logits2d.shape[-1], process_group, logits2d.device, vocab_offset,
                          vocab_size, function)
    if torch.is_grad_enabled() and logits2d.requires_grad:
        return _ShardedCrossEntropy.apply(logits2d, target1d, class_weight, row_weight1d,
                                          options, layout, process_group, with_stats)
    partial = ops.ce_shard_stats(logits2d, target1d, class_weight, layout[0], layout[1], *options)
    gathered = _gather_records(partial, process_group)
    return ops.ce_shard_loss(gathered, target1d, row_weight1d, layout[1], *options, with_stats)


# ---- linear_cross_entropy ------------------------------------------------------------------------

_DEFAULT_BUDGET = 512 << 20


def _chunk_rows(rows: int, local_vocab: int, element: int, budget: int) -> int:
    """Rows per chunk so that a chunk's logits and their gradient fit the budget."""
    per_row = max(1, 2 * local_vocab * element)
    return max(1, min(rows, budget // per_row)) if rows > 0 else 1


def _chunk_logits(hidden, weight, bias, fp32_logits):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return logits.float() if fp32_logits else logits


class _ShardedLinearCrossEntropy(torch.autograd.Function):
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale)
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, row_weight, options, layout,
                group, with_stats, wants, chunk, fp32_logits, reduce_hidden_grad, cache_logits):
        offset, vocab = layout
        rows = hidden.shape[0]
        # Pass 1: one product per chunk, records only (the chunk logits are dropped unless
        # cache_logits keeps them for the backward: N·V_local elements for one product less).
        parts, kept = [], []
        for begin in range(0, rows, chunk):
            end = min(rows, begin + chunk)
            logits = _chunk_logits(hidden[begin:end], weight, bias, fp32_logits)
            parts.append(ops.ce_shard_stats(logits, target[begin:end], class_weight, offset,
                                            vocab, *options))
            if cache_logits:
                kept.append(logits)
        partial = (torch.cat(parts) if len(parts) != 1 else parts[0]) if parts else \
            hidden.new_empty((0, 9), dtype=torch.float64 if hidden.dtype == torch.float64
                             else torch.float32)
        gathered = _gather_records(partial, group)
        outputs = ops.ce_shard_loss(gathered, target, row_weight, vocab, *options, with_stats)
        ctx.save_for_backward(hidden, weight, bias, target, gathered, class_weight, row_weight)
        ctx.options, ctx.layout, ctx.group, ctx.wants = options, layout, group, wants
        ctx.chunk, ctx.fp32_logits, ctx.reduce_hidden_grad = chunk, fp32_logits, reduce_hidden_grad
        ctx.kept = kept
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        hidden, weight, bias, target, gathered, class_weight, row_weight = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.wants
        rows, chunk = hidden.shape[0], ctx.chunk
        offset, vocab = ctx.layout
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # ∂W and ∂bias accumulate in fp32 across chunks (SPEC §2), written once in their dtype.
        # With 16-bit layers each chunk's Gᵀ·h product is rounded to 16 bits before it is added
        # (a torch.mm output); a single chunk (the whole batch within workspace_bytes) has no such
        # rounding. An fp32-output product (addmm's out_dtype, CUDA only) would remove it.
        single = rows <= chunk
        grad_weight = grad_bias = None
        if want_weight and not single:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if want_bias:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        with torch.no_grad():
            # Pass 2: recompute each chunk's logits, its loss gradient, then ∂h, ∂W, ∂bias.
            for begin in range(0, rows, chunk):
                end = min(rows, begin + chunk)
                h = hidden[begin:end]
                logits = (ctx.kept.pop(0) if ctx.kept
                          else _chunk_logits(h, weight, bias, ctx.fp32_logits))
                g = ops.ce_shard_backward(logits, target, gathered, grad_loss, class_weight,
                                          row_weight, offset, vocab, begin, *ctx.options)
                del logits
                g = g.to(hidden.dtype)
                if want_hidden:
                    torch.mm(g, weight, out=grad_hidden[begin:end])
                if want_weight:
                    if single:
                        grad_weight = torch.mm(g.t(), h)
                    else:
                        grad_weight += torch.mm(g.t(), h).float()
                if want_bias:
                    grad_bias += g.float().sum(0)
            if grad_hidden is not None and ctx.reduce_hidden_grad and \
                    dist.get_world_size(ctx.group) > 1:
                dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        grads = _no_double_backward("xent.linear_cross_entropy",
                                    (grad_hidden, grad_weight, grad_bias))
        return (*grads, None, None, None, None, None, None, None, None, None, None, None, None)


def linear_cross_entropy(hidden2d: Tensor, weight: Tensor, bias: Optional[Tensor],
                         target1d: Tensor, class_weight: Optional[Tensor],
                         row_weight1d: Optional[Tensor], options: tuple, with_stats: bool,
                         wants: tuple, *, process_group, workspace_bytes: int = 0,
                         fp32_logits: bool = False, vocab_offset=None, vocab_size=None,
                         reduce_hidden_grad: bool = True, cache_logits: bool = False):
    """The sharded form behind ``xent.linear_cross_entropy(..., process_group=pg)``.

    weight [V_local, H] (and bias [V_local]) are this rank's rows of the LM head; hidden [N, H]
    the same on every rank. ∂hidden is all-reduced over the group unless reduce_hidden_grad is
    False (then it is this rank's partial sum, for a tensor-parallel layer that reduces it).
    cache_logits keeps pass 1's chunk logits (N·V_local elements) so the backward skips their
    recomputation: three products per step instead of four."""
    function = "linear_cross_entropy"
    for name, tensor in (("hidden", hidden2d), ("weight", weight), ("bias", bias),
                         ("class_weight", class_weight)):
        _refuse_dtensor(function, name, tensor)
    if weight.dim() != 2 or hidden2d.dim() != 2 or weight.shape[1] != hidden2d.shape[1]:
        _fail(function, "weight", "shape mismatch", tuple(weight.shape),
              f"(V_local, {hidden2d.shape[-1]}) (the local LM-head rows, H of hidden)")
    layout = vocab_layout(weight.shape[0], process_group, weight.device, vocab_offset,
                          vocab_size, function)
    budget = int(workspace_bytes) if workspace_bytes else _DEFAULT_BUDGET
    element = 4 if fp32_logits else hidden2d.element_size()
    chunk = _chunk_rows(hidden2d.shape[0], weight.shape[0], element, budget)
    if any(wants):
        return _ShardedLinearCrossEntropy.apply(hidden2d, weight, bias, target1d, class_weight,
                                                row_weight1d, options, layout, process_group,
                                                with_stats, wants, chunk, bool(fp32_logits),
                                                bool(reduce_hidden_grad), bool(cache_logits))
    with torch.no_grad():
        return _ShardedLinearCrossEntropy.forward(_NoContext(), hidden2d, weight, bias, target1d,
                                                  class_weight, row_weight1d, options, layout,
                                                  process_group, with_stats, wants, chunk,
                                                  bool(fp32_logits), bool(reduce_hidden_grad),
                                                  False)


def refuse_distill(function: str):
    raise NotImplementedError(
        f"{function}: process_group is not supported yet: vocabulary-parallel distillation is "
        "not implemented (gather the student and teacher logits, or the LM heads, and call "
        "without process_group)")


class _NoContext:
    """Stands in for autograd's ctx when the forward runs without a graph."""

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass
