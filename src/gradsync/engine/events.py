"""Device time for the timeline: when gradients were computed and reduced, not when the host
queued the work.

On a GPU the host runs ahead, so a host clock read at a hook, a launch or a Future's completion
tells when work was enqueued. `EventClock` records a CUDA event on the current stream instead
and hands the timeline a token; a finished iteration's tokens become nanoseconds (on the host
clock's scale, anchored once) only when its events have passed (`landed`), asked without a
sync, or when someone reads the history (`resolve_timeline`). A bucket's completion is timed
on a side stream made to wait for its collective (`after`), so it fires when the reduction
ends, whatever the compute stream is doing.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from typing import Any

from .device import CudaCalls, DeviceCalls
from .timeline import UNTIMED, EventKind, IterationTimeline

__all__ = ["EventClock", "final_reading", "last_tokens", "resolve_timeline"]


class EventClock:
    """A clock for the Reducer's timeline whose readings are CUDA events (as tokens).

    Reading it records an event: the Reducer reads it a few times per bucket and per
    iteration, and per gradient only on sampled iterations (`ReducerConfig.time_gradients_every`);
    the other gradients' readings are `UNTIMED` and resolve to the next timed reading."""

    def __init__(
        self,
        new_event: Callable[[], Any] | None = None,
        side_stream: Callable[[], contextlib.AbstractContextManager] | None = None,
        host_ns: Callable[[], int] = time.perf_counter_ns,
        calls: DeviceCalls | None = None,
    ) -> None:
        if new_event is None or side_stream is None:
            calls = calls or CudaCalls()
            new_event = new_event or calls.event
            side_stream = side_stream or calls.side_stream
        self._new_event, self._side_stream, self._host_ns = new_event, side_stream, host_ns
        self._tokens = itertools.count(1)  # next() is atomic: hooks and comm threads both read
        self._events: dict[int, Any] = {}
        self._anchor: tuple[Any, int] | None = None  # (event, host ns when it was recorded)
        self._free: list[Any] = []  # events forgotten, recorded again rather than made anew

    def __call__(self) -> int:
        try:
            event = self._free.pop()  # hooks and comm threads both read: no check-then-pop
        except IndexError:
            event = self._new_event()
        event.record()
        token = next(self._tokens)
        self._events[token] = event
        if self._anchor is None:
            self._anchor = (event, self._host_ns())
        return token

    def after(self, waitable: Any, events: list, kind: int, index: int) -> None:
        """Append `(token, kind, index)` timed when `waitable` (a Work or a Future) completes on
        the device: a side stream waits for it, then records."""
        with self._side_stream():
            waitable.wait()  # stream-side: the side stream waits, the host does not
            events.append((self(), kind, index))

    def landed(self, tokens: list[int]) -> bool:
        """Whether these readings have all happened on the device (asked, never waited for)."""
        return all(t not in self._events or self._events[t].query() for t in tokens)

    def ns(self, token: int, landed: bool = False) -> int:
        """A reading in nanoseconds (0 stays 0: nothing was recorded). Waits for it if needed
        (not asked when the caller knows it has `landed`)."""
        event = self._events.get(token)
        if event is None or self._anchor is None:
            return 0
        anchor, anchor_ns = self._anchor
        if not landed and not event.query():
            event.synchronize()
        return anchor_ns + round(anchor.elapsed_time(event) * 1e6)

    def forget_through(self, token: int) -> None:
        """Drop readings up to `token` (resolved, or never to be), keeping the anchor; their
        events are recorded again by later readings (a CUDA event is made and destroyed by
        the driver: a few microseconds of host time each, a dozen a step). The readings are
        kept in the order taken, so this looks no further than `token`."""
        anchor = self._anchor[0] if self._anchor is not None else None
        for t in list(self._events):
            if t > token:
                break
            if self._events[t] is not anchor:
                self._free.append(self._events.pop(t))  # nothing refers to it any more


def resolve_timeline(timeline: IterationTimeline, clock: EventClock,
                     landed: bool = False) -> IterationTimeline:
    """Turn a finished timeline's tokens into nanoseconds, in place (and return it). An
    `UNTIMED` reading (a gradient on an iteration not sampled) takes the next timed reading
    after it on the compute stream (a bucket's ready or launch), the end of backward if none:
    when it was ready at the latest. `landed`: the caller has seen the iteration's last events
    pass (nothing to ask or wait for)."""
    last = final_reading(timeline)
    timeline.start_ns = clock.ns(timeline.start_ns, landed)
    timeline.forward_start_ns = clock.ns(timeline.forward_start_ns, landed)
    timeline.backward_end_ns = clock.ns(timeline.backward_end_ns, landed)
    timeline.finish_ns = clock.ns(timeline.finish_ns, landed)
    timeline.backward_returned_ns = clock.ns(timeline.backward_returned_ns, landed)
    resolved, later = [], timeline.backward_end_ns
    for t, k, i in reversed(timeline.events):
        if t == UNTIMED:
            t = later
        else:
            t = clock.ns(t, landed)
            if k != EventKind.COMPLETE:  # on the compute stream, as the gradients are
                later = t
        resolved.append((t, k, i))
    resolved.reverse()
    timeline.events[:] = resolved
    clock.forget_through(last)
    return timeline


def final_reading(timeline: IterationTimeline) -> int:
    """The iteration's last reading on the compute stream: every reading up to it is this
    iteration's or an earlier one's (a completion can be read later, from a comm thread)."""
    return max(timeline.finish_ns, timeline.backward_end_ns, timeline.start_ns)


def last_tokens(timeline: IterationTimeline) -> list[int]:
    """The readings whose passing means the whole iteration has (its end, its completions)."""
    return [timeline.finish_ns] + [t for t, k, _ in timeline.events if k == EventKind.COMPLETE]
