"""The gradient formed in the forward pass (cross_entropy, distill with sum/mean): the same
gradient as the backward-pass form for every option, the upstream scalar applied on the device,
inplace_backward, normalizer, and the single-backward rule."""

import pytest
import reference as ref
import torch

import xent
from xent._ops import ops

CE_OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 3.0},
    {"logit_scale": 0.7},
    {"class_weight": True},
    {"row_weight": True},
    {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 3.0},
]
KINDS = ["forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd"]


def _ce_kwargs(gen, options, rows, vocab, device):
    kwargs = dict(options)
    if kwargs.get("class_weight"):
        kwargs["class_weight"] = (torch.rand(vocab, generator=gen) + 0.5).to(device)
    if kwargs.get("row_weight"):
        kwargs["row_weight"] = (torch.rand(rows, generator=gen) * 2 - 0.5).to(device)
    return kwargs


def _loss_and_grad(fn, logits, upstream, **kwargs):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, **kwargs)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    return loss.detach(), grad


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("options", CE_OPTIONS, ids=lambda o: "+".join(o) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ce_fused_gradient_matches_backward_form(device, gen, reduction, options, dtype):
    rows, vocab = 37, 1031
    logits = ref.randn(gen, rows, vocab, dtype=dtype, device=device, scale=2.0)
    target = ref.targets(gen, rows, vocab, device)
    kwargs = _ce_kwargs(gen, options, rows, vocab, device)
    upstream = torch.tensor(-1.75, device=device)  # not 1: the scaling kernel runs

    def fn(x, **kw):
        return xent.cross_entropy(x, target, reduction=reduction, **kwargs, **kw)

    fused_loss, fused = _loss_and_grad(fn, logits, upstream)
    loss, expected = _loss_and_grad(fn, logits, upstream, grad_in_forward=False)
    torch.testing.assert_close(fused_loss, loss, rtol=0, atol=0)
    # One rounding of (g·c) against c rounded then scaled: equal in fp32 to a few ulps, bf16 to
    # one rounding step.
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(fused, expected, **tol)
    # Against the float64 reference too, so both forms cannot be wrong together.
    x64 = logits.detach().cpu().double().requires_grad_()
    cpu_kwargs = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
    reference = ref.cross_entropy(x64, target.cpu(), reduction=reduction, **cpu_kwargs)
    (grad64,) = torch.autograd.grad(reference, x64, upstream.cpu().double())
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    assert ref.rel_error(fused, grad64) <= limit


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("kind", KINDS)
def test_distill_fused_gradient_matches_backward_form(device, gen, reduction, kind):
    rows, vocab = 29, 517
    student = ref.randn(gen, rows, vocab, device=device, scale=2.0)
    teacher = ref.randn(gen, rows, vocab, device=device, scale=2.0)
    target = ref.targets(gen, rows, vocab, device)
    upstream = torch.tensor(0.375, device=device)

    def fn(x, **kw):
        return xent.distill(
            x,
            teacher,
            target,
            kind=kind,
            temperature=1.5,
            hard_weight=0.25,
            label_smoothing=0.05,
            reduction=reduction,
            **kw,
        )

    fused_loss, fused = _loss_and_grad(fn, student, upstream)
    loss, expected = _loss_and_grad(fn, student, upstream, grad_in_forward=False)
    torch.testing.assert_close(fused_loss, loss, rtol=0, atol=0)
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-7)


def test_upstream_of_one_returns_the_forward_gradient(device, gen):
    logits = ref.randn(gen, 9, 301, device=device)
    target = ref.targets(gen, 9, 301, device)
    x = logits.clone().requires_grad_()
    loss = xent.cross_entropy(x, target)
    formed = loss.grad_fn.saved_tensors[0].data_ptr()  # no reference kept: autograd may steal it
    loss.backward()
    assert x.grad.data_ptr() == formed  # handed over as formed, no copy
    y = logits.clone().requires_grad_()
    xent.cross_entropy(y, target, grad_in_forward=False).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op", ["ce", "distill"])
def test_inplace_backward_writes_the_gradient_over_the_logits(device, gen, op):
    rows, vocab = 23, 401
    logits = ref.randn(gen, rows, vocab, dtype=torch.bfloat16, device=device, scale=2.0)
    teacher = ref.randn(gen, rows, vocab, dtype=torch.bfloat16, device=device, scale=2.0)
    target = ref.targets(gen, rows, vocab, device)

    def fn(x, **kw):
        if op == "ce":
            return xent.cross_entropy(x, target, label_smoothing=0.1, **kw)
        return xent.distill(x, teacher, target, kind="jsd", **kw)

    upstream = torch.tensor(2.0, device=device)
    loss, expected = _loss_and_grad(fn, logits, upstream)
    x = logits.clone().requires_grad_()
    storage = x.data_ptr()
    inplace_loss = fn(x, inplace_backward=True)
    torch.testing.assert_close(inplace_loss, loss, rtol=0, atol=0)
    # The logits now hold the gradient for an upstream of 1.
    torch.testing.assert_close(x.detach().float(), expected.float() / 2, rtol=1e-2, atol=1e-6)
    (grad,) = torch.autograd.grad(inplace_loss, x, upstream)
    assert grad.data_ptr() == storage  # no N x V tensor was added
    torch.testing.assert_close(grad, expected, rtol=1e-2, atol=1e-6)
    # loss.backward(): the gradient accumulated into .grad is the logits' storage, not a copy.
    x = logits.clone().requires_grad_()
    fn(x, inplace_backward=True).backward(upstream)
    assert x.grad.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x.grad, expected, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("op", ["ce", "distill"])
def test_inplace_backward_misuse_raises(device, gen, op):
    """Logits overwritten by their gradient must not be differentiated through afterwards: the
    op marks them dirty as PyTorch's in-place ops do, so such a use raises instead of giving a
    wrong gradient; using them before the call, or only the loss, stays correct."""
    rows, vocab = 8, 50
    h = ref.randn(gen, rows, vocab, device=device).requires_grad_()
    teacher = ref.randn(gen, rows, vocab, device=device)
    target = ref.targets(gen, rows, vocab, device)

    def fn(x, **kw):
        if op == "ce":
            return xent.cross_entropy(x, target, **kw)
        return xent.distill(x, teacher, target, kind="forward_kl", **kw)

    x = h * 2
    loss = fn(x, inplace_backward=True)
    with pytest.raises(RuntimeError, match="overwritten by their gradient"):
        (loss + (x**2).sum()).backward()
    # A tensor saved before the call sees the version counter move.
    h.grad = None
    x = h * 2
    saved = x.sin()
    loss = fn(x, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + saved.sum()).backward()
    # The loss alone: the same gradient as without inplace_backward.
    h.grad = None
    fn(h * 2, inplace_backward=True).backward()
    expected = torch.autograd.grad(fn(h * 2), h)[0]
    torch.testing.assert_close(h.grad, expected, rtol=1e-5, atol=1e-7)


def test_inplace_backward_errors(device, gen):
    logits = ref.randn(gen, 8, 33, device=device).requires_grad_()
    target = ref.targets(gen, 8, 33, device)
    with pytest.raises(
        ValueError, match="cross_entropy: inplace_backward unsupported with reduction 'none'"
    ):
        xent.cross_entropy(logits, target, reduction="none", inplace_backward=True)
    with pytest.raises(ValueError, match="inplace_backward needs grad_in_forward"):
        xent.cross_entropy(logits, target, grad_in_forward=False, inplace_backward=True)
    columns = ref.randn(gen, 33, 8, device=device).t().requires_grad_()
    with pytest.raises(ValueError, match="logits cannot take the gradient in place"):
        xent.cross_entropy(columns, target, inplace_backward=True)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["number", "tensor"])
@pytest.mark.parametrize("op", ["ce", "distill", "linear_ce"])
def test_normalizer_divides_the_sum(device, gen, op, as_tensor):
    rows, hidden, vocab = 21, 19, 257
    logits = ref.randn(gen, rows, vocab, device=device, scale=2.0)
    teacher = ref.randn(gen, rows, vocab, device=device, scale=2.0)
    h = ref.randn(gen, rows, hidden, device=device)
    w = ref.randn(gen, vocab, hidden, device=device, scale=0.3)
    target = ref.targets(gen, rows, vocab, device)
    count = 13.0
    normalizer = torch.tensor(count, device=device) if as_tensor else count

    def fn(*inputs, **kw):
        if op == "ce":
            return xent.cross_entropy(*inputs, target, reduction="sum", z_loss=1e-3, **kw)
        if op == "distill":
            return xent.distill(*inputs, teacher, target, kind="reverse_kl", reduction="sum", **kw)
        return xent.linear_cross_entropy(*inputs, target, reduction="sum", **kw)

    inputs = (logits,) if op != "linear_ce" else (h, w)
    first = [t.clone().requires_grad_() for t in inputs]
    normalized = fn(*first, normalizer=normalizer)
    normalized.backward()
    second = [t.clone().requires_grad_() for t in inputs]
    divided = fn(*second) / count
    divided.backward()
    torch.testing.assert_close(normalized, divided, rtol=1e-6, atol=1e-7)
    for a, b in zip(first, second):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_normalizer_errors(device, gen):
    logits = ref.randn(gen, 8, 33, device=device).requires_grad_()
    target = ref.targets(gen, 8, 33, device)
    with pytest.raises(ValueError, match="cross_entropy: normalizer needs reduction 'sum'"):
        xent.cross_entropy(logits, target, normalizer=4)
    with pytest.raises(ValueError, match="normalizer out of range: got 0"):
        xent.cross_entropy(logits, target, reduction="sum", normalizer=0)
    with pytest.raises(ValueError, match="normalizer is not a scalar"):
        xent.cross_entropy(logits, target, reduction="sum", normalizer=torch.ones(2))


@pytest.mark.parametrize("op", ["ce", "distill"])
def test_second_backward_raises_and_grad_in_forward_false_allows_it(device, gen, op):
    logits = ref.randn(gen, 8, 33, device=device)
    teacher = ref.randn(gen, 8, 33, device=device)
    target = ref.targets(gen, 8, 33, device)

    def fn(x, **kw):
        if op == "ce":
            return xent.cross_entropy(x, target, **kw)
        return xent.distill(x, teacher, target, **kw)

    x = logits.clone().requires_grad_()
    loss = fn(x)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through this loss ran twice"):
        loss.backward()
    y = logits.clone().requires_grad_()
    loss = fn(y, grad_in_forward=False)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(y.grad, 2 * x.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scale_op(device, gen, dtype):
    data = ref.randn(gen, 13, 77, dtype=dtype, device=device)
    for factor in (1.0, -0.3, 0.0):
        scaled = data.clone()
        ops.scale_(scaled, torch.tensor(factor, device=device))
        expected = (data.float() * factor).to(dtype)
        torch.testing.assert_close(scaled, expected, rtol=0, atol=0)
    vector = ref.randn(gen, 101, device=device)
    scaled = vector.clone()
    ops.scale_(scaled, torch.tensor(3.0, device=device))
    torch.testing.assert_close(scaled, vector * 3.0, rtol=0, atol=0)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-hidden", "autocast"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_weight_gets_an_fp32_gradient_from_bf16_products(device, gen, autocast, reduction):
    rows, hidden, vocab = 37, 67, 1031
    h = ref.randn(gen, rows, hidden, device=device)
    w = ref.randn(gen, vocab, hidden, device=device, scale=0.3)
    target = ref.targets(gen, rows, vocab, device)
    upstream = torch.rand(rows if reduction == "none" else (), generator=gen).to(device)
    h_in = (h if autocast else h.to(torch.bfloat16)).clone().requires_grad_()
    w_in = w.clone().requires_grad_()  # fp32: a master weight
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = xent.linear_cross_entropy(
            h_in, w_in, target, reduction=reduction, workspace_bytes=1 << 16
        )
    loss.backward(upstream)
    assert w_in.grad.dtype == torch.float32
    # Accumulated in fp32, not a bf16 gradient that autograd widened on the way out.
    assert (w_in.grad != w_in.grad.bfloat16().float()).any()
    # The same products on bf16 copies made by hand, the weight gradient kept in fp32 by
    # linear_cross_entropy's own arithmetic: equal up to the roundings of the bf16 path (its ∂W
    # summed in bf16 chunks). In norm: element by element, a small ∂W entry that is a sum of
    # cancelling terms can differ by more than 1 % between the two (a CUDA seed did).
    h16 = h.to(torch.bfloat16).requires_grad_()
    w16 = w.to(torch.bfloat16).requires_grad_()
    xent.linear_cross_entropy(
        h16, w16, target, reduction=reduction, workspace_bytes=1 << 16
    ).backward(upstream)
    assert ref.rel_error(w_in.grad, w16.grad.float()) <= 1e-2
    assert ref.rel_error(h_in.grad.float(), h16.grad.float()) <= 1e-2
    # And the fp32 gradient is no further from float64 than the bf16 one, within 1 %: both errors
    # are mostly the bf16 rounding of the logits' gradient, which the two share, so their order
    # can flip by noise where the bf16 path's chunk roundings add little (test_logprobs' twin).
    h64 = h.to(torch.bfloat16).double().cpu().requires_grad_()
    w64 = w.to(torch.bfloat16).double().cpu().requires_grad_()
    target, upstream = target.cpu(), upstream.cpu()
    ref.cross_entropy(h64 @ w64.t(), target, reduction=reduction).backward(upstream.double())
    assert ref.rel_error(w_in.grad, w64.grad) <= 1.01 * ref.rel_error(w16.grad, w64.grad)


def test_default_workspace_budget_policy():
    assert xent.functional.default_workspace_bytes(torch.device("cpu")) == 512 << 20
    if torch.cuda.is_available():
        device = torch.device("cuda")
        total = torch.cuda.get_device_properties(device).total_memory
        expected = max(min(4 << 30, total // 8), 1 << 30)
        assert xent.functional.default_workspace_bytes(device) == expected


def test_default_workspace_budget_never_reads_free_memory(monkeypatch):
    """min(4 GiB, total / 8), at least 1 GiB, from the device's total memory alone (faked here,
    no GPU needed): free memory and the allocator's counters are never asked, so the same call
    gets the same budget (and plan) whatever else is allocated."""
    gib = 1 << 30

    def asked(*args, **kwargs):
        raise AssertionError("the default budget read free memory")

    class Properties:
        total_memory = 0

    monkeypatch.setattr(torch.cuda, "mem_get_info", asked)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", asked)
    monkeypatch.setattr(torch.cuda, "memory_reserved", asked)
    monkeypatch.setattr(torch.cuda, "memory_allocated", asked)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties)
    device = torch.device("cuda", 0)
    for total, expected in (
        (141 * gib, 4 * gib),
        (80 * gib, 4 * gib),
        (24 * gib, 3 * gib),
        (4 * gib, 1 * gib),
    ):
        Properties.total_memory = total
        first = xent.functional.default_workspace_bytes(device)
        assert first == expected
        assert xent.functional.default_workspace_bytes(device) == first
