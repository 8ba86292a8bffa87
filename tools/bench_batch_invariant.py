#!/usr/bin/env python3
"""The cost of batch_invariant=True on xent.linear_logprobs (docs/semantics.md §1,
docs/archive/perf-notes.md note 139), with and without the option:

  fwdbwd   J = Σ a·logprob + 0.01·Σ entropy at (16384, 4096, 151936), backward into h and W
  forward  under torch.no_grad() at 1, 64 and 16384 rows of the same head

and, at the same head, whether rows 0, 1 and 0..63 computed alone equal the same rows of the
16384-row forward bit for bit (with the option they must).

Usage: bench_batch_invariant.py JSON_OUT [--n 16384 --h 4096 --v 151936]   (a CUDA build of the
package on PYTHONPATH; records name the commit from XENT_COMMIT)
"""

import argparse
import json
import os
import sys

import torch
from compare_torch import Timer, summarize

import xent


def timed(fn, reps: int) -> float:
    """Median milliseconds of fn over reps CUDA-event timings, after three warm-up calls."""
    return summarize(Timer("cuda", 3, reps).run(lambda i: fn()))["median"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("json_out")
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--h", type=int, default=4096)
    parser.add_argument("--v", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = args.n, args.h, args.v
    h = torch.randn(n, hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16()
    w.requires_grad_()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    a = torch.randn(n, device="cuda", generator=g)
    common = dict(
        op="linear_logprobs",
        dtype="bfloat16",
        h=hidden,
        v=vocab,
        device=torch.cuda.get_device_name(0),
        cuda_archs=xent.build_info().get("cuda_archs"),
        commit=os.environ.get("XENT_COMMIT"),
    )
    records = []

    def record(**fields):
        records.append({**common, **fields})
        r = records[-1]
        print(
            f"{r['mode']:8s} n={r['n']:6d} batch_invariant={r['batch_invariant']!s:5s} "
            f"{r['ms']:9.3f} ms"
        )

    for invariant in (False, True):

        def step():
            h.grad = w.grad = None
            lp, ent = xent.linear_logprobs(h, w, y, return_entropy=True, batch_invariant=invariant)
            ((a * lp).sum() + 0.01 * ent.sum()).backward()

        record(mode="fwdbwd", n=n, batch_invariant=invariant, ms=timed(step, args.reps))
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    with torch.no_grad():
        for rows in (1, 64, n):
            for invariant in (False, True):

                def forward():
                    xent.linear_logprobs(
                        h[:rows], w, y[:rows], return_entropy=True, batch_invariant=invariant
                    )

                reps = 4 * args.reps if rows < n else args.reps
                record(mode="forward", n=rows, batch_invariant=invariant, ms=timed(forward, reps))
        for invariant in (False, True):
            whole = xent.linear_logprobs(h, w, y, return_entropy=True, batch_invariant=invariant)
            equal = {}
            for first, count in ((0, 1), (1, 1), (0, 64)):
                piece = slice(first, first + count)
                alone = xent.linear_logprobs(
                    h[piece], w, y[piece], return_entropy=True, batch_invariant=invariant
                )
                equal[f"{first}+{count}"] = all(
                    torch.equal(x, full[piece]) for x, full in zip(alone, whole)
                )
            records.append({**common, "mode": "bit_equal", "batch_invariant": invariant, **equal})
            print(f"rows alone equal to the batch's (batch_invariant={invariant}): {equal}")
    with open(args.json_out, "w") as f:
        json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
