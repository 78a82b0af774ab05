"""The Reducer: bucketed, overlapped gradient all-reduce driven by autograd hooks.

One iteration, as torch's c10d Reducer runs it:

1. `prepare_for_backward(outputs)` (from forward) resets the accounting and, with unused-parameter
   search on, walks the graph from the outputs to find parameters that cannot get a gradient.
2. Each parameter's post-accumulate-grad hook marks it ready: its gradient is scaled by 1/world
   while it is copied into its bucket (pre-dividing keeps half precision from overflowing in the
   sum). The first hook also marks the unused parameters ready, so no bucket waits for them.
3. When a bucket's last gradient arrives and every bucket before it has been launched, its
   all-reduce starts asynchronously while autograd keeps computing the rest of backward.
4. After the last bucket launches, `finish_backward` is queued on the autograd engine; at the end
   of backward it waits for each bucket (with a timeout) and writes the averages into `.grad`.

After the first synchronised iteration the buckets are rebuilt once, in the order gradients
actually became ready there (rank 0's order, broadcast, so every rank has the same layout).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import weakref
from collections import deque
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from . import accumulation
from .bucket import FUSED_COPY_MIN_NUMEL, Bucket
from .bucketing import compute_bucket_assignment_by_size, validate_bucket_indices
from .collectives import all_gather_objects, broadcast_tensors, wait_error
from .comm import CommHook, HookChain, check_hook, hook_name
from .config import ReducerConfig
from .errors import (
    GradSyncError,
    ReductionTimeoutError,
    format_names,
    marked_twice_message,
    missing_gradients_message,
    uneven_accumulation_message,
    unfinished_reduction_message,
)
from .guards import check_finite
from .log import detail_enabled, log
from .profiling import profiled as _profiled
from .simulate import Profile
from .stats import IterationStats, Stats
from .timeline import EventKind, IterationTimeline, now_ns
from .unused import find_tensors, reachable_parameters
from .watchdog import StallWatchdog

__all__ = ["Reducer"]


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
    ) -> None:
        self.params = list(params)
        self.expect_sparse_gradient = list(expect_sparse_gradient or [False] * len(self.params))
        self.names = list(param_names) if param_names is not None else _default_names(self.params)
        _check_params(self.params, self.names)
        self.process_group = process_group
        self.config = config or ReducerConfig()
        self.rank = process_group.rank()
        self.world_size = process_group.size()
        self._find_unused = self.config.find_unused_parameters
        self._comm_hook: tuple[object, CommHook] | None = None
        self._watchdog: StallWatchdog | None = None
        self._stall_report = ""
        self.report_unused = False
        self.check_finite = False  # opt-in: NaN/Inf check of each bucket before it is sent
        # On by default: ranks compare how many micro-steps each synchronisation covers, so
        # no_sync() entered on some ranks only is an error at once, not silently mixed steps.
        self.check_accumulation = self.world_size > 1
        self._micro_steps = 1
        self._ride = False  # reports ride in the last bucket's all-reduce this iteration
        self._report_templates: dict[tuple[int, bool], torch.Tensor] = {}
        # Parameters whose gradient never came when this iteration's backward ended.
        self._missing: list[int] = []
        self.last_unused_report: dict[str, list[int]] = {}
        self._chain: HookChain | None = None
        reduce_dtype = self.config.reduce_dtype
        self._scale_at_launch = reduce_dtype is not None and reduce_dtype != (
            self.config.bucket_dtype or self.params[0].dtype
        )
        self._install_buckets(validate_bucket_indices(bucket_indices, self.params, self.names))
        self._needs_rebuild = self.config.rebuild_bucket_size_limits is not None and (
            self.config.static_graph or not self._find_unused
        )
        self.history: deque[IterationTimeline] = deque(maxlen=self.config.history)
        self.buckets: list[Bucket]
        self._unused: list[int] = []
        self.iteration = 0
        self._expect_hooks = False
        # Filled by the hooks even outside synchronised steps (no_sync), and cleared only once a
        # reduction has used it, so a parameter used only in an earlier micro-step still counts
        # as used when the gradients are finally reduced.
        self._local_used = bytearray(len(self.params))
        self._divisor, self._inv_divisor = self.world_size, 1.0 / self.world_size
        self._forward_start_ns = 0
        # Static graph: hook firings per parameter, learned in the first iteration.
        self._static = self.config.static_graph
        self._hook_counts: list[int] = []
        self._static_used: list[int] | None = None
        self._static_unused: list[int] = []
        self._learning_counts = False
        self._fires: list[int] = []
        self._watching = False  # the outputs' backward nodes will queue the end of backward
        self._reset_iteration_state()
        # The hooks hold the reducer weakly: parameters outlive wrappers (a module can be
        # wrapped again), and a reducer kept alive by its own hooks would keep its process group
        # alive until the interpreter tears it down at exit.
        me = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(_dispatch_hook, me, i))
            for i, p in enumerate(self.params)
        ]
        weakref.finalize(self, _remove_handles, list(self._hook_handles))

    # ----------------------------------------------------------------------------- layout

    @property
    def bucket_indices(self) -> list[list[int]]:
        return [list(b.param_indices) for b in self.buckets]

    def _install_buckets(self, layout: list[list[int]]) -> None:
        self._check_sparse_buckets(layout)
        self.buckets = [
            Bucket(
                b,
                indices,
                self.params,
                sparse=self.expect_sparse_gradient[indices[0]],
                dtype=self.config.bucket_dtype,
                # The last bucket carries each rank's report (`accumulation`): its micro-step
                # count and whether gradients were missing.
                tail=self.world_size
                if b == len(layout) - 1 and self.world_size > 1 and not self.expect_sparse_gradient[indices[0]]
                else 0,
            )
            for b, indices in enumerate(layout)
        ]
        self._layout = [list(b.param_indices) for b in self.buckets]
        self._layout_bytes = [b.nbytes for b in self.buckets]
        self._bucket_of: list[Bucket] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for i in bucket.param_indices:
                self._bucket_of[i] = bucket
        if self.config.gradient_as_bucket_view:
            self._point_grads_at_buckets()

    def _check_sparse_buckets(self, layout: list[list[int]]) -> None:
        if len(self.expect_sparse_gradient) != len(self.params):
            raise ValueError(
                f"expect_sparse_gradient has {len(self.expect_sparse_gradient)} flags for "
                f"{len(self.params)} parameters"
            )
        for b, indices in enumerate(layout):
            if len(indices) > 1 and any(self.expect_sparse_gradient[i] for i in indices):
                raise ValueError(
                    f"bucket {b} puts a parameter with a sparse gradient "
                    f"({format_names([self.names[i] for i in indices])}) with others; a sparse "
                    "gradient is reduced on its own, so give it a bucket of its own"
                )

    def _point_grads_at_buckets(self) -> None:
        """Move existing gradients into the (new) buckets, so `.grad` stays a bucket view."""
        with torch.no_grad():
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is not None and not _aliases(p.grad, view):
                        view.copy_(p.grad)
                        p.grad = view

    def install_layout(self, layout: Sequence[Sequence[int]]) -> None:
        """Replace the bucket layout between iterations (every rank must install the same)."""
        if self._expect_hooks and self._require_finalize:
            raise RuntimeError("install_layout: an iteration is still being reduced")
        self._needs_rebuild = False
        self._install_buckets(validate_bucket_indices(layout, self.params, self.names))
        self._check_sparse_buckets(self.bucket_indices)

    def _rebuild_due(self) -> bool:
        # As torch: after the first synchronised iteration, or with a static graph the second
        # (the first only counts hooks, reducing everything at its end, in no real order).
        return self._needs_rebuild and len(self.history) >= (2 if self._static else 1)

    def _rebuild_buckets(self) -> None:
        """Re-bucket once, in rank 0's ready order of the last synchronised iteration, the
        parameters marked unused (which torch hears of only at the end) last."""
        self._needs_rebuild = False
        last = self.history[-1] if self.history else None
        local = [i for _, i in last.order(EventKind.READY)] + [i for _, i in last.order(EventKind.UNUSED)] if last else []
        order = self._broadcast_order(local)
        if sorted(order) != list(range(len(self.params))):
            return  # rank 0 did not see every gradient; every rank skips alike
        limits = list(self.config.rebuild_bucket_size_limits or ())
        layout, _ = compute_bucket_assignment_by_size(
            [self.params[i] for i in order], limits, self.expect_sparse_gradient, order
        )
        self._install_buckets(layout)

    def _broadcast_order(self, order: list[int]) -> list[int]:
        n = len(self.params)
        t = torch.full((n,), -1, dtype=torch.int64, device=self.buckets[0].buffer.device)
        if len(order) == n:
            t.copy_(torch.tensor(order, dtype=torch.int64))
        broadcast_tensors(
            self.process_group, [t], 0, self.config.timeout, "broadcast of rank 0's bucket order"
        )
        return t.tolist()

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
        no_sync); every rank must cover the same number (see `check_accumulation`).
        """
        self._check_prior_reduction_finished()
        if self._rebuild_due():
            self._rebuild_buckets()
        self.iteration += 1
        self._reset_iteration_state()
        self._expect_hooks = True
        if self._watchdog is not None:
            self._watchdog.mark_progress(self.iteration)
        self._divisor = divisor or self.world_size
        self._inv_divisor = 1.0 / self._divisor
        self._micro_steps = micro_steps
        tensors = find_tensors(outputs) if outputs is not None else []
        if self._find_unused:
            reached = reachable_parameters(tensors)
            self._unused = [i for i, p in enumerate(self.params) if id(p) not in reached]
            self._has_marked_unused = not self._unused
        if self.config.static_graph:
            self._prepare_static_iteration()
        self._timeline = IterationTimeline(
            iteration=self.iteration,
            start_ns=now_ns(),
            bucket_indices=self._layout,  # shared, not copied: a layout is never mutated
            bucket_bytes=self._layout_bytes,
        )
        self._timeline.forward_start_ns = self._forward_start_ns
        self._chain = self._new_chain()
        self._ride = self._reports_ride_along()
        self._watch_backward_start(tensors)

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
        self._reduced = False
        self._forward_start_ns = now_ns()

    def note_module_forward(self) -> None:
        """The wrapped module ran forward (through the wrapper or not): gradients from here on
        belong to a new graph, not late arrivals for the last reduced iteration."""
        self._reduced = False

    def _reset_iteration_state(self) -> None:
        self._marked = [False] * len(self.params)
        self._unused = []
        self._has_marked_unused = True
        self._reduced = False
        self._clear_reduction_state()

    def _clear_reduction_state(self) -> None:
        self._require_finalize = False
        self._finalize_queued = False
        self._end_queued = False
        self._missing = []
        self._next_bucket = 0
        self._used_work: dist.Work | None = None
        self._used_map: torch.Tensor | None = None
        self._accumulation: tuple[torch.Tensor, dist.Work | None] | None = None
        for bucket in self.buckets:
            bucket.reset()

    def _check_prior_reduction_finished(self) -> None:
        # Reached only where the end of backward could not be seen (forward returned no
        # tensor, or the loss did not come from its outputs): report the missing gradients now.
        if not self._require_finalize:
            return
        missing = [self.names[i] for i, done in enumerate(self._marked) if not done]
        iteration = self.iteration
        self._abandon_iteration()
        message = unfinished_reduction_message(missing, self.rank, self._find_unused, iteration)
        if self._watchdog is not None:  # what the other ranks reported, if they got here first
            others = self._watchdog.publish_missing(iteration, missing)
            for rank, names in sorted(others.items()):
                message += f"\nRank {rank} reported {len(names)} missing: {format_names(names)}"
        raise GradSyncError(message)

    def _abandon_iteration(self) -> None:
        """Drop a broken iteration so the reducer can be used again after the error."""
        self._expect_hooks = False
        self._reset_iteration_state()

    # ----------------------------------------------------------------------- static graph
    #
    # With static_graph the first iteration only watches: it counts how often each parameter's
    # hook fires (reentrant checkpointing fires a shared parameter's hook more than once) and
    # reduces everything at the very end of backward. Later iterations mark a parameter ready on
    # its last firing, and the parameters that never fired are marked ready up front.

    def _prepare_static_iteration(self) -> None:
        self._fires = [0] * len(self.params)
        self._learning_counts = not self._hook_counts
        if not self._learning_counts:
            self._unused = list(self._static_unused)
            self._has_marked_unused = not self._unused

    def _on_first_static_fire(self, index: int, param: torch.Tensor) -> None:
        self._require_finalize = True
        if param.grad is not None:  # fired without a gradient: unused here, as torch counts it
            self._local_used[index] = 1
        if self._fires[index] == 1:
            self._timeline.events.append((now_ns(), EventKind.READY, index))
        if not self._watching and not self._end_queued:  # no outputs seen: best effort
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _finish_first_static(self) -> None:
        """End of the first static-graph backward: learn the counts, then reduce everything."""
        fired = self._timeline.ready_order()
        self._hook_counts = list(self._fires)
        self._static_unused = [i for i, n in enumerate(self._fires) if n == 0]
        self._learning_counts = False
        self._timeline.events.clear()
        for index in fired:
            self._mark(index, EventKind.READY)
        for index in self._static_unused:
            self._mark(index, EventKind.UNUSED)
        if self._chain is None:
            self._start_used_map_reduction()
        self.finish_backward()

    # ----------------------------------------------------------------------- hot path

    def _autograd_hook(self, index: int, param: torch.Tensor) -> None:
        # Runs once per parameter per backward: plain bookkeeping only. Gradients are copied
        # into the bucket in one batch when its last one arrives (`_fill`).
        if self._find_unused and param.grad is not None:
            # Without a gradient (behind an output left out of the loss) it is unused here.
            self._local_used[index] = 1
        if not self._expect_hooks:
            if self._reduced and self._marked[index]:
                raise GradSyncError(marked_twice_message(self.names[index], index, self.rank, "late"))
            return
        if self._static:  # ready only after its last firing
            self._fires[index] += 1
            if self._learning_counts:
                self._on_first_static_fire(index, param)
                return
            if self._fires[index] < self._hook_counts[index]:
                return
        if self._marked[index]:
            cause = "unused" if index in self._unused else "repeat"
            raise GradSyncError(marked_twice_message(self.names[index], index, self.rank, cause))
        self._require_finalize = True
        if not self._has_marked_unused:
            self._mark_unused()
        self._mark(index, EventKind.READY)
        if self._next_bucket == len(self.buckets) and not self._finalize_queued:
            self._all_launched()

    def _mark_unused(self) -> None:
        # Deferred from prepare_for_backward to the first hook, as torch does: a forward that is
        # never followed by backward then leaves no half-done iteration behind.
        self._has_marked_unused = True
        for unused in self._unused:
            self._mark(unused, EventKind.UNUSED)

    def _mark(self, index: int, kind: int) -> None:
        self._marked[index] = True
        self._timeline.events.append((now_ns(), kind, index))
        bucket = self._bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._timeline.events.append((now_ns(), EventKind.BUCKET_READY, bucket.index))
            self._fill(bucket)
            if bucket.index == self._next_bucket:
                self._start_ready_buckets()

    def _all_launched(self) -> None:
        """Every bucket is on its way: reduce the used map; finish at the end of backward."""
        self._finalize_queued = True
        if self._find_unused and self._chain is None:
            self._start_used_map_reduction()
        if not self._end_queued:  # backward did not come through the outputs: finish as torch
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Queued once per iteration on the autograd engine; runs when backward has ended."""
        self._end_queued = False
        if not self._expect_hooks:
            return  # finished already
        if not self._require_finalize:
            return  # no gradient of ours came (torch.autograd.grad): wait for the real backward
        if self._learning_counts:
            self._finish_first_static()
            return
        if self._next_bucket < len(self.buckets):
            self._complete_missing()
        self.finish_backward()

    def _complete_missing(self) -> None:
        """Backward ended with buckets not full: some gradients never came. Launch those buckets
        anyway (zeros where a gradient is missing), so every rank's collectives still match
        and no rank waits for them, and flag it in this rank's report: the end of backward then
        raises on every rank, naming the parameters (`_raise_missing`)."""
        if not self._has_marked_unused:
            self._mark_unused()
        self._missing = [i for i, done in enumerate(self._marked) if not done]
        for index in self._missing:
            self._mark(index, EventKind.UNUSED)
        if not self._finalize_queued:
            self._finalize_queued = True
            if self._find_unused and self._chain is None:
                self._start_used_map_reduction()

    def _fill(self, bucket: Bucket) -> None:
        """Copy the bucket's gradients in, scaled by 1/world (zeros where there is none)."""
        if bucket.sparse:
            self._fill_sparse(bucket)
            return
        grads = [p.grad for p in bucket.params]
        if self.check_finite:
            check_finite(grads, [self.names[i] for i in bucket.param_indices], self.rank, self.iteration)
        as_view = self.config.gradient_as_bucket_view
        aliased = [as_view and g is not None and _aliases(g, v) for g, v in zip(grads, bucket.views)]
        plain = not any(aliased) and not any(g is not None and g.requires_grad for g in grads)
        scale = self._scale_in_fill
        if plain:
            self._copy_grads_in(bucket, grads)
        elif all(aliased):
            if scale:
                bucket.buffer.div_(self._divisor)
        else:
            for g, v, alias in zip(grads, bucket.views, aliased):
                _scale_into(g, v, alias, self._divisor if scale else 0, self._inv_divisor)
        if as_view:
            for p, g, v, alias in zip(bucket.params, grads, bucket.views, aliased):
                if g is not None and not alias:
                    p.grad = v

    def _fill_sparse(self, bucket: Bucket) -> None:
        param = bucket.params[0]
        grad = param.grad
        if grad is None or not grad.is_sparse:
            kind = "no gradient" if grad is None else "a dense gradient"
            raise GradSyncError(
                f"gradsync: parameter {self.names[bucket.param_indices[0]]!r} was declared to "
                f"get a sparse gradient but has {kind} in iteration {self.iteration} on rank "
                f"{self.rank}. Build its module with sparse=True on every rank and use it in "
                "every iteration, or declare it dense."
            )
        bucket.sparse_grad = grad.coalesce() * self._inv_divisor

    @property
    def _scale_in_fill(self) -> bool:
        # A communication hook averages itself (torch's protocol); mixed precision scales in
        # the reduce dtype at launch (`_payload`).
        return self._comm_hook is None and not self._scale_at_launch

    def _copy_grads_in(self, bucket: Bucket, grads: list[torch.Tensor | None]) -> None:
        if not self._scale_in_fill:
            bucket.buffer.zero_()
            present = [(v, g) for v, g in zip(bucket.views, grads) if g is not None]
            if present:
                torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
            return
        self._copy_scaled_now(bucket, grads)

    def _payload(self, bucket: Bucket) -> torch.Tensor:
        if bucket.sparse_grad is not None:
            return bucket.sparse_grad
        if self._scale_at_launch:
            return bucket.buffer.to(self.config.reduce_dtype).mul_(self._inv_divisor)
        return bucket.buffer

    def _copy_scaled_now(self, bucket: Bucket, grads: list[torch.Tensor | None]) -> None:
        """views = grads / divisor, in as few passes over memory and kernel calls as we can.

        Large gradients are scaled while copied (one pass each); small ones are copied with one
        batched call and scaled with another, which beats a call per tensor. Same arithmetic
        either way: a float multiply by 1/divisor.
        """
        inv = self._inv_divisor
        if bucket.all_small and all(g is not None for g in grads):  # the common case
            torch._foreach_copy_(bucket.views, grads)  # type: ignore[arg-type]
            bucket.buffer.mul_(inv)
            return
        small_views, small_grads = [], []
        for view, grad in zip(bucket.views, grads):
            if grad is None:
                view.zero_()
            elif grad.numel() >= FUSED_COPY_MIN_NUMEL:
                torch.mul(grad, inv, out=view)
            else:
                small_views.append(view)
                small_grads.append(grad)
        if small_views:
            torch._foreach_copy_(small_views, small_grads)
            torch._foreach_mul_(small_views, inv)

    def _start_ready_buckets(self) -> None:
        """Launch, strictly in order, every bucket that is full and not yet launched."""
        buckets, events = self.buckets, self._timeline.events
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            bucket = buckets[self._next_bucket]
            bucket.payload = self._payload(bucket)
            self._next_bucket += 1
            if self._chain is not None:
                continue  # the chain launches it, after its predecessor's Future completes
            events.append((now_ns(), EventKind.LAUNCH, bucket.index))
            wire = bucket.payload
            if self._ride and bucket.tail is not None:
                wire = self._attach_report(bucket)
            with _profiled(f"gradsync.allreduce.bucket{bucket.index}"):
                bucket.work = self.process_group.allreduce([wire])
            bucket.work.get_future().add_done_callback(
                functools.partial(_record_completion, events, bucket.index)
            )
        if self._chain is not None:
            self._chain.release(self._next_bucket)

    def _new_chain(self) -> HookChain | None:
        if self._comm_hook is None:
            return None
        state, hook = self._comm_hook
        iteration = self.iteration
        return HookChain(
            state, hook, self.buckets, self.process_group, self._timeline.events,
            lambda b: f"bucket {b} (rank {self.rank}, iteration {iteration})",
        )

    # ------------------------------------------------------------------ end of backward

    def finish_backward(self) -> None:
        """Wait for every bucket and write the averaged gradients into `.grad`."""
        timeline = self._timeline
        timeline.backward_end_ns = now_ns()
        assert self._next_bucket == len(self.buckets), "finish_backward before every launch"
        try:
            with torch.no_grad(), _profiled("gradsync.finish_backward"):
                self._wait_buckets()
                if not self._ride:  # after every bucket and the used map, on every rank
                    self._start_report_reduction()
                used = self._finish_used_map_reduction()
                self._finish_report_check()  # raises before any gradient is written back
                if self._static:  # the first iteration's global used map holds for good
                    used = self._static_used = used if used is not None else self._static_used
                for bucket in self.buckets:
                    self._copy_grads_out(bucket, used)
        finally:
            self._expect_hooks = False
            timeline.finish_ns = now_ns()
            self.history.append(timeline)
            if detail_enabled():
                log.debug("rank %d: %s", self.rank, IterationStats.from_timeline(timeline))
            self._clear_reduction_state()
            self._local_used = bytearray(len(self.params))
            # Keep `_marked`: a gradient that still arrives for one of them before the next
            # forward (a second reentrant backward, a second backward()) is reported.
            self._reduced = True

    def _copy_grads_out(self, bucket: Bucket, used: list[int] | None) -> None:
        if bucket.sparse:
            reduced = bucket.sparse_grad if bucket.work is None else bucket.work.result()[0]
            bucket.params[0].grad = reduced
            return
        if bucket.payload is not bucket.buffer:
            self._copy_payload_out(bucket, used)
            return
        as_view = self.config.gradient_as_bucket_view
        targets, sources = [], []
        for i, param, view in zip(bucket.param_indices, bucket.params, bucket.views):
            if used is not None and not used[i]:
                continue  # unused on every rank: leave .grad exactly as torch would
            grad = param.grad
            if as_view:
                if grad is None or not _aliases(grad, view):
                    param.grad = view
            elif grad is None:
                param.grad = view.to(param.dtype, copy=True)
            else:
                targets.append(grad)
                sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)

    def _wait_buckets(self) -> None:
        chain = self._chain
        self._stall_report = ""
        if self._watchdog is not None:
            self._watch_for_stall()
        for bucket in self.buckets:
            if chain is None:
                self._wait_work(bucket.work, f"all-reduce of bucket {bucket.index}", bucket)
            else:
                self._accept_hook_value(bucket, chain.result(bucket, self.config.timeout))
        if chain is not None and (self._find_unused or (self._static and self._static_used is None)):
            # Only now: a collective started earlier could interleave with the chain's.
            self._start_used_map_reduction()

    def _watch_for_stall(self) -> None:
        """Wait up to the watchdog's warn_after for every bucket; past it, log who is missing."""
        assert self._watchdog is not None
        deadline = now_ns() + int(self._watchdog.warn_after.total_seconds() * 1e9)
        for bucket in self.buckets:
            left = timedelta(seconds=max(deadline - now_ns(), 0) / 1e9)
            if not _done_within(bucket, left):
                self._stall_report = self._pending_report()
                log.warning(self._stall_report)
                return

    def _accept_hook_value(self, bucket: Bucket, value: torch.Tensor) -> None:
        if bucket.sparse:
            bucket.sparse_grad = value
        elif value.dtype == bucket.buffer.dtype:
            if value.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(value)
            bucket.payload = bucket.buffer
        else:
            bucket.payload = value

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with `hook(state, bucket)` instead of averaging all-reduce."""
        if self._comm_hook is not None:
            raise RuntimeError(
                f"register_comm_hook can be called only once; {hook_name(self._comm_hook[1])} "
                f"is already registered (tried to add {hook_name(hook)})"
            )
        if self.iteration > 0:
            raise RuntimeError(
                f"register_comm_hook must be called before the first forward/backward; "
                f"{self.iteration} iteration(s) have already run with the default all-reduce"
            )
        if self._scale_at_launch:
            raise NotImplementedError(
                "gradsync: communication hooks with mixed precision are not supported yet"
            )
        check_hook(hook)
        self._comm_hook = (state, hook)

    def _copy_payload_out(self, bucket: Bucket, used: list[int] | None) -> None:
        """Write back from a payload of another dtype (mixed precision): cast per gradient."""
        for i, param, offset, length in zip(
            bucket.param_indices, bucket.params, bucket.offsets, bucket.lengths
        ):
            if used is not None and not used[i]:
                continue
            value = bucket.payload.narrow(0, offset, length).view(param.shape)
            if param.grad is None or param.grad.dtype != param.dtype:
                param.grad = value.to(param.dtype, copy=True)
            else:
                param.grad.copy_(value)

    def _start_used_map_reduction(self) -> None:
        device = self.buckets[0].buffer.device
        self._used_map = torch.frombuffer(bytearray(self._local_used), dtype=torch.uint8).to(
            device=device, dtype=torch.int32
        )
        if self.report_unused:  # every rank's map, to say who left what unused
            self._used_maps = [torch.zeros_like(self._used_map) for _ in range(self.world_size)]
            self._used_work = self.process_group.allgather([self._used_maps], [self._used_map])
        else:
            self._used_work = self.process_group.allreduce([self._used_map])

    def _finish_used_map_reduction(self) -> list[int] | None:
        if self._used_work is None or self._used_map is None:
            return None
        self._wait_work(self._used_work, "reduction of the used-parameter map")
        if not self.report_unused:
            return self._used_map.tolist()
        per_rank = [m.tolist() for m in self._used_maps]
        self.last_unused_report = {
            name: [r for r in range(self.world_size) if not per_rank[r][i]]
            for i, name in enumerate(self.names)
            if not all(per_rank[r][i] for r in range(self.world_size))
        }
        return [sum(m[i] for m in per_rank) for i in range(len(self.names))]

    # At the end of every synchronisation each rank reports its micro-step count and whether
    # its backward ended with gradients missing (`accumulation`). Without a hook the reports
    # ride after the last bucket's gradients in its own all-reduce (free); otherwise they go in
    # a tiny all-reduce of their own, after every bucket.

    def _reports_ride_along(self) -> bool:
        return (
            self._comm_hook is None
            and not self._scale_at_launch
            and self.buckets[-1].tail is not None
        )

    def _attach_report(self, bucket: Bucket) -> torch.Tensor:
        """Write this rank's report into the bucket's tail; return what to all-reduce."""
        assert bucket.tail is not None
        key = (self._micro_steps, bool(self._missing))
        template = self._report_templates.get(key)
        if template is None or template.dtype != bucket.tail.dtype or template.device != bucket.tail.device:
            if len(self._report_templates) > 64:  # counts that keep changing: stay bounded
                self._report_templates.clear()
            template = accumulation.encode(torch.empty_like(bucket.tail), self.rank, *key)
            self._report_templates[key] = template
        bucket.tail.copy_(template)
        self._accumulation = (bucket.tail, None)  # waited for with the bucket itself
        return bucket.wire

    def _start_report_reduction(self) -> None:
        """All-reduce the reports on their own."""
        if self.world_size == 1:
            return
        reports = torch.empty(self.world_size, dtype=torch.int64, device=self.buckets[0].buffer.device)
        accumulation.encode(reports, self.rank, self._micro_steps, bool(self._missing))
        self._accumulation = (reports, self.process_group.allreduce([reports]))

    def _finish_report_check(self) -> None:
        if self._accumulation is None:  # world size 1: nobody else to tell
            if self._missing:
                self._raise_missing([accumulation.RankReport(self._micro_steps, True)])
            return
        values, work = self._accumulation
        self._accumulation = None
        if work is not None:
            self._wait_work(work, "all-reduce of the ranks' reports (micro-step counts)")
        self._check_reports(accumulation.decode(values.tolist(), values.dtype))

    def _check_reports(self, reports: list[accumulation.RankReport]) -> None:
        if any(r.micro_steps is None for r in reports):  # a count too large to ride: ask
            exact = torch.zeros(self.world_size, dtype=torch.int64, device=self.buckets[0].buffer.device)
            exact[self.rank] = self._micro_steps
            self._wait_work(self.process_group.allreduce([exact]), "all-reduce of exact micro-step counts")
            reports = accumulation.exact_counts(reports, exact.tolist())
        if any(r.missing for r in reports):
            self._raise_missing(reports)
        if not self.check_accumulation:
            return
        active = {r.micro_steps for r in reports if r.micro_steps}  # 0: a joined rank
        if len(active) > 1:
            per_rank = [r.micro_steps or 0 for r in reports]
            raise GradSyncError(uneven_accumulation_message(per_rank, self.iteration))

    def _raise_missing(self, reports: list[accumulation.RankReport]) -> None:
        """Some rank's backward ended with gradients missing: every rank sees the flag in the
        same reports, so every rank gathers the names (a collective) and raises alike."""
        mine = [(self._bucket_of[i].index, self.names[i]) for i in self._missing]
        everyone = [mine] if self.world_size == 1 else all_gather_objects(
            self.process_group, mine, self.config.timeout
        )
        per_rank = {r: names for r, names in enumerate(everyone) if names}  # type: ignore[misc]
        raise GradSyncError(
            missing_gradients_message(
                per_rank, self.iteration, self._find_unused, self._static, self.rank  # type: ignore[arg-type]
            )
        )

    def _wait_work(self, work: dist.Work | None, what: str, bucket: Bucket | None = None) -> None:
        assert work is not None, f"{what} was never started"
        try:
            work.wait(self.config.timeout)
        except RuntimeError as error:  # the message is built only now, off the normal path
            raise self._wait_failure(error, what, bucket) from error

    def _wait_failure(
        self, error: RuntimeError, what: str, bucket: Bucket | None
    ) -> ReductionTimeoutError:
        if bucket is not None:
            what += f" holding {format_names([self.names[i] for i in bucket.param_indices], 5)}"
        if self._stall_report:
            what += f"\n{self._stall_report}\n"
        failure = wait_error(
            error, f"iteration {self.iteration}: {what}", self.process_group, self.config.timeout
        )
        if self._watchdog is None or self._stall_report or bucket is None:
            return failure
        # Failed before the watchdog's warning (a peer crashed): report now. Buckets are
        # taken in order, so this one and every later one are still outstanding.
        report = self._pending_report(self.buckets[bucket.index :])
        return ReductionTimeoutError(f"{failure}\n{report}")

    def _pending_report(self, outstanding: list[Bucket] | None = None) -> str:
        assert self._watchdog is not None
        if outstanding is None:
            outstanding = [b for b in self.buckets if not _done_within(b, timedelta(0))]
        pending = [(b.index, [self.names[i] for i in b.param_indices]) for b in outstanding]
        waited = timedelta(seconds=(now_ns() - self._timeline.backward_end_ns) / 1e9)
        return self._watchdog.report(self.iteration, waited, pending)

    # ------------------------------------------------------------------- joined ranks

    def shadow_iteration(self) -> None:
        """On a rank that has run out of data, match the collectives of one synchronised
        iteration of the ranks still training: contribute zeros to every bucket, in order."""
        if self._rebuild_due():
            self._rebuild_buckets()
        self._missing = []
        self._micro_steps = 0  # a joined rank has no say in the comparison
        ride = self._reports_ride_along()
        if self._comm_hook is not None:
            self._shadow_hooks()
        else:
            zeros = [torch.zeros_like(b.wire if ride else b.buffer) for b in self.buckets]
            for i, tensor in enumerate(zeros):
                work = self.process_group.allreduce([tensor])
                self._wait_work(work, f"shadow all-reduce {i} of a joined rank")
            if ride:
                self._accumulation = (zeros[-1].narrow(0, self.buckets[-1].buffer.numel(), self.buckets[-1].tail.numel()), None)  # type: ignore[union-attr]
            self._shadow_used_map()
        if not ride:
            self._start_report_reduction()
        self._finish_report_check()

    def _shadow_used_map(self) -> None:
        if self._find_unused:
            used = torch.zeros(len(self.params), dtype=torch.int32, device=self.buckets[0].buffer.device)
            self._wait_work(self.process_group.allreduce([used]), "joined rank's used map")

    def _shadow_hooks(self) -> None:
        """Run the hook on zero buckets: it issues the same collectives as the active ranks'."""
        zero = [
            Bucket(b.index, b.param_indices, self.params, dtype=self.config.bucket_dtype)
            for b in self.buckets
        ]
        state, hook = self._comm_hook  # type: ignore[misc]
        chain = HookChain(
            state, hook, zero, self.process_group, [], lambda b: f"joined rank's bucket {b}"
        )
        chain.release(len(zero))
        for bucket in zero:
            chain.result(bucket, self.config.timeout)
        self._shadow_used_map()

    # --------------------------------------------------------------------------- misc

    def stats(self) -> Stats:
        """The last iteration's timings and aggregates over the retained window."""
        return Stats.from_timelines(self.iteration, list(self.history))

    def timing_profile(self, window: int = 8) -> Profile:
        """Median timings of the last `window` iterations, gradients in ready order: the input
        of `gradsync simulate`."""
        timelines = [t for t in list(self.history)[-window:] if t.finish_ns]
        if not timelines:
            raise RuntimeError("timing_profile: no finished iteration recorded yet")
        ready: list[list[float]] = [[] for _ in self.params]
        for tl in timelines:
            for t, kind, i in tl.events:
                if kind in (EventKind.READY, EventKind.UNUSED):
                    ready[i].append((t - tl.start_ns) * 1e-6)
        median = [statistics.median(v) if v else 0.0 for v in ready]
        order = sorted(range(len(self.params)), key=lambda i: (median[i], i))
        forward = [(t.start_ns - t.forward_start_ns) * 1e-6 for t in timelines if t.forward_start_ns]
        return Profile(
            forward_ms=statistics.median(forward) if forward else 0.0,
            ready_ms=tuple(median[i] for i in order),
            nbytes=tuple(self.params[i].numel() * self.params[i].element_size() for i in order),
            names=tuple(self.names[i] for i in order),
            world_size=self.world_size,
        )

    def enable_watchdog(
        self, warn_after: timedelta, store: dist.Store | None, timeout: timedelta | None = None
    ) -> None:
        """Log a stall report when the end of backward waits longer than `warn_after`, and
        raise (with the report) after `timeout` (default: the current one). `store` (the
        group's store) lets the report say which ranks have not reached the iteration."""
        self._watchdog = StallWatchdog(warn_after, store, self.rank, self.world_size)
        if timeout is not None:
            self.config = dataclasses.replace(self.config, timeout=timeout)

    def locate(self, index: int) -> tuple[int, int]:
        """(bucket index, position in that bucket) of parameter `index`."""
        bucket = self._bucket_of[index]
        return bucket.index, bucket.param_indices.index(index)

    @property
    def last_timeline(self) -> IterationTimeline | None:
        return self.history[-1] if self.history else None

    def remove_hooks(self) -> None:
        """Detach from autograd; the reducer does nothing more after this."""
        _remove_handles(self._hook_handles)
        self._hook_handles = []


def _on_backward_start(reducer: weakref.ref[Reducer], iteration: int, _grads: object) -> None:
    """Prehook of forward's output nodes: queue the end of this iteration's backward."""
    live = reducer()
    if live is not None and live.iteration == iteration and live._expect_hooks and not live._end_queued:
        live._end_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(live._end_of_backward)


def _dispatch_hook(reducer: weakref.ref[Reducer], index: int, param: torch.Tensor) -> None:
    live = reducer()
    if live is not None:
        live._autograd_hook(index, param)


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _scale_into(
    grad: torch.Tensor | None, view: torch.Tensor, aliased: bool, world: int, inv_world: float
) -> None:
    """view = grad / world, where world 0 means: copy without scaling."""
    if grad is None:
        view.zero_()
    elif aliased:
        if world:
            view.div_(world)
    elif grad.requires_grad:  # backward(create_graph=True): leave `grad` itself intact
        view.copy_(grad.detach() * inv_world if world else grad.detach())
    elif world:
        torch.mul(grad, inv_world, out=view)
    else:
        view.copy_(grad)


def _done_within(bucket: Bucket, wait_for: timedelta) -> bool:
    """Has `bucket`'s reduction completed, waiting at most `wait_for`? Never raises."""
    if bucket.future_done is not None:
        return bucket.future_done.wait(wait_for.total_seconds())
    if bucket.work is None:
        return False
    try:
        # At least 1 ms: a zero timeout means "no timeout" to the process group.
        return bool(bucket.work.wait(max(wait_for, timedelta(milliseconds=1))))
    except RuntimeError:  # timed out, or failed: the real wait reports a failure
        return "timed out" not in str(sys.exc_info()[1]).lower()


def _record_completion(events: list, bucket_index: int, _future: object) -> None:
    events.append((now_ns(), EventKind.COMPLETE, bucket_index))


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


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
