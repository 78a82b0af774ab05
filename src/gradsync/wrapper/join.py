"""Uneven inputs: what a rank that has run out of batches does while the others still train.

torch's `Join` context calls `main_hook` on a joined rank once per iteration of the ranks still
active; the hook issues, with zeros, exactly the collectives an active rank's forward and backward
issue (see `DistributedDataParallel.forward`), so nobody waits for a partner that left. When all
have joined, `post_hook` copies the model of the last rank to join onto every rank.

The hook sees the wrapper only through `JoinedWrapper`: torch's public names, which this module
reads and writes as torch's join hook does, and the buffers it is handed.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ..engine.collectives import DEFAULT_TIMEOUT, all_reduce, broadcast_tensors, wait
from ..engine.device import object_device
from .views import WrapperView

__all__ = [
    "DDPJoinHook",
    "JoinedWrapper",
    "all_reduce_flag",
    "check_joinable",
    "find_common_rank",
    "sync_buffers_from_active_rank",
]


class JoinedWrapper(WrapperView, Protocol):
    """What a joined rank's hook needs of its wrapper: torch's public names."""

    require_forward_param_sync: bool

    def will_sync_module_buffers(self) -> bool: ...


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


def sync_buffers_from_active_rank(
    group: dist.ProcessGroup, buffers: list[torch.Tensor], is_active: bool, inside_join: bool
) -> None:
    """Broadcast `buffers` from rank 0, or, inside an enabled join(), from the highest rank still
    training: rank 0 may have joined and hold stale buffers. Every rank calls it at the same
    point, an active one from its forward, a joined one from `main_hook`."""
    src = find_common_rank(group, group.rank(), is_active) if inside_join else 0
    broadcast_tensors(group, buffers, src=src)


def check_joinable(delayed: bool, auto: bool) -> None:
    """Refuse join() for the wrapper's options whose collectives a joined rank cannot mirror."""
    if delayed:
        raise NotImplementedError(
            "gradsync: join() does not support delay_all_reduce_named_params yet (a joined "
            "rank cannot know where in backward the delayed all-reduce falls)"
        )
    if auto:
        raise NotImplementedError(
            'gradsync: join() does not support bucket_cap_mb="auto" yet (planning and its '
            "trial run collectives a joined rank would not join); pass a number"
        )


class DDPJoinHook(JoinHook):
    """The joined rank's side of every collective of `DistributedDataParallel`."""

    def __init__(self, ddp: JoinedWrapper, buffers: list[torch.Tensor]) -> None:
        self.ddp = ddp
        self.buffers = buffers  # those the wrapper broadcasts (`exclude_from_sync` left out)

    def main_hook(self) -> None:
        ddp, group = self.ddp, self.ddp.process_group
        flag = torch.zeros(1, device=object_device(group))
        wait(group.allreduce([flag]), "join: backward-sync flag", group, DEFAULT_TIMEOUT)
        should_sync = flag.item() > 0
        # torch's Join runs main hooks only when enabled: the source is found among active ranks.
        if ddp.will_sync_module_buffers():
            sync_buffers_from_active_rank(group, self.buffers, is_active=False, inside_join=True)
        ddp.require_forward_param_sync = should_sync
        if should_sync and ddp.reducer is not None:
            ddp.reducer.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        owner = (
            ddp.reducer.shard_owner()
            if ddp.reducer is not None and ddp.reducer.shard_owner
            else None
        )
        if owner is not None:  # a sharded optimizer's gathers still on their way (overlapped)
            owner.wait_parameters()  # type: ignore[attr-defined]
        if ddp.reducer is not None:  # the last step's buckets landed and stepped first
            ddp.reducer.land()  # (overlap_optimizer): the broadcast overwrites parameters
        src = find_common_rank(ddp.process_group, ddp.process_group.rank(), is_last_joiner)
        tensors = [p.detach() for p in ddp.module.parameters()]
        if ddp.forward_sync_buffers:
            tensors += self.buffers
        broadcast_tensors(ddp.process_group, tensors, src=src)
