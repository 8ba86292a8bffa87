"""autograd.Function wrappers of the xent ops.

Every op takes 2-D inputs here; functional.py flattens (B, T, ...) and parses options. Options
travel as one tuple (positional, as the op schemas order them) so forward and backward cannot
disagree about them.

Gradients are first-order only: each backward is a single xent kernel, not something autograd
can differentiate again, so differentiating a gradient raises (see _no_double_backward).
"""

from __future__ import annotations

import torch

from xent._ops import ops


class _DoubleBackwardError(torch.autograd.Function):
    """Identity whose backward raises: marks gradients that must not be differentiated again."""

    @staticmethod
    def forward(ctx, name, anchor, *grads):
        # `anchor` is an input of the loss that requires grad: taking it makes autograd attach
        # this node to the returned gradients, so differentiating them reaches backward below.
        ctx.name = name
        return tuple(g.clone() for g in grads)

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(
            f"{ctx.name}: double backward is not supported: the gradient of this loss is computed "
            "by a fused kernel that autograd cannot differentiate again (it was called with "
            "create_graph=True and then differentiated)"
        )


def _no_double_backward(name, grads, inputs):
    """Returns `grads`, guarded against a second differentiation when the graph is being kept
    (create_graph=True). `inputs` are the loss's saved inputs."""
    if not torch.is_grad_enabled():
        return grads
    present = [g for g in grads if g is not None]
    anchor = next((t for t in inputs if t is not None and t.requires_grad), None)
    if not present or anchor is None:
        return grads
    guarded = iter(_DoubleBackwardError.apply(name, anchor, *present))
    return tuple(next(guarded) if g is not None else None for g in grads)


class CrossEntropyFunction(torch.autograd.Function):
    # inputs: logits [N, V], target [N], class_weight, row_weight, options tuple
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale)
    @staticmethod
    def forward(ctx, logits, target, class_weight, row_weight, options, with_stats):
        outputs = ops.ce_forward(logits, target, class_weight, row_weight, *options, with_stats)
        ctx.save_for_backward(logits, target, outputs[1], class_weight, row_weight)
        ctx.options = options
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        logits, target, lse, class_weight, row_weight = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            with torch.no_grad():
                grad = ops.ce_backward(logits, target, lse, grad_loss, class_weight, row_weight,
                                       *ctx.options)
            (grad,) = _no_double_backward("xent.cross_entropy", (grad,), (logits,))
        return grad, None, None, None, None, None


def _scale_saved(ctx, name, upstream):
    """The gradients formed in the forward (for an upstream gradient of 1), scaled in place by
    the scalar upstream gradient. In place because ∂W is as large as the weight (a second copy at
    the peak of the backward would cost V·H elements); the price is that this graph can be
    backpropagated once only, which is checked here rather than left to corrupt a second pass."""
    if ctx.scaled:
        raise RuntimeError(
            f"{name}: backward through this loss ran twice (retain_graph=True): with "
            "reduction 'sum' or 'mean' its gradient is formed in the forward and scaled in place "
            "by the first backward; pass grad_in_forward=False to recompute it in each backward")
    ctx.scaled = True
    *kept, anchor = ctx.saved_tensors
    with torch.no_grad():
        grads = tuple(g.mul_(upstream.to(g.dtype)) if g is not None else None for g in kept)
    return grads, (anchor,)


class LinearCrossEntropyFunction(torch.autograd.Function):
    # options: (ignore_index, reduction, label_smoothing, z_loss, softcap, logit_scale,
    #           workspace_bytes, fp32_logits)
    # wants: (hidden, weight, bias) gradients needed, decided by the caller from requires_grad.
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, row_weight, options, with_stats,
                wants, grad_in_forward, cache_logits):
        reduction = options[1]
        # sum/mean: the gradient for an upstream of 1 is formed in the same pass as the loss and
        # the backward only scales it (SPEC §2). none (or grad_in_forward=False): the backward
        # recomputes the chunk logits with the real upstream gradient, or reads them from the
        # [N, V] cache the forward filled when cache_logits (memory traded for one product).
        in_forward = grad_in_forward and reduction != "none" and any(wants)
        flags = wants if in_forward else (False, False, False)
        cache = cache_logits and not in_forward
        outputs = ops.linear_ce_forward(hidden, weight, bias, target, class_weight, row_weight,
                                        *options, with_stats, *flags, cache)
        stats, grads, logits_cache = outputs[:7], outputs[7:10], outputs[10]
        ctx.options = options
        ctx.wants = wants
        ctx.in_forward = in_forward
        ctx.scaled = False
        if in_forward:
            kept = [g if w else None for g, w in zip(grads, wants)]
            # The weight (a live parameter, so free to keep) anchors the double-backward guard.
            anchor = weight if wants[1] else hidden if wants[0] else bias
            ctx.save_for_backward(*kept, anchor)
        else:
            ctx.save_for_backward(hidden, weight, bias, target, stats[1], class_weight, row_weight,
                                  logits_cache if cache else None)
        ctx.mark_non_differentiable(*stats[1:])
        return stats

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        none = (None,) * 8
        if grad_loss is None:
            return (None, None, None) + none
        if ctx.in_forward:
            grads, anchors = _scale_saved(ctx, "xent.linear_cross_entropy", grad_loss)
        else:
            hidden, weight, bias, target, lse, class_weight, row_weight, cache = ctx.saved_tensors
            with torch.no_grad():
                result = ops.linear_ce_backward(hidden, weight, bias, target, lse, grad_loss,
                                                class_weight, row_weight, *ctx.options,
                                                *ctx.wants, cache)
            grads = tuple(g if w else None for g, w in zip(result, ctx.wants))
            anchors = (hidden, weight, bias)
        grads = _no_double_backward("xent.linear_cross_entropy", grads, anchors)
        return tuple(grads) + none


class DistillFunction(torch.autograd.Function):
    # options: (kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index,
    #           reduction, label_smoothing, z_loss)
    @staticmethod
    def forward(ctx, student, teacher, target, class_weight, options):
        loss = ops.distill_forward(student, teacher, target, class_weight, *options)
        ctx.save_for_backward(student, teacher, target, class_weight)
        ctx.options = options
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        student, teacher, target, class_weight = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            with torch.no_grad():
                grad = ops.distill_backward(student, teacher, target, grad_loss, class_weight,
                                            *ctx.options)
            (grad,) = _no_double_backward("xent.distill", (grad,), (student,))
        return grad, None, None, None, None


class LinearDistillFunction(torch.autograd.Function):
    # options: distill options + (workspace_bytes, fp32_logits); wants: (hidden, weight).
    @staticmethod
    def forward(ctx, student_hidden, student_weight, teacher_logits, teacher_hidden,
                teacher_weight, target, class_weight, options, wants, grad_in_forward):
        reduction = options[7]
        in_forward = grad_in_forward and reduction != "none" and any(wants)
        flags = wants if in_forward else (False, False)
        loss, grad_hidden, grad_weight = ops.linear_distill_forward(
            student_hidden, student_weight, teacher_logits, teacher_hidden, teacher_weight,
            target, class_weight, *options, *flags)
        ctx.options = options
        ctx.wants = wants
        ctx.in_forward = in_forward
        ctx.scaled = False
        if in_forward:
            anchor = student_weight if wants[1] else student_hidden
            ctx.save_for_backward(grad_hidden if wants[0] else None,
                                  grad_weight if wants[1] else None, anchor)
        else:
            ctx.save_for_backward(student_hidden, student_weight, teacher_logits, teacher_hidden,
                                  teacher_weight, target, class_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        none = (None,) * 8
        if grad_loss is None:
            return (None, None) + none
        if ctx.in_forward:
            grads, anchors = _scale_saved(ctx, "xent.linear_distill", grad_loss)
        else:
            saved = ctx.saved_tensors
            with torch.no_grad():
                result = ops.linear_distill_backward(*saved[:6], grad_loss, saved[6],
                                                     *ctx.options, *ctx.wants)
            grads = tuple(g if w else None for g, w in zip(result, ctx.wants))
            anchors = saved[:2]
        grads = _no_double_backward("xent.linear_distill", grads, anchors)
        return tuple(grads) + none
