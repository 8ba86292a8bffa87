"""Distillation from a teacher given as its top-k token ids and log-probabilities
(docs/semantics.md §3.1): xent.TopK and the autograd Function behind distill(teacher=TopK(...))."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from xent._autograd import _logits_backward, _normalized
from xent._ops import ops

Tensor = torch.Tensor

TOPK_MASSES = ("renormalize", "tail", "ignore")


class TopK(NamedTuple):
    """A teacher as its top-k: ids (N, k) / (B, T, k) integer token ids, -1 for an absent entry,
    and logprobs of the same shape, log P_t(id) under the teacher's whole distribution (float32
    or float64). mass says what becomes of the teacher's mass outside the ids: "renormalize"
    (both distributions restricted to the ids), "tail" (one more category for the rest) or
    "ignore" (forward_kl and soft_ce against the student's whole distribution)."""

    ids: Tensor
    logprobs: Tensor
    mass: str = "renormalize"


class DistillTopKFunction(torch.autograd.Function):
    # options: (topk_mass, kind, temperature, beta, softcap, soft_weight, hard_weight,
    #           ignore_index, reduction, label_smoothing, z_loss); mode "recompute" or "fused"
    #           (the gradient formed in the forward and scaled by the upstream scalar).
    @staticmethod
    def forward(
        ctx: Any,
        student: Tensor,
        ids: Tensor,
        logprobs: Tensor,
        target: Tensor | None,
        class_weight: Tensor | None,
        options: tuple,
        mode: str,
        grad_scale: Tensor | None,
    ):
        ctx.mode = mode
        ctx.scaled = False
        if mode == "recompute":
            loss = ops.distill_topk_forward(student, ids, logprobs, target, class_weight, *options)
            ctx.save_for_backward(student, ids, logprobs, target, class_weight)
            ctx.options = options
            return loss
        loss, grad = ops.distill_topk_forward_grad(
            student, ids, logprobs, target, class_weight, *options, grad_scale
        )
        ctx.save_for_backward(grad)
        (loss,) = _normalized((loss,), grad_scale)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor):
        grad = _logits_backward(
            ctx,
            "xent.distill",
            grad_loss,
            lambda student, ids, logprobs, target, class_weight: ops.distill_topk_backward(
                student, ids, logprobs, target, grad_loss, class_weight, *ctx.options
            ),
        )
        return grad, None, None, None, None, None, None, None


def topk_rows(function: str, teacher: Any, row_shape: tuple, fail: Any) -> tuple:
    """The teacher's ids and logprobs as (N, k) rows, checked against the student's rows."""
    if not isinstance(teacher, TopK):
        fail(
            function, "teacher", "is not a TopK", type(teacher).__name__, "xent.TopK(ids, logprobs)"
        )
    if teacher.mass not in TOPK_MASSES:
        fail(function, "teacher.mass", "unknown", teacher.mass, f"one of {TOPK_MASSES}")
    flat = []
    for name, tensor in (("teacher.ids", teacher.ids), ("teacher.logprobs", teacher.logprobs)):
        if not isinstance(tensor, torch.Tensor):
            fail(function, name, "is not a tensor", type(tensor).__name__, "a torch.Tensor")
        if tuple(tensor.shape[:-1]) != row_shape or tensor.dim() != len(row_shape) + 1:
            fail(
                function,
                name,
                "shape mismatch",
                tuple(tensor.shape),
                f"{row_shape} + (k,) (the rows of student_logits, k entries each)",
            )
        flat.append((tensor.flatten(0, 1) if tensor.dim() == 3 else tensor).detach())
    if flat[0].shape != flat[1].shape:
        fail(
            function,
            "teacher.logprobs",
            "shape mismatch",
            tuple(teacher.logprobs.shape),
            f"{tuple(teacher.ids.shape)} (the shape of teacher.ids)",
        )
    return flat[0], flat[1]
