#!/usr/bin/env python3
"""Times xent.distill with a top-k teacher (docs/semantics.md §3.1), bf16 forward + backward,
k = 64, renormalize and tail, against a clone of the student: one read and one write of N x V, the
traffic of a one-pass kernel, so the fraction printed is of copy bandwidth.

Usage: bench_distill_topk.py JSON_OUT   (a CUDA build of the package on PYTHONPATH; records name
the commit from XENT_COMMIT)
"""

import json
import os
import sys

import torch

import xent

SHAPES = ((16384, 32768), (4096, 131072), (2048, 262144))
K = 64


def timed(fn, reps: int = 20) -> float:
    """Median milliseconds of fn over reps CUDA-event timings, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(n: int, v: int, mass: str) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    student = torch.randn(n, v, device="cuda", generator=g).bfloat16().requires_grad_()
    teacher_logits = student.detach().float() + 0.5 * torch.randn(n, v, device="cuda", generator=g)
    logprobs, ids = torch.log_softmax(teacher_logits, -1).topk(K, -1)
    del teacher_logits
    target = torch.randint(0, v, (n,), device="cuda", generator=g)
    teacher = xent.TopK(ids, logprobs, mass)

    def step():
        student.grad = None
        xent.distill(student, target=target, teacher=teacher).backward()

    ms = timed(step)
    values = student.detach()
    copy_ms = timed(values.clone)
    return dict(n=n, v=v, k=K, mass=mass, ms=ms, copy_ms=copy_ms, fraction_of_copy=copy_ms / ms)


def main() -> int:
    records = []
    for n, v in SHAPES:
        for mass in ("renormalize", "tail"):
            record = measure(n, v, mass)
            record.update(
                op="distill_topk",
                impl="xent_torch",
                dtype="bfloat16",
                mode="fwdbwd",
                device=torch.cuda.get_device_name(0),
                cuda_archs=xent.build_info().get("cuda_archs"),
                commit=os.environ.get("XENT_COMMIT"),
            )
            records.append(record)
            print(
                f"{n}x{v} {mass}: {record['ms']:.3f} ms, copy {record['copy_ms']:.3f} ms -> "
                f"{record['fraction_of_copy']:.2f} of copy bandwidth"
            )
            torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
