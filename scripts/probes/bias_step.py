#!/usr/bin/env python3
"""A linear_cross_entropy step with a bias (forward + backward through autograd, ∂bias wanted or
the bias frozen), on the fused Hopper products and on the cuBLASLt path (XENT_CUDA_FUSED_STATS=0
and XENT_CUDA_FUSED_GRAD=0, read per call), interleaved in one process: what the fused products'
bias costs or saves. Prints each configuration's median and p20–p80 of CALLS steps (CUDA events)
per round, and writes them as JSON when given a path.
Run: PYTHONPATH=python python3 scripts/probes/bias_step.py N H V BUDGET_MIB [CALLS [JSON]]
"""
import json
import os
import sys

import torch

import xent.functional as XF
from call_drift import call_times

SWITCHES = ("XENT_CUDA_FUSED_STATS", "XENT_CUDA_FUSED_GRAD")


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    n, h, v, budget_mib = (int(x) for x in sys.argv[1:5])
    calls = int(sys.argv[5]) if len(sys.argv) > 5 else 20
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    bias = (torch.randn(v, device="cuda", dtype=torch.bfloat16) * 0.1).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    frozen = bias.detach()

    def step(with_bias_grad):
        def run():
            hidden.grad = weight.grad = bias.grad = None
            XF.linear_cross_entropy(hidden, weight, target, bias if with_bias_grad else frozen,
                                    workspace_bytes=budget_mib << 20).backward()
        return run

    results = []
    print(f"N={n} H={h} V={v} budget {budget_mib} MiB on {torch.cuda.get_device_name()}")
    for round_index in range(2):
        for path in ("fused", "cublaslt"):
            for with_bias_grad in (True, False):
                for name in SWITCHES:
                    if path == "cublaslt":
                        os.environ[name] = "0"
                    else:
                        os.environ.pop(name, None)
                run = step(with_bias_grad)
                for _ in range(3):
                    run()
                times = sorted(call_times(run, calls))
                row = {"n": n, "h": h, "v": v, "budget_mib": budget_mib, "path": path,
                       "bias_grad": with_bias_grad, "round": round_index + 1,
                       "median_ms": times[len(times) // 2],
                       "p20_ms": times[len(times) // 5], "p80_ms": times[(4 * len(times)) // 5],
                       "device": torch.cuda.get_device_name()}
                results.append(row)
                print(f"round {round_index + 1} {path:8s} ∂bias {str(with_bias_grad):5s} "
                      f"{row['median_ms']:.2f} ms ({row['p20_ms']:.2f}-{row['p80_ms']:.2f})",
                      flush=True)
    for name in SWITCHES:
        os.environ.pop(name, None)
    if len(sys.argv) > 6:
        with open(sys.argv[6], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
