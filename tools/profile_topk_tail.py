"""One process that runs a top-k distill (or ce) forward + backward on bf16 logits a few times and
times it with CUDA events: the program to put under Nsight Compute when comparing the top-k row
kernel with ce's (notes decision 146). N = 16384, k = 64, random logits (N(0, 4)); the teacher's
top-k from the student plus N(0, 1) noise, log-softmaxed.

    PYTHONPATH=python python3 tools/profile_topk_tail.py tail 32768        # or renormalize, ce
    PYTHONPATH=python ncu --clock-control none -k regex:"distill_topk_kernel|ce_rows_kernel" \\
        -s 4 -c 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 tools/profile_topk_tail.py tail 32768
"""

import argparse
import pathlib
import sys

import torch

import xent.functional as xf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from compare_torch import Timer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mass", choices=("tail", "renormalize", "ignore", "ce"))
    parser.add_argument("vocab", type=int)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    n, v = args.rows, args.vocab
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
    with torch.no_grad():
        teacher = (x.float() + torch.randn(n, v, device="cuda", generator=g)).log_softmax(-1)
        logprobs, ids = teacher.topk(args.k, -1)
        del teacher
    target = torch.randint(0, v, (n,), device="cuda", generator=g)

    def step() -> None:
        x.grad = None
        if args.mass == "ce":
            loss = xf.cross_entropy(x, target)
        else:
            loss = xf.distill(x, teacher=xf.TopK(ids, logprobs, args.mass))
        loss.backward()

    times = Timer("cuda", 4, args.steps).run(lambda _: step())
    mean = sum(times) / len(times)
    print(f"{args.mass} {n} x {v}: {mean:.3f} ms a forward + backward (mean of {len(times)})")


if __name__ == "__main__":
    main()
