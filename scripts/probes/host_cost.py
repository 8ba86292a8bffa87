#!/usr/bin/env python3
"""Where the host time of a linear_cross_entropy step goes before its first kernel.

A step that starts on an idle device (after loss.item(), an optimizer's synchronisation, a
logging call) waits for the host: everything the package does before its first launch is GPU
idle time. Times, on the host, each piece of the default budget's query (torch.cuda.mem_get_info
and the caching allocator's counters) and whole forward + backward calls at a shape so small
that the device never paces them, with the default budget and with an explicit one.
Run: PYTHONPATH=python python3 scripts/probes/host_cost.py [REPEAT [JSON]]
"""
import json
import statistics
import sys
import time

import torch

import xent.functional as XF


def host_us(fn, repeat):
    """Median host time of fn in µs over `repeat` calls (after 5 warm-ups)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - start))
    return statistics.median(times)


def main():
    repeat = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    out = sys.argv[2] if len(sys.argv) > 2 else None
    device = torch.device("cuda", torch.cuda.current_device())
    index = device.index
    torch.manual_seed(0)
    n, h, v = 256, 256, 4096
    hidden = torch.randn(n, h, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device=device) / h**0.5).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), device=device)
    budget = XF.default_workspace_bytes(device)

    def step(workspace):
        hidden.grad = weight.grad = None
        XF.linear_cross_entropy(hidden, weight, target, workspace_bytes=workspace).backward()

    def synced_step(workspace):
        step(workspace)
        torch.cuda.synchronize()

    pieces = {
        "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(index),
        "torch.cuda.memory_reserved": lambda: torch.cuda.memory_reserved(index),
        "torch.cuda.memory_allocated": lambda: torch.cuda.memory_allocated(index),
        "xent default_workspace_bytes": lambda: XF.default_workspace_bytes(device),
        "step, default budget (host, no sync)": lambda: step(None),
        "step, explicit budget (host, no sync)": lambda: step(budget),
        "step, default budget, synchronised": lambda: synced_step(None),
        "step, explicit budget, synchronised": lambda: synced_step(budget),
    }
    record = {"device": torch.cuda.get_device_name(index), "shape": [n, h, v],
              "repeat": repeat, "budget_mib": budget >> 20, "host_us": {}}
    for _ in range(2):  # two rounds: the figures' spread
        for name, fn in pieces.items():
            us = host_us(fn, repeat)
            record["host_us"].setdefault(name, []).append(round(us, 1))
            torch.cuda.synchronize()
    for name, values in record["host_us"].items():
        print(f"{name:45s} {' / '.join(f'{x:8.1f}' for x in values)} us", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
