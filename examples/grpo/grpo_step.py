"""GRPO steps on a small Hugging Face causal LM with xent.linear_policy_loss on its LM head.

One rollout and its updates, as a GRPO trainer runs them: sample a group of completions per
prompt at the sampling temperature, score them, normalise each reward within its group into the
advantage of every token of that completion, take the sampling policy's log-probabilities in a
no-grad pass (the "old" logprobs) and the frozen reference model's, then `--iterations` optimizer
steps on the same batch (μ in the GRPO paper), each with the loss

    xent.linear_policy_loss(decoder_hidden, lm_head.weight, completion_tokens, advantages,
                            old_logprobs=..., ref_logprobs=..., loss_type="grpo", ...)

which is xent.policy_loss on the logits hidden @ lm_head.weight.T without holding them: the
clipped surrogate, a k3 KL to the reference and an entropy bonus (docs/semantics.md §7). Every
step also evaluates the same loss written in plain torch on materialised float64 logits and
reports the relative differences of the loss and of every parameter's gradient.

The model is built from a config (no download); `--model` takes any name transformers can load
instead, e.g. Qwen/Qwen2.5-0.5B-Instruct with --device cuda --dtype bfloat16.

    python examples/grpo/grpo_step.py                    # CPU, float32, a 2-layer Qwen2
    python examples/grpo/grpo_step.py --mask-truncated   # completions without EOS do not count
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch

import xent


@dataclasses.dataclass
class Config:
    loss_type: str = "grpo"
    aggregation: str = "seq_mean_token_mean"  # GRPO's paper: each completion's tokens first
    clip_low: float = 0.2  # TRL epsilon, verl clip_ratio_low
    clip_high: float = 0.28  # TRL epsilon_high, verl clip_ratio_high (DAPO's clip-higher)
    kl_coef: float = 0.04  # TRL beta, verl kl_loss_coef (kl_loss_type low_var_kl = k3)
    entropy_coef: float = 0.001
    temperature: float = 0.7


def tiny_model(vocab: int, seed: int) -> torch.nn.Module:
    """A 2-layer Qwen2 with a small hidden size and vocabulary, random weights, no download."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.1,  # logits of a useful spread at the sampling temperature
        # Several stop tokens (as chat models have), so that some completions of a random
        # model end within the few tokens sampled here.
        eos_token_id=list(range(1, 9)),
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def hidden_states(model, input_ids, attention_mask, prompt_len):
    """The decoder's last hidden states at the positions that predict the completion tokens
    (position t predicts token t + 1): (B, completion_len, H). The LM head is not applied."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask)[0]
    return hidden[:, prompt_len - 1 : -1, :]


@torch.no_grad()
def sample(model, prompts, completions, completion_len, temperature, generator):
    """`completions` samples of each prompt at the temperature, token by token (a rollout
    engine's job); after EOS a completion is padded. Returns the (B, P + C) ids, the attention
    mask, the completion targets (-100 after EOS) and which completions never ended (truncated)."""
    config = model.config
    stop = torch.tensor(config.eos_token_id, device=prompts.device).reshape(-1)
    ids = prompts.repeat_interleave(completions, dim=0)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    alive = []
    for _ in range(completion_len):
        logits = model(input_ids=ids).logits[:, -1, :].float()
        probs = torch.softmax(logits / temperature, dim=-1)
        token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(ids.device)
        token = torch.where(done, torch.full_like(token, config.pad_token_id), token)
        alive.append(~done)
        ids = torch.cat([ids, token[:, None]], dim=1)
        done = done | torch.isin(token, stop)
    alive = torch.stack(alive, dim=1)  # the EOS itself is a trained token
    completion = ids[:, prompts.shape[1] :]
    target = torch.where(alive, completion, torch.full_like(completion, -100))
    attention_mask = torch.cat([torch.ones_like(ids[:, : prompts.shape[1]]), alive.long()], dim=1)
    return ids, attention_mask, target, ~done


def reward(target: torch.Tensor) -> torch.Tensor:
    """A verifiable toy reward: the fraction of a completion's tokens with an even id."""
    valid = target != -100
    even = (target % 2 == 0) & valid
    return even.sum(1).float() / valid.sum(1).clamp(min=1).float()


def group_advantages(rewards: torch.Tensor, completions: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantage: the reward standardised within its prompt's group of completions."""
    groups = rewards.view(-1, completions)
    mean, std = groups.mean(1, keepdim=True), groups.std(1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)


def xent_loss(model, batch, cfg: Config, return_stats=False):
    hidden = hidden_states(model, batch["ids"], batch["attention_mask"], batch["prompt_len"])
    target = batch["target"]
    return xent.linear_policy_loss(
        hidden,  # (B, C, H): the rows are the completions (the sequences of the aggregation)
        model.lm_head.weight,
        target,
        batch["advantages"][:, None].expand_as(target),
        old_logprobs=batch["old_logprobs"],
        ref_logprobs=batch["ref_logprobs"],
        loss_type=cfg.loss_type,
        aggregation=cfg.aggregation,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        kl_coef=cfg.kl_coef,
        kl_estimator="k3",
        entropy_coef=cfg.entropy_coef,
        temperature=cfg.temperature,
        loss_mask=batch["loss_mask"],
        return_stats=return_stats,
    )


def torch_loss(model, batch, cfg: Config):
    """The same loss in plain torch on the materialised logits, in float64 from the LM head on:
    what a trainer computes without xent (TRL's and verl's per-token formulas)."""
    hidden = hidden_states(model, batch["ids"], batch["attention_mask"], batch["prompt_len"])
    logits = hidden.double() @ model.lm_head.weight.double().T / cfg.temperature
    logp = torch.log_softmax(logits, dim=-1)
    target = batch["target"]
    valid = (target != -100) & batch["loss_mask"]
    logprob = logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    advantage = batch["advantages"].double()[:, None]
    zero = torch.zeros((), dtype=torch.float64, device=target.device)
    old = torch.where(valid, batch["old_logprobs"].double(), zero)
    ref = torch.where(valid, batch["ref_logprobs"].double(), zero)
    ratio = torch.exp(torch.where(valid, logprob - old, zero))
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    policy = -torch.minimum(ratio * advantage, clipped * advantage)
    log_ref_ratio = torch.where(valid, ref - logprob, zero)
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3
    per_token = torch.where(valid, policy + cfg.kl_coef * kl - cfg.entropy_coef * entropy, zero)
    tokens = valid.sum(1)
    counted = tokens > 0  # a completion without a counted token is not a sequence of the mean
    per_sequence = per_token.sum(1) / tokens.clamp(min=1)
    return (per_sequence * counted).sum() / counted.sum().clamp(min=1)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def gradients(model, loss_fn, batch, cfg):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch, cfg)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@torch.no_grad()
def completion_logprobs(model, batch, cfg):
    hidden = hidden_states(model, batch["ids"], batch["attention_mask"], batch["prompt_len"])
    logprob = xent.linear_logprobs(
        hidden, model.lm_head.weight, batch["target"], temperature=cfg.temperature
    )
    return torch.where(batch["loss_mask"], logprob, torch.zeros_like(logprob))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a transformers name (default: tiny Qwen2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--completions", type=int, default=4, help="the group size G")
    parser.add_argument("--prompt-len", type=int, default=7)
    parser.add_argument("--completion-len", type=int, default=11)
    parser.add_argument("--vocab", type=int, default=97)
    parser.add_argument("--iterations", type=int, default=2, help="optimizer steps per rollout")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--mask-truncated", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = Config()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.model is None:
        model = tiny_model(args.vocab, args.seed)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model)
    model.to(device, dtype)
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # the frozen initial policy
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size

    # Rollout: sample the groups with the current policy, score them, form the advantages.
    model.eval()  # no dropout while sampling and scoring (the tiny model has none anyway)
    prompts = torch.randint(9, vocab, (args.prompts, args.prompt_len), generator=generator)
    ids, attention_mask, target, truncated = sample(
        model,
        prompts.to(device),
        args.completions,
        args.completion_len,
        cfg.temperature,
        generator,
    )
    loss_mask = target != -100
    if args.mask_truncated:  # TRL mask_truncated_completions: truncated completions do not count
        loss_mask &= ~truncated[:, None]
    rewards = reward(target)
    batch = {
        "ids": ids,
        "attention_mask": attention_mask,
        "prompt_len": args.prompt_len,
        "target": target,
        "loss_mask": loss_mask,
        "advantages": group_advantages(rewards, args.completions).to(device),
    }
    # The sampling policy's and the reference's log-probabilities, no gradient: constants.
    batch["old_logprobs"] = completion_logprobs(model, batch, cfg)
    batch["ref_logprobs"] = completion_logprobs(reference, batch, cfg)

    steps = []
    model.train()
    for _ in range(args.iterations):
        loss, grads = gradients(model, xent_loss, batch, cfg)
        ref_loss, ref_grads = gradients(model, torch_loss, batch, cfg)
        errors = {"loss": relative(loss, ref_loss)}
        errors.update({name: relative(grads[name], ref_grads[name]) for name in grads})
        before = completion_logprobs(model, batch, cfg)
        optimizer.zero_grad(set_to_none=True)
        stats = xent_loss(model, batch, cfg, return_stats=True)
        stats.loss.backward()
        optimizer.step()
        after = completion_logprobs(model, batch, cfg)
        # To first order a step on the policy term raises the mean token log-probability of
        # completions with a positive advantage and lowers it for negative ones (the mean, as
        # the aggregation weighs each completion's tokens): Σ_i A_i·Δ mean_t log π > 0.
        counted = batch["loss_mask"].sum(1)
        change = (after - before).sum(1) / counted.clamp(min=1)
        steps.append(
            {
                "loss": loss.item(),
                "torch_loss": ref_loss.item(),
                "max_relative_error": max(errors.values()),
                "worst": max(errors, key=errors.get),
                "alignment": (batch["advantages"] * change).sum().item(),
                "clip_fraction": (stats.clip_fraction_low + stats.clip_fraction_high).item(),
                "kl": stats.kl.item(),
                "mean_ratio": stats.ratio.item(),
            }
        )

    print(
        f"rewards {rewards.mean().item():.3f} (mean), {int(truncated.sum())} of "
        f"{truncated.numel()} completions truncated, {int(loss_mask.sum())} tokens counted"
    )
    for i, step in enumerate(steps):
        print(
            f"step {i}: loss {step['loss']:.6f} (plain torch {step['torch_loss']:.6f}), "
            f"max relative error {step['max_relative_error']:.1e} ({step['worst']}), "
            f"Σ A·Δlogπ {step['alignment']:+.2e}, clipped {step['clip_fraction']:.3f}, "
            f"kl {step['kl']:.2e}, mean ratio {step['mean_ratio']:.4f}"
        )
    return {
        "steps": steps,
        "advantages": batch["advantages"],
        "truncated": int(truncated.sum()),
        "tokens": int(loss_mask.sum()),
    }


if __name__ == "__main__":
    main()
