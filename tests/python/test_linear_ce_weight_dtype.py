"""linear_cross_entropy(weight_grad_accumulation="weight_dtype"): a 16-bit weight gradient summed
chunk by chunk in its own dtype, one rounding per chunk (docs/semantics.md §2), against float64.

The error model: what PyTorch's bf16/fp16 path loses (its own error against float64, plus the
slack of test_linear_ce's half-precision test) plus u·Σ_c ‖S_c‖ / ‖S_K‖ over the chunk ends c,
S_c the float64 ∂W of the rows before c and u the dtype's unit roundoff. The chunk ends are not
visible from Python, but they are a subset of the row ends, so the sum over every row end bounds
the sum over any chunking (all its terms are non-negative); the C++ suite checks the tight form
with the plan's own chunks."""

import re

import pytest
import reference as ref
import torch
import torch.nn.functional as F

import xent

ROWS, HIDDEN, VOCAB = 37, 67, 1031
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _layer(gen, device, dtype, rows=ROWS, hidden=HIDDEN, vocab=VOCAB):
    h = ref.randn(gen, rows, hidden, dtype=dtype, device=device)
    w = ref.randn(gen, vocab, hidden, dtype=dtype, device=device, scale=hidden**-0.5 * 2)
    return h, w, ref.targets(gen, rows, vocab, device)


def _loss(h, w, y, reduction, upstream, **kwargs):
    """The upstream-weighted loss whose gradient the checks take (reduction none: per row)."""
    loss = xent.linear_cross_entropy(h, w, y, reduction=reduction, **kwargs)
    return (loss * upstream.to(loss.device, loss.dtype)).sum()


def _row_partial_sum_ratio(grad_logits, hidden):
    """Σ_n ‖S_n‖ / ‖S_N‖, S_n = Σ_{m ≤ n} G_mᵀ h_m in float64: ‖S_n‖² is the sum of the leading
    (n + 1) × (n + 1) block of (G·Gᵀ) ∘ (h·hᵀ)."""
    products = (grad_logits @ grad_logits.T) * (hidden @ hidden.T)
    squares = products.cumsum(0).cumsum(1).diagonal().clamp(min=0)
    norms = squares.sqrt()
    return (norms.sum() / norms[-1]).item() if norms[-1] > 0 else 0.0


def _call_within_budget(call, budget):
    """call(workspace_bytes) at `budget`, or where that is below the backend's smallest plan (on
    CUDA it also holds product scratch) at that minimum and `budget` more: still many chunks."""
    try:
        return call(budget)
    except ValueError as error:
        found = re.search(r"too small: got \d+ bytes; expected at least (\d+)", str(error))
        assert found, str(error)
        return call(int(found.group(1)) + budget)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("budget", [None, 4 * VOCAB * 4, VOCAB * 4], ids=["one", "rows4", "rows1"])
def test_weight_gradient_within_the_chunk_error_model(device, gen, dtype, reduction, budget):
    h, w, y = _layer(gen, device, dtype)
    # mean: an upstream of 1, so the gradients formed in the forward are not scaled (and rounded)
    # once more in the backward; none: per-row upstreams, folded in before the products.
    upstream = torch.rand(ROWS, generator=gen) + 0.5 if reduction == "none" else torch.tensor(1.0)

    def run(workspace_bytes):
        params = [t.clone().requires_grad_() for t in (h, w)]
        loss = _loss(
            *params,
            y,
            reduction,
            upstream,
            workspace_bytes=workspace_bytes,
            weight_grad_accumulation="weight_dtype",
        )
        return torch.autograd.grad(loss, params)

    grad_h, grad_w = run(None) if budget is None else _call_within_budget(run, budget)

    h64, w64 = (t.cpu().double().requires_grad_() for t in (h, w))
    logits64 = ref.linear_logits(h64, w64, None).detach().requires_grad_()
    expected = F.cross_entropy(logits64, y.cpu(), reduction=reduction)
    (grad_logits,) = torch.autograd.grad((expected * upstream.double()).sum(), logits64)
    expected_h, expected_w = grad_logits @ w64.detach(), grad_logits.T @ h64.detach()

    torch_params = [t.clone().requires_grad_() for t in (h, w)]
    torch_loss = F.cross_entropy(F.linear(*torch_params).float(), y, reduction=reduction)
    torch_h, torch_w = torch.autograd.grad(
        (torch_loss * upstream.to(torch_loss.device)).sum(), torch_params
    )
    growth = UNIT_ROUNDOFF[dtype] * _row_partial_sum_ratio(grad_logits, h64.detach())
    assert grad_w.dtype == dtype and torch.isfinite(grad_w).all()
    assert ref.rel_error(grad_w, expected_w) <= (
        ref.rel_error(torch_w, expected_w) + 1e-3 + 1.05 * growth
    )
    # ∂h is formed as with the default: PyTorch's error.
    assert ref.rel_error(grad_h, expected_h) <= ref.rel_error(torch_h, expected_h) + 1e-3


@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["in_forward", "recompute"])
def test_no_effect_on_an_fp32_weight_gradient(device, gen, grad_in_forward):
    """An fp32 weight (with 16-bit products under autocast-like mixed inputs) and accumulate_into
    are summed in place: the option gives the same bits."""
    h, w, y = _layer(gen, device, torch.float32)
    h16 = h.to(torch.bfloat16)

    def grads(accumulation):
        hidden, weight = h16.clone().requires_grad_(), w.clone().requires_grad_()
        loss = xent.linear_cross_entropy(
            hidden,
            weight,
            y,
            workspace_bytes=_minimum_plus(device, hidden, weight, y),
            grad_in_forward=grad_in_forward,
            weight_grad_accumulation=accumulation,
        )
        loss.backward()
        buffer = torch.zeros_like(w)
        weight2 = w.clone().requires_grad_()
        xent.linear_cross_entropy(
            h16,
            weight2,
            y,
            grad_in_forward=grad_in_forward,
            accumulate_into=buffer,
            weight_grad_accumulation=accumulation,
        ).backward()
        return weight.grad, buffer

    for fp32, weight_dtype in zip(grads("fp32"), grads("weight_dtype")):
        assert fp32.dtype == torch.float32
        assert torch.equal(fp32, weight_dtype)


def _minimum_plus(device, hidden, weight, y, rows=4):
    """A budget a few rows of fp32 logits above the backend's smallest plan: several chunks."""
    try:
        xent.linear_cross_entropy(hidden.detach(), weight.detach(), y, workspace_bytes=1)
    except ValueError as error:
        found = re.search(r"expected at least (\d+)", str(error))
        assert found, str(error)
        return int(found.group(1)) + rows * weight.shape[0] * 4
    return rows * weight.shape[0] * 4


def test_module_takes_the_option(device, gen):
    h, w, y = _layer(gen, device, torch.bfloat16)
    module = xent.nn.LinearCrossEntropyLoss(
        workspace_bytes=None, weight_grad_accumulation="weight_dtype"
    )
    grads = []
    for loss_of in (
        lambda hidden, weight: module(hidden, weight, y),
        lambda hidden, weight: xent.linear_cross_entropy(
            hidden, weight, y, weight_grad_accumulation="weight_dtype"
        ),
    ):
        params = [t.clone().requires_grad_() for t in (h, w)]
        grads.append(torch.autograd.grad(loss_of(*params), params))
    for module_grad, functional_grad in zip(*grads):
        assert torch.equal(module_grad, functional_grad)


@pytest.mark.parametrize("value", ["bf16", "weight", None, 1])
def test_unknown_value_is_refused(gen, value):
    h, w, y = _layer(gen, "cpu", torch.bfloat16)
    with pytest.raises(ValueError) as error:
        xent.linear_cross_entropy(h, w, y, weight_grad_accumulation=value)
    assert str(error.value) == (
        f"linear_cross_entropy: weight_grad_accumulation unknown: got {value!r}; "
        "expected one of 'fp32', 'weight_dtype'"
    )


def test_refused_with_process_group(gen):
    h, w, y = _layer(gen, "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="weight_grad_accumulation unsupported with process_group"):
        xent.linear_cross_entropy(
            h, w, y, process_group=object(), weight_grad_accumulation="weight_dtype"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("budget_mib", [1, 4, None], ids=["1MiB", "4MiB", "one_chunk"])
def test_cuda_chunks_of_a_wide_vocabulary(gen, budget_mib):
    """bf16 at a vocabulary where small budgets leave each chunk a few rows: within the error
    model (over every row end, a bound for any chunking), no more accurate than the fp32 path
    beyond noise; one chunk gives the fp32 path's bits."""
    rows, hidden, vocab = 256, 128, 32000
    h, w, y = _layer(gen, "cuda", torch.bfloat16, rows, hidden, vocab)
    budget = None if budget_mib is None else budget_mib << 20

    def weight_grad(accumulation):
        params = [t.clone().requires_grad_() for t in (h, w)]
        loss = xent.linear_cross_entropy(
            *params, y, workspace_bytes=budget, weight_grad_accumulation=accumulation
        )
        return torch.autograd.grad(loss, params)[1]

    grad_w, fp32_w = weight_grad("weight_dtype"), weight_grad("fp32")
    if budget is None:
        assert torch.equal(grad_w, fp32_w)
        return
    h64, w64 = (t.cpu().double() for t in (h, w))
    logits64 = ref.linear_logits(h64, w64, None).requires_grad_()
    (grad_logits,) = torch.autograd.grad(F.cross_entropy(logits64, y.cpu()), logits64)
    expected_w = grad_logits.T @ h64
    growth = UNIT_ROUNDOFF[torch.bfloat16] * _row_partial_sum_ratio(grad_logits, h64)
    error, fp32_error = ref.rel_error(grad_w, expected_w), ref.rel_error(fp32_w, expected_w)
    assert torch.isfinite(grad_w).all()
    assert fp32_error <= error + 1e-3
    assert error <= fp32_error + 1.05 * growth
