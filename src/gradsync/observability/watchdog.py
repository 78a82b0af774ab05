"""The stall watchdog: when the end of backward waits too long, say who is missing.

Each rank writes the iteration it has reached to the process group's store (a key per rank, one
`set` per iteration, only while the watchdog is on). A rank that has waited `warn_after` for its
buckets reads those keys, with the store's own timeout, never a collective, and logs which
buckets are pending and which ranks have not reached this iteration; the same report is appended
to the error raised when the reducer's timeout runs out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from ..engine.errors import format_names

__all__ = ["StallWatchdog"]


class StallWatchdog:
    """Progress marks in a store, and the report built from them."""

    def __init__(
        self,
        warn_after: timedelta,
        store: dist.Store | None,
        rank: int,
        world_size: int,
        prefix: str = "gradsync",
    ) -> None:
        if warn_after.total_seconds() <= 0:
            raise ValueError(f"warn_after={warn_after} must be positive")
        self.warn_after = warn_after
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.prefix = prefix

    def mark_progress(self, iteration: int) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/progress/{self.rank}", str(iteration))

    def progress(self) -> dict[int, int | None]:
        """rank -> last iteration it started (None: never reported); {} without a store."""
        if self.store is None:
            return {}
        out: dict[int, int | None] = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/progress/{r}"
            out[r] = int(self.store.get(key)) if self.store.check([key]) else None
        return out

    def report(
        self, iteration: int, waited: timedelta, pending: Sequence[tuple[int, Sequence[str]]]
    ) -> str:
        lines = [
            f"gradsync: rank {self.rank} has waited {waited.total_seconds():.1f}s at the end of "
            f"backward in iteration {iteration}; pending buckets:"
        ]
        for index, names in pending:
            lines.append(f"  bucket {index}: {format_names(list(names), 6)}")
        lines.append(f"  all of rank {self.rank}'s gradients were ready (it is waiting on others)")
        progress = self.progress()
        if progress:
            behind = {r: it for r, it in progress.items() if it is None or it < iteration}
            if behind:
                described = ", ".join(
                    f"rank {r} ({'never started' if it is None else f'at iteration {it}'})"
                    for r, it in sorted(behind.items())
                )
                lines.append(f"  ranks that have not reached iteration {iteration}: {described}")
            else:
                lines.append(
                    f"  every rank has reached iteration {iteration}: one is slow inside it, or "
                    "skipped its backward"
                )
        else:
            lines.append("  (no store given: cannot tell which ranks are behind)")
        return "\n".join(lines)

    def publish_missing(self, iteration: int, missing: Sequence[str]) -> dict[int, list[str]]:
        """Share this rank's never-ready parameters; return what other ranks shared so far."""
        if self.store is None:
            return {}
        self.store.set(f"{self.prefix}/missing/{iteration}/{self.rank}", json.dumps(list(missing)))
        seen: dict[int, list[str]] = {}
        for r in range(self.world_size):
            key = f"{self.prefix}/missing/{iteration}/{r}"
            if r != self.rank and self.store.check([key]):
                seen[r] = json.loads(self.store.get(key))
        return seen
