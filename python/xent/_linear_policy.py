"""xent.linear_policy_loss: the policy losses of docs/semantics.md §7 fused with the LM head.

For every loss type but gspo, one op forms it in three products, on CPU and CUDA tensors: per row
chunk the logits, their statistics, the per-token policy math and the gradient in place, then ∂h
and ∂W (docs/semantics.md §7 "Fused with the LM head"); the aggregation weights g_n come first,
from N-sized torch ops. gspo, whose ratio couples a sequence's tokens, runs the composition below:
the statistics from linear_ce's `none` forward (chunked within the workspace budget), the
per-token coefficients c_ℓ and c_H from the same N-sized torch ops as policy_loss (_policy_terms),
and ∂h, ∂W and ∂bias at once from the fused logprob backward fed with those coefficients, all in
the forward; the backward only scales them by the upstream scalar. No N × V tensor is ever held:
the statistics pass keeps the logits of the first rows that DEFAULT_LOGPROBS_CACHE_BYTES (1 GiB)
holds for the gradient pass, which recomputes the others'. Four products for the rows outside
that cache (the logits formed twice), three for those in it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import xent.functional as _functional  # its helpers, read at call time (it imports this module)
from xent._autograd import _apply_upstream, _compute_copies, _no_double_backward, _scale_saved
from xent._errors import python_names
from xent._logprobs import (
    DEFAULT_LOGPROBS_CACHE_BYTES,
    _statistics,
    linear_none_forward,
    logits_cache_rows,
    weight_grad_dtype,
)
from xent._ops import ops
from xent._policy import (
    PolicyLossResult,
    _aggregation_weights,
    _Options,
    _policy_terms,
    _prepare,
)


def _forward(
    operands: tuple,
    target: Tensor,
    linear: tuple,
    with_entropy: bool,
    batch_invariant: bool,
    cache_rows: int = 0,
) -> tuple:
    """(lse, logprob, entropy) of the head's logits, and the cache of the logits of rows
    [0, cache_rows) (None without)."""
    outputs = linear_none_forward(
        operands, target, linear, with_entropy, cache_rows, batch_invariant=batch_invariant
    )
    cache = outputs[10] if cache_rows > 0 else None
    return (*_statistics(outputs, target, linear[0], with_entropy), cache)


def _fused_applies(options: _Options) -> bool:
    """Whether the three-product op runs: every loss type but gspo."""
    return options.loss_type != "gspo"


def _fused(
    operands: tuple,
    target: Tensor,
    data: tuple,
    sequence: Tensor | None,
    divisor: Tensor | None,
    linear: tuple,
    options: _Options,
    wants: tuple,
    weight_grad: torch.dtype | None,
    batch_invariant: bool,
) -> tuple:
    """(loss, logprob, entropy, stats, grads) of the three-product op; grads are empty [0]
    tensors where not wanted."""
    valid = target != linear[0]
    dtype = torch.float64 if operands[0].dtype == torch.float64 else torch.float32
    weights, _ = _aggregation_weights(valid, sequence, divisor, options.aggregation, dtype)
    loss, logprob, entropy, sums, *grads = ops.linear_policy_forward(
        *operands,
        target,
        *data,
        weights,
        options.loss_type,
        options.clip_low,
        options.clip_high,
        options.dual_clip,
        options.kl_coef,
        options.kl_estimator,
        options.entropy_coef,
        options.tis_cap,
        options.sapo_tau_pos,
        options.sapo_tau_neg,
        *linear,
        *wants,
        weight_grad,
        batch_invariant=batch_invariant,
    )
    # The op returns sums over the valid tokens; the statistics are their means.
    stats = tuple((sums / valid.sum().clamp(min=1).to(dtype)).unbind())
    return loss, logprob, entropy, stats, tuple(grads)


class LinearPolicyLossFunction(torch.autograd.Function):
    # hidden [N, H], weight [V, H], bias [V] or None, target [N] (masked tokens already ignored),
    # data: (advantages, old, ref, rollout) [N] or None, sequence [N] or None, divisor: a scalar
    # tensor or None. linear: (ignore_index, softcap, logit_scale, workspace_bytes, fp32_logits);
    # wants: the (hidden, weight, bias) gradients needed; compute_dtype as in
    # LinearCrossEntropyFunction. The gradients are formed here, for an upstream gradient of 1.
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        data: tuple,
        sequence: Tensor | None,
        divisor: Tensor | None,
        linear: tuple,
        wants: tuple,
        compute_dtype: torch.dtype | None,
        options: _Options,
        with_entropy: bool,
        batch_invariant: bool,
    ):
        operands = _compute_copies(compute_dtype, hidden, weight, bias)
        weight_grad = weight_grad_dtype(compute_dtype, weight)
        if _fused_applies(options):
            loss, logprob, entropy, stats, grads = _fused(
                operands,
                target,
                data,
                sequence,
                divisor,
                linear,
                options,
                wants,
                weight_grad,
                batch_invariant,
            )
        else:
            hidden_rows, weight_rows = operands[0].shape[0], operands[1].shape[0]
            rows = logits_cache_rows(
                hidden_rows,
                weight_rows,
                operands[0].dtype,
                linear[4],
                False,
                DEFAULT_LOGPROBS_CACHE_BYTES,
            )
            lse, logprob, entropy, cache = _forward(
                operands, target, linear, with_entropy, batch_invariant, rows
            )
            valid = target != linear[0]
            loss, grad_logprob, grad_entropy, *stats = _policy_terms(
                logprob, entropy, valid, *data, sequence, divisor, options
            )
            grads = ops.linear_logprob_backward(
                *operands,
                target,
                lse,
                entropy,
                grad_logprob,
                grad_entropy,
                *linear,
                *wants,
                cache,
                weight_grad,
            )
            del cache
        ctx.save_for_backward(*(g if w else None for g, w in zip(grads, wants)))
        ctx.scaled = False
        outputs = (logprob, entropy, *stats)
        ctx.mark_non_differentiable(*outputs)
        return (loss, *outputs)

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *unused: Any):
        grads = (None, None, None)
        if any(ctx.needs_input_grad[:3]) and grad_loss is not None:
            grads = _apply_upstream(_scale_saved(ctx, "xent.linear_policy_loss"), grad_loss)
            grads = _no_double_backward("xent.linear_policy_loss", tuple(grads))
        return tuple(grads) + (None,) * 10


@python_names
def linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    advantages: Tensor,
    *,
    bias: Tensor | None = None,
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
    workspace_bytes: int | None = None,
    fp32_logits: bool = False,
    batch_invariant: bool = False,
    process_group: Any = None,
    reduce_hidden_grad: bool = True,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
) -> Tensor | PolicyLossResult:
    """policy_loss(hidden @ weight.T + bias, target, advantages, ...) without ever holding the
    (N, V) logits: the RL policy losses (PPO, GRPO and variants) on a large-vocabulary LM head.

    hidden (N, H) or (B, T, H) (3-D: each row a sequence, as policy_loss's 3-D logits); weight
    (V, H); bias (V,) or None. Every other keyword, the result and docs/semantics.md §7's formulas
    are policy_loss's. Chunked within workspace_bytes like linear_cross_entropy (same default;
    chunk logits rounded to the input dtype unless fp32_logits; mixed precision as there).
    batch_invariant=True makes each row's logprob and entropy (and so its per-token terms) bit-
    identical whatever the other rows of the call and the budget, as in linear_logprobs; the
    loss and statistics, sums over the rows, are not.
    The gradients of hidden, weight and bias are formed in the forward and the backward only
    scales them by the upstream scalar, so a graph supports one backward. For every loss type but
    gspo the forward forms the logits once: three products, as linear_cross_entropy's training
    step (four where the budget cannot hold ∂W's fp32 accumulator of a 16-bit weight, as there).
    gspo forms them twice (statistics, then the gradient from the per-token coefficients), but
    for the first rows whose logits DEFAULT_LOGPROBS_CACHE_BYTES (1 GiB, held only inside the
    forward) keeps between the two passes.

    With process_group, weight/bias are this rank's vocabulary rows of the LM head (vocab_offset /
    vocab_size as in policy_loss); ∂hidden is all-reduced over the group unless
    reduce_hidden_grad=False (xent.distributed, docs/semantics.md §5).
    """
    function = "linear_policy_loss"
    _functional._check_flag(function, "batch_invariant", batch_invariant)
    _functional._check_tensor(function, "weight", weight)
    hidden2d, target1d, row_shape = _functional._rows(function, "hidden", hidden, target)
    options, transform, data, target1d, sequence, divisor = _prepare(
        function,
        hidden,
        target1d,
        row_shape,
        advantages,
        (old_logprobs, ref_logprobs, rollout_logprobs),
        (loss_type, aggregation, clip_low, clip_high, dual_clip, kl_coef, kl_estimator),
        (entropy_coef, tis_cap, sapo_tau_pos, sapo_tau_neg),
        (temperature, softcap, ignore_index, loss_mask, sequence_ids, cu_seqlens, normalizer),
    )
    budget = _functional._workspace_budget(function, workspace_bytes, hidden2d)
    linear = (*transform, budget, bool(fp32_logits))
    compute_dtype = _functional._compute_dtype(hidden2d, weight)
    wants = _functional._needs_grad(hidden2d, weight, bias)
    with_entropy = bool(return_stats) or options.entropy_coef != 0.0
    if process_group is not None:  # vocabulary-parallel (docs/semantics.md §5)
        if batch_invariant:
            # The sharded chunks' products are torch's, not the pinned ones.
            _functional._fail(
                function,
                "batch_invariant",
                "unsupported with process_group",
                True,
                "False with process_group (the vocabulary-parallel form does not pin its products)",
            )
        from xent import _sharded_policy  # it builds on this module's imports

        loss, logprob, entropy, *stats = _sharded_policy.linear_policy_loss(
            (hidden2d, weight, bias),
            target1d,
            tuple(data),
            (sequence, divisor, transform, options),
            wants,
            (process_group, vocab_offset, vocab_size),
            (workspace_bytes, fp32_logits, reduce_hidden_grad),
        )
    elif any(wants):
        loss, logprob, entropy, *stats = LinearPolicyLossFunction.apply(
            hidden2d,
            weight,
            bias,
            target1d,
            tuple(data),
            sequence,
            divisor,
            linear,
            wants,
            compute_dtype,
            options,
            with_entropy,
            batch_invariant,
        )
    elif _fused_applies(options):
        operands = _compute_copies(compute_dtype, hidden2d, weight, bias)
        loss, logprob, entropy, stats, _ = _fused(
            operands,
            target1d,
            tuple(data),
            sequence,
            divisor,
            linear,
            options,
            wants,
            None,
            batch_invariant,
        )
    else:
        operands = _compute_copies(compute_dtype, hidden2d, weight, bias)
        _, logprob, entropy, _ = _forward(operands, target1d, linear, with_entropy, batch_invariant)
        loss, _, _, *stats = _policy_terms(
            logprob, entropy, target1d != transform[0], *data, sequence, divisor, options
        )
    if not return_stats:
        return _functional._validated(loss, hidden)
    reshape = _functional._reshape_rows
    result = PolicyLossResult(
        loss, reshape(logprob, row_shape), reshape(entropy, row_shape), *stats
    )
    return _functional._validated(result, hidden)
