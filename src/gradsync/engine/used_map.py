"""Which parameters each rank used: the map the unused-parameter search reduces across ranks.

A parameter's hook marks it used when it fires with a gradient. The map is filled even outside
synchronised steps (no_sync) and cleared only once a reduction has used it, so a parameter used
only in an earlier micro-step still counts as used when the gradients are finally reduced. A
parameter unused on every rank keeps its `.grad` exactly as torch leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["UsedMap"]


class UsedMap:
    """This rank's used flags, and their reduction (a sum, or every rank's map to report)."""

    def __init__(self, names: Sequence[str], group: dist.ProcessGroup) -> None:
        self.names = list(names)
        self.group = group
        self.local = bytearray(len(self.names))
        self.last_report: dict[str, list[int]] = {}  # {name: ranks that left it unused}
        self._work: dist.Work | None = None
        self._sum: torch.Tensor | None = None
        self._maps: list[torch.Tensor] = []
        self._all_local = False  # every parameter used on this rank (so on some rank)
        self._ones = [1] * len(self.names)

    def clear(self) -> None:
        self.local = bytearray(len(self.names))

    def start(self, device: torch.device, report: bool) -> None:
        """Start the reduction of this rank's map (all-gathered, with `report`, to say who)."""
        self._all_local = all(self.local)
        local = torch.frombuffer(bytearray(self.local), dtype=torch.uint8)
        if device.type == "cuda":  # through pinned memory, so the copy does not stop the host
            local = local.pin_memory().to(device, non_blocking=True)
        self._sum = local.to(device=device, dtype=torch.int32)
        if report:
            self._maps = [torch.zeros_like(self._sum) for _ in range(self.group.size())]
            self._work = self.group.allgather([self._maps], [self._sum])
        else:
            self._maps = []
            self._work = self.group.allreduce([self._sum])

    @property
    def started(self) -> bool:
        return self._work is not None

    def finish(self, wait: Callable[[dist.Work, str], None]) -> list[int] | None:
        """Per parameter, nonzero if some rank used it (the number of ranks that did, unless
        this rank used them all: then ones, unread). None if no reduction was started."""
        if self._work is None or self._sum is None:
            return None
        work, self._work = self._work, None
        wait(work, "reduction of the used-parameter map")
        if not self._maps:
            # Used here means used: only a map with a zero needs reading (a host sync on a GPU).
            return self._ones if self._all_local else self._sum.tolist()
        per_rank = [m.tolist() for m in self._maps]
        world = range(len(per_rank))
        self.last_report = {
            name: [r for r in world if not per_rank[r][i]]
            for i, name in enumerate(self.names)
            if not all(per_rank[r][i] for r in world)
        }
        return [sum(m[i] for m in per_rank) for i in range(len(self.names))]

    def abandon(self) -> None:
        self._work = None
