"""Predict step time at scale from one measured timing profile, with the planner's model.

A *profile* is what one real run measured (`DistributedDataParallel.save_timing_profile`): the
forward time, each gradient's ready time after forward and its size, in ready order. A *network*
is a bandwidth, a latency and an all-reduce algorithm. For each rank count the simulator prices
an all-reduce of M bytes as

* ring: 2(N-1)·latency + 2(N-1)/N · M / bandwidth
* tree: 2·ceil(log2 N)·latency + 2 · M / bandwidth

and replays backward: buckets launch in order as they fill, one collective at a time. Three
layouts are compared: torch's default (1 MiB first bucket, then 25 MiB, in ready order), the
planned one (`plan_buckets` under that N's cost) and no overlap (one all-reduce after backward).

A *host* says how ranks share machines: with more ranks on a host than it has cores (CPU
training, or this project's 2-core test machine), compute stretches by ranks/cores, relative to
the ranks per host the profile was recorded with.

A host whose cores all run a rank's compute, with collectives on the CPU too (gloo), is
*saturated*: communication takes its time from compute instead of hiding behind it, and waits
for the scheduler. Neither the network formula nor a fair-share stretch prices that well
(figures: docs/benchmarks/design-figures.md#saturated-host-pricing), so such a host is better
described by measurement: `planner.probe_under_load` at each rank count gives what one
all-reduce adds to a step while the ranks compute, and how a synchronised step stretches
beyond its compute. Given probes for
the profile's rank count and the predicted one, the step is the profile's compute, stretched as
the probe's step is, plus every bucket's cost under load (one bucket is then the best plan).
Record the profile with a core per rank: under oversubscription a rank's own timings already
hold part of the stretch, unevenly.

Short of saturation, a collective in flight can still take part of the cores: gloo's copies and
reductions, and the kernel's network stack, which on an emulated cluster (network namespaces on
one machine's cores) moves every byte of every link on those cores. `Host.comm_cores_per_gbps`
says how much: cores per GB/s of link bandwidth on each host. While a collective runs, compute
gets what is left of the cores, shared fairly among the host's ranks (`Host.contention`), and
backward slows by that share. The replay follows it (a collective in flight delays the gradients
computed meanwhile, and so later launches), and the planned layout is the best, so replayed, of
the planner's plans under the network's latency and under coarser ones (fewer collectives).
Measured as `planner.measure_contention`'s share (an all-reduce alone, a compute loop alone, both
at once) and turned into cores per GB/s by `Host.with_contention`.

The replay also charges the reducer's own work where the profile recorded it: a bucket's
gradients copied into it between its last gradient and its launch, on the backward thread
(`Profile.fill_ms_per_byte`), and the step's end after the last all-reduce, gradients written
back (`Profile.tail_ms`). Both are compute, and stretch like it; the saturated path leaves them
to the probes under load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.bucketing import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES
from ..engine.timeline import EventKind

if TYPE_CHECKING:
    from ..engine.reducer import Reducer
from .planner import CostModel, LoadProbe, plan_buckets, predict_finish_ms

__all__ = ["Host", "Network", "Profile", "Prediction", "simulate", "default_layout"]


@dataclasses.dataclass(frozen=True)
class Profile:
    """Measured timings of one iteration (medians), gradients in ready order."""

    forward_ms: float
    ready_ms: tuple[float, ...]
    nbytes: tuple[int, ...]
    names: tuple[str, ...] = ()
    world_size: int = 1
    """Ranks of the recorded run (all on one host, for `Host` scaling)."""
    fill_ms_per_byte: float = 0.0
    """The reducer's copy of a bucket's gradients into it (scaled), on the backward thread
    between its last gradient and its launch, per byte (0: not recorded)."""
    tail_ms: float = 0.0
    """After the last all-reduce (or backward, if later): gradients written back, the step's
    report exchanged (0: not recorded)."""

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        try:
            return cls(
                forward_ms=float(data["forward_ms"]),
                ready_ms=tuple(float(t) for t in data["ready_ms"]),
                nbytes=tuple(int(b) for b in data["nbytes"]),
                names=tuple(data.get("names", ())),
                world_size=int(data.get("world_size", 1)),
                fill_ms_per_byte=float(data.get("fill_ms_per_byte", 0.0)),
                tail_ms=float(data.get("tail_ms", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{path}: not a gradsync timing profile "
                f"(need forward_ms, ready_ms, nbytes): {error}"
            ) from error

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        return path

    @classmethod
    def slowest(cls, profiles: Sequence[Profile]) -> Profile:
        """One profile from every rank's: the latest forward and ready time of each gradient
        over the ranks, since the slowest rank sets the step (as the planner's agreed input)."""
        if not profiles:
            raise ValueError("Profile.slowest: no profiles")
        first = profiles[0]
        if len(first.names) != len(first.ready_ms):
            raise ValueError("Profile.slowest: profiles need parameter names to be matched")
        ready = {name: t for name, t in zip(first.names, first.ready_ms)}
        for other in profiles[1:]:
            if set(other.names) != set(ready):
                raise ValueError("Profile.slowest: the ranks' profiles name different parameters")
            for name, t in zip(other.names, other.ready_ms):
                ready[name] = max(ready[name], t)
        size = dict(zip(first.names, first.nbytes))
        position = {name: i for i, name in enumerate(first.names)}
        order = sorted(ready, key=lambda name: (ready[name], position[name]))
        return cls(
            forward_ms=max(p.forward_ms for p in profiles),
            ready_ms=tuple(ready[name] for name in order),
            nbytes=tuple(size[name] for name in order),
            names=tuple(order),
            world_size=first.world_size,
            fill_ms_per_byte=max(p.fill_ms_per_byte for p in profiles),
            tail_ms=max(p.tail_ms for p in profiles),
        )

    @property
    def backward_ms(self) -> float:
        return self.ready_ms[-1] if self.ready_ms else 0.0


@dataclasses.dataclass(frozen=True)
class Network:
    bandwidth_gbps: float
    """Per-link bandwidth in GB/s."""
    latency_us: float
    algorithm: str = "ring"

    def __post_init__(self) -> None:
        if self.bandwidth_gbps <= 0 or self.latency_us < 0:
            raise ValueError(f"bandwidth must be > 0 and latency >= 0, got {self}")
        if self.algorithm not in ("ring", "tree"):
            raise ValueError(f"algorithm={self.algorithm!r}: expected 'ring' or 'tree'")

    def cost(self, ranks: int) -> CostModel:
        """All-reduce cost on `ranks` ranks as a CostModel (alpha ms, beta ms per byte)."""
        alpha, per_byte = self.latency_us * 1e-3, 1e-6 / self.bandwidth_gbps
        if ranks <= 1:
            return CostModel(0.0, 0.0)
        if self.algorithm == "ring":
            return CostModel(2 * (ranks - 1) * alpha, 2 * (ranks - 1) / ranks * per_byte)
        return CostModel(2 * math.ceil(math.log2(ranks)) * alpha, 2 * per_byte)


    @classmethod
    def from_cost(cls, cost: CostModel, ranks: int, algorithm: str = "ring") -> Network:
        """The network whose all-reduce on `ranks` ranks costs `cost` (e.g. a probe's fit)."""
        if ranks < 2:
            raise ValueError("from_cost: a cost measured on at least 2 ranks is needed")
        if algorithm == "ring":
            latency_ms, per_byte = (
                cost.alpha_ms / (2 * (ranks - 1)),
                cost.beta_ms_per_byte * ranks / (2 * (ranks - 1)),
            )
        else:
            latency_ms, per_byte = (
                cost.alpha_ms / (2 * math.ceil(math.log2(ranks))),
                cost.beta_ms_per_byte / 2,
            )
        return cls(1e-6 / max(per_byte, 1e-18), latency_ms * 1e3, algorithm)


@dataclasses.dataclass(frozen=True)
class Host:
    """How ranks share machines. `ranks`: ranks per host; `cores`: cores per host (None: never
    more ranks than cores, compute does not stretch)."""

    ranks: int = 1
    cores: int | None = None
    cpu_collectives: bool = False
    """Collectives run on the host's CPU (gloo): once its cores are all busy, communication
    competes with compute instead of overlapping it, and stretches like it."""
    comm_cores_per_gbps: float = 0.0
    """Short of that: the cores a collective in flight takes on each rank's behalf, per GB/s of
    link bandwidth (0: it waits on the link and takes none). See `contention`."""

    def __post_init__(self) -> None:
        if self.ranks < 1 or (self.cores is not None and self.cores < 1):
            raise ValueError(f"a host needs at least one rank and one core, got {self}")
        if self.comm_cores_per_gbps < 0:
            raise ValueError(f"comm_cores_per_gbps must be >= 0, got {self}")

    def _speeds(self, ranks: int, comm_cores: float) -> tuple[float, float]:
        """A rank's compute speed (1: a core of its own) without and with `comm_cores` busy
        communicating for each of the host's ranks: what is left of the cores, shared fairly."""
        here = min(ranks, self.ranks)
        cores = self.cores if self.cores is not None else here  # None: a core per rank, none spare
        alone = min(1.0, cores / here)
        return alone, min(1.0, max(cores - here * comm_cores, 0.0) / here)

    def contention(self, ranks: int, bandwidth_gbps: float) -> float:
        """The share of a rank's compute speed lost while a collective is in flight at `ranks`
        ranks over links of `bandwidth_gbps` (0: none, 1: compute waits): each of the host's
        ranks moving bytes at the link's rate takes `comm_cores_per_gbps` x that rate of cores,
        and compute gets the rest. Hosts with spare cores absorb it first."""
        if self.comm_cores_per_gbps <= 0 or self.saturated(ranks):
            return 0.0
        alone, during = self._speeds(ranks, self.comm_cores_per_gbps * bandwidth_gbps)
        return 1.0 - during / alone

    def with_contention(self, share: float, ranks: int, bandwidth_gbps: float) -> Host:
        """This host, with the CPU its collectives take set from a measured `share` (a
        `planner.Contention.share`, measured at `ranks` ranks over links of `bandwidth_gbps`):
        the inverse of `contention`. A share measured where spare cores hide it says nothing
        of the cost, and gives 0."""
        if not 0.0 <= share <= 1.0 or bandwidth_gbps <= 0:
            raise ValueError(
                "with_contention: need 0 <= share <= 1 and "
                f"bandwidth > 0, got {share}, {bandwidth_gbps}"
            )
        here = min(ranks, self.ranks)
        cores = self.cores if self.cores is not None else here
        alone, _ = self._speeds(ranks, 0.0)
        comm = max(cores - here * (1.0 - share) * alone, 0.0) / here if share > 0 else 0.0
        return dataclasses.replace(self, comm_cores_per_gbps=comm / bandwidth_gbps)

    def saturated(self, ranks: int) -> bool:
        """Every core busy with a rank's compute: CPU collectives cannot overlap it."""
        return (
            self.cpu_collectives and self.cores is not None and min(ranks, self.ranks) >= self.cores
        )

    def stretch(self, ranks: int) -> float:
        """How much longer compute takes with `ranks` ranks in all than with one per host."""
        if self.cores is None:
            return 1.0
        return max(1.0, min(ranks, self.ranks) / self.cores)


@dataclasses.dataclass(frozen=True)
class Prediction:
    ranks: int
    default_ms: float
    planned_ms: float
    no_overlap_ms: float
    planned_buckets: int
    compute_ms: float
    planned_layout: tuple[tuple[int, ...], ...] = ()
    """The planned buckets, as positions in the profile's ready order."""

    def efficiency(self, step_ms: float) -> float:
        """Scaling efficiency: the one-rank (compute-only) step over this step."""
        return self.compute_ms / step_ms if step_ms > 0 else 1.0


def default_layout(nbytes: Sequence[int]) -> list[list[int]]:
    """torch's limits applied in ready order: a 1 MiB first bucket, then 25 MiB ones."""
    buckets: list[list[int]] = [[]]
    limits = [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES]
    size = 0
    for i, b in enumerate(nbytes):
        buckets[-1].append(i)
        size += b
        if size >= limits[min(len(buckets) - 1, 1)]:
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


def simulate(
    profile: Profile,
    network: Network,
    ranks: Sequence[int],
    host: Host | None = None,
    loads: Mapping[int, LoadProbe] | None = None,
) -> list[Prediction]:
    """Predicted step time (forward + backward + exposed communication) for each rank count.

    `loads`: probes under load (`planner.probe_under_load`) by rank count. On a saturated CPU
    host with probes for the profile's rank count and the predicted one, they price the step
    instead of the network and the fair-share stretch (see `_saturated`)."""
    host = host or Host()
    default = default_layout(list(profile.nbytes))
    loads = loads or {}
    out = []
    for n in ranks:
        if host.saturated(n) and n in loads and profile.world_size in loads:
            out.append(_saturated(profile, default, loads[profile.world_size], loads[n], n))
        else:
            out.append(_modelled(profile, network, host, default, n))
    return out


def _modelled(
    profile: Profile, network: Network, host: Host, default: list[list[int]], n: int
) -> Prediction:
    """The prediction at `n` ranks from the models alone: the profile's compute stretched as
    the host shares its cores, the network's cost, and the default and planned layouts
    replayed over both."""
    nbytes = list(profile.nbytes)
    k = host.stretch(n) / host.stretch(profile.world_size)
    ready = [t * k for t in profile.ready_ms]
    forward, backward = profile.forward_ms * k, profile.backward_ms * k
    cost = network.cost(n)
    serial = host.saturated(n)
    if serial:  # communication waits for cores: it adds to compute, and stretches like it
        cost = CostModel(cost.alpha_ms * host.stretch(n), cost.beta_ms_per_byte * host.stretch(n))
        reducer = _Reducer()  # the probes under load price the step as measured
    else:  # the reducer's own copies are compute: they stretch like it
        reducer = _Reducer(profile.fill_ms_per_byte * k, profile.tail_ms * k)
    share = host.contention(n, network.bandwidth_gbps)
    planned = _plan(ready, nbytes, cost, serial, share, reducer)
    return Prediction(
        ranks=n,
        default_ms=forward + _finish(ready, nbytes, default, cost, serial, share, reducer),
        planned_ms=forward + _finish(ready, nbytes, planned, cost, serial, share, reducer),
        no_overlap_ms=forward
        + backward
        + reducer.fill(sum(nbytes))
        + cost.time_ms(sum(nbytes))
        + reducer.tail_ms,
        planned_buckets=len(planned),
        compute_ms=forward + backward,
        planned_layout=tuple(tuple(b) for b in planned),
    )


def _saturated(
    profile: Profile, default: list[list[int]], recorded: LoadProbe, target: LoadProbe, ranks: int
) -> Prediction:
    """A host whose cores all run a rank's compute, with CPU collectives: nothing overlaps.

    The step is the compute, stretched as the probe's synchronised step stretches (its step
    at the predicted rank count over its compute at the recorded one, where the profile's
    compute was measured alike), plus what each bucket's all-reduce adds to a step under load.
    The best plan is then the fewest buckets: one, the same as no overlap."""
    compute = profile.forward_ms + profile.backward_ms
    stretched = compute * target.step_ms / recorded.compute_ms

    def step(layout: list[list[int]]) -> float:
        return stretched + sum(
            target.cost.time_ms(sum(profile.nbytes[i] for i in b)) for b in layout
        )

    one = [list(range(len(profile.nbytes)))]
    return Prediction(
        ranks=ranks,
        default_ms=step(default),
        planned_ms=step(one),
        no_overlap_ms=step(one),
        planned_buckets=1,
        compute_ms=compute,
        planned_layout=(tuple(one[0]),),
    )


def _plan(ready: list[float], nbytes: list[int], cost: CostModel, serial: bool, share: float,
          reducer: _Reducer) -> list[list[int]]:
    """The planner's layout. Under contention its model (collectives leave compute alone) no
    longer holds, and fewer collectives may pay: its plans under a latency 2, 4, 8, ... times
    the network's, down to one bucket, are priced by the contended replay, the best kept."""
    planned = plan_buckets(ready, nbytes, cost)
    if share <= 0 or serial:
        return planned
    best, best_ms, scale = (
        planned,
        _finish(ready, nbytes, planned, cost, serial, share, reducer),
        2.0,
    )
    while len(planned) > 1 and scale <= 2.0**20:
        planned = plan_buckets(
            ready, nbytes, CostModel(max(cost.alpha_ms, 1e-3) * scale, cost.beta_ms_per_byte)
        )
        ms = _finish(ready, nbytes, planned, cost, serial, share, reducer)
        if ms < best_ms:
            best, best_ms = planned, ms
        scale *= 2
    return best


@dataclasses.dataclass(frozen=True)
class _Reducer:
    """The reducer's own work in a step (`Profile.fill_ms_per_byte`, `Profile.tail_ms`)."""

    fill_ms_per_byte: float = 0.0
    tail_ms: float = 0.0

    def fill(self, nbytes: float) -> float:
        return self.fill_ms_per_byte * nbytes


def _finish(
    ready: list[float], nbytes: list[int], layout: list[list[int]], cost: CostModel, serial: bool,
    share: float = 0.0, reducer: _Reducer = _Reducer(),
) -> float:
    """When the gradients are reduced, after forward: overlapped with backward, or after it.
    `share`: of compute speed lost while a collective is in flight (`Host.contention`)."""
    if serial:
        return predict_finish_ms(ready, nbytes, layout, cost, serial=True)
    if share > 0 or reducer != _Reducer():
        return _replay(ready, nbytes, layout, cost, share, reducer)
    return max(predict_finish_ms(ready, nbytes, layout, cost), ready[-1] if ready else 0.0)


def _replay(
    ready: list[float], nbytes: list[int], layout: list[list[int]], cost: CostModel, share: float,
    reducer: _Reducer,
) -> float:
    """Backward replayed with compute running at 1 - `share` of its speed while a collective is
    in flight: `ready` is compute time (the uncontended profile's). Each bucket is filled on the
    backward thread once its last gradient is computed (delaying the gradients after it), then
    launched, in order, one collective at a time. When the last all-reduce, or backward, ends,
    plus the reducer's tail (wall time after forward)."""
    busy: list[tuple[float, float]] = []  # the collectives' (start, end), in order, disjoint
    speed = 1.0 - share

    def wall(work: float) -> float:  # when backward has done `work` ms of compute
        t = done = 0.0
        for start, end in busy:
            if done + (start - t) >= work:
                break
            done, t = done + (start - t), start
            if speed > 0 and done + (end - start) * speed >= work:
                return start + (work - done) / speed
            done, t = done + (end - start) * speed, end
        return t + (work - done)

    # Fills run when a bucket's last gradient arrives: they push back the compute after them.
    lasts = [max(b) for b in layout]
    fills = [reducer.fill(sum(nbytes[i] for i in b)) for b in layout]
    by_last = sorted(range(len(layout)), key=lambda j: lasts[j])
    filled, before = {}, 0.0  # bucket -> work when its fill ends; fills done so far
    for j in by_last:
        before += fills[j]
        filled[j] = ready[lasts[j]] + before
    finish = 0.0
    for j, bucket in enumerate(layout):
        start = max(wall(filled[j]), finish)
        finish = start + cost.time_ms(sum(nbytes[i] for i in bucket))
        busy.append((start, finish))
    backward = (ready[-1] if ready else 0.0) + sum(fills)
    return max(finish, wall(backward)) + reducer.tail_ms


def markdown(predictions: Sequence[Prediction]) -> str:
    lines = [
        "| ranks | default ms | planned ms | no overlap "
        "ms | planned buckets | efficiency (planned) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in predictions:
        lines.append(
            f"| {p.ranks} | {p.default_ms:.3f} | {p.planned_ms:.3f} | {p.no_overlap_ms:.3f} | "
            f"{p.planned_buckets} | {p.efficiency(p.planned_ms):.1%} |"
        )
    return "\n".join(lines)


def plot(predictions: Sequence[Prediction], path: str | Path) -> Path:
    from ..observability.plot import figure, save_figure

    ranks = [p.ranks for p in predictions]
    fig, ax = figure(7, 4)
    for label, attr in [
        ("default", "default_ms"),
        ("planned", "planned_ms"),
        ("no overlap", "no_overlap_ms"),
    ]:
        ax.plot(ranks, [getattr(p, attr) for p in predictions], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted step time (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def timing_profile(reducer: Reducer, window: int = 8) -> Profile:
    """Median timings of the last `window` iterations, gradients in ready order: the input
    of `gradsync simulate`."""
    timelines = [t for t in list(reducer.history)[-window:] if t.finish_ns]
    if not timelines:
        raise RuntimeError("timing_profile: no finished iteration recorded yet")
    ready: list[list[float]] = [[] for _ in reducer.params]
    for tl in timelines:
        for t, kind, i in tl.events:
            if kind in (EventKind.READY, EventKind.UNUSED):
                ready[i].append((t - tl.start_ns) * 1e-6)
    median = [statistics.median(v) if v else 0.0 for v in ready]
    order = sorted(range(len(reducer.params)), key=lambda i: (median[i], i))
    forward = [(t.start_ns - t.forward_start_ns) * 1e-6 for t in timelines if t.forward_start_ns]
    fills, tails = [], []
    for tl in timelines:
        filled, launched = tl.times(EventKind.BUCKET_READY), tl.times(EventKind.LAUNCH)
        completed = tl.times(EventKind.COMPLETE)
        # filled last: launched at once
        last = max(filled, key=lambda b: filled[b]) if filled else None
        if last is not None and last in launched and tl.bucket_bytes[last] > 0:
            fills.append((launched[last] - filled[last]) * 1e-6 / tl.bucket_bytes[last])
        if tl.backward_end_ns:
            end = max([*completed.values(), tl.backward_end_ns - tl.start_ns])
            tails.append(max(tl.finish_ns - tl.start_ns - end, 0) * 1e-6)
    return Profile(
        forward_ms=statistics.median(forward) if forward else 0.0,
        ready_ms=tuple(median[i] for i in order),
        nbytes=tuple(reducer.params[i].numel() * reducer.params[i].element_size() for i in order),
        names=tuple(reducer.names[i] for i in order),
        world_size=reducer.world_size,
        fill_ms_per_byte=statistics.median(fills) if fills else 0.0,
        tail_ms=statistics.median(tails) if tails else 0.0,
    )
