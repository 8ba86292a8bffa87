"""A GRPO-style clipped policy loss on xent.linear_logprobs, checked against the same loss on
materialised logits.

GRPO samples a group of completions per prompt, scores them, and uses each completion's reward
normalised within its group as the advantage of every token of it. The policy loss per token is
PPO's clipped surrogate on the ratio of the new to the old (sampling-time) probability of the
token, both at the sampling temperature, minus an entropy bonus:

    ratio = exp(logprob − old_logprob)
    loss  = −min(ratio·A, clip(ratio, 1 − ε, 1 + ε)·A) − β·entropy

averaged over the completion tokens (prompt and padding tokens carry target = -100). Only the
log-probabilities and entropies come from xent; the rest is plain torch, so any variant (KL to a
reference policy, token-level normalisation, DAPO's asymmetric clipping) is a few lines here.

    python examples/grpo/grpo_loss.py                # CPU, float32: asserts the two agree
    python examples/grpo/grpo_loss.py --device cuda --dtype bfloat16 --vocab 151936
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import xent


def grpo_policy_loss(logprob, entropy, old_logprob, advantage, mask, clip=0.2, entropy_bonus=0.01):
    """The clipped surrogate of GRPO/PPO, averaged over the tokens where mask is true."""
    ratio = torch.exp(logprob - old_logprob)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    per_token = -(surrogate + entropy_bonus * entropy)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def fused_loss(hidden, weight, target, old_logprob, advantage, temperature):
    logprob, entropy = xent.linear_logprobs(
        hidden, weight, target, temperature=temperature, return_entropy=True
    )
    return grpo_policy_loss(logprob, entropy, old_logprob, advantage, target != -100)


def materialised_loss(hidden, weight, target, old_logprob, advantage, temperature):
    """The same loss with the (N, V) logits in memory: what an RL trainer does without xent."""
    logp = F.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    mask = target != -100
    logprob = logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1) * mask
    entropy = -(logp.exp() * logp).sum(-1) * mask
    return grpo_policy_loss(logprob, entropy, old_logprob, advantage, mask)


def make_batch(
    groups, completions, prompt_len, completion_len, hidden_size, vocab, device, dtype, generator
):
    """A batch of `groups` prompts × `completions` completions: hidden states of every position,
    sampled tokens (prompt positions ignored), group-normalised advantages per completion and
    the sampling policy's log-probabilities (the current ones, perturbed: a policy a step old)."""
    rows = groups * completions
    seq = prompt_len + completion_len

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    hidden = randn(rows, seq, hidden_size)
    weight = randn(vocab, hidden_size, scale=2.0 / hidden_size**0.5)
    target = torch.randint(0, vocab, (rows, seq), generator=generator)
    target[:, :prompt_len] = -100
    lengths = torch.randint(1, completion_len + 1, (rows,), generator=generator)
    padding = torch.arange(completion_len)[None, :] >= lengths[:, None]
    target[:, prompt_len:][padding] = -100
    reward = torch.randn(groups, completions, generator=generator)
    advantage = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
    advantage = advantage.reshape(rows, 1).expand(rows, seq)
    return hidden, weight, target.to(device), advantage.to(device)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--completions", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=5)
    parser.add_argument("--completion-len", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1031)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    hidden, weight, target, advantage = make_batch(
        args.groups,
        args.completions,
        args.prompt_len,
        args.completion_len,
        args.hidden,
        args.vocab,
        args.device,
        dtype,
        generator,
    )
    with torch.no_grad():
        current = xent.linear_logprobs(hidden, weight, target, temperature=args.temperature)
        noise = torch.randn(current.shape, generator=generator).to(current.device)
        old_logprob = current + 0.3 * noise * (target != -100)

    results = []
    for loss_fn in (fused_loss, materialised_loss):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        loss = loss_fn(h, w, target, old_logprob, advantage, args.temperature)
        loss.backward()
        results.append((loss.detach().float(), h.grad.float(), w.grad.float()))

    def relative(a, b):
        return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()

    (loss, grad_h, grad_w), (ref_loss, ref_grad_h, ref_grad_w) = results
    errors = {
        "loss": relative(loss, ref_loss),
        "grad hidden": relative(grad_h, ref_grad_h),
        "grad weight": relative(grad_w, ref_grad_w),
    }
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    print(f"GRPO loss {loss.item():.6f} (materialised logits: {ref_loss.item():.6f})")
    for name, error in errors.items():
        print(f"  relative error of {name}: {error:.2e}")
    assert all(error <= tolerance for error in errors.values()), errors
    return errors


if __name__ == "__main__":
    main()
