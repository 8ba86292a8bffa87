"""xent.logprobs and xent.linear_logprobs (per-token log-probability and entropy with gradients,
docs/semantics.md §1) against the float64 reference, gradcheck, torch.compile and the fakes."""

import pytest
import reference as ref
import torch
import torch.nn.functional as F
from test_compile import _compiled_matches_eager

import xent

TEMPERATURES = [1.0, 0.7, 1.6]


def _upstream(gen, rows, device):
    return (
        torch.randn(rows, generator=gen, dtype=torch.float64).to(device),
        torch.randn(rows, generator=gen, dtype=torch.float64).to(device),
    )


def _grads(outputs, inputs, upstream):
    """Gradients of Σ g_lp·logprob + g_H·entropy with respect to inputs (float64 upstream)."""
    logprob, entropy = outputs
    total = (logprob.double() * upstream[0].to(logprob.device)).sum() + (
        entropy.double() * upstream[1].to(entropy.device)
    ).sum()
    return torch.autograd.grad(total, inputs)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_against_reference(device, gen, dtype, temperature):
    rows, vocab = 37, 1031
    logits = ref.randn(gen, rows, vocab, dtype=dtype, device=device, scale=2.0)
    target = ref.targets(gen, rows, vocab, device)
    x = logits.clone().requires_grad_()
    logprob, entropy = xent.logprobs(x, target, temperature=temperature, return_entropy=True)
    assert logprob.dtype == torch.float32 and logprob.shape == (rows,)
    x64 = logits.cpu().double().requires_grad_()
    expected = ref.logprobs(x64, target.cpu(), temperature)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert ref.rel_error(logprob, expected[0]) <= tol
    assert ref.rel_error(entropy, expected[1]) <= tol
    ignored = target == -100
    assert (logprob[ignored] == 0).all() and (entropy[ignored] == 0).all()
    upstream = _upstream(gen, rows, "cpu")
    (grad,) = _grads((logprob, entropy), [x], upstream)
    (grad_expected,) = _grads(expected, [x64], upstream)
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    assert (grad[ignored] == 0).all()
    # bf16: the gradient is stored in bf16, as PyTorch would store it.
    grad_tol = (
        tol
        if dtype == torch.float32
        else (ref.rel_error(grad_expected.to(dtype), grad_expected) + 1e-3)
    )
    assert ref.rel_error(grad, grad_expected) <= grad_tol


# Without return_entropy the op is asked for the loss and lse alone (the lean kernels: the fused
# product's lean epilogue on Hopper, the row kernels without entropy and argmax) and the logprob
# is formed as −loss: it must still match the float64 reference, give +0 (not −0) on ignored
# rows, and carry the right gradient, with and without autograd, for both forms.
@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_logprob_without_entropy_matches_reference(device, gen, linear, grad):
    h, w, b, y = _linear_inputs(gen, device, rows=41, hidden=48, vocab=1031)
    y = y.clone()
    y[0] = -100  # at least one ignored row
    temperature = 0.7
    x64 = (h.double() @ w.double().T + b.double()).cpu().requires_grad_()
    expected = ref.logprobs(x64, y.cpu(), temperature)[0]
    inputs = [h.clone().requires_grad_(grad)]
    with torch.set_grad_enabled(grad):
        if linear:
            logprob = xent.linear_logprobs(inputs[0], w, y, b, temperature=temperature)
        else:
            logits = inputs[0] @ w.T + b
            logprob = xent.logprobs(logits, y, temperature=temperature)
    assert logprob.dtype == torch.float32 and logprob.shape == (41,)
    assert ref.rel_error(logprob, expected) <= 1e-5
    ignored = y == -100
    assert (logprob[ignored] == 0).all() and not torch.signbit(logprob[ignored]).any()
    if grad:
        upstream = torch.randn(41, generator=gen, dtype=torch.float64)
        (got,) = torch.autograd.grad((logprob.double() * upstream.to(device)).sum(), inputs)
        h64 = h.double().cpu().requires_grad_()
        logits64 = h64 @ w.double().cpu().T + b.double().cpu()
        want = ref.logprobs(logits64, y.cpu(), temperature)[0]
        (want_grad,) = torch.autograd.grad((want * upstream).sum(), [h64])
        assert ref.rel_error(got, want_grad) <= 1e-5


def test_logprobs_without_entropy_is_minus_the_none_loss(device, gen):
    logits = ref.randn(gen, 2, 9, 301, device=device, scale=2.0)
    target = ref.targets(gen, 18, 301, device).reshape(2, 9)
    x = logits.clone().requires_grad_()
    logprob = xent.logprobs(x, target, temperature=0.8)
    assert logprob.shape == (2, 9)
    x2 = logits.clone().requires_grad_()
    loss = xent.cross_entropy(x2, target, reduction="none", logit_scale=1 / 0.8)
    torch.testing.assert_close(logprob, -loss)
    upstream = torch.randn(2, 9, generator=gen).to(device)
    (grad,) = torch.autograd.grad(logprob, x, upstream)
    (grad_loss,) = torch.autograd.grad(loss, x2, -upstream)
    torch.testing.assert_close(grad, grad_loss)


def _linear_inputs(gen, device, rows=37, hidden=67, vocab=1031, dtype=torch.float32):
    h = ref.randn(gen, rows, hidden, dtype=dtype, device=device)
    w = ref.randn(gen, vocab, hidden, dtype=dtype, device=device, scale=2.0 / hidden**0.5)
    b = ref.randn(gen, vocab, dtype=dtype, device=device, scale=0.5)
    y = ref.targets(gen, rows, vocab, device)
    return h, w, b, y


# How much of the forward's logits the backward reads instead of recomputing: none (cache_bytes
# 0, or less than a row), the first rows (13 of 37: a count that no chunk size divides, so
# chunks and tiles cross the cache's end), every row (cache_logits=True).
CACHES = ["none", "under_a_row", "some_rows", "all_rows"]


def _cache(cache: str, vocab: int, element: int = 4, rows: int = 13) -> dict:
    if cache == "all_rows":
        return {"cache_logits": True}
    row_bytes = vocab * element
    sizes = {
        "none": 0,
        "under_a_row": row_bytes - 1,
        "some_rows": rows * row_bytes + row_bytes // 2,
    }
    return {"cache_bytes": sizes[cache]}


# The cache with the default budget and with 64 KiB, where the backward also takes the
# vocabulary-blocked pass.
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("workspace_bytes", [None, 64 << 10])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_linear_logprobs_against_reference(device, gen, temperature, workspace_bytes, cache):
    h, w, b, y = _linear_inputs(gen, device)
    params = [t.clone().requires_grad_() for t in (h, w, b)]
    outputs = xent.linear_logprobs(
        params[0],
        params[1],
        y,
        params[2],
        temperature=temperature,
        return_entropy=True,
        workspace_bytes=workspace_bytes,
        **_cache(cache, w.shape[0]),
    )
    ref_params = [t.cpu().double().requires_grad_() for t in (h, w, b)]
    expected = ref.logprobs(ref.linear_logits(*ref_params), y.cpu(), temperature)
    for out, exp in zip(outputs, expected):
        assert ref.rel_error(out, exp) <= 1e-4
    upstream = _upstream(gen, y.shape[0], "cpu")
    grads = _grads(outputs, params, upstream)
    expected_grads = _grads(expected, ref_params, upstream)
    for grad, grad_expected in zip(grads, expected_grads):
        assert ref.rel_error(grad, grad_expected) <= 1e-4


def _half_no_worse_than_torch(device, gen, dtype, workspace_bytes, cache, cache_rows=13, **shape):
    h, w, b, y = _linear_inputs(gen, device, dtype=dtype, **shape)
    params = [t.clone().requires_grad_() for t in (h, w, b)]
    outputs = xent.linear_logprobs(
        params[0],
        params[1],
        y,
        params[2],
        temperature=0.7,
        return_entropy=True,
        workspace_bytes=workspace_bytes,
        **_cache(cache, w.shape[0], 2, cache_rows),
    )
    upstream = _upstream(gen, y.shape[0], "cpu")
    grads = _grads(outputs, params, upstream)
    # PyTorch at this dtype: bf16 logits from F.linear, softmax in fp32.
    torch_params = [t.clone().requires_grad_() for t in (h, w, b)]
    torch_outputs = ref.logprobs(F.linear(*torch_params).float(), y, 0.7)
    torch_grads = _grads(torch_outputs, torch_params, upstream)
    ref_params = [t.cpu().double().requires_grad_() for t in (h, w, b)]
    expected = ref.logprobs(ref.linear_logits(*ref_params), y.cpu(), 0.7)
    expected_grads = _grads(expected, ref_params, upstream)
    for out, torch_out, exp in zip(outputs, torch_outputs, expected):
        assert ref.rel_error(out, exp) <= ref.rel_error(torch_out, exp) + 1e-3
    for grad, torch_grad, exp in zip(grads, torch_grads, expected_grads):
        assert grad.dtype == dtype and torch.isfinite(grad).all()
        assert ref.rel_error(grad, exp) <= ref.rel_error(torch_grad, exp) + 1e-3


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("workspace_bytes", [None, 64 << 10])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_logprobs_half_no_worse_than_torch(device, gen, dtype, workspace_bytes, cache):
    _half_no_worse_than_torch(device, gen, dtype, workspace_bytes, cache)


# Aligned 16-bit operands, which the Hopper products take (the fused gradient product for the
# chunks outside the cache), in one row chunk (the default budget) or several (256 KiB), with
# the cache's end (row 137) inside a chunk: its cached rows copied, the others formed.
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("workspace_bytes", [None, 256 << 10])
def test_linear_logprobs_partial_cache_aligned_bf16(device, gen, workspace_bytes, cache):
    shape = {"rows": 300, "hidden": 128, "vocab": 2053}
    _half_no_worse_than_torch(device, gen, torch.bfloat16, workspace_bytes, cache, 137, **shape)


def test_linear_logprobs_3d_without_bias_and_frozen_weight(device, gen):
    h, w, _, y = _linear_inputs(gen, device, rows=22, hidden=40, vocab=257)
    h3, y3 = h.reshape(2, 11, 40).clone().requires_grad_(), y.reshape(2, 11)
    logprob, entropy = xent.linear_logprobs(h3, w, y3, return_entropy=True)
    assert logprob.shape == entropy.shape == (2, 11)
    expected = xent.logprobs((h3 @ w.T), y3, return_entropy=True)
    torch.testing.assert_close(logprob, expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(entropy, expected[1], rtol=1e-4, atol=1e-5)
    (logprob.sum() + entropy.sum()).backward()
    assert h3.grad is not None and h3.grad.shape == h3.shape
    with torch.no_grad():
        frozen = xent.linear_logprobs(h3, w, y3, return_entropy=True)
    torch.testing.assert_close(frozen[0], logprob)
    torch.testing.assert_close(frozen[1], entropy)


def test_linear_logprobs_autocast_casts_like_f_linear(device, gen):
    h, w, b, y = _linear_inputs(gen, device, rows=16, hidden=32, vocab=129)
    params = [t.clone().requires_grad_() for t in (h, w, b)]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logprob = xent.linear_logprobs(params[0], params[1], y, params[2])
        logits = F.linear(h, w, b)
    assert logprob.dtype == torch.float32
    # Both sides round the logits to bfloat16 once, but not necessarily to the same neighbour
    # (the product's summation order differs): a logprob may then be off by one 16-bit ulp of the
    # largest logit (x_y and the lse each move by at most half of it, measured 2e-2 at |x| ~ 5),
    # so the bound is that ulp, against the float64 logprob of the exact logits of the bfloat16
    # operands (autocast converts h, W and b before the product).
    exact = ref.logprobs(ref.linear_logits(*(t.bfloat16() for t in (h, w, b))), y)[0]
    ulp = 2.0**-7 * logits.detach().float().abs().amax(dim=1).double()
    assert ((logprob.double() - exact).abs() <= ulp + 1e-5).all()
    assert ((ref.logprobs(logits.float(), y)[0] - exact).abs() <= ulp + 1e-5).all()
    logprob.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)


@pytest.mark.parametrize("cache", ["none", "some_rows", "all_rows"])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-hidden", "autocast"])
def test_linear_logprobs_fp32_weight_gets_an_fp32_gradient(device, gen, autocast, cache):
    h, w, _, y = _linear_inputs(gen, device)
    upstream = _upstream(gen, y.shape[0], "cpu")
    h_in = (h if autocast else h.to(torch.bfloat16)).clone().requires_grad_()
    w_in = w.clone().requires_grad_()  # fp32: a master weight
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        outputs = xent.linear_logprobs(
            h_in,
            w_in,
            y,
            temperature=0.7,
            return_entropy=True,
            workspace_bytes=1 << 16,
            **_cache(cache, w.shape[0], 2),  # the products' dtype: bf16
        )
    grads = _grads(outputs, [h_in, w_in], upstream)
    assert grads[1].dtype == torch.float32 and grads[0].dtype == h_in.dtype
    # Accumulated in fp32, not a bf16 gradient that autograd widened on the way out.
    assert (grads[1] != grads[1].bfloat16().float()).any()
    # The same products on bf16 copies made by hand (∂W summed in bf16 chunks there): equal up
    # to the bf16 path's roundings, in norm (see test_fused_grad's fp32-weight test).
    h16 = h.to(torch.bfloat16).requires_grad_()
    w16 = w.to(torch.bfloat16).requires_grad_()
    grads16 = _grads(
        xent.linear_logprobs(
            h16, w16, y, temperature=0.7, return_entropy=True, workspace_bytes=1 << 16
        ),
        [h16, w16],
        upstream,
    )
    assert ref.rel_error(grads[1], grads16[1].float()) <= 1e-2
    assert ref.rel_error(grads[0].float(), grads16[0].float()) <= 1e-2
    # And the fp32 ∂W is no further from float64 (of the bf16 operands) than the bf16 one, within
    # 1 %: both errors are mostly the bf16 rounding of the logits' gradient, which the two share,
    # so where the bf16 path's chunk roundings add little their order flips by noise (0.1 % at
    # XENT_TEST_SEED=3433383436 on the CPU).
    params64 = [t.to(torch.bfloat16).double().cpu().requires_grad_() for t in (h, w)]
    expected = ref.logprobs(params64[0] @ params64[1].t(), y.cpu(), 0.7)
    (_, expected_w) = _grads(expected, params64, upstream)
    assert ref.rel_error(grads[1], expected_w) <= 1.01 * ref.rel_error(grads16[1], expected_w)


def test_gradcheck_logprobs(gen):
    x = torch.randn(5, 13, generator=gen, dtype=torch.float64).requires_grad_()
    y = torch.tensor([0, 12, -100, 3, 7])
    # fp32 outputs: see test_ce.test_gradcheck for the step size.
    assert torch.autograd.gradcheck(
        lambda x: xent.logprobs(x, y, temperature=0.7, return_entropy=True),
        (x,),
        eps=1e-3,
        atol=2e-3,
        rtol=1e-3,
    )


@pytest.mark.parametrize("cache", ["none", "some_rows", "all_rows"])
def test_gradcheck_linear_logprobs(gen, cache):
    h = torch.randn(4, 3, generator=gen, dtype=torch.float64).requires_grad_()
    w = torch.randn(6, 3, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(6, generator=gen, dtype=torch.float64).requires_grad_()
    y = torch.tensor([0, 5, -100, 2])
    assert torch.autograd.gradcheck(
        lambda h, w, b: xent.linear_logprobs(
            h, w, y, b, temperature=1.3, return_entropy=True, **_cache(cache, 6, 8, rows=2)
        ),
        (h, w, b),
        eps=1e-3,
        atol=2e-3,
        rtol=1e-3,
    )


def test_linear_logprobs_cache_default_and_bad_size(gen):
    h, w, b, y = _linear_inputs(gen, "cpu", rows=9, hidden=8, vocab=33)
    # The default budget (1 GiB) holds these rows: the same values as every row cached.
    assert xent.functional.DEFAULT_LOGPROBS_CACHE_BYTES == 1 << 30
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    xent.linear_logprobs(h1, w, y, b).sum().backward()
    xent.linear_logprobs(h2, w, y, b, cache_logits=True).sum().backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=0)
    with pytest.raises(ValueError, match="linear_logprobs: cache_bytes out of range"):
        xent.linear_logprobs(h1, w, y, cache_bytes=-1)


def test_bad_temperature_is_named():
    x = torch.randn(3, 5)
    y = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="logprobs: temperature out of range"):
        xent.logprobs(x, y, temperature=0.0)
    with pytest.raises(ValueError, match="linear_logprobs: temperature out of range"):
        xent.linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), y, temperature=-1.0)


@pytest.mark.parametrize("cache", ["none", "some_rows", "all_rows"])
def test_compile_linear_logprobs(device, gen, cache):
    h, w, _, y = _linear_inputs(gen, device, rows=22, hidden=40, vocab=257)

    def fn(h, w):
        logprob, entropy = xent.linear_logprobs(
            torch.tanh(h), w, y, temperature=0.9, return_entropy=True, **_cache(cache, 257)
        )
        return (logprob * 0.3).sum() + 0.01 * entropy.sum() + xent.logprobs(h @ w.T, y).sum()

    _compiled_matches_eager(fn, [h, w], grads_of=[0, 1])
