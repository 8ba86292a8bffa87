"""xent.linear_cross_entropy and xent.nn.LinearCrossEntropyLoss against float64 references
built from torch.nn.functional on h·Wᵀ + b (docs/semantics.md §2)."""

import re

import pytest
import reference as ref
import torch
import torch.nn.functional as F

import xent

REDUCTIONS = ["none", "sum", "mean"]
ROWS, HIDDEN, VOCAB = 37, 67, 1031


def _inputs(
    gen, device, rows=ROWS, hidden=HIDDEN, vocab=VOCAB, dtype=torch.float32, with_bias=True
):
    h = ref.randn(gen, rows, hidden, dtype=dtype, device=device)
    w = ref.randn(gen, vocab, hidden, dtype=dtype, device=device, scale=hidden**-0.5 * 2)
    b = ref.randn(gen, vocab, dtype=dtype, device=device, scale=0.5) if with_bias else None
    y = ref.targets(gen, rows, vocab, device)
    return h, w, b, y


def _check(gen, h, w, b, y, reduction, tol, wants=(True, True, True), **kwargs):
    params = [
        t.detach().clone().requires_grad_(want) if t is not None else None
        for t, want in zip((h, w, b), wants)
    ]
    loss = xent.linear_cross_entropy(
        params[0], params[1], y, params[2], reduction=reduction, **kwargs
    )
    ref_params = [
        t.detach().cpu().double().requires_grad_() if t is not None else None for t in (h, w, b)
    ]
    round_to = None if kwargs.get("fp32_logits") else h.dtype
    logits = ref.linear_logits(*ref_params, round_to=round_to)
    cpu_kwargs = {
        k: (v.cpu() if torch.is_tensor(v) else v)
        for k, v in kwargs.items()
        if k not in ("workspace_bytes", "fp32_logits", "grad_in_forward", "cache_logits")
    }
    expected = ref.cross_entropy(logits, y.cpu(), reduction=reduction, **cpu_kwargs)
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert ref.rel_error(loss, expected) <= tol
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64) + 0.5
    inputs = [p for p, want in zip(params, wants) if p is not None and want]
    grads = torch.autograd.grad(loss, inputs, upstream.to(loss.device, torch.float32))
    ref_inputs = [p for p, q, want in zip(ref_params, params, wants) if q is not None and want]
    expected_grads = torch.autograd.grad(expected, ref_inputs, upstream)
    for grad, grad_expected, param in zip(grads, expected_grads, inputs):
        assert grad.dtype == param.dtype and grad.shape == param.shape
        assert ref.rel_error(grad, grad_expected) <= tol


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"label_smoothing": 0.1},
        {"z_loss": 1e-3},
        {"softcap": 3.0},
        {"logit_scale": 0.6},
        {"class_weight": True},
        {"row_weight": True},
        {
            "label_smoothing": 0.1,
            "z_loss": 1e-3,
            "softcap": 5.0,
            "class_weight": True,
            "row_weight": True,
        },
    ],
    ids=["plain", "smoothing", "z", "softcap", "scale", "class_weight", "row_weight", "all"],
)
def test_options_against_reference(device, gen, reduction, options):
    h, w, b, y = _inputs(gen, device)
    kwargs = dict(options)
    if kwargs.get("class_weight"):
        kwargs["class_weight"] = (torch.rand(VOCAB, generator=gen) + 0.5).to(device)
    if kwargs.get("row_weight"):
        kwargs["row_weight"] = (torch.rand(ROWS, generator=gen) * 2 - 0.5).to(device)
    _check(gen, h, w, b, y, reduction, 1e-4, **kwargs)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("budget", [1, 2, 7], ids=lambda b: f"rows{b}")
def test_small_workspace_budgets_chunk_the_work(device, gen, reduction, budget):
    h, w, b, y = _inputs(gen, device, rows=53)
    # A budget of a few rows of fp32 logits forces many uneven chunks.
    workspace = budget * 8 * VOCAB * 4 + VOCAB * HIDDEN * 4 + 4 * VOCAB * 4
    try:
        _check(gen, h, w, b, y, reduction, 1e-4, workspace_bytes=workspace, label_smoothing=0.05)
    except ValueError as error:
        # Below the backend's smallest plan (on CUDA it also holds product scratch): the message
        # names the minimum; that plus a few rows still forces many uneven chunks.
        found = re.search(
            r"workspace_budget too small: got \d+ bytes; expected at least (\d+)", str(error)
        )
        assert found, str(error)
        _check(
            gen,
            h,
            w,
            b,
            y,
            reduction,
            1e-4,
            workspace_bytes=int(found.group(1)) + (budget - 1) * 8 * VOCAB * 4,
            label_smoothing=0.05,
        )


@pytest.mark.parametrize("mode", ["grad_in_forward", "recompute", "cached_logits"])
@pytest.mark.parametrize(
    "wants",
    [(True, False, False), (False, True, False), (False, False, True), (True, True, False)],
    ids=["hidden", "weight", "bias", "hidden+weight"],
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradient_subsets(device, gen, wants, reduction, mode):
    h, w, b, y = _inputs(gen, device)
    _check(
        gen,
        h,
        w,
        b,
        y,
        reduction,
        1e-4,
        wants=wants,
        grad_in_forward=mode == "grad_in_forward",
        cache_logits=mode == "cached_logits",
    )


def test_without_bias_and_3d(device, gen):
    h, w, _, y = _inputs(gen, device, rows=2 * 19, with_bias=False)
    h3, y3 = h.reshape(2, 19, HIDDEN), y.reshape(2, 19)
    loss = xent.linear_cross_entropy(h3, w, y3, reduction="none")
    assert loss.shape == (2, 19)
    flat = xent.linear_cross_entropy(h, w, y, reduction="none")
    torch.testing.assert_close(loss.reshape(-1), flat)
    _check(gen, h, w, None, y, "mean", 1e-4, wants=(True, True, False))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_statistics_match_logits_path(device, gen, reduction):
    h, w, b, y = _inputs(gen, device)
    options = dict(z_loss=1e-2, softcap=4.0, fp32_logits=True)
    fused = xent.linear_cross_entropy(h, w, y, b, reduction=reduction, return_stats=True, **options)
    logits = (h.double() @ w.double().T + b.double()).float()
    plain = xent.cross_entropy(
        logits, y, reduction=reduction, z_loss=1e-2, softcap=4.0, return_stats=True
    )
    for name in ("loss", "lse", "logprob", "entropy", "accuracy", "z_loss"):
        assert ref.rel_error(getattr(fused, name), getattr(plain, name)) <= 1e-4, name
    ignored = y == -100
    assert ignored.any()
    assert torch.all(fused.entropy[ignored] == 0) and torch.all(plain.entropy[ignored] == 0)
    assert torch.equal(fused.argmax, plain.argmax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_no_worse_than_torch(device, gen, dtype):
    h, w, b, y = _inputs(gen, device, dtype=dtype)
    params = [t.clone().requires_grad_() for t in (h, w, b)]
    loss = xent.linear_cross_entropy(params[0], params[1], y, params[2])
    grads = torch.autograd.grad(loss, params)
    torch_params = [t.clone().requires_grad_() for t in (h, w, b)]
    torch_loss = F.cross_entropy(F.linear(*torch_params).float(), y)
    torch_grads = torch.autograd.grad(torch_loss, torch_params)
    ref_params = [t.cpu().double().requires_grad_() for t in (h, w, b)]
    expected = F.cross_entropy(ref.linear_logits(*ref_params), y.cpu())
    expected_grads = torch.autograd.grad(expected, ref_params)
    assert ref.rel_error(loss, expected) <= ref.rel_error(torch_loss, expected) + 1e-3
    for grad, torch_grad, expected_grad in zip(grads, torch_grads, expected_grads):
        assert grad.dtype == dtype and torch.isfinite(grad).all()
        assert ref.rel_error(grad, expected_grad) <= ref.rel_error(torch_grad, expected_grad) + 1e-3


def test_autocast_casts_like_f_linear(device, gen):
    h, w, b, y = _inputs(gen, device)
    params = [t.clone().requires_grad_() for t in (h, w, b)]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = xent.linear_cross_entropy(params[0], params[1], y, params[2])
        torch_loss = F.cross_entropy(F.linear(h, w, b), y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch_loss.float(), rtol=2e-3, atol=2e-3)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


def test_no_grad_and_frozen_paths_agree(device, gen):
    h, w, b, y = _inputs(gen, device)
    base = xent.linear_cross_entropy(h.requires_grad_(), w, y, b, label_smoothing=0.1)
    with torch.no_grad():
        torch.testing.assert_close(xent.linear_cross_entropy(h, w, y, b, label_smoothing=0.1), base)


def test_module_matches_functional(device, gen):
    h, w, b, y = _inputs(gen, device)
    module = xent.nn.LinearCrossEntropyLoss(
        ignore_index=-100, reduction="sum", label_smoothing=0.1, z_loss=1e-4
    )
    expected = xent.linear_cross_entropy(
        h, w, y, b, reduction="sum", label_smoothing=0.1, z_loss=1e-4
    )
    torch.testing.assert_close(module(h, w, y, b), expected)


def test_double_backward_raises(gen):
    h, w, b, y = _inputs(gen, "cpu", rows=4, hidden=3, vocab=6)
    y = torch.tensor([0, 5, 1, 2])
    w.requires_grad_()
    loss = xent.linear_cross_entropy(h, w, y, b)
    (grad,) = torch.autograd.grad(loss, w, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        grad.sum().backward()


def test_second_backward_through_the_same_graph_raises(gen):
    h, w, b, y = _inputs(gen, "cpu")
    w.requires_grad_()
    loss = xent.linear_cross_entropy(h, w, y, b)
    (first,) = torch.autograd.grad(loss, w, retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward=False"):
        torch.autograd.grad(loss, w)
    recomputed = xent.linear_cross_entropy(h, w, y, b, grad_in_forward=False)
    for _ in range(2):  # the recomputing form supports several backward passes
        grad = torch.autograd.grad(recomputed, w, retain_graph=True)[0]
        assert ref.rel_error(grad, first) <= 1e-5


@pytest.mark.parametrize(
    "dtype,fp32_logits", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_cached_logits_give_the_recomputed_gradients(device, gen, dtype, fp32_logits):
    h, w, b, y = _inputs(gen, device, dtype=dtype)
    upstream = torch.rand(ROWS, generator=gen).to(device)
    results = []
    for cache in (False, True):
        params = [t.clone().requires_grad_() for t in (h, w, b)]
        loss = xent.linear_cross_entropy(
            *params[:2],
            y,
            params[2],
            reduction="none",
            fp32_logits=fp32_logits,
            cache_logits=cache,
            label_smoothing=0.1,
        )
        results.append((loss,) + torch.autograd.grad(loss, params, upstream))
    for recomputed, cached in zip(*results):
        # Same chunk logits either way (bit-identical on the CPU); bf16 gradients may round
        # differently where a backend orders its sums differently on the two paths.
        assert ref.rel_error(cached, recomputed) <= (1e-5 if dtype == torch.float32 else 1e-3)
