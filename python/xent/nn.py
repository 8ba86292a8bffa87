"""Loss modules over xent.functional, with the argument order PyTorch users expect."""

from __future__ import annotations

from typing import Any

import torch

from xent import functional as F

Tensor = torch.Tensor

__all__ = [
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "DistillationLoss",
    "LinearDistillationLoss",
]


def _legacy_reduction(size_average: bool | None, reduce: bool | None, reduction: str) -> str:
    if size_average is None and reduce is None:
        return reduction
    from torch.nn import _reduction

    return _reduction.legacy_get_string(size_average, reduce)


class CrossEntropyLoss(torch.nn.Module):
    """Drop-in for torch.nn.CrossEntropyLoss on class-last logits (N, V) or (B, T, V).

    Same positional arguments (weight, size_average, ignore_index, reduce, reduction,
    label_smoothing), plus keyword-only z_loss, softcap and logit_scale. forward(input, target,
    row_weight=None).
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: float | None = None,
        logit_scale: float = 1.0,
    ):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = _legacy_reduction(size_average, reduce, reduction)
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale

    def forward(self, input: Tensor, target: Tensor, row_weight: Tensor | None = None) -> Any:
        return F.cross_entropy(
            input,
            target,
            self.weight,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            logit_scale=self.logit_scale,
            row_weight=row_weight,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
            f"softcap={self.softcap}, logit_scale={self.logit_scale}"
        )


class LinearCrossEntropyLoss(torch.nn.Module):
    """Fused LM head + cross-entropy: forward(input, weight, target, bias=None).

    input (N, H) or (B, T, H), weight (V, H) as F.linear takes them. The (N, V) logits are never
    held: work is chunked within workspace_bytes (default 512 MiB). weight_grad_accumulation as
    in xent.linear_cross_entropy ("fp32", or the opt-in "weight_dtype").
    """

    def __init__(
        self,
        class_weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: float | None = None,
        logit_scale: float = 1.0,
        workspace_bytes: int | None = None,
        fp32_logits: bool = False,
        grad_in_forward: bool = True,
        cache_logits: bool = False,
        weight_grad_accumulation: str = "fp32",
    ):
        super().__init__()
        self.register_buffer("class_weight", class_weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.workspace_bytes = workspace_bytes
        self.fp32_logits = fp32_logits
        self.grad_in_forward = grad_in_forward
        self.cache_logits = cache_logits
        self.weight_grad_accumulation = weight_grad_accumulation

    def forward(
        self,
        input: Tensor,
        weight: Tensor,
        target: Tensor,
        bias: Tensor | None = None,
        row_weight: Tensor | None = None,
        accumulate_into: Tensor | None = None,
    ) -> Any:
        """accumulate_into: an fp32 buffer the weight gradient is added into instead of
        weight.grad (Megatron's main_grad), as in xent.linear_cross_entropy."""
        return F.linear_cross_entropy(
            input,
            weight,
            target,
            bias,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            logit_scale=self.logit_scale,
            class_weight=self.class_weight,
            row_weight=row_weight,
            workspace_bytes=self.workspace_bytes,
            fp32_logits=self.fp32_logits,
            grad_in_forward=self.grad_in_forward,
            cache_logits=self.cache_logits,
            accumulate_into=accumulate_into,
            weight_grad_accumulation=self.weight_grad_accumulation,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, "
            f"softcap={self.softcap}, workspace_bytes={self.workspace_bytes}"
        )


class _DistillOptions(torch.nn.Module):
    def __init__(
        self,
        kind: str,
        temperature: float,
        beta: float,
        softcap: float | None,
        soft_weight: float,
        hard_weight: float,
        ignore_index: int,
        reduction: str,
        label_smoothing: float,
        z_loss: float,
        class_weight: Tensor | None,
        vocab_size: int | None,
    ):
        super().__init__()
        self.kind = kind
        self.temperature = temperature
        self.beta = beta
        self.softcap = softcap
        self.soft_weight = soft_weight
        self.hard_weight = hard_weight
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.vocab_size = vocab_size
        self.register_buffer("class_weight", class_weight)

    def _options(self) -> dict:
        return dict(
            kind=self.kind,
            temperature=self.temperature,
            beta=self.beta,
            softcap=self.softcap,
            soft_weight=self.soft_weight,
            hard_weight=self.hard_weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            class_weight=self.class_weight,
            vocab_size=self.vocab_size,
        )

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind!r}, temperature={self.temperature}, beta={self.beta}, "
            f"soft_weight={self.soft_weight}, hard_weight={self.hard_weight}, "
            f"reduction={self.reduction!r}, vocab_size={self.vocab_size}"
        )


class DistillationLoss(_DistillOptions):
    """Distillation between logits: forward(student_logits, teacher_logits, target=None).

    kind is one of forward_kl, reverse_kl, jsd, soft_ce, tvd (see xent.distill); vocab_size as in
    xent.distill, for student and teacher vocabularies of different sizes.
    """

    def __init__(
        self,
        kind: str = "forward_kl",
        temperature: float = 1.0,
        beta: float = 0.5,
        reduction: str = "mean",
        ignore_index: int = -100,
        *,
        softcap: float | None = None,
        soft_weight: float = 1.0,
        hard_weight: float = 0.0,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        class_weight: Tensor | None = None,
        vocab_size: int | None = None,
    ):
        super().__init__(
            kind,
            temperature,
            beta,
            softcap,
            soft_weight,
            hard_weight,
            ignore_index,
            reduction,
            label_smoothing,
            z_loss,
            class_weight,
            vocab_size,
        )

    def forward(
        self, student_logits: Tensor, teacher_logits: Tensor, target: Tensor | None = None
    ) -> Tensor:
        return F.distill(student_logits, teacher_logits, target, **self._options())


class LinearDistillationLoss(_DistillOptions):
    """Fused student head + distillation.

    forward(student_input, student_weight, teacher_logits=None, target=None, *,
    teacher_input=None, teacher_weight=None): the teacher as logits, or as hidden states and
    its head weight (then its logits are computed chunk by chunk too). vocab_size as in
    xent.linear_distill.
    """

    def __init__(
        self,
        kind: str = "forward_kl",
        temperature: float = 1.0,
        beta: float = 0.5,
        reduction: str = "mean",
        ignore_index: int = -100,
        *,
        softcap: float | None = None,
        soft_weight: float = 1.0,
        hard_weight: float = 0.0,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        class_weight: Tensor | None = None,
        vocab_size: int | None = None,
        workspace_bytes: int | None = None,
        fp32_logits: bool = False,
        grad_in_forward: bool = True,
    ):
        super().__init__(
            kind,
            temperature,
            beta,
            softcap,
            soft_weight,
            hard_weight,
            ignore_index,
            reduction,
            label_smoothing,
            z_loss,
            class_weight,
            vocab_size,
        )
        self.workspace_bytes = workspace_bytes
        self.fp32_logits = fp32_logits
        self.grad_in_forward = grad_in_forward

    def forward(
        self,
        student_input: Tensor,
        student_weight: Tensor,
        teacher_logits: Tensor | None = None,
        target: Tensor | None = None,
        *,
        teacher_input: Tensor | None = None,
        teacher_weight: Tensor | None = None,
    ) -> Tensor:
        return F.linear_distill(
            student_input,
            student_weight,
            teacher_logits,
            target,
            teacher_hidden=teacher_input,
            teacher_weight=teacher_weight,
            workspace_bytes=self.workspace_bytes,
            fp32_logits=self.fp32_logits,
            grad_in_forward=self.grad_in_forward,
            **self._options(),
        )
