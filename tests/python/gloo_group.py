"""Runs a test body in a process group of a few spawned processes (gloo on the CPU, or NCCL with a
GPU a rank): the harness of the vocabulary-parallel and DTensor tests (test_distributed.py,
test_policy_distributed.py, test_distill_topk_distributed.py, test_dtensor.py)."""

import faulthandler
import os
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available",
)


def _worker(rank, world, init_file, error_dir, body, args, nccl):
    # Each rank notes how far it got, and a fatal signal dumps its Python stacks there: a rank
    # killed in C++ leaves no traceback of its own.
    stage = open(os.path.join(error_dir, f"stage{rank}.txt"), "w", buffering=1)
    faulthandler.enable(file=stage, all_threads=True)
    try:
        torch.set_num_threads(1)
        if nccl:
            torch.cuda.set_device(rank)
        stage.write("init\n")
        dist.init_process_group(
            "nccl" if nccl else "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
        )
        stage.write("body\n")
        body(rank, world, dist.group.WORLD, *args)
        stage.write("barrier\n")
        dist.barrier()
        stage.write("destroy\n")
        dist.destroy_process_group()
        stage.write("done\n")
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as out:
            out.write(traceback.format_exc())
        raise
    # Leave without the interpreter's teardown: a DeviceMesh keeps its groups (and their gloo
    # transport threads) alive past destroy_process_group, and their destruction during
    # finalisation aborted a rank now and then ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_group(world, body, args=(), nccl=False):
    """body(rank, world, group, *args) on each of `world` processes (a module-level function, which
    the processes import) in a process group: gloo, or NCCL with rank r on GPU r; a failure fails
    the test with every rank's traceback and how far each rank got."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            mp.spawn(
                _worker,
                args=(world, init_file, tmp, body, tuple(args), nccl),
                nprocs=world,
                join=True,
            )
        except Exception as error:
            reports = [
                f"{name}:\n" + open(os.path.join(tmp, name)).read()
                for name in sorted(os.listdir(tmp))
                if name.startswith(("rank", "stage"))
            ]
            pytest.fail(f"{error}\n" + "\n".join(reports))


def sharded_head(world, vocab, hidden):
    """A (vocab, hidden) DTensor LM head in Shard(0) over a CPU mesh of the group, or None on a
    torch without CPU device meshes."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        return distribute_tensor(torch.randn(vocab, hidden), mesh, [Shard(0)])
    except Exception:  # a torch without CPU device meshes: nothing to check with it
        return None


def slice_of(sizes, rank):
    """[begin, end) of rank's slice when the ranks hold `sizes` columns each, in rank order."""
    begin = sum(sizes[:rank])
    return begin, begin + sizes[rank]


def close(what, got, expected, rtol=2e-5, atol=2e-6):
    """assert_close with `what` named in the message (the vocabulary-parallel tolerance)."""
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
