"""Host-side cost of xent's DTensor path over its process-group path, on the CPU with gloo.

At tiny shapes the kernels take microseconds, so what a call costs is host work: argument
checks, the DTensor conversions of xent/_dtensor.py, autograd, the collectives' latency. Run
under torchrun with gloo, e.g.

    PYTHONPATH=python torchrun --standalone --nproc-per-node 2 tools/bench_dtensor_host.py

For each op (cross_entropy, linear_cross_entropy, distill, logprobs) a training call (forward,
then torch.autograd.grad of the loss) is timed twice on the same inputs: with the DTensors, and
with their local slices plus process_group=, vocab_offset=, vocab_size= (logprobs: the sharded
cross-entropy with reduction "none", which is what its DTensor path runs). The two alternate in
--rounds rounds of --iters back-to-back calls after a barrier; per call, the fastest round's wall
time and main-thread CPU time (which leaves out waiting for the other ranks) are taken, the
slowest rank's. Also counted per call under torch.profiler: the collectives (c10d ops) and the
host reads of a tensor's value (aten::item, a device synchronisation when the tensor is on a GPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

ROWS, HIDDEN, VOCAB = 8, 16, 64


def _steps(mesh, group):
    """{op: (process-group step, DTensor step)} on the same data."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import xent

    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    logits = distribute_tensor(torch.randn(ROWS, VOCAB, generator=gen), mesh, [Shard(-1)])
    teacher = distribute_tensor(torch.randn(ROWS, VOCAB, generator=gen), mesh, [Shard(-1)])
    hidden = distribute_tensor(torch.randn(ROWS, HIDDEN, generator=gen), mesh, [Replicate()])
    weight = distribute_tensor(torch.randn(VOCAB, HIDDEN, generator=gen) / 4, mesh, [Shard(0)])
    for tensor in (logits, hidden, weight):
        tensor.requires_grad_()
    local, t_local, h_local, w_local = (
        t.to_local().detach().requires_grad_(t.requires_grad)
        for t in (logits, teacher, hidden, weight)
    )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sharded = dict(process_group=group, vocab_offset=rank * -(-VOCAB // world), vocab_size=VOCAB)

    def step(loss_fn, inputs):
        def run():
            torch.autograd.grad(loss_fn(), inputs)

        return run

    return {
        "cross_entropy": (
            step(lambda: xent.cross_entropy(local, target, **sharded), local),
            step(lambda: xent.cross_entropy(logits, target), logits),
        ),
        "linear_cross_entropy": (
            step(
                lambda: xent.linear_cross_entropy(h_local, w_local, target, **sharded),
                (h_local, w_local),
            ),
            step(lambda: xent.linear_cross_entropy(hidden, weight, target), (hidden, weight)),
        ),
        "distill": (
            step(lambda: xent.distill(local, t_local, target, **sharded), local),
            step(lambda: xent.distill(logits, teacher, target), logits),
        ),
        "logprobs": (
            step(
                lambda: xent.cross_entropy(local, target, reduction="none", **sharded).neg().sum(),
                local,
            ),
            step(lambda: xent.logprobs(logits, target).sum(), logits),
        ),
    }


def _events(step) -> dict:
    """Collectives and host reads of a value per call, from the profiler's CPU events."""
    from torch.profiler import ProfilerActivity, profile

    calls = 4
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
    counts = collections.Counter()
    for event in prof.events():
        if event.name.startswith("c10d::"):
            counts["collectives"] += 1
        elif event.name == "aten::item":
            counts["item"] += 1
    return {key: counts[key] / calls for key in ("collectives", "item")}


def _timed(step, iters: int) -> tuple[float, float]:
    """(wall, main-thread CPU) milliseconds per call over iters back-to-back calls."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(iters):
        step()
    return (time.perf_counter() - wall) * 1e3 / iters, (time.thread_time() - cpu) * 1e3 / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", default="cross_entropy,linear_cross_entropy,distill,logprobs")
    parser.add_argument("--out", help="JSON record (rank 0 writes)")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit("bench_dtensor_host.py: run it under torchrun (see its docstring)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    steps = _steps(mesh, mesh.get_group(0))
    record = {"tool": "bench_dtensor_host", "world_size": dist.get_world_size(), "ops": {}}
    record.update(torch=torch.__version__, iters=args.iters, rounds=args.rounds)
    for op in args.ops.split(","):
        variants = dict(zip(("process_group", "dtensor"), steps[op]))
        for run in variants.values():
            for _ in range(20):
                run()
        events = {name: _events(run) for name, run in variants.items()}
        best = {name: [float("inf")] * 2 for name in variants}
        for _ in range(args.rounds):
            for name, run in variants.items():
                best[name] = [min(a, b) for a, b in zip(best[name], _timed(run, args.iters))]
        # the slowest rank's figures
        flat = torch.tensor(best["process_group"] + best["dtensor"], dtype=torch.float64)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        pg_wall, pg_cpu, dt_wall, dt_cpu = flat.tolist()
        entry = {
            "process_group_ms": {"wall": pg_wall, "cpu": pg_cpu},
            "dtensor_ms": {"wall": dt_wall, "cpu": dt_cpu},
            "overhead_ms": {"wall": dt_wall - pg_wall, "cpu": dt_cpu - pg_cpu},
            "per_call": events,
        }
        record["ops"][op] = entry
        if dist.get_rank() == 0:
            print(
                f"{op:22s} process group {pg_wall:.3f} ms (cpu {pg_cpu:.3f}), DTensor "
                f"{dt_wall:.3f} ms (cpu {dt_cpu:.3f}): +{dt_wall - pg_wall:.3f} ms "
                f"(cpu +{dt_cpu - pg_cpu:.3f}); per call {events}",
                flush=True,
            )
    if dist.get_rank() == 0 and args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The device mesh keeps its groups' gloo threads alive past destroy_process_group; their
    # destruction at interpreter exit can abort a rank after the record is written (failing the
    # torchrun): leave without it once everything is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
