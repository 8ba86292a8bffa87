"""Vocabulary-parallel xent on GPUs over NCCL: correctness, then timings (docs/performance.md row
"vocab-parallel").

    torchrun --nproc_per_node 2 tests/python/dist_check.py --json OUT/dist.json

1. Correctness on CUDA: sharded cross_entropy / linear_cross_entropy (uneven slices, every §1
   option, fp32 and bf16), sharded distill (every kind, the §3 options, every reduction) and
   sharded distill from a top-k teacher (every mass with its kinds, the ids routed to the rank
   that owns them) against the unsharded xent result on the same GPU, on every rank.
2. Timings (forward + backward, median / p20 / p80 of CUDA-event times, the max over ranks per
   step): ce N = 16384, V = 262144 bf16 and linear_ce (N, H, V) = (8192, 4096, 128256) bf16,
   sharded over the group against unsharded on one GPU, each beside a Megatron-style parallel
   cross-entropy in plain torch ops (all-reduce of the max, then of sum-exp and target logit;
   the local parts torch.compile'd) as the anchor. The collective time is measured alone, at the
   same sizes. Distill: N = 4096, V = 131072 bf16 student and teacher, every kind, sharded
   against unsharded, the collectives (one all_gather of records; two for jsd and tvd) timed
   alone. Rank 0 writes one JSON record per measurement (with world_size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import xent


def commit() -> str:
    if os.environ.get("XENT_COMMIT"):
        return os.environ["XENT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def split(vocab: int, world: int, rank: int, uneven: bool):
    """[begin, end) of this rank; uneven gives the last rank a larger slice."""
    sizes = [vocab // world] * world
    if uneven and world > 1:
        sizes[0] -= 3
    sizes[-1] += vocab - sum(sizes)
    begin = sum(sizes[:rank])
    return begin, begin + sizes[rank]


# ---- 1. correctness ------------------------------------------------------------------------------


def check_close(what, got, expected, rtol, atol, failures):
    if not torch.allclose(got.float(), expected.float(), rtol=rtol, atol=atol, equal_nan=True):
        err = (got.float() - expected.float()).abs().max().item()
        failures.append(f"{what}: max abs error {err:.3e} (rtol {rtol}, atol {atol})")


def check_sharded(tag, got, ref, local_grad, full_grad, begin, end, dtype, failures):
    """A sharded distill's loss against the unsharded one, and its local gradient against the
    slice [begin, end) of the whole gradient (bf16: to 1 % of the largest element)."""
    check_close(tag + " loss", got, ref, 1e-4, 1e-5, failures)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    check_close(
        tag + " grad",
        local_grad,
        full_grad[:, begin:end],
        tol,
        tol * full_grad.abs().max().item(),
        failures,
    )


def correctness(rank, world, device, failures):
    options = [
        {},
        {"label_smoothing": 0.1},
        {"z_loss": 1e-3},
        {"softcap": 30.0},
        {"logit_scale": 0.7},
        {"class_weight": True},
        {"row_weight": True},
        {
            "label_smoothing": 0.1,
            "z_loss": 1e-3,
            "softcap": 30.0,
            "logit_scale": 0.7,
            "class_weight": True,
            "row_weight": True,
        },
    ]
    torch.backends.cuda.matmul.allow_tf32 = False
    for rows, vocab in ((37, 1031), (512, 50257)):
        begin, end = split(vocab, world, rank, uneven=True)
        for dtype in (torch.float32, torch.bfloat16):
            for opts in options:
                for reduction in ("none", "sum", "mean"):
                    gen = torch.Generator(device=device).manual_seed(rows + vocab)
                    logits = (torch.randn(rows, vocab, device=device, generator=gen) * 2).to(dtype)
                    target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
                    target[::7] = -100
                    kw = dict(opts)
                    if kw.get("class_weight"):
                        kw["class_weight"] = torch.rand(vocab, device=device, generator=gen) + 0.5
                    if kw.get("row_weight"):
                        kw["row_weight"] = torch.rand(rows, device=device, generator=gen)
                    upstream = torch.randn(
                        rows if reduction == "none" else (), device=device, generator=gen
                    )
                    tag = f"ce {rows}x{vocab} {dtype} {sorted(opts)} {reduction}"
                    full = logits.clone().requires_grad_()
                    ref = xent.cross_entropy(
                        full, target, reduction=reduction, return_stats=True, **kw
                    )
                    (ref.loss * upstream).sum().backward()
                    local = logits[:, begin:end].clone().requires_grad_()
                    skw = dict(kw)
                    if "class_weight" in skw:
                        skw["class_weight"] = kw["class_weight"][begin:end]
                    got = xent.cross_entropy(
                        local,
                        target,
                        reduction=reduction,
                        return_stats=True,
                        process_group=dist.group.WORLD,
                        **skw,
                    )
                    (got.loss * upstream).sum().backward()
                    check_close(tag + " loss", got.loss, ref.loss, 1e-5, 1e-5, failures)
                    for name in ("lse", "logprob", "entropy", "z_loss"):
                        check_close(
                            f"{tag} {name}",
                            getattr(got, name),
                            getattr(ref, name),
                            1e-5,
                            1e-5,
                            failures,
                        )
                    check_close(tag + " accuracy", got.accuracy, ref.accuracy, 0, 1e-6, failures)
                    if not torch.equal(got.argmax, ref.argmax):
                        failures.append(f"{tag} argmax differs")
                    tol = 1e-5 if dtype == torch.float32 else 1e-2
                    check_close(
                        tag + " grad",
                        local.grad,
                        full.grad[:, begin:end],
                        tol,
                        tol * full.grad.abs().max().item(),
                        failures,
                    )
    # linear_ce, fp32 products (TF32 off), several row chunks.
    rows, hidden_size, vocab = 300, 128, 1031
    begin, end = split(vocab, world, rank, uneven=True)
    for reduction in ("none", "sum", "mean"):
        for budget in (None, 64 * vocab * 4):
            gen = torch.Generator(device=device).manual_seed(7)
            hidden = torch.randn(rows, hidden_size, device=device, generator=gen)
            weight = torch.randn(vocab, hidden_size, device=device, generator=gen) / 8
            bias = torch.randn(vocab, device=device, generator=gen) * 0.1
            target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
            target[::9] = -100
            upstream = torch.randn(
                rows if reduction == "none" else (), device=device, generator=gen
            )
            tag = f"linear_ce {reduction} budget={budget}"
            h1, w1, b1 = (t.clone().requires_grad_() for t in (hidden, weight, bias))
            ref = xent.linear_cross_entropy(
                h1, w1, target, b1, reduction=reduction, z_loss=1e-3, label_smoothing=0.1
            )
            (ref * upstream).sum().backward()
            h2 = hidden.clone().requires_grad_()
            w2 = weight[begin:end].clone().requires_grad_()
            b2 = bias[begin:end].clone().requires_grad_()
            got = xent.linear_cross_entropy(
                h2,
                w2,
                target,
                b2,
                reduction=reduction,
                z_loss=1e-3,
                label_smoothing=0.1,
                workspace_bytes=budget,
                process_group=dist.group.WORLD,
            )
            (got * upstream).sum().backward()
            check_close(tag + " loss", got, ref, 1e-4, 1e-5, failures)
            check_close(tag + " grad hidden", h2.grad, h1.grad, 1e-4, 1e-5, failures)
            check_close(tag + " grad weight", w2.grad, w1.grad[begin:end], 1e-4, 1e-5, failures)
            check_close(tag + " grad bias", b2.grad, b1.grad[begin:end], 1e-4, 1e-5, failures)
    torch.backends.cuda.matmul.allow_tf32 = True
    distill_correctness(rank, world, device, failures)
    topk_correctness(rank, world, device, failures)


DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd")


def distill_correctness(rank, world, device, failures):
    """Sharded distill of every kind against unsharded xent.distill on the same GPU: the loss on
    every rank and the gradient of the local student slice."""
    options = [
        {},
        {"temperature": 2.0, "softcap": 30.0},
        {"beta": 0.25},
        {"hard_weight": 0.5, "label_smoothing": 0.1, "z_loss": 1e-3, "class_weight": True},
        {"no_target": True},
    ]
    cases = [
        (37, 1031, dtype, opts, reduction)
        for dtype in (torch.float32, torch.bfloat16)
        for opts in options
        for reduction in ("none", "sum", "mean")
    ]
    cases += [(512, 50257, torch.bfloat16, {}, "mean")]
    for rows, vocab, dtype, opts, reduction in cases:
        begin, end = split(vocab, world, rank, uneven=True)
        for kind in DISTILL_KINDS:
            gen = torch.Generator(device=device).manual_seed(rows + vocab)
            student = torch.randn(rows, vocab, device=device, generator=gen) * 2
            teacher = student + torch.randn(rows, vocab, device=device, generator=gen)
            student, teacher = student.to(dtype), teacher.to(dtype)
            target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
            target[::7] = -100
            kw = {k: v for k, v in opts.items() if k != "no_target"}
            if opts.get("no_target"):
                target = None
            if kw.get("class_weight"):
                kw["class_weight"] = torch.rand(vocab, device=device, generator=gen) + 0.5
            upstream = torch.randn(
                rows if reduction == "none" else (), device=device, generator=gen
            )
            tag = f"distill {kind} {rows}x{vocab} {dtype} {sorted(opts)} {reduction}"
            full = student.clone().requires_grad_()
            ref = xent.distill(full, teacher, target, kind=kind, reduction=reduction, **kw)
            (ref * upstream).sum().backward()
            local = student[:, begin:end].clone().requires_grad_()
            skw = dict(kw)
            if "class_weight" in skw:
                skw["class_weight"] = kw["class_weight"][begin:end]
            got = xent.distill(
                local,
                teacher[:, begin:end].contiguous(),
                target,
                kind=kind,
                reduction=reduction,
                process_group=dist.group.WORLD,
                **skw,
            )
            (got * upstream).sum().backward()
            check_sharded(tag, got, ref, local.grad, full.grad, begin, end, dtype, failures)


def _topk_teacher(gen, student, k):
    """Top-k ids (global, in a shuffled order) and fp32 log-probabilities of a teacher correlated
    with the student, with absent entries (-1), one row without any and ids at both ends of the
    vocabulary."""
    rows, vocab = student.shape
    teacher = student.float() + torch.randn(rows, vocab, device=student.device, generator=gen)
    logprobs, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    order = torch.argsort(torch.rand(ids.shape, device=ids.device, generator=gen), -1)
    ids, logprobs = ids.gather(1, order), logprobs.gather(1, order)
    ids[1, k // 2 :] = -1
    ids[2, :] = -1
    ids[3, :] = -1  # then ids at both ends alone, so none repeats
    ids[3, :2] = torch.tensor([0, vocab - 1], device=ids.device)
    logprobs = torch.log_softmax(teacher, -1).gather(1, ids.clamp(min=0))
    return ids, logprobs


def topk_correctness(rank, world, device, failures):
    """Sharded distill from a top-k teacher (xent.TopK, global ids) against unsharded xent.distill
    on the same GPU: every mass with its kinds but tvd (whose kinks may fall on either side in
    two fp32 computations; the gloo tests bound that), with and without the hard-label term, fp32
    and bf16, uneven slices; the loss on every rank and the gradient of the local slice."""
    masses = {
        "renormalize": ("forward_kl", "reverse_kl", "jsd", "soft_ce"),
        "tail": ("forward_kl", "reverse_kl", "jsd", "soft_ce"),
        "ignore": ("forward_kl", "soft_ce"),
    }
    option_sets = [{}, {"hard_weight": 0.5, "label_smoothing": 0.1, "softcap": 30.0}]
    cases = [
        (37, 1031, 24, dtype, mass, kind, opts, reduction)
        for dtype in (torch.float32, torch.bfloat16)
        for mass, kinds in masses.items()
        for kind in kinds
        for opts in option_sets
        for reduction in ("none", "mean")
    ]
    cases += [(512, 50257, 64, torch.bfloat16, "tail", "forward_kl", {}, "mean")]
    for rows, vocab, k, dtype, mass, kind, opts, reduction in cases:
        begin, end = split(vocab, world, rank, uneven=True)
        gen = torch.Generator(device=device).manual_seed(rows + vocab + k)
        student = (torch.randn(rows, vocab, device=device, generator=gen) * 2).to(dtype)
        ids, logprobs = _topk_teacher(gen, student, k)
        teacher = xent.TopK(ids, logprobs, mass)
        target = torch.randint(0, vocab, (rows,), device=device, generator=gen)
        target[::7] = -100
        upstream = torch.randn(rows if reduction == "none" else (), device=device, generator=gen)
        tag = f"distill top-k {mass} {kind} {rows}x{vocab} k={k} {dtype} {sorted(opts)} {reduction}"
        full = student.clone().requires_grad_()
        ref = xent.distill(
            full, target=target, teacher=teacher, kind=kind, reduction=reduction, **opts
        )
        (ref * upstream).sum().backward()
        local = student[:, begin:end].clone().requires_grad_()
        got = xent.distill(
            local,
            target=target,
            teacher=teacher,
            kind=kind,
            reduction=reduction,
            process_group=dist.group.WORLD,
            **opts,
        )
        (got * upstream).sum().backward()
        check_sharded(tag, got, ref, local.grad, full.grad, begin, end, dtype, failures)


# ---- 2. timings ----------------------------------------------------------------------------------


def timed(step, iterations=20, warmup=3):
    """CUDA-event times of step() in ms, the max over ranks per iteration."""
    times = []
    for i in range(warmup + iterations):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    t = torch.tensor(times, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    t = t.sort().values.cpu()
    pick = lambda q: float(t[min(len(t) - 1, int(q * len(t)))])
    return {"median_ms": pick(0.5), "p20_ms": pick(0.2), "p80_ms": pick(0.8)}


class MegatronStyleCrossEntropy(torch.autograd.Function):
    """The anchor: Megatron-style vocab-parallel CE in plain torch ops (not xent). Forward:
    local max → all-reduce MAX; local sum-exp and target logit → one all-reduce SUM of [N, 2];
    backward: softmax minus one-hot of the local slice, no communication. Mean reduction."""

    @staticmethod
    def forward(ctx, logits, target, begin, group):
        row_max = _local_max(logits)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = _local_sums(logits, row_max, target, begin)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = row_max + torch.log(sums[:, 0])
        ctx.save_for_backward(logits, target, lse)
        ctx.begin = begin
        return (lse - sums[:, 1]).mean()

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse = ctx.saved_tensors
        return _local_grad(logits, target, lse, ctx.begin, grad / logits.shape[0]), None, None, None


@torch.compile
def _local_max(x):
    return x.float().amax(-1)


@torch.compile
def _local_sums(x, row_max, target, begin: int):
    xf = x.float()
    local = target - begin
    inside = (local >= 0) & (local < x.shape[1])
    picked = xf.gather(1, local.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    return torch.stack(
        [torch.exp(xf - row_max[:, None]).sum(-1), torch.where(inside, picked, 0.0)], 1
    )


@torch.compile
def _local_grad(x, target, lse, begin: int, scale):
    p = torch.exp(x.float() - lse[:, None])
    local = target - begin
    columns = torch.arange(x.shape[1], device=x.device)
    p = p - (columns[None, :] == local[:, None]).float()
    return (p * scale).to(x.dtype)


def guarded(step, iterations=20):
    """timed(step), or None when the step fails (e.g. torch.compile missing on this machine):
    one failing implementation must not cost the other records."""
    try:
        return timed(step, iterations=iterations)
    except Exception as error:  # reported, the run goes on
        print(f"timing failed: {type(error).__name__}: {error}", flush=True)
        return None


def record(op, impl, world, shapes, timing, unsharded_ms, collective_ms, records):
    if timing is None:
        records.append(
            {
                "op": op,
                "impl": impl,
                "world_size": world,
                "shapes": shapes,
                "error": "failed, see the log",
            }
        )
        return
    rec = {
        "op": op,
        "impl": impl,
        "world_size": world,
        "shapes": shapes,
        "dtype": "bfloat16",
        "time_median_ms": timing["median_ms"],
        "time_p20_ms": timing["p20_ms"],
        "time_p80_ms": timing["p80_ms"],
        "unsharded_ms": unsharded_ms,
        "ratio": timing["median_ms"] / unsharded_ms if unsharded_ms else None,
        "collective_ms": collective_ms,
        "device": torch.cuda.get_device_name(),
        "commit": commit(),
    }
    records.append(rec)


def time_ce(rank, world, records):
    rows, vocab = 16384, 262144
    begin, end = split(vocab, world, rank, uneven=False)
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(0)
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    full = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    local = full[:, begin:end].contiguous().requires_grad_()
    full.requires_grad_()

    def unsharded():
        full.grad = None
        xent.cross_entropy(full, target).backward()

    base = timed(unsharded)
    del full
    torch.cuda.empty_cache()

    def sharded():
        local.grad = None
        xent.cross_entropy(local, target, process_group=group).backward()

    def anchor():
        local.grad = None
        MegatronStyleCrossEntropy.apply(local, target, begin, group).backward()

    partial = torch.empty(rows, 9, device="cuda")
    gathered = torch.empty(world * rows, 9, device="cuda")
    gather = timed(lambda: dist.all_gather_into_tensor(gathered, partial, group=group))
    row_max = torch.empty(rows, device="cuda")
    sums = torch.empty(rows, 2, device="cuda")
    reduces = timed(
        lambda: (
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group),
            dist.all_reduce(sums, group=group),
        )
    )
    shapes = {"N": rows, "V": vocab, "V_local": end - begin}
    record("ce", "xent", 1, {"N": rows, "V": vocab}, base, base["median_ms"], 0.0, records)
    record(
        "ce",
        "xent-sharded",
        world,
        shapes,
        guarded(sharded),
        base["median_ms"],
        gather["median_ms"],
        records,
    )
    record(
        "ce",
        "megatron-style-torch-compile",
        world,
        shapes,
        guarded(anchor),
        base["median_ms"],
        reduces["median_ms"],
        records,
    )


def time_linear_ce(rank, world, records):
    rows, hidden_size, vocab = 8192, 4096, 128256
    begin, end = split(vocab, world, rank, uneven=False)
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(0)
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    hidden = (torch.randn(rows, hidden_size, device="cuda", generator=gen) / 8).to(torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) / 64).to(torch.bfloat16)
    hidden.requires_grad_()
    weight.requires_grad_()

    def unsharded():
        hidden.grad = weight.grad = None
        xent.linear_cross_entropy(hidden, weight, target).backward()

    base = timed(unsharded, iterations=10)
    local_weight = weight.detach()[begin:end].clone().requires_grad_()
    weight.grad = None
    del weight
    torch.cuda.empty_cache()

    def sharded(in_forward, cache):
        def step():
            hidden.grad = local_weight.grad = None
            xent.linear_cross_entropy(
                hidden,
                local_weight,
                target,
                process_group=group,
                grad_in_forward=in_forward,
                cache_logits=cache,
            ).backward()

        return step

    def anchor():
        hidden.grad = local_weight.grad = None
        logits = hidden @ local_weight.t()
        MegatronStyleCrossEntropy.apply(logits, target, begin, group).backward()
        dist.all_reduce(hidden.grad, group=group)  # ∂h of a tensor-parallel head, as xent does

    partial = torch.empty(rows, 9, device="cuda")
    gathered = torch.empty(world * rows, 9, device="cuda")
    grad_hidden = torch.empty(rows, hidden_size, device="cuda", dtype=torch.bfloat16)
    collectives = timed(
        lambda: (
            dist.all_gather_into_tensor(gathered, partial, group=group),
            dist.all_reduce(grad_hidden, group=group),
        )
    )
    shapes = {"N": rows, "H": hidden_size, "V": vocab, "V_local": end - begin}
    record(
        "linear_ce",
        "xent",
        1,
        {"N": rows, "H": hidden_size, "V": vocab},
        base,
        base["median_ms"],
        0.0,
        records,
    )
    # The default forms the gradient per row chunk in the forward (no recompute); the two-pass
    # schedule (grad_in_forward=False) recomputes the logits in the backward, or keeps them.
    record(
        "linear_ce",
        "xent-sharded",
        world,
        shapes,
        guarded(sharded(True, False), iterations=10),
        base["median_ms"],
        collectives["median_ms"],
        records,
    )
    record(
        "linear_ce",
        "xent-sharded-two-pass",
        world,
        shapes,
        guarded(sharded(False, False), iterations=10),
        base["median_ms"],
        collectives["median_ms"],
        records,
    )
    record(
        "linear_ce",
        "xent-sharded-two-pass-cache-logits",
        world,
        shapes,
        guarded(sharded(False, True), iterations=10),
        base["median_ms"],
        collectives["median_ms"],
        records,
    )
    record(
        "linear_ce",
        "megatron-style-torch-compile",
        world,
        shapes,
        guarded(anchor, iterations=10),
        base["median_ms"],
        collectives["median_ms"],
        records,
    )


def time_distill(rank, world, records):
    """Sharded distill against unsharded at a PERF-like shape (N = 4096, V = 131072, bf16
    student and teacher), forward + backward, every kind; the collectives timed alone: one
    all_gather of [N, 13] records (every kind), and for jsd and tvd a second of [N, 5] sums."""
    rows, vocab = 4096, 131072
    begin, end = split(vocab, world, rank, uneven=False)
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(0)
    full_student = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    full_teacher = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    local_student = full_student[:, begin:end].contiguous().requires_grad_()
    local_teacher = full_teacher[:, begin:end].contiguous()
    full_student.requires_grad_()
    records_1 = torch.empty(rows, 13, device="cuda")
    gathered_1 = torch.empty(world * rows, 13, device="cuda")
    records_2 = torch.empty(rows, 5, device="cuda")
    gathered_2 = torch.empty(world * rows, 5, device="cuda")
    one = timed(lambda: dist.all_gather_into_tensor(gathered_1, records_1, group=group))
    two = timed(
        lambda: (
            dist.all_gather_into_tensor(gathered_1, records_1, group=group),
            dist.all_gather_into_tensor(gathered_2, records_2, group=group),
        )
    )
    shapes = {"N": rows, "V": vocab, "V_local": end - begin}
    for kind in DISTILL_KINDS:

        def unsharded():
            full_student.grad = None
            xent.distill(full_student, full_teacher, kind=kind).backward()

        def sharded():
            local_student.grad = None
            xent.distill(local_student, local_teacher, kind=kind, process_group=group).backward()

        base = guarded(unsharded)
        if base is None:
            record(f"distill_{kind}", "xent", 1, {"N": rows, "V": vocab}, None, None, 0.0, records)
            continue
        record(
            f"distill_{kind}",
            "xent",
            1,
            {"N": rows, "V": vocab},
            base,
            base["median_ms"],
            0.0,
            records,
        )
        collective = two if kind in ("jsd", "tvd") else one
        record(
            f"distill_{kind}",
            "xent-sharded",
            world,
            shapes,
            guarded(sharded),
            base["median_ms"],
            collective["median_ms"],
            records,
        )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    device = torch.device("cuda", local_rank)

    failures = []
    correctness(rank, world, device, failures)
    ok = torch.tensor([len(failures)], device=device)
    dist.all_reduce(ok)
    print(f"rank {rank}: correctness {'PASS' if not failures else 'FAIL'}", flush=True)
    for line in failures[:30]:
        print(f"rank {rank}: {line}", flush=True)

    records = []

    def save():  # after every op, so a later failure keeps what was measured
        if rank == 0:
            with open(args.json, "w") as out:
                json.dump(
                    {"correctness_failures": int(ok.item()), "records": records}, out, indent=1
                )

    save()
    if not args.skip_timing:
        time_ce(rank, world, records)
        save()
        torch.cuda.empty_cache()
        time_linear_ce(rank, world, records)
        save()
        torch.cuda.empty_cache()
        time_distill(rank, world, records)
        save()
    if rank == 0:
        print(f"{'op':<18} {'impl':<30} {'P':>2} {'median ms':>10} {'ratio':>6} {'coll ms':>8}")
        for r in records:
            if "error" in r:
                print(f"{r['op']:<18} {r['impl']:<30} {r['world_size']:>2} {'failed':>10}")
                continue
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            print(
                f"{r['op']:<18} {r['impl']:<30} {r['world_size']:>2} "
                f"{r['time_median_ms']:>10.3f} {ratio:>6} {r['collective_ms']:>8.3f}"
            )
    dist.destroy_process_group()
    sys.exit(1 if ok.item() else 0)


if __name__ == "__main__":
    main()
