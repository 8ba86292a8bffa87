"""What the vocabulary-parallel ops share (distributed.py, _sharded_linear.py): argument errors, the
layout of the vocabulary over a process group, and the all_gather of per-row records."""

from __future__ import annotations

import weakref
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

# What was learned from a group's collectives (slice layouts, widest slices), kept per group
# object: an entry goes with its group, so a group created later (which may reuse the address,
# the id, of a destroyed one) never meets a stale layout, and no cache keeps a group alive.
_GROUP_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_facts(group: Any) -> dict:
    """The cache of `group` (None: the default group), a dict the callers key as they need."""
    group = dist.group.WORLD if group is None else group
    facts = _GROUP_FACTS.get(group)
    if facts is None:
        facts = _GROUP_FACTS[group] = {}
    return facts


def _fail(function: str, argument: str, problem: str, got: Any, expected: str) -> NoReturn:
    raise ValueError(f"{function}: {argument} {problem}: got {got}; expected {expected}")


def _refuse_dtensor(function: str, name: str, tensor: Tensor | None) -> None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without the DTensor package
        return
    if isinstance(tensor, DTensor):
        raise TypeError(
            f"{function}: {name} is a DTensor (placements {tensor.placements}); with "
            "process_group the loss expects the local vocabulary slice as a plain tensor. Either "
            f"gather it ({name}.full_tensor()) and call without process_group, or pass "
            f"{name}.to_local() with vocab_offset= (the first vocabulary row it holds) and "
            "vocab_size= (see xent.distributed's docstring, FSDP2 recipe)"
        )


def vocab_layout(
    local_vocab: int,
    process_group: Any,
    device: torch.device,
    vocab_offset: int | None = None,
    vocab_size: int | None = None,
    function: str = "vocab_layout",
) -> tuple[int, int]:
    """(offset, global V) of this rank's slice: given, or from one all_gather of the local sizes
    (rank order), cached per (group, local size)."""
    if vocab_offset is not None and vocab_size is not None:
        offset, vocab = int(vocab_offset), int(vocab_size)
    else:
        layouts = group_facts(process_group)
        key = ("layout", int(local_vocab))
        if key not in layouts:
            world = dist.get_world_size(process_group)
            mine = torch.tensor([int(local_vocab)], dtype=torch.int64, device=device)
            sizes = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(sizes, mine, group=process_group)
            sizes = [int(s.item()) for s in sizes]
            rank = dist.get_rank(process_group)
            layouts[key] = (sum(sizes[:rank]), sum(sizes))
        offset, vocab = layouts[key]
        if vocab_offset is not None and int(vocab_offset) != offset:
            _fail(
                function,
                "vocab_offset",
                "disagrees with the gathered layout",
                vocab_offset,
                f"{offset} (the sum of the lower ranks' sizes), or give vocab_size too",
            )
        if vocab_size is not None and int(vocab_size) != vocab:
            _fail(
                function,
                "vocab_size",
                "disagrees with the gathered layout",
                vocab_size,
                f"{vocab} (the sum of every rank's size), or give vocab_offset too",
            )
    if not (0 <= offset and offset + local_vocab <= vocab):
        _fail(
            function,
            "vocab_offset",
            "out of range",
            offset,
            f"0 <= offset and offset + {local_vocab} <= vocab_size = {vocab}",
        )
    return offset, vocab


def _gather_records(partial: Tensor, process_group: Any) -> Tensor:
    """[P·N, W] rank-major from every rank's [N, W] records (one collective)."""
    world = dist.get_world_size(process_group)
    if world == 1:
        return partial
    gathered = partial.new_empty((world * partial.shape[0], partial.shape[1]))
    dist.all_gather_into_tensor(gathered, partial.contiguous(), group=process_group)
    return gathered
