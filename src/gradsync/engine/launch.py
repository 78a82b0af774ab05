"""Filling a bucket and launching it: the phase between a bucket's last gradient and its
collective on the wire.

A full bucket is filled (`Bucket.fill`: the gradients copied in, divided by the world size
unless a hook or mixed precision divides later), on a GPU on the stream its last gradient came
on (made to wait for the stream backward began on). Buckets are launched strictly in order: a
full bucket whose predecessors are not all launched waits for them. A launch is timed (its
completion too: on the device, on a side stream that waits for the collective), and the last
bucket may carry this rank's report in its tail (`accumulation`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from .bucket import Bucket
from .bucket_set import BucketSet
from .checks import check_finite, check_finite_later
from .comm import HookChain
from .device import DeviceCalls, on_stream
from .errors import GradSyncError
from .iteration import Iteration
from .profiling import profiled as _profiled
from .report_checks import ReportChecks
from .settings import Settings
from .timeline import EventKind
from .waits import Waits

__all__ = ["Launcher"]


class Launcher:
    """Fills and launches the buckets of `buckets` over `group`, as `settings` say."""

    def __init__(self, settings: Settings, buckets: BucketSet, group: dist.ProcessGroup, checks: ReportChecks,
                 waits: Waits, calls: DeviceCalls | None, names: Sequence[str]) -> None:
        self.settings, self.set, self.group, self.checks, self.waits = settings, buckets, group, checks, waits
        self.calls, self.names, self.rank = calls, list(names), group.rank()

    def new_chain(self, it: Iteration) -> HookChain | None:
        """With a communication hook (unsharded: sharded buckets run it themselves), the chain
        that runs it bucket by bucket, in order."""
        if self.settings.comm_hook is None or self.set.shards is not None:
            return None
        state, hook = self.settings.comm_hook
        rank, number = self.rank, it.number
        return HookChain(
            state, hook, self.set.buckets, self.group, it.timeline.events,
            lambda b: f"bucket {b} (rank {rank}, iteration {number})", self.settings.clock,
            self.calls.on_stream if self.calls is not None else on_stream,
        )

    def divisor(self, it: Iteration) -> int:
        """What a bucket's gradients are divided by as they go in: a communication hook
        averages itself (torch's protocol), mixed precision divides each bucket's sum
        (`Bucket.divides_sum`): 0, copied as they are. A divisor of 1 is 0 too: x * 1.0 is x,
        bit for bit, so a world of one (one GPU) skips a pass over every bucket."""
        s = self.settings
        return it.divisor if s.comm_hook is None and not s.divides_sums and it.divisor != 1 else 0

    def fill(self, it: Iteration, bucket: Bucket) -> None:
        if bucket.sparse:
            self._fill_sparse(it, bucket)
            return
        config = self.settings.config
        if config.check_finite:
            self._check_finite(it, bucket)
        if self.calls is not None:
            bucket.stream = self._fill_stream(it)  # where the bucket (or the hook chain) launches it
        bucket.fill(self.divisor(it), config.gradient_as_bucket_view)

    def _fill_stream(self, it: Iteration) -> Any:
        """The stream the bucket is filled and launched on (its last gradient's); made to wait
        for the stream backward began on, should they differ (a model that runs part of its
        forward on a stream of its own), so the fill reads finished gradients and the copies
        `take_one` made there. As in torch's reducer, which copies each gradient on its own
        stream and launches on the last one's, gradients from a third stream are not waited for."""
        current = self.calls.current_stream()  # type: ignore[union-attr]
        if it.backward_stream is not None and it.backward_stream != current:
            current.wait_stream(it.backward_stream)
        return current

    def _check_finite(self, it: Iteration, bucket: Bucket) -> None:
        grads, names = [p.grad for p in bucket.params], [self.names[i] for i in bucket.param_indices]
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
                f"{self.rank}{frozen}. Build its module with sparse=True on every rank and use it in "
                "every iteration, or declare it dense."
            )

    def launch_ready(self, it: Iteration) -> bool:
        """Launch, strictly in order, every bucket that is full and not yet launched; True
        once every bucket is on its way."""
        buckets, s = self.set.buckets, self.settings
        while it.next_bucket < len(buckets) and buckets[it.next_bucket].pending == 0:
            bucket = buckets[it.next_bucket]
            bucket.launch_payload(s.config.reduce_dtype if s.scale_at_launch else None, it.divisor)
            it.next_bucket += 1
            if it.chain is None:  # else the chain launches it (an unknown hook after its predecessor's Future)
                self._launch(it, bucket)
        if it.chain is not None:
            it.chain.release(it.next_bucket)
        elif self.set.shards is not None and self.set.shards.transient:
            self.set.settle_landed(it, self.waits, self.completion_recorder(it))
        return it.next_bucket == len(buckets)

    def _launch(self, it: Iteration, bucket: Bucket) -> None:
        """Start `bucket`'s collective (its report riding in the last one's tail)."""
        events, clock = it.timeline.events, self.settings.clock
        events.append((clock(), EventKind.LAUNCH, bucket.index))
        wire = bucket.payload
        if it.ride and bucket.tail is not None:
            self.checks.reports.attach(bucket.tail, it.micro_steps, bool(it.missing))
            wire = bucket.wire
        with _profiled(f"gradsync.allreduce.bucket{bucket.index}"):
            work = bucket.start(self.group, wire)
        if self.settings.device_timed:  # device time: on a side stream that waits for it
            self.settings.device_clock.after(work, events, EventKind.COMPLETE, bucket.index)  # type: ignore[union-attr]
        elif bucket.collective == "all_reduce":
            work.get_future().add_done_callback(functools.partial(_record_completion, events, clock, bucket.index))
        # gloo's reduce-scatter has no Future: its completion is recorded when settled.

    def completion_recorder(self, it: Iteration) -> Callable[[int, int], None] | None:
        """How a settled reduce-scatter's completion is timed: now, on the host clock (device
        time is taken on the side stream at launch instead)."""
        if self.settings.device_timed:
            return None
        events, clock = it.timeline.events, self.settings.clock
        return lambda kind, index: events.append((clock(), kind, index))


def _record_completion(events: list, clock: Callable[[], int], bucket_index: int, _future: object) -> None:
    events.append((clock(), EventKind.COMPLETE, bucket_index))
