"""DTensor inputs to xent's losses: tensor parallelism and FSDP2 as torchtitan runs them.

Each public op (cross_entropy, linear_cross_entropy, distill, linear_distill, logprobs,
linear_logprobs) hands a call with a DTensor argument to ``call`` below, which turns the DTensors
into local tensors plus the process group and vocabulary slice of their mesh, runs the op's
vocabulary-parallel form (xent.distributed), and wraps the results back as DTensors. The
conversions are differentiable (``to_local`` / ``from_local``), so gradients come back as
DTensors with the input's placements.

Accepted placements (mesh of any rank; "the other mesh dims" must be Replicate):

* logits, student/teacher logits: ``Shard(-1)`` on one mesh dim -> the vocabulary-parallel path
  on that mesh dim's process group; each rank's offset is its slice's global offset as DTensor
  computes it (uneven sizes included: torch puts ceil(V/P) columns on the first ranks, the rest,
  possibly nothing, on the last). All ``Replicate`` -> the single-device path on the local copy.
* linear_cross_entropy: weight (and bias) ``Shard(0)`` on one mesh dim with hidden a
  ``Replicate`` DTensor on the same mesh -> the sharded linear path; ∂weight is a ``Shard(0)``
  DTensor, ∂hidden a ``Replicate`` DTensor (all-reduced), or ``Partial`` with
  ``reduce_hidden_grad=False`` (each rank's partial sum, for a layer that reduces it itself).
* linear_distill, linear_logprobs: the same weight/hidden placements; they have no fused
  sharded form, so each rank forms its local logits ``hidden @ weight_local.T`` (N x V_local
  elements) and runs distill / logprobs on them.
* distill's top-k teacher (``teacher=xent.TopK(ids, logprobs)``) beside ``Shard(-1)`` student
  logits: ids and logprobs whole (global ids), plain tensors or ``Replicate`` DTensors.
* targets, row weights: plain tensors or ``Replicate`` DTensors (the same on every rank of the
  vocabulary group). class_weight: a plain or Replicate full-vocabulary tensor (each rank takes
  its slice) or a DTensor sharded like the logits.
* Outputs (loss, statistics, per-row values) are ``Replicate`` DTensors on the input's mesh, as
  torchtitan's ``loss_parallel`` returns them; the logits' gradient is ``Shard(-1)``.

Anything else (``Partial``, a shard of the rows, two sharded mesh dims, a ``_StridedShard``)
raises a ValueError naming the placement and what is accepted. A DTensor together with
process_group= (or vocab_offset= / vocab_size=) raises a TypeError, as xent.distributed does:
one or the other. A vocabulary so small that DTensor's split leaves the last rank(s) no columns
(V = 4 over 3 ranks: 2/2/0) is refused on every rank before any collective.

logprobs on ``Shard(-1)`` logits is the sharded cross-entropy with reduction "none"; its entropy
is returned without a gradient, so ``return_entropy=True`` with a gradient is refused (call it
under ``torch.no_grad()`` or without the entropy).

FSDP2 (choice: refuse, with the remedy). A ``fully_shard``-ed LM head used outside its module's
forward is a DTensor whose rows are a shard of the *parameter* on the data-parallel mesh, while
every rank holds different tokens (hidden is a plain tensor). Gathering it inside the op would
hand back a gradient that bypasses FSDP's own reduce-scatter (its averaging, its mixed-precision
and its gradient-accumulation hooks), so the op raises a ValueError instead, saying what to do:
let FSDP unshard the weight, i.e. call xent inside the forward of the FSDP module that owns it
(``xent.hf.patch(model)`` then ``fully_shard`` the model, with the LM head not wrapped on its
own, or wrapped together with the module whose forward calls xent). Inside that forward FSDP2
hands the op the unsharded weight (a plain tensor, or under FSDP x TP a ``Shard(0)`` DTensor on
the tensor-parallel mesh) and reduce-scatters ∂W after the backward as for any layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # torch without the DTensor package: nothing can be a DTensor
    DTensor = None

Tensor = torch.Tensor

__all__ = ["any_dtensor", "call"]

_ACCEPTED_LOGITS = (
    "Shard(-1) (the vocabulary) on one mesh dim with Replicate on the others, "
    "or Replicate on every mesh dim"
)
_ACCEPTED_WEIGHT = (
    "Shard(0) (vocabulary rows) on one mesh dim with Replicate on the others, "
    "or Replicate on every mesh dim"
)
_ACCEPTED_ROWS = "a plain tensor or a DTensor with Replicate on every mesh dim"


def any_dtensor(*tensors: Any) -> bool:
    """Whether any argument is a DTensor (cheap: the ops call it on every call)."""
    return DTensor is not None and any(isinstance(t, DTensor) for t in tensors)


class _Layout:
    """Where a DTensor's local slice sits: mesh, the sharded mesh dim (None if replicated), its
    group, the local slice's offset and the global size along the sharded tensor dim."""

    def __init__(
        self, mesh: Any, mesh_dim: int | None, offset: int, size: int, group: Any = None
    ) -> None:
        self.mesh, self.mesh_dim, self.offset, self.size = mesh, mesh_dim, offset, size
        self.group = group

    @property
    def sharded(self) -> bool:
        return self.mesh_dim is not None

    def same(self, other: _Layout) -> bool:
        return (
            self.mesh == other.mesh
            and self.mesh_dim == other.mesh_dim
            and self.offset == other.offset
            and self.size == other.size
        )


_MESH_DIMS: dict = {}


def _mesh_dim(mesh: Any, mesh_dim: int) -> tuple:
    """(size, this rank's coordinate, process group) of a mesh dim, looked up once per mesh
    object: the ops ask on every call, and DeviceMesh answers through layout objects."""
    key = (id(mesh), mesh_dim)
    entry = _MESH_DIMS.get(key)
    if entry is None or entry[0]() is not mesh:
        # the entry leaves with its mesh (no process group is kept alive by it)
        ref = weakref.ref(mesh, lambda _, key=key: _MESH_DIMS.pop(key, None))
        coordinate = mesh.get_coordinate()[mesh_dim]
        entry = (ref, mesh.size(mesh_dim), coordinate, mesh.get_group(mesh_dim))
        _MESH_DIMS[key] = entry
    return entry[1:]


def _layout(function: str, name: str, tensor: Any, dim: int, accepted: str) -> _Layout:
    """The layout of a DTensor sharded along tensor dim ``dim`` (or replicated), or the
    ValueError naming its placements and what is accepted."""
    dim = dim % tensor.dim()
    sharded = []
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is Shard and placement.dim % tensor.dim() == dim:
            sharded.append(mesh_dim)
            continue
        raise ValueError(
            f"xent.{function}: {name} has placement {placement} on mesh dim "
            f"{mesh_dim} (placements {tuple(tensor.placements)}); accepted: "
            f"{accepted}"
        )
    if len(sharded) > 1:
        raise ValueError(
            f"xent.{function}: {name} is sharded on mesh dims {sharded} "
            f"(placements {tuple(tensor.placements)}); accepted: {accepted}"
        )
    if not sharded:
        return _Layout(tensor.device_mesh, None, 0, tensor.shape[dim])
    world, coordinate, group = _mesh_dim(tensor.device_mesh, sharded[0])
    size, chunk = tensor.shape[dim], -(-tensor.shape[dim] // world)
    if (world - 1) * chunk >= size:  # raised on every rank: none enters a collective
        raise ValueError(
            f"xent.{function}: {name} of {size} along dim {dim} sharded over "
            f"{world} ranks leaves the last rank(s) no columns (DTensor gives "
            f"ceil({size}/{world}) = {chunk} to the first ranks); "
            "accepted: a size whose last shard is not empty, or a smaller mesh"
        )
    # DTensor's split, torch.chunk's: ceil(size / world) in mesh order, what is left to the last.
    # By hand: DTensor's own offset helper builds the slice's index range as a tensor and reads
    # it back (a device synchronisation when the default device is a GPU).
    return _Layout(tensor.device_mesh, sharded[0], coordinate * chunk, size, group)


def _replicated(function: str, name: str, value: Any, mesh: Any = None) -> Any:
    """A plain tensor (or None) from an argument that must be the same on every rank."""
    if not any_dtensor(value):
        return value
    if not all(isinstance(p, Replicate) for p in value.placements):
        raise ValueError(
            f"xent.{function}: {name} has placements {tuple(value.placements)}; "
            f"accepted: {_ACCEPTED_ROWS}"
        )
    return value.to_local()


def _class_slice(function: str, value: Any, layout: _Layout) -> torch.Tensor | None:
    """This rank's slice of class weights given in full (plain or Replicate) or sharded as the
    logits."""
    if value is None:
        return None
    if any_dtensor(value):
        mine = _layout(function, "class_weight", value, 0, _ACCEPTED_WEIGHT)
        if mine.sharded:
            if not mine.same(layout):
                raise ValueError(
                    f"xent.{function}: class_weight placements "
                    f"{tuple(value.placements)} do not match the vocabulary "
                    "sharding of the logits; accepted: the same mesh dim and "
                    "slices, or a full (Replicate or plain) tensor"
                )
            return value.to_local()
        value = value.to_local()
    if not layout.sharded:
        return value
    local = layout.local_size
    return value[layout.offset : layout.offset + local]


def _wrap(value: Any, mesh: Any) -> Any:
    """Outputs as Replicate DTensors on the mesh (differentiable; None and non-tensors kept)."""
    if isinstance(value, tuple) and hasattr(value, "_replace"):  # CrossEntropyResult
        return type(value)(*(_wrap(v, mesh) for v in value))
    if isinstance(value, tuple):
        return tuple(_wrap(v, mesh) for v in value)
    if isinstance(value, Tensor):
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value


def _no_process_group(function: str, args: dict) -> None:
    for key in ("process_group", "vocab_offset", "vocab_size"):
        if args.get(key) is not None:
            # TypeError, as xent.distributed refuses a DTensor with process_group
            raise TypeError(
                f"xent.{function}: {key}= given with a DTensor argument; either "
                "pass the DTensors alone (their mesh gives the process group and "
                "the vocabulary slice), or the local slice (.to_local()) as a plain "
                "tensor with process_group=, vocab_offset=, vocab_size="
            )


def _vocab_logits(function: str, name: str, logits: Any) -> tuple:
    """(local tensor, layout) of Shard(-1)/Replicate logits."""
    layout = _layout(function, name, logits, -1, _ACCEPTED_LOGITS)
    local = logits.to_local()
    layout.local_size = local.shape[-1]
    return local, layout


def _sharded_args(layout: _Layout) -> dict:
    if not layout.sharded:
        return {}
    return dict(process_group=layout.group, vocab_offset=layout.offset, vocab_size=layout.size)


# ---- per op ----------------------------------------------------------------------------------


def _cross_entropy(fn: Callable, args: dict) -> Any:
    function = "cross_entropy"
    logits = args["logits"]
    if not any_dtensor(logits):
        raise ValueError(
            f"xent.{function}: logits is a plain tensor while another argument is "
            f"a DTensor; accepted: logits a DTensor with {_ACCEPTED_LOGITS}"
        )
    args["logits"], layout = _vocab_logits(function, "logits", logits)
    args["target"] = _replicated(function, "target", args["target"])
    args["row_weight"] = _replicated(function, "row_weight", args["row_weight"])
    for key in ("weight", "class_weight"):
        args[key] = _class_slice(function, args[key], layout)
    if layout.sharded:
        args.update(_sharded_args(layout))
    return _wrap(fn(**args), layout.mesh)


def _distill(fn: Callable, args: dict) -> Any:
    function = "distill"
    student, teacher = args["student_logits"], args["teacher_logits"]
    topk = args["teacher"]
    if topk is not None and teacher is None and any_dtensor(student):  # the whole top-k teacher
        args["student_logits"], layout = _vocab_logits(function, "student_logits", student)
        args["teacher"] = type(topk)(
            _replicated(function, "teacher.ids", topk.ids),
            _replicated(function, "teacher.logprobs", topk.logprobs),
            topk.mass,
        )
    else:
        if not (any_dtensor(student) and any_dtensor(teacher)):
            raise ValueError(
                f"xent.{function}: student_logits and teacher_logits must both be "
                f"DTensors with {_ACCEPTED_LOGITS} (the same sharding)"
            )
        args["student_logits"], layout = _vocab_logits(function, "student_logits", student)
        args["teacher_logits"], other = _vocab_logits(function, "teacher_logits", teacher)
        if not layout.same(other):
            raise ValueError(
                f"xent.{function}: teacher_logits placements {tuple(teacher.placements)}"
                f" differ from student_logits' {tuple(student.placements)}; accepted: "
                "both sharded alike"
            )
    args["target"] = _replicated(function, "target", args["target"])
    args["class_weight"] = _class_slice(function, args["class_weight"], layout)
    if layout.sharded:
        args.update(_sharded_args(layout))
    return _wrap(fn(**args), layout.mesh)


def _logprobs(fn: Callable, args: dict) -> Any:
    function = "logprobs"
    logits = args["logits"]
    if not any_dtensor(logits):
        raise ValueError(f"xent.{function}: logits must be a DTensor with {_ACCEPTED_LOGITS}")
    local, layout = _vocab_logits(function, "logits", logits)
    target = _replicated(function, "target", args["target"])
    if not layout.sharded:
        args.update(logits=local, target=target)
        return _wrap(fn(**args), layout.mesh)
    return_entropy = bool(args["return_entropy"])
    if return_entropy and torch.is_grad_enabled() and local.requires_grad:
        raise ValueError(
            f"xent.{function}: return_entropy=True with a gradient on Shard(-1) "
            "logits: the vocabulary-parallel entropy has no gradient; accepted: "
            "return_entropy=False, or the entropy under torch.no_grad()"
        )
    from xent._logprobs import _zero_ignored
    from xent.functional import _temperature_scale, cross_entropy

    ignore_index = int(args["ignore_index"])
    result = cross_entropy(
        local,
        target,
        ignore_index=ignore_index,
        reduction="none",
        softcap=args["softcap"],
        logit_scale=_temperature_scale(function, args["temperature"]),
        return_stats=return_entropy,
        **_sharded_args(layout),
    )
    if return_entropy:
        loss, entropy = result.loss, _zero_ignored(result.entropy, target, ignore_index)
    else:
        loss = result
    logprob = _zero_ignored(loss.neg(), target, ignore_index)
    return _wrap((logprob, entropy) if return_entropy else logprob, layout.mesh)


def _linear_operands(
    function: str, args: dict, hidden_key: str, weight_key: str, bias_key: str | None
) -> tuple:
    """(local hidden, local weight, local bias, layout, partial hidden?) of a vocabulary-sharded
    (or replicated) LM head, with the FSDP2 refusal."""
    hidden, weight = args[hidden_key], args[weight_key]
    bias = args.get(bias_key) if bias_key else None
    if not any_dtensor(weight):
        raise ValueError(
            f"xent.{function}: {hidden_key} is a DTensor but {weight_key} is a plain "
            f"tensor; accepted: {weight_key} a DTensor with {_ACCEPTED_WEIGHT} and "
            f"{hidden_key} a DTensor with Replicate on the same mesh"
        )
    layout = _layout(function, weight_key, weight, 0, _ACCEPTED_WEIGHT)
    if layout.sharded and not any_dtensor(hidden):
        raise ValueError(
            f"xent.{function}: {weight_key} is a DTensor sharded by rows (placements "
            f"{tuple(weight.placements)}) but {hidden_key} is a plain tensor. If this is an "
            "FSDP2 (fully_shard) parameter used outside its module's forward, its rows are a "
            "shard of the parameter, not a vocabulary slice, and its gradient would bypass "
            "FSDP's reduce-scatter: call xent inside the forward of the FSDP module that owns "
            "the weight (e.g. xent.hf.patch(model), then fully_shard the model without "
            "wrapping the LM head on its own), where FSDP hands over the unsharded weight. For "
            f"tensor parallelism pass {hidden_key} as a DTensor with Replicate on the weight's "
            "mesh (accepted: " + _ACCEPTED_WEIGHT + ")"
        )
    if any_dtensor(hidden):
        if hidden.device_mesh != weight.device_mesh:
            raise ValueError(
                f"xent.{function}: {hidden_key} and {weight_key} are on different "
                "device meshes; accepted: one mesh"
            )
        if not all(isinstance(p, Replicate) for p in hidden.placements):
            raise ValueError(
                f"xent.{function}: {hidden_key} has placements "
                f"{tuple(hidden.placements)}; accepted: Replicate on every mesh dim "
                f"(redistribute it, e.g. {hidden_key}.redistribute(placements="
                "[Replicate()] * mesh.ndim))"
            )
    if bias is not None:
        if not any_dtensor(bias):
            raise ValueError(f"xent.{function}: bias must be a DTensor sharded as {weight_key}")
        if not _layout(function, "bias", bias, 0, _ACCEPTED_WEIGHT).same(layout):
            raise ValueError(
                f"xent.{function}: bias placements {tuple(bias.placements)} differ "
                f"from {weight_key}'s {tuple(weight.placements)}; accepted: alike"
            )
    return hidden, weight, bias, layout


def _local_hidden(hidden: Any, partial: bool) -> torch.Tensor:
    if not any_dtensor(hidden):
        return hidden
    if partial:  # each rank's ∂hidden is its partial sum over its vocabulary slice
        return hidden.to_local(grad_placements=[Partial()] * hidden.device_mesh.ndim)
    return hidden.to_local()


def _linear_cross_entropy(fn: Callable, args: dict) -> Any:
    function = "linear_cross_entropy"
    hidden, weight, bias, layout = _linear_operands(function, args, "hidden", "weight", "bias")
    if args.get("accumulate_into") is not None and layout.sharded:
        raise ValueError(
            f"xent.{function}: accumulate_into with a sharded DTensor weight; "
            "accepted: accumulate_into=None (∂weight comes back as a Shard(0) "
            "DTensor in weight.grad)"
        )
    local_weight = weight.to_local()
    layout.local_size = local_weight.shape[0]
    partial = layout.sharded and not bool(args["reduce_hidden_grad"])
    args["hidden"] = _local_hidden(hidden, partial)
    args["weight"] = local_weight
    args["bias"] = bias.to_local() if bias is not None else None
    args["target"] = _replicated(function, "target", args["target"])
    args["row_weight"] = _replicated(function, "row_weight", args["row_weight"])
    args["class_weight"] = _class_slice(function, args["class_weight"], layout)
    if layout.sharded:
        args.update(_sharded_args(layout))
    return _wrap(fn(**args), layout.mesh)


def _logits_of(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_logits: bool
) -> torch.Tensor:
    """Each rank's local logits as a DTensor (Replicate hidden @ Shard(0) weight.T ->
    Shard(-1)), autograd through DTensor's own linear."""
    hidden = hidden.flatten(0, -2) if hidden.dim() == 3 else hidden
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return logits.float() if fp32_logits else logits


def _linear_logprobs(fn: Callable, args: dict) -> Any:
    function = "linear_logprobs"
    hidden, weight, bias, layout = _linear_operands(function, args, "hidden", "weight", "bias")
    if not layout.sharded:
        args.update(
            hidden=_local_hidden(hidden, False),
            weight=weight.to_local(),
            bias=bias.to_local() if bias is not None else None,
            target=_replicated(function, "target", args["target"]),
        )
        return _wrap(fn(**args), layout.mesh)
    from xent.functional import logprobs

    target = args["target"]
    shape = target.shape
    out = logprobs(
        _logits_of(hidden, weight, bias, bool(args["fp32_logits"])),
        target.flatten() if target.dim() == 2 else target,
        args["temperature"],
        args["return_entropy"],
        ignore_index=args["ignore_index"],
        softcap=args["softcap"],
    )
    if target.dim() == 2:
        out = tuple(o.view(shape) for o in out) if isinstance(out, tuple) else out.view(shape)
    return out


def _linear_distill(fn: Callable, args: dict) -> Any:
    function = "linear_distill"
    hidden, weight, _, layout = _linear_operands(
        function, args, "student_hidden", "student_weight", None
    )
    if not layout.sharded:
        local = {
            key: (value.to_local() if any_dtensor(value) else value) for key, value in args.items()
        }
        return _wrap(fn(**local), layout.mesh)
    from xent.functional import distill

    fp32 = bool(args["fp32_logits"])
    student = _logits_of(hidden, weight, None, fp32)
    if args["teacher_logits"] is not None:
        teacher = args["teacher_logits"]
        teacher = teacher.flatten(0, 1) if teacher.dim() == 3 else teacher
    else:
        t_hidden, t_weight, _, _ = _linear_operands(
            function, args, "teacher_hidden", "teacher_weight", None
        )
        teacher = _logits_of(t_hidden.detach(), t_weight.detach(), None, fp32)
    target = args["target"]
    shape = target.shape if target is not None else None
    keys = (
        "kind",
        "temperature",
        "beta",
        "softcap",
        "soft_weight",
        "hard_weight",
        "ignore_index",
        "reduction",
        "label_smoothing",
        "z_loss",
        "class_weight",
        "grad_in_forward",
    )
    loss = distill(
        student,
        teacher.to(student.dtype),
        target.flatten() if target is not None and target.dim() == 2 else target,
        **{key: args[key] for key in keys},
    )
    if args["reduction"] == "none" and shape is not None and len(shape) == 2:
        loss = loss.view(shape)
    return loss


_OPS = {
    "cross_entropy": _cross_entropy,
    "distill": _distill,
    "logprobs": _logprobs,
    "linear_cross_entropy": _linear_cross_entropy,
    "linear_logprobs": _linear_logprobs,
    "linear_distill": _linear_distill,
}


def call(fn: Callable, function: str, args: dict) -> Any:
    """Runs ``fn`` (a public op) with the DTensors of ``args`` (its arguments by name) turned
    into local tensors and the mesh's process group; results as Replicate DTensors."""
    args = dict(args)
    _no_process_group(function, args)
    return _OPS[function](fn, args)
