"""xent.distill with a top-k teacher (xent.TopK) against the float64 reference (docs/semantics.md
§3.1), on every device; errors; torch.compile."""

import pytest
import reference as ref
import torch

import xent

KINDS = list(xent.DISTILL_KINDS)
REDUCTIONS = ["none", "sum", "mean"]
ROWS, VOCAB, K = 29, 517, 20


def _topk_teacher(gen, student, k=K, absent=True):
    """The top-k of a teacher correlated with the student, in a shuffled order, some rows short
    (-1 entries) and one row empty."""
    teacher = student.double() + 0.6 * torch.randn(
        student.shape, generator=gen, dtype=torch.float64
    )
    logprobs, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    order = torch.argsort(torch.rand(ids.shape, generator=gen), -1)
    ids, logprobs = ids.gather(1, order), logprobs.gather(1, order).float()
    if absent:
        ids[1, 3:] = -1
        ids[2, :] = -1
        ids[6, ::2] = -1
    return ids, logprobs


def _inputs(gen, rows=ROWS, vocab=VOCAB):
    student = ref.randn(gen, rows, vocab, scale=2.0)
    return student, ref.targets(gen, rows, vocab)


def _valid(kind, mass, options):
    if mass == "ignore" and kind not in ("forward_kl", "soft_ce"):
        return False
    return mass == "renormalize" or options.get("temperature", 1.0) == 1.0


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mass", list(xent.TOPK_MASSES))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"temperature": 2.0},
        {"softcap": 3.0},
        {"hard_weight": 0.5, "soft_weight": 0.7, "label_smoothing": 0.1, "z_loss": 1e-3},
        {"no_target": True},
        {"grad_in_forward": False},
    ],
    ids=["plain", "T", "softcap", "hard+soft", "no_target", "recompute"],
)
def test_topk_against_reference(device, gen, reduction, kind, mass, options):
    if not _valid(kind, mass, options):
        pytest.skip("an error case (test_topk_errors)")
    student, target = _inputs(gen)
    options = dict(options)
    if options.pop("no_target", False):
        target = None
    ref_options = {k: v for k, v in options.items() if k != "grad_in_forward"}
    ids, logprobs = _topk_teacher(gen, student)
    s = student.to(device).requires_grad_()
    loss = xent.distill(
        s,
        target=None if target is None else target.to(device),
        teacher=xent.TopK(ids.to(device), logprobs.to(device), mass),
        kind=kind,
        reduction=reduction,
        **options,
    )
    s64 = student.double().requires_grad_()
    expected = ref.distill_topk(
        s64, ids, logprobs, target, mass, kind=kind, reduction=reduction, **ref_options
    )
    assert loss.shape == expected.shape
    assert ref.rel_error(loss, expected) <= 1e-5
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64) + 0.5
    (grad,) = torch.autograd.grad(loss, [s], upstream.float().to(device))
    (grad_expected,) = torch.autograd.grad(expected, [s64], upstream)
    slack = 0.0
    if kind == "tvd":  # near-ties may land on either side in fp32

        def loss_of(band):
            return ref.distill_topk(
                s64, ids, logprobs, target, mass, kind=kind, reduction=reduction,
                tvd_tie_band=band, **ref_options,
            )  # fmt: skip

        band = ref.fp32_tvd_tie_band(student)
        (slack,) = ref.tvd_tie_slack(loss_of, [s64], upstream, band)
    assert ref.rel_error(grad, grad_expected) <= 1e-5 + slack


def _check_grad(device, gen, student, ids, logprobs, mass, kind="forward_kl"):
    """Loss and gradient against the float64 reference, reduction sum, with a target."""
    target = ref.targets(gen, student.shape[0], student.shape[1])
    s = student.to(device).requires_grad_()
    loss = xent.distill(
        s,
        target=target.to(device),
        teacher=xent.TopK(ids.to(device), logprobs.to(device), mass),
        kind=kind,
        reduction="sum",
    )
    s64 = student.double().requires_grad_()
    expected = ref.distill_topk(s64, ids, logprobs, target, mass, kind=kind, reduction="sum")
    # A row's KL can be small against its terms (~ log V each): bound the error per row.
    scale = max(abs(expected.item()), student.shape[0])
    assert abs(loss.item() - expected.item()) <= 1e-5 * scale
    (grad,) = torch.autograd.grad(loss, [s])
    (grad_expected,) = torch.autograd.grad(expected, [s64])
    assert ref.rel_error(grad, grad_expected) <= 1e-5


@pytest.mark.parametrize("vocab,k", [(1, 1), (7, 1), (517, 64), (4099, 256), (40961, 512)])
@pytest.mark.parametrize("mass", list(xent.TOPK_MASSES))
def test_topk_shapes(device, gen, vocab, k, mass):
    """Odd V from one column up (vector sweeps with scalar heads and tails), k from 1 to 512."""
    student = ref.randn(gen, 5, vocab, scale=2.0)
    ids, logprobs = _topk_teacher(gen, student, k=k, absent=False)
    if k > 1:
        ids[1, k // 2 :] = -1
    _check_grad(device, gen, student, ids, logprobs, mass)


@pytest.mark.parametrize("mass", ["tail", "ignore"])
def test_topk_outside_far_below_the_max(device, gen, mass):
    """One id 90 above every other column: the outside sum is formed on its own (CUDA: the second
    sweep), never as 1 - sum over the ids (docs/semantics.md §3.1)."""
    student = ref.randn(gen, 4, 300, scale=2.0)
    ids, logprobs = _topk_teacher(gen, student, k=8, absent=False)
    student[torch.arange(4), ids[:, 0]] += 90.0
    _check_grad(device, gen, student, ids, logprobs, mass)


def test_topk_3d_int32_ids(gen):
    student, target = _inputs(gen, rows=2 * 13)
    ids, logprobs = _topk_teacher(gen, student)
    flat = xent.distill(student, target=target, teacher=xent.TopK(ids, logprobs), reduction="none")
    batched = xent.distill(
        student.reshape(2, 13, VOCAB),
        target=target.reshape(2, 13),
        teacher=xent.TopK(ids.int().reshape(2, 13, K), logprobs.reshape(2, 13, K)),
        reduction="none",
    )
    assert batched.shape == (2, 13)
    torch.testing.assert_close(batched.reshape(-1), flat)


def test_topk_covering_vocabulary_has_no_tail(gen):
    student, target = _inputs(gen, rows=7, vocab=23)
    ids, logprobs = _topk_teacher(gen, student, k=23, absent=False)
    tail = xent.distill(student, target=target, teacher=xent.TopK(ids, logprobs, "tail"))
    full = xent.distill(student, torch.zeros(7, 23).scatter_(1, ids, logprobs), target)
    torch.testing.assert_close(tail, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda ids, lp: (ids.clone().fill_(VOCAB), lp), "teacher.ids out of range"),
        (lambda ids, lp: (ids.clone().fill_(-3), lp), "ids[0, 0] = -3"),
        (lambda ids, lp: (torch.cat([ids[:, :1], ids[:, 1:]], 1).fill_(4), lp), "duplicate id"),
        (lambda ids, lp: (ids, lp.clone().fill_(0.25)), "teacher.logprobs above 0"),
        (lambda ids, lp: (ids, lp[:, :3]), "teacher.logprobs"),
        (lambda ids, lp: (ids[:5], lp[:5]), "teacher.ids"),
        (lambda ids, lp: (ids.float(), lp), "teacher.ids"),
    ],
    ids=["id>=V", "id<-1", "duplicate", "logprob>0", "k mismatch", "rows", "float ids"],
)
def test_topk_errors(gen, change, message):
    student, target = _inputs(gen)
    ids, logprobs = change(*_topk_teacher(gen, student, absent=False))
    with pytest.raises((ValueError, RuntimeError)) as error:
        xent.distill(student, target=target, teacher=xent.TopK(ids, logprobs))
    assert message in str(error.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"teacher_mass": "tail", "temperature": 2.0}, "renormalize"),
        ({"teacher_mass": "ignore", "kind": "jsd"}, "not defined with topk_mass ignore"),
        ({"teacher_mass": "other"}, "teacher.mass"),
        ({"inplace_backward": True}, "inplace_backward"),
    ],
)
def test_topk_option_errors(gen, kwargs, message):
    student, target = _inputs(gen)
    ids, logprobs = _topk_teacher(gen, student)
    kwargs = dict(kwargs)
    mass = kwargs.pop("teacher_mass", "renormalize")
    with pytest.raises((ValueError, RuntimeError)) as error:
        xent.distill(
            student.requires_grad_(),
            target=target,
            teacher=xent.TopK(ids, logprobs, mass),
            **kwargs,
        )
    assert message in str(error.value)


@pytest.mark.parametrize("mass", ["renormalize", "tail"])
def test_topk_gradient_in_place_matches(device, gen, mass):
    # The op linear_distill's chunks take: the gradient over the logits, as the other op forms it.
    from xent._ops import ops

    student = ref.randn(gen, 9, 301, scale=2.0).float().to(device)
    ids, logprobs = _topk_teacher(gen, student.cpu(), k=13)
    ids, logprobs = ids.to(device), logprobs.float().to(device)
    target = ref.targets(gen, 9, 301).to(device)
    options = ("forward_kl", 1.0, 0.5, None, 1.0, 0.5, -100, "sum", 0.1, 0.0)
    loss, grad = ops.distill_topk_forward_grad(
        student, ids, logprobs, target, None, mass, *options, None
    )
    logits = student.clone()
    loss_in_place = ops.distill_topk_forward_grad_inplace(
        logits, ids, logprobs, target, None, mass, *options, None
    )
    torch.testing.assert_close(loss_in_place, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(logits, grad, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="student cannot take the gradient in place"):
        ops.distill_topk_forward_grad_inplace(
            student.t().contiguous().t(), ids, logprobs, target, None, mass, *options, None
        )


def test_topk_teacher_and_logits_together_is_an_error(gen):
    student, target = _inputs(gen)
    ids, logprobs = _topk_teacher(gen, student)
    with pytest.raises(ValueError, match="given twice"):
        xent.distill(student, student, target, teacher=xent.TopK(ids, logprobs))


def test_topk_compiles(gen):
    student, target = _inputs(gen)
    ids, logprobs = _topk_teacher(gen, student)

    def step(s):
        return xent.distill(s, target=target, teacher=xent.TopK(ids, logprobs, "tail"))

    s = student.clone().requires_grad_()
    eager = step(s)
    (grad_eager,) = torch.autograd.grad(eager, [s])
    compiled = torch.compile(step, fullgraph=True)(s)
    (grad_compiled,) = torch.autograd.grad(compiled, [s])
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grad_compiled, grad_eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("vocab", [131071, 262147])
@pytest.mark.parametrize("mass", list(xent.TOPK_MASSES))
@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard+soft"])
def test_topk_long_bf16_rows_on_cuda(gen, vocab, mass, hard):
    """bf16 rows split over a cluster of CTAs on Hopper (4 and 8 slices of the row), k = 64, with
    and without the hard-label term."""
    student = ref.randn(gen, 3, vocab, scale=2.0).bfloat16().double()
    target = ref.targets(gen, 3, vocab)
    ids, logprobs = _topk_teacher(gen, student, k=64, absent=False)
    options = {"hard_weight": 0.5, "soft_weight": 0.7, "label_smoothing": 0.1} if hard else {}
    s = student.bfloat16().cuda().requires_grad_()
    loss = xent.distill(
        s,
        target=target.cuda(),
        teacher=xent.TopK(ids.cuda(), logprobs.cuda(), mass),
        reduction="none",
        **options,
    )
    s64 = student.clone().requires_grad_()
    expected = ref.distill_topk(s64, ids, logprobs, target, mass, reduction="none", **options)
    assert ref.rel_error(loss, expected) <= 1e-4
    upstream = torch.rand(3, generator=gen, dtype=torch.float64) + 0.5
    (grad,) = torch.autograd.grad(loss, [s], upstream.float().cuda())
    (grad_expected,) = torch.autograd.grad(expected, [s64], upstream)
    assert ref.rel_error(grad.double(), grad_expected) <= 1e-2  # bf16 output rounding
