"""xent.linear_policy_loss (docs/semantics.md §7 on an LM head) against the float64 reference:
every loss type × aggregation × policy_loss's option cases, the gradients of hidden, weight and
bias, agreement with policy_loss on materialised logits, small workspaces, dtypes, the path without
gradient, torch.compile, and the errors."""

import re

import pytest
import reference as ref
import torch
from test_compile import _compiled_matches_eager
from test_policy_loss import CASES, _case_inputs, _check_stats

import xent
from xent import _linear_policy

HIDDEN = 29


class _Head:
    """Draws hidden states (rows..., HIDDEN), a weight and a bias for _case_inputs, and returns
    the fp32 logits they give (what the option cases derive old / ref logprobs from)."""

    def __init__(self, gen, device, dtype=torch.float32, bias=True):
        self.gen, self.device, self.dtype, self.with_bias = gen, device, dtype, bias

    def __call__(self, shape):
        *rows, vocab = shape
        self.hidden = ref.randn(self.gen, *rows, HIDDEN, dtype=self.dtype, device=self.device)
        # Logits of standard deviation ~2, as in test_policy_loss.
        scale = 2.0 / HIDDEN**0.5
        self.weight = ref.randn(
            self.gen, vocab, HIDDEN, dtype=self.dtype, device=self.device, scale=scale
        )
        self.bias = (
            ref.randn(self.gen, vocab, dtype=self.dtype, device=self.device, scale=0.5)
            if self.with_bias
            else None
        )
        return self.logits64().float().reshape(shape).to(self.device)

    def params(self):
        return [t for t in (self.hidden, self.weight, self.bias) if t is not None]

    def logits64(self, params=None):
        hidden, weight, *bias = params or [t.cpu().double() for t in self.params()]
        return ref.linear_logits(hidden.reshape(-1, HIDDEN), weight, *bias)


def _inputs(gen, device, case, loss_type, aggregation, dtype=torch.float32, bias=True):
    head = _Head(gen, device, dtype, bias)
    logits, target, advantages, kwargs = _case_inputs(
        gen, device, case, loss_type, aggregation, make_logits=head
    )
    return head, logits, target, advantages, kwargs


def _public(kwargs):
    return {key: value for key, value in kwargs.items() if not key.startswith("_")}


def _call(head, params, target, advantages, kwargs, **extra):
    hidden, weight, *bias = params
    bias = bias[0] if bias else None
    return xent.linear_policy_loss(
        hidden, weight, target, advantages, bias=bias, **_public(kwargs), **extra
    )


def _reference(head, target, advantages, kwargs):
    """The float64 reference on the head's logits, and the float64 parameters it differentiates."""
    params64 = [t.detach().cpu().double().requires_grad_() for t in head.params()]
    cpu = {
        key: (value.cpu() if isinstance(value, torch.Tensor) else value)
        for key, value in _public(kwargs).items()
    }
    if isinstance(cpu.get("normalizer"), torch.Tensor):
        cpu["normalizer"] = cpu["normalizer"].item()
    logits64 = head.logits64(params64).reshape(*target.shape, -1)
    expected = ref.policy_loss(logits64, target.cpu(), advantages.cpu(), **cpu)
    return expected, params64


@pytest.mark.parametrize("aggregation", xent.POLICY_AGGREGATIONS)
@pytest.mark.parametrize("loss_type", xent.POLICY_LOSS_TYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_linear_policy_loss_against_reference(device, gen, case, loss_type, aggregation):
    head, _, target, advantages, kwargs = _inputs(
        gen, device, case, loss_type, aggregation, bias=case != "on_policy"
    )
    params = [t.clone().requires_grad_() for t in head.params()]
    result = _call(head, params, target, advantages, kwargs, return_stats=True)
    expected, params64 = _reference(head, target, advantages, kwargs)
    assert result.loss.dtype == torch.float32 and result.loss.shape == ()
    assert result.logprob.shape == target.shape == result.entropy.shape
    # As test_policy_loss, plus the fp32 product's rounding of each logit (relative ~1e-7 of
    # |h|·|w| over H = 29 terms): the loss against the magnitude of what it sums.
    tol = 1e-5
    assert abs(result.loss.item() - expected["loss"].item()) <= tol * expected["scale"] + 1e-12
    _check_stats(result, expected, tol)
    result.loss.backward()
    grads_expected = torch.autograd.grad(expected["loss"], params64)
    # ∂h = G·W and ∂W = Gᵀ·h sum fp32 products of the logits gradient, whose relative error is
    # policy_loss's; the bias gradient is a column sum of it.
    for param, grad_expected in zip(params, grads_expected):
        assert param.grad.dtype == param.dtype and torch.isfinite(param.grad).all()
        assert ref.rel_error(param.grad, grad_expected) <= 1e-4
    ignored = (~kwargs["_flat_valid"]).reshape(target.shape).to(device)
    assert (params[0].grad[ignored] == 0).all()
    assert (result.logprob[ignored] == 0).all() and (result.entropy[ignored] == 0).all()


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "cispo", "sapo"])
def test_matches_policy_loss_on_materialised_logits(device, gen, loss_type):
    # The GRPO configuration of the performance target: clip-higher, k3 KL, entropy bonus.
    head, _, target, advantages, kwargs = _inputs(
        gen, device, "off_policy_kl_entropy", loss_type, "token_mean"
    )
    params = [t.clone().requires_grad_() for t in head.params()]
    fused = _call(head, params, target, advantages, kwargs, return_stats=True)
    fused.loss.backward()
    plain_params = [t.clone().requires_grad_() for t in head.params()]
    hidden, weight, bias = plain_params
    logits = hidden @ weight.T + bias
    plain = xent.policy_loss(logits, target, advantages, **_public(kwargs), return_stats=True)
    plain.loss.backward()
    expected, _ = _reference(head, target, advantages, kwargs)
    # Both are fp32 products of the same operands, rounded in other orders.
    assert abs(fused.loss.item() - plain.loss.item()) <= 1e-5 * expected["scale"]
    for name in ("logprob", "entropy"):
        assert ref.rel_error(getattr(fused, name), getattr(plain, name)) <= 1e-5
    for a, b in zip(params, plain_params):
        assert ref.rel_error(a.grad, b.grad) <= 1e-4


FUSED_LOSS_TYPES = [t for t in xent.POLICY_LOSS_TYPES if t != "gspo"]


def _run_path(monkeypatch, fused, head, target, advantages, kwargs, **extra):
    """The result and parameter gradients with the three-product op (fused) or the composition."""
    monkeypatch.setattr(_linear_policy, "_fused_applies", lambda options: fused)
    params = [t.detach().clone().requires_grad_() for t in head.params()]
    result = _call(head, params, target, advantages, kwargs, return_stats=True, **extra)
    result.loss.backward()
    return result, [p.grad for p in params]


@pytest.mark.parametrize("aggregation", xent.POLICY_AGGREGATIONS)
@pytest.mark.parametrize("loss_type", FUSED_LOSS_TYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_composition_in_float64(monkeypatch, gen, case, loss_type, aggregation):
    """The per-token math of the three-product op (src/common/policy_row.hpp) against the Python
    formulas of _policy.py that the composition runs, in float64 on the CPU, for every loss type,
    option case and aggregation: the guard against the two drifting apart. Both sum the same
    float64 terms in other orders, so they agree to a few ulps of the magnitudes summed."""
    head, _, target, advantages, kwargs = _inputs(
        gen, "cpu", case, loss_type, aggregation, dtype=torch.float64
    )
    fused, fused_grads = _run_path(monkeypatch, True, head, target, advantages, kwargs)
    plain, plain_grads = _run_path(monkeypatch, False, head, target, advantages, kwargs)
    assert fused.loss.dtype == torch.float64
    for name, a, b in zip(fused._fields, fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    for a, b in zip(fused_grads, plain_grads):
        assert ref.rel_error(a, b) <= 1e-10


@pytest.mark.parametrize("budget", [16 << 10, 40 << 10])  # chunks of a few rows, uneven
@pytest.mark.parametrize("loss_type", FUSED_LOSS_TYPES)
def test_fused_chunks_match_composition(monkeypatch, gen, loss_type, budget):
    head, _, target, advantages, kwargs = _inputs(
        gen,
        "cpu",
        "dual_clip_tis_mask" if loss_type in ("grpo", "dapo") else "off_policy_kl_entropy",
        loss_type,
        "token_mean",
    )
    fused, fused_grads = _run_path(
        monkeypatch, True, head, target, advantages, kwargs, workspace_bytes=budget
    )
    plain, plain_grads = _run_path(monkeypatch, False, head, target, advantages, kwargs)
    for name, a, b in zip(fused._fields, fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    for a, b in zip(fused_grads, plain_grads):
        assert ref.rel_error(a, b) <= 1e-5


def _smallest_budget(head, target, advantages, kwargs):
    """The backend's smallest workspace budget for this call with every gradient, read from the
    error a budget of one byte gives (on CUDA it also holds product scratch)."""
    params = [t.detach().clone().requires_grad_() for t in head.params()]
    with pytest.raises(ValueError, match="too small") as error:
        _call(head, params, target, advantages, kwargs, workspace_bytes=1)
    found = re.search(r"expected at least (\d+)", str(error.value))
    assert found, str(error.value)
    return int(found.group(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 3, None], ids=["smallest", "smallest+3rows", "default"])
@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo"])
def test_fused_matches_composition_on_device(monkeypatch, device, gen, loss_type, rows, dtype):
    """The three-product op against the composition on each backend, one chunk or many: at the
    smallest budget a 16-bit weight's ∂W has no room for its fp32 accumulator, so the op runs the
    vocabulary-blocked schedule (∂W from the saved statistics and coefficients). Both paths form
    16-bit chunk logits and gradients in other chunkings, so they agree to the rounding of the
    dtype; fp32 to that of its products."""
    head, _, target, advantages, kwargs = _inputs(
        gen, device, "off_policy_kl_entropy", loss_type, "seq_mean_token_mean", dtype=dtype
    )
    extra = {}
    if rows is not None:
        # A few rows of fp32 chunk logits and gradient above the smallest plan.
        vocab = head.weight.shape[0]
        extra["workspace_bytes"] = (
            _smallest_budget(head, target, advantages, kwargs) + rows * 8 * vocab
        )
    fused, fused_grads = _run_path(monkeypatch, True, head, target, advantages, kwargs, **extra)
    plain, plain_grads = _run_path(monkeypatch, False, head, target, advantages, kwargs, **extra)
    half = dtype != torch.float32
    tol = 2e-2 if half else 1e-5
    for name, a, b in zip(fused._fields, fused, plain):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    for a, b in zip(fused_grads, plain_grads):
        assert a.dtype == dtype and ref.rel_error(a, b) <= (3e-2 if half else 1e-5)


def test_small_workspace_matches_one_chunk(device, gen):
    head, _, target, advantages, kwargs = _inputs(
        gen, device, "dual_clip_tis_mask", "gspo", "seq_mean_token_mean"
    )
    results = []
    for budget in (None, 16 << 10):  # 16 KiB: chunks of a few rows
        params = [t.clone().requires_grad_() for t in head.params()]
        loss = _call(head, params, target, advantages, kwargs, workspace_bytes=budget)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in params]))
    (whole, whole_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)
    for a, b in zip(chunked_grads, whole_grads):
        assert ref.rel_error(a, b) <= 1e-5


def test_without_gradient_matches_with(device, gen):
    head, _, target, advantages, kwargs = _inputs(
        gen, device, "dual_clip_tis_mask", "dapo", "seq_mean_token_mean"
    )
    frozen = _call(head, head.params(), target, advantages, kwargs, return_stats=True)
    params = [t.clone().requires_grad_() for t in head.params()]
    live = _call(head, params, target, advantages, kwargs, return_stats=True)
    for a, b in zip(frozen, live):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_nothing_valid_or_no_rows_gives_zero(device, gen):
    hidden = ref.randn(gen, 3, 5, HIDDEN, device=device)
    weight = ref.randn(gen, 11, HIDDEN, device=device)
    target = torch.full((3, 5), -100, device=device)
    advantages = torch.randn(3, 5, generator=gen).to(device)
    cases = [(hidden, target, advantages, aggregation) for aggregation in xent.POLICY_AGGREGATIONS]
    cases.append((hidden[:0], target[:0], advantages[:0], "token_mean"))  # no rows at all
    for h, y, a, aggregation in cases:
        params = [h.clone().requires_grad_(), weight.clone().requires_grad_()]
        result = xent.linear_policy_loss(
            *params,
            y,
            a,
            aggregation=aggregation,
            normalizer=3.0,
            entropy_coef=0.1,
            return_stats=True,
        )
        assert result.loss.item() == 0 and result.ratio.item() == 0
        result.loss.backward()
        assert all((p.grad == 0).all() for p in params)


def test_frozen_weight_and_upstream_scaling(device, gen):
    head, _, target, advantages, kwargs = _inputs(
        gen, device, "off_policy_kl_entropy", "grpo", "token_mean", bias=False
    )
    grads = []
    for factor in (1.0, -2.5):
        hidden = head.hidden.clone().requires_grad_()
        (factor * _call(head, [hidden, head.weight], target, advantages, kwargs)).backward()
        grads.append(hidden.grad)
    torch.testing.assert_close(grads[1], -2.5 * grads[0], rtol=1e-6, atol=0)
    hidden = head.hidden.clone().requires_grad_()
    loss = _call(head, [hidden, head.weight], target, advantages, kwargs)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="linear_policy_loss: backward through this loss ran"):
        loss.backward()


def test_float64_gives_float64_results(gen):
    head = _Head(gen, "cpu", torch.float64)
    logits, target, advantages, kwargs = _case_inputs(
        gen, "cpu", "off_policy_kl_entropy", "gspo", "seq_mean_token_sum", make_logits=head
    )
    params = [t.clone().requires_grad_() for t in head.params()]
    result = _call(head, params, target, advantages, kwargs, return_stats=True)
    assert all(value.dtype == torch.float64 for value in result)
    expected, params64 = _reference(head, target, advantages, kwargs)
    assert abs(result.loss.item() - expected["loss"].item()) <= 1e-12 * expected["scale"]
    result.loss.backward()
    for param, grad_expected in zip(params, torch.autograd.grad(expected["loss"], params64)):
        assert param.grad.dtype == torch.float64
        assert ref.rel_error(param.grad, grad_expected) <= 1e-11


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_no_worse_than_policy_loss_on_torch_logits(device, gen, dtype):
    head = _Head(gen, device, dtype)
    _, target, advantages, kwargs = _case_inputs(
        gen, device, "off_policy_kl_entropy", "dapo", "token_mean", make_logits=head
    )
    params = [t.clone().requires_grad_() for t in head.params()]
    fused = _call(head, params, target, advantages, kwargs)
    fused.backward()
    # PyTorch at this dtype: 16-bit logits from F.linear, then policy_loss.
    torch_params = [t.clone().requires_grad_() for t in head.params()]
    logits = torch.nn.functional.linear(*torch_params)
    plain = xent.policy_loss(logits, target, advantages, **_public(kwargs))
    plain.backward()
    expected, params64 = _reference(head, target, advantages, kwargs)
    grads_expected = torch.autograd.grad(expected["loss"], params64)
    bound = abs(plain.item() - expected["loss"].item()) + 1e-3 * expected["scale"]
    assert fused.dtype == torch.float32 and abs(fused.item() - expected["loss"].item()) <= bound
    for param, torch_param, grad_expected in zip(params, torch_params, grads_expected):
        assert param.grad.dtype == dtype and torch.isfinite(param.grad).all()
        bound = ref.rel_error(torch_param.grad, grad_expected) + 1e-3
        assert ref.rel_error(param.grad, grad_expected) <= bound


def test_fp32_master_weight_keeps_an_fp32_gradient(device, gen):
    head, _, target, advantages, kwargs = _inputs(
        gen, device, "off_policy_kl_entropy", "grpo", "token_mean", bias=False
    )
    hidden = head.hidden.to(torch.bfloat16).requires_grad_()
    weight = head.weight.clone().requires_grad_()
    loss = _call(head, [hidden, weight], target, advantages, kwargs)
    loss.backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
    plain_weight = head.weight.clone().requires_grad_()
    logits = hidden.detach() @ plain_weight.to(torch.bfloat16).T
    xent.policy_loss(logits, target, advantages, **_public(kwargs)).backward()
    assert ref.rel_error(weight.grad, plain_weight.grad) <= 2e-2


def test_compile_linear_policy_loss(device, gen):
    head, _, target, advantages, kwargs = _inputs(
        gen, device, "dual_clip_tis_mask", "gspo", "seq_mean_token_mean"
    )
    public = _public(kwargs)

    def fn(hidden, weight, bias):
        result = xent.linear_policy_loss(
            hidden * 1.5, weight, target, advantages, bias=bias, **public, return_stats=True
        )
        return result.loss + 0.0 * result.kl

    _compiled_matches_eager(fn, head.params(), grads_of=[0, 1, 2])


def _small():
    return torch.randn(2, 3, 5), torch.randn(11, 5), torch.randint(0, 11, (2, 3)), torch.randn(2, 3)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(loss_type="ppo2"), ValueError, "linear_policy_loss: loss_type unknown: got 'ppo2'"),
        (dict(clip_high=-0.1), ValueError, "linear_policy_loss: clip_high out of range"),
        (dict(kl_coef=0.1), ValueError, "linear_policy_loss: ref_logprobs missing"),
        (dict(tis_cap=2.0), ValueError, "linear_policy_loss: rollout_logprobs missing"),
        (
            dict(aggregation="token_sum_norm"),
            ValueError,
            "linear_policy_loss: normalizer missing",
        ),
        (
            dict(old_logprobs=torch.zeros(2, 4)),
            ValueError,
            r"linear_policy_loss: old_logprobs shape mismatch: got \(2, 4\)",
        ),
        (
            dict(workspace_bytes=0),
            ValueError,
            "linear_policy_loss: workspace_bytes out of range",
        ),
        (
            dict(bias=torch.zeros(7)),
            ValueError,
            "linear_policy_loss: bias",
        ),
    ],
)
def test_errors(kwargs, error, message):
    hidden, weight, target, advantages = _small()
    with pytest.raises(error, match=message):
        xent.linear_policy_loss(hidden, weight, target, advantages, **kwargs)


def test_more_errors():
    hidden, weight, target, advantages = _small()
    with pytest.raises(ValueError, match="linear_policy_loss: weight is not a tensor"):
        xent.linear_policy_loss(hidden, None, target, advantages)
    with pytest.raises(ValueError, match="linear_policy_loss: advantages shape mismatch"):
        xent.linear_policy_loss(hidden, weight, target, torch.ones(2))
    with pytest.raises(ValueError, match="linear_policy_loss: weight"):
        xent.linear_policy_loss(hidden, weight[:, :4], target, advantages)
    flat, flat_target, flat_adv = hidden.flatten(0, 1), target.flatten(), advantages.flatten()
    with pytest.raises(ValueError, match="linear_policy_loss: sequence_ids missing.*2-D hidden"):
        xent.linear_policy_loss(flat, weight, flat_target, flat_adv, loss_type="gspo")
    with pytest.raises(ValueError, match="linear_policy_loss: target out of range"):
        xent.linear_policy_loss(hidden, weight, torch.full((2, 3), 11), advantages)
