"""xent.distill / xent.linear_distill and their modules against float64 references (docs/semantics.md §3, §4)."""

import pytest
import reference as ref
import torch

import xent

KINDS = list(xent.DISTILL_KINDS)
REDUCTIONS = ["none", "sum", "mean"]
ROWS, HIDDEN, VOCAB = 37, 67, 1031


def _logits(gen, device, rows=ROWS, vocab=VOCAB, dtype=torch.float32):
    student = ref.randn(gen, rows, vocab, dtype=dtype, device=device, scale=2.0)
    teacher = ref.randn(gen, rows, vocab, dtype=dtype, device=device, scale=2.0)
    return student, teacher, ref.targets(gen, rows, vocab, device)


def _compare(gen, loss, expected, inputs, ref_inputs, tol, tie=None):
    """tie: (loss_of, band) for fp32 tvd, whose gradient may also differ from the reference by
    what near-ties at the kink allow (reference.tvd_tie_slack)."""
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert ref.rel_error(loss, expected) <= tol
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64) + 0.5
    grads = torch.autograd.grad(loss, inputs, upstream.to(loss.device, torch.float32))
    expected_grads = torch.autograd.grad(expected, ref_inputs, upstream)
    slacks = [0.0] * len(inputs)
    if tie is not None:
        loss_of, band = tie
        slacks = ref.tvd_tie_slack(loss_of, ref_inputs, upstream, band)
    for grad, grad_expected, slack, param in zip(grads, expected_grads, slacks, inputs):
        assert grad.dtype == param.dtype and grad.shape == param.shape
        assert ref.rel_error(grad, grad_expected) <= tol + slack


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"temperature": 2.5},
        {"softcap": 3.0, "temperature": 0.7},
        {"beta": 0.2},
        {"hard_weight": 0.5, "soft_weight": 0.7},
        {"hard_weight": 1.0, "label_smoothing": 0.1, "z_loss": 1e-3, "class_weight": True},
        {"target": None},
    ],
    ids=["plain", "T", "softcap+T", "beta", "hard+soft", "hard_options", "no_target"],
)
def test_distill_against_reference(device, gen, reduction, kind, options):
    student, teacher, target = _logits(gen, device)
    kwargs = dict(options)
    if "target" in kwargs:
        target = kwargs.pop("target")
    if kwargs.get("class_weight"):
        kwargs["class_weight"] = (torch.rand(VOCAB, generator=gen) + 0.5).to(device)
    s = student.clone().requires_grad_()
    loss = xent.distill(s, teacher, target, kind=kind, reduction=reduction, **kwargs)
    s64 = student.cpu().double().requires_grad_()
    cpu_kwargs = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
    cpu_target = target.cpu() if target is not None else None
    expected = ref.distill(
        s64, teacher.cpu(), cpu_target, kind=kind, reduction=reduction, **cpu_kwargs
    )
    tie = None
    if kind == "tvd":
        temperature = kwargs.get("temperature", 1.0)
        band = ref.fp32_tvd_tie_band(
            *(
                ref.softcapped(x.cpu().double(), kwargs.get("softcap")) / temperature
                for x in (student, teacher)
            )
        )

        def loss_of(band):
            return ref.distill(
                s64, teacher.cpu(), cpu_target, kind=kind, reduction=reduction,
                tvd_tie_band=band, **cpu_kwargs,
            )  # fmt: skip

        tie = (loss_of, band)
    _compare(gen, loss, expected, [s], [s64], 1e-5, tie)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_extreme_beta_is_exactly_zero(device, gen, beta):
    student, teacher, target = _logits(gen, device)
    s = student.clone().requires_grad_()
    loss = xent.distill(s, teacher, target, kind="jsd", beta=beta, reduction="none")
    loss.sum().backward()
    assert torch.count_nonzero(loss) == 0 and torch.count_nonzero(s.grad) == 0


def test_distill_3d_and_module(device, gen):
    student, teacher, target = _logits(gen, device, rows=2 * 13)
    s3, t3, y3 = student.reshape(2, 13, VOCAB), teacher.reshape(2, 13, VOCAB), target.reshape(2, 13)
    module = xent.nn.DistillationLoss("reverse_kl", 2.0, reduction="none")
    loss = module(s3, t3, y3)
    assert loss.shape == (2, 13)
    flat = xent.distill(
        student, teacher, target, kind="reverse_kl", temperature=2.0, reduction="none"
    )
    torch.testing.assert_close(loss.reshape(-1), flat)


def test_teacher_gets_no_gradient(gen):
    student, teacher, target = _logits(gen, "cpu")
    s, t = student.requires_grad_(), teacher.requires_grad_()
    xent.distill(s, t, target).backward()
    assert s.grad is not None and t.grad is None


def _linear_inputs(gen, device, dtype=torch.float32, teacher_hidden=45):
    h = ref.randn(gen, ROWS, HIDDEN, dtype=dtype, device=device)
    w = ref.randn(gen, VOCAB, HIDDEN, dtype=dtype, device=device, scale=HIDDEN**-0.5 * 2)
    ht = ref.randn(gen, ROWS, teacher_hidden, dtype=dtype, device=device)
    wt = ref.randn(
        gen, VOCAB, teacher_hidden, dtype=dtype, device=device, scale=teacher_hidden**-0.5 * 2
    )
    return h, w, ht, wt, ref.targets(gen, ROWS, VOCAB, device)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("teacher_form", ["logits", "hidden"])
def test_linear_distill_against_reference(device, gen, reduction, kind, teacher_form):
    h, w, ht, wt, target = _linear_inputs(gen, device)
    options = dict(kind=kind, temperature=1.5, hard_weight=0.25)
    params = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    if teacher_form == "logits":
        teacher = dict(teacher_logits=(ht.double() @ wt.double().T).float())
    else:
        teacher = dict(teacher_hidden=ht, teacher_weight=wt)
    loss = xent.linear_distill(*params, target=target, reduction=reduction, **options, **teacher)
    ref_params = [h.cpu().double().requires_grad_(), w.cpu().double().requires_grad_()]
    student_logits = ref.linear_logits(*ref_params, round_to=torch.float32)
    teacher_logits = ref.linear_logits(ht.cpu(), wt.cpu(), round_to=torch.float32)
    expected = ref.distill(
        student_logits, teacher_logits, target.cpu(), reduction=reduction, **options
    )
    # tvd's gradient jumps where p_t = p_s: the fp32 products of the op and the float64 ones of
    # the reference put a few near-equal entries on different sides, hence the wider bound.
    _compare(gen, loss, expected, params, ref_params, 1e-3 if kind == "tvd" else 1e-4)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_distill_matches_logits_path_and_module(device, gen, reduction):
    h, w, ht, wt, target = _linear_inputs(gen, device)
    module = xent.nn.LinearDistillationLoss("jsd", 2.0, 0.3, reduction, workspace_bytes=1 << 20)
    fused = module(h, w, None, target, teacher_input=ht, teacher_weight=wt)
    plain = xent.distill(
        h @ w.T, ht @ wt.T, target, kind="jsd", temperature=2.0, beta=0.3, reduction=reduction
    )
    assert ref.rel_error(fused, plain) <= 1e-4


def test_linear_distill_under_autocast(gen):
    h, w, ht, wt, target = _linear_inputs(gen, "cpu")
    teacher_logits = ht @ wt.T
    params = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = xent.linear_distill(*params, teacher_logits, target)
        fused_teacher = xent.linear_distill(
            h, w, None, target, teacher_hidden=ht, teacher_weight=wt
        )
    assert loss.dtype == torch.float32
    plain = xent.distill((h.bfloat16() @ w.bfloat16().T), teacher_logits.bfloat16(), target)
    torch.testing.assert_close(loss, plain, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_teacher, plain, rtol=2e-2, atol=2e-2)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
