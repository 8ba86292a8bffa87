"""autograd.Function wrappers of per-token log-probabilities and entropy (xent.logprobs,
xent.linear_logprobs).

The forward is the `none` cross-entropy forward asked for its statistics: logprob = x̃_y − lse
and entropy H = lse − Σ p·x̃, at logit_scale = 1/temperature. The backward takes an upstream
gradient for each and forms the logits gradient in one pass per row (chunk, for the fused form)
from the saved lse and H: G_i = g_lp·(1{i=y} − p_i) − g_H·p_i·(x̃_i − (lse − H)), then the chain
rule (docs/semantics.md §1). Ignored rows give 0 for both and no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from xent._autograd import _compute_copies, _no_double_backward
from xent._ops import ops

# What linear_logprobs keeps of the forward's logits for its backward when gradients are wanted
# (its cache_bytes), and linear_policy_loss's composition between its two passes.
DEFAULT_LOGPROBS_CACHE_BYTES = 1 << 30


def _zero_ignored(values: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    # Ignored rows' entropy is 0 (their logprob already is), whatever the statistic holds there.
    return values.masked_fill(target == ignore_index, 0.0)


def _statistics(outputs: tuple, target: Tensor, ignore_index: int, with_entropy: bool) -> tuple:
    """(lse, logprob, entropy) of a `none` forward called with `with_stats=with_entropy`.

    Without the statistics the op forms the loss and lse alone, so the lean kernels run (the
    fused product's lean epilogue, the row kernels without entropy and argmax); then logprob is
    −loss (without label smoothing and z-loss a row's loss is lse − x̃_y, and an ignored row's
    is 0) and the entropy, which the caller does not return, is zeros."""
    if with_entropy:
        return outputs[1], outputs[2], _zero_ignored(outputs[3], target, ignore_index)
    logprob = _zero_ignored(outputs[0].neg(), target, ignore_index)  # +0, not −0, when ignored
    return outputs[1], logprob, torch.zeros_like(logprob)


def linear_none_forward(
    operands: tuple,
    target: Tensor,
    options: tuple,
    with_stats: bool,
    cache_rows: int = 0,
    batch_invariant: bool = False,
) -> tuple:
    """linear_ce_forward's outputs with reduction none, no label smoothing and no z-loss: the
    per-row statistics of the fused logprob ops. options: (ignore_index, softcap, logit_scale,
    workspace_bytes, fp32_logits). cache_rows: the logits of rows [0, cache_rows) are kept in
    outputs[10] for the backward (0: none). batch_invariant: each row's statistics bit-identical
    whatever the rows around it and the budget (docs/semantics.md §1)."""
    ignore_index, *rest = options
    return ops.linear_ce_forward(
        *operands,
        target,
        None,
        None,
        ignore_index,
        "none",
        0.0,
        0.0,
        *rest,
        bool(with_stats),
        False,
        False,
        False,
        cache_rows > 0,
        None,
        None,
        batch_invariant=bool(batch_invariant),
        cache_rows=int(cache_rows),
    )


def logits_cache_rows(
    rows: int, vocab: int, dtype: torch.dtype, fp32_logits: bool, cache_logits: bool, budget: int
) -> int:
    """How many rows' logits the forward of linear_logprobs keeps for the backward: all with
    cache_logits, else as many as `budget` bytes hold (V elements of the chunk-logits dtype a
    row: fp32 with fp32_logits, else the operands' dtype)."""
    if cache_logits:
        return rows
    row_bytes = vocab * (4 if fp32_logits else torch.empty((), dtype=dtype).element_size())
    return min(rows, budget // max(row_bytes, 1))


def weight_grad_dtype(compute_dtype: torch.dtype | None, weight: Tensor) -> torch.dtype | None:
    """fp32 for an fp32 master weight whose products run converted (its gradient then stays
    fp32, accumulated in place by the core); None: the weight's own dtype."""
    return torch.float32 if compute_dtype is not None and weight.dtype == torch.float32 else None


def _forward_outputs(
    ctx: Any,
    statistics: tuple,
    target: Tensor,
    ignore_index: int,
    inputs: tuple,
    options: tuple,
    with_entropy: bool,
    cache: Any = None,
) -> tuple:
    """(logprob, entropy) from a `none` forward's outputs; saves what the backward reads
    (inputs, target, lse, entropy, then the logits cache when there is one)."""
    lse, logprob, entropy = _statistics(statistics, target, ignore_index, with_entropy)
    ctx.save_for_backward(*inputs, target, lse, entropy, *(() if cache is None else (cache,)))
    ctx.options = options
    ctx.with_entropy = with_entropy
    if not with_entropy:
        ctx.mark_non_differentiable(entropy)
    return logprob, entropy


class LogprobsFunction(torch.autograd.Function):
    # inputs: logits [N, V], target [N]; options: (ignore_index, softcap, logit_scale)
    # with_entropy: whether the entropy output carries a gradient (else it is skipped in the
    # backward and the entropy returned is a plain statistic).
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, options: tuple, with_entropy: bool):
        ignore_index, softcap, logit_scale = options
        outputs = ops.ce_forward(
            logits,
            target,
            None,
            None,
            ignore_index,
            "none",
            0.0,
            0.0,
            softcap,
            logit_scale,
            bool(with_entropy),
        )
        return _forward_outputs(
            ctx, outputs, target, ignore_index, (logits,), options, with_entropy
        )

    @staticmethod
    def backward(ctx: Any, grad_logprob: Tensor, grad_entropy: Tensor | None):
        logits, target, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        with torch.no_grad():
            grad = ops.ce_logprob_backward(
                logits,
                target,
                lse,
                entropy,
                grad_logprob,
                grad_entropy if ctx.with_entropy else None,
                *ctx.options,
            )
        (grad,) = _no_double_backward("xent.logprobs", (grad,))
        return grad, None, None, None


class LinearLogprobsFunction(torch.autograd.Function):
    # options: (ignore_index, softcap, logit_scale, workspace_bytes, fp32_logits)
    # wants: (hidden, weight, bias) gradients needed, decided by the caller from requires_grad.
    # cache_rows: the forward keeps the logits of rows [0, cache_rows) for the backward, which
    # recomputes only the others' (all rows: three products instead of four, N·V elements more;
    # 0: no cache). compute_dtype: as in LinearCrossEntropyFunction (the products
    # run on converted copies that live only inside each op; an fp32 weight's gradient is
    # accumulated in place in fp32). batch_invariant: the forward's pinned products
    # (docs/semantics.md §1); the backward is unchanged by it.
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        options: tuple,
        wants: tuple,
        with_entropy: bool,
        cache_rows: int,
        compute_dtype: torch.dtype,
        batch_invariant: bool = False,
    ):
        ignore_index = options[0]
        # No gradient in the forward: the upstream gradients are per row (docs/semantics.md §2, reduction
        # none), so the backward recomputes each chunk's logits (or reads the cache) and folds
        # them in.
        outputs = linear_none_forward(
            _compute_copies(compute_dtype, hidden, weight, bias),
            target,
            options,
            with_entropy,
            cache_rows,
            batch_invariant,
        )
        ctx.wants = wants
        ctx.compute_dtype = compute_dtype
        ctx.weight_grad_dtype = weight_grad_dtype(compute_dtype, weight)
        return _forward_outputs(
            ctx,
            outputs,
            target,
            ignore_index,
            (hidden, weight, bias),
            options,
            with_entropy,
            outputs[10] if cache_rows > 0 else None,
        )

    @staticmethod
    def backward(ctx: Any, grad_logprob: Tensor, grad_entropy: Tensor | None):
        none = (None,) * 7
        hidden, weight, bias, target, lse, entropy, *cache = ctx.saved_tensors
        with torch.no_grad():
            operands = _compute_copies(ctx.compute_dtype, hidden, weight, bias)
            result = ops.linear_logprob_backward(
                *operands,
                target,
                lse,
                entropy,
                grad_logprob,
                grad_entropy if ctx.with_entropy else None,
                *ctx.options,
                *ctx.wants,
                cache[0] if cache else None,
                ctx.weight_grad_dtype,
            )
        grads = tuple(g if w else None for g, w in zip(result, ctx.wants))
        grads = _no_double_backward("xent.linear_logprobs", grads)
        return tuple(grads) + none
