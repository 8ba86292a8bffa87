"""xent.policy_loss (docs/semantics.md §7) against the float64 reference: every loss type ×
aggregation × a set of option cases, the statistics, the gradient formed in the forward, dtypes,
the path without gradient, torch.compile, and the errors."""

import math

import pytest
import reference as ref
import torch
from test_compile import _compiled_matches_eager

import xent

VOCAB = 1031

# Option cases run for every loss type and aggregation. layout: how the sequences are told —
# "rows" (3-D logits, each row a sequence), "ids" (sequence_ids, scattered and not contiguous),
# "cu" (cu_seqlens, empty sequences included).
CASES = {
    "on_policy": dict(layout="rows"),
    "off_policy_kl_entropy": dict(
        layout="ids",
        old=0.3,
        clip_high=0.28,
        ref=True,
        kl_coef=0.05,
        kl_estimator="k3",
        entropy_coef=0.01,
        temperature=0.7,
    ),
    "dual_clip_tis_mask": dict(
        layout="cu",
        old=0.4,
        dual_clip=1.5,
        rollout=True,
        tis_cap=1.5,
        ref=True,
        kl_coef=0.1,
        kl_estimator="k1",
        loss_mask=True,
        softcap=5.0,
        normalizer="tensor",
    ),
    "sequence_advantage_k2_tis_on_policy": dict(
        layout="rows",
        sequence_advantage=True,
        rollout=True,
        tis_cap=1.2,
        ref=True,
        kl_coef=0.2,
        kl_estimator="k2",
        temperature=1.3,
        normalizer="float",
    ),
    # GSPO's clip range (its paper's 3e-4 / 4e-4) with log-ratios of that size.
    "tight_clip": dict(layout="ids", old=5e-4, clip_low=3e-4, clip_high=4e-4),
}

# Where the op's ratio meets a clip bound its gradient jumps, and fp32 and float64 may land on
# either side of it. ℓ in fp32 is off by ~1e-6 (its lse is ~10, rounded at 6e-8 relative), so the
# tests keep every ratio (and GSPO's sequence ratio) at least this far, relatively, from a bound.
KINK_MARGIN = 1e-4


def _away_from(values, kinks):
    """values (ratios) moved to kink·(1 ± 2·KINK_MARGIN) where they come within the margin."""
    out = values.clone()
    for kink in kinks:
        near = (out - kink).abs() < KINK_MARGIN * kink
        side = torch.where(out >= kink, 1.0, -1.0).double()
        out = torch.where(near, kink * (1 + 2 * KINK_MARGIN * side), out)
    return out


def _layout(gen, layout, device):
    """(logits shape, sequence keyword arguments) for one layout."""
    if layout == "rows":
        return (3, 13, VOCAB), {}
    rows = 37
    if layout == "ids":
        ids = torch.randint(0, 6, (rows,), generator=gen) * 6 + 1  # values in [1, 32)
        return (rows, VOCAB), dict(sequence_ids=ids.to(device))
    cuts = torch.randint(0, rows + 1, (4,), generator=gen).sort().values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])
    return (rows, VOCAB), dict(cu_seqlens=bounds.to(device))


def _case_inputs(gen, device, case, loss_type, aggregation, dtype=torch.float32, make_logits=None):
    """(logits, target, advantages, keyword arguments of policy_loss) for one case; make_logits
    (shape -> logits) replaces the random logits (test_linear_policy_loss forms them from a head)."""
    spec = dict(CASES[case])
    shape, kwargs = _layout(gen, spec.pop("layout"), device)
    if make_logits is not None:
        logits = make_logits(shape)
    else:
        logits = ref.randn(gen, *shape, dtype=dtype, device=device, scale=2.0)
    row_shape = shape[:-1]
    rows = math.prod(row_shape)
    target = ref.targets(gen, rows, VOCAB, device).reshape(row_shape)
    passed = ("clip_low", "clip_high", "kl_coef", "kl_estimator", "entropy_coef", "tis_cap")
    for key in passed + ("temperature", "softcap"):
        if key in spec:
            kwargs[key] = spec[key]
    if spec.get("dual_clip") and loss_type not in ("cispo", "sapo"):
        kwargs["dual_clip"] = spec["dual_clip"]
    kwargs["loss_type"] = loss_type
    kwargs["aggregation"] = aggregation
    valid = target.cpu() != -100
    if spec.get("loss_mask"):
        mask = torch.rand(row_shape, generator=gen) < 0.85
        kwargs["loss_mask"] = mask.to(device)
        valid = valid & mask
    sequences = ref._sequence_lists(
        rows,
        valid.reshape(-1).tolist(),
        kwargs.get("sequence_ids", None),
        kwargs.get("cu_seqlens", None),
        row_shape,
    )
    if spec.get("sequence_advantage"):
        per_row = torch.randn(row_shape[0], generator=gen, dtype=torch.float64)
        advantages = per_row[:, None].expand(row_shape).float()
    else:
        advantages = torch.randn(row_shape, generator=gen, dtype=torch.float64).float()
    kwargs["_flat_valid"] = valid.reshape(-1)
    lp64 = ref.logprobs(
        logits.reshape(rows, -1).cpu().double(),
        target.reshape(-1).cpu(),
        kwargs.get("temperature", 1.0),
        softcap=kwargs.get("softcap"),
    )[0]
    old = lp64.clone()
    if spec.get("old"):
        low = kwargs.get("clip_low", 0.2)
        high = kwargs.get("clip_high", low)
        kinks = [1 - low, 1 + high] + ([kwargs["dual_clip"]] if "dual_clip" in kwargs else [])
        ratio = torch.exp(spec["old"] * torch.randn(rows, generator=gen, dtype=torch.float64))
        log_ratio = torch.log(_away_from(ratio, kinks))
        if loss_type == "gspo":  # the kinks are on the sequence ratio: shift whole sequences
            for members in sequences:
                mean = log_ratio[members].mean()
                moved = math.log(_away_from(torch.exp(mean)[None], kinks)[0])
                log_ratio[members] += moved - mean
        old = lp64 - log_ratio
        if spec.get("loss_mask"):  # padding data that the loss must never read
            old = torch.where(valid.reshape(-1), old, torch.full_like(old, -math.inf))
        kwargs["old_logprobs"] = old.float().reshape(row_shape).to(device)
    if spec.get("ref"):
        reference = lp64 + 0.3 * torch.randn(rows, generator=gen, dtype=torch.float64)
        kwargs["ref_logprobs"] = reference.float().reshape(row_shape).to(device)
    if spec.get("rollout"):
        mismatch = 0.4 * torch.randn(rows, generator=gen, dtype=torch.float64)
        kwargs["rollout_logprobs"] = (old - mismatch).float().reshape(row_shape).to(device)
    if spec.get("normalizer") == "tensor" or aggregation == "token_sum_norm":
        kwargs["normalizer"] = torch.tensor(47.0, device=device)
    elif spec.get("normalizer") == "float":
        kwargs["normalizer"] = 5.0
    return logits, target, advantages.to(device), kwargs


def _reference(logits, target, advantages, kwargs):
    """The float64 reference of the same call, and the float64 logits it differentiates."""
    x64 = logits.detach().cpu().double().requires_grad_()
    cpu = {
        key: (value.cpu() if isinstance(value, torch.Tensor) else value)
        for key, value in kwargs.items()
        if not key.startswith("_")
    }
    if isinstance(cpu.get("normalizer"), torch.Tensor):
        cpu["normalizer"] = cpu["normalizer"].item()
    expected = ref.policy_loss(x64, target.cpu(), advantages.cpu(), **cpu)
    return expected, x64


def _call(logits, target, advantages, kwargs, **extra):
    public = {key: value for key, value in kwargs.items() if not key.startswith("_")}
    return xent.policy_loss(logits, target, advantages, **public, **extra)


def _check_stats(result, expected, tol):
    assert ref.rel_error(result.logprob, expected["logprob"]) <= tol
    assert ref.rel_error(result.entropy, expected["entropy"]) <= tol
    # Counts of ratios kept KINK_MARGIN from the bounds: exact.
    assert result.clip_fraction_low.item() == pytest.approx(
        expected["clip_fraction_low"].item(), abs=1e-6
    )
    assert result.clip_fraction_high.item() == pytest.approx(
        expected["clip_fraction_high"].item(), abs=1e-6
    )
    # Means of functions of ℓ with derivatives of order 1: ℓ's error, bounded as the loss's.
    for name in ("kl", "ratio"):
        assert abs(getattr(result, name).item() - expected[name].item()) <= tol * (
            1 + abs(expected[name].item())
        )


@pytest.mark.parametrize("aggregation", xent.POLICY_AGGREGATIONS)
@pytest.mark.parametrize("loss_type", xent.POLICY_LOSS_TYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_policy_loss_against_reference(device, gen, case, loss_type, aggregation):
    logits, target, advantages, kwargs = _case_inputs(gen, device, case, loss_type, aggregation)
    x = logits.clone().requires_grad_()
    result = _call(x, target, advantages, kwargs, return_stats=True)
    expected, x64 = _reference(logits, target, advantages, kwargs)
    assert result.loss.dtype == torch.float32 and result.loss.shape == ()
    assert result.logprob.shape == target.shape == result.entropy.shape
    # fp32 kernels against float64: ℓ and H carry relative errors of order 1e-7·|lse| (bounded at
    # 1e-5 in test_logprobs), and each enters the loss through its coefficient. The loss is a sum
    # that may cancel, so its error is bounded against the magnitude of what it adds up (the
    # reference's `scale`: Σ|g·L| + Σ|∂loss/∂ℓ| + Σ|∂loss/∂H|), not against the loss.
    tol = 1e-5
    assert abs(result.loss.item() - expected["loss"].item()) <= tol * expected["scale"] + 1e-12
    _check_stats(result, expected, tol)
    result.loss.backward()
    (grad_expected,) = torch.autograd.grad(expected["loss"], [x64])
    assert x.grad.dtype == logits.dtype and torch.isfinite(x.grad).all()
    # Each row's gradient is its (fp32) coefficients times §1's logprob/entropy gradient: the
    # relative error of test_logprobs.
    assert ref.rel_error(x.grad, grad_expected) <= tol
    ignored = (~kwargs["_flat_valid"]).reshape(target.shape).to(device)
    assert (x.grad[ignored] == 0).all()
    assert (result.logprob[ignored] == 0).all() and (result.entropy[ignored] == 0).all()


def test_without_gradient_matches_with(device, gen):
    logits, target, advantages, kwargs = _case_inputs(
        gen, device, "dual_clip_tis_mask", "dapo", "seq_mean_token_mean"
    )
    frozen = _call(logits, target, advantages, kwargs, return_stats=True)
    x = logits.clone().requires_grad_()
    live = _call(x, target, advantages, kwargs, return_stats=True)
    for a, b in zip(frozen, live):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(_call(x, target, advantages, kwargs), live.loss.detach())


def test_upstream_gradient_scales_the_formed_gradient(device, gen):
    logits, target, advantages, kwargs = _case_inputs(
        gen, device, "off_policy_kl_entropy", "grpo", "token_mean"
    )
    grads = []
    for factor in (1.0, -2.5):
        x = logits.clone().requires_grad_()
        (factor * _call(x, target, advantages, kwargs)).backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], -2.5 * grads[0], rtol=1e-6, atol=0)
    x = logits.clone().requires_grad_()
    loss = _call(x, target, advantages, kwargs)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="policy_loss: backward through this loss ran twice"):
        loss.backward()


def test_float64_logits_give_float64_results(gen):
    logits, target, advantages, kwargs = _case_inputs(
        gen, "cpu", "off_policy_kl_entropy", "gspo", "seq_mean_token_sum", dtype=torch.float64
    )
    x = logits.clone().requires_grad_()
    result = _call(x, target, advantages, kwargs, return_stats=True)
    assert all(value.dtype == torch.float64 for value in result)
    expected, x64 = _reference(logits, target, advantages, kwargs)
    # float64 kernels: the same formulas rounded at 1e-16, not 6e-8.
    assert abs(result.loss.item() - expected["loss"].item()) <= 1e-12 * expected["scale"]
    result.loss.backward()
    (grad_expected,) = torch.autograd.grad(expected["loss"], [x64])
    assert x.grad.dtype == torch.float64
    assert ref.rel_error(x.grad, grad_expected) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits(device, gen, dtype):
    logits, target, advantages, kwargs = _case_inputs(
        gen, device, "off_policy_kl_entropy", "dapo", "token_mean", dtype=dtype
    )
    x = logits.clone().requires_grad_()
    result = _call(x, target, advantages, kwargs, return_stats=True)
    assert result.loss.dtype == torch.float32
    # The reference reads the same 16-bit values, so the loss is as accurate as from fp32 logits.
    expected, x64 = _reference(logits, target, advantages, kwargs)
    assert abs(result.loss.item() - expected["loss"].item()) <= 1e-5 * expected["scale"]
    result.loss.backward()
    (grad_expected,) = torch.autograd.grad(expected["loss"], [x64])
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    # The gradient is stored in the input dtype: its rounding, plus the fp32 bound.
    bound = ref.rel_error(grad_expected.to(dtype), grad_expected) + 1e-5
    assert ref.rel_error(x.grad, grad_expected) <= bound


def test_on_policy_grpo_is_the_plain_policy_gradient(device, gen):
    # Defaults: ratio 1 with its gradient, token mean: the loss is −mean(A) and its gradient that
    # of −mean(A·ℓ) (xent.logprobs' backward, a separate path).
    logits = ref.randn(gen, 37, VOCAB, device=device, scale=2.0)
    target = ref.targets(gen, 37, VOCAB, device)
    advantages = torch.randn(37, generator=gen).to(device)
    x = logits.clone().requires_grad_()
    loss = xent.policy_loss(x, target, advantages)
    valid = target != -100
    torch.testing.assert_close(loss, -advantages[valid].mean())
    loss.backward()
    x2 = logits.clone().requires_grad_()
    logprob = xent.logprobs(x2, target)
    (-(advantages * logprob)[valid].sum() / valid.sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-8)


def test_nothing_valid_gives_zero(device, gen):
    logits = ref.randn(gen, 3, 5, 11, device=device)
    target = torch.full((3, 5), -100, device=device)
    advantages = torch.randn(3, 5, generator=gen).to(device)
    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        x = logits.clone().requires_grad_()
        result = xent.policy_loss(
            x, target, advantages, aggregation=aggregation, entropy_coef=0.1, return_stats=True
        )
        assert result.loss.item() == 0 and result.ratio.item() == 0
        result.loss.backward()
        assert (x.grad == 0).all()


def test_loss_mask_equals_ignore_index(device, gen):
    logits, target, advantages, kwargs = _case_inputs(
        gen, device, "off_policy_kl_entropy", "cispo", "seq_mean_token_mean"
    )
    mask = torch.rand(target.shape, generator=gen) < 0.7
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    first = _call(x1, target, advantages, kwargs, loss_mask=mask.to(device).float())
    ignored = torch.where(mask.to(device), target, torch.full_like(target, -100))
    second = _call(x2, ignored, advantages, kwargs)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    first.backward()
    second.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)


def test_normalizer_splits_a_batch_into_micro_batches(device, gen):
    # Gradient accumulation: two halves, each divided by the whole batch's token count, add up to
    # the whole batch's token mean.
    logits = ref.randn(gen, 40, VOCAB, device=device, scale=2.0)
    target = ref.targets(gen, 40, VOCAB, device)
    advantages = torch.randn(40, generator=gen).to(device)
    old = xent.logprobs(logits, target) + 0.2 * torch.randn(40, generator=gen).to(device)
    options = dict(clip_high=0.28, entropy_coef=0.01)
    whole = logits.clone().requires_grad_()
    xent.policy_loss(whole, target, advantages, old_logprobs=old, **options).backward()
    count = (target != -100).sum()
    parts = logits.clone().requires_grad_()
    total = 0
    for half in (slice(0, 20), slice(20, 40)):
        total = total + xent.policy_loss(
            parts[half],
            target[half],
            advantages[half],
            old_logprobs=old[half],
            normalizer=count,
            **options,
        )
    total.backward()
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-5, atol=1e-9)


def test_cu_seqlens_and_sequence_ids_agree(device, gen):
    logits = ref.randn(gen, 37, VOCAB, device=device, scale=2.0)
    target = ref.targets(gen, 37, VOCAB, device)
    advantages = torch.randn(37, generator=gen).to(device)
    bounds = torch.tensor([0, 5, 5, 20, 37], device=device)
    ids = torch.searchsorted(bounds[1:], torch.arange(37, device=device), right=True)
    results = [
        xent.policy_loss(logits, target, advantages, loss_type="gspo", **sequences)
        for sequences in (dict(cu_seqlens=bounds), dict(sequence_ids=ids * 7 % 37))
    ]
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=0)


def test_compile_policy_loss(device, gen):
    logits, target, advantages, kwargs = _case_inputs(
        gen, device, "dual_clip_tis_mask", "gspo", "seq_mean_token_mean"
    )
    public = {key: value for key, value in kwargs.items() if not key.startswith("_")}

    def fn(x):
        result = xent.policy_loss(x * 1.5, target, advantages, **public, return_stats=True)
        return result.loss + 0.0 * result.kl

    _compiled_matches_eager(fn, [logits], grads_of=[0])


def _small():
    logits = torch.randn(2, 3, 11)
    target = torch.randint(0, 11, (2, 3))
    return logits, target, torch.randn(2, 3)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(loss_type="ppo2"), ValueError, "policy_loss: loss_type unknown: got 'ppo2'"),
        (dict(aggregation="mean"), ValueError, "policy_loss: aggregation unknown"),
        (dict(kl_estimator="k4"), ValueError, "policy_loss: kl_estimator unknown"),
        (dict(clip_low=0.0), ValueError, "policy_loss: clip_low out of range"),
        (dict(clip_high=-0.1), ValueError, "policy_loss: clip_high out of range"),
        (dict(dual_clip=1.0), ValueError, "policy_loss: dual_clip out of range"),
        (dict(dual_clip=3.0, loss_type="cispo"), ValueError, "policy_loss: dual_clip unsupported"),
        (dict(kl_coef=-1.0), ValueError, "policy_loss: kl_coef out of range"),
        (dict(kl_coef=0.1), ValueError, "policy_loss: ref_logprobs missing"),
        (dict(tis_cap=2.0), ValueError, "policy_loss: rollout_logprobs missing"),
        (dict(temperature=0.0), ValueError, "policy_loss: temperature out of range"),
        (dict(normalizer=0.0), ValueError, "policy_loss: normalizer out of range"),
        (
            dict(normalizer=torch.ones(2)),
            ValueError,
            "policy_loss: normalizer is not a scalar",
        ),
        (
            dict(aggregation="token_sum_norm"),
            ValueError,
            "policy_loss: normalizer missing",
        ),
        (dict(sapo_tau_neg=0.0), ValueError, "policy_loss: sapo_tau_neg out of range"),
        (
            dict(old_logprobs=torch.zeros(2, 4)),
            ValueError,
            r"policy_loss: old_logprobs shape mismatch: got \(2, 4\)",
        ),
        (
            dict(old_logprobs=torch.zeros(2, 3, dtype=torch.int64)),
            TypeError,
            "policy_loss: old_logprobs dtype unsupported",
        ),
        (dict(loss_mask=torch.ones(3, 2)), ValueError, "policy_loss: loss_mask shape mismatch"),
        (
            dict(sequence_ids=torch.zeros(2, 3), aggregation="seq_mean_token_sum"),
            TypeError,
            "policy_loss: sequence_ids dtype unsupported",
        ),
        (
            dict(sequence_ids=torch.full((2, 3), 6)),
            ValueError,
            r"policy_loss: sequence_ids out of range: .*expected ids in \[0, 6\)",
        ),
        (
            dict(cu_seqlens=torch.tensor([0, 2, 5])),
            ValueError,
            "policy_loss: cu_seqlens out of range",
        ),
        (
            dict(cu_seqlens=torch.tensor([0, 6]), sequence_ids=torch.zeros(2, 3, dtype=torch.long)),
            ValueError,
            "policy_loss: cu_seqlens given twice",
        ),
    ],
)
def test_errors(kwargs, error, message):
    logits, target, advantages = _small()
    with pytest.raises(error, match=message):
        xent.policy_loss(logits, target, advantages, **kwargs)


def test_more_errors():
    logits, target, advantages = _small()
    with pytest.raises(ValueError, match="policy_loss: advantages is not a tensor"):
        xent.policy_loss(logits, target, [1.0] * 6)
    with pytest.raises(TypeError, match="policy_loss: advantages dtype unsupported"):
        xent.policy_loss(logits, target, torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="policy_loss: advantages shape mismatch"):
        xent.policy_loss(logits, target, torch.ones(2))
    with pytest.raises(ValueError, match="policy_loss: logits rank unsupported"):
        xent.policy_loss(logits[0, 0], target[0, 0], advantages[0, 0])
    # 2-D logits say nothing about sequences: the sequence-level forms need them told.
    flat, flat_target, flat_adv = logits.flatten(0, 1), target.flatten(), advantages.flatten()
    for kwargs in (dict(loss_type="gspo"), dict(aggregation="seq_mean_token_mean")):
        with pytest.raises(ValueError, match="policy_loss: sequence_ids missing"):
            xent.policy_loss(flat, flat_target, flat_adv, **kwargs)
    with pytest.raises(ValueError, match="policy_loss: tis_cap missing"):
        xent.policy_loss(logits, target, advantages, rollout_logprobs=torch.zeros(2, 3))
    # The kernels' own checks, in the caller's names.
    with pytest.raises(ValueError, match="policy_loss: logits has unsupported dtype: got int64"):
        xent.policy_loss(logits.long(), target, advantages)
    with pytest.raises(ValueError, match="policy_loss: target has unsupported dtype"):
        xent.policy_loss(logits, advantages, advantages)
    with pytest.raises(ValueError, match="policy_loss: target out of range"):
        xent.policy_loss(logits, torch.full((2, 3), 11), advantages)
