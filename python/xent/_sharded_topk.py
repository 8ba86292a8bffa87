"""Vocabulary-parallel distill with a teacher given as its top-k (docs/semantics.md §5, §3.1).

Every rank holds the same teacher (global ids and log-probabilities) and its slice of the
student's logits. The single-process top-k math compares at most k + 1 categories per row: the
present ids, whose student values a_j = s̃_id_j each live on the rank owning the id, and (masses
tail, ignore) the rest, a_tail = logsumexp of s̃ outside the ids. So the ranks build one small
"compact student" row [a_1 .. a_k, a_tail] (an absent id -1 gets −inf) whose softmax is exactly
the student's over those categories, and run the single-process op distill_topk on it, the same
on every rank: its logsumexp is the whole row's, so the loss is the single-process one and its
gradient with respect to a_c is the §3.1 ∂loss/∂a_c. Autograd carries that back to each slice:
a_j to the owning rank's column id_j, a_tail as e^(s̃_i − a_tail) to every column outside the ids.
The hard-label term is the sharded cross_entropy of xent.distributed with the distill's options.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from xent import distributed as _distributed
from xent._ops import ops
from xent._topk import DistillTopKFunction
from xent._vocab_parallel import _fail, _refuse_dtensor, vocab_layout

Tensor = torch.Tensor


class _SumOverRanks(torch.autograd.Function):
    """all_reduce(SUM) whose backward is the identity: every rank forms the same loss from the
    sum, so ∂loss/∂(this rank's part) is ∂loss/∂sum, already on every rank."""

    @staticmethod
    def forward(ctx: Any, part: Tensor, group: Any):
        total = part.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return grad, None


def _bad_rows(ids: Tensor, vocab: int) -> Tensor:
    """[N] bool: rows with an id < −1 or ≥ V, or a present id twice. On CPU tensors the first
    such entry is an error (as distill_topk_forward checks it); on a GPU the row becomes NaN."""
    out_of_range = (ids < -1) | (ids >= vocab)
    ordered = ids.sort(dim=1).values
    twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    bad = out_of_range.any(1) | twice.any(1)
    if ids.device.type == "cpu" and bool(bad.any()):
        _raise_bad_id(ids, int(bad.nonzero()[0, 0]), vocab)
    return bad


def _raise_bad_id(ids: Tensor, n: int, vocab: int) -> None:
    """The error of the first bad entry of row n, worded as distill_topk_forward's."""
    row = ids[n].tolist()
    for j, id_ in enumerate(row):
        where = f"ids[{n}, {j}] = {id_}"
        if id_ < -1 or id_ >= vocab:
            _fail(
                "distill",
                "teacher.ids",
                "out of range",
                where,
                f"a token id in [0, {vocab}) or -1 (absent)",
            )
        if id_ >= 0 and id_ in row[:j]:
            _fail(
                "distill",
                "teacher.ids",
                "has a duplicate id",
                f"{where} twice in row {n}",
                "distinct ids in each row (-1 may repeat)",
            )


def _check_values(
    hard_weight: float,
    softcap: float | None,
    target: Tensor | None,
    ignore_index: int,
    class_weight: Tensor | None,
    vocab: int,
) -> None:
    """What distill_topk_forward checks of the options the compact call does not see: the
    softcap, targets against the global V and (host memory only) the class-weight slice."""
    function = "distill"
    if hard_weight > 0 and target is None:
        _fail(
            function, "target", "missing", "an absent tensor", "a [N] tensor when hard_weight > 0"
        )
    if softcap is not None and not (0.0 < softcap < float("inf")):
        _fail(function, "softcap", "out of range", softcap, "a finite value > 0")
    if target is not None and target.device.type == "cpu":
        wrong = (target != ignore_index) & ((target < 0) | (target >= vocab))
        if bool(wrong.any()):
            n = int(wrong.nonzero()[0, 0])
            _fail(
                function,
                "target",
                "out of range",
                f"target[{n}] = {int(target[n])}",
                f"a class index in [0, {vocab}) or ignore_index ({ignore_index})",
            )
    if class_weight is not None and class_weight.device.type == "cpu":
        wrong = ~(torch.isfinite(class_weight) & (class_weight >= 0))
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0, 0])
            _fail(
                function,
                "class_weight",
                "has a negative or non-finite entry",
                f"class_weight[{i}] = {float(class_weight[i])} (of this rank's slice)",
                "finite values >= 0",
            )


def _compact_student(
    student: Tensor, ids: Tensor, mass: str, softcap: float | None, layout: tuple, group: Any
) -> tuple:
    """(compact [N, k + 1] student values, compact ids [N, k + 1]): a_j at column j (−inf for an
    absent id), a_tail at column k (unused by renormalize, which has no tail). A row whose ids
    cover all V columns has no tail category: every column of its compact row is then an id
    (those of −inf, with log-probability −inf, add 0), so that the compact row leaves none."""
    offset, vocab = layout
    rows, width = student.shape
    k = ids.shape[1]
    compute = torch.float64 if student.dtype == torch.float64 else torch.float32
    u = student.to(compute)
    if softcap is not None:
        u = softcap * torch.tanh(u / softcap)
    bad = _bad_rows(ids, vocab)
    with_tail = mass != "renormalize"
    present = ids >= 0
    local = ids.long() - offset
    owned = present & (local >= 0) & (local < width)
    index = torch.where(owned, local, 0)
    if width > 0:
        part = torch.where(owned, u.gather(1, index), 0.0)
    else:
        part = u.new_zeros((rows, k))
    full = with_tail & ~bad & (present.sum(1) == vocab)
    if with_tail:  # Σ e^(s̃_i − m) over this slice's columns outside the ids, m the global max
        mask = torch.zeros((rows, width + 1), dtype=torch.bool, device=student.device)
        mask.scatter_(1, torch.where(owned, local, width), True)
        outside = u.masked_fill(mask[:, :width], float("-inf"))
        top = outside.detach().amax(1) if width > 0 else u.new_full((rows,), float("-inf")).detach()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        top = torch.where(top == float("-inf"), 0.0, top)
        part = torch.cat([part, torch.exp(outside - top[:, None]).sum(1, keepdim=True)], 1)
    part = part + torch.where(bad, float("nan"), 0.0).to(compute)[:, None]  # to loss and grad
    total = _SumOverRanks.apply(part, group)
    inf = torch.tensor(float("-inf"), dtype=compute, device=student.device)
    values = torch.where(present, total[:, :k], inf)
    if with_tail:
        # Ids covering the row: a sum of 0, kept out of the log so that no 0·∞ reaches autograd.
        sum_exp = torch.where(full, 1.0, total[:, k])
        tail = torch.where(full, inf, top + torch.log(sum_exp))
    else:
        tail = torch.zeros_like(total[:, 0])  # never read: finite, so no row is all −inf
    compact = torch.cat([values, tail[:, None]], 1)
    categories = torch.cat([present, full[:, None]], 1) | full[:, None]
    column = torch.arange(k + 1, device=ids.device, dtype=ids.dtype)
    return compact, torch.where(categories, column, -1)


def distill_topk(
    student2d: Tensor,
    ids: Tensor,
    logprobs: Tensor,
    target1d: Tensor | None,
    class_weight: Tensor | None,
    topk_options: tuple,
    *,
    process_group: Any,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """The sharded form behind ``xent.distill(..., teacher=xent.TopK(...), process_group=pg)``.

    student2d [N, V_local] this rank's slice; ids, logprobs [N, k] the whole teacher (global
    ids), the same on every rank; target1d [N] global ids (or None); class_weight the local slice
    of the hard term's class weights. topk_options as DistillTopKFunction's. Returns the loss,
    the same on every rank; autograd gives each rank the gradient of its slice.

    Collectives: one all_reduce(SUM) of [N, k] (renormalize) or [N, k + 1] (tail, ignore: also
    preceded by an all_reduce(MAX) of [N]), and the hard term's all_gather of [N, 9] records
    when hard_weight != 0. Memory beyond the gradient: the slice in float32 (float64 for float64
    logits) when it is of another dtype or softcapped; for tail and ignore also an N×(V_local+1)
    bool mask of the ids and two N×V_local float32 (float64) arrays, the slice outside the ids
    and its exponentials (kept for the backward). Written in torch ops on the slice; the
    backward (autograd's) adds a gradient scattered from the ids and, for tail and ignore, the
    products of the exponentials: a few N×V_local arrays at once."""
    function = "distill"
    _refuse_dtensor(function, "student_logits", student2d)
    _refuse_dtensor(function, "class_weight", class_weight)
    if ids.dtype not in (torch.int32, torch.int64):
        _fail(function, "teacher.ids", "wrong dtype", ids.dtype, "int32 or int64")
    if ids.device != student2d.device:
        _fail(function, "teacher.ids", "on another device", ids.device, str(student2d.device))
    mass, kind, temperature, beta, softcap = topk_options[:5]
    soft_weight, hard_weight, ignore_index, reduction, label_smoothing, z_loss = topk_options[5:]
    layout = vocab_layout(
        student2d.shape[-1], process_group, student2d.device, vocab_offset, vocab_size, function
    )
    _check_values(hard_weight, softcap, target1d, ignore_index, class_weight, layout[1])
    compact, compact_ids = _compact_student(student2d, ids, mass, softcap, layout, process_group)
    extra = torch.full_like(logprobs[:, :1], float("-inf"))
    compact_logprobs = torch.cat([logprobs.masked_fill(ids < 0, float("-inf")), extra], 1)
    compact_target = None
    if target1d is not None:  # only which rows count: any valid compact id for the others
        stand_in = 0 if ignore_index != 0 else 1
        compact_target = torch.where(target1d == ignore_index, target1d, stand_in)
    # The hard term leaves the compact call (which still checks its options): the sharded
    # cross_entropy below takes it.
    options = (mass, kind, temperature, beta, None, soft_weight, 0.0, ignore_index, reduction)
    options = (*options, label_smoothing, z_loss)
    args = (compact, compact_ids, compact_logprobs, compact_target, None, options)
    if compact.requires_grad:
        loss = DistillTopKFunction.apply(*args, "recompute", None)
    else:
        loss = ops.distill_topk_forward(*args[:5], *options)
    if hard_weight != 0.0 and target1d is not None:
        hard = _distributed.cross_entropy(
            student2d,
            target1d,
            class_weight,
            None,
            (ignore_index, reduction, label_smoothing, z_loss, softcap, 1.0),
            False,
            process_group=process_group,
            vocab_offset=layout[0],
            vocab_size=layout[1],
        )[0]
        loss = loss + hard_weight * hard
    return loss
