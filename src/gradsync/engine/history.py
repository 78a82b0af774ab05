"""The finished iterations' timelines: kept, published to listeners, and on a GPU resolved
into device time once their events have passed.

A timeline timed on the host is published when its iteration finishes. One timed with CUDA
events (`events.EventClock`) waits in `unresolved` until its last events have passed (asked at
a later iteration's start, never waited for), or until someone reads `recent`, which resolves
what is left (off the step path).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .events import EventClock, last_tokens, resolve_timeline
from .timeline import IterationTimeline

__all__ = ["Timelines"]


class Timelines:
    """The last `keep` finished timelines of one rank, and those still in flight."""

    def __init__(self, keep: int, rank: int, device_clock: EventClock | None) -> None:
        self._recent: deque[IterationTimeline] = deque(maxlen=keep)
        self.unresolved: deque[IterationTimeline] = deque()  # finished, events still in flight
        self.rank, self.device_clock = rank, device_clock
        # Called with (rank, timeline) after every synchronised iteration (the wrapper logs
        # per-iteration stats through one at GRADSYNC_DEBUG=DETAIL).
        self.listeners: list[Callable[[int, IterationTimeline], None]] = []

    @property
    def finished(self) -> int:
        """Finished iterations kept (published or still resolving)."""
        return len(self._recent) + len(self.unresolved)

    def last(self) -> IterationTimeline:
        """The latest finished timeline (its order is final; on a GPU its times may not be)."""
        return self.unresolved[-1] if self.unresolved else self._recent[-1]

    def add(self, timeline: IterationTimeline, device_timed: bool) -> None:
        """An iteration finished: publish it, or (device time) once its events have passed."""
        if device_timed:
            self.unresolved.append(timeline)
        else:
            self._publish(timeline)

    def publish_landed(self) -> None:
        """Publish, oldest first, the device-timed timelines whose events have all passed."""
        clock = self.device_clock
        while self.unresolved and clock is not None and clock.landed(last_tokens(self.unresolved[0])):
            self._publish(resolve_timeline(self.unresolved.popleft(), clock, landed=True))

    @property
    def recent(self) -> deque[IterationTimeline]:
        """The kept timelines, every one resolved (on a GPU this waits for events in flight)."""
        while self.unresolved:
            self._publish(resolve_timeline(self.unresolved.popleft(), self.device_clock))  # type: ignore[arg-type]
        return self._recent

    def _publish(self, timeline: IterationTimeline) -> None:
        self._recent.append(timeline)
        for listener in self.listeners:
            listener(self.rank, timeline)
