"""`bucket_cap_mb="auto"`: measure, plan, try the plan against the current layout, keep the faster.

1. After `warmup` synchronised iterations (the first rebuild included) every rank plans from the
   same inputs: per-parameter ready times are all-reduced (the slowest rank's, since it decides
   when a bucket can go) and the cost model is agreed in the probe, so the deterministic planner
   gives every rank the same layout without sending the layout itself. Four candidates come out:
   the plan under the probed cost, coarser ones under four and sixteen times its latency (the
   probe is short and backward is not a matrix-product loop), and one bucket (per dtype and
   device: no overlap, fewest collectives).
2. A trial interleaves the candidates with the current layout, round after round, a few
   iterations each (the first after a switch is not counted). Training goes on meanwhile: a
   layout changes where gradients are summed, never what is summed.
3. The layout with the lowest median (agreed across ranks) is installed if it beat the current
   one by more than the trial's own noise (`choose_layout`): never one measured slower, nor one
   that only drew lucky samples.
4. Afterwards the step time is watched; if it drifts by more than `drift` from what it was
   just after the decision, the whole thing runs again (at most `max_replans` times).

Where collectives run is measured before the cost is: on a CPU host (gloo), an all-reduce of the
gradients' size alone and during a compute loop (`measure_contention`). Where every core
computes and gloo's threads take turns with it (loopback, as many ranks as cores) the host is
saturated: the cost is probed under load (`probe_under_load`) and priced serially, each
all-reduce adds to the step, and the plan is one bucket per dtype and device. Where they hide
behind compute (a slow link) the cost is probed with collectives queued during compute
(`probe_during_compute`), as buckets are during backward: each needs gloo's threads and the
kernel's network stack scheduled between compute, and costs several times what an idle probe
shows. On a GPU the probe is idle: NCCL runs on the device's own engines.
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.distributed as dist

from ..engine.collectives import all_reduce
from ..engine.reducer import Reducer
from ..engine.timeline import EventKind, IterationTimeline
from ..observability.log import log
from .planner import (
    Contention,
    CostModel,
    measure_contention,
    plan_buckets,
    predict_finish_ms,
    probe_cost_model,
    probe_during_compute,
    probe_sizes,
    probe_under_load,
)

__all__ = ["AutoBuckets", "BucketPlan", "choose_layout"]

CURRENT, PLANNED, COARSE, COARSER, ONE = "current", "planned", "coarse", "coarser", "one bucket"


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """A planned layout, what the cost model predicted for it and what the trial measured."""

    layout: list[list[int]]
    cost: CostModel
    predicted_finish_ms: float
    """Predicted time from the end of forward until the last all-reduce finishes."""
    default_finish_ms: float
    """The same prediction for the layout it would replace."""
    planned_at_iteration: int
    previous_layout: list[list[int]]
    measured_before_ms: float
    """Median time from the end of forward until gradients were written back, before."""
    measured_after_ms: float | None = None
    """The same for the layout chosen by the trial (None until decided)."""
    kept: bool | None = None
    """Whether a new layout replaced the previous one (None until decided)."""
    trial_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    """Median measured time per candidate layout in the trial (agreed across ranks)."""
    chosen: str | None = None
    replans: int = 0
    """How many times timings drifted and the plan was made again before this one."""
    saturated: bool = False
    """Planned for a saturated CPU host: cost probed under load, nothing overlapping."""
    needed_ms: float = 0.0
    """How much faster than the current layout a candidate had to measure to be kept: the
    margin or the trial's noise, whichever is larger (`choose_layout`)."""
    contention: float | None = None
    """The measured share of an all-reduce that competes with compute (0: hides entirely,
    1: takes turns with it; `planner.measure_contention`), None if not measured."""

    def __str__(self) -> str:
        if self.kept is None:
            verdict = "trial running"
        elif not self.kept and len(self.trial_ms) <= 1:  # nothing else to try
            verdict = "kept the current layout: it is the plan"
        elif self.kept:
            verdict = f"kept the {self.chosen} layout"
        else:
            verdict = "reverted: the current layout measured fastest"
        after = f"{self.measured_after_ms:.3f}" if self.measured_after_ms is not None else "?"
        trial = ", ".join(f"{k} {v:.3f}" for k, v in self.trial_ms.items())
        return (
            f"planned {len(self.layout)} buckets (was {len(self.previous_layout)}) at iteration "
            f"{self.planned_at_iteration}: predicted {self.predicted_finish_ms:.3f} ms vs "
            f"{self.default_finish_ms:.3f} ms; measured {after} ms vs "
            f"{self.measured_before_ms:.3f} ms ({verdict}; trial medians ms: {trial or '-'}"
            f"{f', needed {self.needed_ms:.3f} faster' if self.kept is not None else ''}); "
            f"{'' if self.contention is None else f'contention {self.contention:.2f}, '}"
            f"all-reduce{' under load (saturated CPU host)' if self.saturated else ''} ≈ "
            f"{self.cost.alpha_ms:.3f} ms + {self.cost.beta_ms_per_byte * 2**20:.3f} ms/MiB"
        )


@dataclasses.dataclass
class _Trial:
    """Which candidate each coming iteration runs, and the times measured so far."""

    layouts: dict[str, list[list[int]]]
    schedule: list[str]
    samples: dict[str, list[float]]
    position: int = 0
    running: int | None = None  # reducer iteration the last scheduled slot started


class AutoBuckets:
    """Plan after `warmup` iterations, trial the candidates for `rounds` rounds of `per_slot`
    iterations each, keep the fastest; watch for drift every `drift_every` iterations."""

    def __init__(
        self,
        warmup: int = 3,
        window: int = 2,
        rounds: int = 4,
        per_slot: int = 3,
        margin: float = 0.01,
        drift: float = 0.3,
        drift_every: int = 50,
        max_replans: int = 2,
    ) -> None:
        self.warmup, self.window, self.rounds, self.per_slot = warmup, window, rounds, per_slot
        self.margin, self.drift, self.drift_every, self.max_replans = margin, drift, drift_every, max_replans
        self.saturated: bool | None = None
        """Force the saturated-host model on or off; None: detect it (every rank must agree)."""
        self.plan: BucketPlan | None = None
        self._trial: _Trial | None = None
        self._baseline_ms: float | None = None
        self._watched_at = 0

    def maybe_plan(self, reducer: Reducer) -> None:
        """Call at every synchronised forward, before the reducer prepares the iteration."""
        if self._trial is not None:
            self._advance_trial(reducer, self._trial)
        elif self.plan is None:
            if len(reducer.history) >= self.warmup:
                self._start(reducer)
        elif reducer.iteration - self._watched_at >= self.drift_every:
            self._watch(reducer)

    # --------------------------------------------------------------------------- plan

    def _start(self, reducer: Reducer) -> None:
        ready = self._agreed_ready_ms(reducer)
        buffer = reducer.buckets[0].buffer
        nbytes = [p.numel() * p.element_size() for p in reducer.params]
        contention = self._contention(reducer, sum(nbytes))
        saturated = self.saturated if self.saturated is not None else bool(contention and contention.saturated)
        sizes, timeout = probe_sizes(sum(nbytes)), reducer.config.timeout
        if saturated:
            cost = probe_under_load(reducer.process_group, buffer.dtype, sizes, timeout=timeout).cost
        elif buffer.device.type == "cpu":  # collectives overlap, but need the busy cores: priced queued during compute
            cost = probe_during_compute(reducer.process_group, buffer.dtype, sizes, timeout=timeout)
        else:  # on a GPU they run on the device's own engines
            cost = probe_cost_model(reducer.process_group, buffer.dtype, buffer.device, sizes)
        current = reducer.bucket_indices
        one = _plan(reducer, ready, nbytes, CostModel(1e9, 0.0))  # one per dtype/device
        planned = one if saturated else _plan(reducer, ready, nbytes, cost)
        before = _agreed_max(reducer, [_median_total_ms(list(reducer.history)[-self.window :])])[0]
        self.plan = BucketPlan(
            planned, cost, predict_finish_ms(ready, nbytes, planned, cost, saturated),
            predict_finish_ms(ready, nbytes, current, cost, saturated), reducer.iteration, current, before,
            replans=self.plan.replans + 1 if self.plan is not None else 0, saturated=saturated,
            contention=contention.share if contention is not None else None,
        )
        layouts = {CURRENT: current}
        # On a saturated host an overlapping plan is what the measured model rules out: only
        # the plan (one bucket) is tried against the current layout.
        others = [(PLANNED, planned)]
        if not saturated:
            # A latency ladder: a short probe of a matrix-product loop is not backward, and on
            # the emulated 2 Gbit/s hosts the plan at four times the probed latency beat the plan
            # itself in every trial (153 against 169 ms, 113 against 118).
            others += [(name, _plan(reducer, ready, nbytes, CostModel(cost.alpha_ms * k, cost.beta_ms_per_byte)))
                       for name, k in ((COARSE, 4), (COARSER, 16))] + [(ONE, one)]
        for name, layout in others:
            if all(layout != other for other in layouts.values()):
                layouts[name] = layout
        names = list(layouts)
        schedule = []
        for r in range(self.rounds):  # rotate the order each round: no candidate always first
            for name in names[r % len(names) :] + names[: r % len(names)]:
                schedule += [name] * self.per_slot
        self._trial = _Trial(layouts, schedule, {name: [] for name in names})
        log.info("rank %d: %s", reducer.rank, self.plan)
        self._advance_trial(reducer, self._trial)

    def _advance_trial(self, reducer: Reducer, trial: _Trial) -> None:
        pos = trial.position
        if trial.running is not None:
            finished = reducer.history[-1].iteration if reducer.history else -1
            if finished != trial.running:  # a forward without backward: run the slot again
                trial.running = reducer.iteration + 1
                return
            opened_slot = pos == 1 or trial.schedule[pos - 2] != trial.schedule[pos - 1]
            if not opened_slot or self.per_slot == 1:  # a slot's first paid for the switch
                trial.samples[trial.schedule[pos - 1]].append(_total_ms(reducer.history[-1]))
        if pos == len(trial.schedule):
            self._decide(reducer, trial)
            return
        if pos == 0 or trial.schedule[pos] != trial.schedule[pos - 1]:
            reducer.install_layout(trial.layouts[trial.schedule[pos]])
        trial.position = pos + 1
        trial.running = reducer.iteration + 1  # the iteration this forward prepares

    def _decide(self, reducer: Reducer, trial: _Trial) -> None:
        names = list(trial.samples)
        agreed = _agreed_max(reducer, [statistics.median(trial.samples[n]) for n in names]
                             + [_spread_ms(trial.samples[n]) for n in names])
        medians, spreads = dict(zip(names, agreed)), dict(zip(names, agreed[len(names):]))
        best, needed = choose_layout(medians, spreads, self.margin)
        reducer.install_layout(trial.layouts[best])
        assert self.plan is not None
        self.plan = dataclasses.replace(
            self.plan, measured_before_ms=medians[CURRENT], measured_after_ms=medians[best],
            kept=best != CURRENT, trial_ms=medians, chosen=best, needed_ms=needed,
        )
        self._trial, self._baseline_ms = None, None
        self._watched_at = reducer.iteration
        log.info("rank %d: %s", reducer.rank, self.plan)

    def _watch(self, reducer: Reducer) -> None:
        """Set the steady-state time after a decision; replan if it later drifts far from it."""
        self._watched_at = reducer.iteration
        now = _agreed_max(reducer, [_median_total_ms(list(reducer.history)[-8:])])[0]
        if self._baseline_ms is None:
            self._baseline_ms = now
            return
        ratio = now / self._baseline_ms if self._baseline_ms > 0 else 1.0
        assert self.plan is not None
        if abs(ratio - 1) > self.drift and self.plan.replans < self.max_replans:
            log.info("rank %d: step time drifted x%.2f since the plan; planning again", reducer.rank, ratio)
            self._start(reducer)

    def _contention(self, reducer: Reducer, nbytes: int) -> Contention | None:
        """Measured, not guessed from host names and core counts: does an all-reduce of about
        the gradients' size hide behind compute, or take turns with it for the cores (gloo on
        a CPU whose cores all compute)? Agreed, so all ranks plan alike. Not measured on a GPU
        (its collectives do not run on the host's cores) or when `saturated` is forced."""
        if self.saturated is not None or reducer.buckets[0].buffer.device.type != "cpu":
            return None
        size = min(max(nbytes, 1 << 20), 16 << 20)
        return measure_contention(reducer.process_group, size, timeout=reducer.config.timeout)

    def _agreed_ready_ms(self, reducer: Reducer) -> list[float]:
        recent = list(reducer.history)[-self.window :]
        per_param: list[list[float]] = [[] for _ in reducer.params]
        for tl in recent:
            for t, kind, i in tl.events:
                if kind in (EventKind.READY, EventKind.UNUSED):
                    per_param[i].append((t - tl.start_ns) * 1e-6)
        return _agreed_max(reducer, [statistics.median(v) if v else 0.0 for v in per_param])


def _plan(reducer: Reducer, ready: list[float], nbytes: list[int], cost: CostModel) -> list[list[int]]:
    order = sorted(range(len(ready)), key=lambda i: (ready[i], i))
    keys = [
        ("sparse", i) if reducer.expect_sparse_gradient[i] else (p.dtype, p.device)
        for i, p in enumerate(reducer.params)
    ]
    positions = plan_buckets(
        [ready[i] for i in order], [nbytes[i] for i in order], cost, [keys[i] for i in order]
    )
    return [[order[p] for p in bucket] for bucket in positions]


def choose_layout(medians: dict[str, float], spreads: dict[str, float], margin: float) -> tuple[str, float]:
    """The trial's verdict: the fastest candidate, if it beat the current layout by more than
    `margin` of it and by more than the trial's noise (the mean of the two candidates' spreads,
    `_spread_ms`); else the current layout. Also returns how many ms faster it had to be.

    Without the noise term a trial of a few steps on a noisy host keeps layouts that only drew
    lucky samples (measured: 3 buckets kept at 24.4 against 25.5 ms, IQRs of 6 ms, and the
    whole step 12 % slower than before)."""
    best = min(medians, key=lambda n: medians[n])
    needed = max(margin * medians[CURRENT], (spreads[best] + spreads[CURRENT]) / 2)
    return (best if medians[CURRENT] - medians[best] > needed else CURRENT), needed


def _spread_ms(samples: list[float]) -> float:
    """Half the interquartile range: about the standard error of a difference between two
    medians of the trial's 6-12 samples (0 below 4 samples)."""
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / 2


def _total_ms(timeline: IterationTimeline) -> float:
    return (timeline.finish_ns - timeline.start_ns) * 1e-6 if timeline.finish_ns else 0.0


def _median_total_ms(timelines: list) -> float:
    totals = [_total_ms(t) for t in timelines if t.finish_ns]
    return statistics.median(totals) if totals else 0.0


def _agreed_max(reducer: Reducer, values: list[float]) -> list[float]:
    """Each value's maximum over the ranks: the same inputs, hence the same decisions, everywhere."""
    agreed = torch.tensor(values, dtype=torch.float64, device=reducer.buckets[0].buffer.device)
    return all_reduce(reducer.process_group, agreed, dist.ReduceOp.MAX, "agreement on measured timings").tolist()
