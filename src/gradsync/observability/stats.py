"""What each iteration cost, from the Reducer's timelines: computed on demand, never on the hot
path. The Reducer only appends events; everything here reads them afterwards.

Times are milliseconds from the end of forward (`prepare_for_backward`). Communication is
*exposed* when it is still running after the last gradient became ready: that part of the step
waited for the network instead of hiding behind backward.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from ..engine.timeline import EventKind, IterationTimeline

__all__ = ["BucketStats", "IterationStats", "Stats"]

_MS = 1e-6


@dataclasses.dataclass(frozen=True)
class BucketStats:
    """One bucket in one iteration."""

    index: int
    num_params: int
    nbytes: int
    ready_ms: float
    """When its last gradient arrived."""
    launch_ms: float
    """When its all-reduce (or communication hook) started."""
    complete_ms: float
    """When its reduction finished."""

    @property
    def comm_ms(self) -> float:
        return self.complete_ms - self.launch_ms


@dataclasses.dataclass(frozen=True)
class IterationStats:
    """One synchronised iteration."""

    iteration: int
    backward_ms: float
    """From the end of forward until the last gradient was ready."""
    comm_ms: float
    """From the first bucket's launch until the last bucket's completion."""
    exposed_comm_ms: float
    """Communication still running after the last gradient was ready."""
    total_ms: float
    """From the end of forward until the gradients were written back."""
    nbytes: int
    buckets: tuple[BucketStats, ...]

    @property
    def overlap_ratio(self) -> float:
        """Share of the communication hidden behind backward (1.0: all of it)."""
        return 1.0 - self.exposed_comm_ms / self.comm_ms if self.comm_ms > 0 else 1.0

    @classmethod
    def from_timeline(cls, tl: IterationTimeline) -> IterationStats:
        ready = tl.times(EventKind.READY)
        ready.update({i: t for i, t in tl.times(EventKind.UNUSED).items() if i not in ready})
        bucket_ready, launch = tl.times(EventKind.BUCKET_READY), tl.times(EventKind.LAUNCH)
        complete = tl.times(EventKind.COMPLETE)
        last_ready = max(ready.values(), default=0) * _MS
        end = (tl.finish_ns - tl.start_ns) * _MS
        buckets = tuple(
            BucketStats(
                index=b,
                num_params=len(members),
                nbytes=tl.bucket_bytes[b],
                ready_ms=bucket_ready.get(b, 0) * _MS,
                launch_ms=launch.get(b, 0) * _MS,
                complete_ms=complete.get(b, tl.finish_ns - tl.start_ns) * _MS,
            )
            for b, members in enumerate(tl.bucket_indices)
        )
        first_launch = min((b.launch_ms for b in buckets), default=0.0)
        last_complete = max((b.complete_ms for b in buckets), default=0.0)
        return cls(
            iteration=tl.iteration,
            backward_ms=last_ready,
            comm_ms=max(last_complete - first_launch, 0.0),
            # Only what runs after the last gradient is ready, and after communication began.
            exposed_comm_ms=max(last_complete - max(last_ready, first_launch), 0.0),
            total_ms=end,
            nbytes=sum(tl.bucket_bytes),
            buckets=buckets,
        )


@dataclasses.dataclass(frozen=True)
class Stats:
    """The last iteration and aggregates over the retained window of iterations."""

    iterations: int
    """Synchronised iterations run so far."""
    window: tuple[IterationStats, ...]
    """The most recent iterations (as many as the Reducer keeps)."""

    @property
    def last(self) -> IterationStats | None:
        return self.window[-1] if self.window else None

    def median(self, field: str) -> float:
        """Median of an IterationStats field (or property) over the window."""
        values = [getattr(s, field) for s in self.window]
        return statistics.median(values) if values else 0.0

    @classmethod
    def from_timelines(cls, iterations: int, timelines: Sequence[IterationTimeline]) -> Stats:
        done = [t for t in timelines if t.finish_ns]
        return cls(
            iterations=iterations, window=tuple(IterationStats.from_timeline(t) for t in done)
        )

    def __str__(self) -> str:
        last = self.last
        if last is None:
            return "gradsync stats: no synchronised iteration yet"
        lines = [
            f"gradsync stats: {self.iterations} synchronised iterations; last = #{last.iteration}, "
            f"median over the last {len(self.window)}",
            f"  {'':22s} {'last':>9s} {'median':>9s}",
        ]
        for label, field in [
            ("backward (ms)", "backward_ms"),
            ("communication (ms)", "comm_ms"),
            ("exposed comm (ms)", "exposed_comm_ms"),
            ("until grads (ms)", "total_ms"),
            ("overlap ratio", "overlap_ratio"),
        ]:
            lines.append(f"  {label:22s} {getattr(last, field):9.3f} {self.median(field):9.3f}")
        lines.append(f"  bytes reduced / iter   {last.nbytes:9d}")
        lines.append("  bucket  params     bytes   ready  launch  complete  (ms)")
        for b in last.buckets:
            lines.append(
                f"  {b.index:6d} {b.num_params:7d} {b.nbytes:9d} {b.ready_ms:7.3f} "
                f"{b.launch_ms:7.3f} {b.complete_ms:9.3f}"
            )
        return "\n".join(lines)
