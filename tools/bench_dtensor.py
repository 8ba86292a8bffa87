"""Vocabulary-parallel xent over DTensor vs over a process group vs torch's loss_parallel.

Run under torchrun, one process per GPU, e.g. on 8 GPUs:

    PYTHONPATH=python torchrun --standalone --nproc-per-node 8 tools/bench_dtensor.py \\
        --out bench/results/dtensor-8xH100.json

and on the CPU with gloo at tiny shapes (a check of the script, not a measurement):

    PYTHONPATH=python torchrun --standalone --nproc-per-node 2 tools/bench_dtensor.py \\
        --dry-run --out /tmp/dtensor.json

Cases (training steps, forward + backward, bf16 on the GPU): cross_entropy on [16384, 262144]
logits sharded Shard(-1), and linear_cross_entropy with hidden [8192, 4096] (Replicate) and an
LM head [128256, 4096] sharded Shard(0). Variants timed on the same inputs:

* ``process_group``: xent with the local slice, process_group=, vocab_offset=, vocab_size=;
* ``dtensor``: xent with the DTensors (the conversions of xent/_dtensor.py on top of the above);
* ``loss_parallel``: torch's ``loss_parallel()`` F.cross_entropy on the DTensor logits (for the
  linear case after DTensor's F.linear, which materialises the local logits);
* ``megatron_compiled``: the vocabulary-parallel cross-entropy as Megatron-LM forms it (the
  global row max, then the sums of exponentials and the target logit, each all-reduced; the
  gradient softmax − one-hot of the local columns), in plain torch ops whose local parts are
  torch.compile'd, on the local shards the process-group variant takes (the linear case: the
  local logits by a plain matmul, ∂hidden all-reduced as a column-parallel head's backward does);
* ``local``: xent on the local slice alone, without any collective (targets folded into the
  slice): the compute floor of the sharded step.

The collective time is separated two ways: ``collectives`` times the collectives the sharded
step issues, alone, at their sizes (the all_gather of the [N, 9] fp32 records; for the linear
case also the all_reduce of ∂hidden [N, H]); and ``profiled_collective_ms`` sums, per variant,
the device time of the communication kernels (NCCL on the GPU; gloo ops on the CPU) under
torch.profiler. Times, in milliseconds (CUDA events on the GPU, perf_counter on the CPU), the
slowest rank's, come two ways, the variants interleaved over --rounds rounds of --iters calls
after --warmup: ``ms``, one call after a barrier and a device synchronisation (the median call;
the host work before the first kernel is exposed, as for a loss called on an idle GPU), and
``pipelined_ms``, --iters calls enqueued back to back (the median round's mean call; the host
runs ahead, as in a training step whose loss is queued behind the model's forward); ``spread``
gives each one's (largest − smallest) / median over the rounds. Rank 0 writes one JSON record to
--out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

GPU_CASES = {"ce": (16384, 262144), "linear_ce": (8192, 4096, 128256)}
DRY_CASES = {"ce": (64, 1031), "linear_ce": (32, 48, 1031)}


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON record (rank 0 writes)")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="default: cuda when available, else cpu",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes, 2 iterations: checks the script (gloo on the CPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="calls per round and way of timing")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the variants interleaved")
    parser.add_argument("--cases", default="ce,linear_ce")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler pass")
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="also write a torch.profiler trace per rank of --iters isolated calls of the "
        "process-group and DTensor variants (DIR/CASE-VARIANT-rankR.json)",
    )
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.dry_run:
        args.warmup, args.iters, args.rounds = 1, 2, 2
    return args


class _Timer:
    """Times steps in two ways, every rank in step: ``isolated`` (one call after a barrier and a
    device synchronisation: its host work before the first kernel is exposed) and ``pipelined``
    (``iters`` calls enqueued back to back: the host runs ahead of the GPU, as in a training step
    whose loss is queued behind the model's forward)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def _events(self):
        return [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def isolated(self, step, iters) -> list[float]:
        times = []
        for _ in range(iters):
            dist.barrier()
            if self.cuda:
                torch.cuda.synchronize()
                begin, end = self._events()
                begin.record()
                step()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                begin = time.perf_counter()
                step()
                times.append((time.perf_counter() - begin) * 1e3)
        return times

    def pipelined(self, step, iters) -> float:
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
            begin, end = self._events()
            begin.record()
            for _ in range(iters):
                step()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / iters
        begin = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - begin) * 1e3 / iters

    def slowest(self, value: float) -> float:
        """The largest value over ranks: a collective step ends when its last rank does."""
        value = torch.tensor([value], dtype=torch.float64)
        if self.cuda:
            value = value.cuda()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def median_isolated(self, step, warmup: int, iters: int) -> float:
        """The slowest rank's median of ``iters`` isolated calls after ``warmup``."""
        for _ in range(warmup):
            step()
        return self.slowest(statistics.median(self.isolated(step, iters)))

    def __call__(self, steps: dict, warmup: int, iters: int, rounds: int) -> dict:
        """{name: figures} of every step, the steps interleaved: each round times each step
        (in an order rotated from round to round) ``iters`` times isolated, then ``iters`` calls
        pipelined. Figures, milliseconds, the slowest rank's: ``isolated`` the median of all
        isolated calls, ``pipelined`` the median of the rounds' per-call means, and each one's
        ``*_spread``: (largest - smallest) / median of the rounds' values."""
        names = list(steps)
        for name in names:
            for _ in range(warmup):
                steps[name]()
        isolated = {name: [] for name in names}
        pipelined = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                isolated[name].append(self.isolated(steps[name], iters))
                pipelined[name].append(self.pipelined(steps[name], iters))
        out = {}
        for name in names:
            per_round = [statistics.median(times) for times in isolated[name]]
            calls = [t for times in isolated[name] for t in times]
            out[name] = {
                "isolated": self.slowest(statistics.median(calls)),
                "isolated_spread": self.slowest(_spread(per_round)),
                "pipelined": self.slowest(statistics.median(pipelined[name])),
                "pipelined_spread": self.slowest(_spread(pipelined[name])),
            }
        return out


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def _profiled_collective_ms(step, device, iters):
    """Mean device (CUDA) or CPU time per step of the communication kernels/ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    total = 0.0
    for event in prof.key_averages():
        name = event.key.lower()
        if device.type == "cuda":
            if "nccl" in name and event.device_type.name == "CUDA":
                total += event.self_device_time_total
        elif "gloo" in name or name.startswith("c10d::"):
            total += event.self_cpu_time_total
    return total / 1e3 / iters


def _trace(step, timer, iters, folder, tag):
    """A chrome trace of ``iters`` isolated calls (CPU and device activity) on every rank."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if timer.cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        timer.isolated(step, iters)
    os.makedirs(folder, exist_ok=True)
    prof.export_chrome_trace(os.path.join(folder, f"{tag}-rank{dist.get_rank()}.json"))


def _ce_case(mesh, group, shape, dtype, device, args, timer):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.parallel import loss_parallel

    import xent

    rows, vocab = shape
    torch.manual_seed(0)  # the same targets on every rank
    target = torch.randint(0, vocab, (rows,), device=device)
    logits = _randn((rows, vocab), mesh, [Shard(1)], dtype, 1)
    logits.requires_grad_()
    local = logits.to_local().detach().requires_grad_()
    _, offsets = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
    offset, local_vocab = int(offsets[-1]), local.shape[-1]
    local_target = target % local_vocab

    def pg(grads=None):
        loss = xent.cross_entropy(
            local, target, process_group=group, vocab_offset=offset, vocab_size=vocab
        )
        got = torch.autograd.grad(loss, local)
        if grads is not None:
            grads.extend(got)
        return loss

    def dtensor():
        loss = xent.cross_entropy(logits, target)
        torch.autograd.grad(loss, logits)
        return loss

    def torch_loss_parallel():
        with loss_parallel():
            loss = F.cross_entropy(logits, target)
            torch.autograd.grad(loss, logits)
        return loss

    def no_collective():
        loss = xent.cross_entropy(local, local_target)
        torch.autograd.grad(loss, local)
        return loss

    def megatron_compiled(grads=None):
        loss = _MegatronStyleCE.apply(local, target, offset, group)
        got = torch.autograd.grad(loss, local)
        if grads is not None:
            grads.extend(got)
        return loss

    records_gather = _records_gather(rows, device, group)

    variants, losses = _variants(pg, dtensor, torch_loss_parallel, no_collective, megatron_compiled)
    return (
        variants,
        {"records_all_gather": records_gather},
        losses,
        {
            "rows": rows,
            "vocab": vocab,
            "local_vocab": local_vocab,
            "vocab_offset": offset,
            "megatron_grad_rel_diff": _grad_diff(pg, megatron_compiled),
        },
    )


def _linear_case(mesh, group, shape, dtype, device, args, timer):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.parallel import loss_parallel

    import xent

    rows, hidden_size, vocab = shape
    torch.manual_seed(0)
    target = torch.randint(0, vocab, (rows,), device=device)
    hidden = _randn((rows, hidden_size), mesh, [Replicate()], dtype, 2)
    weight = _randn((vocab, hidden_size), mesh, [Shard(0)], dtype, 3)
    with torch.no_grad():
        weight.mul_(hidden_size**-0.5)
    hidden.requires_grad_(), weight.requires_grad_()
    h_local = hidden.to_local().detach().requires_grad_()
    w_local = weight.to_local().detach().requires_grad_()
    _, offsets = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    offset, local_vocab = int(offsets[0]), w_local.shape[0]
    local_target = target % local_vocab

    def pg(grads=None):
        loss = xent.linear_cross_entropy(
            h_local, w_local, target, process_group=group, vocab_offset=offset, vocab_size=vocab
        )
        got = torch.autograd.grad(loss, (h_local, w_local))
        if grads is not None:
            grads.extend(got)
        return loss

    def dtensor():
        loss = xent.linear_cross_entropy(hidden, weight, target)
        torch.autograd.grad(loss, (hidden, weight))
        return loss

    def torch_loss_parallel():
        logits = F.linear(hidden, weight)  # Shard(-1) logits, N x V_local materialised
        with loss_parallel():
            loss = F.cross_entropy(logits, target)
            torch.autograd.grad(loss, (hidden, weight))
        return loss

    def no_collective():
        loss = xent.linear_cross_entropy(h_local, w_local, local_target)
        torch.autograd.grad(loss, (h_local, w_local))
        return loss

    def megatron_compiled(grads=None):
        loss = _MegatronStyleCE.apply(h_local @ w_local.T, target, offset, group)
        got = torch.autograd.grad(loss, (h_local, w_local))
        dist.all_reduce(got[0], group=group)  # the column-parallel head's ∂input
        if grads is not None:
            grads.extend(got)
        return loss

    records_gather = _records_gather(rows, device, group)
    grad_hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)

    def hidden_all_reduce():
        dist.all_reduce(grad_hidden, group=group)

    variants, losses = _variants(pg, dtensor, torch_loss_parallel, no_collective, megatron_compiled)
    return (
        variants,
        {"records_all_gather": records_gather, "hidden_grad_all_reduce": hidden_all_reduce},
        losses,
        {
            "rows": rows,
            "hidden": hidden_size,
            "vocab": vocab,
            "local_vocab": local_vocab,
            "vocab_offset": offset,
            "megatron_grad_rel_diff": _grad_diff(pg, megatron_compiled),
        },
    )


@torch.compile(dynamic=False)
def _local_max(x):
    return x.float().amax(-1)


@torch.compile(dynamic=False)
def _local_sums(x, row_max, local_target, in_shard):
    shifted = x.float() - row_max[:, None]
    picked = shifted.gather(1, local_target[:, None]).squeeze(1)
    return torch.stack((shifted.exp().sum(-1), torch.where(in_shard, picked, 0.0)))


@torch.compile(dynamic=False)
def _local_grad(x, row_max, log_sum, local_target, in_shard, scale):
    p = (x.float() - row_max[:, None] - log_sum[:, None]).exp()
    hot = torch.zeros_like(p).scatter_(1, local_target[:, None], in_shard[:, None].float())
    return ((p - hot) * scale).to(x.dtype)


class _MegatronStyleCE(torch.autograd.Function):
    """Mean cross-entropy of vocabulary-sharded logits: local slice x of columns
    [offset, offset + x.shape[1]) of every row, targets global, no ignored rows."""

    @staticmethod
    def forward(ctx, x, target, offset, group):
        in_shard = (target >= offset) & (target < offset + x.shape[1])
        local_target = torch.where(in_shard, target - offset, 0)
        row_max = _local_max(x)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = _local_sums(x, row_max, local_target, in_shard)
        dist.all_reduce(sums, group=group)
        log_sum = sums[0].log()
        ctx.save_for_backward(x, row_max, log_sum, local_target, in_shard)
        return (log_sum - sums[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        x, row_max, log_sum, local_target, in_shard = ctx.saved_tensors
        scale = grad / x.shape[0]
        return _local_grad(x, row_max, log_sum, local_target, in_shard, scale), None, None, None


def _randn(shape, mesh, placements, dtype, seed):
    """A DTensor of the global shape whose local shard each rank draws itself (no global tensor,
    no DTensor RNG tracker, which the CPU lacks)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    sharded = any(p.is_shard() for p in placements)  # a replicated tensor: the same everywhere
    gen = torch.Generator(device=torch.get_default_device())
    gen.manual_seed(seed + (dist.get_rank() if sharded else 0))
    local = torch.randn(local_shape, generator=gen, dtype=torch.float32).to(dtype)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _grad_diff(reference, other) -> float:
    """The largest norm-wise relative difference between the gradients of two variants (the
    largest over ranks): a check that the Megatron-style variant computes what xent does."""
    expected, got = [], []
    reference(expected)
    other(got)
    worst = max(
        float((g.float() - e.float()).norm() / e.float().norm()) for e, g in zip(expected, got)
    )
    worst = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _records_gather(rows: int, device, group):
    """The all_gather of the [N, 9] fp32 records that the sharded step issues, alone."""
    records = torch.zeros(rows, 9, dtype=torch.float32, device=device)
    gathered = records.new_empty((dist.get_world_size(group) * rows, 9))

    def records_gather():
        dist.all_gather_into_tensor(gathered, records, group=group)

    return records_gather


SHARDED = ("process_group", "dtensor", "loss_parallel", "megatron_compiled")


def _variants(pg, dtensor, loss_parallel, local, megatron) -> tuple[dict, dict]:
    """The timed variants by name, and the loss of each sharded one (a check they agree)."""
    variants = {
        "process_group": pg,
        "dtensor": dtensor,
        "loss_parallel": loss_parallel,
        "megatron_compiled": megatron,
        "local": local,
    }
    losses = {name: _scalar(variants[name]()) for name in SHARDED}
    return variants, losses


def _scalar(loss) -> float:
    from torch.distributed.tensor import DTensor

    if isinstance(loss, DTensor):
        loss = loss.to_local()
    return float(loss.detach().float().item())


def _commit() -> str:
    """The measured commit, as compare_torch.py names it (XENT_COMMIT where the tree has no .git)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compare_torch import git_commit

    return git_commit()


def main():
    args = _parse()
    device_type = args.device
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" not in os.environ:
        sys.exit("bench_dtensor.py: run it under torchrun (see its docstring)")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    torch.set_default_device(device)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
    group = mesh.get_group(0)
    dtype = getattr(torch, args.dtype)
    shapes = DRY_CASES if args.dry_run else GPU_CASES
    timer = _Timer(device)
    builders = {"ce": _ce_case, "linear_ce": _linear_case}
    record = {
        "tool": "bench_dtensor",
        "commit": _commit(),
        "world_size": world,
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names),
        "device": device_type,
        "device_name": torch.cuda.get_device_name(device) if device_type == "cuda" else "cpu",
        "backend": backend,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "dry_run": bool(args.dry_run),
        "warmup": args.warmup,
        "iters": args.iters,
        "rounds": args.rounds,
        "cases": [],
    }
    for name in args.cases.split(","):
        variants, collectives, losses, shape = builders[name](
            mesh, group, shapes[name], dtype, device, args, timer
        )
        entry = {
            "case": name,
            "shape": shape,
            "losses": losses,
            "ms": {},
            "pipelined_ms": {},
            "spread": {},
            "collectives_ms": {},
            "profiled_collective_ms": {},
        }
        timed = timer(variants, args.warmup, args.iters, args.rounds)
        for variant, figures in timed.items():
            entry["ms"][variant] = figures["isolated"]
            entry["pipelined_ms"][variant] = figures["pipelined"]
            entry["spread"][variant] = {
                "isolated": figures["isolated_spread"],
                "pipelined": figures["pipelined_spread"],
            }
        for collective, step in collectives.items():
            entry["collectives_ms"][collective] = timer.median_isolated(
                step, args.warmup, args.iters
            )
        if args.trace:
            for variant in ("process_group", "dtensor"):
                _trace(variants[variant], timer, args.iters, args.trace, f"{name}-{variant}")
        if not args.no_profile:
            for variant in SHARDED:
                entry["profiled_collective_ms"][variant] = _profiled_collective_ms(
                    variants[variant], device, max(1, min(args.iters, 5))
                )
        for key, times in (("", entry["ms"]), ("_pipelined", entry["pipelined_ms"])):
            extra = times["dtensor"] - times["process_group"]
            entry[f"dtensor_overhead{key}_ms"] = extra
            entry[f"dtensor_overhead{key}_percent"] = 100 * extra / times["process_group"]
        entry["sharded_minus_local_ms"] = entry["ms"]["process_group"] - entry["ms"]["local"]
        record["cases"].append(entry)
        if rank == 0:
            print(json.dumps(entry), flush=True)
        del variants, collectives
        if device_type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
