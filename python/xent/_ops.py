"""Loads the compiled torch ops (namespace ``xent``) and registers their fake implementations.

The fake (meta) implementations describe output shapes and dtypes only, so ``torch.compile``
traces through every op without a graph break and without running it.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from torch import Tensor


def _load_library() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = sorted(glob.glob(os.path.join(here, "_C*.so")))
    if not candidates:
        raise ImportError(
            f"xent: the compiled library (_C.so) is missing from {here}; build it with "
            "`pip install .` or `make test-python` (target xent_torch)"
        )
    torch.ops.load_library(candidates[0])


_load_library()
ops = torch.ops.xent

_register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract


def _result_dtype(like: torch.Tensor) -> torch.dtype:
    """float32 results, float64 for float64 inputs (as python/csrc result_dtype)."""
    return torch.float64 if like.dtype == torch.float64 else torch.float32


def _loss_like(like: torch.Tensor, reduction: str, rows: int) -> torch.Tensor:
    shape = (rows,) if reduction == "none" else ()
    return like.new_empty(shape, dtype=_result_dtype(like))


def _ce_outputs(like: torch.Tensor, rows: int, reduction: str, with_stats: bool) -> tuple:
    f32 = _result_dtype(like)
    stat_rows = rows if with_stats else 0
    return (
        _loss_like(like, reduction, rows),
        like.new_empty((rows,), dtype=f32),
        like.new_empty((stat_rows,), dtype=f32),
        like.new_empty((stat_rows,), dtype=f32),
        like.new_empty((stat_rows,), dtype=torch.int64),
        like.new_empty(() if with_stats else (0,), dtype=f32),
        _loss_like(like, reduction, rows) if with_stats else like.new_empty((0,), dtype=f32),
    )


@_register_fake("xent::ce_forward")
def _ce_forward_fake(
    logits: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
    with_stats: bool,
) -> tuple:
    return _ce_outputs(logits, logits.shape[0], reduction, with_stats)


@_register_fake("xent::ce_forward_grad")
def _ce_forward_grad_fake(
    logits: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
    with_stats: bool,
    grad_scale: Tensor | None,
) -> tuple:
    outputs = _ce_outputs(logits, logits.shape[0], reduction, with_stats)
    return outputs + (logits.new_empty(logits.shape),)


@_register_fake("xent::ce_forward_grad_inplace")
def _ce_forward_grad_inplace_fake(
    logits: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
    with_stats: bool,
    grad_scale: Tensor | None,
) -> tuple:
    return _ce_outputs(logits, logits.shape[0], reduction, with_stats)


@_register_fake("xent::scale_")
def _scale_fake(data: Tensor, factor: Tensor) -> None:
    return None


@_register_fake("xent::ce_backward")
def _ce_backward_fake(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    grad_output: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
) -> Tensor:
    return logits.new_empty(logits.shape)


@_register_fake("xent::linear_ce_forward")
def _linear_ce_forward_fake(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
    workspace_bytes: int | None,
    fp32_logits: bool,
    with_stats: bool,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    grad_bias: Tensor | None,
    cache_logits: bool,
    grad_scale: Tensor | None,
    weight_grad_dtype: torch.dtype | None,
    accumulate_into: Tensor | None = None,
    batch_invariant: bool = False,
    weight_grad_accumulation: str = "fp32",
    cache_rows: int = -1,
) -> tuple:
    grads = _linear_gradients(
        hidden,
        weight,
        bias,
        grad_hidden,
        grad_weight,
        grad_bias,
        weight_grad_dtype,
        accumulate_into,
    )
    cache_dtype = torch.float32 if fp32_logits else hidden.dtype
    rows = hidden.shape[0] if cache_rows < 0 else cache_rows
    cache_shape = (rows, weight.shape[0]) if cache_logits else (0,)
    cache = hidden.new_empty(cache_shape, dtype=cache_dtype if cache_logits else hidden.dtype)
    return _ce_outputs(hidden, hidden.shape[0], reduction, with_stats) + grads + (cache,)


def _linear_gradients(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    grad_bias: Tensor | None,
    weight_grad_dtype: torch.dtype | None = None,
    accumulate_into: Tensor | None = None,
) -> tuple:
    """The gradient outputs: empty [0] when not requested, and for the weight when its gradient
    is added into accumulate_into instead."""
    returned_weight = grad_weight and accumulate_into is None
    return (
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        weight.new_empty(weight.shape, dtype=weight_grad_dtype or weight.dtype)
        if returned_weight
        else weight.new_empty((0,)),
        bias.new_empty(bias.shape) if (grad_bias and bias is not None) else weight.new_empty((0,)),
    )


@_register_fake("xent::linear_ce_backward")
def _linear_ce_backward_fake(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    grad_output: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
    workspace_bytes: int | None,
    fp32_logits: bool,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    grad_bias: Tensor | None,
    logits_cache: Tensor | None,
    weight_grad_dtype: torch.dtype | None,
    accumulate_into: Tensor | None = None,
    weight_grad_accumulation: str = "fp32",
) -> tuple:
    return _linear_gradients(
        hidden,
        weight,
        bias,
        grad_hidden,
        grad_weight,
        grad_bias,
        weight_grad_dtype,
        accumulate_into,
    )


@_register_fake("xent::linear_ce_accumulate_correction")
def _linear_ce_accumulate_correction_fake(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    grad_loss: Tensor,
    grad_scale: Tensor | None,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
    workspace_bytes: int | None,
    fp32_logits: bool,
    accumulate_into: Tensor | None,
) -> None:
    return None


@_register_fake("xent::ce_logprob_backward")
def _ce_logprob_backward_fake(
    logits: Tensor,
    target: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    ignore_index: int,
    softcap: float | None,
    logit_scale: float,
) -> Tensor:
    return logits.new_empty(logits.shape)


@_register_fake("xent::linear_logprob_backward")
def _linear_logprob_backward_fake(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    ignore_index: int,
    softcap: float | None,
    logit_scale: float,
    workspace_bytes: int | None,
    fp32_logits: bool,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    grad_bias: Tensor | None,
    logits_cache: Tensor | None,
    weight_grad_dtype: torch.dtype | None,
) -> tuple:
    return _linear_gradients(
        hidden, weight, bias, grad_hidden, grad_weight, grad_bias, weight_grad_dtype
    )


@_register_fake("xent::linear_policy_forward")
def _linear_policy_forward_fake(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, *rest: Any, batch_invariant: bool = False
) -> tuple:
    # rest: target, the four per-token inputs, token_weight, the policy and chunk options, then
    # (grad_hidden, grad_weight, grad_bias, weight_grad_dtype), and batch_invariant when it comes
    # positionally (the only bool that can end rest).
    if rest and isinstance(rest[-1], bool):
        rest = rest[:-1]
    grad_hidden, grad_weight, grad_bias, weight_grad_dtype = rest[-4:]
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    rows = hidden.shape[0]
    results = (
        hidden.new_empty((), dtype=dtype),
        hidden.new_empty((rows,), dtype=dtype),
        hidden.new_empty((rows,), dtype=dtype),
        hidden.new_empty((4,), dtype=dtype),
    )
    gradients = _linear_gradients(
        hidden, weight, bias, grad_hidden, grad_weight, grad_bias, weight_grad_dtype
    )
    return results + gradients


@_register_fake("xent::distill_forward")
def _distill_forward_fake(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
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
) -> tuple:
    return _loss_like(student, reduction, student.shape[0])


@_register_fake("xent::distill_forward_grad")
def _distill_forward_grad_fake(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
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
    grad_scale: Tensor | None,
) -> tuple:
    loss = _loss_like(student, reduction, student.shape[0])
    return loss, student.new_empty(student.shape)


@_register_fake("xent::distill_forward_grad_inplace")
def _distill_forward_grad_inplace_fake(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
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
    grad_scale: Tensor | None,
) -> tuple:
    return _loss_like(student, reduction, student.shape[0])


@_register_fake("xent::distill_backward")
def _distill_backward_fake(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    grad_output: Tensor,
    class_weight: Tensor | None,
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
) -> Tensor:
    return student.new_empty(student.shape)


@_register_fake("xent::distill_topk_forward")
def _distill_topk_forward_fake(
    student: Tensor, ids: Tensor, logprobs: Tensor, target: Tensor | None, *options: Any
) -> Tensor:
    return _loss_like(student, options[9], student.shape[0])  # options[9]: reduction


@_register_fake("xent::distill_topk_forward_grad")
def _distill_topk_forward_grad_fake(
    student: Tensor, ids: Tensor, logprobs: Tensor, target: Tensor | None, *options: Any
) -> tuple:
    return _loss_like(student, options[9], student.shape[0]), student.new_empty(student.shape)


@_register_fake("xent::distill_topk_forward_grad_inplace")
def _distill_topk_forward_grad_inplace_fake(
    student: Tensor, ids: Tensor, logprobs: Tensor, target: Tensor | None, *options: Any
) -> Tensor:
    return _loss_like(student, options[9], student.shape[0])  # the gradient: over the student


@_register_fake("xent::distill_topk_backward")
def _distill_topk_backward_fake(student: Tensor, *arguments: Any) -> Tensor:
    return student.new_empty(student.shape)


def _student_gradients(
    hidden: Tensor, weight: Tensor, grad_hidden: Tensor | None, grad_weight: Tensor | None
) -> tuple:
    return (
        hidden.new_empty(hidden.shape if grad_hidden else (0,)),
        weight.new_empty(weight.shape if grad_weight else (0,)),
    )


@_register_fake("xent::linear_distill_forward")
def _linear_distill_forward_fake(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_logits: Tensor | None,
    teacher_hidden: Tensor | None,
    teacher_weight: Tensor | None,
    target: Tensor,
    class_weight: Tensor | None,
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
    workspace_bytes: int | None,
    fp32_logits: bool,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
) -> tuple:
    loss = _loss_like(student_hidden, reduction, student_hidden.shape[0])
    return (loss,) + _student_gradients(student_hidden, student_weight, grad_hidden, grad_weight)


@_register_fake("xent::linear_distill_backward")
def _linear_distill_backward_fake(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_logits: Tensor | None,
    teacher_hidden: Tensor | None,
    teacher_weight: Tensor | None,
    target: Tensor,
    grad_output: Tensor,
    class_weight: Tensor | None,
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
    workspace_bytes: int | None,
    fp32_logits: bool,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
) -> tuple:
    return _student_gradients(student_hidden, student_weight, grad_hidden, grad_weight)


@_register_fake("xent::check_errors")
def _check_errors_fake(device_tensor: Tensor) -> None:
    return None


# ---- vocabulary-parallel ce pieces (python/csrc/ops_shard.cpp, used by xent.distributed) -----

_CE_SHARD_STATS_WIDTH = 9  # kCeShardStatsWidth of include/xent/shard.hpp


@_register_fake("xent::ce_shard_stats")
def _ce_shard_stats_fake(
    logits: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
    vocab_offset: int,
    vocab: int,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
) -> Tensor:
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty((logits.shape[0], _CE_SHARD_STATS_WIDTH), dtype=dtype)


@_register_fake("xent::ce_shard_loss")
def _ce_shard_loss_fake(
    gathered: Tensor,
    target: Tensor,
    row_weight: Tensor | None,
    vocab: int,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
    with_stats: bool,
) -> tuple:
    rows = target.shape[0]
    outputs = _ce_outputs(gathered, rows, reduction, with_stats)
    lse = gathered.new_empty((rows if with_stats else 0,), dtype=_result_dtype(gathered))
    return (outputs[0], lse) + outputs[2:]


@_register_fake("xent::ce_shard_backward")
def _ce_shard_backward_fake(
    logits: Tensor,
    target: Tensor,
    gathered: Tensor,
    grad_output: Tensor,
    class_weight: Tensor | None,
    row_weight: Tensor | None,
    vocab_offset: int,
    vocab: int,
    first_row: int,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    logit_scale: float,
) -> Tensor:
    return logits.new_empty(logits.shape)


# ---- vocabulary-parallel distill pieces (python/csrc/ops_distill_shard.cpp) --------------------

_DISTILL_SHARD_STATS_WIDTH = 13  # kDistillShardStatsWidth of include/xent/distill_shard.hpp
_DISTILL_SHARD_SUMS_WIDTH = 5  # kDistillShardSumsWidth


@_register_fake("xent::distill_shard_stats")
def _distill_shard_stats_fake(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    class_weight: Tensor | None,
    vocab_offset: int,
    vocab: int,
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
) -> Tensor:
    return student.new_empty(
        (student.shape[0], _DISTILL_SHARD_STATS_WIDTH), dtype=_result_dtype(student)
    )


@_register_fake("xent::distill_shard_sums")
def _distill_shard_sums_fake(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    gathered: Tensor,
    vocab_offset: int,
    vocab: int,
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
) -> Tensor:
    return student.new_empty(
        (student.shape[0], _DISTILL_SHARD_SUMS_WIDTH), dtype=_result_dtype(student)
    )


@_register_fake("xent::distill_shard_loss")
def _distill_shard_loss_fake(
    gathered: Tensor,
    gathered_sums: Tensor | None,
    target: Tensor,
    rows: int,
    vocab: int,
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
) -> Tensor:
    return _loss_like(gathered, reduction, rows)


@_register_fake("xent::distill_shard_backward")
def _distill_shard_backward_fake(
    student: Tensor,
    teacher: Tensor,
    target: Tensor,
    gathered: Tensor,
    gathered_sums: Tensor | None,
    grad_output: Tensor,
    class_weight: Tensor | None,
    vocab_offset: int,
    vocab: int,
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
) -> Tensor:
    return student.new_empty(student.shape)
