"""linear_cross_entropy(accumulate_into=buffer): the weight gradient ADDED into a caller's fp32
buffer (Megatron's main_grad) instead of weight.grad, against float64 references. Each buffer
starts with random values as large as the gradient, so an op that overwrote or skipped part of it
fails; checks take that prefill off and compare what was added."""

import re

import pytest
import reference as ref
import torch

import xent

ROWS, HIDDEN, VOCAB = 29, 24, 257


def _layer(gen, device, dtype=torch.float32, rows=ROWS):
    h = ref.randn(gen, rows, HIDDEN, dtype=dtype, device=device)
    w = ref.randn(gen, VOCAB, HIDDEN, dtype=dtype, device=device, scale=HIDDEN**-0.5 * 2)
    b = ref.randn(gen, VOCAB, dtype=dtype, device=device, scale=0.5)
    return h, w, b, ref.targets(gen, rows, VOCAB, device)


def _weight_grad(h, w, b, y, reduction="mean", upstream=1.0, **options):
    """∂(upstream · loss)/∂W in float64 on the CPU; options as linear_cross_entropy's."""
    w64 = w.detach().cpu().double().requires_grad_()
    logits = ref.linear_logits(h.detach().cpu().double(), w64, b.detach().cpu().double())
    loss = ref.cross_entropy(logits, y.cpu(), reduction=reduction, **options)
    upstream = torch.as_tensor(upstream, dtype=torch.float64).cpu()
    (grad,) = torch.autograd.grad(loss, w64, upstream.expand_as(loss))
    return grad


def _prefilled(gen, like_grad, device, dtype=torch.float32):
    return (ref.randn(gen, *like_grad.shape, dtype=dtype) * like_grad.std()).to(device)


def _assert_added(buffer, prefill, expected, tol):
    assert buffer.dtype == prefill.dtype and buffer.device == prefill.device
    assert ref.rel_error(buffer.double() - prefill.double(), expected) <= tol


def _tolerance(dtype):
    # bf16 products round their operands; the sums stay fp32 in the buffer.
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("order", ["each_backward", "interleaved"])
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["in_forward", "recompute"])
def test_micro_batches_accumulate_into_one_buffer(device, gen, dtype, order, grad_in_forward):
    batches = [_layer(gen, device, dtype) for _ in range(2)]
    w = batches[0][1].requires_grad_()
    expected = sum(_weight_grad(h, w, b, y, label_smoothing=0.1) for h, _, b, y in batches)
    buffer = _prefilled(gen, expected, device)
    prefill = buffer.clone()
    hiddens = [h.requires_grad_() for h, *_ in batches]
    losses = []
    for h, (_, _, b, y) in zip(hiddens, batches):
        losses.append(
            xent.linear_cross_entropy(
                h,
                w,
                y,
                b,
                label_smoothing=0.1,
                grad_in_forward=grad_in_forward,
                accumulate_into=buffer,
            )
        )
        if order == "each_backward":
            losses[-1].backward()
    if order == "interleaved":  # a pipeline schedule's forwards before their backwards
        sum(losses).backward()
    _assert_added(buffer, prefill, expected, _tolerance(dtype))
    assert w.grad is None, "the weight gradient went into the buffer, not weight.grad"
    for h, (_, _, _b, _y) in zip(hiddens, batches):
        assert h.grad is not None and h.grad.dtype == dtype


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
@pytest.mark.parametrize(
    "reduction,normalizer",
    [("mean", None), ("sum", None), ("sum", 7.0)],
    ids=["mean", "sum", "sum_normalizer"],
)
def test_upstream_other_than_one_adds_the_rest(device, gen, scale, reduction, normalizer):
    h, w, b, y = _layer(gen, device)
    h.requires_grad_()
    w.requires_grad_()
    divisor = 1.0 if normalizer is None else normalizer
    expected = _weight_grad(h, w, b, y, reduction, scale / divisor)
    buffer = _prefilled(gen, expected, device)
    prefill = buffer.clone()
    loss = xent.linear_cross_entropy(
        h, w, y, b, reduction=reduction, normalizer=normalizer, accumulate_into=buffer
    )
    # The forward added the gradient for an upstream of 1 (of the normalized loss).
    _assert_added(buffer, prefill, expected / scale, 1e-4)
    (scale * loss).backward()  # g = scale: the backward's recompute adds (g - 1)·∂W
    _assert_added(buffer, prefill, expected, 1e-4)
    assert w.grad is None
    h_expected = h.detach().clone().requires_grad_()
    (
        scale
        * xent.linear_cross_entropy(
            h_expected, w.detach(), y, b, reduction=reduction, normalizer=normalizer
        )
    ).backward()
    assert ref.rel_error(h.grad, h_expected.grad) <= 1e-5


@pytest.mark.parametrize("cache_logits", [False, True])
def test_reduction_none_adds_the_per_row_upstream(device, gen, cache_logits):
    h, w, b, y = _layer(gen, device)
    w.requires_grad_()
    upstream = torch.randn(ROWS, generator=gen, dtype=torch.float64)
    expected = _weight_grad(h, w, b, y, "none", upstream, z_loss=1e-3)
    buffer = _prefilled(gen, expected, device)
    prefill = buffer.clone()
    loss = xent.linear_cross_entropy(
        h, w, y, b, reduction="none", z_loss=1e-3, cache_logits=cache_logits, accumulate_into=buffer
    )
    assert torch.equal(buffer, prefill), "with reduction none nothing is added before backward"
    loss.backward(upstream.float().to(device))
    _assert_added(buffer, prefill, expected, 1e-4)
    assert w.grad is None


def test_fp32_master_weight_under_autocast(device, gen):
    h, w, b, y = _layer(gen, device)
    w.requires_grad_()
    expected = _weight_grad(h.bfloat16(), w.bfloat16(), b.bfloat16(), y)
    buffer = _prefilled(gen, expected, device)
    prefill = buffer.clone()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = xent.linear_cross_entropy(h, w, y, b, accumulate_into=buffer)
    (0.25 * loss).backward()
    _assert_added(buffer, prefill, 0.25 * expected, _tolerance(torch.bfloat16))
    assert w.grad is None
    added = buffer - prefill
    assert not torch.equal(added, added.bfloat16().float()), "added in fp32, not rounded to bf16"


def test_float64_weight_takes_a_float64_buffer(gen):
    h, w, b, y = _layer(gen, "cpu", torch.float64)
    w.requires_grad_()
    expected = _weight_grad(h, w, b, y, "sum")
    buffer = _prefilled(gen, expected, "cpu", torch.float64)
    prefill = buffer.clone()
    xent.linear_cross_entropy(h, w, y, b, reduction="sum", accumulate_into=buffer).backward()
    _assert_added(buffer, prefill, expected, 1e-12)


def test_frozen_weight_adds_nothing(device, gen):
    h, w, b, y = _layer(gen, device)
    h.requires_grad_()
    buffer = torch.randn(VOCAB, HIDDEN, generator=gen).to(device)
    prefill = buffer.clone()
    xent.linear_cross_entropy(h, w, y, b, accumulate_into=buffer).backward()
    assert torch.equal(buffer, prefill) and h.grad is not None


def test_module_forwards_the_buffer(device, gen):
    h, w, b, y = _layer(gen, device)
    w.requires_grad_()
    expected = _weight_grad(h, w, b, y, "sum", label_smoothing=0.05)
    buffer = _prefilled(gen, expected, device)
    prefill = buffer.clone()
    module = xent.nn.LinearCrossEntropyLoss(reduction="sum", label_smoothing=0.05)
    module(h, w, y, b, accumulate_into=buffer).backward()
    _assert_added(buffer, prefill, expected, 1e-4)
    assert w.grad is None


@pytest.mark.parametrize("case", ["dtype", "shape", "device", "strided", "process_group"])
def test_bad_buffers_are_refused(device, case):
    h = torch.randn(5, 3, device=device)
    w = torch.randn(7, 3, device=device, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 4], device=device)
    buffer, kwargs, shown = {
        "dtype": (torch.zeros(7, 3, dtype=torch.bfloat16, device=device), {}, "bfloat16"),
        "shape": (torch.zeros(7, 4, device=device), {}, "(7, 4)"),
        "device": (torch.zeros(7, 3, device="meta"), {}, "meta"),
        "strided": (torch.zeros(3, 7, device=device).T, {}, "strides (1, 7)"),
        "process_group": (
            torch.zeros(7, 3, device=device),
            {"process_group": object()},
            "process_group",
        ),
    }[case]
    pattern = "linear_cross_entropy: accumulate_into .*" + re.escape(shown)
    with pytest.raises(ValueError, match=pattern):
        xent.linear_cross_entropy(h, w, y, accumulate_into=buffer, **kwargs)
