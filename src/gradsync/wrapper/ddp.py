"""`gradsync.DistributedDataParallel`: torch's wrapper, same constructor and loop, on our Reducer.

Swap `torch.nn.parallel.DistributedDataParallel` for this class and nothing else changes:

    # train.py: model = gradsync.DistributedDataParallel(model)
    torchrun --nproc-per-node 2 train.py

Construction checks that every rank holds the same parameters (before any bucket collective
could hang on a mismatch), broadcasts rank 0's parameters and buffers, and builds the Reducer
with torch's layout policy: one bucket for the first iteration, rebuilt in gradient-ready order.
The steps live beside this class: the arguments in `arguments`, the collectives and the Reducer
in `construction`, the guards on the wrapped module in `module_guards` (those of every forward,
`Placement` and `ForwardWatcher`, here), checkpoints in
`checkpoint`, uneven inputs in `join`, what frameworks call on torch's class in `torch_compat`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.decorators import skip as dynamo_skip
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..engine.collectives import DEFAULT_TIMEOUT, wait
from ..engine.comm import CommHook
from ..engine.errors import GradSyncError
from ..engine.reducer import Reducer
from ..engine.unused import route_through_sink
from ..observability.log import log
from ..observability.stats import Stats
from ..observability.trace import chrome_trace, write_chrome_trace
from ..observability.watchdog import StallWatchdog
from ..planning.autoplan import AutoBuckets, BucketPlan
from ..planning.simulate import timing_profile
from .arguments import (
    bucket_limits,
    buffer_policy,
    check_keywords,
    default_group,
    exclude_from_sync,
    frozen_parameters,
    mixed_precision_params,
    module_buffers,
    refuse_sharding,
    resolve_devices,
    resolve_group,
    trainable_parameters,
    warn_deprecated,
)
from .checkpoint import restore_hook_state, restore_layout, saved_state
from .construction import (
    broadcast_state,
    build_reducer,
    check_same_parameters,
    definition_order_layout,
    reducer_config,
)
from .delayed import DelayedAllReduce
from .guards import check_parameters_in_sync
from .join import DDPJoinHook, all_reduce_flag, check_joinable, sync_buffers_from_active_rank
from .module_guards import LocalRef, UnsynchronisedGradients, check_outputs_hold_tensors
from .overlap import (
    DEFAULT_OVERLAP_BUCKET_MB,
    MeasuredTail,
    OverlappedOptimizer,
    agree_on_parameters,
    agree_on_tail,
    held_by,
    refuse_another,
    tail_bytes,
)
from .torch_compat import (
    TorchDDP,
    TorchNamedReducer,
    logging_data,
    refuse_torch_internals,
)

__all__ = ["DistributedDataParallel", "exclude_from_sync"]

if TYPE_CHECKING:  # typed as what it implements itself, not as torch's class with its C++ reducer

    class _Base(nn.Module, Joinable):
        pass

else:
    _Base = TorchDDP

# Built again on unpickling: a process group cannot be pickled, the rest is made from it.
_REBUILT_ON_UNPICKLING = ("process_group", "reducer", "_delayed", "_placement")


@refuse_torch_internals
class DistributedDataParallel(_Base):
    """Data-parallel training of `module`: gradients are averaged across `process_group`.

    A subclass of torch's class, so that frameworks' `isinstance` checks hold, whose
    constructor is never run: no C++ reducer, no hooks of torch's (`torch_compat`).
    """

    _limits: tuple[list[int], bool]  # the buckets' byte caps (`bucket_limits`)

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        check_keywords(**{k: v for k, v in locals().items() if k != "self"})  # before anything runs
        nn.Module.__init__(self)  # not torch's DistributedDataParallel.__init__: no C++ reducer
        Joinable.__init__(self)
        self.module = module
        self.process_group = resolve_group(process_group, device_mesh)
        self.device_ids, self.output_device = resolve_devices(module, device_ids, output_device)
        # The flags as truth values, as torch reads them (1 and None are accepted there).
        self.dim = dim
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        # torch skips sending parameters unused on every rank (its users promise the unused set
        # never changes); gradsync still sends their zeros. The results are the same.
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self.batched_grad_copy = bool(batched_grad_copy)  # how copies are issued: accepted
        warn_deprecated(broadcast_buffers, forward_sync_buffers, check_reduction)
        self.forward_sync_buffers, init_buffers = buffer_policy(broadcast_buffers,
                                                                forward_sync_buffers)
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._divergence_every = 0  # see enable_divergence_check
        self._forward_counts = _Forwards()
        self._choose_parameters(bucket_cap_mb, bucket_cap_mb_list, delay_all_reduce_named_params,
                                param_to_hook_all_reduce, mixed_precision)
        if init_sync:  # every rank holds the same parameters; rank 0's state everywhere
            check_same_parameters(self.process_group, self._named_params)
            broadcast_state(self.module, self.process_group,
                            self._buffers_to_sync if init_buffers else None)
            if self._delayed is not None:
                self._delayed.broadcast_from_rank0()
        self._connect()
        self.register_state_dict_pre_hook(_land_before_saving)
        self.register_load_state_dict_pre_hook(_land_before_loading)
        log.info(
            "rank %d/%d: wrapped %d parameters in %d buckets (find_unused=%s, static_graph=%s)",
            self.process_group.rank(), self.process_group.size(), len(self._named_params),
            len(self.reducer.buckets) if self.reducer else 0, self.find_unused_parameters,
            self.static_graph,
        )

    # ------------------------------------------------ seeing inside, and the checks

    def _reducer_for(self, what: str) -> Reducer:
        """The Reducer, for `what`; an error where there is none (every parameter went to the
        delayed all-reduce: no buckets to hook, time, watch or check)."""
        if self.reducer is None:
            raise RuntimeError(
                f"{what}: every parameter of this wrapper uses the delayed all-reduce "
                "(delay_all_reduce_named_params), so there are no buckets")
        return self.reducer

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future[Tensor]` (torch's protocol).

        The hook sees the bucket's summed, unaveraged gradients and must return a Future of the
        averaged (or otherwise reduced) tensor of the same shape and dtype. Call once, before
        the first forward. torch's own hooks (`torch.distributed.algorithms.ddp_comm_hooks`)
        and `gradsync.comm_hooks` work as they are.
        """
        self._reducer_for("register_comm_hook").register_comm_hook(state, hook)

    def stats(self) -> Stats:
        """Timings of the last synchronised iteration and medians over recent ones: when each
        bucket was ready, launched and complete, backward and communication time, the exposed
        (not overlapped) communication, bytes reduced. `print(ddp.stats())` for a table."""
        reducer = self._reducer_for("stats")
        return Stats.from_timelines(reducer.iteration, list(reducer.history))

    def export_timeline(self, path: str, rank_in_name: bool = True) -> str:
        """Write this rank's recent iterations as a Perfetto / Chrome trace JSON; return the
        path (with `.rank{N}` inserted before `.json` unless `rank_in_name` is False)."""
        reducer = self._reducer_for("export_timeline")
        rank = self.process_group.rank()
        if rank_in_name and path.endswith(".json"):
            path = f"{path[:-5]}.rank{rank}.json"
        trace = chrome_trace(reducer.history, rank, reducer.names)
        return str(write_chrome_trace(path, trace))

    def enable_stall_watchdog(
        self,
        warn_after: float = 60.0,
        timeout: float | None = None,
        store: dist.Store | None = None,
    ) -> None:
        """When the end of backward waits more than `warn_after` seconds, log which buckets
        are pending and which ranks have not reached the iteration; raise with that report
        after `timeout` seconds. `store` defaults to torch's default store when this wrapper
        uses the default group. Costs one store write per iteration."""
        reducer = self._reducer_for("enable_stall_watchdog")
        if store is None and self.process_group is dist.group.WORLD:
            store = dist.distributed_c10d._get_default_store()
        group = self.process_group
        monitor = StallWatchdog(timedelta(seconds=warn_after), store, group.rank(), group.size())
        reducer.set_stall_monitor(
            monitor, timedelta(seconds=timeout) if timeout is not None else None)

    def save_timing_profile(self, path: str) -> str:
        """Write this rank's measured timings (medians of recent iterations) as JSON, for
        `gradsync simulate --profile`."""
        reducer = self._reducer_for("save_timing_profile")
        return str(timing_profile(reducer).save(path))

    def enable_nan_check(self, enable: bool = True) -> None:
        """Check every gradient for NaN and Inf before it is communicated; the error names
        the parameter and the rank."""
        self._reducer_for("enable_nan_check").configure(check_finite=enable)

    def set_accumulation_check(self, enabled: bool) -> None:
        """On by default: every synchronisation compares, across ranks, how many forward
        passes it covers, and raises if they differ (no_sync() entered on some ranks only).
        Turn it off (on every rank) if ranks accumulating different numbers of micro-batches
        is intended. The counts ride in the last bucket's all-reduce; with a communication hook
        or mixed precision they take one tiny all-reduce of their own at the end of backward.
        They travel either way: beside the count, each rank says whether its backward ended
        with gradients missing, so that every rank raises then."""
        self._reducer_for("set_accumulation_check").configure(check_accumulation=enabled)

    def report_unused_parameters(self, enable: bool = True) -> None:
        """With find_unused_parameters, record each iteration which parameters each rank left
        unused (an all-gather instead of an all-reduce of the used map); read it from
        `unused_parameters()`."""
        if not self.find_unused_parameters or self.reducer is None:
            raise RuntimeError("report_unused_parameters needs find_unused_parameters=True")
        self.reducer.configure(report_unused=enable)

    def unused_parameters(self) -> dict[str, list[int]]:
        """{parameter name: ranks that did not use it} for the last synchronised iteration."""
        return dict(self.reducer.last_unused_report) if self.reducer is not None else {}

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, tail_mb: float | None = None,
                          chunk_mb: float | None = None,
                          credit_mb: float | None = None) -> OverlappedOptimizer:
        """Step `optimizer` per bucket as each bucket's averages land, and let the next forward
        start on what has landed; use what this returns in its place, in the same loop
        (`loss.backward(); opt.step(); opt.zero_grad()`). `step()` returns at once.
        With `bucket_cap_mb` left out, buckets are capped at `overlap.DEFAULT_OVERLAP_BUCKET_MB`
        (4 MiB, not torch's 25): each is stepped as it lands, and smaller ones start reducing
        earlier in backward (with "auto" not yet planned, the candidates are tried against
        these). Buckets landed by `step()` are stepped there, the rest in the next forward
        where one of its parameters is first used. The last `tail_mb` MiB of gradients in ready
        order (nearest the input: needed first) go nearest-first, in chunks of `chunk_mb` MiB,
        at most `credit_mb` MiB reducing at once (0: all). None: `overlap.DEFAULT_TAIL_MB`,
        `DEFAULT_CHUNK_MB`, `DEFAULT_CREDIT_MB`; the tail then measured (what the link could
        not carry before backward ended), tried and kept if faster (`measured_tail`), or, with
        `bucket_cap_mb="auto"`, tried by the planner's trial. Read parameters before the next
        forward after `opt.wait()`; gradients read (clipping, GradScaler) land their buckets
        first; a second overlapped optimizer is refused. Same results as torch's DDP with
        `optimizer` stepped after backward. Call alike on every rank."""
        reducer = self._reducer_for("overlap_optimizer")
        refuse_another(reducer, optimizer)
        tail, chunk, credit = tail_bytes(tail_mb, chunk_mb, credit_mb)
        plan = self.bucket_plan()
        if (tail_mb is None and chunk_mb is None and credit_mb is None and plan is not None
                and plan.tail_settings is not None):
            tail, chunk, credit = plan.tail_settings  # the planner's (a checkpoint's)
        agree_on_tail(self.process_group, tail, chunk, credit)
        agree_on_parameters(self.process_group, reducer.names, held_by(optimizer, reducer.params))
        overlapped = OverlappedOptimizer(reducer, optimizer, self.module)
        undecided = self._auto is not None and plan is None  # "auto", not yet planned
        if (getattr(self, "_default_caps", False) or undecided) and not reducer.sharded:
            # Buckets land and are stepped one by one: smaller ones start reducing earlier in
            # backward and leave less of the last one in front of the tail (measured:
            # docs/benchmarks/2026-12-06-overlap-buckets.md). Set bucket_cap_mb to keep others.
            # With "auto" not yet planned, the trial's candidates must beat these buckets.
            self._limits = ([self._limits[0][0], int(DEFAULT_OVERLAP_BUCKET_MB * 2**20)], False)
            reducer.recap_buckets(self._limits[0])  # and `bucket_bytes_cap` says so
        reducer.send_tail_first(tail, chunk, credit=credit)
        # Without tail_mb, the tail is measured after a few iterations (the planner's trial
        # chooses it under "auto", a checkpoint's plan restores it).
        self._measured_tail: MeasuredTail | None = (
            MeasuredTail(chunk, credit) if tail_mb is None and self._auto is None else None)
        return overlapped

    @property
    def measured_tail(self) -> MeasuredTail | None:
        """How `overlap_optimizer` measures its tail where given no `tail_mb`: `tail`, in bytes
        once decided, the `backlog` it tried and its `score`; None where it is not measured
        (tail_mb given, "auto", inside join())."""
        return self._measured_tail

    def check_sharded_optimizer(self, group: dist.ProcessGroup) -> None:
        """Called by gradsync.ZeroRedundancyOptimizer (ZeRO-1) holding this wrapper's parameters,
        before it splits their optimizer state across `group`: a wrapper whose set of ranks
        changes from step to step (gradsync.ft) refuses, with the reason. Here: nothing to
        refuse."""

    # --------------------------------------------------------------------- construction

    def _choose_parameters(
        self, cap_mb: float | str | None, cap_mb_list: list[float] | None, delay_named: Any,
        delay_trigger: Any, mixed: Any,
    ) -> None:
        """Which parameters go where: the Reducer's buckets (and their limits), the delayed
        all-reduce, mixed precision's low-precision copies; and the buffers to broadcast."""
        # "auto": measure, probe the network and plan the layout (gradsync.planning.planner).
        self._auto = AutoBuckets() if cap_mb == "auto" else None
        self._measured_tail = None  # overlap_optimizer's, without tail_mb
        self._limits = bucket_limits(None if self._auto else cap_mb, cap_mb_list)  # type: ignore[arg-type]
        self._default_caps = cap_mb is None and not cap_mb_list  # torch's 25 MiB: none given
        self._delay_args = (delay_named, delay_trigger)
        self._delayed = DelayedAllReduce.from_arguments(self.module, *self._delay_args,
                                                        self.process_group)
        delayed_names = {n for n, _ in delay_named or ()}
        self._named_params = trainable_parameters(self.module, delayed_names,
                                                  self._delayed is not None)
        self._mixed = mixed_precision_params(self.module, mixed, self.gradient_as_bucket_view)
        self._buffers_to_sync = module_buffers(self.module)

    def _connect(self) -> None:
        """Build what works on the parameters (again after unpickling): the Reducer, each
        parameter's link back to this wrapper, the guards on the module."""
        self.reducer = self._build_reducer() if self._named_params else None
        for _, param in self._named_params:  # how a sharded optimizer finds its wrapper
            param._gradsync_wrapper = LocalRef(self)  # type: ignore[attr-defined]
        self._install_guards()

    def _build_reducer(self) -> TorchNamedReducer:
        config = reducer_config(self._searches_unused(), self.static_graph, self._mixed,
                                self.gradient_as_bucket_view, self._limits[0])
        reducer = build_reducer(self.module, self._named_params, self.process_group, config,
                                self._limits)
        reducer.take_micro_steps = weakref.WeakMethod(self._take_micro_steps)
        return reducer

    def shard_gradients(self, in_flight: int | None = None,
                        reduce_by: str | None = None) -> Reducer:
        """Reduce-scatter the gradients in buckets capped at `bucket_cap_mb`, in reverse
        definition order, for good (gradsync.ZeroRedundancyOptimizer calls this when it holds
        this wrapper's parameters): each rank keeps its shard of each bucket's averaged
        gradients, `.grad` is left None after a synchronised backward; at most `in_flight`
        buckets reducing at once (`Reducer.shard_gradients`). Returns the Reducer."""
        if self.reducer is None:
            raise ValueError("shard_gradients: this wrapper has no parameters to synchronise")
        refuse_sharding(auto=self._auto is not None, delayed=self._delayed is not None)
        if not self.reducer.sharded:
            layout = definition_order_layout([p for _, p in self._named_params], self._limits[0])
            self.reducer.shard_gradients(layout, in_flight, reduce_by)
        return self.reducer

    def _install_guards(self) -> None:
        """Remember where the parameters are (a later move is refused), and watch forwards
        of the wrapped module itself (not through this wrapper): they start a graph of their
        own, whose gradients are local, as under torch's DDP, not late ones."""
        # Mixed precision swaps parameter dtypes around every forward, on purpose.
        self._placement = Placement(self.module, self._named_params,
                                    dtype_swaps=self._mixed is not None)
        weakref.finalize(self, UnsynchronisedGradients(frozen_parameters(self.module)).remove)
        if self.reducer is None:
            return
        handle = self.module.register_forward_pre_hook(ForwardWatcher(self.reducer))
        weakref.finalize(self, handle.remove)

    def _searches_unused(self) -> bool:
        # A static graph learns its unused parameters once instead of searching every forward.
        return self.find_unused_parameters and not self.static_graph

    # -------------------------------------------------------------------------- forward

    @dynamo_skip
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # The order of collectives here is mirrored by a joined rank's DDPJoinHook.main_hook.
        # Under torch.compile only the wrapped module's forward is compiled, as its own frame:
        # dynamo skips this one (not what it calls), and the two halves around the module.
        with torch.autograd.profiler.record_function("gradsync.DistributedDataParallel.forward"):
            inputs, kwargs, active = self._pre_forward(*inputs, **kwargs)
            ACTIVE_FORWARDS.enter(self)
            try:
                # buckets still landing (overlap_optimizer): each where the forward needs it
                with self._landing_on_use():
                    output = self.module(*inputs, **kwargs)
            finally:
                ACTIVE_FORWARDS.leave(self)
            return self._post_forward(output, active)

    @torch.compiler.disable
    def _landing_on_use(self) -> contextlib.AbstractContextManager:
        return (self.reducer.landing_on_use() if self.reducer is not None
                else contextlib.nullcontext())

    @torch.compiler.disable
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any, dist.Work | None]:
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._placement.check(sample=True)
        if self.reducer is not None:
            # Nothing may still be landing under a forward that will not reduce, nor under
            # mixed precision's low-precision copies, made from the whole parameters now.
            if not sync or self._mixed is not None:
                self.reducer.land()
            self.reducer.prepare_for_forward()
        if self._delayed is not None:
            self._delayed.enabled = sync
        active = Join.notify_join_context(self)  # None unless inside join()
        if self._join_config.enable:  # waited for: a Work dropped unwaited can be freed early
            wait(all_reduce_flag(self.process_group, sync), "join: backward-sync flag",
                 self.process_group, DEFAULT_TIMEOUT)
        if self.will_sync_module_buffers():
            sync_buffers_from_active_rank(self.process_group, self._buffers_to_sync, is_active=True,
                                          inside_join=self._join_config.enable)
        if self.device_ids:
            inputs, kwargs = (_move_to(inputs, self.device_ids[0]),
                              _move_to(kwargs, self.device_ids[0]))
        if self._mixed is not None:
            owner = self._shard_owner()
            if owner is not None:  # the low-precision copies are made from whole parameters:
                owner.wait_parameters()  # no overlapped gather may land after them
            sharded = self.reducer is not None and self.reducer.sharded
            self._mixed.cast_down(sync, written_back=sync and self._fills_in_backward(),
                                  sharded=sharded)
            inputs, kwargs = self._mixed.cast_inputs(inputs), self._mixed.cast_inputs(kwargs)
        return inputs, kwargs, active

    def _fills_in_backward(self) -> bool:
        """Whether the Reducer copies every gradient into its buckets during backward, before
        mixed precision's restore at its end. Not in a static graph's first iteration, which
        reduces everything at the end of backward, after the restore: its gradients must then
        be in `.grad`, in full precision (exactly: cast up from the bucket's dtype)."""
        learning = self.static_graph and self.reducer is not None and self.reducer.reductions == 0
        return self.reducer is not None and not learning

    @torch.compiler.disable
    def _post_forward(self, output: Any, active: dist.Work | None) -> Any:
        grad = torch.is_grad_enabled()
        # Read again after the module ran, as torch does: Lightning's manual optimisation turns
        # it off inside forward and prepares the backward itself (reducer.prepare_for_backward).
        sync = grad and self.require_backward_grad_sync
        if self._searches_unused() and grad:
            # As torch's _DDPSink: an output left out of the loss is still visited by
            # backward (with no gradient), so its parameters count as unused on this rank.
            output = route_through_sink(output)
        if self._mixed is not None:  # queued first: full precision is back before write-back
            self._mixed.restore_after_backward(output)
        counts = self._forward_counts
        if sync and self._divergence_every and counts.syncs % self._divergence_every == 0:
            self.check_parameters_in_sync()
        counts.syncs += sync
        counts.micro_steps += grad
        if sync and self.reducer is not None:
            if self._auto is not None:
                self._auto.maybe_plan(self.reducer)
            if self._measured_tail is not None:
                self._measured_tail.maybe_decide(self.reducer)
            if self.find_unused_parameters or self.static_graph:  # the graph is searched from them
                check_outputs_hold_tensors(output, True)
            self.reducer.prepare_for_backward(
                output, divisor=self._divisor(active), micro_steps=self._take_micro_steps()
            )
        elif sync:
            counts.micro_steps = 0
        if self.require_forward_param_sync is not sync:
            self.require_forward_param_sync = sync
        return output

    def _take_micro_steps(self) -> int:
        """The forwards this synchronisation covers (with grad, since the last one); reset."""
        counts = self._forward_counts
        steps, counts.micro_steps = counts.micro_steps, 0
        return steps

    def _divisor(self, active_ranks: dist.Work | None) -> int | None:
        """Average over the ranks still training, if join(divide_by_initial_world_size=False)."""
        if active_ranks is None or self._divide_by_initial_world_size:
            return None
        wait(active_ranks, "join: count of ranks still training", self.process_group,
             DEFAULT_TIMEOUT)
        return int(active_ranks.result()[0].item())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronises them."""
        if self.reducer is not None:  # the gradients accumulate onto the landed averages
            self.reducer.land()
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ----------------------------------------------------------- checkpoints, guards

    def gradsync_state(self) -> dict[str, Any]:
        """What to checkpoint besides the model and optimizer: the bucket layout (rebuilt or
        planned), the planner's verdict, the iteration count and the registered communication
        hook's state (e.g. PowerSGD's error feedback, low-rank memories and random generator;
        its process group is left out). Save it with your checkpoint and hand it to
        `load_gradsync_state` after a restart, after registering the same hook, so the run goes
        on exactly as an uninterrupted one would."""
        return saved_state(self.reducer, self._auto, self._forward_counts.syncs)

    def load_gradsync_state(self, state: dict[str, Any]) -> None:
        """Restore what `gradsync_state` saved (call on every rank, before the first forward,
        after `register_comm_hook` if the run used a hook)."""
        restore_layout(state, self.reducer, self._auto)
        self._forward_counts.syncs = state["syncs"]
        restore_hook_state(self.reducer, state.get("hook_state"))

    def bucket_plan(self) -> BucketPlan | None:
        """With bucket_cap_mb="auto": the planned layout and its predicted time (None until
        planned). Compare with `stats()` for the measured one."""
        return self._auto.plan if self._auto is not None else None

    def check_parameters_in_sync(self) -> None:
        """Raise ParameterDivergenceError on every rank if the replicas differ (a collective:
        call it on every rank at the same point)."""
        if self.reducer is not None:  # buckets still landing (overlap_optimizer): stepped first
            self.reducer.land()
        check_parameters_in_sync(list(self.module.named_parameters()), self.process_group)

    def enable_divergence_check(self, every: int = 100) -> None:
        """Check that parameters are identical across ranks every `every` synchronised
        forwards (before the forward runs); 0 turns it off."""
        if every < 0:
            raise ValueError(f"every={every} must be >= 0")
        self._divergence_every = every

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names: list[str]) -> None:
        """torch's name for `gradsync.exclude_from_sync`, so existing code keeps working."""
        exclude_from_sync(module, names)

    # ------------------------------------------------- torch's names, for frameworks

    @property
    def bucket_bytes_cap(self) -> int:
        """torch's attribute: the bucket size in bytes. dynamo's DDPOptimizer splits a compiled
        graph at this size; planned layouts (bucket_cap_mb="auto") give their largest bucket."""
        if self._auto is not None and self.reducer is not None and self.reducer.rebuilt:
            return max(bucket.nbytes for bucket in self.reducer.buckets)
        return self._limits[0][-1]

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's summary of this wrapper (keys as torch's, where they mean something here),
        with gradsync's own figures; Lightning reads `can_set_static_graph` at teardown."""
        params = [p for _, p in self._named_params]
        return logging_data(self, params, self._join_config.enable, self._searches_unused())

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError(f"DDP runtime logging sample rate should be >= 1, got {sample_rate}")
        # gradsync times every iteration (`stats()`); there is no sampling to set.

    def _set_static_graph(self) -> None:
        """torch's late switch to static_graph=True: before the first iteration only."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer is not None:
            self.reducer.set_static_graph()
        self.static_graph = True

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks by name (`dist.BuiltinCommHookType`), as Python hooks."""
        hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        if comm_hook_type not in hooks:
            raise ValueError(f"unknown built-in communication hook {comm_hook_type!r}; "
                             f"known: {list(hooks)}")
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])

    def to_kwargs(self, inputs: tuple, kwargs: dict | None,
                  device_id: int) -> tuple[tuple, tuple]:
        """torch's (kept there for old callers): `inputs` and `kwargs` moved to device
        `device_id` of the module's device type, each wrapped in a one-element tuple."""
        from torch.nn.parallel.distributed import _to_kwargs

        param = next(self.module.parameters(), None)
        device_type = param.device.type if param is not None else "cpu"
        side_stream = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
        return _to_kwargs(inputs, kwargs, torch.device(device_type, device_id), side_stream)

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (torch's name)."""
        return (
            self.forward_sync_buffers
            and self.require_forward_param_sync
            and bool(self._buffers_to_sync)
            and self.process_group.size() > 1
        )

    # ----------------------------------------------------------------------------- join

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """A context for training with uneven inputs, as torch's `DistributedDataParallel.join`.

        Ranks that run out of batches keep answering the others' collectives with zeros until
        all are done; then every rank takes the model of the last rank to finish. A sharded
        optimizer holding this wrapper's gradients (ZeRO-2) joins with it; give a ZeRO-1 one
        to `Join([model, optimizer])` yourself, as with torch's class. With
        `throw_on_early_termination`, every rank raises as soon as one runs out instead.
        """
        if self.reducer is not None:
            self.reducer.land()
        owner = self._shard_owner()
        joinables: list[Joinable] = [self]
        if isinstance(owner, Joinable):  # a joined rank steps its shard too
            joinables.append(owner)
        return Join(
            joinables,
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def _shard_owner(self) -> Any:
        """The sharded optimizer holding this wrapper's gradients (ZeRO-2), if one is alive."""
        ref = self.reducer.shard_owner if self.reducer is not None else None
        return ref() if ref is not None else None

    def join_hook(self, **kwargs: Any) -> JoinHook:
        check_joinable(delayed=self._delayed is not None or self.reducer is None,
                       auto=self._auto is not None)
        self._measured_tail = None  # its agreement is a collective a joined rank would miss
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return DDPJoinHook(self, self._buffers_to_sync)

    @property
    def join_device(self) -> torch.device:
        return next(iter(self.module.parameters())).device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _apply(self, fn: Any, recurse: bool = True) -> DistributedDataParallel:
        # ddp.to(...), ddp.double(), ...: buckets cannot follow the parameters; say so now.
        result = super()._apply(fn, recurse)
        self._placement.check(sample=False)
        return result

    # ------------------------------------------------------------------------- pickling

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in _REBUILT_ON_UNPICKLING}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = default_group()
        self._delayed = DelayedAllReduce.from_arguments(self.module, *self._delay_args,
                                                        self.process_group)
        self._connect()


class ForwardWatcher:
    """Forward pre-hook on the wrapped module: tells the reducer (held weakly) that a forward
    started. Pickles (with the module) to a no-op; the unpickled wrapper adds its own."""

    def __init__(self, reducer: Reducer | None) -> None:
        # not a LocalRef: a call into another file on every forward (tests/threaded/test_locality)
        self.reducer = weakref.ref(reducer) if reducer is not None else None

    def __call__(self, _module: nn.Module, _inputs: Any) -> None:
        alive = self.reducer() if self.reducer is not None else None
        if alive is not None:
            alive.note_module_forward()

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return (ForwardWatcher, (None,))


class Placement:
    """Where the wrapped parameters were: buckets live on their device and in their dtype, so
    a module moved or cast after wrapping must be refused, not half-synchronised."""

    SAMPLE = 4  # checked on every forward: the first and last few (a whole-module move)

    def __init__(
        self, module: nn.Module, named: list[tuple[str, nn.Parameter]], dtype_swaps: bool
    ) -> None:
        owners = dict(module.named_modules())
        self.entries = []
        for name, param in named:
            owner, _, attr = name.rpartition(".")
            self.entries.append((name, owners[owner], attr, param, param.device, param.dtype))
        k = self.SAMPLE
        self.sample = (
            self.entries if len(self.entries) <= 2 * k else self.entries[:k] + self.entries[-k:]
        )
        self.dtype_swaps = dtype_swaps

    def check(self, sample: bool) -> None:
        for name, owner, attr, param, device, dtype in self.sample if sample else self.entries:
            current = owner._parameters.get(attr)
            if current is not param:
                self._refuse(
                    name, f"was replaced by a new tensor ({_where(current)})", device, dtype
                )
            if param.device != device or (param.dtype != dtype and not self.dtype_swaps):
                self._refuse(name, f"is now {_where(param)}", device, dtype)

    @staticmethod
    def _refuse(name: str, now: str, device: torch.device, dtype: torch.dtype) -> None:
        raise GradSyncError(
            f"gradsync: parameter {name!r} was on {device} as {dtype} when the module was "
            f"wrapped and {now}: the module was moved or cast after wrapping. gradsync's "
            "gradient buckets were allocated for the parameters as they were, so they can no "
            "longer be synchronised.\nFix: move or cast the module first, then wrap it: "
            "model.to(device); ddp = gradsync.DistributedDataParallel(model, ...)."
        )


def _where(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"on {t.device} as {t.dtype}"


def _land_before_saving(wrapper: DistributedDataParallel, _prefix: str, _keep: bool) -> None:
    """A state-dict pre-hook: parameters still being stepped as their buckets land first."""
    if wrapper.reducer is not None:
        wrapper.reducer.land()


def _land_before_loading(wrapper: DistributedDataParallel, *_args: Any) -> None:
    """A load-state-dict pre-hook: no bucket may land (and step) on top of loaded values."""
    if wrapper.reducer is not None:
        wrapper.reducer.land()


# The forward pre-hook's old name: modules pickled with an earlier gradsync hold it.
_ForwardWatcher = ForwardWatcher


@dataclasses.dataclass(slots=True)
class _Forwards:
    """The wrapper's counts of forwards, kept off the module: each `nn.Module.__setattr__`
    costs about a microsecond, and these change on every forward."""

    syncs: int = 0
    """Synchronised forwards so far (the divergence check's period, checkpointed)."""
    micro_steps: int = 0
    """Forwards with grad since the last synchronised one."""


class ActiveForwards:
    """Which DDP module's forward runs, where dynamo looks for it: torch's own class attribute
    `_active_ddp_module` (whatever the name `DistributedDataParallel` points to now). A graph
    compiled meanwhile is split at bucket boundaries (DDPOptimizer), so its gradients come out
    bucket by bucket and communication overlaps the rest of backward.

    One per process, like the attribute it keeps: wrappers whose forwards overlap (nested, or
    rank threads of one process) each leave it pointing at one still inside, or None. Saving
    and restoring "the one before" would not: two threads interleaving can restore a wrapper
    whose forward has ended, and the class attribute then keeps it alive."""

    def __init__(self) -> None:
        self._inside: list[object] = []
        self._lock = threading.Lock()

    @torch.compiler.disable
    def enter(self, ddp: nn.Module) -> None:
        with self._lock:
            self._inside.append(ddp)
            TorchDDP._active_ddp_module = ddp  # type: ignore[assignment]

    @torch.compiler.disable
    def leave(self, ddp: nn.Module) -> None:
        with self._lock:
            last = len(self._inside) - 1 - self._inside[::-1].index(ddp)
            del self._inside[last]
            TorchDDP._active_ddp_module = self._inside[-1] if self._inside else None  # type: ignore[assignment]


ACTIVE_FORWARDS = ActiveForwards()


def _move_to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_move_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    return obj
