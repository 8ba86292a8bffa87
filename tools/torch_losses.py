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
    """SPEC §3 at temperature 1, mean over rows, written as PyTorch users write it."""
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


def eager_loss(op: str, kind: str):
    if op == "ce":
        return lambda x: F.cross_entropy(x["logits"].float(), x["target"])
    if op == "linear_ce":
        return lambda x: F.cross_entropy((x["hidden"] @ x["weight"].t()).float(), x["target"])
    if op == "distill":
        return lambda x: distill_loss(x["logits"], x["teacher"], kind)
    return lambda x: distill_loss(x["hidden"] @ x["weight"].t(),
                                  x["teacher_hidden"] @ x["teacher_weight"].t(), kind)


def library_loss(impl: str, op: str, kind: str):
    """The loss function of an optional library, or a string saying why there is none."""
    if impl == "liger":
        try:
            from liger_kernel.transformers import (LigerCrossEntropyLoss,
                                                   LigerFusedLinearCrossEntropyLoss)
        except ImportError as error:
            return f"not importable ({error.__class__.__name__})"
        if op == "ce":
            module = LigerCrossEntropyLoss()
            return lambda x: module(x["logits"], x["target"])
        if op == "linear_ce":
            module = LigerFusedLinearCrossEntropyLoss()
            return lambda x: module(x["weight"], x["hidden"], x["target"])
        return "no comparable Liger op"
    if impl == "cce":
        if op != "linear_ce":
            return "Cut Cross-Entropy has linear_ce only"
        try:
            from cut_cross_entropy import linear_cross_entropy
        except ImportError as error:
            return f"not importable ({error.__class__.__name__})"
        return lambda x: linear_cross_entropy(x["hidden"], x["weight"], x["target"])
    if impl == "xent":
        try:
            import xent.functional as xf
        except ImportError:
            # Not installed: the package built in this checkout (python/) when there is one.
            sys.path.insert(0, os.path.join(REPO, "python"))
            try:
                import xent.functional as xf
            except ImportError as error:
                return f"not importable ({error.__class__.__name__}: {error})"
        if op == "ce":
            return lambda x: xf.cross_entropy(x["logits"], x["target"])
        if op == "linear_ce":
            return lambda x: xf.linear_cross_entropy(x["hidden"], x["weight"], x["target"])
        if op == "distill":
            return lambda x: xf.distill(x["logits"], x["teacher"], kind=kind)
        return lambda x: xf.linear_distill(x["hidden"], x["weight"],
                                           teacher_hidden=x["teacher_hidden"],
                                           teacher_weight=x["teacher_weight"], kind=kind)
    raise ValueError(impl)
