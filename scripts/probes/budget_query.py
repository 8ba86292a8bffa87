#!/usr/bin/env python3
"""Does the default workspace budget's device-memory query cost a training step anything?

linear_cross_entropy without workspace_bytes asks the device how much memory is free
(torch.cuda.mem_get_info) on every call; with workspace_bytes it does not. Times forward +
backward through autograd both ways, interleaved in R rounds of C calls each (CUDA events per
call, the host's time of the query alone too), at one shape.
Run: PYTHONPATH=python python3 scripts/probes/budget_query.py N H V [C [R]]
"""
import statistics
import sys
import time

import torch

import xent.functional as XF
from call_drift import call_times  # this folder, first on sys.path when run as a script


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    n, h, v = (int(a) for a in sys.argv[1:4])
    calls = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    budget = XF.default_workspace_bytes(hidden.device)
    start = time.perf_counter()
    for _ in range(100):
        XF.default_workspace_bytes(hidden.device)
    print(f"default budget {budget >> 20} MiB; its query {1e6 * (time.perf_counter() - start) / 100:.0f} us "
          "on the host", flush=True)

    def step(explicit):
        hidden.grad = weight.grad = None
        loss = XF.linear_cross_entropy(hidden, weight, target,
                                       workspace_bytes=budget if explicit else None)
        loss.backward()

    series = {False: [], True: []}
    for r in range(rounds):
        for explicit in (False, True):
            for _ in range(3 if r == 0 else 1):
                step(explicit)
            times = call_times(lambda: step(explicit), calls)
            series[explicit] += times
            name = "explicit" if explicit else "default "
            print(f"round {r} {name} {' '.join(f'{t:.1f}' for t in times)}", flush=True)
    for explicit in (False, True):
        t = sorted(series[explicit])
        print(f"{'explicit' if explicit else 'default '}: median {statistics.median(t):.2f} ms, "
              f"p20 {t[len(t) // 5]:.2f}, p80 {t[4 * len(t) // 5]:.2f} over {len(t)} calls")


if __name__ == "__main__":
    main()
