#!/usr/bin/env python3
"""A linear_cross_entropy step with a per-column term or the row statistics (forward + backward
through autograd) on the
fused Hopper products and on the cuBLASLt path (XENT_CUDA_FUSED_STATS=0, XENT_CUDA_FUSED_GRAD=0
and XENT_CUDA_REFERENCE=0, read per call), interleaved in one process: what the fused products'
per-column terms cost or save. KIND: bias (default: with ∂bias and with the bias frozen),
class_weight, class_weight_smoothing or smoothing (ε = 0.1), statistics (return_stats=True:
entropy, argmax and accuracy besides the loss; statistics_all: the same with
XENT_CUDA_REFERENCE=all on the fused side, the reference path's statistics form at every H), or
plain (none of them). Prints each configuration's median and
p20–p80 of CALLS steps (CUDA events) per round, and writes them as JSON when given a path.
Run: PYTHONPATH=python python3 scripts/probes/column_terms_step.py N H V BUDGET_MIB [CALLS [JSON [KIND]]]
"""
import json
import os
import sys

import torch

import xent.functional as XF
from call_drift import call_times

SWITCHES = ("XENT_CUDA_FUSED_STATS", "XENT_CUDA_FUSED_GRAD", "XENT_CUDA_REFERENCE")
KINDS = ("bias", "class_weight", "class_weight_smoothing", "smoothing", "statistics",
         "statistics_all", "plain")


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    n, h, v, budget_mib = (int(x) for x in sys.argv[1:5])
    calls = int(sys.argv[5]) if len(sys.argv) > 5 else 20
    kind = sys.argv[7] if len(sys.argv) > 7 else "bias"
    if kind not in KINDS:
        sys.exit(f"KIND must be one of {', '.join(KINDS)}")
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    bias = (torch.randn(v, device="cuda", dtype=torch.bfloat16) * 0.1).requires_grad_()
    class_weight = torch.rand(v, device="cuda") + 0.5
    target = torch.randint(0, v, (n,), device="cuda")
    frozen = bias.detach()

    def step(variant):
        if kind == "bias":
            extra = {"bias": bias if variant else frozen}
        elif kind.startswith("statistics"):
            extra = {"return_stats": True}
        elif kind == "plain":
            extra = {}
        else:
            extra = {"label_smoothing": 0.1 if kind.endswith("smoothing") else 0.0}
            if kind.startswith("class_weight"):
                extra["class_weight"] = class_weight

        def run():
            hidden.grad = weight.grad = bias.grad = None
            out = XF.linear_cross_entropy(hidden, weight, target,
                                          workspace_bytes=budget_mib << 20, **extra)
            (out.loss if kind.startswith("statistics") else out).backward()
        return run

    # bias: with ∂bias (True) and frozen (False); the other kinds: one configuration.
    variants = (True, False) if kind == "bias" else (True,)
    results = []
    print(f"N={n} H={h} V={v} budget {budget_mib} MiB, {kind}, on {torch.cuda.get_device_name()}")
    for round_index in range(2):
        for path in ("fused", "cublaslt"):
            for variant in variants:
                for name in SWITCHES:
                    if path == "cublaslt":
                        os.environ[name] = "0"
                    else:
                        os.environ.pop(name, None)
                if path == "fused" and kind == "statistics_all":
                    os.environ["XENT_CUDA_REFERENCE"] = "all"
                run = step(variant)
                for _ in range(3):
                    run()
                times = sorted(call_times(run, calls))
                row = {"n": n, "h": h, "v": v, "budget_mib": budget_mib, "kind": kind,
                       "path": path, "round": round_index + 1,
                       "median_ms": times[len(times) // 2],
                       "p20_ms": times[len(times) // 5], "p80_ms": times[(4 * len(times)) // 5],
                       "device": torch.cuda.get_device_name()}
                if kind == "bias":
                    row["bias_grad"] = variant
                results.append(row)
                label = f"∂bias {str(variant):5s} " if kind == "bias" else ""
                print(f"round {round_index + 1} {path:8s} {label}{row['median_ms']:.2f} ms "
                      f"({row['p20_ms']:.2f}-{row['p80_ms']:.2f})", flush=True)
    for name in SWITCHES:
        os.environ.pop(name, None)
    if len(sys.argv) > 6:
        with open(sys.argv[6], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
