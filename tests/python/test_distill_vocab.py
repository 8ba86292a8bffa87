"""Student and teacher vocabularies of different sizes, vocab_size=V' (docs/semantics.md §3.2):
distill with full and top-k teachers, linear_distill with both teacher forms, the modules, against
the float64 reference on the first V' columns with the gradient padded by zeros; errors."""

import pytest
import reference as ref
import torch

import xent

KINDS = list(xent.DISTILL_KINDS)
ROWS, HIDDEN, TEACHER_HIDDEN = 29, 37, 23
# (student width, teacher width, V'): the student wider, narrower, and both past an odd V'.
WIDTHS = [(521, 509, 503), (509, 521, 509), (515, 515, 497)]
WIDTH_IDS = ["student_wider", "student_narrower", "both_padded"]


def _tie_slack(kind, loss_of, s64, upstream, logits):
    """tvd's near-ties may land on either side in fp32 (reference.tvd_tie_slack)."""
    if kind != "tvd":
        return 0.0
    return ref.tvd_tie_slack(loss_of, [s64], upstream, ref.fp32_tvd_tie_band(*logits))[0]


def _check_grad(grad, grad_expected, shared, tol):
    assert torch.count_nonzero(grad[:, shared:]) == 0  # exactly 0, not small
    assert ref.rel_error(grad[:, :shared], grad_expected[:, :shared]) <= tol


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("widths", WIDTHS, ids=WIDTH_IDS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"temperature": 1.7, "softcap": 4.0, "reduction": "sum"},
        {"hard_weight": 0.5, "label_smoothing": 0.1, "class_weight": True, "reduction": "none"},
        {"grad_in_forward": False},
        {"inplace_backward": True, "reduction": "sum"},
    ],
    ids=["plain", "T+softcap", "hard+class_weight", "recompute", "inplace"],
)
def test_distill_vocab_against_reference(device, gen, kind, widths, options):
    width_s, width_t, shared = widths
    student = ref.randn(gen, ROWS, width_s, scale=2.0)
    teacher = ref.randn(gen, ROWS, width_t, scale=2.0)
    target = ref.targets(gen, ROWS, shared)
    options = dict(options)
    if options.get("class_weight"):  # the student's width: entries past V' are not read
        options["class_weight"] = torch.rand(width_s, generator=gen) + 0.5
    ref_options = {
        k: v for k, v in options.items() if k not in ("grad_in_forward", "inplace_backward")
    }
    if "class_weight" in ref_options:
        ref_options["class_weight"] = ref_options["class_weight"][:shared]
    on_device = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in options.items()}
    s = student.to(device).requires_grad_()
    s_input = s.clone() if options.get("inplace_backward") else s  # a non-leaf takes it in place
    loss = xent.distill(
        s_input, teacher.to(device), target.to(device), kind=kind, vocab_size=shared, **on_device
    )
    s64 = student.double().requires_grad_()

    def loss_of(band=0.0):
        return ref.distill(
            s64[:, :shared],
            teacher.double()[:, :shared],
            target,
            kind=kind,
            tvd_tie_band=band,
            **ref_options,
        )

    expected = loss_of()
    assert loss.shape == expected.shape
    assert ref.rel_error(loss, expected) <= 1e-5
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64) + 0.5
    slack = _tie_slack(kind, loss_of, s64, upstream, (student, teacher))
    (grad,) = torch.autograd.grad(loss, [s], upstream.float().to(device))
    (grad_expected,) = torch.autograd.grad(expected, [s64], upstream)
    assert grad.shape == s.shape
    _check_grad(grad.cpu(), grad_expected, shared, 1e-5 + slack)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("widths", WIDTHS, ids=WIDTH_IDS)
def test_distill_vocab_bf16(device, gen, kind, widths):
    """bf16 operands of their own odd row strides (unaligned rows on a GPU): the loss against the
    reference on the rounded inputs, the gradient within its own bf16 rounding (docs/semantics.md
    §6, as the C++ suites' grad_tolerance)."""
    width_s, width_t, shared = widths
    student = ref.randn(gen, ROWS, width_s, scale=2.0).bfloat16()
    teacher = ref.randn(gen, ROWS, width_t, scale=2.0).bfloat16()
    s = student.to(device).requires_grad_()
    loss = xent.distill(s, teacher.to(device), kind=kind, vocab_size=shared, reduction="sum")
    s64 = student.double().requires_grad_()
    expected = ref.distill(
        s64[:, :shared], teacher.double()[:, :shared], kind=kind, reduction="sum"
    )
    assert ref.rel_error(loss, expected) <= 1e-5
    (grad,) = torch.autograd.grad(loss, [s])
    (grad_expected,) = torch.autograd.grad(expected, [s64])
    assert grad.dtype == torch.bfloat16
    bf16_rounding = ref.rel_error(grad_expected.bfloat16(), grad_expected)
    _check_grad(grad.cpu().double(), grad_expected, shared, bf16_rounding + 1e-3)


@pytest.mark.parametrize("widths", WIDTHS, ids=WIDTH_IDS)
def test_distill_vocab_float64(gen, widths):
    """float64 in, float64 out (a CPU dtype: docs/semantics.md §6)."""
    device = "cpu"
    width_s, width_t, shared = widths
    student = ref.randn(gen, ROWS, width_s, dtype=torch.float64, device=device, scale=2.0)
    teacher = ref.randn(gen, ROWS, width_t, dtype=torch.float64, device=device, scale=2.0)
    s = student.clone().requires_grad_()
    loss = xent.distill(s, teacher, kind="jsd", vocab_size=shared)
    assert loss.dtype == torch.float64
    s64 = student.cpu().clone().requires_grad_()
    expected = ref.distill(s64[:, :shared], teacher.cpu()[:, :shared], kind="jsd")
    assert ref.rel_error(loss, expected) <= 1e-12
    (grad,) = torch.autograd.grad(loss, [s])
    (grad_expected,) = torch.autograd.grad(expected, [s64])
    assert grad.dtype == torch.float64
    _check_grad(grad.cpu(), grad_expected, shared, 1e-12)


@pytest.mark.parametrize("teacher_form", ["logits", "topk"])
def test_padded_columns_change_nothing(device, gen, teacher_form):
    """A huge logit past V' (in both student and teacher) would dominate either softmax if it
    were read: the loss and gradient equal those of the same rows with zeros there."""
    width_s, width_t, shared = WIDTHS[0]
    student = ref.randn(gen, ROWS, width_s, device=device, scale=2.0)
    teacher = ref.randn(gen, ROWS, width_t, device=device, scale=2.0)
    target = ref.targets(gen, ROWS, shared, device)
    results = []
    for fill in (0.0, 1e4):
        s = student.clone()
        s[:, shared:], t = fill, teacher.clone()
        t[:, shared:] = fill
        s.requires_grad_()
        if teacher_form == "logits":
            loss = xent.distill(s, t, target, vocab_size=shared, kind="reverse_kl")
        else:
            logprobs, ids = torch.log_softmax(t[:, :shared].double(), -1).topk(16, -1)
            loss = xent.distill(
                s,
                target=target,
                teacher=xent.TopK(ids, logprobs.float(), "tail"),
                vocab_size=shared,
            )
        (grad,) = torch.autograd.grad(loss, [s])
        results.append((loss, grad))
    assert torch.isfinite(results[1][0])
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.count_nonzero(results[1][1][:, shared:]) == 0


@pytest.mark.parametrize("mass", list(xent.TOPK_MASSES))
@pytest.mark.parametrize("kind", ["forward_kl", "jsd", "tvd"])
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["fused", "recompute"])
def test_distill_topk_vocab_against_reference(device, gen, mass, kind, grad_in_forward):
    if mass == "ignore" and kind != "forward_kl":
        pytest.skip("ignore takes forward_kl and soft_ce only (test_distill_topk.py)")
    width_s, _, shared = WIDTHS[0]
    student = ref.randn(gen, ROWS, width_s, scale=2.0)
    teacher = student[:, :shared].double() + 0.6 * torch.randn(
        ROWS, shared, generator=gen, dtype=torch.float64
    )
    logprobs, ids = torch.log_softmax(teacher, -1).topk(20, -1)
    ids[3, 5:] = -1
    logprobs = logprobs.float()
    target = ref.targets(gen, ROWS, shared)
    s = student.to(device).requires_grad_()
    loss = xent.distill(
        s,
        target=target.to(device),
        teacher=xent.TopK(ids.to(device), logprobs.to(device), mass),
        kind=kind,
        reduction="sum",
        vocab_size=shared,
        grad_in_forward=grad_in_forward,
    )
    s64 = student.double().requires_grad_()

    def loss_of(band=0.0):
        return ref.distill_topk(
            s64[:, :shared], ids, logprobs, target, mass, kind=kind, reduction="sum",
            tvd_tie_band=band,
        )  # fmt: skip

    expected = loss_of()
    assert ref.rel_error(loss, expected) <= 1e-5
    upstream = torch.tensor(0.75, dtype=torch.float64)
    slack = _tie_slack(kind, loss_of, s64, upstream, (student,))
    (grad,) = torch.autograd.grad(loss, [s], upstream.float().to(device))
    (grad_expected,) = torch.autograd.grad(expected, [s64], upstream)
    _check_grad(grad.cpu(), grad_expected, shared, 1e-5 + slack)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "soft_ce"])
@pytest.mark.parametrize("widths", WIDTHS, ids=WIDTH_IDS)
@pytest.mark.parametrize("teacher_form", ["logits", "hidden"])
def test_linear_distill_vocab_against_reference(device, gen, kind, widths, teacher_form):
    width_s, width_t, shared = widths
    h = ref.randn(gen, ROWS, HIDDEN, device=device)
    w = ref.randn(gen, width_s, HIDDEN, device=device, scale=HIDDEN**-0.5 * 2)
    ht = ref.randn(gen, ROWS, TEACHER_HIDDEN, device=device)
    wt = ref.randn(gen, width_t, TEACHER_HIDDEN, device=device, scale=TEACHER_HIDDEN**-0.5 * 2)
    target = ref.targets(gen, ROWS, shared, device)
    params = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    if teacher_form == "logits":
        teacher = dict(teacher_logits=(ht.double() @ wt.double().T).float())
    else:
        teacher = dict(teacher_hidden=ht, teacher_weight=wt)
    options = dict(kind=kind, temperature=1.5, hard_weight=0.25)
    loss = xent.linear_distill(
        *params, target=target, vocab_size=shared, workspace_bytes=1 << 16, **options, **teacher
    )
    ref_params = [h.cpu().double().requires_grad_(), w.cpu().double().requires_grad_()]
    student_logits = ref.linear_logits(
        ref_params[0], ref_params[1][:shared], round_to=torch.float32
    )
    teacher_logits = ref.linear_logits(ht.cpu(), wt.cpu()[:shared], round_to=torch.float32)
    expected = ref.distill(student_logits, teacher_logits, target.cpu(), **options)
    assert ref.rel_error(loss, expected) <= 1e-4
    grads = torch.autograd.grad(loss, params)
    grads_expected = torch.autograd.grad(expected, ref_params)
    assert grads[1].shape == w.shape
    assert torch.count_nonzero(grads[1][shared:]) == 0  # the head's rows past V'
    assert ref.rel_error(grads[0], grads_expected[0]) <= 1e-4
    assert ref.rel_error(grads[1][:shared], grads_expected[1][:shared]) <= 1e-4


def test_modules_take_vocab_size(device, gen):
    width_s, width_t, shared = WIDTHS[0]
    h = ref.randn(gen, ROWS, HIDDEN, device=device)
    w = ref.randn(gen, width_s, HIDDEN, device=device, scale=HIDDEN**-0.5 * 2)
    ht = ref.randn(gen, ROWS, TEACHER_HIDDEN, device=device)
    wt = ref.randn(gen, width_t, TEACHER_HIDDEN, device=device, scale=TEACHER_HIDDEN**-0.5 * 2)
    target = ref.targets(gen, ROWS, shared, device)
    plain = xent.nn.DistillationLoss("jsd", 2.0, vocab_size=shared)(h @ w.T, ht @ wt.T, target)
    fused = xent.nn.LinearDistillationLoss("jsd", 2.0, vocab_size=shared)(
        h, w, None, target, teacher_input=ht, teacher_weight=wt
    )
    expected = ref.distill(
        (h @ w[:shared].T).cpu().double(),
        (ht @ wt[:shared].T).cpu().double(),
        target.cpu(),
        kind="jsd",
        temperature=2.0,
    )
    assert ref.rel_error(plain, expected) <= 1e-5
    assert ref.rel_error(fused, expected) <= 1e-4
    assert "vocab_size=503" in repr(xent.nn.DistillationLoss(vocab_size=503))


def _error_inputs(gen):
    student = ref.randn(gen, ROWS, 13)
    teacher = ref.randn(gen, ROWS, 11)
    return student, teacher, ref.targets(gen, ROWS, 9)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s, t, y: xent.distill(s, t, y), r"shape mismatch.*vocab_size="),
        (lambda s, t, y: xent.distill(s, t, y, vocab_size=12), r"vocab_size out of range"),
        (lambda s, t, y: xent.distill(s, t, y, vocab_size=0), r"vocab_size out of range"),
        (lambda s, t, y: xent.distill(s, t, y, vocab_size=9.0), r"vocab_size is not an int"),
        (
            lambda s, t, y: xent.distill(s, t, y.clamp(min=0) + 9, vocab_size=9, hard_weight=1.0),
            r"target out of range.*\[0, 9\)",
        ),
        (lambda s, t, y: xent.distill(s[:-1], t[:, :13], y), r"shape mismatch"),
        (
            lambda s, t, y: xent.distill(
                s,
                target=y,
                teacher=xent.TopK(torch.full((ROWS, 2), 10), torch.full((ROWS, 2), -1.0)),
                vocab_size=9,
            ),
            r"teacher.ids out of range.*\[0, 9\)",
        ),
        (
            lambda s, t, y: xent.distill(
                s,
                target=y,
                teacher=xent.TopK(torch.zeros(ROWS, 1, dtype=torch.long), torch.zeros(ROWS, 1)),
                vocab_size=14,
            ),
            r"vocab_size out of range",
        ),  # fmt: skip
        (
            lambda s, t, y: xent.linear_distill(torch.zeros(ROWS, 4), torch.zeros(13, 4), t, y),
            r"teacher_logits shape mismatch.*vocab_size=",
        ),
        (
            lambda s, t, y: xent.linear_distill(
                torch.zeros(ROWS, 4),
                torch.zeros(13, 4),
                None,
                y,
                teacher_hidden=torch.zeros(ROWS, 3),
                teacher_weight=torch.zeros(11, 3),
            ),
            r"teacher_weight shape mismatch.*vocab_size=",
        ),
        (
            lambda s, t, y: xent.linear_distill(
                torch.zeros(ROWS, 4), torch.zeros(13, 4), t, y, vocab_size=12
            ),
            r"vocab_size out of range",
        ),
    ],
    ids=[
        "widths_without_vocab_size",
        "above_narrower",
        "zero",
        "not_int",
        "target_past_shared",
        "rows_differ",
        "topk_id_past_shared",
        "topk_above_student",
        "linear_logits_widths",
        "linear_head_widths",
        "linear_above_narrower",
    ],
)
def test_vocab_errors(gen, call, message):
    student, teacher, target = _error_inputs(gen)
    with pytest.raises(ValueError, match=message):
        call(student, teacher, target)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_topk_id_past_shared_is_a_nan_row(gen):
    """On a GPU ids are not read on the host: an id in [V', V_s) makes its row NaN (§3.1)."""
    width_s, _, shared = WIDTHS[0]
    student = ref.randn(gen, ROWS, width_s, device="cuda")
    logprobs, ids = torch.log_softmax(student[:, :shared].double(), -1).topk(8, -1)
    ids[4, 0] = shared  # a real column of the student, but past V'
    loss = xent.distill(
        student,
        teacher=xent.TopK(ids, logprobs.float()),
        reduction="none",
        vocab_size=shared,
    )
    bad = torch.isnan(loss).cpu()
    assert bad[4] and bad.sum() == 1


@pytest.mark.parametrize("mode", ["fused", "recompute"])  # inplace_backward does not compile
def test_distill_vocab_compiles(gen, mode):
    width_s, width_t, shared = WIDTHS[0]
    student = ref.randn(gen, ROWS, width_s)
    teacher = ref.randn(gen, ROWS, width_t)
    options = {"grad_in_forward": mode != "recompute"}

    def step(s):
        return xent.distill(s, teacher, vocab_size=shared, reduction="sum", **options)

    results = []
    for run in (step, torch.compile(step, fullgraph=True)):
        s = student.clone().requires_grad_()
        loss = run(s)
        (grad,) = torch.autograd.grad(loss, [s])
        results.append((loss, grad))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    assert torch.count_nonzero(results[1][1][:, shared:]) == 0
