"""The Reducer: bucketed, overlapped gradient all-reduce driven by autograd hooks.

One gradient's path, as torch's c10d Reducer runs it:

1. `prepare_for_backward(outputs)` (from forward) starts the iteration: with unused-parameter
   search on, it walks the graph from the outputs for parameters that cannot get a gradient, and
   it asks backward to call `_end_of_backward` once backward has passed through the outputs.
2. `_autograd_hook` (the parameter's post-accumulate-grad hook) marks it ready (`_mark`); the
   first hook also marks the unused parameters, so no bucket waits for them.
3. When a bucket's last gradient arrives it is filled (`Bucket.fill`: copied in, divided by the
   world size, which keeps half precision from overflowing in the sum) and, strictly in order,
   launched (`_launch_ready`): its all-reduce runs while autograd computes the rest.
4. `_end_of_backward` launches what never filled (and has every rank raise, naming the
   parameters), then `finish_backward` waits for each bucket and writes back (`Bucket.write_back`).

The units around it: `layout` (the one-time rebuild in ready order), `static_graph`, `used_map`,
`accumulation` (each rank's report), `shadow` (a joined rank's side), `comm.HookChain`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from . import layout as layouts
from . import missing, static_graph
from .accumulation import Reports, decode, uneven
from .bucket import REDUCE_BY, Bucket, Sharding
from .bucketing import validate_bucket_indices
from .checks import PendingFinite, check_finite, check_finite_later
from .comm import CommHook, HookChain, check_registration, sharded_hook_dtype
from .config import RUNTIME_FIELDS, ReducerConfig
from .device import CudaCalls, DeviceCalls, HostRead, host_runs_collectives, on_stream
from .errors import (
    GradSyncError,
    format_names,
    marked_twice_message,
    missing_elsewhere_message,
    missing_gradients_message,
    uneven_accumulation_message,
)
from .events import EventClock, last_tokens, resolve_timeline
from .pool import BufferPool
from .profiling import profiled as _profiled
from .static_graph import StaticGraph
from .timeline import UNTIMED, DiscardedEvents, EventKind, IterationTimeline
from .unused import find_tensors, reachable_parameters
from .used_map import UsedMap
from .waits import StallMonitor, Waits

__all__ = ["Phase", "Reducer", "StallMonitor"]

_log = logging.getLogger("gradsync")


class Phase(enum.Enum):
    """Where the current iteration is."""

    IDLE = "idle"  # no synchronised iteration under way
    PREPARED = "prepared"  # forward said a backward will synchronise; no gradient yet
    BACKWARD = "backward"  # gradients arriving; buckets filling and launching in order
    LAUNCHED = "launched"  # every bucket on its way; finished at the end of backward
    REDUCED = "reduced"  # written back; a gradient now is a late one (until the next forward)


# The hot path compares against module constants (a global lookup, not an attribute of Phase).
_PREPARED, _BACKWARD, _LAUNCHED, _REDUCED = Phase.PREPARED, Phase.BACKWARD, Phase.LAUNCHED, Phase.REDUCED


class Reducer:
    """Synchronise the gradients of `params` over `process_group`, one bucket at a time.

    `bucket_indices` lists, per bucket, indices into `params`; buckets are reduced in that order,
    so the first bucket should hold the parameters whose gradients are ready first.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        bucket_indices: Sequence[Sequence[int]],
        process_group: dist.ProcessGroup,
        *,
        param_names: Sequence[str] | None = None,
        config: ReducerConfig | None = None,
        expect_sparse_gradient: Sequence[bool] | None = None,
        device_calls: DeviceCalls | None = None,
    ) -> None:
        self.params = list(params)
        self.names = list(param_names) if param_names is not None else _default_names(self.params)
        _check_params(self.params, self.names)
        self.expect_sparse_gradient = list(expect_sparse_gradient or [False] * len(self.params))
        self.process_group, self.config = process_group, config or ReducerConfig()
        self.rank, self.world_size = process_group.rank(), process_group.size()
        self._find_unused = self.config.find_unused_parameters
        self._static = StaticGraph(len(self.params)) if self.config.static_graph else None
        self._used = UsedMap(self.names, process_group)
        self._reports = Reports(process_group)
        self._comm_hook: tuple[object, CommHook] | None = None
        self._waits = Waits(process_group, self.names)
        # On a GPU: its streams (a bucket is filled and launched on the stream backward runs
        # on), and the timeline timed with CUDA events, resolved once they have passed.
        self._calls = device_calls if device_calls is not None else (CudaCalls() if self.params[0].is_cuda else None)
        self._device_clock = self.config.clock if isinstance(self.config.clock, EventClock) else (
            EventClock(calls=self._calls) if self._calls is not None else None
        )
        self._clock = _recording_clock(self.config, self._device_clock)
        self._grad_clock = self._clock  # per gradient: untimed on device iterations not sampled
        self._defer = _defers_reads(self.config, process_group)
        self._deferred: deque[tuple[int, HostRead]] = deque()  # (iteration, its reports)
        self._finite: deque[tuple[int, PendingFinite]] = deque()  # deferred finite checks, one per bucket
        # Called with (rank, timeline) after every synchronised iteration (the wrapper logs
        # per-iteration stats through one at GRADSYNC_DEBUG=DETAIL).
        self.iteration_listeners: list[Callable[[int, IterationTimeline], None]] = []
        self._history: deque[IterationTimeline] = deque(maxlen=self.config.history)
        self._unresolved: deque[IterationTimeline] = deque()  # finished, events still in flight
        self._scale_at_launch = self.config.casts_to_reduce(self.params[0].dtype)
        # Mixed precision (the wrapper sets these dtypes) reduces as torch's does: gradients go
        # into the buckets undivided, each bucket's sum is divided once landed (`Bucket.divides_sum`).
        self._divides_sums = self.config.bucket_dtype is not None or self.config.reduce_dtype is not None
        self.buckets: list[Bucket] = []
        self._bucket_of: list[Bucket] = []  # parameter index -> its bucket
        self._shards: Sharding | None = None  # sharded gradients (`shard_gradients`)
        self._in_flight: int | None = None  # at most this many transient buckets reducing at once
        self.reductions = 0  # synchronised iterations finished (a sharded optimizer counts them)
        self.last_used: list[int] | None = None  # the used map they were written back with
        self.shard_owner: Callable[[], object] | None = None  # the sharded optimizer's weak reference
        self._finish_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()  # `register_finish_hook`
        self._install_buckets(validate_bucket_indices(bucket_indices, self.params, self.names))
        self._needs_rebuild = self.config.rebuild_bucket_size_limits is not None and (
            self.config.static_graph or not self._find_unused
        )
        self.iteration, self._micro_steps, self._forward_start_ns = 0, 1, 0
        self._divisor, self._ride = self.world_size, False
        self._unused: list[int] = []
        self._chain: HookChain | None = None
        self._backward_stream: Any = None  # on a GPU: the stream of this backward's first hook
        self.phase = Phase.IDLE
        self._start_state()
        _attach_hooks(self)

    # ----------------------------------------------------------------------------- layout

    @property
    def bucket_indices(self) -> list[list[int]]:
        return [list(b.param_indices) for b in self.buckets]

    def _install_buckets(self, layout: list[list[int]]) -> None:
        layouts.check_sparse_layout(layout, self.expect_sparse_gradient, self.names)
        # The old buckets go first: old and new together would be a gradient-sized spike.
        # (Gradients that are views of them keep their storage until adopted.)
        self.buckets = []
        self._bucket_of.clear()
        self.buckets = layouts.make_buckets(
            layout, self.params, self.expect_sparse_gradient, self.config.bucket_dtype, self.world_size,
            self._shards,
        )
        self._layout = [list(b.param_indices) for b in self.buckets]
        self._layout_bytes = [b.nbytes for b in self.buckets]
        self._bucket_of = [None] * len(self.params)  # type: ignore[list-item]
        self._position = [0] * len(self.params)  # parameter index -> its place in its bucket
        for bucket in self.buckets:
            bucket.divides_sum = self._divides_sums
            for position, i in enumerate(bucket.param_indices):
                self._bucket_of[i] = bucket
                self._position[i] = position
            if self.config.gradient_as_bucket_view and not bucket.sparse:
                bucket.adopt_grads()

    def install_layout(self, layout: Sequence[Sequence[int]]) -> None:
        """Replace the bucket layout between iterations (every rank must install the same)."""
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("install_layout: an iteration is still being reduced")
        if self._shards is not None:
            raise RuntimeError(
                "install_layout: the gradients are sharded over the current buckets (a sharded "
                "optimizer holds state for each bucket's shard); the layout cannot change now"
            )
        self._needs_rebuild = False
        self._install_buckets(validate_bucket_indices(layout, self.params, self.names))

    def shard_gradients(self, layout: Sequence[Sequence[int]], in_flight: int | None = None,
                        reduce_by: str | None = None) -> None:
        """Reduce-scatter from now on, in buckets of `layout` for good: each rank keeps only its
        shard of each bucket's averaged gradients (`Bucket.shard`) and `.grad` is cleared once a
        gradient is in its bucket. Without gradient_as_bucket_view the buckets are transient:
        a buffer lives from its fill until its reduce-scatter has completed, and with
        `in_flight` no more than that many are reducing at once (backward waits for the oldest:
        memory bounded at the cost of overlap where the network is slower than backward). For a
        sharded optimizer (`gradsync.ZeroRedundancyOptimizer`); every rank must call it alike.
        `reduce_by` (`bucket.REDUCE_BY`): "reduce_scatter" (the default on device backends),
        "all_to_all" (the default on host backends, gloo, whose all-to-all beats its
        reduce-scatter and all-reduce) or "all_reduce" (each bucket reduced whole, the shard
        copied out: DDP's very sums at any world size, where all-to-all's rank-order sum
        differs from gloo's ring in the last bit beyond 2 ranks)."""
        if in_flight is not None and in_flight < 1:
            raise ValueError(f"shard_gradients(in_flight={in_flight}): expected at least 1, or None for no limit")
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("shard_gradients: an iteration is still being reduced")
        hooked, hook_dtype = self._comm_hook is not None, None
        if self._comm_hook is not None:
            try:
                hook_dtype = sharded_hook_dtype(self._comm_hook[0], self._comm_hook[1], self.process_group)
            except ValueError as error:
                raise ValueError(f"gradsync: cannot shard the gradients: {error}") from None
        if any(self.expect_sparse_gradient):
            raise ValueError("gradsync: cannot shard the gradients: some parameters get sparse gradients")
        if reduce_by is None:
            reduce_by = "all_to_all" if host_runs_collectives(self.process_group) else "reduce_scatter"
        if reduce_by not in REDUCE_BY:
            raise ValueError(f"shard_gradients(reduce_by={reduce_by!r}): expected one of {', '.join(REDUCE_BY)}")
        transient = not self.config.gradient_as_bucket_view
        # Transient buffers are lent: as many as can be live at once (those reducing and the
        # one filling) stay warm between steps (`BufferPool`).
        keep = in_flight + 1 if in_flight is not None else 2
        casts = hook_dtype is not None or self._scale_at_launch  # a cast beside each buffer
        per_bucket = (2 if casts else 1) + (reduce_by == "all_to_all")  # a cast, a receive buffer
        pool = BufferPool(keep=per_bucket * keep) if transient else None
        self._shards = Sharding(self.rank, transient, reduce_by, pool, hooked, hook_dtype)
        self._in_flight = in_flight
        self._needs_rebuild = False
        self._install_buckets(validate_bucket_indices(layout, self.params, self.names))

    @property
    def sharded(self) -> bool:
        """Whether buckets are reduce-scattered (`shard_gradients`)."""
        return self._shards is not None

    @property
    def buffer_pool(self) -> BufferPool | None:
        """Lends the transient buckets' buffers (sharded, without bucket views); a sharded
        optimizer's gathers borrow from it too, outside backward."""
        return self._shards.pool if self._shards is not None else None

    @property
    def shards_reduced_by(self) -> str | None:
        """How sharded buckets are reduced (`bucket.REDUCE_BY`); None when not sharded."""
        return self._shards.reduce_by if self._shards is not None else None

    @property
    def rebuilt(self) -> bool:
        """Whether the one-time rebuild in ready order has happened (or will not happen)."""
        return not self._needs_rebuild

    def _rebuild_if_due(self) -> None:
        # As torch: after the first synchronised iteration, or with a static graph the second
        # (the first only counts hooks, reducing everything at its end, in no real order).
        finished = len(self._history) + len(self._unresolved)
        if not self._needs_rebuild or finished < (2 if self._static else 1):
            return
        self._needs_rebuild = False
        last = self._unresolved[-1] if self._unresolved else self._history[-1]  # its order, not times
        layout = layouts.rebuilt_layout(
            last, self.params, self.expect_sparse_gradient,
            self.config.rebuild_bucket_size_limits or (), self.process_group, self.config.timeout,
        )
        if layout is not None:  # None on every rank alike
            self._install_buckets(layout)

    def locate(self, index: int) -> tuple[int, int]:
        """(bucket index, position in that bucket) of parameter `index`."""
        return self._bucket_of[index].index, self._position[index]

    # ------------------------------------------------------------------ iteration lifecycle

    def prepare_for_backward(
        self, outputs: object = None, divisor: int | None = None, micro_steps: int = 1
    ) -> None:
        """Start a synchronised iteration; call from forward with its outputs.

        With find_unused_parameters, parameters not reachable from `outputs` will be marked
        ready as soon as backward starts. Whenever `outputs` hold tensors, the end of the
        backward through them is where the iteration is finished: a bucket whose gradients
        never came is reported there, on every rank. Gradients are averaged over `divisor`
        ranks (default: the group size; fewer when ranks have joined early and the caller says
        so). `micro_steps` counts the forwards this synchronisation covers (1 + those under
        no_sync); every rank must cover the same number (`config.check_accumulation`).
        """
        self._check_prior_reduction_finished()
        self._check_deferred()
        if self._unresolved:
            self._publish_landed()
        self._rebuild_if_due()
        self.iteration += 1
        self._start_state()
        self.phase = Phase.PREPARED
        if self._waits.monitor is not None:
            self._waits.monitor.mark_progress(self.iteration)
        self._divisor, self._micro_steps = divisor or self.world_size, micro_steps
        tensors = find_tensors(outputs) if outputs is not None else []
        if self._find_unused:
            reached = reachable_parameters(tensors)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
        if self._static is not None:
            self._static.start_iteration()
            if self._static.learned:
                self._unused = list(self._static.unused)
        self._unused_pending = bool(self._unused)
        self._grad_clock = self._gradient_clock()
        self._timeline = IterationTimeline(
            iteration=self.iteration,
            start_ns=self._clock(),
            bucket_indices=self._layout,  # shared, not copied: a layout is never mutated
            bucket_bytes=self._layout_bytes,
            # Until the buckets are rebuilt, their ready order is recorded whatever the config
            # says: the rebuild reads it (without it the first iteration's single bucket stayed
            # for good, and nothing overlapped).
            events=[] if self.config.record_events or self._needs_rebuild else DiscardedEvents(),
            gradients_timed=self._grad_clock is not _untimed,
        )
        self._timeline.forward_start_ns = self._forward_start_ns
        self._chain = self._new_chain()
        self._ride = self._reports_ride_along()
        self._watch_backward_start(tensors)

    def _gradient_clock(self) -> Callable[[], int]:
        # A CUDA event per gradient costs the host microseconds each: on the device, gradients
        # are timed on sampled iterations only (buckets and the iteration always are).
        if self._clock is not self._device_clock or self.iteration % self.config.time_gradients_every == 0:
            return self._clock
        return _untimed

    def _watch_backward_start(self, outputs: list[torch.Tensor]) -> None:
        # Backward reaches forward's outputs first, in the outermost backward (a reentrant
        # checkpoint's nested backward comes later, inside it). A callback queued from there
        # runs when that whole backward has ended: the one place to see a bucket left unfilled.
        nodes = {id(t.grad_fn): t.grad_fn for t in outputs if t.grad_fn is not None}
        hook = functools.partial(_on_backward_start, weakref.ref(self), self.iteration)
        for node in nodes.values():
            node.register_prehook(hook)
        self._watching = bool(nodes)

    def prepare_for_forward(self) -> None:
        """Note that a new forward has started (call it on every forward, synced or not).

        Until then, a gradient that arrives for a parameter already reduced in this iteration is
        an error: it would be silently left out of the average.
        """
        self.note_module_forward()
        self._forward_start_ns = self._clock()

    def note_module_forward(self) -> None:
        """The wrapped module ran forward (through the wrapper or not): gradients from here on
        belong to a new graph, not late arrivals for the last reduced iteration."""
        if self.phase is Phase.REDUCED:
            self.phase = Phase.IDLE

    def _start_state(self) -> None:
        self._marked = [False] * len(self.params)
        self._unused = []  # parameters marked ready up front (unreachable, or never fired)
        self._unused_pending = False  # unused parameters still to mark, at the first hook
        self._watching = False  # the outputs' backward nodes will queue the end of backward
        self._clear_reduction()

    def _clear_reduction(self) -> None:
        self._missing: list[int] = []  # parameters without a gradient when backward ended
        self._next_bucket = 0
        self._settled = 0  # transient buckets before this one have landed and been dropped
        self._end_queued = False
        self._chain = None
        self._reports.abandon()
        self._used.abandon()
        for bucket in self.buckets:
            bucket.reset()

    def _check_prior_reduction_finished(self) -> None:
        # Reached only where the end of backward could not be seen (forward returned no
        # tensor, or the loss did not come from its outputs): report the missing gradients now.
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            error = missing.unfinished_iteration_error(self)
            self._abandon_iteration()
            raise error

    def _abandon_iteration(self) -> None:
        """Drop a broken iteration so the reducer can be used again after the error."""
        self.phase = Phase.IDLE
        self._start_state()

    # ----------------------------------------------------------------------- hot path

    def _autograd_hook(self, index: int, param: torch.Tensor) -> None:
        # Runs once per parameter per backward: plain bookkeeping only. Gradients are copied
        # into the bucket in one batch when its last one arrives (`Bucket.fill`).
        phase = self.phase
        if self._find_unused and param.grad is not None:
            self._used.local[index] = 1  # without a gradient (an output left out) it is unused
        if phase is not _BACKWARD:  # the common case first: one comparison
            if phase is _PREPARED:
                self.phase = _BACKWARD
                if self._calls is not None:  # once per backward: hooks run on its stream(s)
                    self._backward_stream = self._calls.current_stream()
            elif phase is not _LAUNCHED:  # idle or reduced: not ours to count
                if phase is _REDUCED and self._marked[index]:
                    raise GradSyncError(marked_twice_message(self.names[index], index, self.rank, "late"))
                return
        static = self._static
        if static is not None and not static.fire(index):
            if static.learning:
                static_graph.learning_fire(self, index, param)
            return
        if self._marked[index]:
            cause = "unused" if index in self._unused else "repeat"
            raise GradSyncError(marked_twice_message(self.names[index], index, self.rank, cause))
        if self._unused_pending:
            self._mark_unused()
        self._mark(index, EventKind.READY)
        chain = self._chain
        if chain is not None and chain.waiting:  # a bucket whose predecessor has completed since
            chain.pump()

    def _mark_unused(self) -> None:
        # Deferred from prepare_for_backward to the first hook, as torch does: a forward that is
        # never followed by backward then leaves no half-done iteration behind.
        self._unused_pending = False
        for unused in self._unused:
            self._mark(unused, EventKind.UNUSED)

    def _mark(self, index: int, kind: int) -> None:
        self._marked[index] = True
        self._timeline.events.append((self._grad_clock(), kind, index))
        bucket = self._bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._timeline.events.append((self._clock(), EventKind.BUCKET_READY, bucket.index))
            self._fill(bucket)
            if bucket.index == self._next_bucket:
                self._launch_ready()
        elif kind == EventKind.READY and bucket.copies_early:
            position = self._position[index]
            if bucket.early[position]:
                bucket.take_one(position, self._fill_divisor(), self.config.gradient_as_bucket_view)

    def _fill(self, bucket: Bucket) -> None:
        if bucket.sparse:
            self._fill_sparse(bucket)
            return
        if self.config.check_finite:
            self._check_finite(bucket)
        if self._calls is not None:
            bucket.stream = self._on_fill_stream()  # where the chain launches it (M2)
        bucket.fill(self._fill_divisor(), self.config.gradient_as_bucket_view)

    def _on_fill_stream(self) -> Any:
        """The stream the bucket is filled and launched on (its last gradient's); made to wait
        for the stream backward began on, should they differ (a model that runs part of its
        forward on a stream of its own), so the fill reads finished gradients and the copies
        `take_one` made there. As in torch's reducer, which copies each gradient on its own
        stream and launches on the last one's, gradients from a third stream are not waited for."""
        current = self._calls.current_stream()  # type: ignore[union-attr]
        first = self._backward_stream
        if first is not None and first != current:
            current.wait_stream(first)
        return current

    def _check_finite(self, bucket: Bucket) -> None:
        grads, names = [p.grad for p in bucket.params], [self.names[i] for i in bucket.param_indices]
        if not self._defer:
            check_finite(grads, names, self.rank, self.iteration)
        elif (pending := check_finite_later(grads, names, self.rank, self.iteration)) is not None:
            self._finite.append((self.iteration, pending))  # read once landed (`_check_deferred`)

    def _fill_divisor(self) -> int:
        # A communication hook averages itself (torch's protocol); mixed precision divides each
        # bucket's sum (`Bucket.divides_sum`): 0, copied as they are.
        return self._divisor if self._comm_hook is None and not self._divides_sums else 0

    def _fill_sparse(self, bucket: Bucket) -> None:
        if not bucket.fill_sparse(self._divisor):
            kind = "no gradient" if bucket.params[0].grad is None else "a dense gradient"
            raise GradSyncError(
                f"gradsync: parameter {self.names[bucket.param_indices[0]]!r} was declared to "
                f"get a sparse gradient but has {kind} in iteration {self.iteration} on rank "
                f"{self.rank}. Build its module with sparse=True on every rank and use it in "
                "every iteration, or declare it dense."
            )

    def _launch_ready(self) -> None:
        """Launch, strictly in order, every bucket that is full and not yet launched."""
        buckets, events = self.buckets, self._timeline.events
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            bucket = buckets[self._next_bucket]
            bucket.launch_payload(self.config.reduce_dtype if self._scale_at_launch else None, self._divisor)
            self._next_bucket += 1
            if self._chain is not None:
                continue  # the chain launches it, after its predecessor's Future completes
            events.append((self._clock(), EventKind.LAUNCH, bucket.index))
            wire = bucket.payload
            if self._ride and bucket.tail is not None:
                self._reports.attach(bucket.tail, self._micro_steps, bool(self._missing))
                wire = bucket.wire
            with _profiled(f"gradsync.allreduce.bucket{bucket.index}"):
                work = bucket.start(self.process_group, wire)
            if self._clock is self._device_clock:  # device time (never None: _no_clock else)
                self._device_clock.after(work, events, EventKind.COMPLETE, bucket.index)
            elif bucket.collective == "all_reduce":
                work.get_future().add_done_callback(
                    functools.partial(_record_completion, events, self._clock, bucket.index)
                )
            # gloo's reduce-scatter has no Future: its completion is recorded when waited for.
        if self._chain is not None:
            self._chain.release(self._next_bucket)
        elif self._shards is not None and self._shards.transient:
            self._settle_landed()
        if self._next_bucket == len(buckets) and self.phase is _BACKWARD:
            self._all_launched()

    def _settle_landed(self) -> None:
        """Transient buckets: drop each buffer as soon as its reduce-scatter has landed (asked,
        never waited for), so that gradient memory is the shards and the buckets in flight."""
        limit = self._in_flight
        while self._settled < self._next_bucket and (
            self.buckets[self._settled].work.is_completed()  # type: ignore[union-attr]
            or (limit is not None and self._next_bucket - self._settled > limit)
        ):
            self._settle(self.buckets[self._settled])
            self._settled += 1

    def _settle(self, bucket: Bucket, record: bool = True) -> None:
        self._waits(bucket.work, f"reduce-scatter of bucket {bucket.index}", bucket)  # raises if it failed
        if record and self._clock is not self._device_clock:  # gloo's reduce-scatter has no Future to time it by
            self._timeline.events.append((self._clock(), EventKind.COMPLETE, bucket.index))
        bucket.take_shard()
        if bucket.transient:  # back to the pool; the last bucket's tail is read before any
            bucket.release()  # bucket takes a buffer again (`finish_backward`)
        bucket.work, bucket.landed = None, True  # the work holds the buffer too

    def _all_launched(self) -> None:
        """Every bucket is on its way: reduce the used map; finish at the end of backward."""
        self.phase = Phase.LAUNCHED
        if self._find_unused and self._chain is None:
            self._used.start(self.buckets[0].buffer.device, self.config.report_unused)
        if not self._end_queued:  # backward did not come through the outputs: finish as torch
            self._queue_end_of_backward()

    def _queue_end_of_backward(self) -> None:
        self._end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Queued once per iteration on the autograd engine; runs when backward has ended."""
        if self.phase is Phase.PREPARED:
            self._end_queued = False  # no gradient of ours came (torch.autograd.grad): re-arm
            return
        if self.phase is not Phase.BACKWARD and self.phase is not Phase.LAUNCHED:
            return  # finished already
        if self._static is not None and self._static.learning:
            static_graph.finish_first_iteration(self)
            return
        if self.phase is Phase.BACKWARD:
            self._complete_missing()
        self.finish_backward()

    def _complete_missing(self) -> None:
        """Backward ended with buckets not full: some gradients never came. Launch those buckets
        anyway (zeros where a gradient is missing), so every rank's collectives still match
        and no rank waits for them, and flag it in this rank's report: the end of backward then
        raises on every rank, naming the parameters (`_raise_missing`)."""
        if self._unused_pending:
            self._mark_unused()
        self._missing = [i for i, done in enumerate(self._marked) if not done]
        for index in self._missing:
            self._mark(index, EventKind.UNUSED)

    # ------------------------------------------------------------------ end of backward

    def finish_backward(self) -> None:
        """Wait for every bucket and write the averaged gradients into `.grad`."""
        timeline = self._timeline
        timeline.backward_end_ns = self._clock()
        assert self._next_bucket == len(self.buckets), "finish_backward before every launch"
        try:
            with torch.no_grad(), _profiled("gradsync.finish_backward"):
                self._waits.begin(self.iteration, self.config.timeout, self.buckets)
                used = None
                if self._writes_back_as_landed():
                    self._write_back_as_landed()
                else:
                    used = self._write_back_with_used_map()
                self.last_used, self.reductions = used, self.reductions + 1
        finally:
            self.phase = Phase.REDUCED  # `_marked` kept: a gradient still coming is reported
            timeline.finish_ns = self._clock()
            if self._clock is not self._device_clock:
                self._publish(timeline)
            else:  # published once its events have passed (`_publish_landed`)
                self._unresolved.append(timeline)
            self._used.clear()
            self._clear_reduction()
            self._end_queued = True  # until the next iteration: nothing more to finish
        for hook in list(self._finish_hooks.values()):
            hook()

    def register_finish_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call `hook()` each time a synchronised backward has been finished here: every
        bucket landed, the reports checked, the averages written back (or in the shards). Not
        after a joined rank's shadow iteration, whose joinables are called by `Join` instead.
        A sharded optimizer stepping inside backward (`overlap_with_ddp`) is the one user."""
        handle = RemovableHandle(self._finish_hooks)
        self._finish_hooks[handle.id] = hook
        return handle

    def _write_back_with_used_map(self) -> list[int] | None:
        """Wait for every bucket and the used map, then write back what some rank used."""
        self._wait_buckets()
        if not self._ride:  # after every bucket and the used map, on every rank
            self._start_reports()
        used = self._used.finish(self._waits)
        self._check_reports()  # raises before any gradient is written back
        if self._static is not None:  # the first iteration's used map holds for good
            used = self._static.settle_used_map(used)
        for bucket in self.buckets:
            bucket.write_back(used, self.config.gradient_as_bucket_view)
        return used

    def _writes_back_as_landed(self) -> bool:
        # Without a used map to wait for (no unused-parameter search, no static graph) and
        # unsharded, nothing that the write-back needs lands after the buckets themselves.
        return self._shards is None and not self._find_unused and self._static is None

    def _write_back_as_landed(self) -> None:
        """Wait for each bucket in order and write it back at once, so that copying one
        bucket's averages into `.grad` hides under the reductions still running (as torch's
        finalize_backward does). The reports are checked once the last bucket has landed,
        before its write-back: an error leaves the earlier buckets' averages in `.grad`, on
        every rank alike."""
        last = self.buckets[-1]
        for bucket in self.buckets:
            self._land(bucket)
            if bucket is last:
                if not self._ride:  # after every bucket, on every rank
                    self._start_reports()
                self._check_reports()
            bucket.write_back(None, self.config.gradient_as_bucket_view)

    def _start_reports(self) -> None:
        """This rank's report in a small all-reduce of its own (when it cannot ride along)."""
        self._reports.start(self.buckets[0].buffer.device, self._micro_steps, bool(self._missing))

    def _land(self, bucket: Bucket) -> None:
        """Wait until `bucket`'s reduction has landed (a sharded one: settled, if not already)."""
        if self._chain is not None:
            bucket.accept(self._chain.result(bucket, self.config.timeout))
        elif bucket.collective == "reduce_scatter":
            if bucket.index >= self._settled:
                self._settle(bucket)
        else:
            self._waits(bucket.work, f"all-reduce of bucket {bucket.index}", bucket)

    def _wait_buckets(self) -> None:
        chain = self._chain
        for bucket in self.buckets:
            self._land(bucket)
        needs_map = self._find_unused or (self._static is not None and self._static.used_map is None)
        if chain is not None and needs_map:
            # Only now: a collective started earlier could interleave with the chain's.
            self._used.start(self.buckets[0].buffer.device, self.config.report_unused)

    # ------------------------------------------------------------------------- history

    @property
    def history(self) -> deque[IterationTimeline]:
        """The last `config.history` finished iterations' timelines (on a GPU, reading it
        waits for the events of iterations still in flight: off the step path)."""
        while self._unresolved:
            self._publish(resolve_timeline(self._unresolved.popleft(), self._device_clock))  # type: ignore[arg-type]
        return self._history

    def _publish(self, timeline: IterationTimeline) -> None:
        self._history.append(timeline)
        for listener in self.iteration_listeners:
            listener(self.rank, timeline)

    def _publish_landed(self) -> None:
        clock = self._device_clock
        assert clock is not None
        while self._unresolved and clock.landed(last_tokens(self._unresolved[0])):
            self._publish(resolve_timeline(self._unresolved.popleft(), clock, landed=True))

    def _check_reports(self) -> None:
        if self._defer:
            self._defer_reports()
            return
        reports = self._reports.finish(self._waits, self._micro_steps)
        if self._missing if reports is None else any(r.missing for r in reports):
            raise missing.missing_gradients_error(self)  # on every rank: all saw the flag
        if reports is None:  # world size 1: nobody else to tell
            return
        counts = uneven(reports) if self.config.check_accumulation else None
        if counts is not None:
            raise GradSyncError(uneven_accumulation_message(counts, self.iteration))

    def _defer_reports(self) -> None:
        """Deferred read-back: this rank's own missing gradients raise now (the host knows
        them); the summed reports are read once they have landed (`_check_deferred`)."""
        pending = self._reports.finish_later(self._waits)
        self._check_deferred()  # what has landed (a joined rank never starts an iteration)
        if pending is not None:
            self._deferred.append((self.iteration, pending))
        if self._missing:
            mine = [(self._bucket_of[i].index, self.names[i]) for i in self._missing]
            raise GradSyncError(missing_gradients_message(
                {self.rank: mine}, self.iteration, self._find_unused, self._static is not None, self.rank
            ))

    def _check_deferred(self) -> None:
        """Read the reports of earlier iterations that have landed (asking, not waiting), and
        those of the iteration before last in any case; raise what they show. The same for
        the deferred finite checks' norms."""
        self._drain(self._finite, lambda _, finite: finite.check())
        self._drain(self._deferred, self._check_reports_of)

    def _drain(self, queue: deque, check: Callable[[int, Any], None]) -> None:
        """Check, oldest first, the (iteration, pending read) entries of `queue` that have
        landed or are from before this iteration; after one raises, drop the rest."""
        while queue:
            iteration, pending = queue[0]
            if iteration >= self.iteration and not pending.ready():
                return
            queue.popleft()
            try:
                check(iteration, pending)
            except GradSyncError:
                queue.clear()
                raise

    def _check_reports_of(self, iteration: int, pending: HostRead) -> None:
        reports = decode(pending.get(), torch.int64)
        elsewhere = [r for r, report in enumerate(reports) if report.missing and r != self.rank]
        if elsewhere:
            raise GradSyncError(missing_elsewhere_message(elsewhere, iteration, self.rank))
        counts = uneven(reports) if self.config.check_accumulation else None
        if counts is not None:
            raise GradSyncError(uneven_accumulation_message(counts, iteration))

    def _reports_ride_along(self) -> bool:
        # Without a hook each rank's report rides after the last bucket's gradients in its own
        # all-reduce (free); otherwise it takes a tiny all-reduce of its own, after every bucket
        # (always when read back deferred: in int64, never saturated, no follow-up collective).
        # Not under mixed precision either: gloo sums a longer tensor in another order at 3 ranks
        # and more, and its last bucket would no longer be summed as torch's is.
        return (self._comm_hook is None and not self._divides_sums and not self._defer
                and self.buckets[-1].has_tail)

    # ---------------------------------------------------------------- hooks, settings

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with `hook(state, bucket)` instead of averaging all-reduce."""
        check_registration(self._comm_hook, hook, self.iteration, self._scale_at_launch)
        if self._shards is not None:  # the hook's reduction, done as a reduce-scatter
            try:
                hook_dtype = sharded_hook_dtype(state, hook, self.process_group)
            except ValueError as error:
                raise ValueError(f"register_comm_hook: the gradients are sharded; {error}") from None
            if self._shards.pool is not None and hook_dtype is not None:
                self._shards.pool.keep *= 2  # a cast beside each buffer
            self._shards = dataclasses.replace(self._shards, hooked=True, hook_dtype=hook_dtype)
            for bucket in self.buckets:  # in place: a sharded optimizer holds views of their shards
                bucket.reduce_as_hook(hook_dtype)
        self._comm_hook = (state, hook)

    @property
    def comm_hook(self) -> tuple[object, CommHook] | None:
        """(state, hook) as registered, or None."""
        return self._comm_hook

    def _new_chain(self) -> HookChain | None:
        if self._comm_hook is None or self._shards is not None:  # sharded: the buckets run it
            return None
        state, hook = self._comm_hook
        iteration = self.iteration
        return HookChain(
            state, hook, self.buckets, self.process_group, self._timeline.events,
            lambda b: f"bucket {b} (rank {self.rank}, iteration {iteration})", self._clock,
            self._calls.on_stream if self._calls is not None else on_stream,
        )

    def configure(self, **changes: object) -> None:
        """Change what may change between iterations (`config.RUNTIME_FIELDS`: timeout, the
        NaN, accumulation and unused-report checks, recording, the clock), validated as the
        frozen config validates itself; every rank must make the same change."""
        fixed = sorted(set(changes) - RUNTIME_FIELDS)
        if fixed:
            raise ValueError(
                f"Reducer.configure: {', '.join(fixed)} cannot change after construction "
                f"(they shape the buckets); changeable: {', '.join(sorted(RUNTIME_FIELDS))}"
            )
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("Reducer.configure: an iteration is still being reduced")
        self.config = dataclasses.replace(self.config, **changes)  # type: ignore[arg-type]
        self._clock = _recording_clock(self.config, self._device_clock)
        self._defer = _defers_reads(self.config, self.process_group)

    def set_static_graph(self) -> None:
        """Turn static_graph on before the first iteration (torch's `_set_static_graph`): the
        first iteration then learns the graph, and the rebuild in ready order follows the
        second. Replaces the search for unused parameters, as the constructor's flag does."""
        if self.iteration > 0:
            raise RuntimeError(
                f"set_static_graph: {self.iteration} iterations have run already; the static "
                "graph must be known from the first. Pass static_graph=True when wrapping instead."
            )
        if self._static is not None:
            return
        self.config = dataclasses.replace(self.config, static_graph=True, find_unused_parameters=False)
        self._static, self._find_unused = StaticGraph(len(self.params)), False
        self._needs_rebuild = self.config.rebuild_bucket_size_limits is not None

    def set_stall_monitor(self, monitor: StallMonitor, timeout: timedelta | None = None) -> None:
        """Report stalls through `monitor` (gradsync's `StallWatchdog`): a log report when the
        end of backward waits longer than its `warn_after`, the error (with the report) after
        `timeout` (default: the current one)."""
        self._waits.monitor = monitor
        if timeout is not None:
            self.configure(timeout=timeout)

    @property
    def last_unused_report(self) -> dict[str, list[int]]:
        """With `config.report_unused`: {parameter name: ranks that left it unused}."""
        return self._used.last_report

    def shadow_iteration(self) -> None:
        """On a rank that has run out of data, match the collectives of one synchronised
        iteration of the ranks still training (`shadow`)."""
        from .shadow import shadow_iteration

        shadow_iteration(self)


def _on_backward_start(reducer: weakref.ref[Reducer], iteration: int, _grads: object) -> None:
    """Prehook of forward's output nodes: queue the end of this iteration's backward."""
    live = reducer()
    if live is not None and live.iteration == iteration and not live._end_queued and live.phase in (
        Phase.PREPARED, Phase.BACKWARD, Phase.LAUNCHED
    ):
        live._queue_end_of_backward()


def _attach_hooks(reducer: Reducer) -> None:
    # The hooks hold the reducer weakly: parameters outlive wrappers (a module can be wrapped
    # again), and a reducer kept alive by its own hooks would keep its process group alive
    # until the interpreter tears it down at exit.
    me = weakref.ref(reducer)
    handles = [
        p.register_post_accumulate_grad_hook(functools.partial(_dispatch_hook, me, i))
        for i, p in enumerate(reducer.params)
    ]
    weakref.finalize(reducer, _remove_handles, handles)


def _dispatch_hook(reducer: weakref.ref[Reducer], index: int, param: torch.Tensor) -> None:
    live = reducer()
    if live is not None:
        live._autograd_hook(index, param)


def _defers_reads(config: ReducerConfig, group: dist.ProcessGroup) -> bool:
    if config.read_back == "auto":
        return not host_runs_collectives(group)
    return config.read_back == "deferred"


def _no_clock() -> int:
    return 0


def _untimed() -> int:
    return UNTIMED


def _recording_clock(config: ReducerConfig, device_clock: EventClock | None) -> Callable[[], int]:
    if not config.record_events:
        return _no_clock
    if device_clock is not None and config.clock in (time.perf_counter_ns, device_clock):  # not the user's own
        return device_clock
    return config.clock


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _record_completion(events: list, clock: Callable[[], int], bucket_index: int, _future: object) -> None:
    events.append((clock(), EventKind.COMPLETE, bucket_index))


def _default_names(params: Sequence[torch.Tensor]) -> list[str]:
    return [f"parameter[{i}]" for i in range(len(params))]


def _check_params(params: list[torch.Tensor], names: list[str]) -> None:
    if not params:
        raise ValueError("gradsync.Reducer needs at least one parameter to synchronise")
    if len(names) != len(params):
        raise ValueError(f"got {len(names)} parameter names for {len(params)} parameters")
    frozen = [n for p, n in zip(params, names) if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"parameters that do not require grad cannot be synchronised: {format_names(frozen)}. "
            "Leave them out of the Reducer (DistributedDataParallel does so automatically), or "
            "set requires_grad=True on them."
        )
    seen: dict[int, str] = {}
    for p, n in zip(params, names):
        if id(p) in seen:
            raise ValueError(
                f"parameter {n!r} is the same tensor as {seen[id(p)]!r}; pass each shared "
                "parameter once"
            )
        seen[id(p)] = n
