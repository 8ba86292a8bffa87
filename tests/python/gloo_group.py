"""Runs a test body in a CPU process group (gloo) of a few spawned processes: the harness of the
vocabulary-parallel tests (test_distributed.py, test_policy_distributed.py)."""

import os
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


def _worker(rank, world, init_file, error_dir, body, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        body(rank, world, dist.group.WORLD, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as out:
            out.write(traceback.format_exc())
        raise


def run_group(world, body, args=()):
    """body(rank, world, group, *args) on each of `world` processes (a module-level function, which
    the processes import); a failure fails the test with every rank's traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            mp.spawn(
                _worker, args=(world, init_file, tmp, body, tuple(args)), nprocs=world, join=True
            )
        except Exception as error:
            reports = [
                open(os.path.join(tmp, f)).read()
                for f in sorted(os.listdir(tmp))
                if f.startswith("rank")
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
