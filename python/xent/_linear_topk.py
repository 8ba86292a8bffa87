"""linear_distill with a top-k teacher (docs/semantics.md §3.1, §4): the student's logits formed a
row chunk at a time inside the workspace budget and handed to the top-k row math of distill.

This is the composite form: each chunk's h·Wᵀ is one product, the top-k distill op runs on it, and
the backward forms the chunk again (recompute) before ∂h = G·W and ∂W += Gᵀ·h: four products.
With grad_in_forward (sum, mean) the gradient is formed in the forward instead: three products.
The C++ core (one op on every backend, errors in src/api) is not built yet."""

from __future__ import annotations

from typing import Any

import torch

from xent._autograd import _apply_upstream, _no_double_backward, _scale_saved
from xent._ops import ops

Tensor = torch.Tensor
_NAME = "xent.linear_distill"


def _chunk_rows(hidden: Tensor, weight: Tensor, budget: int, fp32: bool) -> int:
    """Rows a chunk: its logits and their gradient (fp32 with fp32_logits) in the budget. All rows
    in one chunk where they fit, with no ∂W accumulator (its one product writes ∂W); else the
    16-bit weight gradient's fp32 accumulator is counted first when the budget holds it (as
    linear_ce counts it)."""
    element = 4 if fp32 else hidden.element_size()
    row_bytes = max(1, 2 * weight.shape[0] * element)
    if budget // row_bytes >= hidden.shape[0]:
        return max(1, hidden.shape[0])
    accumulator = weight.numel() * 4 if weight.element_size() < 4 else 0
    if budget > 2 * accumulator:
        budget -= accumulator
    return max(1, min(hidden.shape[0], budget // row_bytes))


def _mean_as_sum(
    options: tuple, rows: int, target: Tensor | None, class_weight: Tensor | None
) -> tuple:
    """§1/§3's mean as a sum over chunks: the soft weight over N_valid, the hard weight over D
    (Σ_valid r_n) and z_loss rescaled so that its part keeps the divisor N_valid."""
    kind, temperature, beta, softcap, soft, hard, ignore, _, smoothing, z = options
    valid = None if target is None else target != ignore
    n_valid = float(rows) if valid is None else float(valid.sum())  # no target: every row
    if target is not None and class_weight is not None:
        safe = torch.where(valid, target, torch.zeros_like(target))
        divisor = float((class_weight.double()[safe] * valid).sum())
    else:
        divisor = n_valid
    soft_scale = 0.0 if not n_valid else 1.0 / n_valid
    hard_scale = 0.0 if not divisor else 1.0 / divisor
    z_scaled = z * divisor / n_valid if divisor and n_valid else z
    return (
        kind,
        temperature,
        beta,
        softcap,
        soft * soft_scale,
        hard * hard_scale,
        ignore,
        "sum",
        smoothing,
        z_scaled,
    )


class LinearDistillTopKFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, logprobs, target, class_weight, options, budget, fp32):
        rows = _chunk_rows(hidden, weight, budget, fp32)
        reduction = options[8]  # the mass first
        total = None
        parts = []
        for _, logits, chunk in _chunks(hidden, weight, ids, logprobs, target, rows, fp32):
            loss = ops.distill_topk_forward(logits, *chunk, class_weight, *options)
            if reduction == "none":
                parts.append(loss)
            else:
                total = loss if total is None else total + loss
        if reduction == "none":
            out = torch.cat(parts) if parts else hidden.new_zeros((0,), dtype=torch.float32)
        else:
            out = total if total is not None else hidden.new_zeros((), dtype=torch.float32)
        ctx.save_for_backward(hidden, weight, ids, logprobs, target, class_weight)
        ctx.options, ctx.rows, ctx.fp32 = options, rows, fp32
        return out

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, ids, logprobs, target, class_weight = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grads = _WeightGradient(weight, hidden.shape[0], ctx.rows) if want_w else None
        none = ctx.options[8] == "none"
        chunks = _chunks(hidden, weight, ids, logprobs, target, ctx.rows, ctx.fp32)
        for piece, logits, chunk in chunks:
            upstream = grad_loss[piece].contiguous() if none else grad_loss
            grad = ops.distill_topk_backward(logits, *chunk, upstream, class_weight, *ctx.options)
            _accumulate(grad.to(hidden.dtype), hidden[piece], weight, piece, grad_h, grads)
        grad_w = grads.result() if want_w else None
        return grad_h, grad_w, None, None, None, None, None, None, None


class LinearDistillTopKFusedFunction(torch.autograd.Function):
    """sum / mean with the gradient formed in the forward (three products, as linear_ce): each
    chunk's logits, their gradient at upstream 1, ∂h = G·W and ∂W += Gᵀ·h; the backward scales
    both by the upstream scalar, so a graph supports one backward (docs/semantics.md §4)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, logprobs, target, class_weight, options, budget, fp32):
        rows = _chunk_rows(hidden, weight, budget, fp32)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grads = _WeightGradient(weight, hidden.shape[0], rows) if want_w else None
        total = None
        for piece, logits, chunk in _chunks(hidden, weight, ids, logprobs, target, rows, fp32):
            # The gradient written over the chunk's logits (a buffer of this function's own).
            loss = ops.distill_topk_forward_grad_inplace(
                logits, *chunk, class_weight, *options, None
            )
            total = loss if total is None else total + loss
            _accumulate(logits.to(hidden.dtype), hidden[piece], weight, piece, grad_h, grads)
        ctx.save_for_backward(grad_h, grads.result() if want_w else None)
        ctx.scaled = False
        return total if total is not None else hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_loss):
        # Scaled in place on the device (nothing when the upstream is exactly 1), as linear_ce's
        # gradients formed in the forward are; a second backward is refused.
        grads = _apply_upstream(_scale_saved(ctx, _NAME), grad_loss)
        grad_h, grad_w = _no_double_backward(_NAME, tuple(grads))
        return grad_h, grad_w, *([None] * 7)


class _WeightGradient:
    """∂W over the row chunks: one chunk's product written straight in the weight's dtype (one
    rounding, no accumulator); several chunks summed in an fp32 (float64 for a float64 weight)
    accumulator, each chunk's product added in place, rounded to the weight's dtype at the end."""

    def __init__(self, weight: Tensor, rows: int, chunk_rows: int):
        self.weight = weight
        self.sums = None
        if rows > chunk_rows:
            dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
            self.sums = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        self.value = None

    def add(self, grad: Tensor, h: Tensor) -> None:
        if self.sums is None:
            self.value = grad.t() @ h
        else:
            self.sums.add_(grad.t() @ h)

    def result(self) -> Tensor:
        if self.sums is not None:
            return self.sums.to(self.weight.dtype)
        return self.value if self.value is not None else torch.zeros_like(self.weight)


def _accumulate(grad, h, weight, piece, grad_h, grads) -> None:
    if grad_h is not None:
        torch.matmul(grad, weight, out=grad_h[piece])
    if grads is not None:
        grads.add(grad, h)


def _chunks(hidden, weight, ids, logprobs, target, rows, fp32):
    """Each row chunk: its slice, its logits h·Wᵀ and its (ids, logprobs, target)."""
    for start in range(0, hidden.shape[0], rows):
        piece = slice(start, start + rows)
        chunk = (ids[piece], logprobs[piece], None if target is None else target[piece])
        yield piece, _logits(hidden[piece], weight, fp32), chunk


def _logits(hidden: Tensor, weight: Tensor, fp32: bool) -> Tensor:
    if fp32 and hidden.dtype in (torch.bfloat16, torch.float16):
        return (hidden.float() @ weight.float().t()).contiguous()
    return (hidden @ weight.t()).contiguous()


def linear_distill_topk(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    logprobs: Tensor,
    target: Tensor | None,
    class_weight: Tensor | None,
    mass: str,
    options: tuple,
    budget: int,
    fp32: bool,
    wants: Any,
    grad_in_forward: bool,
) -> Tensor:
    """options as _distill_options gives them; the loss of distill(h·Wᵀ, teacher=TopK) in one
    call. mean runs as a sum with the divisors folded into the weights (see _mean_as_sum)."""
    if options[7] == "mean":
        options = _mean_as_sum(options, hidden.shape[0], target, class_weight)
    topk_options = (mass, *options)
    if any(wants):
        fused = grad_in_forward and topk_options[8] != "none"
        function = LinearDistillTopKFusedFunction if fused else LinearDistillTopKFunction
        return function.apply(
            hidden, weight, ids, logprobs, target, class_weight, topk_options, budget, fp32
        )
    with torch.no_grad():
        return LinearDistillTopKFunction.forward(
            _NoCtx(),
            hidden,
            weight,
            ids,
            logprobs,
            target,
            class_weight,
            topk_options,
            budget,
            fp32,
        )


class _NoCtx:
    def save_for_backward(self, *tensors: Any) -> None:
        pass
