#!/usr/bin/env python3
"""Per-call times of xent's linear_cross_entropy (forward + backward through autograd) and of the
three bare products it is measured against, to tell a comparison's spread apart from the op's:
under sustained load a GPU's clock drifts (power, temperature), and every implementation timed
during the drift moves with it.

Prints each call's time (CUDA events), xent, then the products, then xent again, and the
caching allocator's reserved memory after each series. With a fifth argument S, instead S series
of xent alone, the caching allocator emptied between them (as compare_torch.py's rounds do), to
see whether a series' level follows where its workspace lands.
Run: PYTHONPATH=python python3 scripts/probes/call_drift.py N H V [CALLS [S]]
"""
import sys

import torch

import xent.functional as XF


def call_times(fn, calls):
    """Each of `calls` calls of fn timed alone (CUDA events, ms), the device idle before each."""
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def series(name, fn, calls):
    for _ in range(3):
        fn()
    times = call_times(fn, calls)
    reserved = torch.cuda.memory_reserved() / 2**30
    print(f"{name:8s} {' '.join(f'{t:.1f}' for t in times)}  (ms; reserved {reserved:.1f} GiB)",
          flush=True)


def linear_problem(n, h, v, workspace_bytes=None):
    """bf16 hidden states, head and targets (seed 0), and a step of linear_cross_entropy on them:
    forward and backward through autograd (workspace_bytes: the op's budget, None its default)."""
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")

    def step():
        hidden.grad = None
        weight.grad = None
        XF.linear_cross_entropy(hidden, weight, target,
                                workspace_bytes=workspace_bytes).backward()

    return hidden, weight, target, step


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    n, h, v = (int(x) for x in sys.argv[1:4])
    calls = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    hidden, weight, target, step = linear_problem(n, h, v)

    def products():  # h·Wᵀ, then G·W and Gᵀ·h with the logits standing in for G
        logits = hidden.detach() @ weight.detach().T
        logits @ weight.detach()
        logits.T @ hidden.detach()

    print(f"N={n} H={h} V={v} on {torch.cuda.get_device_name()}")
    if len(sys.argv) > 5:
        for index in range(int(sys.argv[5])):
            torch.cuda.empty_cache()
            series(f"xent {index + 1}", step, calls)
        return
    for name, fn in (("xent", step), ("products", products), ("xent", step)):
        series(name, fn, calls)


if __name__ == "__main__":
    main()
