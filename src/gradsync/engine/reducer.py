"""The Reducer: bucketed, overlapped gradient all-reduce driven by autograd hooks.

One gradient's path, as torch's c10d Reducer runs it:

1. `prepare_for_backward(outputs)` (from forward) starts the iteration (`iteration.Iteration`):
   with unused-parameter search on, it finds the parameters that cannot get a gradient (or
   leaves the question for backward to answer), and it asks backward to call
   `_end_of_backward` once backward has passed through the outputs.
2. `_autograd_hook` (the parameter's post-accumulate-grad hook) marks it ready (`_mark`); the
   first hook also marks the unused parameters, so no bucket waits for them.
3. When a bucket's last gradient arrives, the owner of the buckets' reductions
   (`reductions.Reductions`) fills it (copied in, divided by the world size, which keeps half
   precision from overflowing in the sum) and, strictly in order, starts its all-reduce, which
   runs while autograd computes the rest.
4. `_end_of_backward` starts what never filled (and has every rank raise, naming the
   parameters), then `finish_backward` has `Reductions.write_back` wait for each bucket and
   write the averages into `.grad`.

Around it: `bucket_set` (the layout's buckets), `layout` (the one-time rebuild in ready order),
`static_graph`, `used_map`, `reports` (each rank's report), `shadow` (a joined rank's side),
and `Timelines` below (the finished iterations' timelines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import itertools
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from . import layout as layouts
from . import missing, shadow, static_graph
from .bucket import Bucket
from .bucket_set import BucketSet
from .bucket_shard import ReduceBy
from .bucketing import compute_bucket_assignment_by_size, validate_bucket_indices
from .comm import CommHook, check_registration
from .config import ReducerConfig
from .device import CudaCalls, DeviceCalls
from .errors import GradSyncError, format_names, marked_twice_message
from .events import EventClock, final_reading, last_tokens, resolve_timeline
from .iteration import Iteration
from .pool import BufferPool
from .reductions import BucketStepper, Reductions, profiled, quiesce
from .reports import ReportChecks
from .settings import Settings, changed_config
from .timeline import DiscardedEvents, EventKind, IterationTimeline, untimed
from .unused import Accumulators, reachable_from, reachable_parameters
from .used_map import UsedMap
from .waits import StallMonitor, Waits

__all__ = ["Phase", "Reducer", "StallMonitor", "arguments_among", "find_tensors",
           "flat_arguments"]


class Phase(enum.Enum):
    """Where the current iteration is."""

    IDLE = "idle"  # no synchronised iteration under way
    PREPARED = "prepared"  # forward said a backward will synchronise; no gradient yet
    BACKWARD = "backward"  # gradients arriving; buckets filling and launching in order
    LAUNCHED = "launched"  # every bucket on its way; finished at the end of backward
    # backward ended, buckets still landing where their parameters are needed, stepped as
    # they land (`Reducer.step_each_bucket(..., lazily=True)`)
    LANDING = "landing"
    REDUCED = "reduced"  # written back; a gradient now is a late one (until the next forward)


# The hot path compares against module constants (a global lookup, not an attribute of Phase).
_PREPARED, _BACKWARD, _LAUNCHED, _REDUCED = (Phase.PREPARED, Phase.BACKWARD, Phase.LAUNCHED,
                                             Phase.REDUCED)


class Reducer:
    """Synchronise the gradients of `params` over `process_group`, one bucket at a time.

    `bucket_indices` lists, per bucket, indices into `params`; buckets are reduced in that order,
    so the first bucket should hold the parameters whose gradients are ready first.
    """

    # The wrapper's "forwards since the last synchronisation, and reset", held weakly (the
    # wrapper holds this reducer; a dead wrapper's count is taken as one forward).
    take_micro_steps: weakref.WeakMethod[Callable[[], int]] | None = None

    def __init__(
        self, params: Sequence[torch.Tensor], bucket_indices: Sequence[Sequence[int]],
        process_group: dist.ProcessGroup, *, param_names: Sequence[str] | None = None,
        config: ReducerConfig | None = None, expect_sparse_gradient: Sequence[bool] | None = None,
        device_calls: DeviceCalls | None = None,
    ) -> None:
        self.params = list(params)
        self.names = list(param_names) if param_names is not None else _default_names(self.params)
        _check_params(self.params, self.names)
        self.expect_sparse_gradient = list(expect_sparse_gradient or [False] * len(self.params))
        self.process_group, config = process_group, config or ReducerConfig()
        self.rank, self.world_size = process_group.rank(), process_group.size()
        self._calls, device_clock = _on_the_device(self.params[0], config, device_calls)
        self._settings = Settings.of(config, process_group, device_clock, self.params[0].dtype,
                                     len(self.params))
        self._used, self._waits = (UsedMap(self.names, process_group),
                                   Waits(process_group, self.names))
        self._checks = ReportChecks(process_group, self._waits)
        self._bucket_set = BucketSet(self.params, self.expect_sparse_gradient, self.names,
                                     config.bucket_dtype, self.world_size,
                                     self._settings.divides_after_sum)
        self._reductions = Reductions(self._settings, self._bucket_set, process_group,
                                      self._checks, self._waits, self._used, self._calls)
        self._timelines = Timelines(config.history, self.rank, device_clock)
        self._install(validate_bucket_indices(bucket_indices, self.params, self.names))
        self._needs_rebuild = config.rebuild_bucket_size_limits is not None and (
            config.static_graph or not config.find_unused_parameters)
        self.iteration, self._forward_start_ns = 0, 0
        self.reductions = 0  # synchronised iterations finished (a sharded optimizer counts them)
        self.last_used: list[int] | None = None  # the used map they were written back with
        # the sharded optimizer's weak reference
        self.shard_owner: Callable[[], object] | None = None
        # `register_finish_hook`
        self._finish_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self.phase, self._it = Phase.IDLE, Iteration.idle(0, len(self.params), self.world_size)
        self.on_use: LandOnUse | None = None  # lands buckets as the forward uses them
        self.on_use_ended: Callable[[], None] | None = None  # called as each `on_use` exits
        # Called wherever buckets still landing would land, on every rank alike, landing or
        # not on this one.
        self.before_landing: Callable[[], None] | None = None
        # Held for the unused search to ask the engine about (else it walks the graph); not
        # with parameters cast each forward (`bucket_dtype`), whose accumulators are new each time.
        held = self._settings.find_unused and config.bucket_dtype is None
        self._accumulators = Accumulators(self.params) if held else None
        _attach_hooks(self)
        _quiesce_at_exit(self)

    @property
    def iteration_listeners(self) -> list[Callable[[int, Any], None]]:
        """Called with (rank, timeline) as each finished iteration's timeline is resolved."""
        return self._timelines.listeners

    @property
    def config(self) -> ReducerConfig:
        """The configuration in force (`configure` changes it between iterations)."""
        return self._settings.config

    @config.setter
    def config(self, config: ReducerConfig) -> None:
        self._settings.reconfigure(config, self.process_group)

    # ----------------------------------------------------------------------------- layout

    @property
    def bucket_indices(self) -> list[list[int]]:
        return [list(b.param_indices) for b in self.buckets]

    def _install(self, layout: list[list[int]]) -> None:
        order, tail = None, self.config.priority_tail_bytes
        # A communication hook runs over the buckets by index, so the tail would not go first:
        # not cut, and a hook's state kept per bucket (PowerSGD's) stays valid.
        if tail and self._bucket_set.shards is None and self._settings.comm_hook is None:
            layout, order = layouts.priority_tail(layout, self.params, self.expect_sparse_gradient,
                                                  tail, self.config.chunk_bytes)
        self._bucket_set.install(layout, self.config.gradient_as_bucket_view)
        self._reductions.set_order(order)
        self.buckets = self._bucket_set.buckets
        self._bucket_of, self._position = self._bucket_set.bucket_of, self._bucket_set.position

    def install_layout(self, layout: Sequence[Sequence[int]]) -> None:
        """Replace the bucket layout between iterations (every rank must install the same)."""
        self.land()
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("install_layout: an iteration is still being reduced")
        self._bucket_set.check_relayout()
        self._needs_rebuild = False
        self._install(validate_bucket_indices(layout, self.params, self.names))

    def shard_gradients(self, layout: Sequence[Sequence[int]], in_flight: int | None = None,
                        reduce_by: ReduceBy | str | None = None) -> None:
        """Reduce-scatter from now on, in buckets of `layout` for good: each rank keeps only its
        shard of each bucket's averaged gradients (`Bucket.shard`), `.grad` cleared once a
        gradient is in its bucket; `in_flight` and `reduce_by` as `BucketSet.shard` takes them.
        For a sharded optimizer (`gradsync.ZeroRedundancyOptimizer`); every rank must call it
        alike."""
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("shard_gradients: an iteration is still being reduced")
        if self._reductions.stepper is not None:
            raise RuntimeError("shard_gradients: an optimizer steps each bucket "
                               "(overlap_optimizer), and sharded gradients never reach .grad; "
                               "use one or the other")
        self._bucket_set.shard(self.process_group, in_flight, reduce_by, self._settings.comm_hook,
                               self._settings.casts_to_reduce_dtype,
                               self.config.gradient_as_bucket_view)
        self._needs_rebuild = False
        self._install(validate_bucket_indices(layout, self.params, self.names))

    @property
    def sharded(self) -> bool:
        """Whether buckets are reduce-scattered (`shard_gradients`)."""
        return self._bucket_set.shards is not None

    @property
    def buffer_pool(self) -> BufferPool | None:
        """Lends the transient buckets' buffers (sharded, without bucket views); a sharded
        optimizer's gathers borrow from it too, outside backward."""
        return self._bucket_set.pool

    @property
    def shards_reduced_by(self) -> ReduceBy | None:
        """How sharded buckets are reduced; None when not sharded."""
        return self._bucket_set.shards.reduce_by if self._bucket_set.shards is not None else None

    @property
    def rebuilt(self) -> bool:
        """Whether the one-time rebuild in ready order has happened (or will not happen)."""
        return not self._needs_rebuild

    def rebuild_if_due(self) -> None:
        """Rebuild the buckets in ready order once, as torch: after the first synchronised
        iteration, or with a static graph the second (the first only counts hooks)."""
        if (not self._needs_rebuild
                or self._timelines.finished < (2 if self._settings.static else 1)):
            return
        self._needs_rebuild = False
        layout = layouts.rebuilt_layout(
            # its order, not times
            self._timelines.last(), self.params, self.expect_sparse_gradient,
            self.config.rebuild_bucket_size_limits or (), self.process_group, self.config.timeout,
        )
        if layout is not None:  # None on every rank alike
            self._install(layout)

    def locate(self, index: int) -> tuple[int, int]:
        """(bucket index, position in that bucket) of parameter `index`."""
        return self._bucket_set.locate(index)

    # ------------------------------------------------------------------ iteration lifecycle

    def prepare_for_backward(
        self, outputs: object = None, divisor: int | None = None, micro_steps: int | None = None
    ) -> None:
        """Start a synchronised iteration; call from forward with its outputs.

        With find_unused_parameters, parameters not reachable from `outputs` will be marked
        ready as soon as backward starts. Whenever `outputs` hold tensors, the end of the
        backward through them is where the iteration is finished: a bucket whose gradients
        never came is reported there, on every rank. Gradients are averaged over `divisor`
        ranks (default: the group size; fewer when ranks have joined early and the caller says
        so). `micro_steps` counts the forwards this synchronisation covers (1 + those under
        no_sync); every rank must cover the same number (`config.check_accumulation`). Not
        given (a framework preparing the backward itself, as torch's reducer lets it), it is
        asked of `take_micro_steps`, which the wrapper sets, or taken as 1.
        """
        if self.phase is Phase.LANDING:  # what the forward did not need (parameters unused)
            self.land()
        self._check_prior_reduction_finished()
        self._checks.check_landed(self.iteration, self.config.check_accumulation)
        self._timelines.publish_landed()
        self.rebuild_if_due()
        self.iteration += 1
        self._clear_reduction()
        self.phase = Phase.PREPARED
        if self._waits.monitor is not None:
            self._waits.monitor.mark_progress(self.iteration)
        tensors = find_tensors(outputs) if outputs is not None else []
        if micro_steps is None:
            take = self.take_micro_steps() if self.take_micro_steps is not None else None
            micro_steps = take() if take is not None else 1
        it = self._it = self._new_iteration(divisor or self.world_size, micro_steps)
        self._start_search(it, tensors)
        self._reductions.begin(it)
        # Backward reaches forward's outputs first, in the outermost backward (a reentrant
        # checkpoint's nested backward comes later, inside it); a callback queued from there
        # runs when that whole backward has ended: the one place to see a bucket left unfilled.
        nodes = {id(t.grad_fn): t.grad_fn for t in tensors if t.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(functools.partial(_on_backward_start, weakref.ref(self), it))
        it.watching = bool(nodes)

    def _new_iteration(self, divisor: int, micro_steps: int) -> Iteration:
        """This iteration's state, its timeline started now. The ready order is recorded
        whatever the config says while the rebuild needs it (without it the first iteration's
        single bucket stayed for good, and nothing overlapped). On the device, gradients are
        timed on sampled iterations only (a CUDA event per gradient costs the host
        microseconds); buckets and the iteration always are."""
        s, layout = self._settings, self._bucket_set
        sampled = not s.device_timed or self.iteration % s.config.time_gradients_every == 0
        timeline = IterationTimeline(
            iteration=self.iteration,
            start_ns=s.clock(),
            bucket_indices=layout.layout,  # shared, not copied: a layout is never mutated
            bucket_bytes=layout.layout_bytes,
            events=[] if s.config.record_events or self._needs_rebuild else DiscardedEvents(),
            forward_start_ns=self._forward_start_ns,
            gradients_timed=sampled,
        )
        return Iteration(self.iteration, [False] * len(self.params), timeline,
                         s.clock if sampled else untimed, divisor, micro_steps)

    def _start_search(self, it: Iteration, outputs: list[torch.Tensor]) -> None:
        """`it.unused`, the parameters to mark ready at the first hook: unreachable from
        `outputs` (unused-parameter search), or, with a static graph once learned, never fired.
        Or the search left for backward (`_answer_in_backward`): `it.search`, a weak reference
        to the one node every output comes from."""
        s, unused, search = self._settings, [], None
        if s.find_unused:
            search = _deferrable(outputs) if self._accumulators is not None else None
            if search is None:
                unused = _unreached(self.params, reachable_parameters(outputs))
        if s.static is not None:
            s.static.start_iteration()
            if s.static.learned:
                unused, search = list(s.static.unused), None
        it.unused, it.search, it.unused_pending = unused, search, bool(unused) or search is not None

    def prepare_for_forward(self) -> None:
        """Note that a new forward has started (call it on every forward, synced or not).

        Until then, a gradient that arrives for a parameter already reduced in this iteration is
        an error: it would be silently left out of the average. Buckets still landing go on
        landing, each where the forward uses it (`landing_on_use`).
        """
        if self.phase is Phase.REDUCED:
            self.phase = Phase.IDLE
        self._forward_start_ns = self._settings.clock()

    def note_module_forward(self) -> None:
        """The wrapped module ran forward (through the wrapper or not): gradients from here on
        belong to a new graph, not late arrivals for the last reduced iteration. Not through
        the wrapper, nothing may still be landing under it."""
        if self.before_landing is not None:
            self.before_landing()
        if self.phase is Phase.LANDING and self.on_use is None:
            self.land()  # and so reduced
        if self.phase is Phase.REDUCED:
            self.phase = Phase.IDLE

    def _clear_reduction(self) -> None:
        """Drop what an iteration left in flight: reports, used map, the buckets' state."""
        self._checks.reports.abandon()
        # the only users of a used map
        if self._settings.find_unused or self._settings.static is not None:
            self._used.abandon()
        self._reductions.clear()
        self._waits.end()

    def _check_prior_reduction_finished(self) -> None:
        # Reached only where the end of backward could not be seen (forward returned no
        # tensor, or the loss did not come from its outputs): report the missing gradients now.
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            unmarked = self._it.unmarked()
            error = missing.unfinished_iteration_error(
                [self.names[i] for i in unmarked], self.rank, self._settings.find_unused,
                self.iteration, self._waits.monitor,
                [self.names[i] for i in unmarked if not self.params[i].requires_grad],
            )
            self.abandon_iteration()
            raise error

    def abandon_iteration(self) -> None:
        """Drop a broken iteration (after an error, or a step fault tolerance discards)."""
        self.phase = Phase.IDLE
        self._it = Iteration.idle(self.iteration, len(self.params), self._it.divisor)
        self._clear_reduction()

    # ----------------------------------------------------------------------- hot path

    def _autograd_hook(self, index: int, param: torch.Tensor) -> None:
        # Runs once per parameter per backward: plain bookkeeping only. Gradients are copied
        # into the bucket in one batch when its last one arrives (`Bucket.fill`).
        phase, it = self.phase, self._it
        if self._settings.find_unused and param.grad is not None:
            self._used.local[index] = 1  # without a gradient (an output left out) it is unused
        if phase is not _BACKWARD:  # the common case first: one comparison
            if phase is _PREPARED:
                self.phase = _BACKWARD
                if self._calls is not None:  # once per backward: hooks run on its stream(s)
                    it.backward_stream = self._calls.current_stream()
            elif phase is not _LAUNCHED:  # idle or reduced: not ours to count
                if phase is _REDUCED and it.marked[index] and _runs_again(it):
                    raise GradSyncError(marked_twice_message(self.names[index], index, self.rank,
                                                             "late"))
                return
        static = self._settings.static
        if static is not None and not static.fire(index):
            if static.learning:
                static_graph.learning_fire(static, it, self._used, index, param,
                                           self._queue_end_of_backward)
            return
        if it.unused_pending:  # first, as torch: a parameter it marks unused cannot fire
            self._mark_unused(it, index)
        if it.marked[index]:
            cause = "unused" if index in it.unused else "repeat"
            raise GradSyncError(marked_twice_message(self.names[index], index, self.rank, cause))
        self._mark(it, index, EventKind.READY)
        if self._reductions.hook_waiting:  # a bucket whose predecessor's hook has completed since
            self._reductions.hand_to_hook(it)

    def _mark_unused(self, it: Iteration, first: int | None = None) -> None:
        # Deferred from prepare_for_backward to the first hook, as torch does: a forward that is
        # never followed by backward then leaves no half-done iteration behind.
        if it.search is not None:  # the search's answer, for good (asked now if backward has
            if not it.answered:  # not reached the outputs' node yet)
                answer = self._answer_in_backward(it.search, first)
                assert answer is not None, "a gradient came inside torch.autograd.grad"
                it.unused = answer
            it.search = None
        it.unused_pending = False
        for unused in it.unused:
            self._mark(it, unused, EventKind.UNUSED)

    def _answer_in_backward(self, search: Callable[[], Any], first: int | None,
                            ) -> list[int] | None:
        """The search left for backward, answered there: in the outputs' node's prehook
        (`first` is None), or at a gradient that came before backward reached that node
        (`first`, its index).

        The engine's answer is the walk's whenever backward runs through the outputs' node: all
        it reaches from there, the engine runs (what it runs besides are parameters used
        outside forward, which torch's DDP rejects). A gradient that came first, while that
        node is still to run, is one of those: torch's DDP marks it unused, then ready, and
        raises; so does the Reducer, given it as unused. A backward that does not run through
        the node gets the walk's answer, or, the node gone with its graph, the engine's. None
        inside `torch.autograd.grad`, which accumulates no gradient (`_on_backward_start`)."""
        assert self._accumulators is not None, ("a search waits for backward only with "
                                                "accumulators held")
        node = search() if first is not None else None
        if first is None or node is None:
            return self._accumulators.unused()
        if torch._C._will_engine_execute_node(node):
            return [first]
        return _unreached(self.params, reachable_from([node]))

    def _mark(self, it: Iteration, index: int, kind: int) -> None:
        it.marked[index] = True
        it.timeline.events.append((it.grad_clock(), kind, index))
        bucket = self._bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            it.timeline.events.append((self._settings.clock(), EventKind.BUCKET_READY,
                                       bucket.index))
            reductions = self._reductions
            reductions.fill(it, bucket)
            if (bucket.index == reductions.next_index and reductions.start_ready(it)
                    and self.phase is _BACKWARD):
                self._all_launched(it)  # strictly in order: this one and every full one after it
        elif kind == EventKind.READY and bucket.copies_early:
            position = self._position[index]
            if bucket.early[position]:
                bucket.copy_early(position, self._reductions.divisor(it),
                                  self.config.gradient_as_bucket_view)

    def _all_launched(self, it: Iteration) -> None:
        """Every bucket is on its way: reduce the used map; finish at the end of backward."""
        self.phase = Phase.LAUNCHED
        if self._settings.find_unused and not self._reductions.hooked:
            self._used.start(self.buckets[0].buffer.device, self.config.report_unused)
        if not it.end_queued:  # backward did not come through the outputs: finish as torch
            self._queue_end_of_backward(it)

    def _queue_end_of_backward(self, it: Iteration) -> None:
        it.end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(self._end_of_backward, it))

    def _end_of_backward(self, it: Iteration) -> None:
        """Queued once per iteration on the autograd engine; runs when backward has ended."""
        if it is not self._it:
            return  # an iteration since abandoned
        if self.phase is Phase.PREPARED:
            # no gradient of ours came (torch.autograd.grad): re-arm
            it.end_queued = it.answered = False
            return
        if self.phase is not Phase.BACKWARD and self.phase is not Phase.LAUNCHED:
            return  # finished already
        if self._settings.static is not None and self._settings.static.learning:
            static_graph.finish_first_iteration(self._settings.static, it, self._mark,
                                                self._start_used_map, self.finish_backward)
            return
        if self.phase is Phase.BACKWARD:
            self._complete_missing(it)
        self.finish_backward()

    def finish_learning_iteration(self) -> None:
        """The static graph's first iteration, finished now if its backward is still running
        (torch's `_delay_all_reduce`); else nothing left to do."""
        learning = self._settings.static is not None and self._settings.static.learning
        if learning and self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            self._end_of_backward(self._it)

    def _start_used_map(self, it: Iteration) -> None:
        if not self._reductions.hooked:  # else at the end, after the hook's collectives
            self._used.start(self.buckets[0].buffer.device, False)

    def _complete_missing(self, it: Iteration) -> None:
        """Backward ended with buckets not full: some gradients never came. Launch those buckets
        anyway (zeros where a gradient is missing), so every rank's collectives still match
        and no rank waits for them, and flag it in this rank's report: the end of backward then
        raises on every rank, naming the parameters (`missing.missing_gradients_error`)."""
        if it.unused_pending:
            self._mark_unused(it)
        it.missing = it.unmarked()
        for index in it.missing:
            self._mark(it, index, EventKind.UNUSED)

    # ------------------------------------------------------------------ end of backward

    def finish_backward(self) -> None:
        """Wait for every bucket and write the averaged gradients into `.grad`. With buckets
        landing lazily (`step_each_bucket(..., lazily=True)`), only those landed already and
        those the stepper does not step whole (`BucketStepper.may_land_later`): the others
        land where their parameters are needed (`land`), stepped as they do."""
        it = self._it
        it.timeline.backward_end_ns = self._settings.clock()
        self._waits.begin(self.iteration, self.config.timeout, self.buckets,
                          self._reductions.done_within)
        if not (self._reductions.lazily and self._reductions.lands_lazily()):
            self._land(it, None, landed_only=False)
            return
        self.phase = Phase.LANDING
        self._reductions.start_reports(it)  # now, on every rank alike, after every bucket
        if not self._land(it, None, landed_only=True):
            stepper = self._reductions.stepper
            assert stepper is not None
            now = [b.index for b in self._reductions.pending() if not stepper.may_land_later(b)]
            if not now or not self._land(it, now, landed_only=False):
                stepper.backward_ended(self._reductions.pending())
        it.timeline.backward_returned_ns = self._settings.clock()

    def land(self, buckets: Sequence[int] | None = None) -> None:
        """Land the last backward's `buckets` still reducing (default: every one), each
        written back and stepped: called where their parameters are needed (a module's
        forward, the next backward, a checkpoint, `OverlappedOptimizer.wait`)."""
        if self.before_landing is not None:
            self.before_landing()
        if self.phase is Phase.LANDING:
            self._land(self._it, buckets, landed_only=False)

    def landing_on_use(self) -> contextlib.AbstractContextManager:
        """Around a forward through the wrapper: while buckets are landing, a torch function
        mode that lands each when one of its parameters is first used (`LandOnUse`), so that
        forward waits for each bucket where it needs it and for nothing else."""
        if self.before_landing is not None:
            self.before_landing()
        if self.phase is not Phase.LANDING:
            return contextlib.nullcontext()
        return LandOnUse(self, self._reductions.pending())

    def _land(self, it: Iteration, buckets: Sequence[int] | None, landed_only: bool) -> bool:
        """Write back what is wanted; once every bucket is, end the iteration (at once on an
        error: the iteration is then dropped). True once ended."""
        done = True  # an error ends the iteration too
        try:
            # Outside any inference mode of the caller's (an evaluation under
            # torch.inference_mode() lands the buckets first): the gradients written back and
            # the optimizer state its step creates must stay tensors the next step may update.
            with torch.inference_mode(False), torch.no_grad(), \
                    profiled("gradsync.finish_backward"):
                done = self._reductions.write_back(it, buckets, landed_only)
        finally:
            if done:
                self.phase = Phase.REDUCED  # the marks kept: a gradient still coming is reported
                it.timeline.finish_ns = self._settings.clock()
                self._timelines.add(it.timeline, self._settings.device_timed)
                if self._settings.find_unused or self._settings.static is not None:
                    self._used.clear()
                self._clear_reduction()
                it.end_queued = True  # until the next iteration: nothing more to finish
        if done:
            self.last_used, self.reductions = self._reductions.written_with, self.reductions + 1
            for hook in list(self._finish_hooks.values()):
                hook()
        return done

    def step_each_bucket(self, stepper: BucketStepper | None, lazily: bool = False) -> None:
        """Tell `stepper` of each bucket as its averages are written back at the end of each
        synchronised backward, while later buckets may still be reducing: an optimizer
        stepped per bucket (`DistributedDataParallel.overlap_optimizer`). The ranks' reports
        are checked before the last bucket is written back, so an error there leaves the
        earlier buckets stepped on every rank alike. None stops it. One at a time, and not
        with sharded gradients, whose averages never reach `.grad`.

        `lazily`: backward ends without waiting, leaving the buckets still reducing to land
        where their parameters are needed next (`land`, `landing_on_use`), where the
        configuration allows (`Reductions.lands_lazily`)."""
        if stepper is not None and self._reductions.stepper is not None:
            raise RuntimeError("step_each_bucket: buckets are already stepped by another "
                               "optimizer; stop it first (step_each_bucket(None))")
        if stepper is not None and self.sharded:
            raise RuntimeError("step_each_bucket: the gradients are sharded "
                               "(ZeroRedundancyOptimizer), so no bucket's averages reach .grad "
                               "to be stepped; ZeroRedundancyOptimizer(overlap_with_ddp=True) "
                               "steps inside backward instead")
        self._reductions.stepper, self._reductions.lazily = stepper, lazily

    @property
    def bucket_stepper(self) -> BucketStepper | None:
        """What steps each bucket as it lands (`step_each_bucket`), if anything does."""
        return self._reductions.stepper

    @property
    def lands_lazily(self) -> bool:
        """Whether backward ends with buckets still reducing, each landing (and stepped) where
        its parameters are next needed: an optimizer stepped per bucket, lazily, in a
        configuration that allows it (`Reductions.lands_lazily`)."""
        return self._reductions.lands_lazily()

    def send_tail_first(self, tail_bytes: int, chunk_bytes: int,
                        layout: Sequence[Sequence[int]] | None = None,
                        credit: int = 0) -> None:
        """From now on send the last `tail_bytes` of gradients in ready order nearest the input
        first, in buckets of at most `chunk_bytes`, with at most `credit` bytes of them
        reducing at once where they land in the next forward (`ReducerConfig.priority_tail_bytes`,
        `credit_bytes`); the
        layout in place is cut so at once, or `layout` is installed cut so (the planner trying
        tails on one layout: a layout cut once is not cut back). Between iterations; every
        rank alike."""
        self.land()
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("send_tail_first: an iteration is still being reduced")
        self.config = dataclasses.replace(self.config, priority_tail_bytes=tail_bytes,
                                          chunk_bytes=chunk_bytes, credit_bytes=credit)
        if layout is not None:
            self.install_layout(layout)
        elif not self.sharded:
            self._install(self.bucket_indices)

    def recap_buckets(self, limits: Sequence[int]) -> None:
        """Cap the buckets at `limits` (bytes, as `ReducerConfig.rebuild_bucket_size_limits`)
        from now on, in the order they are laid out: the one-time rebuild in ready order takes
        them, or, once it has happened, the layout in place is cut again in its own order (not
        under a communication hook, whose state may be kept per bucket, as PowerSGD's is).
        Between iterations; every rank alike."""
        self.land()
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("recap_buckets: an iteration is still being reduced")
        if not self._needs_rebuild and self._settings.comm_hook is not None:
            return
        self.config = dataclasses.replace(self.config, rebuild_bucket_size_limits=tuple(limits))
        if self._needs_rebuild or self.sharded:
            return
        self.install_layout(self.layout_by_caps())

    def layout_by_caps(self) -> list[list[int]]:
        """The layout in place cut again by the caps (`rebuild_bucket_size_limits`) in its own
        order: a tail's chunks merged back into buckets, to cut another tail from (without
        caps, the layout in place)."""
        limits = self.config.rebuild_bucket_size_limits
        if limits is None:
            return [list(bucket) for bucket in self.bucket_indices]
        order = [i for bucket in self.bucket_indices for i in bucket]
        layout, _ = compute_bucket_assignment_by_size(
            [self.params[i] for i in order], list(limits), self.expect_sparse_gradient, order)
        return layout

    def register_finish_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call `hook()` each time a synchronised backward has been finished here: every
        bucket landed, the reports checked, the averages written back (or in the shards). Not
        after a joined rank's shadow iteration, whose joinables are called by `Join` instead.
        A sharded optimizer stepping inside backward (`overlap_with_ddp`) is the one user."""
        handle = RemovableHandle(self._finish_hooks)
        self._finish_hooks[handle.id] = hook
        return handle

    # ------------------------------------------------------------------------- history

    @property
    def history(self) -> Any:
        """The last `config.history` finished iterations' timelines (on a GPU, reading it
        waits for the events of iterations still in flight: off the step path)."""
        return self._timelines.recent

    @property
    def _unresolved(self) -> Any:
        return self._timelines.unresolved

    # ---------------------------------------------------------------- hooks, settings

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with `hook(state, bucket)` instead of averaging all-reduce."""
        check_registration(self._settings.comm_hook, hook, self.iteration,
                           self._settings.casts_to_reduce_dtype)
        if self._bucket_set.shards is not None:  # the hook's reduction, done as a reduce-scatter
            self._bucket_set.reduce_as_hook(state, hook, self.process_group)
        self._settings.comm_hook = (state, hook)

    @property
    def comm_hook(self) -> tuple[object, CommHook] | None:
        """(state, hook) as registered, or None."""
        return self._settings.comm_hook

    def configure(self, **changes: object) -> None:
        """Change what may change between iterations (`config.RUNTIME_FIELDS`: timeout, the
        NaN, accumulation and unused-report checks, recording, the clock), validated as the
        frozen config validates itself; every rank must make the same change."""
        changed = changed_config(self.config, changes)
        self.land()
        if self.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            raise RuntimeError("Reducer.configure: an iteration is still being reduced")
        self.config = changed

    def set_static_graph(self) -> None:
        """Turn static_graph on before the first iteration (torch's `_set_static_graph`): the
        first iteration then learns the graph, and the rebuild in ready order follows the
        second. Replaces the search for unused parameters, as the constructor's flag does."""
        if self.iteration > 0:
            raise RuntimeError(
                f"set_static_graph: {self.iteration} iterations have run already; the static "
                "graph must be known from the first. Pass static_graph=True when wrapping instead."
            )
        if self._settings.static is None:
            self.config = self._settings.make_static(len(self.params))
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
        iteration of the ranks still training (`shadow`), on its own buckets, zeroed."""
        self.land()
        self.rebuild_if_due()
        # Averaged over the ranks its last iteration averaged over (the active ranks' divisor).
        it = Iteration.idle(self.iteration, len(self.params), self._it.divisor)
        it.micro_steps, it.joined = 0, True
        self._waits.begin(self.iteration, self.config.timeout, [])
        try:
            self.last_used, self.reductions = (
                shadow.shadow_iteration(self._reductions, self._used, it), self.reductions + 1)
        finally:
            self._clear_reduction()


class Timelines:
    """The last `keep` finished timelines of one rank, and those still in flight: kept,
    published to listeners, and on a GPU resolved into device time once their events have passed.

    A timeline timed on the host is published when its iteration finishes. One timed with CUDA
    events (`events.EventClock`) waits in `unresolved` until someone reads `recent`, which resolves
    it (off the step path); while a listener wants every iteration, it is published as soon as its
    last events have passed (asked at a later iteration's start, never waited for). Nobody looking,
    the device is asked nothing: torch's reducer too reads its events on sampled iterations only.
    """

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
            if getattr(listener, "wanted", _always)():
                listener(self.rank, timeline)


def _always() -> bool:
    return True


class LandOnUse(TorchFunctionMode):
    """While buckets are landing (`Reducer.landing_on_use`): a torch function given a
    parameter of one lands that bucket first. Exact where module hooks are not: a parameter
    used by a function of another module (`nn.MultiheadAttention`'s `out_proj`, tied weights)
    lands before its first use all the same, never stepped after the forward has saved it."""

    def __init__(self, reducer: Reducer, pending: Sequence[Bucket]) -> None:
        super().__init__()
        self.reducer = reducer
        self.bucket_of = {id(p): b.index for b in pending for p in b.params}

    def __enter__(self) -> LandOnUse:
        self.reducer.on_use = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.reducer.on_use = None
        super().__exit__(*exc)
        if self.reducer.on_use_ended is not None:  # off the stack: a mode below may come off too
            self.reducer.on_use_ended()

    def __torch_function__(self, func: Callable, types: object, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.bucket_of:
            self._land_used(args, kwargs)
        return func(*args, **kwargs)

    # Under torch.compile dynamo traces a mode's __torch_function__ into the module's graph:
    # a landing (a wait, then the optimizer's step) must run as written, not be traced (the
    # step compiled would round as the compiled kernels do, not as the optimizer's own).
    @torch.compiler.disable
    def _land_used(self, args: tuple, kwargs: dict) -> None:
        bucket_of = self.bucket_of
        if hit := {bucket_of[id(a)] for a in arguments_among(args, kwargs, bucket_of)}:
            self.bucket_of = {k: v for k, v in bucket_of.items() if v not in hit}
            self.reducer.land(sorted(hit))


def arguments_among(args: tuple, kwargs: dict, ids: Mapping[int, object]) -> list[Any]:
    """The arguments of a torch function (inside lists and tuples too) whose `id` is a key of
    `ids`, each once: the parameters a function is given (`LandOnUse`, and the overlapped
    optimizer's read guard)."""
    found, seen = [], set[int]()
    for item in flat_arguments(args, kwargs):
        key = id(item)
        if key in ids and key not in seen:
            seen.add(key)
            found.append(item)
    return found


def flat_arguments(args: tuple, kwargs: dict) -> Iterator[Any]:
    """The arguments of a torch function, those inside lists and tuples one by one."""
    for arg in itertools.chain(args, kwargs.values()):
        yield from arg if isinstance(arg, (list, tuple)) else (arg,)


def find_tensors(obj: object) -> list[torch.Tensor]:
    """All tensors inside an arbitrary forward output: tuples, lists, dicts, dataclasses."""
    found: list[torch.Tensor] = []
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif id(item) in seen or isinstance(item, (str, bytes)):
            continue
        elif isinstance(item, Mapping):
            seen.add(id(item))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            seen.add(id(item))
            stack.extend(item)
        elif hasattr(item, "__dataclass_fields__"):
            seen.add(id(item))
            stack.extend(getattr(item, f) for f in item.__dataclass_fields__)
    return found


def _deferrable(outputs: list[torch.Tensor]) -> Callable[[], object] | None:
    """A weak reference to the node every output comes from (the wrapper's output sink), or
    None where the search must walk now: outputs from several nodes, a leaf among them, or a
    node that cannot be held weakly (holding it strongly would keep a graph never
    backpropagated alive)."""
    nodes = {t.grad_fn for t in outputs}
    if len(nodes) != 1:
        return None
    node = nodes.pop()
    if not isinstance(node, torch._C._FunctionBase):  # None (a leaf), or a C++ node
        return None
    return weakref.ref(node)


def _unreached(params: Sequence[torch.Tensor], reached: set[int]) -> list[int]:
    return [i for i, p in enumerate(params) if id(p) not in reached]


def _on_the_device(param: torch.Tensor, config: ReducerConfig, calls: DeviceCalls | None,
                   ) -> tuple[DeviceCalls | None, EventClock | None]:
    """On a GPU: its streams (a bucket is filled and launched on the stream backward runs on),
    and the clock that times the timeline with CUDA events, resolved once they have passed."""
    if calls is None and param.is_cuda:
        calls = CudaCalls()
    if isinstance(config.clock, EventClock):
        return calls, config.clock
    return calls, EventClock(calls=calls) if calls is not None else None


def _on_backward_start(reducer: weakref.ref[Reducer], it: Iteration, _grads: object) -> None:
    """Prehook of forward's output nodes: queue the end of this iteration's backward, and answer
    the unused-parameter search if it waits for backward (before any gradient of this one)."""
    live = reducer()
    if live is None or live._it is not it:
        return
    if live.phase is Phase.REDUCED:  # a second backward through these outputs (`_runs_again`)
        it.again = torch._C._current_graph_task_id()
        return
    if it.search is not None and live.phase is Phase.PREPARED:
        if (unused := live._answer_in_backward(it.search, None)) is None:
            return  # torch.autograd.grad: the search waits for a backward that accumulates
        it.unused, it.answered = unused, True
    if not it.end_queued and live.phase in (Phase.PREPARED, Phase.BACKWARD, Phase.LAUNCHED):
        live._queue_end_of_backward(it)


def _runs_again(it: Iteration) -> bool:
    """Whether a gradient coming after `it` was reduced comes from a backward through its
    forward's outputs again (a retained graph's second backward: left out of the average, an
    error), rather than from a backward of a graph of its own (a loss over the parameters
    alone, backward without a forward: local, as with torch's DDP). Without outputs to watch,
    taken for the former."""
    return not it.watching or it.again == torch._C._current_graph_task_id()


def _quiesce_at_exit(reducer: Reducer) -> None:
    """Once the reducer is dropped, or at interpreter exit if it never is, wait a little for
    its collectives still in flight (`reductions.quiesce`). The overlapped optimizer leaves the
    last step's buckets reducing after `step()`, and a script may end right there: a gloo
    collective completing while the interpreter is being finalized calls back into Python (its
    completion callback) from gloo's thread, which aborts the process ("terminate called
    without an active exception"). The flights are held, not the reducer: it stays free to go."""
    weakref.finalize(reducer, quiesce, reducer._reductions.flights)


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


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()


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
