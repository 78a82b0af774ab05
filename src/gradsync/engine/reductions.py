"""Every bucket's reduction, owned by one object from launch to landing.

A bucket's last gradient has come (`Reducer._mark` counted it): `Reductions.fill` copies the
gradients in, divided by the world size unless a hook or mixed precision divides later. Then,
strictly in order, `start_ready` starts every full bucket's collective (`_start`: an
all-reduce, or a reduce-scatter of sharded gradients) or hands the bucket to the communication
hook (`_call_hook`; an unknown hook only once the previous bucket's Future has completed).
At the end of backward `write_back` lands each bucket (`finish`: its work waited for, a sharded
bucket's shard taken and its buffer given back, a hook's result checked and taken) and writes
the averages into `.grad`, checking every rank's report before the last write-back; an
optimizer stepped per bucket steps each as soon as it is written back (`BucketStepper`),
while the later buckets are still on the wire.

Each bucket's progress in the iteration is one `Flight` (its work or its hook's Future, and
its `Stage`), held here and nowhere else; the stages only move forward, and every step checks
the one before (a bucket started twice, landed before it was started, or written back before it
landed is a bug, and asserted). What is sent when, and what waits for what, is decided here
alone: the place to change the order of the buckets, split them, or act on each as it lands.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .bucket import Bucket, Collective
from .bucket_set import BucketSet
from .checks import check_finite, check_finite_later
from .comm import CommHook, GradBucket, averages_by_one_allreduce, check_hook_result, hook_name
from .device import DeviceCalls, on_stream
from .errors import GradSyncError, ReductionTimeoutError
from .events import EventClock
from .iteration import Iteration
from .missing import missing_gradients_error
from .reports import ReportChecks
from .settings import Settings
from .timeline import EventKind
from .used_map import UsedMap
from .waits import Waits

__all__ = ["QUIESCE_S", "BucketStepper", "Flight", "Reductions", "Stage", "profiled", "quiesce"]


class Stage(enum.IntEnum):
    """How far a bucket's reduction has come in the current iteration."""

    FILLING = 0  # gradients still coming
    STARTED = 1  # its collective, or its hook's, is in flight
    LANDED = 2  # its reduced values are in the bucket (a sharded one's: in its shard)
    WRITTEN = 3  # written back into `.grad`


class BucketStepper(Protocol):
    """What steps each bucket as it lands (`Reducer.step_each_bucket`): an optimizer."""

    def backward_ended(self, pending: Sequence[Bucket]) -> None:
        """Backward has ended with `pending` still reducing, to land later (lazily)."""

    def landing(self, bucket: Bucket) -> None:
        """`bucket` has landed and is about to be written back into `.grad`."""

    def written(self, bucket: Bucket) -> None:
        """`bucket`'s averages are in `.grad`: step its parameters (now, or at the step)."""

    def may_land_later(self, bucket: Bucket) -> bool:
        """Whether `bucket` may land after backward: every parameter of it is stepped here.
        Else it lands as backward ends, as without a stepper: another optimizer (or code that
        reads a gradient) steps the others right after backward, from their averages."""


class Flight:
    """One bucket's reduction in one iteration: what was started, and how it ends.

    The defaults live on the class and an instance holds only what its iteration set: one is
    made per bucket per iteration, and an `__init__` storing seven fields costs more host time
    than the rest of the bucket's bookkeeping on the default path."""

    stage: Stage = Stage.FILLING
    work: dist.Work | None = None
    """The collective started (None with a hook, whose `future` it is then)."""
    stream: Any = None
    """On a GPU: the stream the bucket was filled on, where its hook runs."""
    future: torch.futures.Future | None = None
    view: GradBucket | None = None
    """What the hook was given (its `set_buffer` says what shape its result must have)."""
    hook_done: threading.Event | None = None
    """Set once the hook's Future has completed (or the hook raised: `error`)."""
    error: Exception | None = None


class Reductions:
    """Starts, lands and writes back the buckets of `bucket_set` over `group`."""

    def __init__(self, settings: Settings, bucket_set: BucketSet, group: dist.ProcessGroup,
                 checks: ReportChecks, waits: Waits, used: UsedMap,
                 calls: DeviceCalls | None) -> None:
        self.settings, self.bucket_set, self.group = settings, bucket_set, group
        self.checks, self.waits, self.used, self.calls = checks, waits, used, calls
        self.names, self.rank = bucket_set.names, group.rank()
        self.buckets: list[Bucket] = []  # the layout's (`set_order`)
        self.flights: list[Flight] = []
        self._cleared = True  # nothing of an iteration left to drop
        self.order: list[int] = []  # the order to start the buckets in (`set_order`)
        self._by_index: list[int] = []
        self._starts: list[int] = []  # this iteration's (by index with a hook)
        self.started = 0  # buckets before it have been started (handed to the hook), in order
        self.next_index = 0  # the bucket to start next (-1: all started)
        self.settled = 0  # transient buckets before it have landed and given their buffers back
        self._tail_from = 0  # the tail's first position in `order` (`set_order`)
        self._tail: frozenset[int] = frozenset()  # its buckets
        self._credit = 0  # bytes of the tail's chunks reducing at once (0: no limit; `begin`)
        self.hooked = False  # this iteration's buckets go through the communication hook
        self.hook_waiting = False  # buckets full and in order wait for their predecessor's Future
        self._hooks_in_order = False  # this iteration's hook goes without waiting (`begin`)
        self._released = 0  # with a hook: buckets full and in order, free to go to it
        self._hooked_count = 0  # with a hook: buckets handed to it
        self._lock = threading.RLock()  # the hook's launches: from gradient hooks of any thread
        self._launching = False
        # Told of each bucket as it is written back, while later ones may still be reducing:
        # an optimizer stepped per bucket (`Reducer.step_each_bucket`); `lazily`: after
        # backward, each where its parameters are needed (`lands_lazily`).
        self.stepper: BucketStepper | None = None
        self.lazily = False
        self.written = 0  # buckets written back this iteration
        self.written_with: list[int] | None = None  # the used map they were written with
        self._reports_started = False

    def set_order(self, order: list[int] | None) -> None:
        """A new layout's buckets (`bucket_set`'s), and the order to start them in
        (`layout.priority_tail`); None: by index, as they fill in ready order."""
        self.buckets = self.bucket_set.buckets
        self.flights[:] = [Flight() for _ in self.buckets]  # the same list: `quiesce` holds it
        self._cleared = True
        self._by_index = list(range(len(self.buckets)))
        self.order = order if order is not None else self._by_index
        # where the tail sent nearest the input first begins in the order (the head is started
        # by index): a credit holds back the tail's chunks only
        self._tail_from = next((p for p, i in enumerate(self.order) if i != p), len(self.order))
        self._tail = frozenset(self.order[self._tail_from:])

    # ----------------------------------------------------------------------- iteration

    def begin(self, it: Iteration) -> None:
        """A new iteration: every bucket filling, nothing started."""
        s = self.settings
        assert self._cleared, "an iteration began before the last one was cleared"
        self._cleared = False  # its flights are fresh (`clear`, `set_order`)
        self.started = self.settled = self._released = self._hooked_count = self.written = 0
        self._reports_started, self.written_with = False, None
        # Sharded buckets run a registered hook themselves, as a reduce-scatter (`BucketSet.shard`).
        self.hooked = s.comm_hook is not None and self.bucket_set.shards is None
        self.hook_waiting = False
        # the hook's chain runs by index, as torch hands it buckets
        self._starts = self._by_index if self.hooked else self.order
        self.next_index = self._starts[0]
        # Landing in the next forward, the tail's chunks go within a credit of bytes in flight.
        self._credit = s.config.credit_bytes if self.lands_lazily() else 0
        # Known hooks that issue their one all-reduce inside the call go as their buckets fill.
        self._hooks_in_order = self.hooked and averages_by_one_allreduce(s.comm_hook[1])  # type: ignore[index]
        it.reports_in_tail = self.reports_in_tail()

    def clear(self) -> None:
        """Drop what an iteration left (finished or abandoned): each bucket's state reset, a
        transient buffer still reducing not lent again. Once: until the next `begin`."""
        if self._cleared:
            return
        for bucket, flight in zip(self.buckets, self.flights):
            bucket.reset(reusable=flight.work is None or flight.work.is_completed())
        self.flights[:], self._cleared = [Flight() for _ in self.buckets], True

    def reports_in_tail(self) -> bool:
        """Whether this rank's report rides after the last bucket's gradients in its
        all-reduce (free), when that bucket is the last started. Not with a hook (a tiny
        all-reduce of its own, after every bucket), nor read back deferred (in int64, never
        saturated, no follow-up collective), nor under mixed precision (more elements would
        change how gloo sums a bucket in its own dtype, and torch's hook sends the gradients
        alone), nor with the tail sent first (`layout.priority_tail`)."""
        s = self.settings
        return (s.comm_hook is None and not s.divides_after_sum and not s.defer
                and self.buckets[-1].has_tail and self._starts[-1] == len(self.buckets) - 1)

    # ----------------------------------------------------------------------- filling

    def divisor(self, it: Iteration) -> int:
        """What a bucket's gradients are divided by as they go in: the ranks averaged over, or
        1 (copied as they are) where a communication hook averages itself (torch's protocol)
        or mixed precision divides each bucket's sum (`Bucket.divides_after_sum`). Dividing by
        1 is skipped: a world of one (one GPU) makes no pass over its buckets to scale them."""
        s = self.settings
        return it.divisor if s.comm_hook is None and not s.divides_after_sum else 1

    def fill(self, it: Iteration, bucket: Bucket) -> None:
        """Every gradient of `bucket` has come: copy them in (on a GPU, on the stream the last
        one came on, made to wait for the stream backward began on, should they differ, so the
        fill reads finished gradients; as in torch's reducer, a third stream is not waited for)."""
        if bucket.sparse:
            self._fill_sparse(it, bucket)
            return
        config = self.settings.config
        if config.check_finite:
            self._check_finite(it, bucket)
        if self.calls is not None:
            stream = self.calls.current_stream()
            if it.backward_stream is not None and it.backward_stream != stream:
                stream.wait_stream(it.backward_stream)
            self.flights[bucket.index].stream = stream
        bucket.fill(self.divisor(it), config.gradient_as_bucket_view)

    def _check_finite(self, it: Iteration, bucket: Bucket) -> None:
        grads, names = ([p.grad for p in bucket.params],
                        [self.names[i] for i in bucket.param_indices])
        if not self.settings.defer:
            check_finite(grads, names, self.rank, it.number)
        elif (pending := check_finite_later(grads, names, self.rank, it.number)) is not None:
            self.checks.add_finite(it.number, pending)  # read once landed

    def _fill_sparse(self, it: Iteration, bucket: Bucket) -> None:
        if not bucket.fill_sparse(it.divisor):
            param = bucket.params[0]
            kind = "no gradient" if param.grad is None else "a dense gradient"
            frozen = "" if param.requires_grad else (
                " (requires_grad was turned off after the wrapper was built: a sparse gradient "
                "cannot be left out as unused, in torch's DDP either; build the wrapper again)")
            raise GradSyncError(
                f"gradsync: parameter {self.names[bucket.param_indices[0]]!r} was declared to "
                f"get a sparse gradient but has {kind} in iteration {it.number} on rank "
                f"{self.rank}{frozen}. Build its module with sparse=True on every rank and use it "
                "in every iteration, or declare it dense."
            )

    # ----------------------------------------------------------------------- launching

    def start_ready(self, it: Iteration) -> bool:
        """Start, strictly in order (by index, or the layout's `order`), every bucket that is
        full and not yet started; True once every bucket is on its way."""
        buckets, s, starts = self.buckets, self.settings, self._starts
        while self.started < len(buckets) and buckets[starts[self.started]].pending == 0:
            bucket = buckets[starts[self.started]]
            if self._credit and not self._within_credit(bucket):
                break
            bucket.launch_payload(s.config.reduce_dtype if s.casts_to_reduce_dtype else None,
                                  it.divisor)
            self.started += 1
            if not self.hooked:
                self._start(it, bucket)
        self.next_index = starts[self.started] if self.started < len(buckets) else -1
        if self.hooked:
            with self._lock:
                self._released = self.started
                self._hand_to_hook(it)
        elif self.bucket_set.shards is not None and self.bucket_set.shards.transient:
            self.release_landed(it)
        return self.started == len(buckets)

    def _within_credit(self, bucket: Bucket) -> bool:
        """May `bucket` start now under the credit of bytes in flight? Outside the tail,
        always; in it, if the tail's chunks started and not yet landed leave room for it (or
        none is reducing). Counted from landings the next forward asks for, never from
        completions seen by chance: what has started at any point is the same on every rank,
        so the ranks' collectives pair up with anything else issued in between."""
        if self.started < self._tail_from:
            return True
        flying = [self.buckets[i] for i in self._starts[self._tail_from:self.started]
                  if self.flights[i].stage is Stage.STARTED]
        return not flying or sum(b.nbytes for b in flying) + bucket.nbytes <= self._credit

    def holding(self) -> bool:
        """Whether chunks of the tail wait for the credit (full, not yet started)."""
        return self.started < len(self.buckets) and self.started >= self._tail_from

    def _start(self, it: Iteration, bucket: Bucket) -> None:
        """Start `bucket`'s collective (this rank's report riding in the last one's tail)."""
        flight = self.flights[bucket.index]
        assert flight.stage is Stage.FILLING, f"bucket {bucket.index} started twice"
        events, clock = it.timeline.events, self.settings.clock
        events.append((clock(), EventKind.LAUNCH, bucket.index))
        wire = bucket.payload
        if it.reports_in_tail and bucket.tail is not None:
            self.checks.reports.attach(bucket.tail, it.micro_steps, bool(it.missing))
            wire = bucket.wire
        with profiled(f"gradsync.allreduce.bucket{bucket.index}"):
            flight.work = work = bucket.start(self.group, wire)
        flight.stage = Stage.STARTED
        if self.settings.device_timed:  # device time: on a side stream that waits for it
            self.settings.device_clock.after(work, events, EventKind.COMPLETE, bucket.index)  # type: ignore[union-attr]
        elif bucket.collective is Collective.ALL_REDUCE:
            work.get_future().add_done_callback(
                functools.partial(_record_completion, events, clock, bucket.index))
        # gloo's reduce-scatter has no Future: its completion is recorded when it lands.

    def hand_to_hook(self, it: Iteration) -> None:
        """Hand the hook what has become launchable since (a predecessor's Future completed);
        called from the backward thread, never from a communication thread's callback."""
        with self._lock:
            self._hand_to_hook(it)

    def _hand_to_hook(self, it: Iteration) -> None:
        """The hook runs over the buckets in order. Bucket k+1's hook starts only once bucket
        k's Future has completed: hooks such as PowerSGD issue more collectives from their
        Futures' callbacks and wait for them there, and, started all at once, those nested
        collectives interleave differently on each rank while callbacks waiting on work queued
        behind them occupy every gloo worker thread: a hang (torch 2.13's DDP hangs on PowerSGD
        with one-parameter buckets for this reason). The known hooks that issue their one
        all-reduce inside the call (`averages_by_one_allreduce`) cannot interleave: they go as
        their buckets fill, so a slow link is never left idle between two buckets.

        The hook runs where torch's DDP runs it, on the backward thread, on the stream the
        bucket was filled on. Call with the lock held. A loop, not a recursion: a Future
        complete when returned (NCCL's are, at enqueue) goes straight on to the next bucket."""
        if self._launching:
            return
        self._launching = True
        try:
            in_order = self._hooks_in_order
            while self._hooked_count < self._released:
                previous = self.flights[self._hooked_count - 1] if self._hooked_count else None
                if not in_order and previous is not None and not previous.hook_done.is_set():  # type: ignore[union-attr]
                    self.hook_waiting = True
                    return
                self._hooked_count += 1
                self._call_hook(it, self.buckets[self._hooked_count - 1])
            self.hook_waiting = False
        finally:
            self._launching = False

    def _call_hook(self, it: Iteration, bucket: Bucket) -> None:
        state, hook = self.settings.comm_hook  # type: ignore[misc]
        flight = self.flights[bucket.index]
        assert flight.stage is Stage.FILLING, f"bucket {bucket.index} handed to the hook twice"
        flight.stage, flight.hook_done = Stage.STARTED, threading.Event()
        events, clock = it.timeline.events, self.settings.clock
        events.append((clock(), EventKind.LAUNCH, bucket.index))
        flight.view = GradBucket(bucket, is_last=bucket.index == len(self.buckets) - 1)
        stream = self.calls.on_stream if self.calls is not None else on_stream
        try:
            with profiled(f"gradsync.comm_hook.bucket{bucket.index}"), stream(flight.stream):
                future = _hook_future(self.group, state, hook, bucket, flight.view)
        except Exception as error:  # reported at the end of backward, on the backward thread
            flight.error = GradSyncError(
                f"gradsync: communication hook {hook_name(hook)} raised on "
                f"{self._where(it, bucket)}: {type(error).__name__}: {error}"
            )
            flight.error.__cause__ = error
            flight.hook_done.set()
            return
        flight.future = future
        # The callback runs on a communication thread: it holds only this iteration's flight
        # and timeline, never this object (so never the process group, which, were the
        # callback its last holder, would be destroyed on its own worker thread: a deadlock).
        future.add_done_callback(functools.partial(_hook_completed, flight.hook_done, events, clock,
                                                   bucket.index))

    def _where(self, it: Iteration, bucket: Bucket) -> str:
        if it.joined:
            return f"joined rank's bucket {bucket.index}"
        return f"bucket {bucket.index} (rank {self.rank}, iteration {it.number})"

    # ----------------------------------------------------------------------- landing

    def release_landed(self, it: Iteration) -> None:
        """Transient buckets: drop each buffer as soon as its reduce-scatter has landed (asked,
        never waited for), so that gradient memory is the shards and the buckets in flight;
        with `BucketSet.in_flight`, backward waits for the oldest beyond that many."""
        limit = self.bucket_set.in_flight
        while self.settled < self.started and (
            self.flights[self.settled].work.is_completed()  # type: ignore[union-attr]
            or (limit is not None and self.started - self.settled > limit)
        ):
            self._land_shard(it, self.buckets[self.settled])
            self.settled += 1

    def finish(self, it: Iteration, bucket: Bucket) -> None:
        """Wait until `bucket`'s reduction has landed (a sharded one: settled, if not already)."""
        flight = self.flights[bucket.index]
        if flight.stage >= Stage.LANDED:
            return
        if self.hooked:
            bucket.accept(self._hook_result(it, bucket))
        elif bucket.collective is Collective.REDUCE_SCATTER:
            self._land_shard(it, bucket)
            return
        else:
            while flight.stage is Stage.FILLING and self.holding():
                self._land_to_start(it)
            assert flight.stage is Stage.STARTED, (f"bucket {bucket.index} landed before it was "
                                                   "started")
            self.waits(flight.work, f"all-reduce of bucket {bucket.index}", bucket)
            if bucket.sparse:
                bucket.accept(flight.work.result()[0])  # type: ignore[union-attr]
        flight.stage = Stage.LANDED

    def _land_to_start(self, it: Iteration) -> None:
        """A chunk held by the credit is wanted: land the earliest of the tail's chunks still
        reducing (they go in order), which frees credit, and start what then fits."""
        first = next(i for i in self._starts[self._tail_from:self.started]
                     if self.flights[i].stage is Stage.STARTED)
        self.finish(it, self.buckets[first])
        self.start_ready(it)

    def _land_shard(self, it: Iteration, bucket: Bucket) -> None:
        """A reduce-scatter bucket has landed: take its shard, give its buffer back."""
        flight = self.flights[bucket.index]
        assert flight.stage is Stage.STARTED, (f"bucket {bucket.index} landed before it was "
                                               "started")
        # raises if it failed
        self.waits(flight.work, f"reduce-scatter of bucket {bucket.index}", bucket)
        if not self.settings.device_timed:  # gloo's reduce-scatter has no Future to time it by
            it.timeline.events.append((self.settings.clock(), EventKind.COMPLETE, bucket.index))
        bucket.take_shard()
        if bucket.transient:  # back to the pool; the last bucket's tail is read before any
            bucket.release()  # bucket takes a buffer again (`write_back`)
        flight.work, flight.stage = None, Stage.LANDED  # the work holds the buffer too

    def _hook_result(self, it: Iteration, bucket: Bucket) -> torch.Tensor:
        """The checked tensor of the hook's Future for `bucket`, waiting at most the timeout."""
        timeout: timedelta = self.settings.config.timeout
        hook, where = hook_name(self.settings.comm_hook[1]), self._where(it, bucket)  # type: ignore[index]
        flight = self._hooked_up_to(it, bucket, timeout)
        assert flight.hook_done is not None
        if not flight.hook_done.wait(timeout.total_seconds()):
            raise ReductionTimeoutError(
                f"gradsync: the Future returned by communication hook {hook} for {where} did "
                f"not complete within {timeout}. A hook whose collective is not issued on every "
                "rank, or a Future nobody completes, ends here instead of hanging."
            )
        if flight.error is not None:
            raise flight.error
        assert flight.future is not None and flight.view is not None
        try:
            # wait(), not value(): on a GPU it makes the current stream wait for the hook's
            # work (NCCL's Futures complete at enqueue), so the copy out reads landed data.
            value = flight.future.wait()
        except Exception as error:
            raise GradSyncError(f"gradsync: communication hook {hook} failed for {where}: "
                                f"{error}") from error
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if bucket.sparse:
            return value
        return check_hook_result(value, bucket, flight.view.buffer(), hook, where)

    def _hooked_up_to(self, it: Iteration, bucket: Bucket, timeout: timedelta) -> Flight:
        """`bucket`'s flight, handed to the hook by now (its predecessor waited for, bounded)."""
        self.hand_to_hook(it)
        flight = self.flights[bucket.index]
        if flight.stage is Stage.FILLING and bucket.index > 0:
            previous = self.flights[bucket.index - 1]
            assert previous.hook_done is not None
            # Normally already set (results are taken in order); bounded all the same.
            previous.hook_done.wait(timeout.total_seconds())
            self.hand_to_hook(it)
        if flight.stage is Stage.FILLING:
            raise ReductionTimeoutError(
                f"gradsync: {self._where(it, bucket)} was never launched: the previous "
                f"bucket's Future did not complete within {timeout}"
            )
        return flight

    def done_within(self, bucket: Bucket, seconds: float) -> bool:
        """Has `bucket`'s reduction completed, waiting at most `seconds`? Never raises. Polled,
        not waited on: a timed-out wait can abort an NCCL communicator. A failed one counts as
        completed; the real wait then reports the failure."""
        flight = self.flights[bucket.index]
        if flight.hook_done is not None:
            return flight.hook_done.wait(seconds)
        if flight.work is None:  # landed, or held by the credit: nothing of it reducing
            return flight.stage >= Stage.LANDED or bucket.index in self._tail
        return _completes_within(flight.work, seconds)

    # ----------------------------------------------------------------------- writing back

    def lands_lazily(self) -> bool:
        """Whether this iteration's buckets may land after backward, each where its parameters
        are needed: an optimizer steps them as they land (`stepper`, `lazily`), and
        nothing waits for every bucket first (no used map, no hook chain, not sharded)."""
        s = self.settings
        return (self.lazily and self.stepper is not None and not self.hooked
                and self.bucket_set.shards is None and not s.find_unused and s.static is None)

    def write_back(self, it: Iteration, wanted: Sequence[int] | None = None,
                   landed_only: bool = False) -> bool:
        """Land and write back the buckets `wanted` (default: every one; `landed_only`: those
        whose reduction has completed, asked, never waited for); True once every bucket is
        (`written_with` then holds the used map they were written with; None: all).

        Without a used map to wait for (no unused-parameter search, no static graph) and
        unsharded, each bucket is written back as soon as it has landed, so the copy into
        `.grad` hides under the reductions still running (as torch's finalize_backward does).
        Otherwise every bucket and the used map are waited for first, and only what some rank
        used is written back. Either way the reports are checked before the last write-back,
        so an error leaves `.grad` alike on every rank."""
        assert self.started == len(self.buckets) or self.holding(), (
            "write_back before every bucket was started")
        s = self.settings
        if self.bucket_set.shards is None and not s.find_unused and s.static is None:
            return self._write_back_as_landed(it, wanted, landed_only)
        self.written_with = self._write_back_with_used_map(it)
        return True

    def _write_back_as_landed(self, it: Iteration, wanted: Sequence[int] | None,
                              landed_only: bool) -> bool:
        """Land each bucket wanted, in order, and write it back at once. The reports are
        checked before the last write-back: an error leaves the earlier buckets' averages in
        `.grad`, on every rank alike."""
        buckets, as_view = self.buckets, self.settings.config.gradient_as_bucket_view
        for bucket in [buckets[i] for i in (self._starts if wanted is None else wanted)]:
            flight = self.flights[bucket.index]
            if flight.stage is Stage.WRITTEN or (landed_only and not self._landed_by_now(bucket)):
                continue
            self.finish(it, bucket)
            if self._credit:  # a chunk landed: room for the next
                self.start_ready(it)
            if self.written == len(buckets) - 1:
                self.start_reports(it)
                self.check_reports(it)
            self._write_back(it, bucket, None, as_view)
        return self.written == len(buckets)

    def _landed_by_now(self, bucket: Bucket) -> bool:
        """Whether `bucket` can be written back without waiting. Under a credit not a chunk of
        the tail: those land when the next forward asks (`_within_credit`)."""
        if self._credit and bucket.index in self._tail:
            return False
        return self.done_within(bucket, 0)

    def pending(self) -> list[Bucket]:
        """The buckets not written back yet (landing lazily: still reducing after backward)."""
        return [b for b, f in zip(self.buckets, self.flights) if f.stage is not Stage.WRITTEN]

    def _write_back_with_used_map(self, it: Iteration) -> list[int] | None:
        """Land every bucket and the used map, then write back what some rank used."""
        s, buckets = self.settings, self.buckets
        for bucket in buckets:
            self.finish(it, bucket)
        if self.hooked and (s.find_unused or (s.static is not None and s.static.used_map is None)):
            # Only now: a collective started earlier could interleave with the hook's.
            self.used.start(buckets[0].buffer.device, s.config.report_unused)
        self.start_reports(it)
        used = self.used.finish(self.waits)
        self.check_reports(it)  # raises before any gradient is written back
        if s.static is not None:  # the first iteration's used map holds for good
            used = s.static.settle_used_map(used)
        # Used on some rank, every one (the common case): written back as without a map, in one
        # batch per bucket rather than parameter by parameter.
        keep = None if used is None or all(used) else used
        for bucket in buckets:
            self._write_back(it, bucket, keep, s.config.gradient_as_bucket_view)
        return used

    def _write_back(self, it: Iteration, bucket: Bucket, used: Sequence[int] | None,
                    as_view: bool) -> None:
        flight, stepper = self.flights[bucket.index], self.stepper
        assert flight.stage is Stage.LANDED, f"bucket {bucket.index} written back before it landed"
        if stepper is not None:
            it.timeline.events.append((self.settings.clock(), EventKind.STEP, bucket.index))
            stepper.landing(bucket)
        bucket.write_back(used, as_view)
        flight.stage = Stage.WRITTEN
        self.written += 1
        if stepper is not None:
            stepper.written(bucket)
            it.timeline.events.append((self.settings.clock(), EventKind.STEPPED, bucket.index))

    # ----------------------------------------------------------------------- reports

    def start_reports(self, it: Iteration) -> None:
        """This rank's report in a small all-reduce of its own, after every bucket, on every
        rank, when it did not ride in the last bucket's tail."""
        if not it.reports_in_tail and not self._reports_started:
            self.checks.start(self.buckets[0].buffer.device, it.micro_steps, bool(it.missing))
        self._reports_started = True

    def check_reports(self, it: Iteration) -> None:
        """Every rank's report: gradients missing somewhere, uneven micro-step counts."""
        accumulation = self.settings.config.check_accumulation
        if not self.settings.defer:
            self.checks.check_now(it.micro_steps, bool(it.missing), it.number, accumulation,
                                  self._missing_error(it, everyone=True))
        else:
            own = self._missing_error(it, everyone=False) if it.missing else None
            self.checks.check_later(it.number, accumulation, own)

    def _missing_error(self, it: Iteration, everyone: bool) -> Callable[[], GradSyncError]:
        def error() -> GradSyncError:
            names, params = self.names, self.bucket_set.params
            mine = [(self.bucket_set.bucket_of[i].index, names[i]) for i in it.missing]
            frozen = [names[i] for i in it.missing if not params[i].requires_grad]
            return missing_gradients_error(
                mine, it.number, self.rank, self.group if everyone else None,
                self.settings.config.timeout, self.settings.find_unused,
                self.settings.static is not None, frozen,
            )

        return error


def _hook_future(group: dist.ProcessGroup, state: object, hook: CommHook, bucket: Bucket,
                 view: GradBucket) -> torch.futures.Future:
    if bucket.sparse:  # reduced as torch does, but in the hook's order
        return group.allreduce([bucket.payload]).get_future().then(lambda f: f.value()[0])
    future = hook(state, view)
    if not isinstance(future, torch._C.Future):  # torch.futures.Future and the C++ kind
        raise TypeError(
            f"the hook returned {type(future).__name__}; a hook must return a "
            "torch.futures.Future whose value is the reduced bucket tensor (e.g. "
            "group.allreduce([t]).get_future().then(lambda f: f.value()[0]))"
        )
    return future


def _hook_completed(done: threading.Event, events: list, clock: Callable[[], int], index: int,
                    future: object) -> None:
    if isinstance(clock, EventClock):  # timed on the device, not at this callback
        clock.after(future, events, EventKind.COMPLETE, index)
    else:
        events.append((clock(), EventKind.COMPLETE, index))
    done.set()  # the next bucket goes to the hook from the backward thread, not from here


def _record_completion(events: list, clock: Callable[[], int], bucket_index: int,
                       _future: object) -> None:
    events.append((clock(), EventKind.COMPLETE, bucket_index))


# How long the collectives left in flight may take once their reducer is gone: a bucket's
# transfer, on links far slower than the emulated cluster's. One that takes longer is stuck
# (a peer gone elsewhere), and the exit of a failed run must not wait for it any longer.
QUIESCE_S = 10.0


def quiesce(flights: list[Flight], seconds: float | None = None) -> None:
    """Wait, at most `seconds` in all (default `QUIESCE_S`, read when called), for the
    collectives of `flights` in flight to complete, landing and starting nothing
    (`reducer._quiesce_at_exit`)."""
    deadline = time.monotonic() + (QUIESCE_S if seconds is None else seconds)
    for flight in flights:
        if flight.work is not None:
            _completes_within(flight.work, max(0.0, deadline - time.monotonic()))


def _completes_within(work: dist.Work, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def profiled(name: str) -> contextlib.AbstractContextManager:
    """A torch.profiler range around gradsync's own work, so buckets show up in users' traces;
    only while a profiler runs (entering one costs microseconds)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()
