"""`gradsync.DistributedDataParallel`: torch's wrapper, same constructor and loop, on our Reducer.

Swap `torch.nn.parallel.DistributedDataParallel` for this class and nothing else changes:

    torchrun --nproc-per-node 2 train.py      # train.py: model = gradsync.DistributedDataParallel(model)

Construction checks that every rank holds the same parameters (before any bucket collective
could hang on a mismatch), broadcasts rank 0's parameters and buffers, and builds the Reducer
with torch's layout policy: one bucket for the first iteration, rebuilt in gradient-ready order.
"""

from __future__ import annotations

import contextlib
import copy
import sys
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

from ..engine.bucketing import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES, MIB
from ..engine.bucketing import compute_bucket_assignment_by_size as assign_buckets
from ..engine.collectives import DEFAULT_TIMEOUT, all_gather_objects, broadcast_tensors, wait
from ..engine.comm import CommHook
from ..engine.config import ReducerConfig
from ..engine.errors import GradSyncError
from ..engine.reducer import Reducer
from ..engine.timeline import EventKind
from ..engine.unused import find_tensors, route_through_sink
from ..observability.log import log, log_iteration
from ..observability.stats import Stats
from ..observability.trace import chrome_trace, write_chrome_trace
from ..observability.watchdog import StallWatchdog
from ..planning.autoplan import AutoBuckets, BucketPlan
from ..planning.simulate import timing_profile
from .delayed import DelayedAllReduce
from .guards import check_parameters_in_sync
from .join import DDPJoinHook, all_reduce_flag, find_common_rank
from .mixed import MixedPrecisionParams
from .torch_compat import (
    ACTIVE_FORWARDS,
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

@refuse_torch_internals
class DistributedDataParallel(_Base):
    """Data-parallel training of `module`: gradients are averaged across `process_group`.

    A subclass of torch's class, so that frameworks' `isinstance` checks hold, whose
    constructor is never run: no C++ reducer, no hooks of torch's (`torch_compat`).
    """

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
        nn.Module.__init__(self)  # not torch's DistributedDataParallel.__init__: no C++ reducer
        Joinable.__init__(self)
        self.module = module
        self.process_group = _resolve_group(process_group, device_mesh)
        # torch skips sending parameters unused on every rank (its users promise the unused set
        # never changes); gradsync still sends their zeros. The results are the same.
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.device_ids, self.output_device = _resolve_devices(module, device_ids, output_device)
        self.dim = dim
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # batched_grad_copy changes only how copies are issued, never the result; accepted.
        self.batched_grad_copy = batched_grad_copy
        self.static_graph = static_graph
        self.forward_sync_buffers, init_buffers = _buffer_policy(broadcast_buffers, forward_sync_buffers)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._divergence_every = 0  # see enable_divergence_check
        self._syncs = 0
        self._micro_steps = 0  # forwards with grad since the last synchronised one
        # "auto": measure, probe the network and plan the layout (gradsync.planning.planner).
        self._auto = AutoBuckets() if bucket_cap_mb == "auto" else None
        self._limits = _bucket_limits(None if self._auto else bucket_cap_mb, bucket_cap_mb_list)  # type: ignore[arg-type]
        self._delay_args = (delay_all_reduce_named_params, param_to_hook_all_reduce)
        self._delayed = DelayedAllReduce.from_arguments(module, *self._delay_args, self.process_group)
        delayed_names = {n for n, _ in delay_all_reduce_named_params or ()}
        self._named_params = _trainable_parameters(module, delayed_names, self._delayed is not None)
        self._mixed = _mixed_precision(module, mixed_precision, gradient_as_bucket_view)
        self._buffers_to_sync = _buffers(module)
        if init_sync:
            self._check_same_parameters_across_ranks()
            self._broadcast_state(include_buffers=init_buffers)
            if self._delayed is not None:
                self._delayed.broadcast_from_rank0()
        self.reducer = self._build_reducer() if self._named_params else None
        for _, param in self._named_params:  # how a sharded optimizer finds its wrapper
            param._gradsync_wrapper = WrapperRef(self)  # type: ignore[attr-defined]
        self._install_guards()
        log.info(
            "rank %d/%d: wrapped %d parameters in %d buckets (find_unused=%s, static_graph=%s)",
            self.process_group.rank(), self.process_group.size(), len(self._named_params),
            len(self.reducer.buckets) if self.reducer else 0, find_unused_parameters, static_graph,
        )

    # --------------------------------------------------------------------- construction

    def _build_reducer(self) -> Reducer:
        params = [p for _, p in self._named_params]
        sparse = _expects_sparse_gradient(self.module, [n for n, _ in self._named_params])
        limits, per_bucket = self._limits
        # As torch: without unused-parameter search the first iteration uses one bucket and the
        # rebuild orders buckets by real arrival; with it, buckets follow reversed definition
        # order. Explicit per-bucket caps (bucket_cap_mb_list) apply from the start.
        initial = limits if self._searches_unused() or per_bucket else [sys.maxsize]
        layout, _ = assign_buckets(params, initial, sparse)
        config = ReducerConfig(
            find_unused_parameters=self._searches_unused(),
            static_graph=self.static_graph,
            bucket_dtype=self._mixed.param_dtype if self._mixed else None,
            reduce_dtype=self._mixed.reduce_dtype if self._mixed else None,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            rebuild_bucket_size_limits=tuple(limits),
        )
        reducer = TorchNamedReducer(
            params,
            list(reversed(layout)),
            self.process_group,
            param_names=[n for n, _ in self._named_params],
            config=config,
            expect_sparse_gradient=sparse,
        )
        reducer.iteration_listeners.append(log_iteration)
        reducer.wrapper = weakref.ref(self)
        return reducer

    def shard_gradients(self, in_flight: int | None = None, reduce_by: str | None = None) -> Reducer:
        """Reduce-scatter the gradients in buckets capped at `bucket_cap_mb`, in reverse
        definition order, for good (gradsync.ZeroRedundancyOptimizer calls this when it holds
        this wrapper's parameters): each rank keeps its shard of each bucket's averaged
        gradients, `.grad` is left None after a synchronised backward; at most `in_flight`
        buckets reducing at once (`Reducer.shard_gradients`). Returns the Reducer."""
        if self.reducer is None:
            raise ValueError("shard_gradients: this wrapper has no parameters to synchronise")
        refused = [why for cond, why in (
            (self._auto is not None, 'bucket_cap_mb="auto" (the planner changes the layout; sharded state follows it)'),
            (self._delayed is not None, "delay_all_reduce_named_params"),
        ) if cond]
        if refused:
            raise ValueError(
                f"gradsync: cannot shard this wrapper's gradients with {', '.join(refused)}; pass a "
                "numeric bucket_cap_mb and leave the others out, or use "
                "ZeroRedundancyOptimizer(shard_gradients=False) (ZeRO-1)"
            )
        if not self.reducer.sharded:
            params = [p for _, p in self._named_params]
            layout, _ = assign_buckets(params, self._limits[0], [False] * len(params))
            self.reducer.shard_gradients(list(reversed(layout)), in_flight, reduce_by)
        return self.reducer

    def _install_guards(self) -> None:
        """Remember where the parameters are (a later move is refused), and watch forwards
        of the wrapped module itself (not through this wrapper): they start a graph of their
        own, whose gradients are local, as under torch's DDP, not late ones."""
        # Mixed precision swaps parameter dtypes around every forward, on purpose.
        self._placement = _Placement(self.module, self._named_params, dtype_swaps=self._mixed is not None)
        if self.reducer is None:
            return
        handle = self.module.register_forward_pre_hook(_ForwardWatcher(self.reducer))
        weakref.finalize(self, handle.remove)

    def _searches_unused(self) -> bool:
        # A static graph learns its unused parameters once instead of searching every forward.
        return self.find_unused_parameters and not self.static_graph

    def _check_same_parameters_across_ranks(self) -> None:
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in self._named_params]
        everyone = all_gather_objects(self.process_group, mine)
        problem = _first_mismatch(everyone)  # every rank computes the same verdict
        if problem is not None:
            raise ValueError(
                f"gradsync.DistributedDataParallel: ranks hold different parameters. {problem}\n"
                "Every rank must build the same model (same classes, arguments and requires_grad "
                "settings) before wrapping it; check for rank-dependent model code or a "
                "checkpoint loaded on only some ranks."
            )

    def _broadcast_state(self, include_buffers: bool) -> None:
        ignored = _ignored(self.module)
        tensors = [p.detach() for n, p in self.module.named_parameters() if n not in ignored]
        if include_buffers:
            tensors += self._buffers_to_sync
        if tensors and self.process_group.size() > 1:
            broadcast_tensors(self.process_group, tensors, src=0)

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
                output = self.module(*inputs, **kwargs)
            finally:
                ACTIVE_FORWARDS.leave(self)
            return self._post_forward(output, active)

    @torch.compiler.disable
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any, dist.Work | None]:
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._placement.check(sample=True)
        if self.reducer is not None:
            self.reducer.prepare_for_forward()
        if self._delayed is not None:
            self._delayed.enabled = sync
        active = Join.notify_join_context(self)  # None unless inside join()
        if self._join_config.enable:  # waited for: a Work dropped unwaited can be freed early
            wait(all_reduce_flag(self.process_group, sync), "join: backward-sync flag",
                 self.process_group, DEFAULT_TIMEOUT)
        self._sync_buffers_from_active_rank(is_active=True)
        if self.device_ids:
            inputs, kwargs = _move_to(inputs, self.device_ids[0]), _move_to(kwargs, self.device_ids[0])
        if self._mixed is not None:
            owner = self._shard_owner()
            if owner is not None:  # the low-precision copies are made from whole parameters:
                owner.wait_parameters()  # no overlapped gather may land after them
            sharded = self.reducer is not None and self.reducer.sharded
            self._mixed.cast_down(sync, written_back=sync and self._fills_in_backward(), sharded=sharded)
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
        if sync and self._divergence_every and self._syncs % self._divergence_every == 0:
            self.check_parameters_in_sync()
        self._syncs += sync
        self._micro_steps += grad
        if sync and self.reducer is not None:
            if self._auto is not None:
                self._auto.maybe_plan(self.reducer)
            self._check_outputs_hold_tensors(output)
            self.reducer.prepare_for_backward(
                output, divisor=self._divisor(active), micro_steps=self._take_micro_steps()
            )
        elif sync:
            self._micro_steps = 0
        self.require_forward_param_sync = sync
        return output

    def _check_outputs_hold_tensors(self, output: Any) -> None:
        wants_outputs = self.find_unused_parameters or self.static_graph
        if wants_outputs and torch.is_grad_enabled() and not find_tensors(output):
            raise GradSyncError(
                f"gradsync: forward returned {type(output).__name__} with no tensor in "
                "it. With find_unused_parameters=True (or static_graph=True) gradsync "
                "walks the autograd graph from forward's output tensors to see which "
                "parameters took part. Return the tensors the loss is computed from "
                "(in a tuple, list, dict or dataclass is fine)."
            )

    def _take_micro_steps(self) -> int:
        """The forwards this synchronisation covers (with grad, since the last one); reset."""
        steps, self._micro_steps = self._micro_steps, 0
        return steps

    def _divisor(self, active_ranks: dist.Work | None) -> int | None:
        """Average over the ranks still training, if join(divide_by_initial_world_size=False)."""
        if active_ranks is None or self._divide_by_initial_world_size:
            return None
        wait(active_ranks, "join: count of ranks still training", self.process_group, DEFAULT_TIMEOUT)
        return int(active_ranks.result()[0].item())

    def _should_sync_buffers(self) -> bool:
        return (
            self.forward_sync_buffers
            and self.require_forward_param_sync
            and bool(self._buffers_to_sync)
            and self.process_group.size() > 1
        )

    def _sync_buffers_from_active_rank(self, is_active: bool) -> None:
        if not self._should_sync_buffers():
            return
        src = 0
        if self._join_config.enable:  # rank 0 may have joined and hold stale buffers
            src = find_common_rank(self.process_group, self.process_group.rank(), is_active)
        broadcast_tensors(self.process_group, self._buffers_to_sync, src=src)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronises them."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> Future[Tensor]` (torch's protocol).

        The hook sees the bucket's summed, unaveraged gradients and must return a Future of the
        averaged (or otherwise reduced) tensor of the same shape and dtype. Call once, before
        the first forward. torch's own hooks (`torch.distributed.algorithms.ddp_comm_hooks`)
        and `gradsync.comm_hooks` work as they are.
        """
        if self.reducer is None:
            raise RuntimeError("register_comm_hook: every parameter uses the delayed all-reduce")
        self.reducer.register_comm_hook(state, hook)

    # ----------------------------------------------------------------- seeing inside

    def stats(self) -> Stats:
        """Timings of the last synchronised iteration and medians over recent ones: when each
        bucket was ready, launched and complete, backward and communication time, the exposed
        (not overlapped) communication, bytes reduced. `print(ddp.stats())` for a table."""
        if self.reducer is None:
            raise RuntimeError("stats: every parameter uses the delayed all-reduce; no buckets")
        return Stats.from_timelines(self.reducer.iteration, list(self.reducer.history))

    def export_timeline(self, path: str, rank_in_name: bool = True) -> str:
        """Write this rank's recent iterations as a Perfetto / Chrome trace JSON; return the
        path (with `.rank{N}` inserted before `.json` unless `rank_in_name` is False)."""
        if self.reducer is None:
            raise RuntimeError("export_timeline: no buckets (all parameters delayed)")
        rank = self.process_group.rank()
        if rank_in_name and path.endswith(".json"):
            path = f"{path[:-5]}.rank{rank}.json"
        trace = chrome_trace(self.reducer.history, rank, self.reducer.names)
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
        if self.reducer is None:
            raise RuntimeError("enable_stall_watchdog: no buckets (all parameters delayed)")
        if store is None and self.process_group is dist.group.WORLD:
            store = dist.distributed_c10d._get_default_store()
        group = self.process_group
        monitor = StallWatchdog(timedelta(seconds=warn_after), store, group.rank(), group.size())
        self.reducer.set_stall_monitor(monitor, timedelta(seconds=timeout) if timeout is not None else None)

    def save_timing_profile(self, path: str) -> str:
        """Write this rank's measured timings (medians of recent iterations) as JSON, for
        `gradsync simulate --profile`."""
        if self.reducer is None:
            raise RuntimeError("save_timing_profile: no buckets (all parameters delayed)")
        return str(timing_profile(self.reducer).save(path))

    def gradsync_state(self) -> dict[str, Any]:
        """What to checkpoint besides the model and optimizer: the bucket layout (rebuilt or
        planned), the planner's verdict, the iteration count and the registered communication
        hook's state (e.g. PowerSGD's error feedback, low-rank memories and random generator;
        its process group is left out). Save it with your checkpoint and hand it to
        `load_gradsync_state` after a restart, after registering the same hook, so the run goes
        on exactly as an uninterrupted one would."""
        reducer = self.reducer
        return {
            "version": 2,
            "bucket_indices": reducer.bucket_indices if reducer else [],
            "rebuilt": bool(reducer and reducer.rebuilt),
            "iterations": reducer.iteration if reducer else 0,
            "plan": self._auto.plan if self._auto else None,
            "syncs": self._syncs,
            "hook_state": _hook_state_to_save(reducer),
        }

    def load_gradsync_state(self, state: dict[str, Any]) -> None:
        """Restore what `gradsync_state` saved (call on every rank, before the first forward,
        after `register_comm_hook` if the run used a hook)."""
        if state.get("version") not in (1, 2):
            raise ValueError(f"load_gradsync_state: unknown state version {state.get('version')!r}")
        reducer = self.reducer
        if reducer is not None and state["bucket_indices"]:
            if state["rebuilt"]:
                reducer.install_layout(state["bucket_indices"])
            reducer.iteration = state["iterations"]
        if self._auto is not None and state["plan"] is not None and state["plan"].kept is not None:
            self._auto.plan = state["plan"]  # decided; a trial cut short by the stop starts over
        self._syncs = state["syncs"]
        _restore_hook_state(reducer, state.get("hook_state"))

    def bucket_plan(self) -> BucketPlan | None:
        """With bucket_cap_mb="auto": the planned layout and its predicted time (None until
        planned). Compare with `stats()` for the measured one."""
        return self._auto.plan if self._auto is not None else None

    def check_parameters_in_sync(self) -> None:
        """Raise ParameterDivergenceError on every rank if the replicas differ (a collective:
        call it on every rank at the same point)."""
        check_parameters_in_sync(list(self.module.named_parameters()), self.process_group)

    def enable_divergence_check(self, every: int = 100) -> None:
        """Check that parameters are identical across ranks every `every` synchronised
        forwards (before the forward runs); 0 turns it off."""
        if every < 0:
            raise ValueError(f"every={every} must be >= 0")
        self._divergence_every = every

    def enable_nan_check(self, enable: bool = True) -> None:
        """Check every gradient for NaN and Inf before it is communicated; the error names
        the parameter and the rank."""
        if self.reducer is None:
            raise RuntimeError("enable_nan_check: no buckets (all parameters delayed)")
        self.reducer.configure(check_finite=enable)

    def set_accumulation_check(self, enabled: bool) -> None:
        """On by default: every synchronisation compares, across ranks, how many forward
        passes it covers, and raises if they differ (no_sync() entered on some ranks only).
        Turn it off (on every rank) if ranks accumulating different numbers of micro-batches
        is intended. The counts ride in the last bucket's all-reduce; with a communication hook
        or mixed precision they take one tiny all-reduce of their own at the end of backward.
        They travel either way: beside the count, each rank says whether its backward ended
        with gradients missing, so that every rank raises then."""
        if self.reducer is not None:
            self.reducer.configure(check_accumulation=enabled)

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
        return logging_data(self)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError(f"DDP runtime logging sample rate should be >= 1, got {sample_rate}")
        # gradsync times every iteration (`stats()`); there is no sampling to set.

    def _set_static_graph(self) -> None:
        """torch's late switch to static_graph=True: before the first iteration only."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=2)
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
            raise ValueError(f"unknown built-in communication hook {comm_hook_type!r}; known: {list(hooks)}")
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (torch's name)."""
        return self._should_sync_buffers()

    def _graph_was_static(self) -> bool:
        """As torch's `can_set_static_graph`: unused-parameter search is on (not a static
        graph) and every recent iteration left the same parameters unused."""
        if self.reducer is None or not self.reducer.history:
            return False
        unused = [frozenset(t.times(EventKind.UNUSED)) for t in self.reducer.history]
        return len(set(unused)) == 1

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
        if self._delayed is not None or self.reducer is None:
            raise NotImplementedError(
                "gradsync: join() does not support delay_all_reduce_named_params yet (a joined "
                "rank cannot know where in backward the delayed all-reduce falls)"
            )
        if self._auto is not None:
            raise NotImplementedError(
                'gradsync: join() does not support bucket_cap_mb="auto" yet (planning and its '
                "trial run collectives a joined rank would not join); pass a number"
            )
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

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
        state = self.__dict__.copy()
        state.pop("process_group", None)
        state.pop("reducer", None)
        state.pop("_delayed", None)
        state.pop("_placement", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = _default_group()
        self._delayed = DelayedAllReduce.from_arguments(self.module, *self._delay_args, self.process_group)
        self.reducer = self._build_reducer() if self._named_params else None
        for _, param in self._named_params:  # how a sharded optimizer finds its wrapper
            param._gradsync_wrapper = WrapperRef(self)  # type: ignore[attr-defined]
        self._install_guards()


class _ForwardWatcher:
    """Forward pre-hook on the wrapped module: tells the reducer (held weakly) that a forward
    started. Pickles (with the module) to a no-op; the unpickled wrapper adds its own."""

    def __init__(self, reducer: Reducer | None) -> None:
        self.reducer = weakref.ref(reducer) if reducer is not None else None

    def __call__(self, _module: nn.Module, _inputs: Any) -> None:
        alive = self.reducer() if self.reducer is not None else None
        if alive is not None:
            alive.note_module_forward()

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return (_ForwardWatcher, (None,))


# ---------------------------------------------------------------------------- helpers


class _Placement:
    """Where the wrapped parameters were: buckets live on their device and in their dtype, so
    a module moved or cast after wrapping must be refused, not half-synchronised."""

    SAMPLE = 4  # checked on every forward: the first and last few (a whole-module move)

    def __init__(self, module: nn.Module, named: list[tuple[str, nn.Parameter]], dtype_swaps: bool) -> None:
        owners = dict(module.named_modules())
        self.entries = []
        for name, param in named:
            owner, _, attr = name.rpartition(".")
            self.entries.append((name, owners[owner], attr, param, param.device, param.dtype))
        k = self.SAMPLE
        self.sample = self.entries if len(self.entries) <= 2 * k else self.entries[:k] + self.entries[-k:]
        self.dtype_swaps = dtype_swaps

    def check(self, sample: bool) -> None:
        for name, owner, attr, param, device, dtype in self.sample if sample else self.entries:
            current = owner._parameters.get(attr)
            if current is not param:
                self._refuse(name, f"was replaced by a new tensor ({_where(current)})", device, dtype)
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


def _hook_state_to_save(reducer: Reducer | None) -> dict[str, Any] | None:
    """The registered hook's state object as a dict of its fields (copied: the hook keeps
    changing its tensors in place), without process groups, which cannot be saved."""
    if reducer is None or reducer.comm_hook is None:
        return None
    state = reducer.comm_hook[0]
    if state is None or isinstance(state, dist.ProcessGroup):
        return None
    # PowerSGDState's __getstate__ drops its process group itself.
    fields: Any = state.__getstate__()  # type: ignore[attr-defined]
    if not isinstance(fields, dict):  # a __slots__ object without its own __getstate__
        fields = {k: getattr(state, k) for k in getattr(type(state), "__slots__", ())}
    kept = {k: v for k, v in fields.items() if not isinstance(v, dist.ProcessGroup)}
    return {"type": type(state).__qualname__, "fields": copy.deepcopy(kept)}


def _restore_hook_state(reducer: Reducer | None, saved: dict[str, Any] | None) -> None:
    if saved is None:
        return
    state = reducer.comm_hook[0] if reducer is not None and reducer.comm_hook else None
    if state is None or type(state).__qualname__ != saved["type"]:
        raise ValueError(
            f"load_gradsync_state: the checkpoint holds the state of a {saved['type']} hook, but "
            f"{'no hook' if state is None else f'a {type(state).__qualname__}'} is registered. "
            "Call register_comm_hook with the same kind of state before load_gradsync_state."
        )
    for name, value in saved["fields"].items():
        setattr(state, name, value)


def _where(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"on {t.device} as {t.dtype}"


def _resolve_group(group: dist.ProcessGroup | None, mesh: Any) -> dist.ProcessGroup:
    if mesh is None:
        return group if group is not None else _default_group()
    if group is not None:
        raise RuntimeError("pass either process_group or device_mesh, not both")
    if mesh.ndim != 1:
        raise RuntimeError(
            f"device_mesh must be one-dimensional for data parallelism, got {mesh.ndim} "
            f"dimensions {tuple(mesh.shape)}; pass device_mesh[\"dp\"] (a 1-D slice)"
        )
    return mesh.get_group()


def _default_group() -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            "gradsync.DistributedDataParallel needs a process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment "
            "for it), or pass process_group=..."
        )
    return dist.group.WORLD  # type: ignore[return-value]


def _resolve_devices(
    module: nn.Module, device_ids: list | None, output_device: Any
) -> tuple[list[torch.device] | None, torch.device | None]:
    devices = {p.device for p in module.parameters()}
    if device_ids is None or len(devices) > 1 or devices <= {torch.device("cpu")}:
        if device_ids:
            raise ValueError(
                f"device_ids={device_ids} only applies to a module on a single accelerator; "
                f"this module's parameters are on {sorted(str(d) for d in devices)}. "
                "Pass device_ids=None."
            )
        return None, None
    ids = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in device_ids]
    if len(ids) != 1:
        raise ValueError(f"device_ids={device_ids}: give exactly one device per process")
    return ids, torch.device(output_device) if output_device is not None else ids[0]


def _buffer_policy(broadcast_buffers: bool | None, forward_sync: bool | None) -> tuple[bool, bool]:
    """(sync buffers at each forward, sync buffers at construction), as torch 2.13 decides."""
    if forward_sync is not None:
        return forward_sync, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def _bucket_limits(
    cap_mb: float | None, cap_mb_list: list[float] | None
) -> tuple[list[int], bool]:
    """(byte limits, whether they are explicit per-bucket caps), as torch 2.13 sets them."""
    caps = list(cap_mb_list or []) + ([] if cap_mb is None else [cap_mb])
    bad = [c for c in caps if c < 0]
    if bad:
        raise ValueError(f"bucket sizes must be >= 0 MiB, got {bad}")
    if cap_mb_list:
        return [int(c * MIB) for c in cap_mb_list], True
    if cap_mb is None:
        return [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES], False
    return [int(cap_mb * MIB)], False


def _trainable_parameters(
    module: nn.Module, delayed: set[str], has_delayed: bool
) -> list[tuple[str, nn.Parameter]]:
    ignored = _ignored(module) | delayed
    named = [
        (n, p)
        for n, p in module.named_parameters()  # shared parameters are listed once
        if p.requires_grad and n not in ignored
    ]
    if not named and not has_delayed:
        raise RuntimeError(
            "gradsync.DistributedDataParallel: the module has no parameter that requires a "
            "gradient, so there is nothing to synchronise. Wrap a module with trainable "
            "parameters, or train without DistributedDataParallel."
        )
    return named


def _expects_sparse_gradient(module: nn.Module, names: list[str]) -> list[bool]:
    """Per parameter: does its module produce a sparse gradient (Embedding(sparse=True))?"""
    sparse: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            sparse.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False))
    return [n in sparse for n in names]


class WrapperRef:
    """A parameter's weak reference to the wrapper that synchronises it. Pickled or copied
    it becomes dead: a copy of a model is not wrapped."""

    __slots__ = ("_ref",)

    def __init__(self, wrapper: DistributedDataParallel | None) -> None:
        self._ref = weakref.ref(wrapper) if wrapper is not None else None

    def __call__(self) -> DistributedDataParallel | None:
        return self._ref() if self._ref is not None else None

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (WrapperRef, (None,))


def exclude_from_sync(module: nn.Module, names: list[str]) -> None:
    """Leave these parameters and buffers (by qualified name) out of synchronisation.

    Call before wrapping: excluded parameters keep rank-local gradients and are not broadcast
    at construction; excluded buffers are never broadcast. Same effect as torch's
    `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`.
    """
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"exclude_from_sync: {unknown} are not parameters or buffers of this module; "
            f"valid names include {sorted(known)[:10]}"
        )
    module._ddp_params_and_buffers_to_ignore = list(names)  # type: ignore[assignment]


def _mixed_precision(
    module: nn.Module, config: Any, as_view: bool
) -> MixedPrecisionParams | None:
    if config is None:
        return None
    if as_view:
        raise NotImplementedError(
            "gradsync: mixed_precision with gradient_as_bucket_view=True is not supported (the "
            "bucket holds low-precision gradients while .grad is float32); drop one of them"
        )
    return MixedPrecisionParams(module, config, _ignored(module))


def _ignored(module: nn.Module) -> set[str]:
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def _buffers(module: nn.Module) -> list[torch.Tensor]:
    ignored = _ignored(module)
    return [b for n, b in module.named_buffers() if n not in ignored]


def _first_mismatch(everyone: list) -> str | None:
    """Describe the first parameter that differs between ranks, or None if all agree."""
    counts = [len(params) for params in everyone]
    for i in range(max(counts)):
        entries = [params[i] if i < len(params) else None for params in everyone]
        if any(e != entries[0] for e in entries):
            per_rank = "; ".join(
                f"rank {r}: " + ("(none)" if e is None else f"{e[0]!r} shape {list(e[1])} {e[2]}")
                for r, e in enumerate(entries)
            )
            return f"Parameter #{i} differs: {per_rank}. Parameter counts per rank: {counts}."
    return None


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
