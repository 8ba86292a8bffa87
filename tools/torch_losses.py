"""The losses compare_torch.py times: PyTorch written as training code writes it, and the
optional libraries (Liger-Kernel, Cut Cross-Entropy, xent's own binding) behind one signature:
a function of the input dict {logits, teacher, hidden, weight, teacher_hidden, teacher_weight,
target, topk_ids, topk_logprobs} returning the scalar mean loss.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compared_loss(log_ps, log_pt, kind: str, beta: float = 0.5):
    """docs/semantics.md §3's loss of each row between two distributions given as their
    log-probabilities over the same categories (last dimension), written as PyTorch users write it.
    """
    if kind == "forward_kl":
        return F.kl_div(log_ps, log_pt, log_target=True, reduction="none").sum(-1)
    if kind == "reverse_kl":
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    if kind == "jsd":
        ps, pt = log_ps.exp(), log_pt.exp()
        log_m = (beta * pt + (1 - beta) * ps).log()
        return (beta * pt * (log_pt - log_m) + (1 - beta) * ps * (log_ps - log_m)).sum(-1)
    if kind == "soft_ce":
        return -(log_pt.exp() * log_ps).sum(-1)
    if kind == "tvd":
        return 0.5 * (log_pt.exp() - log_ps.exp()).abs().sum(-1)
    raise ValueError(kind)


def distill_loss(student, teacher, kind: str, beta: float = 0.5):
    """docs/semantics.md §3 at temperature 1, mean over rows."""
    log_ps = F.log_softmax(student.float(), dim=-1)
    log_pt = F.log_softmax(teacher.float(), dim=-1)
    return compared_loss(log_ps, log_pt, kind, beta).mean()


def distill_topk_rows(student, ids, logprobs, kind: str, mass: str, beta: float = 0.5):
    """Per-row losses of docs/semantics.md §3.1 at temperature 1 against a teacher given as k ids
    and log-probabilities a row, every id present (the tool's teachers have no -1 entries). The
    student is computed in fp32, or in float64 when given so (the tool's reference)."""
    dtype = torch.promote_types(student.dtype, torch.float32)
    log_ps = F.log_softmax(student.to(dtype), dim=-1)
    ell = logprobs.to(dtype)
    at_ids = log_ps.gather(1, ids)
    if mass == "renormalize":  # both restricted to the ids
        return compared_loss(at_ids.log_softmax(-1), ell.log_softmax(-1), kind, beta)
    if mass == "ignore":  # the student's whole distribution, the teacher's tail dropped
        return compared_loss(at_ids, ell, kind, beta)
    if ids.shape[1] == student.shape[1]:  # the ids cover the vocabulary: no tail category
        return compared_loss(at_ids, ell, kind, beta)
    # One more category for the mass outside the ids: the student's as a logsumexp over the
    # other columns (1 - Σ p would cancel), the teacher's kept above 0 so its log stays finite.
    student_tail = log_ps.scatter(1, ids, float("-inf")).logsumexp(-1, keepdim=True)
    teacher_tail = (1 - ell.exp().sum(-1, keepdim=True)).clamp_min(torch.finfo(dtype).tiny)
    return compared_loss(
        torch.cat([at_ids, student_tail], -1),
        torch.cat([ell, teacher_tail.log()], -1),
        kind,
        beta,
    )


def chunked_linear_distill_topk(case: dict, rows: int = 1024):
    """The top-k loss of h·Wᵀ a chunk of rows at a time, as a careful PyTorch user writes it
    without a fused kernel: torch.utils.checkpoint around each chunk, so the forward keeps no
    chunk's logits and the backward forms each chunk's logits again (one more h·Wᵀ per chunk)
    before its products. Returns the mean over rows."""
    kind, mass = case.get("kind", "forward_kl"), case["topk_mass"]

    def chunk_sum(hidden, weight, ids, logprobs):
        return distill_topk_rows(hidden @ weight.t(), ids, logprobs, kind, mass).sum()

    def loss(x):
        hidden, weight = x["hidden"], x["weight"]
        total = 0
        for start in range(0, hidden.shape[0], rows):
            part = slice(start, start + rows)
            total = total + checkpoint(
                chunk_sum,
                hidden[part],
                weight,
                x["topk_ids"][part],
                x["topk_logprobs"][part],
                use_reentrant=False,
            )
        return total / hidden.shape[0]

    return loss


# The "every option" row of docs/performance.md: label smoothing, z-loss and softcap together.
ALL_OPTIONS = dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)


def _options(case: dict) -> dict:
    return dict(ALL_OPTIONS) if case.get("options") == "all" else {}


def _eager_ce(logits, target, case: dict):
    options = _options(case)
    reduction = case.get("reduction", "mean")
    x = logits.float()
    if "softcap" in options:
        x = options["softcap"] * torch.tanh(x / options["softcap"])
    loss = F.cross_entropy(
        x, target, reduction=reduction, label_smoothing=options.get("label_smoothing", 0.0)
    )
    if "z_loss" in options:
        z = options["z_loss"] * torch.logsumexp(x, dim=-1).square()
        loss = loss + (z if reduction == "none" else z.mean())
    return loss


def eager_loss(case: dict):
    """The loss as training code writes it in PyTorch (fp32 upcast of the logits)."""
    op, kind = case["op"], case.get("kind", "forward_kl")
    if case.get("teacher_topk"):  # on materialised student logits (h·Wᵀ for the linear op)
        mass = case["topk_mass"]

        def topk_loss(x):
            student = x["logits"] if op == "distill" else x["hidden"] @ x["weight"].t()
            return distill_topk_rows(student, x["topk_ids"], x["topk_logprobs"], kind, mass).mean()

        return topk_loss
    if op == "ce":
        return lambda x: _eager_ce(x["logits"], x["target"], case)
    if op == "linear_ce":
        return lambda x: _eager_ce(
            x["hidden"] @ x["weight"].to(x["hidden"].dtype).t(), x["target"], case
        )
    if op == "distill":
        return lambda x: distill_loss(x["logits"], x["teacher"], kind)
    return lambda x: distill_loss(
        x["hidden"] @ x["weight"].t(), x["teacher_hidden"] @ x["teacher_weight"].t(), kind
    )


def _import_xent():
    try:
        import xent.functional as xf
    except ImportError:
        # Not installed: the package built in this checkout (python/) when there is one.
        sys.path.insert(0, os.path.join(REPO, "python"))
        import xent.functional as xf
    return xf


def _topk(xf, x: dict, case: dict):
    return xf.TopK(x["topk_ids"], x["topk_logprobs"], case["topk_mass"])


def library_loss(impl: str, case: dict):
    """The loss function of an optional library for this case, or a string saying why there is
    none. Every function takes the input dict and returns the loss (per row for reduction none).
    """
    op, kind = case["op"], case.get("kind", "forward_kl")
    options = _options(case)
    reduction = case.get("reduction", "mean")
    topk = case.get("teacher_topk")
    if topk and impl in ("liger", "cce", "cce_exact", "quack"):
        return "no top-k teacher"
    if impl == "chunked":
        if not topk or op != "linear_distill":
            return "the chunked anchor is of linear_distill with a top-k teacher only"
        return chunked_linear_distill_topk(case)
    if impl == "liger":
        try:
            from liger_kernel.transformers import (
                LigerCrossEntropyLoss,
                LigerFusedLinearCrossEntropyLoss,
            )
        except ImportError as error:
            return f"not importable ({error.__class__.__name__})"
        liger_options = dict(
            label_smoothing=options.get("label_smoothing", 0.0),
            lse_square_scale=options.get("z_loss", 0.0),
            softcap=options.get("softcap"),
            reduction=reduction,
        )
        if op == "ce":
            module = LigerCrossEntropyLoss(**liger_options)
            return lambda x: module(x["logits"], x["target"])
        if op == "linear_ce":
            module = LigerFusedLinearCrossEntropyLoss(**liger_options)
            return lambda x: module(x["weight"], x["hidden"], x["target"])
        return "no comparable Liger op"
    if impl in ("cce", "cce_exact"):
        if op != "linear_ce":
            return "Cut Cross-Entropy has linear_ce only"
        if options or reduction != "mean":
            return "not measured with options"
        try:
            from cut_cross_entropy import linear_cross_entropy
        except ImportError as error:
            return f"not importable ({error.__class__.__name__})"
        if impl == "cce":  # the default: gradient blocks under a probability threshold skipped
            return lambda x: linear_cross_entropy(x["hidden"], x["weight"], x["target"])
        return lambda x: linear_cross_entropy(
            x["hidden"], x["weight"], x["target"], filter_eps=None
        )
    if impl == "quack":
        if options or reduction != "mean":
            return "not measured with options"
        try:
            if op == "ce":
                from quack.cross_entropy import cross_entropy as quack_ce

                return lambda x: quack_ce(x["logits"], x["target"], reduction="mean")
            if op == "linear_ce":
                from quack.linear_cross_entropy import chunked_linear_cross_entropy

                return lambda x: chunked_linear_cross_entropy(x["hidden"], x["weight"], x["target"])
        except Exception as error:  # the DSL can fail at import on an unsupported setup
            return f"not importable ({error.__class__.__name__}: {str(error)[:200]})"
        return "no comparable QuACK op"
    if impl == "xent_linear_ce" and (op != "linear_distill" or not topk):
        return "the linear_ce reference is of linear_distill with a top-k teacher only"
    if impl in ("xent_torch", "xent_linear_ce"):
        try:
            xf = _import_xent()
        except ImportError as error:
            return f"not importable ({error.__class__.__name__}: {error})"
        extra = {"inplace_backward": True} if case.get("inplace") else {}
        budget = (
            {} if case.get("budget_bytes") is None else {"workspace_bytes": case["budget_bytes"]}
        )
        if op == "linear_ce" and case.get("weight_grad_accumulation"):
            budget["weight_grad_accumulation"] = case["weight_grad_accumulation"]
        if op == "ce":
            return lambda x: xf.cross_entropy(
                x["logits"], x["target"], reduction=reduction, **options, **extra
            )
        if op == "linear_ce" or impl == "xent_linear_ce":
            return lambda x: xf.linear_cross_entropy(
                x["hidden"], x["weight"], x["target"], reduction=reduction, **options, **budget
            )
        if topk:
            if op != "linear_distill":
                return lambda x: xf.distill(
                    x["logits"], teacher=_topk(xf, x, case), kind=kind, reduction=reduction
                )
            return lambda x: xf.linear_distill(
                x["hidden"], x["weight"], teacher=_topk(xf, x, case), kind=kind, **budget
            )
        if op == "distill":
            return lambda x: xf.distill(
                x["logits"], x["teacher"], kind=kind, reduction=reduction, **extra
            )
        return lambda x: xf.linear_distill(
            x["hidden"],
            x["weight"],
            teacher_hidden=x["teacher_hidden"],
            teacher_weight=x["teacher_weight"],
            kind=kind,
            **budget,
        )
    raise ValueError(impl)
