"""Planned buckets: choose bucket boundaries from measured timings instead of a fixed 25 MiB.

Two pure pieces, tested without a process group:

* `CostModel`: all-reduce time ≈ α + β·bytes, fitted by least squares (`fit_cost_model`) to a short
  probe of the group in use (`probe_cost_model`, the only part that communicates).
* `even_split`: the same number of buckets with equal bytes, whatever the ready times say.
* `plan_buckets`: given when each gradient becomes ready (in ready order), its size and the cost
  model, the bucket boundaries that minimise the predicted time at which the last all-reduce
  finishes. Collectives run one after another, so bucket k finishes at
  max(finish[k-1], ready of its last gradient) + α + β·bytes[k]; a dynamic programme over the
  ready order finds the best segmentation exactly (O(n²) in the number of gradients, which are
  first merged into at most `max_atoms` consecutive groups when there are more).

Buckets never mix (dtype, device) groups: a boundary is forced wherever the group changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine.collectives import DEFAULT_TIMEOUT, all_reduce, wait

__all__ = [
    "CostModel",
    "fit_cost_model",
    "plan_buckets",
    "even_split",
    "predict_finish_ms",
    "probe_cost_model",
    "LoadProbe",
    "probe_under_load",
    "probe_sizes",
    "Contention",
    "measure_contention",
    "probe_during_compute",
    "CommCpu",
    "measure_comm_cpu",
    "busy_cpu_seconds",
]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """All-reduce time in milliseconds for a message of `nbytes`: alpha + beta * nbytes."""

    alpha_ms: float
    beta_ms_per_byte: float

    def time_ms(self, nbytes: float) -> float:
        return self.alpha_ms + self.beta_ms_per_byte * nbytes

    @property
    def bandwidth_gbps(self) -> float:
        """Bytes per second implied by beta, in GB/s (all-reduce 'bus' terms aside)."""
        return 1e-6 / self.beta_ms_per_byte if self.beta_ms_per_byte > 0 else float("inf")


def fit_cost_model(sizes: Sequence[float], times_ms: Sequence[float]) -> CostModel:
    """The line through (bytes, ms) with the least *relative* squared error, kept non-negative.

    Relative: probe sizes span orders of magnitude, and a plain least-squares line is pinned by
    the largest ones, leaving the latency (alpha) to chance; yet alpha is what decides how many
    buckets pay off.
    """
    if len(sizes) != len(times_ms) or len(sizes) < 2:
        raise ValueError(
            f"need at least two (size, time) pairs, got {len(sizes)} and {len(times_ms)}"
        )
    if len(set(sizes)) < 2:
        raise ValueError("probe sizes must differ")
    w = [1.0 / max(t, 1e-9) ** 2 for t in times_ms]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * y for wi, y in zip(w, times_ms))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, times_ms))
    beta = max((sw * sxy - sx * sy) / (sw * sxx - sx * sx), 0.0)
    alpha = max((sy - beta * sx) / sw, 0.0)
    return CostModel(alpha, beta)


PROBE_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def probe_sizes(gradient_bytes: int) -> tuple[int, ...]:
    """The default probe sizes, plus the whole gradient (up to 64 MiB) when it is larger: the
    fit should hold over the bucket sizes a plan can choose, and large messages fall out of
    the caches and cost more per byte than small ones."""
    top = min(gradient_bytes, 64 << 20)
    return PROBE_SIZES + ((top,) if top > PROBE_SIZES[-1] else ())


def probe_cost_model(
    group: dist.ProcessGroup,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    sizes: Sequence[int] = PROBE_SIZES,
    repeats: int = 5,
) -> CostModel:
    """Time all-reduces of a few sizes on `group` and fit the cost model; every rank gets the
    same model (each size's time is the slowest rank's median)."""
    element = torch.empty(0, dtype=dtype).element_size()
    medians = []
    for nbytes in sizes:
        t = torch.zeros(max(nbytes // element, 1), dtype=dtype, device=device)
        wait(group.allreduce([t]), "cost-model probe", group, DEFAULT_TIMEOUT)  # warm-up
        samples = []
        for _ in range(repeats):
            _settle(t.device)
            start = time.perf_counter()
            wait(group.allreduce([t]), "cost-model probe", group, DEFAULT_TIMEOUT)
            _settle(t.device)  # on a GPU the wait is stream-side: time until the device is done
            samples.append((time.perf_counter() - start) * 1e3)
        medians.append(statistics.median(samples))
    agreed = torch.tensor(medians, dtype=torch.float64, device=device)
    all_reduce(group, agreed, dist.ReduceOp.MAX, "cost-model agreement")
    return fit_cost_model([float(s) for s in sizes], agreed.tolist())


def probe_during_compute(
    group: dist.ProcessGroup,
    dtype: torch.dtype = torch.float32,
    sizes: Sequence[int] = PROBE_SIZES,
    repeats: int = 3,
    queued_bytes: int = 16 << 20,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> CostModel:
    """The cost model of all-reduces queued one after another while the rank computes, as
    buckets are during backward: for each size, 2-8 all-reduces (about `queued_bytes` in all)
    are started at once and matrix products run until the last has completed; a collective's
    cost is that time over their number. Every rank gets the same model (slowest rank's medians).

    On a CPU host (gloo) this is what a plan must be priced with when collectives can overlap:
    each one needs gloo's threads and the kernel's network stack to be scheduled between
    compute, and pays for it: an idle probe underprices both the all-reduces and a plan built
    on them (figures: docs/benchmarks/design-figures.md#collectives-queued-during-compute).
    A rank that does not take part makes the others raise after `timeout`."""
    element = torch.empty(0, dtype=dtype).element_size()
    a = torch.randn(96, 96)
    medians = []
    for nbytes in sizes:
        count = min(max(queued_bytes // max(nbytes, 1), 2), 8)
        queue = [torch.zeros(max(nbytes // element, 1), dtype=dtype) for _ in range(count)]
        for work in [group.allreduce([t]) for t in queue]:  # warm-up
            wait(work, "cost-model probe during compute", group, timeout)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            works = [group.allreduce([t]) for t in queue]
            while (not works[-1].is_completed()
                   and time.perf_counter() - start < timeout.total_seconds()):
                torch.mm(a, a)
            for work in works:  # completed (in order); wait() surfaces errors and timeouts
                wait(work, "cost-model probe during compute", group, timeout)
            samples.append((time.perf_counter() - start) * 1e3 / len(queue))
        medians.append(statistics.median(samples))
    agreed = torch.tensor(medians, dtype=torch.float64)
    all_reduce(group, agreed, dist.ReduceOp.MAX, "cost-model agreement", timeout)
    return fit_cost_model([float(s) for s in sizes], agreed.tolist())


@dataclasses.dataclass(frozen=True)
class LoadProbe:
    """How collectives and a synchronised step behave while every rank computes on the CPU,
    measured at `ranks` ranks (`probe_under_load`)."""

    ranks: int
    cost: CostModel
    """What one all-reduce adds to a step when it runs during compute."""
    compute_ms: float
    """The probe's compute, on the slowest rank (wall time, sharing cores as the ranks do)."""
    step_ms: float
    """The same compute as a synchronised step: ending in a tiny all-reduce, back to back."""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = {
            "ranks": self.ranks,
            "alpha_ms": self.cost.alpha_ms,
            "beta_ms_per_byte": self.cost.beta_ms_per_byte,
            "compute_ms": self.compute_ms,
            "step_ms": self.step_ms,
        }
        path.write_text(json.dumps(fields, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> LoadProbe:
        try:
            data = json.loads(Path(path).read_text())
            return cls(
                int(data["ranks"]),
                CostModel(float(data["alpha_ms"]), float(data["beta_ms_per_byte"])),
                float(data["compute_ms"]),
                float(data["step_ms"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{path}: not a gradsync load probe (LoadProbe.save): {error}"
            ) from error


def probe_under_load(
    group: dist.ProcessGroup,
    dtype: torch.dtype = torch.float32,
    sizes: Sequence[int] = PROBE_SIZES,
    repeats: int = 7,
    busy_ms: float = 8.0,
    launches: int = 4,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> LoadProbe:
    """Measure what collectives cost while every rank computes on the CPU (see `LoadProbe`).

    Each probe step is `busy_ms` of matrix products (the same number on every rank) with
    `launches` all-reduces of one size started along the way, then a tiny all-reduce that ends
    the step, as a last bucket would; a size's cost is the step time beyond the same step
    without those launches, per launch. On a host whose cores all run a rank's compute, gloo's
    threads take their time from that compute and wait for the scheduler, so a collective
    costs several times what the idle probe says (figures:
    docs/benchmarks/design-figures.md#collectives-under-load); where cores are free it comes out
    near zero, as overlap hides it.
    Steps without launches also give how a synchronised step stretches beyond its compute
    when ranks outnumber cores. Every rank gets the same result (the slowest rank's medians);
    a rank that does not take part makes the others raise after `timeout`."""
    a = torch.randn(96, 96)
    products = max(int(busy_ms * 1e-3 / _seconds_per_product(a, group, timeout)), launches + 1)
    element = torch.empty(0, dtype=dtype).element_size()
    step = _loaded_step(group, a, products, torch.zeros(1, dtype=dtype), timeout)
    messages = [
        [torch.zeros(max(n // element, 1), dtype=dtype) for _ in range(launches)] for n in sizes
    ]
    base, loaded = _time_loaded_steps(step, messages, repeats)
    floor = statistics.median(t for t, _ in base)
    marginal = [(statistics.median(t) - floor) / launches for t in loaded]
    agreed = torch.tensor(
        [floor, statistics.median(c for _, c in base), *marginal], dtype=torch.float64
    )
    all_reduce(group, agreed, dist.ReduceOp.MAX, "loaded cost-model agreement", timeout)
    step_ms, compute_ms, *costs = agreed.tolist()
    # Small collectives can cost next to nothing; a floor keeps the relative fit well posed.
    cost = fit_cost_model([float(s) for s in sizes], [max(c, 0.01) for c in costs])
    return LoadProbe(group.size(), cost, compute_ms, step_ms)


_LoadedStep = Callable[[list[torch.Tensor]], tuple[float, float]]


def _loaded_step(
    group: dist.ProcessGroup, a: torch.Tensor, products: int, end: torch.Tensor, timeout: timedelta
) -> _LoadedStep:
    """One probe step of `probe_under_load`: `products` matrix products with an all-reduce of
    each given tensor started between equal chunks of them, as backward launches buckets, then
    the tiny all-reduce of `end` that closes the step, as a last bucket would. The step returns
    (its wall time, the time its compute took), in ms."""

    def step(tensors: list[torch.Tensor]) -> tuple[float, float]:
        works, chunk = [], products // (len(tensors) + 1)
        start = time.perf_counter()
        for t in tensors:
            _busy(a, chunk)
            works.append(group.allreduce([t]))
        _busy(a, products - chunk * len(tensors))
        computed = time.perf_counter()
        works.append(group.allreduce([end]))
        for w in works:
            wait(w, "loaded cost-model probe", group, timeout)
        return (time.perf_counter() - start) * 1e3, (computed - start) * 1e3

    return step


def _time_loaded_steps(
    step: _LoadedStep, messages: list[list[torch.Tensor]], repeats: int
) -> tuple[list[tuple[float, float]], list[list[float]]]:
    """`repeats` rounds of steps without launches (base: wall and compute times) and with each
    size's messages (loaded: wall times, by size), after a warm-up. Every rank runs the same
    sequence, so their collectives pair up."""
    for _ in range(3):  # warm-up, into the steady state of back-to-back steps
        step([])
    base: list[tuple[float, float]] = []
    loaded: list[list[float]] = [[] for _ in messages]
    for _ in range(repeats):  # interleaved, so drift hits every size alike
        for k, tensors in enumerate(messages):
            base.append(step([]))
            loaded[k].append(step(tensors)[0])
    return base, loaded


@dataclasses.dataclass(frozen=True)
class Contention:
    """Whether collectives compete with compute here: times (ms, the slowest rank's) of a
    compute loop alone, an all-reduce alone, and both at once."""

    compute_ms: float
    allreduce_ms: float
    together_ms: float

    @property
    def share(self) -> float:
        """0: the all-reduce hides behind compute entirely (it waits on a link); 1: nothing
        overlaps, the two take turns on the cores (gloo on a CPU whose cores all compute)."""
        shorter = min(self.compute_ms, self.allreduce_ms)
        if shorter <= 0:
            return 0.0
        return min(
            max((self.together_ms - max(self.compute_ms, self.allreduce_ms)) / shorter, 0.0), 1.0
        )

    @property
    def saturated(self) -> bool:
        """Mostly taking turns. Short of that, overlap still gains something, and the trial
        (which tries one bucket too) measures how much."""
        return self.share > 0.8


def measure_contention(
    group: dist.ProcessGroup, nbytes: int, repeats: int = 5, timeout: timedelta = DEFAULT_TIMEOUT
) -> Contention:
    """Measure, rather than guess from host names and core counts, whether an all-reduce of
    `nbytes` overlaps computation: a loop of matrix products as long as the all-reduce, alone,
    then with the all-reduce started at its beginning. Every rank gets the same result."""
    a = torch.randn(96, 96)
    t = torch.zeros(max(nbytes // 4, 1))
    wait(group.allreduce([t]), "contention probe", group, timeout)  # warm-up

    def timed(fn: Callable[[], None]) -> float:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)

    alone = timed(lambda: wait(group.allreduce([t]), "contention probe", group, timeout))
    products = max(int(alone * 1e-3 / _seconds_per_product(a, group, timeout)), 1)
    compute = timed(lambda: _busy(a, products))

    def both() -> None:
        work = group.allreduce([t])
        _busy(a, products)
        wait(work, "contention probe", group, timeout)

    together = timed(both)
    agreed = torch.tensor([compute, alone, together], dtype=torch.float64)
    all_reduce(group, agreed, dist.ReduceOp.MAX, "contention agreement", timeout)
    return Contention(*agreed.tolist())


@dataclasses.dataclass(frozen=True)
class CommCpu:
    """What an all-reduce costs the machine's CPUs besides its wall time: gloo's threads and
    the kernel's network stack (on the emulated cluster: TCP, the veth pairs, the bridge, tbf)."""

    allreduce_ms: float
    """Wall time of one all-reduce (the slowest rank's)."""
    busy_ms: float
    """CPU time the machine spent per all-reduce, every core together, less its idle baseline."""
    cores: int

    @property
    def per_core_ms(self) -> float:
        """What each core loses per all-reduce if every core is computing (the work spreads over
        them): the least a step can add to its compute when it overlaps that all-reduce."""
        return self.busy_ms / self.cores


def busy_cpu_seconds(stat: str | None = None) -> float | None:
    """Seconds every CPU of this machine spent busy since boot (the first line of `/proc/stat`:
    all but idle and iowait), or None where there is no `/proc/stat`."""
    if stat is None:
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:
            return None
    fields = [int(f) for f in stat.splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / _clock_ticks()


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def measure_comm_cpu(
    group: dist.ProcessGroup,
    nbytes: int,
    seconds: float = 1.0,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> CommCpu | None:
    """The machine's CPU time per all-reduce of `nbytes`, from `/proc/stat` around back-to-back
    all-reduces for about `seconds`, less what the machine spends over as long idle (a sleep).
    Machine-wide: on the emulated cluster every host shares this machine's cores, so it is
    every rank's cost together. None where `/proc/stat` is missing (every rank agrees: the
    slowest rank's wall time and the largest reading)."""
    t = torch.zeros(max(nbytes // 4, 1))
    wait(group.allreduce([t]), "CPU cost probe", group, timeout)  # warm-up
    start = time.perf_counter()
    wait(group.allreduce([t]), "CPU cost probe", group, timeout)
    once = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    count = max(
        3,
        int(seconds / all_reduce(group, once, dist.ReduceOp.MAX, "CPU cost probe", timeout).item()),
    )
    busy0, start = busy_cpu_seconds(), time.perf_counter()
    for _ in range(count):
        wait(group.allreduce([t]), "CPU cost probe", group, timeout)
    busy1, wall = busy_cpu_seconds(), time.perf_counter() - start
    time.sleep(wall)  # the idle baseline over as long
    busy2 = busy_cpu_seconds()
    if busy0 is None or busy1 is None or busy2 is None:
        cost = -1.0  # no /proc/stat: None below
    else:
        cost = max(((busy1 - busy0) - (busy2 - busy1)) / count * 1e3, 0.0)
    agreed = torch.tensor([wall / count * 1e3, cost], dtype=torch.float64)
    all_reduce(group, agreed, dist.ReduceOp.MAX, "CPU cost agreement", timeout)
    wall_ms, busy_ms = agreed.tolist()
    if busy_ms < 0:
        return None
    return CommCpu(wall_ms, busy_ms, os.cpu_count() or 1)


def _settle(device: torch.device) -> None:
    """Wait until `device` has done what was queued (the probe is off the step path)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy(a: torch.Tensor, products: int) -> None:
    for _ in range(products):
        torch.mm(a, a)


def _seconds_per_product(a: torch.Tensor, group: dist.ProcessGroup, timeout: timedelta) -> float:
    """One product's time, the fastest rank's, so every rank runs the same number."""
    _busy(a, 10)
    start = time.perf_counter()
    _busy(a, 50)
    agreed = torch.tensor([(time.perf_counter() - start) / 50], dtype=torch.float64)
    return float(
        all_reduce(
            group, agreed, dist.ReduceOp.MIN, "loaded cost-model calibration", timeout
        ).item()
    )


def predict_finish_ms(
    ready_ms: Sequence[float],
    nbytes: Sequence[int],
    buckets: Sequence[Sequence[int]],
    cost: CostModel,
    serial: bool = False,
) -> float:
    """When the last bucket's all-reduce finishes, launching buckets in order as they fill.

    `buckets` hold positions into `ready_ms` / `nbytes` (the ready order). `serial`: nothing
    overlaps (a saturated CPU host, `cost` measured under load): every all-reduce adds to the
    time backward takes."""
    if serial:
        return max(ready_ms, default=0.0) + sum(
            cost.time_ms(sum(nbytes[i] for i in b)) for b in buckets
        )
    finish = 0.0
    for bucket in buckets:
        ready = max(ready_ms[i] for i in bucket)
        finish = max(finish, ready) + cost.time_ms(sum(nbytes[i] for i in bucket))
    return finish


def plan_buckets(
    ready_ms: Sequence[float],
    nbytes: Sequence[int],
    cost: CostModel,
    groups: Sequence[Hashable] | None = None,
    max_atoms: int = 400,
) -> list[list[int]]:
    """The segmentation of positions 0..n-1 (ready order) that minimises the predicted finish.

    `ready_ms` must be non-decreasing. `groups[i]` is position i's (dtype, device) key, if mixed.
    """
    n = len(ready_ms)
    if n == 0:
        raise ValueError("plan_buckets: no gradients to plan")
    if len(nbytes) != n or (groups is not None and len(groups) != n):
        raise ValueError(
            "plan_buckets: ready_ms, nbytes and groups must have one entry per gradient"
        )
    if any(b < a for a, b in zip(ready_ms, ready_ms[1:])):
        raise ValueError("plan_buckets: ready_ms must be in ready order (non-decreasing)")
    keys = list(groups) if groups is not None else [0] * n
    atoms = _atoms(nbytes, keys, max_atoms)
    ready = [ready_ms[a[-1]] for a in atoms]
    size = [sum(nbytes[i] for i in a) for a in atoms]
    key = [keys[a[0]] for a in atoms]
    cuts = _best_cuts(ready, size, key, cost)
    return [[i for a in atoms[lo:hi] for i in a] for lo, hi in zip(cuts, cuts[1:])]


def even_split(
    nbytes: Sequence[int], n: int, groups: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Positions 0..len(nbytes)-1 (ready order) in `n` consecutive buckets of about equal bytes.

    Each position goes to the bucket its bytes' midpoint falls in, so a gradient larger than a
    bucket's share takes a bucket of its own and no bucket is empty. A boundary is also forced
    wherever `groups` changes (one (dtype, device) group per bucket), so mixed groups can give
    more than `n` buckets.
    """
    if n < 1:
        raise ValueError(f"even_split: {n} buckets asked for; ask for at least 1")
    keys = list(groups) if groups is not None else [0] * len(nbytes)
    total = sum(nbytes) or 1
    buckets: list[list[int]] = []
    last: tuple[Hashable, int] = (None, -1)
    done = 0
    for i, size in enumerate(nbytes):
        slot = (keys[i], min(n - 1, int((done + size / 2) * n / total)))
        if slot != last:
            buckets.append([])
            last = slot
        buckets[-1].append(i)
        done += size
    return buckets


def _atoms(nbytes: Sequence[int], keys: Sequence[Hashable], max_atoms: int) -> list[list[int]]:
    """Consecutive positions merged into at most about `max_atoms` groups of similar bytes."""
    target = sum(nbytes) / max_atoms if len(nbytes) > max_atoms else 0
    atoms: list[list[int]] = []
    total = 0
    for i, b in enumerate(nbytes):
        if atoms and keys[atoms[-1][0]] == keys[i] and total + b <= target:
            atoms[-1].append(i)
            total += b
        else:
            atoms.append([i])
            total = b
    return atoms


def _best_cuts(
    ready: list[float], size: list[int], key: list[Hashable], cost: CostModel
) -> list[int]:
    n = len(ready)
    prefix = [0]
    for s in size:
        prefix.append(prefix[-1] + s)
    best = [0.0] + [float("inf")] * n
    parent = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # segment i..j-1, growing to the left
            if key[i] != key[j - 1]:
                break  # a bucket holds one (dtype, device) group
            finish = max(best[i], ready[j - 1]) + cost.time_ms(prefix[j] - prefix[i])
            if finish < best[j]:
                best[j], parent[j] = finish, i
    cuts = [n]
    while cuts[-1] > 0:
        cuts.append(parent[cuts[-1]])
    return cuts[::-1]
