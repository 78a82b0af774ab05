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

    def __str__(self) -> str:
        return (
            f"planned {len(self.layout)} buckets at iteration {self.planned_at_iteration}: "
            f"predicted {self.predicted_finish_ms:.3f} ms vs {self.default_finish_ms:.3f} ms for "
            f"the previous layout (all-reduce ≈ {self.cost.alpha_ms:.3f} ms + "
            f"{self.cost.beta_ms_per_byte * 1e6:.4f} ms/MB)"
        )


class AutoBuckets:
    """Plans once, after `warmup` finished synchronised iterations (the first rebuild included)."""

    def __init__(self, warmup: int = 3, window: int = 2) -> None:
        self.warmup, self.window = warmup, window
        self.plan: BucketPlan | None = None

    def maybe_plan(self, reducer: Reducer) -> None:
        if self.plan is None and len(reducer.history) >= self.warmup:
            self.plan = self._plan(reducer)
            log.info("rank %d: %s", reducer.rank, self.plan)

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
        default = predict_finish_ms(ready, nbytes, reducer.bucket_indices, cost)
        predicted = predict_finish_ms(ready, nbytes, layout, cost)
        reducer.install_layout(layout)
        return BucketPlan(layout, cost, predicted, default, reducer.iteration)

    def _agreed_ready_ms(self, reducer: Reducer) -> list[float]:
        recent = list(reducer.history)[-self.window :]
        per_param: list[list[float]] = [[] for _ in reducer.params]
        for tl in recent:
            for t, kind, i in tl.events:
                if kind in (EventKind.READY, EventKind.UNUSED):
                    per_param[i].append((t - tl.start_ns) * 1e-6)
        local = [statistics.median(v) if v else 0.0 for v in per_param]
        agreed = torch.tensor(local, dtype=torch.float64, device=reducer.buckets[0].buffer.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        group = reducer.process_group
        wait(group.allreduce([agreed], opts), "agreement on gradient ready times", group, DEFAULT_TIMEOUT)
        return agreed.tolist()
