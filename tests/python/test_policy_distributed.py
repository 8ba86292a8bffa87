"""Vocabulary-parallel policy_loss and linear_policy_loss over torch.distributed (docs/semantics.md
§5, §7) on the CPU with gloo.

2 and 3 processes hold uneven vocabulary slices (V = 1031, one slice 7 wide); every loss type
(gspo included), each aggregation, the KL / entropy / TIS / dual-clip / temperature / softcap
options, ignore_index and loss_mask are run sharded and compared with the single-process op on
the whole vocabulary: loss, statistics and the gradient of the local logits slice (policy_loss)
or ∂hidden and the local rows of ∂weight, ∂bias (linear_policy_loss, in one and in several row
chunks). float64 cases compare with the float64 single-process op, itself checked against a
float64 reference in test_policy_loss.py. One spawn per world size.
"""

import pytest
import torch
import torch.distributed as dist
from gloo_group import close as _close
from gloo_group import needs_gloo, run_group, sharded_head, slice_of

ROWS, VOCAB, HIDDEN = 37, 1031, 29
SPLITS = {2: [500, 531], 3: [400, 7, 624]}
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
ALL_OPTIONS = {
    "kl_coef": 0.05,
    "kl_estimator": "k3",
    "entropy_coef": 0.01,
    "tis_cap": 2.0,
    "temperature": 0.8,
    "softcap": 5.0,
    "clip_high": 0.28,
}
FIELDS = ("loss", "logprob", "entropy", "clip_fraction_low", "clip_fraction_high", "kl", "ratio")


def _slice_of(rank, world):
    return slice_of(SPLITS[world], rank)


def _close_grad(what, got, expected, rtol):
    """Gradients: 16-bit ones are rounded once unsharded, and sharded twice more where the
    entropy part is added (error model: a few half-ulps of the largest term of the row)."""
    if got.dtype == torch.bfloat16:
        scale = expected.float().abs().amax().item()
        _close(what, got.float(), expected.float(), rtol=0.0, atol=2**-6 * scale)
    else:
        _close(what, got, expected, rtol=rtol, atol=1e-6)


def _compare(tag, got, expected, rtol=2e-5, atol=2e-6):
    for name in FIELDS:
        _close(f"{tag} {name}", getattr(got, name), getattr(expected, name), rtol, atol)


def _cases(device="cpu"):
    """(loss_type, aggregation or None, options, dtype) of the test (float64 on the CPU only, as
    the CUDA ops take it)."""
    for loss_type in LOSS_TYPES:
        yield loss_type, None, {}, torch.float32
    for aggregation in AGGREGATIONS:
        yield "grpo", aggregation, {"entropy_coef": 0.02}, torch.float32
    yield "grpo", None, {**ALL_OPTIONS, "dual_clip": 3.0}, torch.float32
    yield "gspo", None, ALL_OPTIONS, torch.float32
    yield "sapo", None, {"entropy_coef": -0.01, "kl_coef": 0.1, "kl_estimator": "k2"}, torch.float32
    if device == "cpu":
        yield "cispo", "seq_mean_token_sum", ALL_OPTIONS, torch.float64
        yield "gspo", None, ALL_OPTIONS, torch.float64
    yield "grpo", "seq_mean_token_mean", ALL_OPTIONS, torch.bfloat16


def _data(gen, dtype, options, device):
    """target (with ignored tokens), and advantages and the other per-token data on device."""
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    target[::6] = -100
    target[1], target[2] = 0, VOCAB - 1
    sequence_ids = torch.sort(torch.randint(0, 6, (ROWS,), generator=gen)).values
    loss_mask = torch.rand(ROWS, generator=gen) > 0.15
    kwargs = {
        "old_logprobs": -7.0 + 0.3 * torch.randn(ROWS, generator=gen, dtype=dtype),
        "sequence_ids": sequence_ids,
        "loss_mask": loss_mask,
    }
    if "kl_coef" in options:
        kwargs["ref_logprobs"] = -7.0 + 0.3 * torch.randn(ROWS, generator=gen, dtype=dtype)
    if "tis_cap" in options:
        kwargs["rollout_logprobs"] = -7.0 + 0.3 * torch.randn(ROWS, generator=gen, dtype=dtype)
    advantages = torch.randn(ROWS, generator=gen, dtype=dtype)
    kwargs = {name: value.to(device) for name, value in kwargs.items()}
    return target.to(device), advantages.to(device), kwargs


def _policy_cases(rank, world, group, seed, device):
    import xent

    begin, end = _slice_of(rank, world)
    for case, (loss_type, aggregation, options, dtype) in enumerate(_cases(device)):
        gen = torch.Generator().manual_seed(seed + 100 + case)
        logits = (torch.randn(ROWS, VOCAB, generator=gen, dtype=dtype) * 2).to(device)
        target, advantages, data = _data(gen, dtype, options, device)
        # old ℓ near ℓ: ratios around 1, some clipped on both sides.
        data["old_logprobs"] = torch.log_softmax(logits.double(), -1).gather(
            1, target.clamp(min=0)[:, None]
        )[:, 0].to(dtype) + 0.3 * torch.randn(ROWS, generator=gen, dtype=dtype).to(device)
        kwargs = {"loss_type": loss_type, "aggregation": aggregation, **options, **data}
        if loss_type == "dr_grpo" or aggregation == "token_sum_norm":
            kwargs["normalizer"] = 11.0
        tag = f"policy_loss {loss_type} {aggregation} {sorted(options)} {dtype}"

        full = logits.clone().requires_grad_()
        expected = xent.policy_loss(full, target, advantages, return_stats=True, **kwargs)
        expected.loss.backward()
        local = logits[:, begin:end].clone().requires_grad_()
        layout = {"vocab_offset": begin, "vocab_size": VOCAB} if case % 2 else {}
        got = xent.policy_loss(
            local, target, advantages, return_stats=True, process_group=group, **kwargs, **layout
        )
        (got.loss * 1.5).backward()
        _compare(tag, got, expected)
        _close_grad(f"{tag} grad", local.grad, full.grad[:, begin:end] * 1.5, 2e-5)

        with torch.no_grad():
            plain = xent.policy_loss(
                local.detach(), target, advantages, process_group=group, **kwargs
            )
        _close(f"{tag} no-grad loss", plain, expected.loss)


def _linear_cases(rank, world, group, seed, device):
    import xent

    begin, end = _slice_of(rank, world)
    for case, (loss_type, aggregation, options, dtype) in enumerate(_cases(device)):
        gen = torch.Generator().manual_seed(seed + 500 + case)
        hidden = torch.randn(ROWS, HIDDEN, generator=gen, dtype=dtype)
        weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=dtype) / HIDDEN**0.5 * 2
        bias = torch.randn(VOCAB, generator=gen, dtype=dtype) * 0.1
        hidden, weight, bias = hidden.to(device), weight.to(device), bias.to(device)
        target, advantages, data = _data(gen, dtype, options, device)
        kwargs = {"loss_type": loss_type, "aggregation": aggregation, **options, **data}
        if loss_type == "dr_grpo" or aggregation == "token_sum_norm":
            kwargs["normalizer"] = 11.0
        # Several row chunks (11 rows of the widest slice) in every other case.
        budget = 11 * 2 * 624 * hidden.element_size() if case % 2 else None
        tag = f"linear_policy_loss {loss_type} {aggregation} {sorted(options)} {dtype} {budget}"

        h_full = hidden.clone().requires_grad_()
        w_full = weight.clone().requires_grad_()
        b_full = bias.clone().requires_grad_()
        expected = xent.linear_policy_loss(
            h_full, w_full, target, advantages, bias=b_full, return_stats=True, **kwargs
        )
        expected.loss.backward()
        h = hidden.clone().requires_grad_()
        w = weight[begin:end].clone().requires_grad_()
        b = bias[begin:end].clone().requires_grad_()
        got = xent.linear_policy_loss(
            h,
            w,
            target,
            advantages,
            bias=b,
            return_stats=True,
            process_group=group,
            workspace_bytes=budget,
            **kwargs,
        )
        got.loss.backward()
        if dtype == torch.bfloat16 and device != "cpu":
            # Both round the chunk logits to bf16, but after products summed in other orders: a
            # logit may round one ulp apart (2^-6 at |x| < 4), and a clip decision flip with it.
            for name in ("loss", "logprob", "entropy"):
                _close(f"{tag} {name}", getattr(got, name), getattr(expected, name), 0, 2**-5)
        else:
            _compare(tag, got, expected)
        _close_grad(f"{tag} grad hidden", h.grad, h_full.grad, 1e-4)
        _close_grad(f"{tag} grad weight", w.grad, w_full.grad[begin:end], 1e-4)
        _close_grad(f"{tag} grad bias", b.grad, b_full.grad[begin:end], 1e-4)

    # reduce_hidden_grad=False: each rank's ∂hidden is partial; their sum is the full one.
    gen = torch.Generator().manual_seed(seed + 999)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5).to(device)
    hidden = hidden.to(device)
    target, advantages, data = _data(gen, torch.float32, {}, device)
    h_full = hidden.clone().requires_grad_()
    data["old_logprobs"] = None  # on-policy
    xent.linear_policy_loss(h_full, weight, target, advantages, **data).backward()
    h = hidden.clone().requires_grad_()
    xent.linear_policy_loss(
        h,
        weight[begin:end],
        target,
        advantages,
        process_group=group,
        reduce_hidden_grad=False,
        **data,
    ).backward()
    partial = h.grad.clone()
    dist.all_reduce(partial, group=group)
    _close("partial grad hidden, summed", partial, h_full.grad, rtol=1e-4, atol=1e-6)


def _error_cases(rank, world, group):
    import xent

    begin, end = _slice_of(rank, world)
    logits = torch.randn(ROWS, end - begin)
    target = torch.zeros(ROWS, dtype=torch.int64)
    advantages = torch.randn(ROWS)
    with pytest.raises(ValueError, match="vocab_offset"):
        xent.policy_loss(
            logits, target, advantages, process_group=group, vocab_offset=VOCAB, vocab_size=VOCAB
        )
    with pytest.raises(ValueError, match="weight"):
        xent.linear_policy_loss(
            torch.randn(ROWS, HIDDEN), torch.randn(4, 3), target, advantages, process_group=group
        )
    weight = sharded_head(world, VOCAB, HIDDEN)
    if weight is None:
        return
    with pytest.raises(TypeError, match="DTensor"):
        xent.linear_policy_loss(
            torch.randn(ROWS, HIDDEN), weight, target, advantages, process_group=group
        )
    from torch.distributed.tensor import Shard, distribute_tensor

    logits = distribute_tensor(torch.randn(ROWS, VOCAB), weight.device_mesh, [Shard(1)])
    with pytest.raises(TypeError, match="DTensor"):
        xent.policy_loss(logits, target, advantages, process_group=group)


def _all_cases(rank, world, group, seed, device="cpu"):
    # device "cuda": the same cases on one GPU shared by the ranks (gloo over CUDA tensors).
    _policy_cases(rank, world, group, seed, device)
    _linear_cases(rank, world, group, seed, device)
    _error_cases(rank, world, group)


@needs_gloo
@pytest.mark.parametrize("world", [2, 3])
def test_policy_vocabulary_parallel_matches_single_process(world, gen):
    # Every rank draws the same inputs from one seed of the run's.
    run_group(world, _all_cases, (int(torch.randint(0, 2**30, (), generator=gen)),))


@pytest.mark.gpu
@needs_gloo
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_policy_vocabulary_parallel_on_one_gpu(gen):
    # The CUDA ops' sharded forms where one GPU is at hand: the ranks share it and exchange CUDA
    # tensors over gloo (NCCL needs a GPU a rank).
    run_group(2, _all_cases, (int(torch.randint(0, 2**30, (), generator=gen)), "cuda"))
