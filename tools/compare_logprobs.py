#!/usr/bin/env python3
"""Times xent.linear_logprobs (log-probabilities and entropy, forward + backward) against the same
computation on materialised logits, and against xent.linear_cross_entropy at the same shape.

Every implementation computes J = Σ_n a_n·logprob_n + β·Σ_n entropy_n (a: random per-token
advantages, β = 0.01: the shape of a GRPO/PPO policy loss) and backpropagates it into the hidden
states and the LM head weight:

  xent       xent.linear_logprobs(h, W, y, temperature, return_entropy=True): its default
             logits cache (the first rows' logits within DEFAULT_LOGPROBS_CACHE_BYTES, 1 GiB)
  xent_cache the same with cache_logits=True (the forward keeps the N×V logits for the backward:
             three products instead of four, N·V elements more)
  xent_nocache  the same with cache_bytes=0: every row's logits recomputed (four products)
  xent_cache_256m, xent_cache_512m, xent_cache_1g, xent_cache_4g  the same with cache_bytes
             256 MiB / 512 MiB / 1 GiB / 4 GiB
  products3  the three bare products of a training step (h·Wᵀ, G·W, Gᵀ·h in the input dtype, G a
             fixed N×V tensor): F, the floor; records carry time_vs_products3
  xent_logprob  xent.linear_logprobs(h, W, y, temperature) without the entropy: J = Σ a·logprob
             (the forward asks for the loss and lse alone, so the lean kernels run)
  eager      log_softmax((h @ W.T).float() / T), gather and entropy, in PyTorch eager
  compile    the same function through torch.compile
  linear_ce  xent.linear_cross_entropy(h, W, y) (mean, gradient formed in the forward)
  linear_ce_none  xent.linear_cross_entropy(h, W, y, reduction="none") weighted by a: the same
             recompute-in-backward structure as linear_logprobs (per-row upstream gradients)
  linear_policy  xent.linear_policy_loss(h, W, y, a, ...) at the temperature: GRPO with clip-higher
             (0.2 / 0.28), a k3 KL term (β = 0.04) and an entropy bonus (α = 0.01), off-policy
             (old and reference logprobs within ±0.1 of a typical logprob); a loss, not J
  gspo_policy  the same with loss_type="gspo" over 1024-token sequences (cu_seqlens): its
             sequence ratio needs every token of a sequence before any gradient, so it keeps
             the four-product form
  compile_policy  the same policy loss (DAPO token-mean) on materialised logits through
             torch.compile
  chunked_policy  the same in plain PyTorch over row chunks of 2048 tokens, each chunk's logits
             recomputed in the backward (torch.utils.checkpoint)
  liger_policy  Liger-Kernel's LigerFusedLinearGRPOLoss with its defaults but the same clip range,
             β, loss type (dapo) and temperature, on 1024-token sequences (its advantages are one
             per sequence, and it has no entropy bonus)

With --no-grad the same forwards run under torch.no_grad() (the old-policy and reference-model
passes of an RL step), beside `product`, the bare logits product h @ Wᵀ in the input dtype: the
floor a logprob forward cannot beat (records carry time_vs_product). --budget-mib sets xent's
workspace budget.

Time is the median / p20 / p80 of CUDA events (wall clock on the CPU); peak extra memory is the
peak allocated during one step beyond the inputs and their gradients. Records are JSON.

Usage: compare_logprobs.py [--n 16384 --h 4096 --v 151936 --dtype bf16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from compare_torch import (  # noqa: E402
    DTYPES,
    Timer,
    build_archs,
    device_name,
    git_commit,
    peak_extra_bytes,
    progress,
    summarize,
)

IMPLS = (
    "xent",
    "xent_cache",
    "xent_nocache",
    "xent_cache_256m",
    "xent_cache_512m",
    "xent_cache_1g",
    "xent_cache_4g",
    "products3",
    "xent_logprob",
    "eager",
    "compile",
    "linear_ce",
    "linear_ce_none",
    "linear_policy",
    "gspo_policy",
    "compile_policy",
    "chunked_policy",
    "liger_policy",
)
POLICY_IMPLS = ("linear_policy", "gspo_policy", "compile_policy", "chunked_policy", "liger_policy")
NO_GRAD_IMPLS = ("product", "xent_logprob", "xent", "eager", "compile")
ENTROPY_WEIGHT = 0.01


def _logits(h, w, temperature):
    """fp32 logits of 16-bit or fp32 operands; float64 ones stay float64 (the check's reference)."""
    logits = h @ w.T
    return logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature


def materialised(h, w, y, advantage, temperature):
    logp = F.log_softmax(_logits(h, w, temperature), dim=-1)
    valid = y != -100
    logprob = logp.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1) * valid
    entropy = -(logp.exp() * logp).sum(-1) * valid
    return (advantage * logprob).sum() + ENTROPY_WEIGHT * entropy.sum()


def policy_data(advantage):
    """Old and reference logprobs, fixed by the advantages' values (time does not depend on them)."""
    old = -5.0 + 0.1 * torch.sin(advantage * 7.0)
    return old, old + 0.05 * torch.cos(advantage * 3.0)


def materialised_policy(h, w, y, advantage, temperature, entropy_weight=ENTROPY_WEIGHT, data=None):
    """GRPO with clip-higher (0.2 / 0.28), k3 KL (β = 0.04), entropy bonus (α = 0.01), token-mean.
    data: (old, ref) in place of policy_data(advantage)."""
    old, ref = policy_data(advantage) if data is None else data
    logp = F.log_softmax(_logits(h, w, temperature), dim=-1)
    valid = y != -100
    logprob = logp.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    ratio = torch.exp(logprob - old)
    policy = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.28) * advantage)
    kl = torch.exp(ref - logprob) - (ref - logprob) - 1.0
    per_token = (policy + 0.04 * kl - entropy_weight * entropy) * valid
    return per_token, valid


def make_objective(impl: str, temperature: float, budget: int | None = None):
    import xent
    import xent.functional

    if budget is not None:
        # The workspace budget of every xent call below (a keyword of each op).
        xent = _with_budget(xent, budget)
    if impl == "product":
        return lambda h, w, y, advantage: h @ w.T

    if impl == "products3":
        gradient = {}

        def objective(h, w, y, advantage):
            # A leaf of its own so that backward() runs the two gradient products and nothing else.
            if "g" not in gradient:
                gradient["g"] = torch.randn(h.shape[0], w.shape[0], device=h.device).to(h.dtype)
            logits = h @ w.T
            return _ThreeProducts.apply(h, w, logits, gradient["g"])

        return objective
    cache_bytes = {
        "xent_nocache": 0,
        "xent_cache_256m": 256 << 20,
        "xent_cache_512m": 512 << 20,
        "xent_cache_1g": 1 << 30,
        "xent_cache_4g": 4 << 30,
    }
    if impl in ("xent", "xent_cache") or impl in cache_bytes:
        keywords = {"cache_bytes": cache_bytes[impl]} if impl in cache_bytes else {}

        def objective(h, w, y, advantage):
            logprob, entropy = xent.linear_logprobs(
                h,
                w,
                y,
                temperature=temperature,
                return_entropy=True,
                cache_logits=impl == "xent_cache",
                **keywords,
            )
            return (advantage * logprob).sum() + ENTROPY_WEIGHT * entropy.sum()

        return objective
    if impl == "xent_logprob":
        return lambda h, w, y, advantage: (
            advantage * xent.linear_logprobs(h, w, y, temperature=temperature)
        ).sum()
    if impl == "eager":
        return lambda h, w, y, advantage: materialised(h, w, y, advantage, temperature)
    if impl == "compile":
        torch._dynamo.reset()
        return torch.compile(
            lambda h, w, y, advantage: materialised(h, w, y, advantage, temperature)
        )
    if impl == "linear_ce":
        return lambda h, w, y, advantage: xent.linear_cross_entropy(h, w, y)
    if impl in ("linear_policy", "gspo_policy"):

        def policy(h, w, y, advantage):
            old, ref = policy_data(advantage)
            sequences = {}
            if impl == "gspo_policy":
                bounds = torch.arange(0, h.shape[0] + 1, 1024, device=h.device)
                if bounds[-1] != h.shape[0]:
                    bounds = torch.cat([bounds, bounds.new_tensor([h.shape[0]])])
                sequences = dict(loss_type="gspo", cu_seqlens=bounds.to(torch.int32))
            return xent.linear_policy_loss(
                h,
                w,
                y,
                advantage,
                old_logprobs=old,
                ref_logprobs=ref,
                clip_low=0.2,
                clip_high=0.28,
                kl_coef=0.04,
                kl_estimator="k3",
                entropy_coef=0.01,
                temperature=temperature,
                **sequences,
            )

        return policy
    if impl == "compile_policy":
        torch._dynamo.reset()

        def token_mean(h, w, y, advantage):
            per_token, valid = materialised_policy(h, w, y, advantage, temperature)
            return per_token.sum() / valid.sum().clamp(min=1)

        return torch.compile(token_mean)
    if impl == "chunked_policy":
        from torch.utils.checkpoint import checkpoint

        def chunked(h, w, y, advantage, rows=2048):
            total = h.new_zeros((), dtype=torch.float32)
            for i in range(0, h.shape[0], rows):
                part = slice(i, i + rows)
                per_token, _ = checkpoint(
                    materialised_policy,
                    h[part],
                    w,
                    y[part],
                    advantage[part],
                    temperature,
                    use_reentrant=False,
                )
                total = total + per_token.sum()
            return total / (y != -100).sum().clamp(min=1)

        return chunked
    if impl == "liger_policy":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss = LigerFusedLinearGRPOLoss(
            beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo", temperature=temperature
        )

        def liger(h, w, y, advantage, length=LIGER_SEQUENCE):
            old, ref = policy_data(advantage)
            n = h.shape[0] // length * length
            shape = (n // length, length)
            valid = (y[:n] != -100).view(shape)
            out = loss(
                h[:n].view(*shape, -1),
                w,
                y[:n].clamp(min=0).view(shape),
                valid.to(torch.int64),
                advantage[:n].view(shape)[:, 0].contiguous(),
                ref_per_token_logps=ref[:n].view(shape),
                old_per_token_logps=old[:n].view(shape),
            )
            return out[0] if isinstance(out, tuple) else out

        return liger
    if impl == "linear_ce_none":
        return lambda h, w, y, advantage: (
            advantage * xent.linear_cross_entropy(h, w, y, reduction="none")
        ).sum()
    raise ValueError(impl)


# The shape where --check holds each implementation's value and gradients to float64.
CHECK_SHAPE = (2048, 256, 4096)
LIGER_SEQUENCE = 1024


def reference_value(impl: str, h, w, y, advantage, temperature: float):
    """The float64 value of `impl`'s objective (h, w: float64 leaves, on the CPU)."""
    if impl in ("linear_policy", "compile_policy", "chunked_policy"):
        per_token, valid = materialised_policy(h, w, y, advantage, temperature)
        return per_token.sum() / valid.sum().clamp(min=1)
    if impl == "liger_policy":
        # Its configuration as called above: no entropy bonus, each 1024-token sequence's first
        # advantage for all its tokens, whole sequences only, DAPO's token-mean.
        n = h.shape[0] // LIGER_SEQUENCE * LIGER_SEQUENCE
        old, ref = policy_data(advantage[:n])
        sequence_advantage = advantage[:n:LIGER_SEQUENCE].repeat_interleave(LIGER_SEQUENCE)
        per_token, valid = materialised_policy(
            h[:n], w, y[:n], sequence_advantage, temperature, 0.0, (old, ref)
        )
        return per_token.sum() / valid.sum().clamp(min=1)
    if impl == "gspo_policy":
        # No closed form here: the library's float64 CPU path, which its tests hold to the
        # float64 formulas of docs/semantics.md §7.
        return make_objective(impl, temperature)(h, w, y, advantage)
    if impl.startswith("xent_cache") or impl in ("xent", "xent_nocache", "eager", "compile"):
        return materialised(h, w, y, advantage, temperature)
    if impl == "xent_logprob":
        logp = F.log_softmax(_logits(h, w, temperature), dim=-1)
        valid = y != -100
        return (advantage * logp.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1) * valid).sum()
    if impl == "linear_ce":
        return F.cross_entropy(h @ w.T, y)
    if impl == "linear_ce_none":
        return (advantage * F.cross_entropy(h @ w.T, y, reduction="none")).sum()
    raise ValueError(impl)


def _rel_error(got, want) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp(min=1e-300))


def check(impl: str, args, dtype) -> dict:
    """loss_rel_err and grad_rel_err (the larger of ∂h's and ∂W's, in norm) of `impl` at
    CHECK_SHAPE against its objective in float64."""
    hidden, weight, target, advantage = make_inputs(*CHECK_SHAPE, dtype, args.device, seed=2)
    value = make_objective(impl, args.temperature)(hidden, weight, target, advantage)
    value.backward()
    h64 = hidden.detach().double().cpu().requires_grad_()
    w64 = weight.detach().double().cpu().requires_grad_()
    y, a = target.cpu(), advantage.detach().double().cpu()
    expected = reference_value(impl, h64, w64, y, a, args.temperature)
    expected.backward()
    return {
        "loss_rel_err": abs(value.item() - expected.item()) / max(abs(expected.item()), 1e-300),
        "grad_rel_err": max(_rel_error(hidden.grad, h64.grad), _rel_error(weight.grad, w64.grad)),
    }


class _ThreeProducts(torch.autograd.Function):
    """A scalar of the logits whose backward is the two gradient products with a fixed G."""

    @staticmethod
    def forward(ctx, h, w, logits, gradient):
        ctx.save_for_backward(h, w, gradient)
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _):
        h, w, gradient = ctx.saved_tensors
        return gradient @ w, gradient.T @ h, None, None


class _with_budget:
    """xent's linear ops with workspace_bytes fixed."""

    def __init__(self, module, budget: int):
        self.module, self.budget = module, budget

    def __getattr__(self, name):
        op = getattr(self.module, name)
        return lambda *a, **k: op(*a, workspace_bytes=self.budget, **k)


def make_inputs(n, h, v, dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=generator) * h**-0.5).to(device, dtype)
    weight.requires_grad_()
    target = torch.randint(0, v, (n,), generator=generator)
    target[torch.rand(n, generator=generator) < 0.1] = -100  # prompt / padding tokens
    advantage = torch.randn(n, generator=generator).to(device)
    return hidden, weight, target.to(device), advantage


def measure(impl, inputs, args, base):
    record = dict(
        base,
        impl=impl,
        op="matmul"
        if impl == "product"
        else impl
        if impl in POLICY_IMPLS
        else "linear_ce"
        if impl.startswith("linear_ce")
        else "linear_logprobs",
        time_ms=None,
        peak_extra_mib=None,
        value=None,
        error=None,
    )
    budget = None if args.budget_mib is None else args.budget_mib << 20
    objective = make_objective(impl, args.temperature, budget)
    hidden, weight, target, advantage = inputs

    def step(_):
        hidden.grad = weight.grad = None
        if args.no_grad:
            with torch.no_grad():
                out = objective(hidden, weight, target, advantage)
            return out if out.dim() == 0 else out[0, 0]  # the product's logits: one to report
        value = objective(hidden, weight, target, advantage)
        value.backward()
        return value

    if args.check and not args.no_grad and impl not in ("product", "products3"):
        try:
            record.update(check(impl, args, inputs[0].dtype))
            progress(
                f"{impl:15s}: against float64 at {CHECK_SHAPE}: loss {record['loss_rel_err']:.2e},"
                f" gradients {record['grad_rel_err']:.2e}"
            )
        except Exception as error:
            record["error"] = f"check: {error.__class__.__name__}: {error}"[:500]
            progress(f"{impl:15s}: check error: {record['error']}")
    try:
        progress(f"{impl:15s}: {args.warmup} warm-up + {args.repeat} timed ...")
        record["value"] = step(0).detach().float().item()  # compiles, allocates
        if args.device == "cuda":
            record["peak_extra_mib"] = peak_extra_bytes(step, [hidden, weight]) / 2**20
        record["time_ms"] = summarize(Timer(args.device, args.warmup, args.repeat).run(step))
        progress(
            f"{impl:15s}: median {record['time_ms']['median']:.3f} ms"
            + (
                f", extra {record['peak_extra_mib']:.1f} MiB"
                if record["peak_extra_mib"] is not None
                else ""
            )
        )
    except Exception as error:  # one failing implementation must not stop the others
        record["error"] = f"{error.__class__.__name__}: {error}"[:500]
        progress(f"{impl:15s}: error: {record['error']}")
    finally:
        hidden.grad = weight.grad = None
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--device", choices=("cuda", "cpu"))
    parser.add_argument(
        "--impls",
        help=f"comma list (default {','.join(IMPLS)}; with --no-grad {','.join(NO_GRAD_IMPLS)})",
    )
    parser.add_argument(
        "--no-grad",
        action="store_true",
        help="time the forwards under torch.no_grad() beside the bare logits product",
    )
    parser.add_argument("--budget-mib", type=int, help="xent's workspace budget in MiB")
    parser.add_argument(
        "--portable-paths",
        action="store_true",
        help="run xent's CUDA ops on their portable paths (those of non-Hopper GPUs) on this GPU",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="first hold each implementation's value and gradients to its objective in float64 "
        f"at (N, H, V) = {CHECK_SHAPE} (records carry loss_rel_err and grad_rel_err)",
    )
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--json", help="write the records as a JSON array to this file")
    args = parser.parse_args(argv)
    args.impls = args.impls or ",".join(NO_GRAD_IMPLS if args.no_grad else IMPLS)
    if args.budget_mib is not None and args.budget_mib <= 0:
        parser.error("--budget-mib: a positive number of MiB")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device == "cuda"
    if args.portable_paths:
        import xent  # noqa: F401  (registers its ops)

        if not cuda or not hasattr(torch.ops.xent, "_force_portable_paths"):
            print("compare_logprobs.py: --portable-paths needs xent's CUDA ops", file=sys.stderr)
            return 2
        torch.ops.xent._force_portable_paths(True)
    args.repeat = args.repeat or (20 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, DTYPES[args.dtype])
    base = {
        "n": args.n,
        "h": args.h,
        "v": args.v,
        "dtype": str(dtype).replace("torch.", ""),
        "temperature": args.temperature,
        "mode": "fwd" if args.no_grad else "fwdbwd",
        "budget_bytes": None if args.budget_mib is None else args.budget_mib << 20,
        "paths": "portable" if args.portable_paths else "default",
        "device": device_name(args.device),
        "commit": git_commit(),
        "cuda_archs": build_archs("cuda_archs"),
        "cuda_ptx": build_archs("cuda_ptx"),
    }
    inputs = make_inputs(args.n, args.h, args.v, dtype, args.device, seed=1)
    records = [measure(impl, inputs, args, base) for impl in args.impls.split(",") if impl]
    reference = next((r for r in records if r["impl"] == "linear_ce" and r["time_ms"]), None)
    product = next((r for r in records if r["impl"] == "product" and r["time_ms"]), None)
    three = next((r for r in records if r["impl"] == "products3" and r["time_ms"]), None)
    for r in records:
        if product and r["time_ms"]:
            r["time_vs_product"] = r["time_ms"]["median"] / product["time_ms"]["median"]
        if three and r["time_ms"]:
            r["time_vs_products3"] = r["time_ms"]["median"] / three["time_ms"]["median"]
    print(
        f"{'impl':15s} {'median ms':>10s} {'p20 ms':>10s} {'p80 ms':>10s} {'extra MiB':>10s}"
        f" {'vs linear_ce':>12s} {'vs product':>10s} {'vs F':>6s}"
    )
    for r in records:
        if r["error"]:
            print(f"{r['impl']:15s} error: {r['error']}")
            continue
        t = r["time_ms"]
        if reference:
            r["time_vs_linear_ce"] = t["median"] / reference["time_ms"]["median"]
        extra = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.1f}"
        ratio = f"{r['time_vs_linear_ce']:.3f}" if reference else "-"
        floor = f"{r['time_vs_product']:.3f}" if product else "-"
        in_f = f"{r['time_vs_products3']:.3f}" if three else "-"
        print(
            f"{r['impl']:15s} {t['median']:10.3f} {t['p20']:10.3f} {t['p80']:10.3f}"
            f" {extra:>10s} {ratio:>12s} {floor:>10s} {in_f:>6s}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        progress(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
