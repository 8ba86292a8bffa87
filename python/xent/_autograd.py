"""autograd.Function wrappers of the xent ops.

Every op takes 2-D inputs here; functional.py flattens (B, T, ...) and parses options. Options
travel as one tuple (positional, as the op schemas order them) so forward and backward cannot
disagree about them.

Gradients are first-order only: each backward is a single xent kernel, not something autograd
can differentiate again, so differentiating a gradient raises (see _no_double_backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from xent._ops import ops


def _normalized(outputs: tuple, grad_scale: Tensor | None) -> tuple:
    """Loss outputs divided by the normalizer (grad_scale = 1/normalizer): the loss and, when
    present, its z-loss part (ce outputs: index 6), both reduced like the loss."""
    if grad_scale is None:
        return outputs
    outputs = list(outputs)
    for index in (0, 6):
        if index < len(outputs) and outputs[index].numel() > 0:
            outputs[index] = outputs[index] * grad_scale
    return tuple(outputs)


class _DoubleBackwardError(torch.autograd.Function):
    """Identity whose backward raises: marks gradients that must not be differentiated again."""

    @staticmethod
    def forward(ctx: Any, name: str, anchor: Tensor, *grads: tuple):
        # `anchor` requires grad: taking it makes autograd attach this node to the returned
        # gradients, so differentiating them reaches backward below.
        ctx.name = name
        return tuple(g.clone() for g in grads)

    @staticmethod
    def backward(ctx: Any, *unused: Any):
        raise RuntimeError(
            f"{ctx.name}: double backward is not supported: the gradient of this loss is computed "
            "by a fused kernel that autograd cannot differentiate again (it was called with "
            "create_graph=True and then differentiated)"
        )


def _no_double_backward(name: str, grads: tuple) -> tuple:
    """Returns `grads`, guarded against a second differentiation when the graph is being kept
    (create_graph=True): differentiating them again reaches _DoubleBackwardError and raises."""
    if not torch.is_grad_enabled():
        return grads
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    # Any tensor that requires grad makes autograd record the node; a fresh scalar leaf does, at
    # no cost, and keeps the loss's inputs (the N x V logits) out of the saved state.
    anchor = torch.zeros((), device=present[0].device, requires_grad=True)
    guarded = iter(_DoubleBackwardError.apply(name, anchor, *present))
    return tuple(next(guarded) if g is not None else None for g in grads)


def _scale_saved(ctx: Any, name: str) -> tuple:
    """The gradients formed in the forward (for an upstream gradient of 1, or 1/normalizer),
    scaled in place by the scalar upstream gradient on the device (xent::scale_ returns at once
    when it is exactly 1, the plain loss.backward(), without a host synchronisation). In place
    because they are as large as the logits or the weight (a second copy at the peak of the
    backward would cost that much again); the price is that this graph can be backpropagated
    once only, which is checked here rather than left to corrupt a second pass."""
    if ctx.scaled:
        raise RuntimeError(
            f"{name}: backward through this loss ran twice (retain_graph=True): with "
            "reduction 'sum' or 'mean' its gradient is formed in the forward and scaled in place "
            "by the first backward; pass grad_in_forward=False to recompute it in each backward"
        )
    ctx.scaled = True
    return ctx.saved_tensors


def _apply_upstream(grads: tuple, upstream: Any) -> tuple:
    with torch.no_grad():
        for g in grads:
            if g is not None and g.numel() > 0:
                ops.scale_(g, upstream.detach())
    return grads


def _logits_backward(ctx: Any, name: str, grad_loss: Any, recompute: Any) -> Any:
    """The gradient of a loss over logits: recompute(*saved tensors) in mode "recompute", else the
    one formed in the forward, scaled by the upstream gradient; guarded against double backward."""
    if not ctx.needs_input_grad[0] or grad_loss is None:
        return None
    if ctx.mode == "recompute":
        with torch.no_grad():
            grad = recompute(*ctx.saved_tensors)
    else:
        (grad,) = _apply_upstream(_scale_saved(ctx, name), grad_loss)
    (grad,) = _no_double_backward(name, (grad,))
    return grad


def _gradient_alias(logits: Tensor) -> Tensor:
    """The gradient written over `logits` (inplace_backward), as a tensor of its own sharing the
    storage. Returned by the backward as the logits themselves, it would be one more reference to
    the caller's tensor, and autograd's gradient accumulation copies a gradient it cannot take
    over: a full N x V copy (measured: the in-place form at 0.39-0.44 of copy bandwidth against
    0.64-0.78 without it). Saved, the alias is released before accumulation, which then keeps it
    as .grad without a copy."""
    return logits.detach()


def _mark_overwritten(ctx: Any, logits: Tensor) -> bool:
    """inplace_backward: `logits` now hold their gradient. A tensor with history is marked dirty,
    as PyTorch's in-place ops mark theirs: its version counter moves (an op that saved it before
    fails in backward) and it is returned as an output of the op, so that a later use whose
    gradient would flow through the overwritten values raises in backward instead of silently
    differentiating the gradient. A leaf's storage is meant to receive its own gradient (its
    .grad then shares it): only its version counter moves. True when `logits` is an output."""
    base = logits._base if logits._base is not None else logits
    if logits.requires_grad and not base.is_leaf:
        ctx.mark_dirty(logits)
        ctx.set_materialize_grads(False)
        return True
    torch.autograd.graph.increment_version(logits)
    return False


def _refuse_overwritten_use(function: str, grad: Tensor | None) -> None:
    """Raises when a gradient reaches the logits that inplace_backward overwrote."""
    if grad is not None:
        raise RuntimeError(
            f"{function}: the logits were overwritten by their gradient (inplace_backward=True) "
            "and then used in a computation being differentiated; use them before the call, "
            "or pass inplace_backward=False"
        )


class CrossEntropyFunction(torch.autograd.Function):
    # inputs: logits [N, V], target [N], class_weight, row_weight, options tuple
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale)
    # mode: "recompute" (forward only; the backward reads the logits again with the saved lse),
    # "fused" (the gradient formed in the forward pass into a new tensor; sum/mean only) or
    # "inplace" (fused, the gradient written over the logits). grad_scale: the upstream scalar the
    # fused gradient is formed for (1/normalizer), or None for 1.
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        class_weight: Tensor | None,
        row_weight: Tensor | None,
        options: tuple,
        with_stats: bool,
        mode: str,
        grad_scale: Tensor | None,
    ):
        ctx.mode = mode
        ctx.scaled = False
        if mode == "recompute":
            outputs = ops.ce_forward(logits, target, class_weight, row_weight, *options, with_stats)
            ctx.save_for_backward(logits, target, outputs[1], class_weight, row_weight)
            ctx.options = options
        else:
            if mode == "inplace":
                outputs = ops.ce_forward_grad_inplace(
                    logits, target, class_weight, row_weight, *options, with_stats, grad_scale
                )
                grad = _gradient_alias(logits)
                ctx.logits_output = _mark_overwritten(ctx, logits)
            else:
                *outputs, grad = ops.ce_forward_grad(
                    logits, target, class_weight, row_weight, *options, with_stats, grad_scale
                )
            ctx.save_for_backward(grad)
            outputs = _normalized(outputs, grad_scale)  # the gradient was formed for it
        ctx.mark_non_differentiable(*outputs[1:])
        if getattr(ctx, "logits_output", False):
            return (*outputs, logits)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *unused: Any):
        if getattr(ctx, "logits_output", False):
            _refuse_overwritten_use("xent.cross_entropy", unused[-1])
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            if ctx.mode == "recompute":
                logits, target, lse, class_weight, row_weight = ctx.saved_tensors
                with torch.no_grad():
                    grad = ops.ce_backward(
                        logits, target, lse, grad_loss, class_weight, row_weight, *ctx.options
                    )
            else:
                (grad,) = _apply_upstream(_scale_saved(ctx, "xent.cross_entropy"), grad_loss)
            (grad,) = _no_double_backward("xent.cross_entropy", (grad,))
        return grad, None, None, None, None, None, None, None


def _compute_copies(compute_dtype: torch.dtype, *tensors: Any) -> tuple:
    """The operands the products run on: `tensors` converted to compute_dtype (the autocast dtype
    for an fp32 master weight), or as they are. The copies live only inside the op."""
    if compute_dtype is None:
        return tensors
    return tuple(t.to(compute_dtype) if t is not None else None for t in tensors)


class LinearCrossEntropyFunction(torch.autograd.Function):
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
    #           workspace_bytes, fp32_logits)
    # wants: (hidden, weight, bias) gradients needed, decided by the caller from requires_grad.
    # compute_dtype: the dtype the products run in when it is not the weight's (an fp32 weight
    # under autocast, or with 16-bit hidden states): ∂W then goes straight into an fp32 gradient
    # (the core accumulates it in place, no accumulator). grad_scale: 1/normalizer or None.
    # accumulate_into: an fp32 (V, H) buffer ∂W is added into instead of returned (or None).
    # weight_grad_accumulation: "fp32" or "weight_dtype" (a 16-bit ∂W summed in its own dtype).
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
        with_stats: bool,
        wants: tuple,
        grad_in_forward: bool,
        cache_logits: bool,
        compute_dtype: torch.dtype,
        grad_scale: Tensor | None,
        accumulate_into: Tensor | None,
        weight_grad_accumulation: str = "fp32",
    ):
        reduction = options[1]
        # sum/mean: the gradient for an upstream of 1 (or 1/normalizer) is formed in the same
        # pass as the loss (docs/semantics.md §2) and the backward only scales it, on the device. none (or
        # grad_in_forward=False): the backward recomputes the chunk logits with the real upstream
        # gradient, or reads them from the [N, V] cache the forward filled when cache_logits
        # (memory traded for one product).
        in_forward = grad_in_forward and reduction != "none" and any(wants)
        flags = wants if in_forward else (False, False, False)
        cache = cache_logits and not in_forward
        weight_grad_dtype = (
            torch.float32 if compute_dtype is not None and weight.dtype == torch.float32 else None
        )
        # The buffer is kept on ctx, not saved: autograd's version check would reject it once a
        # later micro-batch's forward has added into it, which is the point of the buffer.
        ctx.accumulate_into = accumulate_into if wants[1] else None
        operands = _compute_copies(compute_dtype, hidden, weight, bias)
        outputs = ops.linear_ce_forward(
            *operands[:3],
            target,
            class_weight,
            row_weight,
            *options,
            with_stats,
            *flags,
            cache,
            grad_scale if in_forward else None,
            weight_grad_dtype,
            ctx.accumulate_into if in_forward else None,
            False,
            weight_grad_accumulation,
        )
        stats, grads, logits_cache = list(outputs[:7]), outputs[7:10], outputs[10]
        ctx.weight_grad_accumulation = weight_grad_accumulation
        ctx.options = options
        ctx.wants = wants
        ctx.returned = (wants[0], wants[1] and ctx.accumulate_into is None, wants[2])
        ctx.in_forward = in_forward
        ctx.compute_dtype = compute_dtype
        ctx.weight_grad_dtype = weight_grad_dtype
        ctx.scaled = False
        if in_forward:
            saved = [g if w else None for g, w in zip(grads, ctx.returned)]
            if ctx.accumulate_into is not None:  # what the correction of ∂W recomputes from
                saved += [
                    hidden,
                    weight,
                    bias,
                    target,
                    stats[1],
                    class_weight,
                    row_weight,
                    grad_scale,
                ]
            ctx.save_for_backward(*saved)
            stats = _normalized(stats, grad_scale)  # the gradients were formed for it
        else:
            ctx.save_for_backward(
                hidden,
                weight,
                bias,
                target,
                stats[1],
                class_weight,
                row_weight,
                logits_cache if cache else None,
            )
        ctx.mark_non_differentiable(*stats[1:])
        return tuple(stats)

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *unused: Any):
        none = (None,) * 12
        if grad_loss is None:
            return (None, None, None) + none
        if ctx.in_forward:
            saved = _scale_saved(ctx, "xent.linear_cross_entropy")
            grads = _apply_upstream(saved[:3], grad_loss)
            if ctx.accumulate_into is not None:
                # The forward added ∂W for an upstream of 1; the op adds (g - 1)·∂W (nothing
                # when g is exactly 1).
                hidden, weight, bias, target, lse, class_weight, row_weight, grad_scale = saved[3:]
                with torch.no_grad():
                    operands = _compute_copies(ctx.compute_dtype, hidden, weight, bias)
                    ops.linear_ce_accumulate_correction(
                        *operands,
                        target,
                        lse,
                        grad_loss,
                        grad_scale,
                        class_weight,
                        row_weight,
                        *ctx.options,
                        ctx.accumulate_into,
                    )
        else:
            hidden, weight, bias, target, lse, class_weight, row_weight, cache = ctx.saved_tensors
            with torch.no_grad():
                operands = _compute_copies(ctx.compute_dtype, hidden, weight, bias)
                result = ops.linear_ce_backward(
                    *operands,
                    target,
                    lse,
                    grad_loss,
                    class_weight,
                    row_weight,
                    *ctx.options,
                    *ctx.wants,
                    cache,
                    ctx.weight_grad_dtype,
                    ctx.accumulate_into,
                    ctx.weight_grad_accumulation,
                )
            grads = tuple(g if w else None for g, w in zip(result, ctx.returned))
        grads = _no_double_backward("xent.linear_cross_entropy", grads)
        return tuple(grads) + none


class DistillFunction(torch.autograd.Function):
    # options: (kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index,
    #           reduction, label_smoothing, z_loss); mode and grad_scale as CrossEntropyFunction.
    # vocab: the V' columns the student shares with a narrower teacher (docs/semantics.md §3.2),
    # read as a view with the student's row stride; None when the student has no other columns.
    @staticmethod
    def forward(
        ctx: Any,
        student: Tensor,
        teacher: Tensor,
        target: Tensor,
        class_weight: Tensor | None,
        options: tuple,
        mode: str,
        grad_scale: Tensor | None,
        vocab: int | None = None,
    ):
        ctx.mode = mode
        ctx.scaled = False
        ctx.padding = 0 if vocab is None else student.shape[-1] - vocab
        columns = student if vocab is None else student[:, :vocab]
        if mode == "recompute":
            loss = ops.distill_forward(columns, teacher, target, class_weight, *options)
            ctx.save_for_backward(columns, teacher, target, class_weight)
            ctx.options = options
        elif mode == "inplace":
            loss = ops.distill_forward_grad_inplace(
                columns, teacher, target, class_weight, *options, grad_scale
            )
            if ctx.padding:  # the rest of the gradient, in place too
                student[:, vocab:].zero_()
                ctx.padding = 0
            ctx.save_for_backward(_gradient_alias(student))
            ctx.logits_output = _mark_overwritten(ctx, student)
            (loss,) = _normalized((loss,), grad_scale)
            if ctx.logits_output:
                return loss, student
        else:
            loss, grad = ops.distill_forward_grad(
                columns, teacher, target, class_weight, *options, grad_scale
            )
            ctx.save_for_backward(grad)
            (loss,) = _normalized((loss,), grad_scale)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *overwritten: Any):
        if getattr(ctx, "logits_output", False):
            _refuse_overwritten_use("xent.distill", overwritten[0])
        grad = _logits_backward(
            ctx,
            "xent.distill",
            grad_loss,
            lambda student, teacher, target, class_weight: ops.distill_backward(
                student, teacher, target, grad_loss, class_weight, *ctx.options
            ),
        )
        if grad is not None and ctx.padding:  # columns past V' get exactly 0
            grad = torch.nn.functional.pad(grad, (0, ctx.padding))
        return grad, None, None, None, None, None, None, None


class LinearDistillFunction(torch.autograd.Function):
    # options: distill options + (workspace_bytes, fp32_logits); wants: (hidden, weight).
    @staticmethod
    def forward(
        ctx: Any,
        student_hidden: Tensor,
        student_weight: Tensor,
        teacher_logits: Tensor | None,
        teacher_hidden: Tensor | None,
        teacher_weight: Tensor | None,
        target: Tensor,
        class_weight: Tensor | None,
        options: tuple,
        wants: tuple,
        grad_in_forward: bool,
    ):
        reduction = options[7]
        in_forward = grad_in_forward and reduction != "none" and any(wants)
        flags = wants if in_forward else (False, False)
        loss, grad_hidden, grad_weight = ops.linear_distill_forward(
            student_hidden,
            student_weight,
            teacher_logits,
            teacher_hidden,
            teacher_weight,
            target,
            class_weight,
            *options,
            *flags,
        )
        ctx.options = options
        ctx.wants = wants
        ctx.in_forward = in_forward
        ctx.scaled = False
        if in_forward:
            ctx.save_for_backward(
                grad_hidden if wants[0] else None, grad_weight if wants[1] else None
            )
        else:
            ctx.save_for_backward(
                student_hidden,
                student_weight,
                teacher_logits,
                teacher_hidden,
                teacher_weight,
                target,
                class_weight,
            )
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor):
        none = (None,) * 8
        if grad_loss is None:
            return (None, None) + none
        if ctx.in_forward:
            grads = _apply_upstream(_scale_saved(ctx, "xent.linear_distill"), grad_loss)
        else:
            saved = ctx.saved_tensors
            with torch.no_grad():
                result = ops.linear_distill_backward(
                    *saved[:6], grad_loss, saved[6], *ctx.options, *ctx.wants
                )
            grads = tuple(g if w else None for g, w in zip(result, ctx.wants))
        grads = _no_double_backward("xent.linear_distill", grads)
        return tuple(grads) + none
