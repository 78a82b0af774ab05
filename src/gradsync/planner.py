"""Planned buckets: choose bucket boundaries from measured timings instead of a fixed 25 MiB.

Two pure pieces, tested without a process group:

* `CostModel`: all-reduce time ≈ α + β·bytes, fitted by least squares (`fit_cost_model`) to a short
  probe of the group in use (`probe_cost_model`, the only part that communicates).
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
import statistics
import time
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from .collectives import DEFAULT_TIMEOUT, wait

__all__ = ["CostModel", "fit_cost_model", "plan_buckets", "predict_finish_ms", "probe_cost_model", "probe_sizes"]


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
        raise ValueError(f"need at least two (size, time) pairs, got {len(sizes)} and {len(times_ms)}")
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
            start = time.perf_counter()
            wait(group.allreduce([t]), "cost-model probe", group, DEFAULT_TIMEOUT)
            samples.append((time.perf_counter() - start) * 1e3)
        medians.append(statistics.median(samples))
    agreed = torch.tensor(medians, dtype=torch.float64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
    wait(group.allreduce([agreed], opts), "cost-model agreement", group, DEFAULT_TIMEOUT)
    return fit_cost_model([float(s) for s in sizes], agreed.tolist())


def predict_finish_ms(
    ready_ms: Sequence[float], nbytes: Sequence[int], buckets: Sequence[Sequence[int]], cost: CostModel
) -> float:
    """When the last bucket's all-reduce finishes, launching buckets in order as they fill.

    `buckets` hold positions into `ready_ms` / `nbytes` (the ready order)."""
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
        raise ValueError("plan_buckets: ready_ms, nbytes and groups must have one entry per gradient")
    if any(b < a for a, b in zip(ready_ms, ready_ms[1:])):
        raise ValueError("plan_buckets: ready_ms must be in ready order (non-decreasing)")
    keys = list(groups) if groups is not None else [0] * n
    atoms = _atoms(nbytes, keys, max_atoms)
    ready = [ready_ms[a[-1]] for a in atoms]
    size = [sum(nbytes[i] for i in a) for a in atoms]
    key = [keys[a[0]] for a in atoms]
    cuts = _best_cuts(ready, size, key, cost)
    return [[i for a in atoms[lo:hi] for i in a] for lo, hi in zip(cuts, cuts[1:])]


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


def _best_cuts(ready: list[float], size: list[int], key: list[Hashable], cost: CostModel) -> list[int]:
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
