"""The functional API: losses over logits, and fused forms over (hidden, weight).

Shapes: logits (N, V) or (B, T, V) with the vocabulary last; target (N,) or (B, T); hidden
(N, H) or (B, T, H). Per-row results (reduction="none", statistics) come back shaped like target.
Losses are float32 whatever the input dtype (the kernels do their math in float32, as
F.cross_entropy under autocast does), except for float64 inputs on the CPU: float64 math and
float64 losses, so torch.autograd.gradcheck works at its default tolerances; gradients come back
in each input's dtype.
"""

from __future__ import annotations

import math
import operator
import os
from typing import Any, NamedTuple, NoReturn

import torch

from xent import _dtensor
from xent import distributed as _distributed
from xent._autograd import (
    CrossEntropyFunction,
    DistillFunction,
    LinearCrossEntropyFunction,
    LinearDistillFunction,
    _compute_copies,
    _normalized,
)
from xent._errors import python_names
from xent._linear_policy import linear_policy_loss
from xent._linear_topk import linear_distill_topk
from xent._logprobs import (
    DEFAULT_LOGPROBS_CACHE_BYTES,
    LinearLogprobsFunction,
    LogprobsFunction,
    _statistics,
    linear_none_forward,
    logits_cache_rows,
)
from xent._ops import ops
from xent._policy import (
    KL_ESTIMATORS,
    POLICY_AGGREGATIONS,
    POLICY_LOSS_TYPES,
    PolicyLossResult,
    policy_loss,
)
from xent._topk import TOPK_MASSES, DistillTopKFunction, TopK, topk_rows

Tensor = torch.Tensor

__all__ = [
    "CrossEntropyResult",
    "cross_entropy",
    "linear_cross_entropy",
    "distill",
    "linear_distill",
    "DISTILL_KINDS",
    "TopK",
    "TOPK_MASSES",
    "default_workspace_bytes",
    "logprobs",
    "linear_logprobs",
    "linear_policy_loss",
    "policy_loss",
    "PolicyLossResult",
    "POLICY_LOSS_TYPES",
    "POLICY_AGGREGATIONS",
    "KL_ESTIMATORS",
]

DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd")
_REDUCTIONS = ("none", "sum", "mean")

# XENT_VALIDATE=1: after every op on a CUDA tensor, synchronise and raise what the kernels flagged
# (out-of-range targets), as the CPU backend does at once. Off by default: it costs a sync.
_VALIDATE = os.environ.get("XENT_VALIDATE", "0") not in ("", "0")


def _validated(result: Any, like: Tensor) -> Any:
    if _VALIDATE and like.is_cuda:
        ops.check_errors(like)
    return result


# Outputs of the ce ops: loss, lse, logprob, entropy, argmax, accuracy, z-loss value.
CE_OUTPUTS = 7


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


def _fail(function: str, argument: str, problem: str, got: Any, expected: str) -> NoReturn:
    raise ValueError(f"{function}: {argument} {problem}: got {got}; expected {expected}")


def _check_reduction(function: str, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        _fail(function, "reduction", "unknown", repr(reduction), "one of 'none', 'sum', 'mean'")


def _check_tensor(function: str, argument: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        _fail(function, argument, "is not a tensor", type(value).__name__, "a torch.Tensor")


def _check_flag(function: str, argument: str, value: Any) -> None:
    # A promise such as batch_invariant must not be set by a truthy tensor or string by mistake.
    if not isinstance(value, bool):
        _fail(function, argument, "is not a bool", type(value).__name__, "True or False")


def _rows(
    function: str, argument: str, tensor: Tensor, target: Tensor | None, target_name: str = "target"
) -> tuple:
    """Flattens (B, T, X) to (B*T, X) and the target to (B*T,); returns them and the row shape."""
    _check_tensor(function, argument, tensor)
    if tensor.dim() not in (2, 3):
        _fail(
            function,
            argument,
            "rank unsupported",
            f"{tensor.dim()}-D {tuple(tensor.shape)}",
            "2-D (N, X) or 3-D (B, T, X)",
        )
    row_shape = tuple(tensor.shape[:-1])
    if target is not None:
        _check_tensor(function, target_name, target)
        if tuple(target.shape) != row_shape:
            _fail(
                function,
                target_name,
                "shape mismatch",
                tuple(target.shape),
                f"{row_shape} (the leading dimensions of {argument})",
            )
        target = target.reshape(-1)
    # flatten, not reshape(-1, X): it stays a view whenever it can and handles X = 0 (which the
    # core then reports by name).
    return (tensor.flatten(0, 1) if tensor.dim() == 3 else tensor), target, row_shape


def _row_weight(function: str, row_weight: Tensor | None, row_shape: tuple) -> Tensor | None:
    if row_weight is None:
        return None
    _check_tensor(function, "row_weight", row_weight)
    if tuple(row_weight.shape) != row_shape:
        _fail(
            function,
            "row_weight",
            "shape mismatch",
            tuple(row_weight.shape),
            f"{row_shape} (one weight per row)",
        )
    return row_weight.reshape(-1).float()


def _class_weight(
    function: str, weight: Tensor | None, class_weight: Tensor | None
) -> Tensor | None:
    if weight is not None and class_weight is not None:
        _fail(
            function,
            "class_weight",
            "given twice",
            "both weight and class_weight",
            "one of them (weight is the F.cross_entropy name)",
        )
    chosen = class_weight if class_weight is not None else weight
    if chosen is not None:
        _check_tensor(function, "class_weight", chosen)
        chosen = chosen.float()
    return chosen


def _reshape_rows(value: Tensor, row_shape: tuple) -> Tensor:
    return value.reshape(row_shape) if value.dim() == 1 else value


def _result(outputs: tuple, reduction: str, row_shape: tuple, with_stats: bool) -> Any:
    loss = _reshape_rows(outputs[0], row_shape) if reduction == "none" else outputs[0]
    if not with_stats:
        return loss
    _, lse, logprob, entropy, argmax, accuracy, z_loss = outputs
    z_loss = _reshape_rows(z_loss, row_shape) if reduction == "none" else z_loss
    return CrossEntropyResult(
        loss,
        _reshape_rows(lse, row_shape),
        _reshape_rows(logprob, row_shape),
        _reshape_rows(entropy, row_shape),
        _reshape_rows(argmax, row_shape),
        accuracy,
        z_loss,
    )


def _autocast_dtype(tensor: Tensor) -> torch.dtype | None:
    """The autocast dtype active for tensor's device, or None (torch >= 2.4 API first)."""
    device_type = tensor.device.type
    if device_type == "meta":  # shape inference only (fake kernels): no autocast state there
        return None
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


def _needs_grad(*tensors: Any) -> tuple:
    enabled = torch.is_grad_enabled()
    return tuple(bool(enabled and t is not None and t.requires_grad) for t in tensors)


def _fused_mode(
    function: str, reduction: str, grad_in_forward: bool, inplace_backward: bool
) -> str:
    """How an autograd Function over logits forms its gradient (see CrossEntropyFunction)."""
    if inplace_backward and reduction == "none":
        _fail(
            function,
            "inplace_backward",
            "unsupported with reduction 'none'",
            True,
            "reduction 'sum' or 'mean' (with 'none' the gradient needs the per-row upstream "
            "gradient, which only the backward has)",
        )
    if reduction == "none" or not grad_in_forward:
        if inplace_backward:
            _fail(
                function,
                "inplace_backward",
                "needs grad_in_forward",
                True,
                "grad_in_forward=True (the in-place gradient is formed in the forward)",
            )
        return "recompute"
    return "inplace" if inplace_backward else "fused"


def _check_in_place_rows(
    function: str,
    argument: str,
    rows: Tensor,
    remedy: str = "inplace_backward=False writes the gradient to a new tensor instead",
) -> None:
    """The op writes a gradient into `rows` (inplace_backward, accumulate_into): they must be
    readable as they are (contiguous columns, ordered rows), since a copy would take the gradient
    instead. `remedy` ends the message: what the caller can do instead."""
    readable = (
        rows.dim() == 2
        and (rows.stride(1) == 1 or rows.size(1) <= 1)
        and (rows.stride(0) >= rows.size(1) or rows.size(0) <= 1)
    )
    if not readable:
        _fail(
            function,
            argument,
            "cannot take the gradient in place",
            f"a tensor of shape {tuple(rows.shape)} and strides {rows.stride()}",
            f"2-D rows with contiguous columns ({remedy})",
        )


def _grad_scale(
    function: str, normalizer: float | Tensor | None, reduction: str, like: Tensor
) -> Tensor | None:
    """1/normalizer as an fp32 scalar on like's device (never read on the host), or None."""
    if normalizer is None:
        return None
    if reduction != "sum":
        _fail(
            function,
            "normalizer",
            "needs reduction 'sum'",
            repr(reduction),
            "reduction='sum' (normalizer divides the summed loss, as training code divides by "
            "the number of items in the batch)",
        )
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            _fail(
                function,
                "normalizer",
                "is not a scalar",
                tuple(normalizer.shape),
                "a number or a one-element tensor",
            )
        return (1.0 / normalizer.detach().to(device=like.device, dtype=torch.float32)).reshape(())
    if not isinstance(normalizer, (int, float)) or not math.isfinite(normalizer) or normalizer <= 0:
        _fail(
            function,
            "normalizer",
            "out of range",
            normalizer,
            "a positive finite number or a scalar tensor",
        )
    # A fill kernel, not a host-to-device copy: no synchronisation.
    return torch.full((), 1.0 / float(normalizer), dtype=torch.float32, device=like.device)


_MIB = 1 << 20
_GIB = 1 << 30


def default_workspace_bytes(device: torch.device) -> int:
    """The workspace budget linear_cross_entropy / linear_distill use when none is given.

    GPU: min(4 GiB, total / 8), at least 1 GiB, where total is the device's total memory (a
    property of the device, never what is free): the plan of a call, and so its speed and its
    rounding, then depend only on its shapes, dtypes, options and device, not on what else
    happens to be allocated. At that budget the 16-bit weight gradient's fp32 accumulator
    (V x H x 4 bytes: 2 GiB at 128256 x 4096) fits beside the chunks and the three-product
    schedule runs; an fp32 weight gradient (accumulated in place, no accumulator) gets the same
    budget. The budget is not checked against free memory: where that much is not free, pass
    workspace_bytes (e.g. 256 MiB) to trade speed for memory. CPU: 512 MiB.
    """
    if device.type != "cuda":
        return 512 * _MIB
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_default_budget(index)


@torch.compiler.assume_constant_result
def _cuda_default_budget(index: int) -> int:
    # A device property, so torch.compile may fold it into the graph as a constant.
    total = torch.cuda.get_device_properties(index).total_memory
    return int(max(min(4 * _GIB, total // 8), _GIB))


def _workspace_budget(function: str, workspace_bytes: int | None, hidden: Tensor) -> int:
    if workspace_bytes is None:
        return default_workspace_bytes(hidden.device)
    budget = int(workspace_bytes)
    if budget <= 0:
        _fail(function, "workspace_bytes", "out of range", workspace_bytes, "a positive size")
    return budget


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype | None:
    """The dtype the products run in when the op must convert its operands: the autocast dtype,
    or the 16-bit dtype of the hidden states beside an fp32 weight; None otherwise."""
    autocast = _autocast_dtype(hidden)
    if autocast is not None:
        return autocast
    if weight.dtype == torch.float32 and hidden.dtype in (torch.bfloat16, torch.float16):
        return hidden.dtype
    return None


@python_names
def cross_entropy(
    logits: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    class_weight: Tensor | None = None,
    row_weight: Tensor | None = None,
    return_stats: bool = False,
    grad_in_forward: bool = True,
    inplace_backward: bool = False,
    normalizer: float | Tensor | None = None,
    process_group: Any = None,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
) -> Tensor | CrossEntropyResult:
    """Cross-entropy of logits (N, V) or (B, T, V) against integer targets.

    Drop-in for F.cross_entropy on class-last logits (``weight`` is the per-class weight, also
    accepted as ``class_weight``), plus z-loss (z_loss * lse**2), softcapping
    (softcap * tanh(x / softcap)), logit_scale (x * logit_scale first) and per-row weights.
    With return_stats=True returns a CrossEntropyResult with lse, logprob, entropy, argmax,
    accuracy and the z-loss part, computed in the same pass.

    Gradient (when logits require grad): with reduction "sum"/"mean" it is formed in the forward
    pass, in the same read of the logits as the loss (one read, one write), and the backward only
    applies the upstream scalar, on the device: nothing at all for loss.backward(), one
    read + write otherwise. The graph then supports one backward (retain_graph raises);
    grad_in_forward=False forms it in the backward instead (a second read of the logits, any
    number of backward passes, gradcheck). reduction "none" always forms it in the backward from
    the saved row statistics (one read + one write there). In 16-bit inputs the forward-formed
    gradient is rounded once for an upstream of 1 (and exactly scaled by a power of two); any
    other upstream scalar rounds it a second time, about twice the rounding error of
    grad_in_forward=False.

    inplace_backward=True writes the gradient over the logits in the forward pass: no N x V
    memory is added, and the logits are gone after the call (their values are the gradient).
    Use it only when nothing else reads the logits afterwards (not another loss, not a saved
    activation of the op that produced them, such as a softcap written in torch).

    normalizer (with reduction="sum"): a number or a scalar tensor the summed loss is divided by
    inside the op, as Hugging Face divides by num_items_in_batch. The gradient is formed for it in
    the forward, so the upstream gradient stays 1 and the backward moves no bytes; dividing the
    returned sum yourself gives the same values at the cost of a pass over the gradient.

    With process_group, logits (and class_weight) are this rank's vocabulary slice: see
    xent.distributed (vocab_offset / vocab_size: the slice's first id and the global V).
    """
    if _dtensor.any_dtensor(logits, target, weight, class_weight, row_weight):  # _dtensor.py
        return _dtensor.call(cross_entropy, "cross_entropy", locals())
    function = "cross_entropy"
    _check_reduction(function, reduction)
    logits2d, target1d, row_shape = _rows(function, "logits", logits, target)
    row_weight1d = _row_weight(function, row_weight, row_shape)
    class_weight = _class_weight(function, weight, class_weight)
    options = (
        int(ignore_index),
        reduction,
        float(label_smoothing),
        float(z_loss),
        None if softcap is None else float(softcap),
        float(logit_scale),
    )
    mode = _fused_mode(function, reduction, grad_in_forward, inplace_backward)
    grad_scale = _grad_scale(function, normalizer, reduction, logits)
    if mode == "inplace":
        _check_in_place_rows(function, "logits", logits2d)
    if process_group is not None:  # vocabulary-parallel (docs/semantics.md §5)
        mode = "recompute"  # the sharded form has its own passes (xent.distributed)
        outputs = _distributed.cross_entropy(
            logits2d,
            target1d,
            class_weight,
            row_weight1d,
            options,
            bool(return_stats),
            process_group=process_group,
            vocab_offset=vocab_offset,
            vocab_size=vocab_size,
        )
    elif _needs_grad(logits)[0]:
        outputs = CrossEntropyFunction.apply(
            logits2d,
            target1d,
            class_weight,
            row_weight1d,
            options,
            bool(return_stats),
            mode,
            grad_scale,
        )
        # inplace_backward on logits with history: the overwritten logits come back last
        # (_autograd._mark_overwritten); they are the caller's tensor, rebased, not a result.
        outputs = outputs[:CE_OUTPUTS]
    else:
        outputs = ops.ce_forward(
            logits2d, target1d, class_weight, row_weight1d, *options, bool(return_stats)
        )
    if mode == "recompute" or not _needs_grad(logits)[0]:
        outputs = _normalized(outputs, grad_scale)  # autograd carries 1/normalizer backward
    return _validated(_result(outputs, reduction, row_shape, return_stats), logits)


@python_names
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    class_weight: Tensor | None = None,
    row_weight: Tensor | None = None,
    workspace_bytes: int | None = None,
    fp32_logits: bool = False,
    grad_in_forward: bool = True,
    cache_logits: bool = False,
    return_stats: bool = False,
    normalizer: float | Tensor | None = None,
    process_group: Any = None,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
    accumulate_into: Tensor | None = None,
    weight_grad_accumulation: str = "fp32",
) -> Tensor | CrossEntropyResult:
    """cross_entropy(hidden @ weight.T + bias, target) without ever holding the (N, V) logits.

    hidden (N, H) or (B, T, H); weight (V, H) as in nn.Linear; bias (V,) or None. The work is
    chunked so that its scratch memory stays within workspace_bytes. Its default depends on the
    device (see default_workspace_bytes): on a GPU, enough for the fast three-product schedule
    with the fp32 accumulator of a 16-bit weight's gradient, min(4 GiB, total / 8) and at least
    1 GiB of the device's total memory, never a figure read from free memory (an fp32 weight
    gradient, which is accumulated in place, gets the same budget for its row chunks); 512 MiB
    on the CPU.
    Logits chunks are rounded to the input dtype before the softmax, as F.cross_entropy(h @ W.T)
    sees them, unless fp32_logits=True.

    Mixed precision: under autocast the products run in the autocast dtype, as F.linear's would;
    an fp32 weight (a master weight, the Hugging Face Trainer's bf16 default) is converted inside
    the op only (the copy is gone when it returns) and its gradient is accumulated in place in
    an fp32 tensor, with no accumulator and no 16-bit copy of it. The same holds for an fp32
    weight with bf16/fp16 hidden states outside autocast.

    With reduction "sum"/"mean" the gradients are formed in the forward pass (one pass over the
    vocabulary instead of two) and the backward scales them in place, so the graph supports one
    backward; grad_in_forward=False recomputes them in the backward instead (several backward
    passes, retain_graph, gradcheck). reduction "none" always recomputes with the per-row
    upstream gradient; cache_logits=True keeps the (N, V) logits from the forward for that
    backward instead (one product less, N·V elements more: opt-in). normalizer as in
    cross_entropy (with reduction="sum": the sum divided inside the op, e.g. by the number of
    items in the batch, so the backward moves no bytes).
    With process_group, weight/bias are this rank's vocabulary rows of the LM head: see
    xent.distributed (reduce_hidden_grad=False leaves ∂hidden partial for a tensor-parallel layer).

    accumulate_into: a float32 (V, H) tensor on the weight's device (float64 for a float64
    weight) that the weight gradient is ADDED into, never overwritten, as Megatron's main_grad:
    the autograd gradient of weight is then None (weight.grad stays untouched), for any weight
    dtype, with no fp32 accumulator and no separate gradient. Nothing is added while the weight
    does not require grad. With reduction "sum"/"mean" (grad_in_forward) the forward adds the
    gradient for an upstream gradient of 1, so the buffer changes during the forward (also for a
    loss that is then never backpropagated: compute such losses under torch.no_grad); the backward
    then reads the upstream g on the host (one small synchronisation per step) and, when g is
    not exactly 1, adds (g - 1) times the gradient by a second pass that recomputes the logits.
    Keep g at 1 under gradient accumulation by passing normalizer= (or reduction="mean") instead
    of dividing the loss; loss scaling (fp16) makes every step pay that pass, and so does a
    backward captured into a CUDA graph, where nothing can be read (it always adds (g - 1) times
    the gradient). With reduction "none" or grad_in_forward=False the backward adds the gradient
    of the real upstream. Not with process_group.

    weight_grad_accumulation: how a 16-bit weight gradient is summed over the row chunks.
    "fp32" (the default): in fp32, rounded once at the end (on a GPU a (V, H) fp32 accumulator
    inside workspace_bytes, or a slower schedule where the budget cannot hold it). "weight_dtype"
    (opt-in): each chunk's product is added straight into the 16-bit gradient, fp32 math inside
    the product and one rounding per chunk: no accumulator, so small budgets keep the fast
    three-product schedule, at a weight-gradient error that grows with the number of chunks K
    (about sqrt(K) to K roundings of the dtype; docs/semantics.md §2). No effect on an fp32 weight
    gradient (an fp32 weight, accumulate_into), which is summed in place. Not with process_group.
    """
    if _dtensor.any_dtensor(hidden, weight, bias, target, class_weight, row_weight):
        return _dtensor.call(linear_cross_entropy, "linear_cross_entropy", locals())
    function = "linear_cross_entropy"
    _check_reduction(function, reduction)
    _check_tensor(function, "weight", weight)
    hidden2d, target1d, row_shape = _rows(function, "hidden", hidden, target)
    row_weight1d = _row_weight(function, row_weight, row_shape)
    class_weight = _class_weight(function, None, class_weight)
    compute_dtype = _compute_dtype(hidden2d, weight)
    wants = _needs_grad(hidden2d, weight, bias)
    budget = _workspace_budget(function, workspace_bytes, hidden2d)
    options = (
        int(ignore_index),
        reduction,
        float(label_smoothing),
        float(z_loss),
        None if softcap is None else float(softcap),
        float(logit_scale),
        budget,
        bool(fp32_logits),
    )
    grad_scale = _grad_scale(function, normalizer, reduction, hidden)
    if accumulate_into is not None:
        accumulate_into = _gradient_buffer(function, accumulate_into, weight, process_group)
    _check_weight_grad_accumulation(function, weight_grad_accumulation, process_group)
    in_forward = False
    if process_group is not None:  # vocabulary-parallel (docs/semantics.md §5)
        outputs = _distributed.linear_cross_entropy(
            *_compute_copies(compute_dtype, hidden2d, weight, bias),
            target1d,
            class_weight,
            row_weight1d,
            options[:6],
            bool(return_stats),
            wants,
            process_group=process_group,
            workspace_bytes=budget,
            fp32_logits=bool(fp32_logits),
            vocab_offset=vocab_offset,
            vocab_size=vocab_size,
            reduce_hidden_grad=bool(reduce_hidden_grad),
            cache_logits=bool(cache_logits),
            grad_in_forward=bool(grad_in_forward),
        )
    elif any(wants):
        outputs = LinearCrossEntropyFunction.apply(
            hidden2d,
            weight,
            bias,
            target1d,
            class_weight,
            row_weight1d,
            options,
            bool(return_stats),
            wants,
            bool(grad_in_forward),
            bool(cache_logits),
            compute_dtype,
            grad_scale,
            accumulate_into,
            weight_grad_accumulation,
        )
        in_forward = grad_in_forward and reduction != "none"
    else:
        operands = _compute_copies(compute_dtype, hidden2d, weight, bias)
        outputs = ops.linear_ce_forward(
            *operands,
            target1d,
            class_weight,
            row_weight1d,
            *options,
            bool(return_stats),
            False,
            False,
            False,
            False,
            None,
            None,
        )[:7]
        in_forward = False
    if not in_forward:
        outputs = _normalized(outputs, grad_scale)  # autograd carries 1/normalizer backward
    return _validated(_result(outputs, reduction, row_shape, return_stats), hidden)


_WEIGHT_GRAD_ACCUMULATIONS = ("fp32", "weight_dtype")


def _check_weight_grad_accumulation(function: str, value: Any, process_group: Any) -> None:
    if not isinstance(value, str) or value not in _WEIGHT_GRAD_ACCUMULATIONS:
        _fail(
            function,
            "weight_grad_accumulation",
            "unknown",
            repr(value),
            "one of 'fp32', 'weight_dtype'",
        )
    if value != "fp32" and process_group is not None:
        _fail(
            function,
            "weight_grad_accumulation",
            "unsupported with process_group",
            repr(value),
            "'fp32' (the vocabulary-parallel form accumulates in fp32)",
        )


def _gradient_buffer(
    function: str, buffer: Tensor | None, weight: Tensor, process_group: Any
) -> Tensor:
    """accumulate_into checked as the core will use it: float32 (float64 for a float64 weight),
    weight's shape and device, and rows the core reads where they are (a copy would take the
    gradient and be dropped). Detached: it is written under no autograd."""
    _check_tensor(function, "accumulate_into", buffer)
    if process_group is not None:
        _fail(
            function,
            "accumulate_into",
            "unsupported with process_group",
            "both",
            "one of them (the vocabulary-parallel form returns weight.grad)",
        )
    expected = torch.float64 if weight.dtype == torch.float64 else torch.float32
    if buffer.dtype != expected:
        _fail(
            function,
            "accumulate_into",
            "has wrong dtype",
            buffer.dtype,
            f"{expected} (the gradient is added in fp32 whatever the weight dtype; float64 "
            "for a float64 weight)",
        )
    if tuple(buffer.shape) != tuple(weight.shape):
        _fail(
            function,
            "accumulate_into",
            "shape mismatch",
            tuple(buffer.shape),
            f"{tuple(weight.shape)} (the shape of weight)",
        )
    if buffer.device != weight.device:
        _fail(
            function,
            "accumulate_into",
            "is on another device",
            buffer.device,
            f"{weight.device} (the device of weight)",
        )
    _check_in_place_rows(
        function,
        "accumulate_into",
        buffer,
        "the gradient is added where the buffer is: a contiguous one",
    )
    return buffer.detach()


def _distill_options(
    function: str,
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
    _check_reduction(function, reduction)
    if kind not in DISTILL_KINDS:
        _fail(function, "kind", "unknown", repr(kind), "one of " + ", ".join(DISTILL_KINDS))
    return (
        kind,
        float(temperature),
        float(beta),
        None if softcap is None else float(softcap),
        float(soft_weight),
        float(hard_weight),
        int(ignore_index),
        reduction,
        float(label_smoothing),
        float(z_loss),
    )


def _shared_vocab(function: str, vocab_size: Any, widths: dict) -> int | None:
    """vocab_size = V' of student and teacher vocabularies of different sizes (docs/semantics.md
    §3.2): checked against every operand's width; None without it."""
    if vocab_size is None:
        return None
    try:  # ints of any kind (numpy's too), not bools or floats
        if isinstance(vocab_size, bool):
            raise TypeError
        vocab_size = operator.index(vocab_size)
    except TypeError:
        _fail(function, "vocab_size", "is not an int", type(vocab_size).__name__, "an int or None")
    narrowest = min(widths.values())
    if not 1 <= vocab_size <= narrowest:
        names = " and ".join(f"{name} ({width})" for name, width in widths.items())
        _fail(
            function,
            "vocab_size",
            "out of range",
            vocab_size,
            f"1 <= vocab_size <= {narrowest}, the narrower width of {names}",
        )
    return vocab_size


def _shared_class_weight(class_weight: Tensor | None, shared: int | None, width: int) -> Any:
    """A class_weight of the student's width read for the V' shared columns only (a view)."""
    if not isinstance(class_weight, torch.Tensor) or shared is None or class_weight.dim() != 1:
        return class_weight
    return class_weight[:shared] if class_weight.shape[0] == width else class_weight


def _width_mismatch(function: str, argument: str, got: Any, expected: str) -> NoReturn:
    """Student and teacher widths differ without vocab_size."""
    _fail(
        function,
        argument,
        "shape mismatch",
        got,
        f"{expected}, or vocab_size= naming the part both vocabularies share when they "
        "differ in size (docs/semantics.md §3.2)",
    )


@python_names
def distill(
    student_logits: Tensor,
    teacher_logits: Tensor | None = None,
    target: Tensor | None = None,
    *,
    teacher: TopK | None = None,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    beta: float = 0.5,
    softcap: float | None = None,
    soft_weight: float = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    class_weight: Tensor | None = None,
    grad_in_forward: bool = True,
    inplace_backward: bool = False,
    normalizer: float | Tensor | None = None,
    process_group: Any = None,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Distillation loss between student and teacher logits (N, V) or (B, T, V).

    kind: forward_kl KL(p_t||p_s), reverse_kl KL(p_s||p_t), jsd (mixing weight beta), soft_ce,
    tvd. Both distributions at temperature T; softcap (if set) applies to both before T. Rows
    whose target equals ignore_index are skipped; without target every row counts. mean is the
    sum over valid rows divided by their number ("batchmean" over tokens). With hard_weight > 0
    the loss is hard_weight * CE(student, target) + soft_weight * distill; label_smoothing,
    z_loss and class_weight configure that CE term. The teacher gets no gradient.

    grad_in_forward, inplace_backward (the gradient written over student_logits) and normalizer
    work as in cross_entropy: with "sum"/"mean" the student gradient is formed in the same pass
    as the loss (one read of student and teacher, one write), and loss.backward() moves no bytes.

    With process_group, student_logits, teacher_logits (and class_weight) are this rank's
    vocabulary slice: see xent.distributed.distill for the passes and collectives of each kind
    (vocab_offset / vocab_size: the slice's first id and the global V). The gradient is then
    formed in the backward (grad_in_forward and inplace_backward do not apply).

    teacher=xent.TopK(ids, logprobs, mass) in place of teacher_logits: a teacher given as its
    top-k log-probabilities (docs/semantics.md §3.1). softcap and temperature then act on the
    student (and temperature on a renormalized teacher); inplace_backward does not apply. With
    process_group, student_logits (and class_weight) are this rank's slice and the TopK the
    whole teacher, global ids, the same on every rank (xent.distributed.distill_topk: every
    option works sharded; the gradient is formed in the backward).

    Without process_group, vocab_size=V' names the vocabulary student and teacher share when
    their widths differ (a padded or extended head): only the first V' columns of each enter the
    softmaxes, the student's columns past V' get a zero gradient, targets and top-k ids must be
    below V', and class_weight has V' entries or the student's width (docs/semantics.md §3.2).
    """
    if _dtensor.any_dtensor(student_logits, teacher_logits, target, class_weight):
        return _dtensor.call(distill, "distill", locals())
    function = "distill"
    student2d, target1d, row_shape = _rows(function, "student_logits", student_logits, target)
    options = _distill_options(
        function,
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
    )
    width = student2d.shape[-1]
    if teacher is not None or teacher_logits is None:
        shared = None
        if process_group is None:  # else _distill_topk refuses it
            shared = _shared_vocab(function, vocab_size, {"student_logits": width})
        return _distill_topk(
            student_logits,
            student2d if shared is None or shared == width else student2d[:, :shared],
            target1d,
            row_shape,
            teacher_logits,
            teacher,
            options,
            _shared_class_weight(class_weight, shared, width),
            grad_in_forward,
            inplace_backward,
            normalizer,
            process_group,
            vocab_offset,
            vocab_size,
        )
    _check_tensor(function, "teacher_logits", teacher_logits)
    if tuple(teacher_logits.shape) != tuple(student_logits.shape):
        got, expected = (
            tuple(teacher_logits.shape),
            f"{tuple(student_logits.shape)} (the shape of student_logits)",
        )
        same_rows = teacher_logits.shape[:-1] == student_logits.shape[:-1]
        if not same_rows or process_group is not None:
            _fail(function, "teacher_logits", "shape mismatch", got, expected)
        if vocab_size is None:
            _width_mismatch(function, "teacher_logits", got, expected)
    teacher2d = (
        teacher_logits.flatten(0, 1) if teacher_logits.dim() == 3 else teacher_logits
    ).detach()
    # With process_group, vocab_size is the global V of the vocabulary-parallel form.
    shared = None
    if process_group is None:
        shared = _shared_vocab(
            function,
            vocab_size,
            {"student_logits": width, "teacher_logits": teacher2d.shape[-1]},
        )
    if shared is not None:
        teacher2d = teacher2d[:, :shared]  # a view with the teacher's row stride: no copy
    class_weight = _shared_class_weight(_class_weight(function, None, class_weight), shared, width)
    shared = None if shared == width else shared  # the student's columns past V' only
    mode = _fused_mode(function, reduction, grad_in_forward, inplace_backward)
    grad_scale = _grad_scale(function, normalizer, reduction, student_logits)
    if mode == "inplace":
        _check_in_place_rows(function, "student_logits", student2d)
    if process_group is not None:  # vocabulary-parallel (docs/semantics.md §5)
        mode = "recompute"  # the sharded form has its own passes (xent.distributed)
        loss = _distributed.distill(
            student2d,
            teacher2d,
            target1d,
            class_weight,
            options,
            process_group=process_group,
            vocab_offset=vocab_offset,
            vocab_size=vocab_size,
        )
    elif _needs_grad(student2d)[0]:
        loss = DistillFunction.apply(
            student2d, teacher2d, target1d, class_weight, options, mode, grad_scale, shared
        )
        if isinstance(loss, tuple):  # the overwritten student logits, rebased (inplace_backward)
            loss = loss[0]
    else:
        columns = student2d if shared is None else student2d[:, :shared]
        loss = ops.distill_forward(columns, teacher2d, target1d, class_weight, *options)
    if mode == "recompute" or not _needs_grad(student2d)[0]:
        (loss,) = _normalized((loss,), grad_scale)  # autograd carries 1/normalizer backward
    return _validated(
        _reshape_rows(loss, row_shape) if reduction == "none" else loss, student_logits
    )


def _distill_topk(
    student_logits: Tensor,
    student2d: Tensor,
    target1d: Tensor | None,
    row_shape: tuple,
    teacher_logits: Tensor | None,
    teacher: Any,
    options: tuple,
    class_weight: Tensor | None,
    grad_in_forward: bool,
    inplace_backward: bool,
    normalizer: Any,
    process_group: Any,
    vocab_offset: int | None,
    vocab_size: int | None,
) -> Tensor:
    """distill with a TopK teacher (docs/semantics.md §3.1), vocabulary-parallel with
    process_group (xent/_sharded_topk.py)."""
    function = "distill"
    if teacher is None:
        _fail(
            function, "teacher_logits", "missing", None, "teacher_logits or teacher=xent.TopK(...)"
        )
    if teacher_logits is not None:
        _fail(function, "teacher", "given twice", "teacher_logits and teacher", "one of them")
    if inplace_backward:
        _fail(function, "inplace_backward", "unsupported with a TopK teacher", True, "False")
    reduction = options[7]
    ids, logprobs = topk_rows(function, teacher, row_shape, _fail)
    class_weight = _class_weight(function, None, class_weight)
    mode = _fused_mode(function, reduction, grad_in_forward, False)
    grad_scale = _grad_scale(function, normalizer, reduction, student_logits)
    topk_options = (teacher.mass, *options)
    if process_group is not None:  # vocabulary-parallel (docs/semantics.md §5)
        mode = "recompute"  # autograd through the sharded composition (xent/_sharded_topk.py)
        loss = _distributed.distill_topk(
            student2d,
            ids,
            logprobs,
            target1d,
            class_weight,
            topk_options,
            process_group=process_group,
            vocab_offset=vocab_offset,
            vocab_size=vocab_size,
        )
    elif _needs_grad(student2d)[0]:
        loss = DistillTopKFunction.apply(
            student2d, ids, logprobs, target1d, class_weight, topk_options, mode, grad_scale
        )
    else:
        loss = ops.distill_topk_forward(
            student2d, ids, logprobs, target1d, class_weight, *topk_options
        )
    if mode == "recompute" or not _needs_grad(student2d)[0]:
        (loss,) = _normalized((loss,), grad_scale)
    return _validated(
        _reshape_rows(loss, row_shape) if reduction == "none" else loss, student_logits
    )


def _linear_shared_vocab(
    function: str,
    vocab_size: Any,
    student_weight: Tensor,
    teacher_logits: Tensor | None,
    teacher_weight: Tensor | None,
    class_weight: Tensor | None,
) -> tuple:
    """linear_distill's operands cut to the V' shared rows of each head (contiguous views; the
    student head's rows past V' get zeros from autograd) or columns of teacher_logits (a view with
    the teacher's row stride); docs/semantics.md §3.2. The widths must agree without vocab_size.
    A teacher of neither form (a top-k one) leaves the student head alone to cut."""
    widths = {}
    if student_weight.dim() == 2:
        widths["student_weight"] = student_weight.shape[0]
    if teacher_logits is not None and teacher_logits.dim() == 2:
        widths["teacher_logits"] = teacher_logits.shape[1]
    if isinstance(teacher_weight, torch.Tensor) and teacher_weight.dim() == 2:
        widths["teacher_weight"] = teacher_weight.shape[0]
    if "student_weight" not in widths:
        return student_weight, teacher_logits, teacher_weight, class_weight  # the core says why
    if vocab_size is None:
        if len(set(widths.values())) > 1:
            name = "teacher_logits" if teacher_logits is not None else "teacher_weight"
            got = tuple((teacher_logits if teacher_logits is not None else teacher_weight).shape)
            axis = "columns" if teacher_logits is not None else "rows"
            _width_mismatch(
                function,
                name,
                got,
                f"{widths['student_weight']} {axis} (the rows of student_weight)",
            )
        return student_weight, teacher_logits, teacher_weight, class_weight
    shared = _shared_vocab(function, vocab_size, widths)
    width = widths["student_weight"]
    if class_weight is not None:
        class_weight = _shared_class_weight(class_weight, shared, width)
    return (
        student_weight[:shared] if shared < width else student_weight,
        None if teacher_logits is None else teacher_logits[:, :shared],
        None if teacher_weight is None else teacher_weight[:shared],
        class_weight,
    )


@python_names
def linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_logits: Tensor | None = None,
    target: Tensor | None = None,
    *,
    teacher_hidden: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    teacher: TopK | None = None,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    beta: float = 0.5,
    softcap: float | None = None,
    soft_weight: float = 1.0,
    hard_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    class_weight: Tensor | None = None,
    workspace_bytes: int | None = None,
    fp32_logits: bool = False,
    grad_in_forward: bool = True,
    vocab_size: int | None = None,
) -> Tensor:
    """distill(student_hidden @ student_weight.T, teacher, target) without (N, V) logits.

    The teacher is either teacher_logits (N, V) / (B, T, V), or teacher_hidden (N, H_t) with
    teacher_weight (V, H_t), whose logits are computed chunk by chunk too. Gradients flow to the
    student hidden states and weight only. grad_in_forward and the default workspace_bytes as in
    linear_cross_entropy.

    vocab_size=V' when the student's and the teacher's vocabularies differ in size: the first V'
    rows of each head (or columns of teacher_logits) are compared, the student head's rows past
    V' get a zero gradient (docs/semantics.md §3.2).

    teacher=xent.TopK(ids, logprobs, mass) in place of teacher_logits / teacher_hidden: a teacher
    given as its top-k log-probabilities, as in distill (docs/semantics.md §3.1); the student's
    logits are formed a row chunk at a time within workspace_bytes.
    """
    if teacher is not None:
        return _linear_distill_topk(locals())
    if _dtensor.any_dtensor(
        student_hidden,
        student_weight,
        teacher_logits,
        teacher_hidden,
        teacher_weight,
        target,
        class_weight,
    ):  # xent/_dtensor.py
        return _dtensor.call(linear_distill, "linear_distill", locals())
    function = "linear_distill"
    _check_tensor(function, "student_weight", student_weight)
    hidden2d, target1d, row_shape = _rows(function, "student_hidden", student_hidden, target)
    teacher_logits2d = teacher_hidden2d = None
    if teacher_logits is not None:
        _check_tensor(function, "teacher_logits", teacher_logits)
        teacher_logits2d = (
            teacher_logits.flatten(0, 1) if teacher_logits.dim() == 3 else teacher_logits
        ).detach()
    if teacher_hidden is not None:
        _check_tensor(function, "teacher_hidden", teacher_hidden)
        teacher_hidden2d = (
            teacher_hidden.flatten(0, 1) if teacher_hidden.dim() == 3 else teacher_hidden
        ).detach()
    if teacher_weight is not None:
        teacher_weight = teacher_weight.detach()
    student_weight, teacher_logits2d, teacher_weight, class_weight = _linear_shared_vocab(
        function, vocab_size, student_weight, teacher_logits2d, teacher_weight, class_weight
    )
    options = _distill_options(
        function,
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
    )
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
    budget = _workspace_budget(function, workspace_bytes, hidden2d)
    options = options + (budget, bool(fp32_logits))
    wants = _needs_grad(hidden2d, student_weight)
    teacher = (teacher_logits2d, teacher_hidden2d, teacher_weight)
    if any(wants):
        loss = LinearDistillFunction.apply(
            hidden2d,
            student_weight,
            *teacher,
            target1d,
            class_weight,
            options,
            wants,
            bool(grad_in_forward),
        )
    else:
        loss = ops.linear_distill_forward(
            hidden2d, student_weight, *teacher, target1d, class_weight, *options, False, False
        )[0]
    return _validated(
        _reshape_rows(loss, row_shape) if reduction == "none" else loss, student_hidden
    )


def _linear_distill_topk(arguments: dict) -> Tensor:
    """linear_distill with a TopK teacher (docs/semantics.md §3.1, §4)."""
    function = "linear_distill"
    a = arguments
    for name in ("teacher_logits", "teacher_hidden", "teacher_weight"):
        if a[name] is not None:
            _fail(function, "teacher", "given twice", f"{name} and teacher", "one of them")
    student_weight = a["student_weight"]
    _check_tensor(function, "student_weight", student_weight)
    hidden2d, target1d, row_shape = _rows(
        function, "student_hidden", a["student_hidden"], a["target"]
    )
    teacher = a["teacher"]
    ids, logprobs = topk_rows(function, teacher, row_shape, _fail)
    student_weight, _, _, class_weight = _linear_shared_vocab(
        function, a["vocab_size"], student_weight, None, None, a["class_weight"]
    )
    options = _distill_options(
        function,
        a["kind"],
        a["temperature"],
        a["beta"],
        a["softcap"],
        a["soft_weight"],
        a["hard_weight"],
        a["ignore_index"],
        a["reduction"],
        a["label_smoothing"],
        a["z_loss"],
    )
    class_weight = _class_weight(function, None, class_weight)
    autocast = _autocast_dtype(hidden2d)
    if autocast is not None:
        hidden2d, student_weight = hidden2d.to(autocast), student_weight.to(autocast)
    budget = _workspace_budget(function, a["workspace_bytes"], hidden2d)
    loss = linear_distill_topk(
        hidden2d,
        student_weight,
        ids,
        logprobs,
        target1d,
        class_weight,
        teacher.mass,
        options,
        budget,
        bool(a["fp32_logits"]),
        _needs_grad(hidden2d, student_weight),
        bool(a["grad_in_forward"]),
    )
    reduction = options[7]
    return _validated(
        _reshape_rows(loss, row_shape) if reduction == "none" else loss, a["student_hidden"]
    )


# ---- per-token log-probabilities and entropy (RL) ----------------------------------------------


def _temperature_scale(function: str, temperature: float) -> float:
    value = float(temperature)
    if not (value > 0 and value != float("inf")):
        _fail(function, "temperature", "out of range", temperature, "a finite value > 0")
    return 1.0 / value


def _logprobs_result(
    logprob: Tensor, entropy: Tensor, row_shape: tuple, return_entropy: bool
) -> Tensor | tuple[Tensor, Tensor]:
    logprob = _reshape_rows(logprob, row_shape)
    return (logprob, _reshape_rows(entropy, row_shape)) if return_entropy else logprob


def logprobs(
    logits: Tensor,
    target: Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    batch_invariant: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probability of target under softmax(logits / temperature), and optionally
    the entropy of that distribution, both differentiable (float32, shaped like target).

    logits (N, V) or (B, T, V). logprob = log_softmax(x / T)[y] and entropy = −Σ p·log p; rows
    whose target is ignore_index give 0 for both and no gradient. The backward forms the logits
    gradient from both upstream gradients in one pass over the logits (docs/semantics.md §1).
    batch_invariant=True promises each row's values bit-identical whatever the other rows; on
    logits every backend already computes a row by a plan of V and dtype alone, so it changes
    nothing here (accepted so that callers can pass it to every logprob op).
    Returns logprob, or (logprob, entropy) when return_entropy.
    """
    if _dtensor.any_dtensor(logits, target):  # DTensor inputs: xent/_dtensor.py
        return _dtensor.call(logprobs, "logprobs", locals())
    function = "logprobs"
    _check_flag(function, "batch_invariant", batch_invariant)
    logits2d, target1d, row_shape = _rows(function, "logits", logits, target)
    options = (
        int(ignore_index),
        None if softcap is None else float(softcap),
        _temperature_scale(function, temperature),
    )
    if _needs_grad(logits)[0]:
        logprob, entropy = LogprobsFunction.apply(logits2d, target1d, options, bool(return_entropy))
    else:
        outputs = ops.ce_forward(
            logits2d,
            target1d,
            None,
            None,
            options[0],
            "none",
            0.0,
            0.0,
            options[1],
            options[2],
            bool(return_entropy),
        )
        _, logprob, entropy = _statistics(outputs, target1d, options[0], return_entropy)
    return _validated(_logprobs_result(logprob, entropy, row_shape, return_entropy), logits)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    workspace_bytes: int | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    fp32_logits: bool = False,
    cache_logits: bool = False,
    batch_invariant: bool = False,
    cache_bytes: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """logprobs(hidden @ weight.T + bias, target, temperature, return_entropy) without ever
    holding all (N, V) logits: for RL losses (PPO, GRPO) on a large-vocabulary LM head.

    hidden (N, H) or (B, T, H); weight (V, H); bias (V,) or None. Chunked within workspace_bytes
    like linear_cross_entropy (same default, see default_workspace_bytes); chunk logits are
    rounded to the input dtype unless fp32_logits. Mixed precision as in linear_cross_entropy:
    under autocast the products run in the autocast dtype, and an fp32 weight (a master weight,
    also with 16-bit hidden states outside autocast) is converted inside the op only, its
    gradient accumulated in place in fp32.
    The upstream gradients of logprob and entropy are per token and unknown in the forward, so
    when gradients are wanted the forward keeps the logits of the first rows in a cache of at
    most cache_bytes (default DEFAULT_LOGPROBS_CACHE_BYTES, 1 GiB: V elements of the input
    dtype a row, fp32 with fp32_logits; held from the forward until the backward), and the
    backward reads those rows' logits there and recomputes the others' chunk by chunk, folding
    both upstream gradients in before the products. Each cached row saves a quarter of its
    four products: with every row cached, about the time of the mean linear_cross_entropy; with
    none (cache_bytes=0), that of linear_cross_entropy(reduction="none"). cache_logits=True
    caches all (N, V) logits whatever cache_bytes.
    batch_invariant=True makes each row's logprob and entropy bit-identical whatever the number
    of rows, the row's position and workspace_bytes (the forward's product runs in an order
    fixed per shape of the head: on the CPU the library's own tiled product, on CUDA one cuBLASLt
    algorithm per head shape without split-K, and no fused Hopper products; slower,
    docs/semantics.md §1); gradients are not covered.
    """
    if _dtensor.any_dtensor(hidden, weight, bias, target):  # DTensor inputs: xent/_dtensor.py
        return _dtensor.call(linear_logprobs, "linear_logprobs", locals())
    function = "linear_logprobs"
    _check_flag(function, "batch_invariant", batch_invariant)
    cache_budget = DEFAULT_LOGPROBS_CACHE_BYTES if cache_bytes is None else int(cache_bytes)
    if cache_budget < 0:
        _fail(function, "cache_bytes", "out of range", cache_bytes, "a size of 0 or more")
    _check_tensor(function, "weight", weight)
    hidden2d, target1d, row_shape = _rows(function, "hidden", hidden, target)
    compute_dtype = _compute_dtype(hidden2d, weight)
    wants = _needs_grad(hidden2d, weight, bias)
    budget = _workspace_budget(function, workspace_bytes, hidden2d)
    options = (
        int(ignore_index),
        None if softcap is None else float(softcap),
        _temperature_scale(function, temperature),
        budget,
        bool(fp32_logits),
    )
    if any(wants):
        logprob, entropy = LinearLogprobsFunction.apply(
            hidden2d,
            weight,
            bias,
            target1d,
            options,
            wants,
            bool(return_entropy),
            logits_cache_rows(
                hidden2d.shape[0],
                weight.shape[0],
                compute_dtype or hidden2d.dtype,
                bool(fp32_logits),
                bool(cache_logits),
                cache_budget,
            ),
            compute_dtype,
            batch_invariant,
        )
    else:
        operands = _compute_copies(compute_dtype, hidden2d, weight, bias)
        outputs = linear_none_forward(
            operands, target1d, options, return_entropy, batch_invariant=batch_invariant
        )
        _, logprob, entropy = _statistics(outputs, target1d, options[0], return_entropy)
    return _validated(_logprobs_result(logprob, entropy, row_shape, return_entropy), hidden)
