"""Uneven inputs: what a rank that has run out of batches does while the others still train.

torch's `Join` context calls `main_hook` on a joined rank once per iteration of the ranks still
active; the hook issues, with zeros, exactly the collectives an active rank's forward and backward
issue (see `DistributedDataParallel.forward`), so nobody waits for a partner that left. When all
have joined, `post_hook` copies the model of the last rank to join onto every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ..engine.collectives import DEFAULT_TIMEOUT, all_reduce, broadcast_tensors, wait
from ..engine.device import object_device

if TYPE_CHECKING:
    from .ddp import DistributedDataParallel

__all__ = ["DDPJoinHook", "all_reduce_flag", "find_common_rank"]


def find_common_rank(group: dist.ProcessGroup, rank: int, candidate: bool) -> int:
    """The highest rank among those passing `candidate=True` (every rank must call this)."""
    t = all_reduce(group, torch.tensor([rank if candidate else -1], device=object_device(group)),
                   dist.ReduceOp.MAX, "all-reduce to agree on an authoritative rank")
    common = int(t.item())  # once, when the last rank joins: off the step path
    if common < 0:
        raise RuntimeError("gradsync join: no rank could serve as the authoritative copy")
    return common


def all_reduce_flag(group: dist.ProcessGroup, value: bool) -> dist.Work:
    """Start a sum of one flag per rank; joined ranks contribute False."""
    return group.allreduce([torch.tensor([1.0 if value else 0.0], device=object_device(group))])


class DDPJoinHook(JoinHook):
    """The joined rank's side of every collective of `DistributedDataParallel`."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        flag = torch.zeros(1, device=object_device(ddp.process_group))
        wait(ddp.process_group.allreduce([flag]), "join: backward-sync flag", ddp.process_group, DEFAULT_TIMEOUT)
        should_sync = flag.item() > 0
        ddp._sync_buffers_from_active_rank(is_active=False)
        ddp.require_forward_param_sync = should_sync
        if should_sync and ddp.reducer is not None:
            ddp.reducer.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        owner = ddp.reducer.shard_owner() if ddp.reducer is not None and ddp.reducer.shard_owner else None
        if owner is not None:  # a sharded optimizer's gathers still on their way (overlapped)
            owner.wait_parameters()  # type: ignore[attr-defined]
        src = find_common_rank(ddp.process_group, ddp.process_group.rank(), is_last_joiner)
        tensors = [p.detach() for p in ddp.module.parameters()]
        if ddp.forward_sync_buffers:
            tensors += ddp._buffers_to_sync
        broadcast_tensors(ddp.process_group, tensors, src=src)
