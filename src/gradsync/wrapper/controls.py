"""The wrapper's switches and views onto its Reducer: the communication hook, timings, traces,
the stall watchdog, the NaN, accumulation and unused-parameter checks.

A base class of `DistributedDataParallel` that reads only the wrapper's public `reducer` and
`process_group` (and `find_unused_parameters`): every method here answers from the Reducer, or
refuses where every parameter went to the delayed all-reduce and there are no buckets.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..engine.comm import CommHook
from ..engine.reducer import Reducer
from ..observability.stats import Stats
from ..observability.trace import chrome_trace, write_chrome_trace
from ..observability.watchdog import StallWatchdog
from ..planning.simulate import timing_profile

__all__ = ["ReducerControls"]


class ReducerControls:
    """Seeing inside the Reducer of a wrapper, and the checks it can run."""

    reducer: Reducer | None
    process_group: dist.ProcessGroup
    find_unused_parameters: bool

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
        self.reducer.set_stall_monitor(
            monitor, timedelta(seconds=timeout) if timeout is not None else None
        )

    def save_timing_profile(self, path: str) -> str:
        """Write this rank's measured timings (medians of recent iterations) as JSON, for
        `gradsync simulate --profile`."""
        if self.reducer is None:
            raise RuntimeError("save_timing_profile: no buckets (all parameters delayed)")
        return str(timing_profile(self.reducer).save(path))

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

    def check_sharded_optimizer(self, group: dist.ProcessGroup) -> None:
        """Called by gradsync.ZeroRedundancyOptimizer (ZeRO-1) holding this wrapper's parameters,
        before it splits their optimizer state across `group`: a wrapper whose set of ranks
        changes from step to step (gradsync.ft) refuses, with the reason. Here: nothing to
        refuse."""
