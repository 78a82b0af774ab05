"""`bucket_cap_mb="auto"`: measure a few iterations, probe the network, plan, rebuild once.

Every rank plans from the same inputs: per-parameter ready times are all-reduced (the slowest
rank's, since it decides when a bucket can go) and the cost model is agreed in the probe, so the
deterministic planner gives every rank the same layout without sending the layout itself.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.distributed as dist

from .collectives import DEFAULT_TIMEOUT, wait
from .log import log
from .planner import CostModel, plan_buckets, predict_finish_ms, probe_cost_model
from .reducer import Reducer
from .timeline import EventKind

__all__ = ["AutoBuckets", "BucketPlan"]


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """A planned layout and what the cost model predicted for it."""

    layout: list[list[int]]
    cost: CostModel
    predicted_finish_ms: float
    """Predicted time from the end of forward until the last all-reduce finishes."""
    default_finish_ms: float
    """The same prediction for the layout it replaced."""
    planned_at_iteration: int
    previous_layout: list[list[int]]
    measured_before_ms: float
    """Median time from the end of forward until gradients were written back, before."""
    measured_after_ms: float | None = None
    """The same after planning (None until checked)."""
    kept: bool | None = None
    """Whether the plan stayed (None until checked; False: measured slower, reverted)."""

    def __str__(self) -> str:
        verdict = {None: "not yet checked", True: "kept", False: "reverted: measured slower"}[self.kept]
        after = f"{self.measured_after_ms:.3f}" if self.measured_after_ms is not None else "?"
        return (
            f"planned {len(self.layout)} buckets (was {len(self.previous_layout)}) at iteration "
            f"{self.planned_at_iteration}: predicted {self.predicted_finish_ms:.3f} ms vs "
            f"{self.default_finish_ms:.3f} ms; measured {after} ms vs "
            f"{self.measured_before_ms:.3f} ms ({verdict}); all-reduce ≈ "
            f"{self.cost.alpha_ms:.3f} ms + {self.cost.beta_ms_per_byte * 2**20:.3f} ms/MiB"
        )


class AutoBuckets:
    """Plans once, after `warmup` finished synchronised iterations (the first rebuild included),
    then checks the plan against measurement after `check` more and reverts it if it was slower
    (the model knows nothing of, say, gloo threads competing with backward for the cores)."""

    def __init__(self, warmup: int = 3, window: int = 2, check: int = 4, tolerance: float = 0.02) -> None:
        self.warmup, self.window, self.check, self.tolerance = warmup, window, check, tolerance
        self.plan: BucketPlan | None = None

    def maybe_plan(self, reducer: Reducer) -> None:
        finished = len(reducer.history)
        if self.plan is None and finished >= self.warmup:
            self.plan = self._plan(reducer)
            log.info("rank %d: %s", reducer.rank, self.plan)
        elif self.plan is not None and self.plan.kept is None:
            since = reducer.iteration - self.plan.planned_at_iteration
            if since >= self.check:
                self.plan = self._judge(reducer, self.plan)
                log.info("rank %d: %s", reducer.rank, self.plan)

    def _judge(self, reducer: Reducer, plan: BucketPlan) -> BucketPlan:
        recent = [t for t in reducer.history if t.iteration > plan.planned_at_iteration]
        after = _agreed_max(reducer, [_median_total_ms(recent[-self.check :])])[0]
        kept = after <= plan.measured_before_ms * (1 + self.tolerance)
        if not kept:
            reducer.install_layout(plan.previous_layout)
        return dataclasses.replace(plan, measured_after_ms=after, kept=kept)

    def _plan(self, reducer: Reducer) -> BucketPlan:
        ready = self._agreed_ready_ms(reducer)
        device = reducer.buckets[0].buffer.device
        cost = probe_cost_model(reducer.process_group, reducer.buckets[0].buffer.dtype, device)
        n = len(reducer.params)
        order = sorted(range(n), key=lambda i: (ready[i], i))
        nbytes = [p.numel() * p.element_size() for p in reducer.params]
        keys = [
            ("sparse", i) if reducer.expect_sparse_gradient[i] else (p.dtype, p.device)
            for i, p in enumerate(reducer.params)
        ]
        positions = plan_buckets(
            [ready[i] for i in order], [nbytes[i] for i in order], cost, [keys[i] for i in order]
        )
        layout = [[order[p] for p in bucket] for bucket in positions]
        previous = reducer.bucket_indices
        default = predict_finish_ms(ready, nbytes, previous, cost)
        predicted = predict_finish_ms(ready, nbytes, layout, cost)
        before = _agreed_max(reducer, [_median_total_ms(list(reducer.history)[-self.window :])])[0]
        reducer.install_layout(layout)
        return BucketPlan(layout, cost, predicted, default, reducer.iteration, previous, before)

    def _agreed_ready_ms(self, reducer: Reducer) -> list[float]:
        recent = list(reducer.history)[-self.window :]
        per_param: list[list[float]] = [[] for _ in reducer.params]
        for tl in recent:
            for t, kind, i in tl.events:
                if kind in (EventKind.READY, EventKind.UNUSED):
                    per_param[i].append((t - tl.start_ns) * 1e-6)
        return _agreed_max(reducer, [statistics.median(v) if v else 0.0 for v in per_param])


def _median_total_ms(timelines: list) -> float:
    totals = [(t.finish_ns - t.start_ns) * 1e-6 for t in timelines if t.finish_ns]
    return statistics.median(totals) if totals else 0.0


def _agreed_max(reducer: Reducer, values: list[float]) -> list[float]:
    """Each value's maximum over the ranks: the same inputs, hence the same decisions, everywhere."""
    agreed = torch.tensor(values, dtype=torch.float64, device=reducer.buckets[0].buffer.device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
    group = reducer.process_group
    wait(group.allreduce([agreed], opts), "agreement on measured timings", group, DEFAULT_TIMEOUT)
    return agreed.tolist()
