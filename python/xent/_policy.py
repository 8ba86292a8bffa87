"""xent.policy_loss: the policy-gradient losses of RL fine-tuning on logits (docs/semantics.md §7).

A policy loss is a known function of the per-token logprob ℓ and entropy H and of per-token data
that is all present in the forward (advantages, old / reference / rollout logprobs). So the forward
runs the logprob kernels (the `none` cross-entropy forward asked for its statistics), forms the
per-token coefficients c_ℓ = ∂loss/∂ℓ and c_H = ∂loss/∂H with N-sized torch ops, and at once
forms ∂loss/∂logits with the logprob backward kernel; the backward only scales that gradient by
the upstream scalar, as cross_entropy's `mean` does. Nothing here is N × V but the logits and
their gradient.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

import xent.functional as _functional  # its helpers, read at call time (it imports this module)
from xent._autograd import _apply_upstream, _no_double_backward, _scale_saved
from xent._errors import python_names
from xent._logprobs import _statistics
from xent._ops import ops

POLICY_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo")
POLICY_AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "token_sum_norm",
)
KL_ESTIMATORS = ("k1", "k2", "k3")

# The aggregation a loss type takes when none is given (docs/semantics.md §7, "Loss types").
_DEFAULT_AGGREGATION = {
    "grpo": "token_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "dr_grpo": "token_sum_norm",
    "gspo": "seq_mean_token_mean",
    "cispo": "token_mean",
    "sapo": "token_mean",
}
# The loss types whose per-token term is PPO's clipped surrogate (of r, or GSPO's s).
_SURROGATE = ("grpo", "bnpo", "dapo", "dr_grpo", "gspo")


class PolicyLossResult(NamedTuple):
    """What policy_loss returns with return_stats=True; every field but loss is detached.

    Per-token fields are shaped like target (0 on ignored and masked tokens); the others are
    means over the valid tokens (0 when there is none).
    """

    loss: Tensor
    logprob: Tensor  # ℓ, the log-probability of the target at the temperature
    entropy: Tensor  # H of the policy at the temperature
    clip_fraction_low: Tensor  # share of tokens clipped at the lower bound
    clip_fraction_high: Tensor  # share clipped at an upper bound (dual clip included)
    kl: Tensor  # mean of the KL estimate to ref_logprobs (0 without them)
    ratio: Tensor  # mean importance ratio (r per token, or GSPO's s)


def _type_fail(function: str, argument: str, got: Any, expected: str) -> None:
    raise TypeError(f"{function}: {argument} dtype unsupported: got {got}; expected {expected}")


def _number(function: str, argument: str, value: Any, low: float, inclusive: bool) -> float:
    """value as a float, finite and above low (or at it when inclusive)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        _functional._fail(function, argument, "is not a number", repr(value), "a float")
    above = number >= low if inclusive else number > low
    if not (math.isfinite(number) and above):
        bound = f">= {low:g}" if inclusive else f"> {low:g}"
        _functional._fail(function, argument, "out of range", value, f"a finite value {bound}")
    return number


def _token_shaped(function: str, argument: str, value: Any, row_shape: tuple, item: str) -> None:
    """value is a tensor with one `item` per token, shaped like target."""
    _functional._check_tensor(function, argument, value)
    if tuple(value.shape) != row_shape:
        _functional._fail(
            function,
            argument,
            "shape mismatch",
            tuple(value.shape),
            f"{row_shape} (one {item} per token, shaped like target)",
        )


def _per_token(
    function: str, argument: str, value: Tensor | None, row_shape: tuple, logits: Tensor
) -> Tensor | None:
    """A per-token float input, flattened to (N,), detached (the loss treats it as data)."""
    if value is None:
        return None
    _token_shaped(function, argument, value, row_shape, "value")
    if not value.is_floating_point():
        _type_fail(function, argument, value.dtype, "a floating-point tensor")
    if value.device != logits.device:
        _functional._fail(
            function, argument, "is on another device", value.device, f"{logits.device}"
        )
    return value.detach().reshape(-1)


def _checks_values(tensor: Tensor) -> bool:
    # A check of the values is free on the CPU; on a GPU it would synchronise (ops never do), and
    # a traced graph cannot branch on them.
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def _sequence_index(
    function: str,
    sequence_ids: Tensor | None,
    cu_seqlens: Tensor | None,
    row_shape: tuple,
    logits: Tensor,
) -> Tensor | None:
    """Each token's sequence as an index in [0, N), or None when nothing tells the sequences."""
    rows = math.prod(row_shape)
    if sequence_ids is not None and cu_seqlens is not None:
        _functional._fail(
            function,
            "cu_seqlens",
            "given twice",
            "both sequence_ids and cu_seqlens",
            "one of them",
        )
    if sequence_ids is not None:
        _token_shaped(function, "sequence_ids", sequence_ids, row_shape, "id")
        if sequence_ids.is_floating_point() or sequence_ids.dtype == torch.bool:
            _type_fail(function, "sequence_ids", sequence_ids.dtype, "an integer tensor")
        ids = sequence_ids.reshape(-1).to(device=logits.device, dtype=torch.int64)
        if _checks_values(ids) and rows > 0 and (ids.min() < 0 or ids.max() >= rows):
            _functional._fail(
                function,
                "sequence_ids",
                "out of range",
                f"ids in [{ids.min().item()}, {ids.max().item()}]",
                f"ids in [0, {rows}) (at most one sequence per token)",
            )
        return ids
    if cu_seqlens is not None:
        _functional._check_tensor(function, "cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            _functional._fail(
                function,
                "cu_seqlens",
                "shape unsupported",
                tuple(cu_seqlens.shape),
                "(S + 1,): 0, then the end of each sequence",
            )
        if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            _type_fail(function, "cu_seqlens", cu_seqlens.dtype, "an integer tensor")
        bounds = cu_seqlens.to(device=logits.device, dtype=torch.int64)
        if _checks_values(bounds) and (
            bounds[0] != 0 or bounds[-1] != rows or (bounds[1:] < bounds[:-1]).any()
        ):
            _functional._fail(
                function,
                "cu_seqlens",
                "out of range",
                bounds.tolist() if bounds.numel() <= 8 else f"{bounds.numel()} bounds",
                f"non-decreasing bounds from 0 to {rows} (the number of tokens)",
            )
        positions = torch.arange(rows, device=logits.device)
        return torch.searchsorted(bounds[1:].contiguous(), positions, right=True)
    if len(row_shape) == 2:  # (B, T): each of the B rows is a sequence
        return torch.arange(rows, device=logits.device) // max(row_shape[1], 1)
    return None


def _normalizer(function: str, normalizer: Any, like: Tensor, dtype: torch.dtype) -> Tensor | None:
    """The divisor as a scalar tensor on like's device (never read on the host), or None."""
    if normalizer is None:
        return None
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            _functional._fail(
                function,
                "normalizer",
                "is not a scalar",
                tuple(normalizer.shape),
                "a number or a one-element tensor",
            )
        return normalizer.detach().to(device=like.device, dtype=dtype).reshape(())
    value = _number(function, "normalizer", normalizer, 0.0, False)
    return torch.full((), value, dtype=dtype, device=like.device)  # a fill, not a host copy


class _Options(NamedTuple):
    loss_type: str
    aggregation: str
    clip_low: float
    clip_high: float
    dual_clip: float | None
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    tis_cap: float | None
    sapo_tau_pos: float
    sapo_tau_neg: float


def _aggregation_weights(
    valid: Tensor,
    sequence: Tensor | None,
    divisor: Tensor | None,
    aggregation: str,
    dtype: torch.dtype,
) -> tuple:
    """(g, counts): each token's weight in the loss, Σ g·L_t, and each token's number of valid
    tokens in its sequence (None for the token-level modes)."""
    mask = valid.to(dtype)
    if aggregation == "token_sum_norm":
        return mask / divisor, None
    if aggregation == "token_mean":
        return mask / (divisor if divisor is not None else mask.sum().clamp(min=1)), None
    per_sequence = torch.zeros_like(mask).index_add_(0, sequence, mask)
    counts = per_sequence[sequence]
    if divisor is None:  # the sequences with at least one valid token
        divisor = (per_sequence > 0).sum().to(mask.dtype).clamp(min=1)
    if aggregation == "seq_mean_token_sum":
        return mask / divisor, counts
    return mask / (counts.clamp(min=1) * divisor), counts


def _policy_terms(
    logprob: Tensor,
    entropy: Tensor,
    valid: Tensor,
    advantages: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    rollout: Tensor | None,
    sequence: Tensor | None,
    divisor: Tensor | None,
    options: _Options,
    block_weights: Tensor | None = None,
) -> tuple:
    """(loss, c_ℓ, c_H, clip_low, clip_high, kl, ratio) of docs/semantics.md §7 from the per-token
    ℓ and H (all detached data here; N-sized ops in ℓ's dtype). block_weights: the tokens'
    aggregation weights g when the inputs are a block of rows of the batch (not for gspo); the
    four statistics are then sums over the block's valid tokens, not means."""
    dtype = logprob.dtype
    zero = torch.zeros_like(logprob)
    mask = valid.to(dtype)
    if block_weights is None:
        weights, counts = _aggregation_weights(valid, sequence, divisor, options.aggregation, dtype)
    else:
        weights, counts = block_weights, None
    advantage = torch.where(valid, advantages.to(dtype), zero)
    old_lp = logprob if old is None else old.to(dtype)
    # where, not a product: an ignored token's data may be anything (-inf padding included).
    log_ratio = torch.where(valid, logprob - old_lp, zero)

    if options.loss_type == "gspo":
        per_sequence = torch.zeros_like(log_ratio).index_add_(0, sequence, log_ratio)
        if counts is None:
            counts = torch.zeros_like(mask).index_add_(0, sequence, mask)[sequence]
        ratio = torch.where(valid, torch.exp(per_sequence[sequence] / counts.clamp(min=1)), zero)
    else:
        ratio = torch.where(valid, torch.exp(log_ratio), zero)

    if rollout is None:
        tis = mask
    else:
        mismatch = torch.where(valid, old_lp - rollout.to(dtype), zero)
        tis = torch.where(valid, torch.exp(mismatch).clamp(max=options.tis_cap), zero)

    low_bound, high_bound = 1.0 - options.clip_low, 1.0 + options.clip_high
    clipped_low = clipped_high = torch.zeros_like(valid)
    if options.loss_type in _SURROGATE:
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(low_bound, high_bound) * advantage)
        value = -surrogate
        # The unclipped branch is the minimum (its gradient flows) below the upper bound for
        # A ≥ 0 and above the lower one for A < 0.
        flows = torch.where(advantage >= 0, ratio <= high_bound, ratio >= low_bound)
        clipped_low = valid & (advantage < 0) & (ratio < low_bound)
        clipped_high = valid & (advantage > 0) & (ratio > high_bound)
        if options.dual_clip is not None:
            dual = valid & (advantage < 0) & (ratio > options.dual_clip)
            value = torch.where(dual, -options.dual_clip * advantage, value)
            flows = flows & ~dual
            clipped_high = clipped_high | dual
        d_ratio = torch.where(flows, -advantage, zero)  # ∂(policy term)/∂ρ
    elif options.loss_type == "sapo":
        tau = torch.where(
            advantage > 0,
            torch.full_like(ratio, options.sapo_tau_pos),
            torch.full_like(ratio, options.sapo_tau_neg),
        )
        gate = torch.sigmoid(tau * (ratio - 1.0))
        value = -advantage * gate * 4.0 / tau
        d_ratio = -advantage * 4.0 * gate * (1.0 - gate)
    else:  # cispo: the clipped ratio is a stopped weight on ℓ
        weight = ratio.clamp(low_bound, high_bound)
        value = -weight * advantage * logprob
        d_logprob = -weight * advantage
        clipped_low = valid & (ratio < low_bound)
        clipped_high = valid & (ratio > high_bound)

    scaled = weights * tis  # the policy term's weight in the loss
    if options.loss_type == "gspo":
        # ρ = s of the token's sequence: ∂s/∂ℓ_t = s / count, the same for each of its tokens.
        per_sequence = torch.zeros_like(scaled).index_add_(0, sequence, scaled * d_ratio)
        grad_logprob = torch.where(
            valid, ratio / counts.clamp(min=1) * per_sequence[sequence], zero
        )
    elif options.loss_type == "cispo":
        grad_logprob = scaled * d_logprob
    else:
        grad_logprob = scaled * d_ratio * ratio
    total = scaled * value

    if ref is not None:
        delta = torch.where(valid, ref.to(dtype) - logprob, zero)  # log(π_ref / π)
        if options.kl_estimator == "k1":
            kl, d_kl = -delta, mask
        elif options.kl_estimator == "k2":
            kl, d_kl = 0.5 * delta * delta, -delta
        else:
            exp_delta = torch.where(valid, torch.exp(delta), zero)
            kl, d_kl = exp_delta - delta - mask, mask - exp_delta
        if options.kl_coef != 0.0:
            total = total + weights * options.kl_coef * kl
            grad_logprob = grad_logprob + weights * options.kl_coef * d_kl
    else:
        kl = zero
    grad_entropy = None
    if options.entropy_coef != 0.0:
        total = total - weights * options.entropy_coef * entropy
        grad_entropy = -options.entropy_coef * weights

    count = mask.sum().clamp(min=1) if block_weights is None else 1.0

    def mean(values: Tensor) -> Tensor:
        return torch.where(valid, values.to(dtype), zero).sum() / count

    stats = (mean(clipped_low), mean(clipped_high), mean(kl), mean(ratio))
    return (total.sum(), grad_logprob, grad_entropy) + stats


def _forward(logits: Tensor, target: Tensor, ignore_index: int, softcap, scale, with_entropy):
    outputs = ops.ce_forward(
        logits, target, None, None, ignore_index, "none", 0.0, 0.0, softcap, scale, with_entropy
    )
    return _statistics(outputs, target, ignore_index, with_entropy)


class PolicyLossFunction(torch.autograd.Function):
    # logits [N, V], target [N] (masked tokens already set to ignore_index), the per-token data
    # [N] (None when absent), divisor: a scalar tensor or None. transform: (ignore_index, softcap,
    # logit_scale). The gradient is formed here, for an upstream gradient of 1.
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        advantages: Tensor,
        old: Tensor | None,
        ref: Tensor | None,
        rollout: Tensor | None,
        sequence: Tensor | None,
        divisor: Tensor | None,
        transform: tuple,
        options: _Options,
        with_entropy: bool,
    ):
        ignore_index, softcap, scale = transform
        lse, logprob, entropy = _forward(logits, target, ignore_index, softcap, scale, with_entropy)
        valid = target != ignore_index
        loss, grad_logprob, grad_entropy, *stats = _policy_terms(
            logprob, entropy, valid, advantages, old, ref, rollout, sequence, divisor, options
        )
        grad = ops.ce_logprob_backward(
            logits, target, lse, entropy, grad_logprob, grad_entropy, *transform
        )
        ctx.save_for_backward(grad)
        ctx.scaled = False
        outputs = (logprob, entropy, *stats)
        ctx.mark_non_differentiable(*outputs)
        return (loss, *outputs)

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *unused: Any):
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            (grad,) = _apply_upstream(_scale_saved(ctx, "xent.policy_loss"), grad_loss)
            (grad,) = _no_double_backward("xent.policy_loss", (grad,))
        return (grad,) + (None,) * 10


def _options(
    function: str,
    loss_type: str,
    aggregation: str | None,
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
    kl_coef: float,
    kl_estimator: str,
    entropy_coef: float,
    tis_cap: float | None,
    sapo_tau_pos: float,
    sapo_tau_neg: float,
) -> _Options:
    if loss_type not in POLICY_LOSS_TYPES:
        _functional._fail(
            function,
            "loss_type",
            "unknown",
            repr(loss_type),
            "one of " + ", ".join(POLICY_LOSS_TYPES),
        )
    if aggregation is None:
        aggregation = _DEFAULT_AGGREGATION[loss_type]
    if aggregation not in POLICY_AGGREGATIONS:
        _functional._fail(
            function,
            "aggregation",
            "unknown",
            repr(aggregation),
            "one of " + ", ".join(POLICY_AGGREGATIONS),
        )
    if kl_estimator not in KL_ESTIMATORS:
        _functional._fail(
            function, "kl_estimator", "unknown", repr(kl_estimator), "one of k1, k2, k3"
        )
    low = _number(function, "clip_low", clip_low, 0.0, False)
    high = low if clip_high is None else _number(function, "clip_high", clip_high, 0.0, False)
    if dual_clip is not None:
        if loss_type not in _SURROGATE:
            _functional._fail(
                function,
                "dual_clip",
                "unsupported",
                f"loss_type {loss_type!r}",
                "a clipped-surrogate loss type (" + ", ".join(_SURROGATE) + ")",
            )
        dual_clip = _number(function, "dual_clip", dual_clip, 1.0, False)
    return _Options(
        loss_type,
        aggregation,
        low,
        high,
        dual_clip,
        _number(function, "kl_coef", kl_coef, 0.0, True),
        kl_estimator,
        _number(function, "entropy_coef", entropy_coef, -math.inf, False),
        None if tis_cap is None else _number(function, "tis_cap", tis_cap, 0.0, False),
        _number(function, "sapo_tau_pos", sapo_tau_pos, 0.0, False),
        _number(function, "sapo_tau_neg", sapo_tau_neg, 0.0, False),
    )


def _prepare(
    function: str,
    like: Tensor,
    target1d: Tensor,
    row_shape: tuple,
    advantages: Tensor,
    logprobs: tuple,
    surrogate: tuple,
    terms: tuple,
    rest: tuple,
) -> tuple:
    """The checked arguments of policy_loss and linear_policy_loss (like: the logits or the
    hidden states, whose dtype sets the result's): (options, transform, data, target1d with the
    masked tokens ignored, sequence index or None, divisor or None)."""
    old_logprobs, ref_logprobs, rollout_logprobs = logprobs
    temperature, softcap, ignore_index, loss_mask, sequence_ids, cu_seqlens, normalizer = rest
    options = _options(function, *surrogate, *terms)
    transform = (
        int(ignore_index),
        None if softcap is None else float(softcap),
        _functional._temperature_scale(function, temperature),
    )
    _functional._check_tensor(function, "advantages", advantages)
    data = [
        _per_token(function, name, value, row_shape, like)
        for name, value in (
            ("advantages", advantages),
            ("old_logprobs", old_logprobs),
            ("ref_logprobs", ref_logprobs),
            ("rollout_logprobs", rollout_logprobs),
        )
    ]
    if options.kl_coef != 0.0 and ref_logprobs is None:
        _functional._fail(
            function, "ref_logprobs", "missing", None, "ref_logprobs for kl_coef != 0"
        )
    if (rollout_logprobs is None) != (options.tis_cap is None):
        _functional._fail(
            function,
            "tis_cap" if rollout_logprobs is not None else "rollout_logprobs",
            "missing",
            None,
            "rollout_logprobs and tis_cap together (the truncated importance weight needs both)",
        )
    if loss_mask is not None:
        _token_shaped(function, "loss_mask", loss_mask, row_shape, "flag")
        # A masked token is an ignored one: no statistics, no loss, no gradient (§1's rule).
        keep = loss_mask.reshape(-1).to(target1d.device) != 0
        target1d = torch.where(keep, target1d, torch.full_like(target1d, int(ignore_index)))
    sequence = _sequence_index(function, sequence_ids, cu_seqlens, row_shape, like)
    if sequence is None and (options.loss_type == "gspo" or options.aggregation.startswith("seq")):
        name = "logits" if function == "policy_loss" else "hidden"
        shape = "(B, T, V)" if function == "policy_loss" else "(B, T, H)"
        _functional._fail(
            function,
            "sequence_ids",
            "missing",
            f"neither sequence_ids nor cu_seqlens, and 2-D {name}",
            f"sequence_ids or cu_seqlens for loss_type {options.loss_type!r} with aggregation "
            f"{options.aggregation!r} (or 3-D {shape} {name}, whose rows are the sequences)",
        )
    result_dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    divisor = _normalizer(function, normalizer, like, result_dtype)
    if divisor is None and options.aggregation == "token_sum_norm":
        _functional._fail(
            function,
            "normalizer",
            "missing",
            None,
            "the constant the token sum is divided by (Dr. GRPO: sequences × the longest "
            "allowed response) for aggregation 'token_sum_norm'",
        )
    return options, transform, data, target1d, sequence, divisor


@python_names
def policy_loss(
    logits: Tensor,
    target: Tensor,
    advantages: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    loss_type: str = "grpo",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    tis_cap: float | None = None,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    loss_mask: Tensor | None = None,
    aggregation: str | None = None,
    sequence_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    return_stats: bool = False,
    batch_invariant: bool = False,
    process_group: Any = None,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
) -> Tensor | PolicyLossResult:
    """The policy-gradient loss of RL fine-tuning (PPO, GRPO and variants) on logits (N, V) or
    (B, T, V), reduced to a scalar; every formula is in docs/semantics.md §7.

    ℓ = log_softmax(softcap(logits / temperature))[target] and H its entropy, per token. Data,
    each shaped like target and treated as constants: advantages (per token: broadcast a
    per-sequence advantage yourself, e.g. ``adv[:, None].expand(B, T)``), old_logprobs (the
    sampling policy's ℓ; None: on-policy, ℓ detached, ratio 1 with its gradient), ref_logprobs
    (for the KL term kl_coef · k(ℓ, ℓ_ref), estimator k1, k2 or k3), rollout_logprobs (the
    inference engine's ℓ: truncated importance weight min(exp(ℓ_old − ℓ_rollout), tis_cap) on the
    policy term, needs tis_cap). loss_mask (bool, or nonzero = counted) removes tokens as
    ignore_index does.

    loss_type: grpo, bnpo, dapo, dr_grpo (PPO's clipped surrogate on r = exp(ℓ − ℓ_old), bounds
    1 − clip_low and 1 + clip_high (clip_high None: clip_low), dual_clip c > 1 bounds the loss of
    negative advantages at −c·A), gspo (the surrogate on the sequence ratio exp(mean(ℓ − ℓ_old))),
    cispo (−sg(clip(r))·A·ℓ), sapo (soft gate (4/τ)·σ(τ(r − 1)), τ = sapo_tau_pos for A > 0,
    sapo_tau_neg otherwise). entropy_coef α adds −α·H. aggregation: token_mean,
    seq_mean_token_mean, seq_mean_token_sum, token_sum_norm (Σ / normalizer); None takes the loss
    type's (dr_grpo: token_sum_norm, gspo: seq_mean_token_mean, the others token_mean).
    normalizer replaces the divisor (the token count, or the sequence count) by a given number,
    e.g. the global count when gradients are accumulated over micro-batches. Sequences (for the
    seq_* modes and gspo) come from sequence_ids (ids in [0, N), shaped like target) or
    cu_seqlens (S + 1 bounds), else from the rows of 3-D logits.

    The gradient of the logits is formed in the forward (one logits read and one gradient write
    beyond the statistics pass) and the backward only scales it by the upstream scalar, so a
    graph supports one backward. float32 results (float64 for float64 logits). With return_stats
    returns a PolicyLossResult: the loss and, detached, per-token logprob and entropy, the clip
    fractions, mean KL and mean ratio. batch_invariant: as in logprobs (per-token values on
    logits are already batch invariant; accepted for the fused form's sake).

    With process_group, logits are this rank's vocabulary slice (vocab_offset / vocab_size: its
    first id and the global V, else gathered): the result, identical on every rank, is that of
    the concatenated vocabulary (xent.distributed, docs/semantics.md §5).
    """
    function = "policy_loss"
    _functional._check_flag(function, "batch_invariant", batch_invariant)
    logits2d, target1d, row_shape = _functional._rows(function, "logits", logits, target)
    options, transform, data, target1d, sequence, divisor = _prepare(
        function,
        logits,
        target1d,
        row_shape,
        advantages,
        (old_logprobs, ref_logprobs, rollout_logprobs),
        (loss_type, aggregation, clip_low, clip_high, dual_clip, kl_coef, kl_estimator),
        (entropy_coef, tis_cap, sapo_tau_pos, sapo_tau_neg),
        (temperature, softcap, ignore_index, loss_mask, sequence_ids, cu_seqlens, normalizer),
    )
    with_entropy = bool(return_stats) or options.entropy_coef != 0.0
    if process_group is not None:  # vocabulary-parallel (docs/semantics.md §5)
        from xent import _sharded_policy  # it builds on this module

        loss, logprob, entropy, *stats = _sharded_policy.policy_loss(
            logits2d,
            target1d,
            tuple(data),
            (sequence, divisor, transform, options),
            _functional._needs_grad(logits)[0],
            (process_group, vocab_offset, vocab_size),
        )
    elif _functional._needs_grad(logits)[0]:
        loss, logprob, entropy, *stats = PolicyLossFunction.apply(
            logits2d, target1d, *data, sequence, divisor, transform, options, with_entropy
        )
    else:
        _, logprob, entropy = _forward(logits2d, target1d, *transform, with_entropy)
        loss, _, _, *stats = _policy_terms(
            logprob, entropy, target1d != transform[0], *data, sequence, divisor, options
        )
    if not return_stats:
        return _functional._validated(loss, logits)
    reshape = _functional._reshape_rows
    result = PolicyLossResult(
        loss, reshape(logprob, row_shape), reshape(entropy, row_shape), *stats
    )
    return _functional._validated(result, logits)
