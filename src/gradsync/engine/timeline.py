"""What happened, and when, in one iteration of the Reducer: the raw material for stats and plans.

Recording is one `list.append` of a `(time_ns, kind, index)` tuple per event, cheap enough to
leave on. The list is in the order events happened on the backward thread; completions are
appended from the communication thread when the reduction finishes.
"""

from __future__ import annotations

import dataclasses
import time

__all__ = ["UNTIMED", "DiscardedEvents", "EventKind", "IterationTimeline", "now_ns", "untimed"]

now_ns = time.perf_counter_ns
UNTIMED = 0  # a reading not taken (a gradient's, on a device iteration not sampled)


def untimed() -> int:
    """The clock of gradients not timed: every reading `UNTIMED`."""
    return UNTIMED


class EventKind:
    """Event kinds, as small ints so the hot path appends plain tuples."""

    READY = 0  # a parameter's gradient became ready (index: parameter)
    UNUSED = 1  # a parameter was marked ready because it took no part in the graph
    BUCKET_READY = 2  # a bucket's last gradient arrived (index: bucket)
    LAUNCH = 3  # a bucket's all-reduce was started (index: bucket)
    COMPLETE = 4  # a bucket's all-reduce finished (index: bucket)
    # with an optimizer stepped per bucket (overlap_optimizer): a bucket's write-back and step
    STEP = 5  # began, once it had landed (index: bucket)
    STEPPED = 6  # ended


class DiscardedEvents(list):
    """The events list of an iteration that records nothing (`ReducerConfig.record_events`)."""

    def append(self, _event: object) -> None:
        pass


@dataclasses.dataclass
class IterationTimeline:
    """Events of one synchronised backward pass, with the bucket layout it ran under."""

    iteration: int
    start_ns: int
    bucket_indices: list[list[int]]
    bucket_bytes: list[int]
    events: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    backward_end_ns: int = 0
    finish_ns: int = 0
    forward_start_ns: int = 0
    """When the forward that led here began (0 if the caller did not say)."""
    backward_returned_ns: int = 0
    """With buckets landing in the next forward (`Reducer.lands_lazily`): when the end of
    backward returned, the buckets landed by then written back and stepped, the rest still
    reducing (0 otherwise). From `forward_start_ns` to here is what the host spent on this
    step, the waits of the last step's buckets in this forward included, idle time between
    steps (data loading, anything else running) not."""
    gradients_timed: bool = True
    """Whether each gradient's ready time was read (on a GPU only on sampled iterations; on
    the others a gradient's time is its bucket's, or the next bucket's: when it was ready at
    the latest)."""

    def times(self, kind: int) -> dict[int, int]:
        """index -> time (ns since `start_ns`) of the first event of `kind`."""
        out: dict[int, int] = {}
        for t, k, i in self.events:
            if k == kind and i not in out:
                out[i] = t - self.start_ns
        return out

    def order(self, *kinds: int) -> list[tuple[int, int]]:
        """(kind, index) of the events of the given kinds, in the order they were recorded."""
        return [(k, i) for _, k, i in self.events if k in kinds]

    def ready_order(self) -> list[int]:
        """Parameter indices in the order their gradients became ready (unused ones included)."""
        return [i for _, k, i in self.events if k in (EventKind.READY, EventKind.UNUSED)]

    def backlog_bytes(self) -> int | None:
        """Bytes of gradients still waiting for the link when backward ended, had every bucket
        been sent as it filled, one after another, at the rate the link kept in this iteration
        (its bytes over the time some collective was in flight). Holding back that many of the
        last gradients (`Reducer.send_tail_first`) costs the link no time during backward: it
        is busy with the others until backward ends. None where the timeline lacks a bucket's
        fill, launch or completion, or backward's end."""
        filled, launched = self.times(EventKind.BUCKET_READY), self.times(EventKind.LAUNCH)
        landed, count = self.times(EventKind.COMPLETE), len(self.bucket_bytes)
        if not self.backward_end_ns or any(
            b not in filled or b not in launched or b not in landed for b in range(count)
        ):
            return None
        busy, reached = 0, None  # the union of the collectives' spans
        for start, end in sorted((launched[b], landed[b]) for b in range(count)):
            if reached is None or end > reached:
                busy += end - (start if reached is None else max(start, reached))
                reached = end
        if busy <= 0:
            return None
        rate = sum(self.bucket_bytes) / busy  # bytes a nanosecond
        queued, clock = 0.0, 0
        for when, b in sorted((filled[b], b) for b in range(count)):
            queued = max(0.0, queued - (when - clock) * rate) + self.bucket_bytes[b]
            clock = max(clock, when)
        end = self.backward_end_ns - self.start_ns
        return int(max(0.0, queued - max(0, end - clock) * rate))
