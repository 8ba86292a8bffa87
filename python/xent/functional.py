"""The functional API: losses over logits, and fused forms over (hidden, weight).

Shapes: logits (N, V) or (B, T, V) with the vocabulary last; target (N,) or (B, T); hidden
(N, H) or (B, T, H). Per-row results (reduction="none", statistics) come back shaped like target.
Losses are float32 whatever the input dtype (the kernels do their math in float32, as
F.cross_entropy under autocast does), except for float64 inputs on the CPU: float64 math and
float64 losses, so torch.autograd.gradcheck works at its default tolerances; gradients come back
in each input's dtype.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from xent._autograd import (
    CrossEntropyFunction,
    DistillFunction,
    LinearCrossEntropyFunction,
    LinearDistillFunction,
)
from xent._ops import ops

Tensor = torch.Tensor

__all__ = [
    "CrossEntropyResult",
    "cross_entropy",
    "linear_cross_entropy",
    "distill",
    "linear_distill",
    "DISTILL_KINDS",
]

DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd")
_REDUCTIONS = ("none", "sum", "mean")

# XENT_VALIDATE=1: after every op on a CUDA tensor, synchronise and raise what the kernels flagged
# (out-of-range targets), as the CPU backend does at once. Off by default: it costs a sync.
_VALIDATE = os.environ.get("XENT_VALIDATE", "0") not in ("", "0")


def _validated(result, like: Tensor):
    if _VALIDATE and like.is_cuda:
        ops.check_errors(like)
    return result


class CrossEntropyResult(NamedTuple):
    """What cross_entropy / linear_cross_entropy return when asked for statistics.

    Per-row fields are shaped like target; ignored rows hold 0 (argmax: -1).
    """

    loss: Tensor
    lse: Tensor  # log-sum-exp of the (scaled, softcapped) logits
    logprob: Tensor  # log-probability of the target
    entropy: Tensor  # entropy of the predicted distribution
    argmax: Tensor  # predicted class (int64)
    accuracy: Tensor  # fraction of valid rows whose argmax is the target
    z_loss: Tensor  # the z-loss part of the loss alone, reduced like the loss (no gradient)


def _fail(function: str, argument: str, problem: str, got, expected: str):
    raise ValueError(f"{function}: {argument} {problem}: got {got}; expected {expected}")


def _check_reduction(function: str, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        _fail(function, "reduction", "unknown", repr(reduction), "one of 'none', 'sum', 'mean'")


def _check_tensor(function: str, argument: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        _fail(function, argument, "is not a tensor", type(value).__name__, "a torch.Tensor")


def _rows(function: str, argument: str, tensor: Tensor, target: Optional[Tensor],
          target_name: str = "target"):
    """Flattens (B, T, X) to (B*T, X) and the target to (B*T,); returns them and the row shape."""
    _check_tensor(function, argument, tensor)
    if tensor.dim() not in (2, 3):
        _fail(function, argument, "rank unsupported", f"{tensor.dim()}-D {tuple(tensor.shape)}",
              "2-D (N, X) or 3-D (B, T, X)")
    row_shape = tuple(tensor.shape[:-1])
    if target is not None:
        _check_tensor(function, target_name, target)
        if tuple(target.shape) != row_shape:
            _fail(function, target_name, "shape mismatch", tuple(target.shape),
                  f"{row_shape} (the leading dimensions of {argument})")
        target = target.reshape(-1)
    # flatten, not reshape(-1, X): it stays a view whenever it can and handles X = 0 (which the
    # core then reports by name).
    return (tensor.flatten(0, 1) if tensor.dim() == 3 else tensor), target, row_shape


def _row_weight(function: str, row_weight: Optional[Tensor], row_shape) -> Optional[Tensor]:
    if row_weight is None:
        return None
    _check_tensor(function, "row_weight", row_weight)
    if tuple(row_weight.shape) != row_shape:
        _fail(function, "row_weight", "shape mismatch", tuple(row_weight.shape),
              f"{row_shape} (one weight per row)")
    return row_weight.reshape(-1).float()


def _class_weight(function: str, weight: Optional[Tensor], class_weight: Optional[Tensor]):
    if weight is not None and class_weight is not None:
        _fail(function, "class_weight", "given twice", "both weight and class_weight",
              "one of them (weight is the F.cross_entropy name)")
    chosen = class_weight if class_weight is not None else weight
    if chosen is not None:
        _check_tensor(function, "class_weight", chosen)
        chosen = chosen.float()
    return chosen


def _reshape_rows(value: Tensor, row_shape) -> Tensor:
    return value.reshape(row_shape) if value.dim() == 1 else value


def _result(outputs, reduction: str, row_shape, with_stats: bool):
    loss = _reshape_rows(outputs[0], row_shape) if reduction == "none" else outputs[0]
    if not with_stats:
        return loss
    _, lse, logprob, entropy, argmax, accuracy, z_loss = outputs
    z_loss = _reshape_rows(z_loss, row_shape) if reduction == "none" else z_loss
    return CrossEntropyResult(loss, _reshape_rows(lse, row_shape),
                              _reshape_rows(logprob, row_shape),
                              _reshape_rows(entropy, row_shape),
                              _reshape_rows(argmax, row_shape), accuracy, z_loss)


def _autocast_dtype(tensor: Tensor) -> Optional[torch.dtype]:
    """The autocast dtype active for tensor's device, or None (torch >= 2.4 API first)."""
    device_type = tensor.device.type
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except (TypeError, AttributeError):  # torch < 2.4: per-device functions
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if device_type == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        return None


def _needs_grad(*tensors) -> tuple:
    enabled = torch.is_grad_enabled()
    return tuple(bool(enabled and t is not None and t.requires_grad) for t in tensors)


def cross_entropy(logits: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, z_loss: float = 0.0,
                  softcap: Optional[float] = None, logit_scale: float = 1.0,
                  class_weight: Optional[Tensor] = None, row_weight: Optional[Tensor] = None,
                  return_stats: bool = False):
    """Cross-entropy of logits (N, V) or (B, T, V) against integer targets.

    Drop-in for F.cross_entropy on class-last logits (``weight`` is the per-class weight, also
    accepted as ``class_weight``), plus z-loss (z_loss * lse**2), softcapping
    (softcap * tanh(x / softcap)), logit_scale (x * logit_scale first) and per-row weights.
    With return_stats=True returns a CrossEntropyResult with lse, logprob, entropy, argmax,
    accuracy and the z-loss part, computed in the same pass.
    """
    function = "cross_entropy"
    _check_reduction(function, reduction)
    logits2d, target1d, row_shape = _rows(function, "logits", logits, target)
    row_weight1d = _row_weight(function, row_weight, row_shape)
    class_weight = _class_weight(function, weight, class_weight)
    options = (int(ignore_index), reduction, float(label_smoothing), float(z_loss),
               None if softcap is None else float(softcap), float(logit_scale))
    if _needs_grad(logits)[0]:
        outputs = CrossEntropyFunction.apply(logits2d, target1d, class_weight, row_weight1d,
                                             options, bool(return_stats))
    else:
        outputs = ops.ce_forward(logits2d, target1d, class_weight, row_weight1d, *options,
                                 bool(return_stats))
    return _validated(_result(outputs, reduction, row_shape, return_stats), logits)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                         bias: Optional[Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0, *,
                         z_loss: float = 0.0, softcap: Optional[float] = None,
                         logit_scale: float = 1.0, class_weight: Optional[Tensor] = None,
                         row_weight: Optional[Tensor] = None,
                         workspace_bytes: Optional[int] = None, fp32_logits: bool = False,
                         grad_in_forward: bool = True, cache_logits: bool = False,
                         return_stats: bool = False):
    """cross_entropy(hidden @ weight.T + bias, target) without ever holding the (N, V) logits.

    hidden (N, H) or (B, T, H); weight (V, H) as in nn.Linear; bias (V,) or None. The work is
    chunked so that its scratch memory stays within workspace_bytes (default 512 MiB). Logits
    chunks are rounded to the input dtype before the softmax, as F.cross_entropy(h @ W.T) sees
    them, unless fp32_logits=True. Under autocast, hidden/weight/bias are cast to the autocast
    dtype first, as F.linear would be.

    With reduction "sum"/"mean" the gradients are formed in the forward pass (one pass over the
    vocabulary instead of two) and the backward scales them in place, so the graph supports one
    backward; grad_in_forward=False recomputes them in the backward instead (several backward
    passes, retain_graph, gradcheck). reduction "none" always recomputes with the per-row
    upstream gradient; cache_logits=True keeps the (N, V) logits from the forward for that
    backward instead (one product less, N·V elements more: opt-in).
    """
    function = "linear_cross_entropy"
    _check_reduction(function, reduction)
    _check_tensor(function, "weight", weight)
    hidden2d, target1d, row_shape = _rows(function, "hidden", hidden, target)
    row_weight1d = _row_weight(function, row_weight, row_shape)
    class_weight = _class_weight(function, None, class_weight)
    autocast = _autocast_dtype(hidden2d)
    if autocast is not None:
        hidden2d, weight = hidden2d.to(autocast), weight.to(autocast)
        bias = bias.to(autocast) if bias is not None else None
    budget = 0 if workspace_bytes is None else int(workspace_bytes)
    if workspace_bytes is not None and budget <= 0:
        _fail(function, "workspace_bytes", "out of range", workspace_bytes, "a positive size")
    options = (int(ignore_index), reduction, float(label_smoothing), float(z_loss),
               None if softcap is None else float(softcap), float(logit_scale), budget,
               bool(fp32_logits))
    wants = _needs_grad(hidden2d, weight, bias)
    if any(wants):
        outputs = LinearCrossEntropyFunction.apply(hidden2d, weight, bias, target1d, class_weight,
                                                   row_weight1d, options, bool(return_stats),
                                                   wants, bool(grad_in_forward),
                                                   bool(cache_logits))
    else:
        outputs = ops.linear_ce_forward(hidden2d, weight, bias, target1d, class_weight,
                                        row_weight1d, *options, bool(return_stats), False, False,
                                        False, False)[:7]
    return _validated(_result(outputs, reduction, row_shape, return_stats), hidden)


def _distill_options(function: str, kind: str, temperature: float, beta: float,
                     softcap: Optional[float], soft_weight: float, hard_weight: float,
                     ignore_index: int, reduction: str, label_smoothing: float, z_loss: float):
    _check_reduction(function, reduction)
    if kind not in DISTILL_KINDS:
        _fail(function, "kind", "unknown", repr(kind), "one of " + ", ".join(DISTILL_KINDS))
    return (kind, float(temperature), float(beta), None if softcap is None else float(softcap),
            float(soft_weight), float(hard_weight), int(ignore_index), reduction,
            float(label_smoothing), float(z_loss))


def distill(student_logits: Tensor, teacher_logits: Tensor, target: Optional[Tensor] = None, *,
            kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5,
            softcap: Optional[float] = None, soft_weight: float = 1.0, hard_weight: float = 0.0,
            ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
            z_loss: float = 0.0, class_weight: Optional[Tensor] = None) -> Tensor:
    """Distillation loss between student and teacher logits (N, V) or (B, T, V).

    kind: forward_kl KL(p_t||p_s), reverse_kl KL(p_s||p_t), jsd (mixing weight beta), soft_ce,
    tvd. Both distributions at temperature T; softcap (if set) applies to both before T. Rows
    whose target equals ignore_index are skipped; without target every row counts. mean is the
    sum over valid rows divided by their number ("batchmean" over tokens). With hard_weight > 0
    the loss is hard_weight * CE(student, target) + soft_weight * distill; label_smoothing,
    z_loss and class_weight configure that CE term. The teacher gets no gradient.
    """
    function = "distill"
    student2d, target1d, row_shape = _rows(function, "student_logits", student_logits, target)
    _check_tensor(function, "teacher_logits", teacher_logits)
    if tuple(teacher_logits.shape) != tuple(student_logits.shape):
        _fail(function, "teacher_logits", "shape mismatch", tuple(teacher_logits.shape),
              f"{tuple(student_logits.shape)} (the shape of student_logits)")
    teacher2d = (teacher_logits.flatten(0, 1) if teacher_logits.dim() == 3
                 else teacher_logits).detach()
    options = _distill_options(function, kind, temperature, beta, softcap, soft_weight,
                               hard_weight, ignore_index, reduction, label_smoothing, z_loss)
    class_weight = _class_weight(function, None, class_weight)
    if _needs_grad(student2d)[0]:
        loss = DistillFunction.apply(student2d, teacher2d, target1d, class_weight, options)
    else:
        loss = ops.distill_forward(student2d, teacher2d, target1d, class_weight, *options)
    return _validated(_reshape_rows(loss, row_shape) if reduction == "none" else loss,
                      student_logits)


def linear_distill(student_hidden: Tensor, student_weight: Tensor,
                   teacher_logits: Optional[Tensor] = None, target: Optional[Tensor] = None, *,
                   teacher_hidden: Optional[Tensor] = None,
                   teacher_weight: Optional[Tensor] = None, kind: str = "forward_kl",
                   temperature: float = 1.0, beta: float = 0.5, softcap: Optional[float] = None,
                   soft_weight: float = 1.0, hard_weight: float = 0.0, ignore_index: int = -100,
                   reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                   class_weight: Optional[Tensor] = None, workspace_bytes: Optional[int] = None,
                   fp32_logits: bool = False, grad_in_forward: bool = True) -> Tensor:
    """distill(student_hidden @ student_weight.T, teacher, target) without (N, V) logits.

    The teacher is either teacher_logits (N, V) / (B, T, V), or teacher_hidden (N, H_t) with
    teacher_weight (V, H_t), whose logits are computed chunk by chunk too. Gradients flow to the
    student hidden states and weight only. grad_in_forward as in linear_cross_entropy.
    """
    function = "linear_distill"
    _check_tensor(function, "student_weight", student_weight)
    hidden2d, target1d, row_shape = _rows(function, "student_hidden", student_hidden, target)
    teacher_logits2d = teacher_hidden2d = None
    if teacher_logits is not None:
        _check_tensor(function, "teacher_logits", teacher_logits)
        teacher_logits2d = (teacher_logits.flatten(0, 1) if teacher_logits.dim() == 3
                            else teacher_logits).detach()
    if teacher_hidden is not None:
        _check_tensor(function, "teacher_hidden", teacher_hidden)
        teacher_hidden2d = (teacher_hidden.flatten(0, 1) if teacher_hidden.dim() == 3
                            else teacher_hidden).detach()
    if teacher_weight is not None:
        teacher_weight = teacher_weight.detach()
    options = _distill_options(function, kind, temperature, beta, softcap, soft_weight,
                               hard_weight, ignore_index, reduction, label_smoothing, z_loss)
    class_weight = _class_weight(function, None, class_weight)
    autocast = _autocast_dtype(hidden2d)
    if autocast is not None:
        hidden2d, student_weight = hidden2d.to(autocast), student_weight.to(autocast)
        if teacher_logits2d is not None:  # the core takes student and teacher in one dtype
            teacher_logits2d = teacher_logits2d.to(autocast)
        if teacher_hidden2d is not None:
            teacher_hidden2d = teacher_hidden2d.to(autocast)
        if teacher_weight is not None:
            teacher_weight = teacher_weight.to(autocast)
    budget = 0 if workspace_bytes is None else int(workspace_bytes)
    if workspace_bytes is not None and budget <= 0:
        _fail(function, "workspace_bytes", "out of range", workspace_bytes, "a positive size")
    options = options + (budget, bool(fp32_logits))
    wants = _needs_grad(hidden2d, student_weight)
    teacher = (teacher_logits2d, teacher_hidden2d, teacher_weight)
    if any(wants):
        loss = LinearDistillFunction.apply(hidden2d, student_weight, *teacher, target1d,
                                           class_weight, options, wants, bool(grad_in_forward))
    else:
        loss = ops.linear_distill_forward(hidden2d, student_weight, *teacher, target1d,
                                          class_weight, *options, False, False)[0]
    return _validated(_reshape_rows(loss, row_shape) if reduction == "none" else loss,
                      student_hidden)
