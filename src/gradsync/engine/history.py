"""The finished iterations' timelines: kept, published to listeners, and on a GPU resolved
into device time once their events have passed.

A timeline timed on the host is published when its iteration finishes. One timed with CUDA
events (`events.EventClock`) waits in `unresolved` until someone reads `recent`, which resolves
it (off the step path); while a listener wants every iteration, it is published as soon as its
last events have passed (asked at a later iteration's start, never waited for). Nobody looking,
the device is asked nothing: torch's reducer too reads its events on sampled iterations only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .events import EventClock, final_reading, last_tokens, resolve_timeline
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
        self.finished = 0  # iterations finished so far (kept or not)

    def last(self) -> IterationTimeline:
        """The latest finished timeline (its order is final; on a GPU its times may not be)."""
        return self.unresolved[-1] if self.unresolved else self._recent[-1]

    def add(self, timeline: IterationTimeline, device_timed: bool) -> None:
        """An iteration finished: publish it, or (device time) once its events have passed."""
        self.finished += 1
        if not device_timed:
            self._publish(timeline)
            return
        self.unresolved.append(timeline)
        if len(self.unresolved) > (self._recent.maxlen or 0) and not self._listened():
            # Older than the last `keep`: `recent` would drop it unread. Its events go unasked.
            dropped = self.unresolved.popleft()
            assert self.device_clock is not None, "device-timed without a device clock"
            self.device_clock.forget_through(final_reading(dropped))

    def publish_landed(self) -> None:
        """Publish, oldest first, the device-timed timelines whose events have all passed,
        if a listener wants every iteration (else they wait to be read)."""
        clock = self.device_clock
        if clock is None or not self.unresolved or not self._listened():
            return
        while self.unresolved and clock.landed(last_tokens(self.unresolved[0])):
            self._publish(resolve_timeline(self.unresolved.popleft(), clock, landed=True))

    def _listened(self) -> bool:
        """Whether a listener wants every iteration now (one with a `wanted()` says when)."""
        return any(getattr(listener, "wanted", _always)() for listener in self.listeners)

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


def _always() -> bool:
    return True
