"""The losses compare_torch.py times: PyTorch written as training code writes it, and the
optional libraries (Liger-Kernel, Cut Cross-Entropy, xent's own binding) behind one signature:
a function of the input dict {logits, teacher, hidden, weight, teacher_hidden, teacher_weight,
target} returning the scalar mean loss.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def distill_loss(student, teacher, kind: str, beta: float = 0.5):
    """docs/semantics.md §3 at temperature 1, mean over rows, written as PyTorch users write it."""
    log_ps = F.log_softmax(student.float(), dim=-1)
    log_pt = F.log_softmax(teacher.float(), dim=-1)
    if kind == "forward_kl":
        return F.kl_div(log_ps, log_pt, log_target=True, reduction="batchmean")
    if kind == "reverse_kl":
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1).mean()
    if kind == "jsd":
        ps, pt = log_ps.exp(), log_pt.exp()
        log_m = (beta * pt + (1 - beta) * ps).log()
        return (beta * pt * (log_pt - log_m) + (1 - beta) * ps * (log_ps - log_m)).sum(-1).mean()
    if kind == "soft_ce":
        return -(log_pt.exp() * log_ps).sum(-1).mean()
    if kind == "tvd":
        return 0.5 * (log_pt.exp() - log_ps.exp()).abs().sum(-1).mean()
    raise ValueError(kind)


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


def library_loss(impl: str, case: dict):
    """The loss function of an optional library for this case, or a string saying why there is
    none. Every function takes the input dict and returns the loss (per row for reduction none).
    """
    op, kind = case["op"], case.get("kind", "forward_kl")
    options = _options(case)
    reduction = case.get("reduction", "mean")
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
    if impl == "xent_torch":
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
        if op == "linear_ce":
            return lambda x: xf.linear_cross_entropy(
                x["hidden"], x["weight"], x["target"], reduction=reduction, **options, **budget
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
