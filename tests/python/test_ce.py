"""xent.cross_entropy and xent.nn.CrossEntropyLoss against float64 references (docs/semantics.md §1)."""

import itertools

import pytest
import reference as ref
import torch
import torch.nn.functional as F

import xent

REDUCTIONS = ["none", "sum", "mean"]
OPTIONS = {
    "label_smoothing": 0.1,
    "z_loss": 1e-3,
    "softcap": 3.0,
    "logit_scale": 0.7,
    "class_weight": True,
    "row_weight": True,
}
SINGLE = [(name,) for name in OPTIONS]
PAIRS = list(itertools.combinations(OPTIONS, 2))


def _inputs(gen, device, rows=37, vocab=1031, dtype=torch.float32, scale=2.0):
    logits = ref.randn(gen, rows, vocab, dtype=dtype, device=device, scale=scale)
    target = ref.targets(gen, rows, vocab, device)
    return logits, target


def _kwargs(gen, names, rows, vocab, device):
    kwargs = {}
    for name in names:
        if name == "class_weight":
            kwargs[name] = (torch.rand(vocab, generator=gen) + 0.5).to(device)
        elif name == "row_weight":
            kwargs[name] = (torch.rand(rows, generator=gen) * 2 - 0.5).to(device)
        else:
            kwargs[name] = OPTIONS[name]
    return kwargs


def _check(logits, target, reduction, kwargs, gen, tol):
    """Loss and gradient (with a random upstream gradient) against the float64 reference."""
    x = logits.detach().clone().requires_grad_()
    loss = xent.cross_entropy(x, target, reduction=reduction, **kwargs)
    x64 = logits.detach().cpu().double().requires_grad_()
    cpu_kwargs = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
    expected = ref.cross_entropy(x64, target.cpu(), reduction=reduction, **cpu_kwargs)
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert ref.rel_error(loss, expected) <= tol
    upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad(loss, x, upstream.to(loss.device, loss.dtype))
    (grad_expected,) = torch.autograd.grad(expected, x64, upstream)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert ref.rel_error(grad, grad_expected) <= tol


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("names", SINGLE + PAIRS, ids=lambda n: "+".join(n))
def test_options_against_reference(device, gen, reduction, names):
    logits, target = _inputs(gen, device)
    kwargs = _kwargs(gen, names, *logits.shape, device)
    _check(logits, target, reduction, kwargs, gen, tol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "with_weight,smoothing", [(False, 0.0), (True, 0.0), (False, 0.2), (True, 0.2)]
)
def test_drop_in_for_f_cross_entropy(device, gen, reduction, dtype, with_weight, smoothing):
    if dtype == torch.float64 and device.type == "cuda":
        pytest.skip("float64 is a CPU-only input dtype")
    logits, target = _inputs(gen, device, dtype=dtype)
    weight = (torch.rand(logits.shape[1], generator=gen) + 0.5).to(device) if with_weight else None
    x = logits.clone().requires_grad_()
    loss = xent.cross_entropy(x, target, weight, -100, reduction, smoothing)
    x64 = logits.cpu().double().requires_grad_()
    expected = F.cross_entropy(
        x64,
        target.cpu(),
        weight.double().cpu() if with_weight else None,
        ignore_index=-100,
        reduction=reduction,
        label_smoothing=smoothing,
    )
    assert ref.rel_error(loss, expected) <= 1e-5
    upstream = torch.rand(expected.shape, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad(loss, x, upstream.to(device, torch.float32))
    (grad_expected,) = torch.autograd.grad(expected, x64, upstream)
    assert ref.rel_error(grad, grad_expected) <= 1e-5


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batch_time_vocab_layout(device, gen, reduction):
    logits = ref.randn(gen, 3, 11, 257, device=device)
    target = ref.targets(gen, 33, 257, device).reshape(3, 11)
    row_weight = torch.rand(3, 11, generator=gen).to(device)
    x = logits.clone().requires_grad_()
    loss = xent.cross_entropy(x, target, reduction=reduction, row_weight=row_weight)
    flat = xent.cross_entropy(
        logits.reshape(-1, 257),
        target.reshape(-1),
        reduction=reduction,
        row_weight=row_weight.reshape(-1),
    )
    expected_shape = (3, 11) if reduction == "none" else ()
    assert loss.shape == expected_shape
    torch.testing.assert_close(loss.reshape(-1), flat.reshape(-1))
    loss.sum().backward()
    assert x.grad.shape == logits.shape


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_statistics(device, gen, reduction):
    logits, target = _inputs(gen, device, rows=53, vocab=515)
    target[3] = logits[3].argmax()  # at least one correct prediction
    row_weight = torch.rand(53, generator=gen).to(device)
    options = dict(softcap=4.0, logit_scale=1.3, z_loss=1e-2)
    result = xent.cross_entropy(
        logits, target, reduction=reduction, row_weight=row_weight, return_stats=True, **options
    )
    assert isinstance(result, xent.CrossEntropyResult)
    expected = ref.ce_stats(
        logits.cpu(), target.cpu(), reduction=reduction, row_weight=row_weight.cpu(), **options
    )
    for name in ("lse", "logprob", "entropy", "accuracy", "z_loss"):
        assert ref.rel_error(getattr(result, name), expected[name]) <= 1e-5, name
    ignored = (target == -100).cpu()
    assert ignored.any()
    for name in ("lse", "logprob", "entropy"):  # exactly 0 on ignored rows
        assert torch.all(getattr(result, name).cpu()[ignored] == 0), name
    assert result.argmax.dtype == torch.int64
    assert torch.equal(result.argmax.cpu(), expected["argmax"])
    plain = xent.cross_entropy(
        logits, target, reduction=reduction, row_weight=row_weight, **options
    )
    torch.testing.assert_close(result.loss, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["fused", "backward"])
def test_half_precision_no_worse_than_torch(device, gen, dtype, reduction, grad_in_forward):
    logits, target = _inputs(gen, device, rows=64, vocab=2053, dtype=dtype, scale=4.0)
    x = logits.clone().requires_grad_()
    loss = xent.cross_entropy(x, target, reduction=reduction, grad_in_forward=grad_in_forward)
    upstream = torch.rand(loss.shape, generator=gen).to(device)
    if grad_in_forward and reduction != "none":
        # The gradient formed in the forward is rounded to the input dtype for an upstream of 1;
        # another upstream scalar rounds it a second time (functional.cross_entropy's docstring),
        # so the contract is checked where one rounding happens: loss.backward().
        upstream = torch.ones_like(upstream)
    (grad,) = torch.autograd.grad(loss, x, upstream)
    # PyTorch at the same input dtype with an fp32 upcast of the logits, as users write it.
    xt = logits.clone().requires_grad_()
    torch_loss = F.cross_entropy(xt.float(), target, reduction=reduction)
    (torch_grad,) = torch.autograd.grad(torch_loss, xt, upstream)
    x64 = logits.cpu().double().requires_grad_()
    expected = F.cross_entropy(x64, target.cpu(), reduction=reduction)
    (grad_expected,) = torch.autograd.grad(expected, x64, upstream.cpu().double())
    assert grad.dtype == dtype and loss.dtype == torch.float32
    assert ref.rel_error(loss, expected) <= ref.rel_error(torch_loss, expected) + 1e-3
    assert ref.rel_error(grad, grad_expected) <= ref.rel_error(torch_grad, grad_expected) + 1e-3
    assert torch.isfinite(grad).all()


def test_strided_inputs_read_in_place_or_copied(device, gen):
    wide = ref.randn(gen, 40, 600, device=device)
    logits = wide[:, :515]  # padded rows: read where they are
    transposed = ref.randn(gen, 515, 40, device=device).T  # columns strided: copied
    target = ref.targets(gen, 80, 515, device)[::2]  # strided target
    for x in (logits, transposed):
        x = x.detach().requires_grad_()
        loss = xent.cross_entropy(x, target, label_smoothing=0.1)
        expected = ref.cross_entropy(x.detach().cpu(), target.cpu(), label_smoothing=0.1)
        assert ref.rel_error(loss, expected) <= 1e-5
        loss.backward()
        assert x.grad.shape == x.shape


def test_edge_rows(device, gen):
    vocab = 97
    empty = torch.empty(0, vocab, device=device, requires_grad=True)
    no_target = torch.empty(0, dtype=torch.long, device=device)
    assert xent.cross_entropy(empty, no_target, reduction="none").shape == (0,)
    for reduction in ("sum", "mean"):
        loss = xent.cross_entropy(empty, no_target, reduction=reduction)
        assert loss.item() == 0.0
        loss.backward()
    logits = ref.randn(gen, 6, vocab, device=device).requires_grad_()
    ignored = torch.full((6,), -100, device=device)
    loss = xent.cross_entropy(logits, ignored)  # mean over no valid row: 0, not NaN (deviation)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
    extremes = torch.tensor([0, vocab - 1, 0, vocab - 1, 5, 6], device=device)
    _check(logits.detach(), extremes, "none", {}, gen, tol=1e-5)


def test_mean_with_zero_target_weights(device, gen):
    # D = 0 with N_valid > 0 (docs/semantics.md): the ℓ/D part is 0 even with smoothing (whose
    # numerator is not 0; PyTorch gives NaN), the z-loss part is still divided by N_valid.
    logits, target = _inputs(gen, device, rows=11, vocab=97)
    valid = target != -100
    weight = (torch.rand(97, generator=gen) + 0.5).to(device)
    weight[target[valid]] = 0
    x = logits.detach().clone().requires_grad_()
    result = xent.cross_entropy(
        x, target, weight, label_smoothing=0.1, z_loss=1e-2, return_stats=True
    )
    lse = torch.logsumexp(logits.double(), -1)
    z_part = (1e-2 * lse[valid] ** 2).sum() / valid.sum()
    assert z_part > 0
    assert ref.rel_error(result.loss, z_part) <= 1e-5
    assert ref.rel_error(result.z_loss, z_part) <= 1e-5
    result.loss.backward()
    p = torch.softmax(logits.double(), -1)
    expected = torch.where(valid[:, None], 2e-2 * lse[:, None] * p / valid.sum(), 0.0)
    assert ref.rel_error(x.grad, expected) <= 1e-5


def test_nan_row_stays_in_its_row(device, gen):
    logits, target = _inputs(gen, device, rows=8, vocab=129)
    target[2] = 7
    logits[2, 5] = float("nan")
    x = logits.clone().requires_grad_()
    loss = xent.cross_entropy(x, target, reduction="none")
    loss.sum().backward()
    clean = torch.arange(8, device=device) != 2
    assert torch.isnan(loss[2]) and torch.isfinite(loss[clean]).all()
    assert torch.isfinite(x.grad[clean]).all()
    expected = ref.cross_entropy(logits[clean].cpu(), target[clean].cpu(), reduction="none")
    assert ref.rel_error(loss[clean], expected) <= 1e-5


def test_int32_target_and_no_grad_path(device, gen):
    logits, target = _inputs(gen, device)
    base = xent.cross_entropy(logits, target, z_loss=1e-3)
    torch.testing.assert_close(xent.cross_entropy(logits, target.int(), z_loss=1e-3), base)
    with torch.no_grad():
        x = logits.clone().requires_grad_()
        torch.testing.assert_close(xent.cross_entropy(x, target, z_loss=1e-3), base)


def test_module_matches_functional(device, gen):
    logits, target = _inputs(gen, device)
    weight = (torch.rand(logits.shape[1], generator=gen) + 0.5).to(device)
    module = xent.nn.CrossEntropyLoss(
        weight, None, -100, None, "sum", 0.05, z_loss=1e-4, softcap=5.0
    )
    expected = xent.cross_entropy(
        logits, target, weight, reduction="sum", label_smoothing=0.05, z_loss=1e-4, softcap=5.0
    )
    torch.testing.assert_close(module(logits, target), expected)
    legacy = xent.nn.CrossEntropyLoss(size_average=False)  # PyTorch's legacy spelling of sum
    assert legacy.reduction == "sum"
    torch_module = torch.nn.CrossEntropyLoss(
        weight.double().cpu(), reduction="sum", label_smoothing=0.05
    )
    plain = xent.nn.CrossEntropyLoss(weight, reduction="sum", label_smoothing=0.05)
    expected = torch_module(logits.double().cpu(), target.cpu())
    assert ref.rel_error(plain(logits, target), expected) <= 1e-5


def test_autocast_returns_float32_like_torch(device, gen):
    logits, target = _inputs(gen, device, rows=32, vocab=300)
    x = logits.bfloat16().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = xent.cross_entropy(x, target)
        torch_loss = F.cross_entropy(x, target)
    assert loss.dtype == torch_loss.dtype == torch.float32
    # The value against float64 on the same 16-bit logits: torch's own autocast loss lands on a
    # 16-bit-like grid on CUDA (measured up to 1e-3 relative off float64), ours is fp32 math.
    expected = ref.cross_entropy(x.detach(), target)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, torch_loss, rtol=2e-3, atol=2e-3)
    loss.backward()
    assert x.grad.dtype == torch.bfloat16


def test_double_backward_raises(gen):
    x = ref.randn(gen, 4, 9).requires_grad_()
    loss = xent.cross_entropy(x, torch.tensor([1, 2, 3, 4]))
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        grad.sum().backward()
