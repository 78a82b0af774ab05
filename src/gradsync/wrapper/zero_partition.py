"""Who steps which parameter under ZeRO-1, and how each owner's updates reach the other ranks.

The partition is torch's: per parameter group, largest first, each parameter to the rank holding
the fewest elements so far (counting the groups before it), so the same parameters end on the
same ranks as under torch's `ZeroRedundancyOptimizer`. After the step every owner broadcasts its
parameters; with `parameters_as_bucket_view` each owner's contiguous parameters of a group view
one flat buffer per dtype and device, which is broadcast where it lies, with no copy in or out.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from ..engine.bucket import view_like
from ..engine.collectives import Broadcasts
from .zero_shards import Piece

__all__ = ["Partition", "flat_views"]


class Partition:
    """The owners of the parameters, group by group, and the flat buffers they view."""

    def __init__(self, world_size: int, as_bucket_view: bool) -> None:
        self.as_bucket_view = as_bucket_view
        self.groups: list[list[list[torch.Tensor]]] = []  # [group][rank] -> parameters
        self.loads = [0] * world_size  # elements owned per rank so far
        # (owner, a flat buffer its parameters view)
        self.flats: list[tuple[int, torch.Tensor]] = []
        self.viewed: set[int] = set()  # ids of the parameters that view one

    def add_group(self, params: list[torch.Tensor]) -> None:
        """Partition one more group, after (and continuing the loads of) those before it."""
        per_rank: list[list[torch.Tensor]] = [[] for _ in self.loads]
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            rank = self.loads.index(min(self.loads))
            per_rank[rank].append(p)
            self.loads[rank] += p.numel()
        self.groups.append(per_rank)
        self._view(per_rank)

    def _view(self, part: list[list[torch.Tensor]]) -> None:
        """`parameters_as_bucket_view` (as torch's keyword): each owner's contiguous parameters
        of one group become views of a flat buffer per dtype and device. Parameters whose
        memory has another layout travel as before (`Broadcasts`). As under torch's class,
        replacing a parameter's `.data` afterwards (`model.to(...)`) cuts it off its buffer."""
        if not self.as_bucket_view:
            return
        for rank, params in enumerate(part):
            for buffer, members in flat_views(params):
                self.flats.append((rank, buffer))
                self.viewed.update(id(p) for p in members)

    def owner(self, param: torch.Tensor) -> int:
        """The rank that steps `param`."""
        for part in self.groups:
            for rank, params in enumerate(part):
                if any(p is param for p in params):
                    return rank
        raise KeyError("ZeroRedundancyOptimizer.owner: not one of this optimizer's parameters")

    def owned(self, rank: int) -> int:
        """How many parameters `rank` steps."""
        return sum(len(part[rank]) for part in self.groups)

    def pieces(self, rank: int, position: dict[int, int]) -> list[list[Piece]]:
        """`rank`'s parameters per group, each a whole piece; `position` maps id(parameter)
        to its index over all groups."""
        return [
            [Piece(position[id(p)], 0, p.numel(), True, p, None) for p in part[rank]]
            for part in self.groups
        ]

    def broadcast(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        """Every owner's broadcasts in flight at once (as torch's class), then waited for."""
        broadcasts = Broadcasts(group, timeout)
        for rank, buffer in self.flats:
            broadcasts.start_in_place(
                buffer, rank, f"broadcast of the parameters rank {rank} stepped"
            )
        for rank in range(len(self.loads)):
            owned = [p for part in self.groups for p in part[rank] if id(p) not in self.viewed]
            if owned:
                broadcasts.start(owned, rank, f"broadcast of the parameters rank {rank} stepped")
        broadcasts.finish()


def flat_views(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """One flat buffer per dtype and device holding these contiguous parameters' values, each
    parameter's `.data` now a view of it with the parameter's own strides; with the parameters
    that view each."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.is_contiguous():
            kinds.setdefault((p.dtype, p.device), []).append(p)
    buffers = []
    with torch.no_grad():
        for (dtype, device), members in kinds.items():
            buffer = torch.empty(sum(p.numel() for p in members), dtype=dtype, device=device)
            starts = itertools.accumulate((p.numel() for p in members), initial=0)
            for start, p in zip(starts, members):
                # With its own strides (`view_like`, not `view_as`): a weight contiguous in two
                # memory formats at once (a channels-last conv weight with one input channel)
                # keeps the one it had, and so do the kernels its convolution picks, and its bits.
                view = view_like(buffer, start, p)
                view.copy_(p.detach())
                p.data = view
            buffers.append((buffer, members))
    return buffers
