"""`bucket_cap_mb="auto"`: measure, plan, try the plan against the current layout, keep the faster.

1. After `warmup` synchronised iterations (the first rebuild included) every rank plans from the
   same inputs: per-parameter ready times are all-reduced (the slowest rank's, since it decides
   when a bucket can go) and the cost model is agreed in the probe, so the deterministic planner
   gives every rank the same layout without sending the layout itself. Up to nine candidates
   come out: the plan under the probed cost, coarser ones under 4, 16 and 64 times its latency
   (the probe is short and backward is not a matrix-product loop), each of those four's even
   twin (as many buckets, of equal bytes: backward stretches once buckets overlap it, so the
   measured ready times that placed the boundaries no longer hold), and one bucket (per dtype
   and device: no overlap, fewest collectives).
2. A trial interleaves the candidates with the current layout, round after round, a few
   iterations each (the first after a switch is not counted). Training goes on meanwhile: a
   layout changes where gradients are summed, never what is summed. Each candidate is scored
   by its time relative to the current layout's in the same round (paired: a round's load on
   a shared host is common to both), the median over rounds.
3. The best-scoring candidate, if any beat the current layout, is confirmed on fresh
   iterations, alone against the current layout, for `confirm_rounds` rounds (three times the
   screening's: a median of four ratios let one run of bad rounds revert a layout that every
   fixed cap near it beat torch's DDP with; figures in
   docs/benchmarks/design-figures.md#confirmation-rounds); it is installed only if it is
   faster there by more than `margin` and the noise of its ratio (`confirm_layout`). The best
   of several noisy scores is flattered by its own luck (a winner's lead in its own rounds
   shrank in the steps that followed; figures in
   docs/benchmarks/design-figures.md#trial-winners-curse), so the keep-or-revert decision is
   never made on the samples that chose the winner.
4. With an optimizer stepped per bucket as each lands (`overlap_optimizer`: buckets land in
   the next forward, `Reducer.lands_lazily`), a trial times whole steps, from a synchronised
   forward (which waits for the last step's buckets) to the return of its backward, since the
   end of backward no longer waits for the buckets; the time between steps is left out, and a
   step after a pause longer than itself is not counted (its forward found everything landed,
   which flatters a tail that leaves more in flight; `after_pause`). Once the
   layout is decided, a second trial of the same form (screen, then confirm) picks how much
   of the communication tail goes first and in what chunks (`Reducer.send_tail_first`):
   the tail as set, none, half and three quarters of the gradients (where the link cannot
   carry them during backward), chunks four times as large, and one chunk reducing at a time
   (a credit of bytes in flight).
5. Afterwards the step time is watched; if it drifts by more than `drift` from what it was
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
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..engine.collectives import all_reduce
from ..engine.config import ReducerConfig
from ..engine.reducer import Reducer
from ..engine.timeline import EventKind, IterationTimeline
from ..observability.log import log
from .planner import (
    Contention,
    CostModel,
    even_split,
    measure_contention,
    plan_buckets,
    predict_finish_ms,
    probe_cost_model,
    probe_during_compute,
    probe_sizes,
    probe_under_load,
)

__all__ = ["AutoBuckets", "BucketPlan", "after_pause", "agreed_max", "confirm_layout",
           "screen_layouts"]

CURRENT, PLANNED, ONE = "current", "planned", "one bucket"
LADDER = (("coarse", 4), ("coarser", 16), ("coarsest", 64))
"""Coarser candidates: the plan under this many times the probed latency."""
EVEN = "even "
"""Prefix of each plan's twin: as many buckets, of equal bytes (`planner.even_split`)."""


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
    trial_ratio: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each candidate's score in the trial: the median over rounds of its time over the
    current layout's in the same round."""
    confirmed_ratio: float | None = None
    """The trial's winner against the current layout on fresh iterations (None if no
    candidate scored better than the current layout, so nothing was confirmed)."""
    winner: str | None = None
    """The candidate that scored best in the trial, if any beat the current layout."""
    chosen: str | None = None
    replans: int = 0
    """How many times timings drifted and the plan was made again before this one."""
    saturated: bool = False
    """Planned for a saturated CPU host: cost probed under load, nothing overlapping."""
    needed: float = 0.0
    """How far below 1 the confirmed ratio had to be for the winner to be kept: the margin
    or the noise of that ratio, whichever is larger (`confirm_layout`)."""
    contention: float | None = None
    """The measured share of an all-reduce that competes with compute (0: hides entirely,
    1: takes turns with it; `planner.measure_contention`), None if not measured."""
    tail: tuple[int, ...] | None = None
    """With buckets landing in the next forward (`overlap_optimizer`): the (tail, chunk,
    credit) bytes the tail trial chose (`Reducer.send_tail_first`; a plan saved before the
    credit has two); None: not tried (yet). `tail_settings` reads either."""
    tail_trial_ratio: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each tail candidate's score against the tail as set, as `trial_ratio`."""
    tail_confirmed_ratio: float | None = None
    """The tail trial's winner against the tail as set on fresh iterations, as
    `confirmed_ratio`."""

    @property
    def tail_settings(self) -> tuple[int, int, int] | None:
        """`tail` as (tail, chunk, credit) bytes (no credit in a plan saved before it)."""
        if self.tail is None:
            return None
        tail, chunk, credit = (*self.tail, 0)[:3]
        return tail, chunk, credit

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
        ratios = ", ".join(f"{k} x{v:.3f}" for k, v in self.trial_ratio.items())
        confirmed = ("" if self.confirmed_ratio is None else
                     f"; the {self.winner} layout confirmed at x{self.confirmed_ratio:.3f} "
                     f"(needed below x{1 - self.needed:.3f})")
        tails = ", ".join(f"{k} x{v:.3f}" for k, v in self.tail_trial_ratio.items())
        confirmed_tail = ("" if self.tail_confirmed_ratio is None else
                          f"; the winner confirmed at x{self.tail_confirmed_ratio:.3f}")
        tail = ""
        if (settings := self.tail_settings) is not None:
            credit = (f", {settings[2] / 2**20:.3g} MiB of them in flight" if settings[2]
                      else "")
            tail = (f"; tail {settings[0] / 2**20:.3g} MiB in chunks of "
                    f"{settings[1] / 2**20:.3g} MiB{credit} (tails against the one set: "
                    f"{tails or '-'}{confirmed_tail})")
        return (
            f"planned {len(self.layout)} buckets (was {len(self.previous_layout)}) at iteration "
            f"{self.planned_at_iteration}: predicted {self.predicted_finish_ms:.3f} ms vs "
            f"{self.default_finish_ms:.3f} ms; measured {after} ms vs "
            f"{self.measured_before_ms:.3f} ms ({verdict}; trial medians ms: {trial or '-'}; "
            f"against the current layout: {ratios or '-'}{confirmed}); "
            f"{'' if self.contention is None else f'contention {self.contention:.2f}, '}"
            f"all-reduce{' under load (saturated CPU host)' if self.saturated else ''} ≈ "
            f"{self.cost.alpha_ms:.3f} ms + {self.cost.beta_ms_per_byte * 2**20:.3f} ms/MiB"
            f"{tail}"
        )


@dataclasses.dataclass
class _Trial:
    """Which layout (or tail) each coming iteration runs (round, name), and the times measured
    so far."""

    layouts: dict[str, Any]  # name -> a layout, or a tail trial's (tail, chunk, credit) bytes
    schedule: list[tuple[int, str]]
    samples: dict[tuple[int, str], list[float]]
    confirming: str | None = None  # the screening's winner, now alone against the current layout
    screened: dict[tuple[int, str], float] | None = None  # the screening's agreed slot times
    position: int = 0
    running: int | None = None  # reducer iteration the last scheduled slot started
    base: list[list[int]] | None = None  # a tail trial: the layout each tail is cut from

    @classmethod
    def of(
        cls, layouts: dict[str, Any], rounds: int, per_slot: int, **kw: object
    ) -> _Trial:
        """Every layout `per_slot` iterations a round, the order rotated each round (no
        layout always first)."""
        names, schedule = list(layouts), []
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                schedule += [(r, name)] * per_slot
        return cls(layouts, schedule, {slot: [] for slot in dict.fromkeys(schedule)}, **kw)  # type: ignore[arg-type]


class AutoBuckets:
    """Plan after `warmup` iterations, trial the candidates for `rounds` rounds of `per_slot`
    iterations each, confirm the winner for `confirm_rounds` more, keep the fastest; watch for
    drift every `drift_every` iterations."""

    def __init__(
        self,
        warmup: int = 3,
        window: int = 2,
        rounds: int = 4,
        per_slot: int = 3,
        confirm_rounds: int = 12,
        margin: float = 0.01,
        drift: float = 0.3,
        drift_every: int = 50,
        max_replans: int = 2,
    ) -> None:
        self.warmup, self.window, self.rounds, self.per_slot = warmup, window, rounds, per_slot
        self.confirm_rounds = confirm_rounds
        self.margin, self.drift, self.drift_every, self.max_replans = (
            margin,
            drift,
            drift_every,
            max_replans,
        )
        self.saturated: bool | None = None
        """Force the saturated-host model on or off; None: detect it (every rank must agree)."""
        self.cost: CostModel | None = None
        """Force the all-reduce cost model (a link whose cost is known); None: probe it. Every
        rank must set the same."""
        self.plan: BucketPlan | None = None
        self._trial: _Trial | None = None
        self._baseline_ms: float | None = None
        self._watched_at = 0
        self._forward_ns = 0  # when the trial last saw a synchronised forward (host clock)

    @property
    def decided_by(self) -> int:
        """Iterations by which the first plan is decided, at most: the warm-up, the screening
        (the current layout, the plan, the ladder and one bucket each round), the confirmation
        (two layouts a round), the decision."""
        # current, plan, ladder, one; the plans' even twins
        layouts = 3 + len(LADDER) + 1 + len(LADDER)
        return self.warmup + (self.rounds * layouts + self.confirm_rounds * 2) * self.per_slot + 1

    @property
    def tail_decided_by(self) -> int:
        """Iterations by which the first plan and its tail are decided, at most, with buckets
        landing in the next forward (`overlap_optimizer`): the tail trial follows the layout's
        (the tail as set, none, half and three quarters of the gradients, larger chunks, a
        credit; then the confirmation)."""
        tails = 6
        return self.decided_by + (self.rounds * tails + self.confirm_rounds * 2) * self.per_slot + 1

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
        """Plan from the warm-up's timings (and replan after drift): price the all-reduce,
        draw the plan, then start the trial of it against the current layout."""
        ready = self._agreed_ready_ms(reducer)
        nbytes = [p.numel() * p.element_size() for p in reducer.params]
        contention = self._contention(reducer, sum(nbytes))
        saturated = (
            self.saturated
            if self.saturated is not None
            else bool(contention and contention.saturated)
        )
        cost = self._cost_model(reducer, sum(nbytes), saturated)
        current = reducer.bucket_indices
        one = _plan(reducer, ready, nbytes, CostModel(1e9, 0.0))  # one per dtype/device
        planned = one if saturated else _plan(reducer, ready, nbytes, cost)
        before = agreed_max(reducer, [_median_total_ms(list(reducer.history)[-self.window :])])[0]
        self.plan = BucketPlan(
            planned,
            cost,
            predict_finish_ms(ready, nbytes, planned, cost, saturated),
            predict_finish_ms(ready, nbytes, current, cost, saturated),
            reducer.iteration,
            current,
            before,
            replans=self.plan.replans + 1 if self.plan is not None else 0,
            saturated=saturated,
            contention=contention.share if contention is not None else None,
        )
        layouts = _trial_layouts(reducer, ready, nbytes, cost, saturated, current, planned, one)
        self._trial = _Trial.of(layouts, self.rounds, self.per_slot)
        log.info("rank %d: %s", reducer.rank, self.plan)
        self._advance_trial(reducer, self._trial)

    def _cost_model(self, reducer: Reducer, total_bytes: int, saturated: bool) -> CostModel:
        """The all-reduce's cost as it will be paid during backward: forced, or probed the way
        collectives meet compute on this host (under load, queued during compute, or idle)."""
        buffer = reducer.buckets[0].buffer
        sizes, timeout = probe_sizes(total_bytes), reducer.config.timeout
        if self.cost is not None:
            return self.cost
        if saturated:
            return probe_under_load(
                reducer.process_group, buffer.dtype, sizes, timeout=timeout
            ).cost
        # collectives overlap, but need the busy cores: priced queued during compute
        if buffer.device.type == "cpu":
            return probe_during_compute(reducer.process_group, buffer.dtype, sizes, timeout=timeout)
        # on a GPU they run on the device's own engines
        return probe_cost_model(reducer.process_group, buffer.dtype, buffer.device, sizes)

    def _advance_trial(self, reducer: Reducer, trial: _Trial) -> None:
        pos = trial.position
        # Landing in this forward, the last iteration has used every bucket by now: finish it.
        reducer.land()
        now, since = time.perf_counter_ns(), self._forward_ns
        self._forward_ns = now
        if trial.running is not None:
            finished = reducer.history[-1].iteration if reducer.history else -1
            if finished != trial.running:  # a forward without backward: run the slot again
                trial.running = reducer.iteration + 1
                return
            switched = pos == 1 or trial.schedule[pos - 2][1] != trial.schedule[pos - 1][1]
            if not switched or self.per_slot == 1:  # the first after a switch paid for it
                # Buckets landing in the next forward: the step (its forward, which waits for
                # the last step's buckets, to its backward's return) is what a layout or a tail
                # changes; otherwise until the last bucket is written back.
                last = reducer.history[-1]
                ms = (_step_ms(last, (now - since) * 1e-6) if reducer.lands_lazily
                      else _total_ms(last))
                if not (reducer.lands_lazily and after_pause(reducer.history, ms)):
                    trial.samples[trial.schedule[pos - 1]].append(ms)
        if pos == len(trial.schedule):
            if trial.confirming is None:
                self._screened(reducer, trial)
            else:
                self._decide(reducer, trial)
            return
        if pos == 0 or trial.schedule[pos][1] != trial.schedule[pos - 1][1]:
            _apply(reducer, trial, trial.schedule[pos][1])
        trial.position = pos + 1
        trial.running = reducer.iteration + 1  # the iteration this forward prepares

    def _screened(self, reducer: Reducer, trial: _Trial) -> None:
        """Screening done: confirm its winner on fresh rounds, or decide if none beat the
        current layout."""
        slots = _agreed_slots(reducer, trial)
        scores = {
            name: _median_or_inf(_round_ratios(slots, name))
            for name in trial.layouts
            if name != CURRENT
        }
        winner = screen_layouts(scores, self.margin)
        assert self.plan is not None
        if trial.base is not None:
            self.plan = dataclasses.replace(self.plan, tail_trial_ratio=scores)
        else:
            self.plan = dataclasses.replace(
                self.plan,
                trial_ms=_medians(slots, list(trial.layouts)),
                trial_ratio=scores,
                winner=None if winner == CURRENT else winner,
            )
        if winner == CURRENT:
            self._decide(reducer, dataclasses.replace(trial, screened=slots))
            return
        layouts = {CURRENT: trial.layouts[CURRENT], winner: trial.layouts[winner]}
        self._trial = _Trial.of(
            layouts, self.confirm_rounds, self.per_slot, confirming=winner, screened=slots,
            base=trial.base,
        )
        log.info("rank %d: confirming the %s %s (x%.3f in the trial) against the current one",
                 reducer.rank, winner, "tail" if trial.base else "layout", scores[winner])
        self._advance_trial(reducer, self._trial)

    def _decide(self, reducer: Reducer, trial: _Trial) -> None:
        assert self.plan is not None and trial.screened is not None
        best, fresh, needed = CURRENT, None, 0.0
        if trial.confirming is not None:
            slots = _agreed_slots(reducer, trial)
            fresh = _round_ratios(slots, trial.confirming)
            tried = self.plan.tail_trial_ratio if trial.base else self.plan.trial_ratio
            screened = {n: _round_ratios(trial.screened, n) for n in tried}
            keep, needed = confirm_layout(fresh, [*screened.values(), fresh], self.margin)
            best = trial.confirming if keep else CURRENT
            after = _medians(slots, [best])[best]
        else:
            after = _medians(trial.screened, [CURRENT])[CURRENT] if trial.base else (
                self.plan.trial_ms[CURRENT])
        _apply(reducer, trial, best)
        confirmed = None if fresh is None else _median_or_inf(fresh)
        if trial.base:
            self.plan = dataclasses.replace(self.plan, tail=trial.layouts[best],
                                            tail_confirmed_ratio=confirmed)
            self._end_trial(reducer)
            return
        self.plan = dataclasses.replace(
            self.plan, measured_before_ms=self.plan.trial_ms[CURRENT], measured_after_ms=after,
            kept=best != CURRENT, chosen=best, needed=needed, confirmed_ratio=confirmed,
        )
        total = sum(p.numel() * p.element_size() for p in reducer.params)
        tails = _tail_candidates(reducer.config, total) if reducer.lands_lazily else {}
        if len(tails) > 1:  # the layout decided; now the tail on it
            log.info("rank %d: %s; trying tails", reducer.rank, self.plan)
            self._trial = _Trial.of(tails, self.rounds, self.per_slot,
                                    base=[list(b) for b in trial.layouts[best]])
            self._advance_trial(reducer, self._trial)
            return
        self._end_trial(reducer)

    def _end_trial(self, reducer: Reducer) -> None:
        self._trial, self._baseline_ms = None, None
        self._watched_at = reducer.iteration
        log.info("rank %d: %s", reducer.rank, self.plan)

    def _watch(self, reducer: Reducer) -> None:
        """Set the steady-state time after a decision; replan if it later drifts far from it."""
        self._watched_at = reducer.iteration
        now = agreed_max(reducer, [_median_total_ms(list(reducer.history)[-8:])])[0]
        if self._baseline_ms is None:
            self._baseline_ms = now
            return
        ratio = now / self._baseline_ms if self._baseline_ms > 0 else 1.0
        assert self.plan is not None
        if abs(ratio - 1) > self.drift and self.plan.replans < self.max_replans:
            log.info(
                "rank %d: step time drifted x%.2f since the plan; planning again",
                reducer.rank,
                ratio,
            )
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
        # On a GPU each gradient is timed on sampled iterations only; the others know a
        # gradient's time to its bucket's, too coarse to plan buckets by.
        recent = [tl for tl in recent if tl.gradients_timed] or recent
        per_param: list[list[float]] = [[] for _ in reducer.params]
        for tl in recent:
            for t, kind, i in tl.events:
                if kind in (EventKind.READY, EventKind.UNUSED):
                    per_param[i].append((t - tl.start_ns) * 1e-6)
        return agreed_max(reducer, [statistics.median(v) if v else 0.0 for v in per_param])


def _trial_layouts(
    reducer: Reducer, ready: list[float], nbytes: list[int], cost: CostModel, saturated: bool,
    current: list[list[int]], planned: list[list[int]], one: list[list[int]],
) -> dict[str, list[list[int]]]:
    """The layouts the trial screens, by name: the current one first, then each candidate
    that differs from every layout already in."""
    layouts = {CURRENT: current}
    # On a saturated host an overlapping plan is what the measured model rules out: only
    # the plan (one bucket) is tried against the current layout.
    others = [(PLANNED, planned)]
    if not saturated:
        # A latency ladder: a short probe of a matrix-product loop is not backward, and on
        # the emulated hosts coarser plans than the probed cost's ran faster
        # (figures: docs/benchmarks/design-figures.md#latency-ladder).
        others += [
            (
                name,
                _plan(reducer, ready, nbytes, CostModel(cost.alpha_ms * k, cost.beta_ms_per_byte)),
            )
            for name, k in LADDER
        ]
        # Each plan's even twin: the ready times it is drawn from are measured before any
        # bucket overlaps, and backward stretches once they do, so its boundaries (small
        # buckets first, a large one last, whose all-reduce is then the tail after
        # backward) fit a profile that no longer holds. In trials on the emulated hosts the
        # twins ran faster (figures: docs/benchmarks/design-figures.md#even-twins).
        others += [
            (EVEN + name, _even(reducer, ready, nbytes, len(layout)))
            for name, layout in others
            if len(layout) > 1
        ] + [(ONE, one)]
    for name, layout in others:
        if all(layout != other for other in layouts.values()):
            layouts[name] = layout
    return layouts


def _apply(reducer: Reducer, trial: _Trial, name: str) -> None:
    """Run the coming iterations with candidate `name`: a layout, or a tail cut from the
    trial's base layout."""
    if trial.base is None:
        reducer.install_layout(trial.layouts[name])
    else:
        tail, chunk, credit = trial.layouts[name]
        reducer.send_tail_first(tail, chunk, layout=trial.base, credit=credit)


def _tail_candidates(config: ReducerConfig, total: int) -> dict[str, tuple[int, int, int]]:
    """The tails a trial tries, by name: the one set first, then none, half and three quarters
    of the `total` bytes of gradients, chunks four times as large, and one chunk reducing at a
    time (a credit of one chunk; the whole tail at once if one was set); each that differs from
    those already in.

    The fractions are for a link slower than backward: what it cannot carry before backward
    ends is better held and sent nearest the input first, so the next forward starts on the
    first chunk instead of behind every bucket queued before it (the cluster's 64 MiB MLP with
    three quarters held: 0.86-0.94 of torch's DDP's step, with the 4 MiB tail 0.95-1.01; a
    compute-bound GPT the other way; docs/benchmarks/2026-12-07-overlap-tails.md). Half and
    twice the set tail lost to it on every cluster model (2026-12-06-overlap-buckets.md): they
    are no longer tried."""
    tail, chunk, credit = config.priority_tail_bytes, config.chunk_bytes, config.credit_bytes
    candidates = {CURRENT: (tail, chunk, credit)}
    if tail > 0:
        for name, choice in (("no tail", (0, chunk, 0)),
                             ("half the gradients", (max(total // 2, tail), chunk, credit)),
                             ("three quarters of the gradients",
                              (max(total * 3 // 4, tail), chunk, credit)),
                             ("chunks x4", (tail, 4 * chunk, credit and 4 * credit)),
                             ("one chunk in flight" if not credit else "no credit",
                              (tail, chunk, 0 if credit else chunk))):
            if choice not in candidates.values():
                candidates[name] = choice
    return candidates


def _plan(
    reducer: Reducer, ready: list[float], nbytes: list[int], cost: CostModel
) -> list[list[int]]:
    return _in_ready_order(reducer, ready, nbytes, lambda r, b, k: plan_buckets(r, b, cost, k))


def _even(reducer: Reducer, ready: list[float], nbytes: list[int], count: int) -> list[list[int]]:
    return _in_ready_order(reducer, ready, nbytes, lambda _r, b, k: even_split(b, count, k))


def _in_ready_order(
    reducer: Reducer, ready: list[float], nbytes: list[int], split: Callable
) -> list[list[int]]:
    """`split(ready, nbytes, groups)`, all in ready order, as parameter indices."""
    order = sorted(range(len(ready)), key=lambda i: (ready[i], i))
    keys = [
        ("sparse", i) if reducer.expect_sparse_gradient[i] else (p.dtype, p.device)
        for i, p in enumerate(reducer.params)
    ]
    positions = split(
        [ready[i] for i in order], [nbytes[i] for i in order], [keys[i] for i in order]
    )
    return [[order[p] for p in bucket] for bucket in positions]


def screen_layouts(scores: dict[str, float], margin: float) -> str:
    """The trial's winner: the candidate with the lowest score (time over the current
    layout's), if below 1 - `margin`; else the current layout (nothing to confirm)."""
    if not scores:
        return CURRENT
    best = min(scores, key=lambda n: scores[n])
    return best if scores[best] < 1 - margin else CURRENT


def confirm_layout(
    fresh: list[float], every: list[list[float]], margin: float
) -> tuple[bool, float]:
    """Keep the winner if its median ratio on the fresh rounds is below 1 by more than
    `margin` and by more than that median's noise. Also returns that bar.

    The noise is the standard error of a median of `len(fresh)` ratios, from how far every
    candidate's ratios (`every`: the screening's per candidate, and the fresh ones) scatter
    about their own median: pooled, so a few rounds give a steady figure, and about each
    candidate's own median, so the winner's lucky screening does not count as scatter.

    Without the noise term a trial of a few steps on a noisy host keeps layouts that only drew
    lucky samples, and the step gets slower
    (figures: docs/benchmarks/design-figures.md#confirmation-noise-term)."""
    scatter = [r - statistics.median(rs) for rs in every if rs for r in rs]
    needed = max(margin, _median_error(scatter, len(fresh)))
    return _median_or_inf(fresh) < 1 - needed, needed


def _median_error(deviations: list[float], n: int) -> float:
    """The standard error of a median of `n` draws whose deviations from their centre look
    like `deviations`: 1.2533 sigma / sqrt(n), sigma from the median absolute deviation
    (x 1.4826, a normal's). 0 below 4 deviations: too few to say."""
    if len(deviations) < 4 or n < 1:
        return 0.0
    sigma = 1.4826 * statistics.median(abs(d) for d in deviations)
    return 1.2533 * sigma / n**0.5


def _agreed_slots(reducer: Reducer, trial: _Trial) -> dict[tuple[int, str], float]:
    """Each slot's mean time, the slowest rank's (0 where a slot measured nothing): the same
    numbers on every rank, in the schedule's order, so every rank decides alike."""
    slots = list(trial.samples)
    means = [statistics.fmean(trial.samples[s]) if trial.samples[s] else 0.0 for s in slots]
    return dict(zip(slots, agreed_max(reducer, means)))


def _round_ratios(slots: dict[tuple[int, str], float], name: str) -> list[float]:
    """`name`'s time over the current layout's, round by round (rounds missing either skipped)."""
    rounds = sorted({r for r, _ in slots})
    return [slots[(r, name)] / slots[(r, CURRENT)] for r in rounds
            if slots.get((r, name), 0.0) > 0 and slots.get((r, CURRENT), 0.0) > 0]


def _medians(slots: dict[tuple[int, str], float], names: list[str]) -> dict[str, float]:
    return {
        n: statistics.median([v for (_, m), v in slots.items() if m == n and v > 0] or [0.0])
        for n in names
    }


def _median_or_inf(values: list[float]) -> float:
    return statistics.median(values) if values else float("inf")


def _step_ms(timeline: IterationTimeline, forward_to_forward_ms: float) -> float:
    """With buckets landing in the next forward: from the iteration's forward to the return of
    its backward (`IterationTimeline.backward_returned_ns`), leaving out the time between
    steps (a data loader, another model trained in turn) that forward to forward counts."""
    if timeline.forward_start_ns and timeline.backward_returned_ns:
        return (timeline.backward_returned_ns - timeline.forward_start_ns) * 1e-6
    return forward_to_forward_ms


def after_pause(history: Sequence[IterationTimeline], step_ms: float) -> bool:
    """Whether the last step's forward came after a pause longer than the step (another model
    trained in turn, an evaluation): the step before it had landed in the pause, so its forward
    waited for nothing, and a tail that leaves more in flight would look faster than it is."""
    if len(history) < 2 or not history[-2].backward_returned_ns:
        return False
    return (history[-1].forward_start_ns - history[-2].backward_returned_ns) * 1e-6 > step_ms


def _total_ms(timeline: IterationTimeline) -> float:
    return (timeline.finish_ns - timeline.start_ns) * 1e-6 if timeline.finish_ns else 0.0


def _median_total_ms(timelines: list) -> float:
    totals = [_total_ms(t) for t in timelines if t.finish_ns]
    return statistics.median(totals) if totals else 0.0


def agreed_max(reducer: Reducer, values: list[float]) -> list[float]:
    """Each value's maximum over the ranks: the same inputs, hence the same decisions,
    everywhere."""
    agreed = torch.tensor(values, dtype=torch.float64, device=reducer.buckets[0].buffer.device)
    what = ("agreement on measured timings (bucket_cap_mb='auto', or overlap_optimizer's "
            "measured tail)")
    return all_reduce(
        reducer.process_group, agreed, dist.ReduceOp.MAX, what, reducer.config.timeout
    ).tolist()
