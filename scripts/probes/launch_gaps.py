#!/usr/bin/env python3
"""Where a linear_cross_entropy step's time goes between kernels: the GPU's idle gaps.

Profiles a few steps (forward + backward through autograd) with torch.profiler (CUPTI kernel
records) and prints, per step, its span (first kernel's start to last kernel's end), the sum of
its kernels' durations, the idle time between them, and the largest gaps with the kernels on
either side. A step whose span exceeds its kernels' sum by more than launch latency is waiting
on the host (launch cost, a synchronisation). Writes the figures as JSON to the path given.
Run: PYTHONPATH=python python3 scripts/probes/launch_gaps.py N H V BUDGET_MIB [JSON]
"""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from call_drift import linear_problem  # this folder, first on sys.path when run as a script


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    n, h, v, mib = (int(x) for x in sys.argv[1:5])
    _, _, _, step = linear_problem(n, h, v, workspace_bytes=mib << 20)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
            torch.cuda.synchronize()  # steps apart, so each is measured alone
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    # Split into steps at gaps longer than 1 ms (the synchronisation between steps).
    groups, current = [], []
    for e in kernels:
        if current and e.time_range.start - current[-1].time_range.end > 1000:
            groups.append(current)
            current = []
        current.append(e)
    if current:
        groups.append(current)
    report = []
    for g in groups[-steps:]:
        span = g[-1].time_range.end - g[0].time_range.start
        busy = sum(e.time_range.elapsed_us() for e in g)
        gaps = [(g[i + 1].time_range.start - g[i].time_range.end, g[i].name[:50], g[i + 1].name[:50])
                for i in range(len(g) - 1)]
        idle = sum(max(0.0, x[0]) for x in gaps)
        top = sorted(gaps, reverse=True)[:6]
        report.append(dict(kernels=len(g), span_ms=span / 1e3, kernel_sum_ms=busy / 1e3,
                           idle_ms=idle / 1e3, gaps_over_20us=sum(1 for x in gaps if x[0] > 20),
                           largest_gaps_us=[[round(x[0], 1), x[1], x[2]] for x in top]))
        print(f"{n}x{h}x{v} at {mib} MiB: {len(g)} kernels, span {span / 1e3:.2f} ms, kernels "
              f"{busy / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms "
              f"({report[-1]['gaps_over_20us']} gaps > 20 µs)")
        for x in top[:3]:
            print(f"    {x[0]:8.1f} µs between {x[1]} and {x[2]}")
    if len(sys.argv) > 5:
        with open(sys.argv[5], "w") as f:
            json.dump(dict(shape=[n, h, v], budget_mib=mib, device=torch.cuda.get_device_name(),
                           steps=report), f, indent=1)


if __name__ == "__main__":
    main()
