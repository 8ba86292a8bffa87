#!/usr/bin/env python3
"""Times PyTorch eager, torch.compile and other loss libraries on the shapes of xent-bench.

One process measures everything, so every ratio is taken against ceilings of the same run:
the copy bandwidth B (a >= 1 GiB device-to-device copy, bytes read + written over time) and, for
the linear ops, the GEMM floor F (torch.matmul time of h·Wᵀ, G·W and Gᵀ·h). Records follow the
schema of xent-bench's JSON (docs/performance.md "What a benchmark record holds"); linear rows also carry
products_tflops, F's flops (2·N·H·V a product) over the library's median time.

Implementations, each skipped with a note when not importable:
  eager       F.cross_entropy on logits upcast to fp32, as training code does
  compile     the same function through torch.compile
  liger       Liger-Kernel (liger_kernel)
  cce         Cut Cross-Entropy (cut_cross_entropy) with its default filter_eps ("high": gradient
              blocks under a probability threshold are skipped), linear_ce only
  cce_exact   Cut Cross-Entropy with filter_eps=None (exact gradients)
  quack       QuACK (quack-kernels)
  xent_torch  xent through its Python package and autograd (records of xent-bench, the C++
              kernels alone, are impl "xent")
  chunked     linear_distill with a top-k teacher in plain PyTorch a chunk of rows at a time,
              torch.utils.checkpoint around each (torch_losses.chunked_linear_distill_topk)
  xent_linear_ce  beside linear_distill with a top-k teacher: xent.linear_cross_entropy (mean) on
              the same h, W and budget; the other records carry ratio_to_linear_ce against it

Top-k teachers (--teacher-topk K --topk-mass MASS, docs/semantics.md §3.1): k ids and fp32
log-probabilities a row, the top-k of a teacher correlated with the student, drawn once outside
the timing. F then counts no teacher product; every loss is checked against the float64 loss of
the first inputs (loss_rel_err).

Modes: fwdbwd (forward + backward through autograd), fwd (forward without gradient), and for the
small-V rows of the seed benchmark also fwd_graph (the forward of a training step alone) and bwd
(its backward alone). Linear rows run on random and on peaked logits (--distribution): peaked
hidden states are h = noise + a·W[y], a set so the mean target probability is about 0.3.

Usage: compare_torch.py --op linear_ce --n 8192 --h 4096 --v 128256 [--json FILE [--append]]
       compare_torch.py --suite perf-ce|perf-ce-small|perf-distill|perf-linear|perf|topk
       compare_torch.py --suite linear-curve|linear-distill-curve   (memory against time)
       compare_torch.py --op linear_distill --n 8192 --h 4096 --v 128256 --teacher-topk 64,256
       --topk-mass tail,renormalize
       [--rounds R]: F and every library timed in R interleaved rounds (the GPU's clock drifts)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable

try:
    import torch
    from torch_losses import distill_topk_rows, eager_loss, library_loss
except ImportError:  # reported in main(), so --help works without torch
    torch = None

DISTILL_KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd")
IMPLS = (
    "eager",
    "compile",
    "chunked",
    "liger",
    "cce",
    "cce_exact",
    "quack",
    "xent_torch",
    "xent_linear_ce",
)
# Run only where they mean something: linear_distill with a top-k teacher.
LINEAR_TOPK_IMPLS = ("chunked", "xent_linear_ce")
TOPK_MASSES = ("renormalize", "tail", "ignore")
TOPK_IGNORE_KINDS = ("forward_kl", "soft_ce")  # the kinds docs/semantics.md §3.1 gives `ignore`
LINEAR_SHAPES = ((8192, 4096, 128256), (8192, 2304, 256000), (32768, 768, 128256))
# linear_ce's memory–time curve: xent at each workspace budget (MiB), the anchors once per shape.
CURVE_BUDGETS_MIB = (64, 128, 256, 512, 1024, 2048, 4096)
CURVE_ANCHORS = ("compile", "liger", "cce", "cce_exact", "quack")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def progress(message: str) -> None:
    print(f"[compare_torch] {message}", file=sys.stderr, flush=True)


def build_archs(key: str) -> list[str] | None:
    """xent.build_info()[key] (the cubins or PTX of the build measured), None without xent."""
    try:
        import xent
    except ImportError:
        return None
    return xent.build_info()[key]


def git_commit(repo: str = REPO) -> str:
    """The commit the measured code is, "<sha>-dirty" when tracked files differ from it (a record
    of uncommitted code must not pass for the commit's)."""
    # A copy of the tree without .git (a GPU machine gets the files only) names it through the
    # environment.
    if os.environ.get("XENT_COMMIT"):
        return os.environ["XENT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", repo, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
        commit = out.stdout.strip()
        if not commit:
            return "unknown"
        status = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return commit + ("-dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: str) -> str:
    """The name xent-bench gives the same device, so records of both tools group together."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    model = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} threads)"


# ----------------------------------------------------------------------------- cases


def curve_cases(shape: dict, anchors: tuple, label: str) -> list[dict]:
    """A memory–time plane's cases at one shape: the anchors once, xent's default budget, and
    xent at each of CURVE_BUDGETS_MIB."""
    cases = [dict(shape, impls=anchors, label=f"{label} anchors")]
    cases.append(dict(shape, impls=("xent_torch",), label=f"{label} xent default"))
    for mib in CURVE_BUDGETS_MIB:
        cases.append(
            dict(shape, budget_bytes=mib << 20, impls=("xent_torch",), label=f"{label} xent")
        )
    return cases


def suite_cases(name: str) -> list[dict]:
    """The docs/performance.md rows (same shapes as xent-bench --suite), each a dict of case fields."""
    cases = []
    if name in ("perf-ce", "perf"):
        for v in (32768, 131072, 262144):
            cases.append(dict(op="ce", n=16384, h=0, v=v, mode="fwdbwd", label="perf-ce"))
            cases.append(dict(op="ce", n=16384, h=0, v=v, mode="fwd", label="perf-ce no grad"))
            cases.append(
                dict(
                    op="ce",
                    n=16384,
                    h=0,
                    v=v,
                    mode="fwdbwd",
                    options="all",
                    label="perf-ce every option",
                )
            )
            cases.append(
                dict(
                    op="ce",
                    n=16384,
                    h=0,
                    v=v,
                    mode="fwdbwd",
                    reduction="none",
                    label="perf-ce reduction none",
                )
            )
            cases.append(
                dict(
                    op="ce",
                    n=16384,
                    h=0,
                    v=v,
                    mode="fwdbwd",
                    inplace=True,
                    impls=("xent_torch",),
                    label="perf-ce inplace_backward",
                )
            )
        cases.append(dict(op="ce", n=262144, h=0, v=4096, mode="fwdbwd", label="perf-ce small V"))
        cases.append(dict(op="ce", n=256, h=0, v=262144, mode="fwdbwd", label="perf-ce small N"))
        cases.append(dict(op="ce", n=128, h=0, v=131072, mode="fwdbwd", label="perf-ce small N"))
    if name in ("perf-ce-small", "perf"):
        # The seed benchmark's rows: forward, backward, full step, no-grad forward.
        for v in (1024, 4096, 8192, 32768):
            for mode in ("fwd_graph", "bwd", "fwdbwd", "fwd"):
                cases.append(
                    dict(op="ce", n=16384, h=0, v=v, mode=mode, label="perf-ce seed small V")
                )
    if name in ("perf-distill", "perf"):
        for kind in DISTILL_KINDS:
            for n, v in ((4096, 32768), (16384, 131072)):
                cases.append(
                    dict(
                        op="distill", n=n, h=0, v=v, mode="fwdbwd", kind=kind, label="perf-distill"
                    )
                )
    if name in ("perf-linear", "perf"):
        for distribution in ("random", "peaked"):
            for n, h, v in LINEAR_SHAPES:
                cases.append(
                    dict(
                        op="linear_ce",
                        n=n,
                        h=h,
                        v=v,
                        mode="fwdbwd",
                        distribution=distribution,
                        label="perf-linear",
                    )
                )
        for distribution in ("random", "peaked"):
            for n, h, v in LINEAR_SHAPES:
                cases.append(
                    dict(
                        op="linear_ce",
                        n=n,
                        h=h,
                        v=v,
                        mode="fwdbwd",
                        budget_bytes=64 << 20,
                        impls=("xent_torch",),
                        distribution=distribution,
                        label="perf-linear 64 MiB",
                    )
                )
        for n, h, v in LINEAR_SHAPES:
            for weight in ("fp32", "fp32-autocast"):
                cases.append(
                    dict(
                        op="linear_ce",
                        n=n,
                        h=h,
                        v=v,
                        mode="fwdbwd",
                        weight=weight,
                        impls=("compile", "xent_torch"),
                        label=f"perf-linear {weight} weight",
                    )
                )
        # linear_distill (forward KL, teacher hidden states and head): at the default budget
        # (the fp32 ∂W accumulator fits) and at 64 MiB; F counts its four products.
        for n, h, v in LINEAR_SHAPES:
            cases.append(
                dict(
                    op="linear_distill",
                    n=n,
                    h=h,
                    v=v,
                    mode="fwdbwd",
                    impls=("compile", "xent_torch"),
                    label="perf-linear distill",
                )
            )
            cases.append(
                dict(
                    op="linear_distill",
                    n=n,
                    h=h,
                    v=v,
                    mode="fwdbwd",
                    budget_bytes=64 << 20,
                    impls=("xent_torch",),
                    label="perf-linear distill 64 MiB",
                )
            )
    if name == "linear-curve":
        # Time / F against peak extra memory: xent's budgets and default, each anchor once (their
        # memory is theirs to choose), at the docs/performance.md shapes on both distributions.
        for distribution in ("random", "peaked"):
            for n, h, v in LINEAR_SHAPES:
                shape = dict(op="linear_ce", n=n, h=h, v=v, mode="fwdbwd")
                shape["distribution"] = distribution
                cases += curve_cases(shape, CURVE_ANCHORS, "linear-curve")
    if name == "linear-distill-curve":
        # linear_distill (forward KL, the teacher as hidden states and head) on the same plane,
        # against F of its four products: xent at each budget and its default, torch.compile on
        # materialised logits once per shape (no other library fuses this loss with both heads).
        for n, h, v in LINEAR_SHAPES:
            shape = dict(op="linear_distill", n=n, h=h, v=v, mode="fwdbwd", kind="forward_kl")
            cases += curve_cases(shape, ("compile",), "linear-distill-curve")
    if name == "topk":
        # Issue 51's top-k teacher rows: distill on logits as a fraction of B (xent and its eager
        # anchor), linear_distill beside linear_ce, the anchors on materialised logits and the
        # chunked one; few repeats, the compiles dominate.
        for n, v in ((16384, 32768), (4096, 131072), (2048, 262144)):
            for mass in ("renormalize", "tail"):
                cases.append(
                    dict(
                        op="distill",
                        n=n,
                        h=0,
                        v=v,
                        mode="fwdbwd",
                        teacher_topk=64,
                        topk_mass=mass,
                        impls=("eager", "xent_torch"),
                        repeat=20,
                        label="topk distill",
                    )
                )
        for k in (64, 256):
            for mass in ("tail", "renormalize"):
                cases.append(
                    dict(
                        op="linear_distill",
                        n=8192,
                        h=4096,
                        v=128256,
                        mode="fwdbwd",
                        teacher_topk=k,
                        topk_mass=mass,
                        impls=("eager", "compile", "chunked", "xent_torch", "xent_linear_ce"),
                        repeat=10,
                        label="topk linear",
                    )
                )
    for case in cases:
        case.setdefault("kind", "forward_kl")
        case.setdefault("dtype", "bf16")
    return cases


# ----------------------------------------------------------------------------- timing


class Timer:
    """CUDA events on the current stream (or wall clock on the CPU); median, p20, p80."""

    def __init__(self, device: str, warmup: int, repeat: int):
        self.device, self.warmup, self.repeat = device, warmup, repeat

    def run(
        self, fn: Callable[[int], None], prepare: Callable[[int], None] | None = None
    ) -> list[float]:
        """Times fn(i); prepare(i), when given, runs before each call, outside the timing."""
        for i in range(self.warmup):
            if prepare:
                prepare(i)
            fn(i)
        times = []
        if self.device == "cuda":
            torch.cuda.synchronize()
            pairs = []
            for i in range(self.repeat):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                if prepare:
                    prepare(i)
                start.record()
                fn(i)
                stop.record()
                pairs.append((start, stop))
            torch.cuda.synchronize()
            times = [start.elapsed_time(stop) for start, stop in pairs]
        else:
            for i in range(self.repeat):
                if prepare:
                    prepare(i)
                begin = time.perf_counter()
                fn(i)
                times.append((time.perf_counter() - begin) * 1e3)
        return times


def selected_suite_cases(args) -> list[dict]:
    """The cases of args.suite that --labels (label prefixes; one ending in "$" names a whole
    label) and --distribution (of the linear_ce cases; the others stay) keep."""
    cases = suite_cases(args.suite)
    if args.labels:
        wanted = args.labels.split(",")
        prefixes = tuple(label for label in wanted if not label.endswith("$"))
        whole = {label[:-1] for label in wanted if label.endswith("$")}
        cases = [
            case
            for case in cases
            if case["label"] in whole or (prefixes and case["label"].startswith(prefixes))
        ]
    if args.distribution:
        cases = [
            case
            for case in cases
            if case["op"] != "linear_ce" or case.get("distribution", "random") == args.distribution
        ]
    return cases


def summarize(times: list[float]) -> dict:
    ordered = sorted(times)

    def quantile(q: float) -> float:
        position = q * (len(ordered) - 1)
        below = int(position)
        above = min(below + 1, len(ordered) - 1)
        fraction = position - below
        return ordered[below] * (1 - fraction) + ordered[above] * fraction

    return {
        "median": quantile(0.5),
        "p20": quantile(0.2),
        "p80": quantile(0.8),
        "samples": len(ordered),
    }


def copy_bandwidth(device: str) -> float | None:
    """B in bytes/s: a 2 GiB (at least 1 GiB) device-to-device copy, read + written."""
    if device != "cuda":
        return None
    for gib in (2, 1):
        try:
            source = torch.empty(gib << 30, dtype=torch.uint8, device="cuda").random_()
            destination = torch.empty_like(source)
        except torch.cuda.OutOfMemoryError:
            continue
        times = Timer("cuda", 3, 20).run(lambda i: destination.copy_(source))
        median = summarize(times)["median"]
        del source, destination
        torch.cuda.empty_cache()
        return 2.0 * (gib << 30) / (median / 1e3)
    return None


def gemm_floor_flops(case: dict) -> int | None:
    """Flops of the products F times (gemm_floor_samples): 2·N·H·V each; None for other ops. A
    top-k teacher brings no product of its own: F is then linear_ce's."""
    if case["op"] not in ("linear_ce", "linear_distill"):
        return None
    teacher = case["op"] == "linear_distill" and not case.get("teacher_topk")
    products = 1 + teacher + 2 * (case["mode"] == "fwdbwd")
    return 2 * case["n"] * case["h"] * case["v"] * products


def gemm_floor_samples(case: dict, dtype, device: str, timer: Timer) -> list[float]:
    """Samples of F in ms: torch.matmul time of the products a fused linear op must do at this
    shape (none for other ops and on the CPU). The operands live only while they are timed."""
    if device != "cuda" or case["op"] not in ("linear_ce", "linear_distill"):
        return []
    n, h, v = case["n"], case["h"], case["v"]
    hidden = torch.randn(n, h, device=device, dtype=dtype)
    weight = torch.randn(v, h, device=device, dtype=dtype) / math.sqrt(h)
    grad = torch.randn(n, v, device=device, dtype=dtype)
    backward = case["mode"] == "fwdbwd"
    teacher = case["op"] == "linear_distill" and not case.get("teacher_topk")

    def products(i):
        torch.matmul(hidden, weight.t())
        if teacher:
            torch.matmul(hidden, weight.t())
        if backward:
            torch.matmul(grad, weight)
            torch.matmul(grad.t(), hidden)

    samples = timer.run(products)
    del hidden, weight, grad
    torch.cuda.empty_cache()
    return samples


# ----------------------------------------------------------------------------- inputs


def make_inputs(case: dict, dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Random inputs like xent-bench's: logits uniform in [-8, 8), weights scaled by 1/sqrt(H).
    Peaked linear rows add a·W[y] to the hidden states (case["peak_scale"] = a)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    n, h, v = case["n"], case["h"], case["v"]
    grad = case["mode"] != "fwd"

    def uniform(shape, bound):
        values = torch.rand(shape, device=device, dtype=torch.float32, generator=generator)
        return ((values * 2 - 1) * bound).to(dtype).requires_grad_(False)

    x = {"target": torch.randint(0, v, (n,), device=device, generator=generator)}
    op = case["op"]
    topk = case.get("teacher_topk")
    if op in ("ce", "distill"):
        x["logits"] = uniform((n, v), 8.0).requires_grad_(grad)
        if op == "distill" and not topk:
            x["teacher"] = uniform((n, v), 8.0)
    else:
        bound = 8.0 * math.sqrt(3.0 / h)
        hidden = uniform((n, h), 1.0)
        weight = uniform((v, h), bound)
        if case.get("distribution") == "peaked":
            hidden = (hidden.float() + case["peak_scale"] * weight[x["target"]].float()).to(dtype)
        if case.get("weight", "").startswith("fp32"):
            weight = weight.float()  # an fp32 (master) weight beside 16-bit hidden states
        x["hidden"] = hidden.requires_grad_(grad)
        x["weight"] = weight.requires_grad_(grad)
        if op == "linear_distill" and not topk:
            x["teacher_hidden"] = uniform((n, h), 1.0)
            x["teacher_weight"] = uniform((v, h), bound)
    if topk:
        x["topk_ids"], x["topk_logprobs"] = topk_teacher(x, topk, generator)
    return x


def topk_teacher(x: dict, k: int, generator, rows: int = 1024):
    """The top-k ids and fp32 log-probabilities of a teacher correlated with the student: its
    logits plus Gaussian noise of scale 0.5, a chunk of rows at a time (no N x V fp32 at once)."""
    ids, logprobs = [], []
    with torch.no_grad():
        n = x["logits"].shape[0] if "logits" in x else x["hidden"].shape[0]
        for start in range(0, n, rows):
            if "logits" in x:
                student = x["logits"][start : start + rows].float()
            else:
                hidden = x["hidden"][start : start + rows]
                student = (hidden @ x["weight"].to(hidden.dtype).t()).float()
            noise = torch.randn(
                student.shape, device=student.device, dtype=student.dtype, generator=generator
            )
            values, chosen = (student + 0.5 * noise).log_softmax(-1).topk(k, -1)
            logprobs.append(values)
            ids.append(chosen)
    return torch.cat(ids), torch.cat(logprobs)


def topk_reference_loss(case: dict, x: dict, rows: int = 1024) -> float:
    """The float64 loss (mean over rows) of a top-k case's first inputs, what every
    implementation's first loss is compared with."""
    total = 0.0
    with torch.no_grad():
        n = x["topk_ids"].shape[0]
        weight = x["weight"].double() if "weight" in x else None
        for start in range(0, n, rows):
            part = slice(start, start + rows)
            if weight is None:
                student = x["logits"][part].double()
            else:
                student = x["hidden"][part].double() @ weight.t()
            total += (
                distill_topk_rows(
                    student,
                    x["topk_ids"][part],
                    x["topk_logprobs"][part],
                    case.get("kind", "forward_kl"),
                    case["topk_mass"],
                )
                .sum()
                .item()
            )
    return total / n


def mean_target_probability(case: dict, dtype, device: str, scale: float, rows: int = 256):
    """Mean p(target) of the first rows of a peaked linear case at peak scale `scale`."""
    probe = dict(case, n=min(rows, case["n"]), peak_scale=scale, mode="fwd")
    x = make_inputs(probe, dtype, device, seed=1)
    with torch.no_grad():
        logits = (x["hidden"] @ x["weight"].to(dtype).t()).float()
        return logits.log_softmax(-1).gather(1, x["target"][:, None]).exp().mean().item()


def calibrate_peak(case: dict, dtype, device: str, goal: float = 0.3) -> float:
    """The peak scale a (h = noise + a·W[y]) whose mean target probability is about `goal`."""
    low, high = 0.0, 1.0
    while mean_target_probability(case, dtype, device, high) < goal and high < 64:
        low, high = high, high * 2
    for _ in range(20):
        middle = (low + high) / 2
        if mean_target_probability(case, dtype, device, middle) < goal:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def linear_reference_grads(x: dict, chunk: int = 2048):
    """∂h and ∂W of the mean cross-entropy of h·Wᵀ in float64 (row chunks, so the N x V
    logits are never held at once): what each implementation's gradient is compared with."""
    hidden = x["hidden"].detach().double()
    weight = x["weight"].detach().double()
    target = x["target"]
    valid = max(int((target != -100).sum().item()), 1)
    grad_h = torch.empty_like(hidden)
    grad_w = torch.zeros_like(weight)
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        probs = (h @ weight.t()).softmax(-1)
        rows = torch.arange(h.shape[0], device=h.device)
        probs[rows, target[start : start + chunk]] -= 1
        probs /= valid
        grad_h[start : start + chunk] = probs @ weight
        grad_w += probs.t() @ h
        del probs
    return grad_h, grad_w


def leaves(x: dict) -> list:
    return [t for t in x.values() if t.requires_grad]


def tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def peak_extra_bytes(step: Callable[[int], object], leaves: list) -> int:
    """Peak CUDA memory of one step(0) beyond what was allocated before it and the gradients it
    leaves in `leaves` (beyond the inputs and their gradients, as docs/performance.md counts it)."""
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(0)
    torch.cuda.synchronize()
    # A gradient written over its input (inplace_backward) adds no bytes of its own.
    grads = sum(
        tensor_bytes(leaf.grad)
        for leaf in leaves
        if leaf.grad is not None and leaf.grad.data_ptr() != leaf.data_ptr()
    )
    return max(0, torch.cuda.max_memory_allocated() - before - grads)


# ----------------------------------------------------------------------------- measuring

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _relative_error(out, reference) -> float:
    out = out.detach().double()
    return ((out - reference).norm() / reference.norm().clamp_min(1e-300)).item()


def case_title(case: dict) -> str:
    op, mode = case["op"], case["mode"]
    shape = f"{case['n']}x{str(case['h']) + 'x' if case['h'] else ''}{case['v']}"
    notes = [
        case[k]
        for k in ("options", "reduction", "distribution", "weight", "weight_grad_accumulation")
        if case.get(k) not in (None, "plain", "mean", "random", "fp32")
    ]
    if case.get("inplace"):
        notes.append("inplace")
    if case.get("budget_bytes"):
        notes.append(f"{case['budget_bytes'] >> 20} MiB")
    if case.get("teacher_topk"):
        notes.append(f"top-{case['teacher_topk']} {case['topk_mass']}")
    kind = ":" + case["kind"] if "distill" in op else ""
    return f"{op}{kind} {shape} {case['dtype']} {mode}" + (
        f" [{', '.join(notes)}]" if notes else ""
    )


def measure_case(
    case: dict, impls: list[str], args, bandwidth: float | None, commit: str
) -> list[dict]:
    device = args.device
    dtype = getattr(torch, DTYPES[case["dtype"]])
    op, kind, mode = case["op"], case.get("kind", "forward_kl"), case["mode"]
    reduction = case.get("reduction", "mean")
    impls = [impl for impl in impls if impl in case.get("impls", impls)]
    linear_topk = op == "linear_distill" and bool(case.get("teacher_topk"))
    if not linear_topk:
        impls = [impl for impl in impls if impl not in LINEAR_TOPK_IMPLS]
    title = case_title(case)
    if case.get("distribution") == "peaked" and device == "cuda":
        case["peak_scale"] = calibrate_peak(case, dtype, device)
        case["mean_target_prob"] = mean_target_probability(case, dtype, device, case["peak_scale"])
        progress(
            f"{title}: peak scale {case['peak_scale']:.4f}, mean target probability "
            f"{case['mean_target_prob']:.3f}"
        )
    first = make_inputs(case, dtype, device, seed=1)
    input_bytes = sum(tensor_bytes(t) for t in first.values())
    copies = 1
    if device == "cuda":
        cache = torch.cuda.get_device_properties(0).L2_cache_size
        if input_bytes < cache:  # rotate among copies so no repetition finds its inputs in L2
            copies = min(16, 2 * cache // max(input_bytes, 1) + 1)
    if case.get("inplace"):
        copies = 1  # every step refreshes the logits it overwrites (see prepare below)
    inputs = [first] + [make_inputs(case, dtype, device, seed=1 + c) for c in range(1, copies)]
    pristine = first["logits"].detach().clone() if case.get("inplace") else None
    linear_reference = None
    if (
        args.errors
        and op == "linear_ce"
        and mode == "fwdbwd"
        and reduction == "mean"
        and not case.get("options")
    ):
        progress(f"{title}: float64 reference gradients ...")
        linear_reference = linear_reference_grads(first)
    element = torch.finfo(dtype).bits // 8
    base = {
        "op": op,
        "mode": mode,
        "options": case.get("options", "plain"),
        "reduction": reduction,
        "kind": kind if "distill" in op else None,
        "dtype": str(dtype).replace("torch.", ""),
        "n": case["n"],
        "h": case["h"],
        "v": case["v"],
        "budget_bytes": case.get("budget_bytes"),
        "inplace_backward": bool(case.get("inplace")),
        "distribution": case.get("distribution", "random") if "linear" in op else None,
        "peak_scale": case.get("peak_scale"),
        "mean_target_prob": case.get("mean_target_prob"),
        "weight_dtype": "float32" if case.get("weight", "").startswith("fp32") else None,
        "autocast": case.get("weight") == "fp32-autocast",
        "weight_grad_accumulation": case.get("weight_grad_accumulation"),
        "teacher_topk": case.get("teacher_topk"),
        "topk_mass": case.get("topk_mass"),
        "label": case.get("label", ""),
        "device": device_name(device),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "gemm_floor_ms": None,
        "commit": commit,
        "cuda_archs": build_archs("cuda_archs"),
        "cuda_ptx": build_archs("cuda_ptx"),
        "paths": "portable" if args.portable_paths else "default",
    }
    if linear_topk:
        base.update(ratio_to_linear_ce=None, extra_bytes_to_linear_ce=None)
    reference_loss = None
    if case.get("teacher_topk"):
        progress(f"{title}: float64 reference loss ...")
        reference_loss = topk_reference_loss(case, first)
    records = []
    runners = []  # (record, (timed function, prepare), its pending state) of each library that ran

    def clear(pending):
        pending.clear()
        for x in inputs:
            for leaf in leaves(x):
                leaf.grad = None
        if device == "cuda":
            torch.cuda.empty_cache()

    for impl in impls:
        record = dict(
            base,
            impl=impl,
            time_ms=None,
            ratio=None,
            ratio_kind=None,
            min_bytes=None,
            peak_extra_bytes=None,
            workspace_bytes=None,
            loss_rel_err=None,
            grad_rel_err=None,
            grad_hidden_rel_err=None,
            grad_weight_rel_err=None,
            error=None,
        )
        if impl in ("eager", "compile"):
            loss_fn = eager_loss(case)
            if impl == "compile":
                # A fresh compile per case specialises on its shape, as a training run with
                # fixed shapes gets; otherwise dynamo would turn to dynamic shapes.
                torch._dynamo.reset()
                loss_fn = torch.compile(loss_fn)
        else:
            loss_fn = library_loss(impl, case)
        if isinstance(loss_fn, str):
            record["error"] = loss_fn
            progress(f"{impl:10s} {title}: skipped: {loss_fn}")
            records.append(record)
            continue
        if case.get("weight") == "fp32-autocast":
            plain_fn = loss_fn

            def loss_fn(x, plain_fn=plain_fn):
                with torch.autocast("cuda", dtype=dtype):
                    return plain_fn(x)

        upstream = {}

        def refresh(i):
            # inplace_backward overwrites the logits: each step starts from fresh ones, outside
            # the timing.
            if pristine is not None:
                inputs[0]["logits"] = pristine.clone().requires_grad_()

        # Every closure binds this library's own state as default arguments: the rounds below
        # call them after the loop has moved on to the other libraries.
        def forward(i, loss_fn=loss_fn, upstream=upstream):
            x = inputs[i % copies]
            for leaf in leaves(x):
                leaf.grad = None
            loss = loss_fn(x)
            if reduction == "none" and mode != "fwd":
                loss = (loss * upstream.setdefault("g", torch.rand_like(loss))).sum()
            return loss

        pending = {}

        def step(i, forward=forward):
            if mode == "fwd":
                with torch.no_grad():
                    return forward(i)
            loss = forward(i)
            if mode != "fwd_graph":
                loss.backward()
            return loss

        def prepare_backward(i, forward=forward, pending=pending):
            refresh(i)
            pending["loss"] = forward(i)

        def backward_only(i, pending=pending):
            pending.pop("loss").backward()

        try:
            progress(f"{impl:10s} {title}: first call ...")
            refresh(0)
            loss = step(0).detach().float().item()  # compiles, autotunes, allocates
            if impl != "xent_linear_ce":  # another loss: its time is the reference, not its value
                if reference_loss is None:
                    reference_loss = loss
                relative = abs(loss - reference_loss) / max(abs(reference_loss), 1e-30)
                record["loss_rel_err"] = relative
            if linear_reference is not None:
                grad_h, grad_w = inputs[0]["hidden"].grad, inputs[0]["weight"].grad
                if grad_h is not None and grad_w is not None:
                    record["grad_hidden_rel_err"] = _relative_error(grad_h, linear_reference[0])
                    record["grad_weight_rel_err"] = _relative_error(grad_w, linear_reference[1])
            if device == "cuda":
                refresh(0)
                record["peak_extra_bytes"] = peak_extra_bytes(step, leaves(inputs[0]))
            if mode == "bwd":
                timed = (backward_only, prepare_backward)
            else:
                timed = (step, refresh if pristine is not None else None)
            runners.append((record, timed, pending))
        except Exception as error:  # one failing library must not stop the comparison
            record["error"] = f"{error.__class__.__name__}: {error}"[:500]
            progress(f"{impl:10s} {title}: error: {record['error']}")
        finally:
            clear(pending)
        records.append(record)

    # Timing, in rounds: each round times the floor F and then every library in turn
    # (args.repeat / rounds steps each, after warm-ups), so that the GPU's drift under sustained
    # load (its clock falls and recovers over tens of calls, docs/archive/perf-notes.md decision 79)
    # reaches F and every library alike.
    rounds = max(1, args.rounds)
    repeat = args.repeat if args.repeat_given else case.get("repeat", args.repeat)
    per_round = max(1, -(-repeat // rounds))
    samples = {id(record): [] for record, _, _ in runners}
    floor_samples = []
    for round_index in range(rounds):
        warmup = args.warmup if round_index == 0 else min(args.warmup, 2)
        floor_samples += gemm_floor_samples(case, dtype, device, Timer(device, warmup, per_round))
        for record, (fn, prepare), pending in runners:
            impl = record["impl"]
            progress(
                f"{impl:10s} {title}: {warmup} warm-up + {per_round} timed"
                + (f" (round {round_index + 1} of {rounds})" if rounds > 1 else "")
                + " ..."
            )
            try:
                samples[id(record)] += Timer(device, warmup, per_round).run(fn, prepare=prepare)
            except Exception as error:
                record["error"] = f"{error.__class__.__name__}: {error}"[:500]
                progress(f"{impl:10s} {title}: error: {record['error']}")
            finally:
                clear(pending)
    floor = summarize(floor_samples)["median"] if floor_samples else None
    for record in records:
        record["gemm_floor_ms"] = floor
    for record, _, _ in runners:
        impl = record["impl"]
        if record["error"]:
            continue
        times = summarize(samples[id(record)])
        record["time_ms"] = times
        if op in ("linear_ce", "linear_distill"):
            record["ratio_kind"] = "gemm"
            if floor:
                record["ratio"] = times["median"] / floor
            # The step in the products' own terms: F's flops over the library's time.
            record["products_tflops"] = gemm_floor_flops(case) / (times["median"] / 1e3) / 1e12
        else:
            # A top-k teacher's few columns are not counted: one read of the student (and one
            # write of its gradient).
            teacher = op == "distill" and not case.get("teacher_topk")
            tensors = (2 if teacher else 1) + (1 if mode == "fwdbwd" else 0)
            if mode == "bwd":
                tensors = 1  # the fused forms write the gradient in the forward
            record["ratio_kind"] = "bandwidth"
            record["min_bytes"] = tensors * case["n"] * case["v"] * element
            if bandwidth:
                record["ratio"] = record["min_bytes"] / (times["median"] / 1e3) / bandwidth
        progress(
            f"{impl:10s} {title}: median {times['median']:.3f} ms"
            + (f", ratio {record['ratio']:.3f}" if record["ratio"] else "")
            + (
                f", extra {record['peak_extra_bytes'] / 2**20:.1f} MiB"
                if record["peak_extra_bytes"] is not None
                else ""
            )
            + (
                f", dW err {record['grad_weight_rel_err']:.4f}, dh err "
                f"{record['grad_hidden_rel_err']:.4f}"
                if record["grad_weight_rel_err"] is not None
                else ""
            )
        )
    linear_ce = next(
        (r for r in records if r["impl"] == "xent_linear_ce" and r["time_ms"] is not None), None
    )
    if linear_ce is not None:  # a fused top-k distill aims at linear_ce's time and memory
        for record in records:
            if record["time_ms"] is not None:
                record["ratio_to_linear_ce"] = (
                    record["time_ms"]["median"] / linear_ce["time_ms"]["median"]
                )
                if record["peak_extra_bytes"] is not None and linear_ce["peak_extra_bytes"]:
                    record["extra_bytes_to_linear_ce"] = (
                        record["peak_extra_bytes"] / linear_ce["peak_extra_bytes"]
                    )
    return records


def print_table(records: list[dict]) -> None:
    print(
        f"{'case':72s} {'impl':10s} {'median ms':>10s} {'p20 ms':>10s}"
        f" {'p80 ms':>10s} {'extra MiB':>10s} {'ratio':>8s} {'TFLOP/s':>8s} {'loss diff':>10s}"
        f" {'x lin_ce':>8s}"
    )
    for r in records:
        case = dict(
            r,
            options=r["options"],
            inplace=r.get("inplace_backward"),
            weight=("fp32-autocast" if r.get("autocast") else "fp32")
            if r.get("weight_dtype")
            else None,
        )
        head = f"{case_title(case)[:72]:72s} {r['impl']:10s}"
        if r["error"]:
            print(f"{head} error: {r['error']}")
            continue
        t = r["time_ms"]
        extra = "-" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.1f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        diff = "-" if r["loss_rel_err"] is None else f"{r['loss_rel_err']:.2e}"
        tflops = "-" if r.get("products_tflops") is None else f"{r['products_tflops']:.0f}"
        to_ce = "-" if r.get("ratio_to_linear_ce") is None else f"{r['ratio_to_linear_ce']:.3f}"
        print(
            f"{head} {t['median']:10.3f} {t['p20']:10.3f} {t['p80']:10.3f} {extra:>10s}"
            f" {ratio:>8s} {tflops:>8s} {diff:>10s} {to_ce:>8s}"
        )


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--op", choices=("ce", "linear_ce", "distill", "linear_distill"), default="linear_ce"
    )
    parser.add_argument("--n", type=int)
    parser.add_argument("--h", type=int, default=0)
    parser.add_argument("--v", type=int)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--mode", choices=("fwd", "fwdbwd", "fwd_graph", "bwd"), default="fwdbwd")
    parser.add_argument("--kind", choices=DISTILL_KINDS, default="forward_kl")
    parser.add_argument("--device", choices=("cuda", "cpu"))
    parser.add_argument(
        "--suite",
        choices=(
            "perf-ce",
            "perf-ce-small",
            "perf-distill",
            "perf-linear",
            "perf",
            "linear-curve",
            "linear-distill-curve",
            "topk",
        ),
        help="a docs/performance.md suite; linear-curve: linear_ce at each workspace budget "
        "beside the anchors; linear-distill-curve: the same for linear_distill; topk: distill and "
        "linear_distill with a top-k teacher (none of the three part of perf)",
    )
    parser.add_argument(
        "--teacher-topk",
        help="distill, linear_distill: a teacher given as its top-k ids and log-probabilities, "
        "k ids a row (a comma list of k: one case each)",
    )
    parser.add_argument(
        "--topk-mass",
        help="with --teacher-topk: what becomes of the teacher's mass outside the ids, a comma "
        f"list of {', '.join(TOPK_MASSES)} (one case each; default renormalize)",
    )
    parser.add_argument(
        "--budget-mib",
        help="workspace budget of xent's fused linear ops in MiB, or a comma list of budgets "
        "(one case each, the anchors in the first only; default: the package's device-aware "
        "default)",
    )
    parser.add_argument(
        "--weight-grad-accumulation",
        help="linear_ce: xent's weight_grad_accumulation, or a comma list of 'fp32', "
        "'weight_dtype' (one case each per budget, the anchors in the first only)",
    )
    parser.add_argument(
        "--distribution",
        choices=("random", "peaked"),
        help="logits of a linear case: random (the default), or peaked (mean "
        "target probability about 0.3); with --suite, only the suite's "
        "linear_ce cases of that distribution run",
    )
    parser.add_argument(
        "--weight",
        choices=("fp32", "fp32-autocast"),
        help="linear_ce: an fp32 (master) weight beside the 16-bit hidden states, "
        "plain or under autocast to --dtype (default: the weight in --dtype)",
    )
    parser.add_argument(
        "--errors", action="store_true", help="linear_ce: gradient errors against float64 (slow)"
    )
    parser.add_argument(
        "--labels",
        help="comma list: run only suite cases whose label "
        "starts with one of these (or is one, written with a "
        "trailing $: 'perf-linear$')",
    )
    parser.add_argument(
        "--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS)
    )
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the libraries of a case in this many interleaved rounds of "
        "repeat / rounds steps each (the GPU's clock drifts under sustained "
        "load; default 1: each library's steps in one stretch)",
    )
    parser.add_argument(
        "--portable-paths",
        action="store_true",
        help="run xent's CUDA ops on their portable paths (those of non-Hopper GPUs) on this "
        "GPU, through the core's test hook; records say so in 'paths'",
    )
    parser.add_argument("--json", help="write the records as a JSON array to this file")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add to the records already in --json instead of replacing them",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        help="seconds after which no further case is started (default: none, "
        "800 for the default suite run)",
    )
    args = parser.parse_args(argv)
    impls = [impl for impl in args.impls.split(",") if impl]
    for impl in impls:
        if impl not in IMPLS:
            parser.error(f"--impls: got '{impl}'; expected a comma list of {', '.join(IMPLS)}")
    args.impls = impls
    args.default_run = args.suite is None and args.n is None and args.v is None
    if args.suite is None and not args.default_run:
        if args.n is None or args.v is None:
            parser.error("--n and --v go together (or give neither for the default run)")
        if args.op in ("linear_ce", "linear_distill") and args.h <= 0:
            parser.error(f"--h is required for --op {args.op}")
        if min(args.n, args.v) <= 0:
            parser.error("--n and --v must be positive")
    if args.budget_mib is not None:
        try:
            args.budget_mib = [int(mib) for mib in args.budget_mib.split(",")]
        except ValueError:
            args.budget_mib = [0]
        if min(args.budget_mib) <= 0 or args.suite is not None:
            parser.error(
                "--budget-mib: positive numbers of MiB (a comma list), for a single shape "
                "(--n, --v)"
            )
    if args.weight_grad_accumulation is not None:
        args.weight_grad_accumulation = args.weight_grad_accumulation.split(",")
        if args.suite is not None or args.op != "linear_ce":
            parser.error("--weight-grad-accumulation: for a single linear_ce shape (--n, --v)")
        for value in args.weight_grad_accumulation:
            if value not in ("fp32", "weight_dtype"):
                parser.error(
                    f"--weight-grad-accumulation: got '{value}'; expected a comma list of "
                    "fp32, weight_dtype"
                )
    if args.weight is not None and args.suite is not None:
        parser.error("--weight: for a single shape (--n, --v); the suites set their own weights")
    args.repeat_given = args.repeat is not None
    check_topk_args(parser, args)
    return args


def check_topk_args(parser, args) -> None:
    """--teacher-topk and --topk-mass as lists (k, masses); errors name the flag at fault."""
    if args.teacher_topk is None:
        if args.topk_mass is not None:
            parser.error("--topk-mass: only with --teacher-topk")
        return
    if args.suite is not None or args.default_run:
        parser.error("--teacher-topk: for a single shape (--n, --v); --suite topk has its own")
    if args.op not in ("distill", "linear_distill"):
        parser.error(f"--teacher-topk: for --op distill or linear_distill, not {args.op}")
    try:
        args.teacher_topk = [int(k) for k in args.teacher_topk.split(",")]
    except ValueError:
        parser.error(f"--teacher-topk: got '{args.teacher_topk}'; expected a comma list of k")
    for k in args.teacher_topk:
        if not 0 < k <= args.v:
            parser.error(f"--teacher-topk: got k = {k}; expected 1 <= k <= V = {args.v}")
    args.topk_mass = (args.topk_mass or "renormalize").split(",")
    for mass in args.topk_mass:
        if mass not in TOPK_MASSES:
            parser.error(f"--topk-mass: got '{mass}'; expected a comma list of {TOPK_MASSES}")
        if mass == "ignore" and args.kind not in TOPK_IGNORE_KINDS:
            parser.error(
                f"--topk-mass: ignore with --kind {args.kind}; ignore takes "
                f"{' or '.join(TOPK_IGNORE_KINDS)} (docs/semantics.md §3.1)"
            )
    if args.mode in ("fwd_graph", "bwd"):
        parser.error("--teacher-topk: with --mode fwdbwd or fwd")


def single_shape_cases(args) -> list[dict]:
    """The cases of a run given --n, --v (and --h): one per --budget-mib and
    --weight-grad-accumulation value, the anchors (whose memory is their own) in the first only;
    all that for each --teacher-topk k and --topk-mass."""
    shape = dict(
        op=args.op,
        n=args.n,
        h=args.h if "linear" in args.op else 0,
        v=args.v,
        dtype=args.dtype,
        mode=args.mode,
        kind=args.kind,
        label="",
        distribution=args.distribution or "random",
    )
    if args.weight is not None:
        shape["weight"] = args.weight
    cases = []
    teachers = [
        dict(teacher_topk=k, topk_mass=mass)
        for k in args.teacher_topk or []
        for mass in args.topk_mass
    ]
    for teacher in teachers or [{}]:
        first = True
        for mib in args.budget_mib or [None]:
            for accumulation in args.weight_grad_accumulation or [None]:
                case = dict(shape, **teacher)
                if mib is not None:
                    case["budget_bytes"] = mib << 20
                if accumulation is not None:
                    case["weight_grad_accumulation"] = accumulation
                if not first:  # xent alone (and linear_ce's reference at its budget)
                    case["impls"] = ("xent_torch", "xent_linear_ce") if teacher else ("xent_torch",)
                first = False
                cases.append(case)
    return cases


def main(argv=None) -> int:
    args = parse_args(argv)
    if torch is None:
        print("compare_torch.py: PyTorch is not installed (pip install torch)", file=sys.stderr)
        return 1
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("compare_torch.py: --device cuda: no CUDA GPU is visible", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    if args.portable_paths:
        if (
            not cuda
            or build_archs("cuda_archs") is None
            or not hasattr(torch.ops.xent, "_force_portable_paths")
        ):
            print("compare_torch.py: --portable-paths needs xent's CUDA ops", file=sys.stderr)
            return 2
        torch.ops.xent._force_portable_paths(True)
        progress("xent: the portable paths forced (as on a non-Hopper GPU)")
    args.repeat = args.repeat or (50 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products stay fp32, as in xent
    if args.default_run:
        # No shape given: the docs/performance.md rows on a GPU, xent-bench's default case on the CPU.
        if cuda:
            args.suite = "perf"
            if args.time_limit is None:
                args.time_limit = 800.0
        else:
            args.op, args.n, args.h, args.v, args.dtype = "linear_ce", 1024, 256, 32000, "fp32"
    if args.suite == "topk" and args.time_limit is None:
        args.time_limit = 330.0  # about 6 minutes on an H200 with the last case
    cases = selected_suite_cases(args) if args.suite else single_shape_cases(args)
    commit = git_commit()
    progress(f"device: {device_name(args.device)}, torch {torch.__version__}")
    bandwidth = copy_bandwidth(args.device)
    if bandwidth:
        progress(f"copy bandwidth B = {bandwidth / 1e9:.1f} GB/s")
    existing = []
    if args.json and args.append and os.path.exists(args.json):
        with open(args.json) as f:
            existing = json.load(f)
    started = time.monotonic()
    records = []
    for index, case in enumerate(cases):
        if args.time_limit is not None and time.monotonic() - started > args.time_limit:
            progress(
                f"time limit of {args.time_limit:.0f} s reached: {len(cases) - index} cases not run"
            )
            break
        records.extend(measure_case(case, args.impls, args, bandwidth, commit))
        if args.json:  # after every case, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(existing + records, f, indent=1)
    print_table(records)
    if args.json:
        progress(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
