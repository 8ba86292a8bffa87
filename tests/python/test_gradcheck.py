"""torch.autograd.gradcheck of every op and option at gradcheck's default tolerances.

float64 inputs on the CPU run float64 math and return float64 losses (docs/semantics.md), so the
finite differences of gradcheck's default step (eps 1e-6, atol 1e-5, rtol 1e-3) resolve any wrong
gradient term, where a float32 loss needed eps 1e-3 / atol 2e-3. Shapes are tiny: each check
perturbs every input element twice.
"""

import pytest
import reference as ref
import torch

import xent

REDUCTIONS = ["none", "sum", "mean"]
KINDS = ["forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd"]
ROWS, VOCAB, HIDDEN = 5, 7, 3
# Row 2 is ignored in every case, so each check covers an ignore_index row.
TARGET = torch.tensor([0, 6, -100, 3, 2])

CE_OPTIONS = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 0.05},
    "softcap": {"softcap": 2.0},
    "logit_scale": {"logit_scale": 1.5},
    "class_weight": {"class_weight": True},
    "row_weight": {"row_weight": True},
    "ignore_index": {"ignore_index": -1},
    "all": {
        "label_smoothing": 0.1,
        "z_loss": 0.05,
        "softcap": 2.0,
        "logit_scale": 1.5,
        "class_weight": True,
        "row_weight": True,
    },
}


def _ce_kwargs(gen, name, rows=ROWS, vocab=VOCAB):
    kwargs = dict(CE_OPTIONS[name])
    if kwargs.get("class_weight"):
        kwargs["class_weight"] = torch.rand(vocab, generator=gen, dtype=torch.float64) + 0.5
    if kwargs.get("row_weight"):
        # Negative weights too (RL advantages).
        kwargs["row_weight"] = torch.rand(rows, generator=gen, dtype=torch.float64) * 2 - 0.5
    target = TARGET.clone()
    if kwargs.get("ignore_index") == -1:
        target[2] = -1
    return kwargs, target


def _randn(gen, *shape):
    return ref.randn(gen, *shape, dtype=torch.float64).requires_grad_()


def _check(function, inputs):
    # gradcheck's defaults: eps 1e-6, atol 1e-5, rtol 1e-3.
    assert torch.autograd.gradcheck(function, inputs)


def test_float64_in_float64_out(gen):
    x = _randn(gen, ROWS, VOCAB)
    for reduction in REDUCTIONS:
        result = xent.cross_entropy(x, TARGET, reduction=reduction, return_stats=True)
        for name in ("loss", "lse", "logprob", "entropy", "accuracy", "z_loss"):
            assert getattr(result, name).dtype == torch.float64, (reduction, name)
    h, w = _randn(gen, ROWS, HIDDEN), _randn(gen, VOCAB, HIDDEN)
    assert xent.linear_cross_entropy(h, w, TARGET).dtype == torch.float64
    assert xent.distill(x, x.detach() + 1, TARGET).dtype == torch.float64
    assert xent.linear_distill(h, w, x.detach(), TARGET).dtype == torch.float64
    # ... and float32 out for float32 in.
    assert xent.cross_entropy(x.detach().float(), TARGET).dtype == torch.float32


@pytest.mark.parametrize("option", list(CE_OPTIONS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy(gen, reduction, option):
    kwargs, target = _ce_kwargs(gen, option)
    x = _randn(gen, ROWS, VOCAB)
    _check(
        lambda x: xent.cross_entropy(
            x, target, reduction=reduction, grad_in_forward=False, **kwargs
        ),
        (x,),
    )


def test_cross_entropy_mean_with_zero_target_weight(gen):
    # D = 0, N_valid > 0: the ℓ part is 0 and the z-loss part keeps its N_valid divisor.
    x = _randn(gen, ROWS, VOCAB)
    class_weight = torch.rand(VOCAB, generator=gen, dtype=torch.float64) + 0.5
    class_weight[TARGET[TARGET != -100]] = 0
    _check(
        lambda x: xent.cross_entropy(
            x,
            TARGET,
            class_weight=class_weight,
            z_loss=0.05,
            label_smoothing=0.1,
            grad_in_forward=False,
        ),
        (x,),
    )


# Every op recomputes its gradient in the backward here: gradcheck runs several backward
# passes through one forward, which a gradient formed in the forward and scaled in place by the
# first backward refuses (test_linear_ce checks that form against this one).
@pytest.mark.parametrize("option", list(CE_OPTIONS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_cross_entropy(gen, reduction, option):
    kwargs, target = _ce_kwargs(gen, option)
    inputs = (_randn(gen, ROWS, HIDDEN), _randn(gen, VOCAB, HIDDEN), _randn(gen, VOCAB))
    _check(
        lambda h, w, b: xent.linear_cross_entropy(
            h, w, target, b, reduction=reduction, grad_in_forward=False, **kwargs
        ),
        inputs,
    )


DISTILL_OPTIONS = {
    "plain": {},
    "temperature": {"temperature": 1.7},
    "softcap": {"softcap": 2.0},
    "hard_and_soft": {
        "hard_weight": 0.4,
        "soft_weight": 0.7,
        "label_smoothing": 0.1,
        "z_loss": 0.05,
        "class_weight": True,
    },
    "no_target": {"no_target": True},
    "ignore_index": {"ignore_index": -1},
    "all": {"temperature": 1.7, "softcap": 2.0, "hard_weight": 0.4, "soft_weight": 0.7},
}


def _distill_kwargs(gen, kind, name):
    kwargs = dict(DISTILL_OPTIONS[name], kind=kind)
    if kind == "jsd":
        kwargs["beta"] = 0.3
    if kwargs.get("class_weight"):
        kwargs["class_weight"] = torch.rand(VOCAB, generator=gen, dtype=torch.float64) + 0.5
    target = TARGET.clone()
    if kwargs.pop("no_target", False):
        target = None
    elif kwargs.get("ignore_index") == -1:
        target[2] = -1
    return kwargs, target


def _smallest_tvd_gap(student_logits, teacher_logits, kwargs):
    """min |p_s − p_t| / (p_s + p_t) over every element, under the call's softcap and
    temperature: how near tvd's kink any element lies, relative to how far gradcheck's step
    moves it (≈ 1e-6 of p)."""

    def probs(x):
        cap = kwargs.get("softcap")
        if cap:
            x = cap * torch.tanh(x / cap)
        return torch.softmax(x / kwargs.get("temperature", 1.0), dim=-1)

    p_s, p_t = probs(student_logits), probs(teacher_logits)
    return ((p_s - p_t).abs() / (p_s + p_t)).min().item()


def _far_from_ties(gen, kwargs, student_logits, draw_teacher, logits_of=lambda t: t):
    """draw_teacher(gen), drawn again for tvd while some p_t (of logits_of(draw)) lies within a
    relative 1e-4 of its p_s: the kink would sit inside gradcheck's step (a gap of 9e-9 failed
    once)."""
    teacher = draw_teacher(gen)
    for _ in range(100):
        if (
            kwargs["kind"] != "tvd"
            or _smallest_tvd_gap(student_logits, logits_of(teacher), kwargs) > 1e-4
        ):
            return teacher
        teacher = draw_teacher(gen)
    raise AssertionError("no teacher draw away from tvd's ties in 100 tries")


def _teacher(gen, student_logits, kwargs):
    # Correlated with the student (as a real teacher is), and far from tvd's ties.
    student_logits = student_logits.detach()
    return _far_from_ties(
        gen,
        kwargs,
        student_logits,
        lambda g: (
            student_logits + ref.randn(g, *student_logits.shape, dtype=torch.float64)
        ).detach(),
    )


@pytest.mark.parametrize("option", list(DISTILL_OPTIONS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_distill(gen, kind, reduction, option):
    kwargs, target = _distill_kwargs(gen, kind, option)
    s = _randn(gen, ROWS, VOCAB)
    t = _teacher(gen, s, kwargs)
    _check(
        lambda s: xent.distill(s, t, target, reduction=reduction, grad_in_forward=False, **kwargs),
        (s,),
    )


@pytest.mark.parametrize("teacher", ["logits", "hidden"])
@pytest.mark.parametrize("option", ["plain", "all", "no_target", "hard_and_soft"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_linear_distill(gen, kind, reduction, option, teacher):
    kwargs, target = _distill_kwargs(gen, kind, option)
    h, w = _randn(gen, ROWS, HIDDEN), _randn(gen, VOCAB, HIDDEN)
    student_logits = h.detach() @ w.detach().T
    if teacher == "logits":
        kwargs["teacher_logits"] = _teacher(gen, student_logits, kwargs)
    else:
        kwargs["teacher_hidden"] = _far_from_ties(
            gen,
            kwargs,
            student_logits,
            lambda g: (h.detach() + ref.randn(g, ROWS, HIDDEN, dtype=torch.float64)).detach(),
            logits_of=lambda teacher_hidden: teacher_hidden @ w.detach().T,
        )
        kwargs["teacher_weight"] = w.detach().clone()
    _check(
        lambda h, w: xent.linear_distill(
            h, w, target=target, reduction=reduction, grad_in_forward=False, **kwargs
        ),
        (h, w),
    )
