"""Benchmark plumbing shared by `benchmarks/` and (later) `gradsync bench`.

This machine is shared and noisy, so every comparison is run the same way: variants interleaved
round by round (each round runs every variant once, in a rotated order), warm-up rounds dropped,
and reported as medians plus paired ratios to a baseline, next to an A/A ratio (the baseline
against a second copy of itself) that shows how much of a difference is noise.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

__all__ = ["Comparison", "interleave", "markdown_table", "mismatched", "timed"]


class Comparison:
    """Per-variant samples of one measurement (e.g. ms per step), collected round by round."""

    def __init__(self, variants: Sequence[str]) -> None:
        self.variants = list(variants)
        self.samples: dict[str, list[float]] = {v: [] for v in variants}

    def add(self, variant: str, value: float) -> None:
        self.samples[variant].append(value)

    def median(self, variant: str) -> float:
        return statistics.median(self.samples[variant])

    def spread(self, variant: str) -> tuple[float, float]:
        """(25th, 75th) percentile."""
        q = statistics.quantiles(self.samples[variant], n=4, method="inclusive")
        return q[0], q[2]

    def paired_ratio(self, variant: str, baseline: str) -> float:
        """Median over rounds of variant/baseline: pairs share a round, so share its noise."""
        return statistics.median(self._ratios(variant, baseline))

    def ratio_interval(self, variant: str, baseline: str, level: float = 0.95,
                       resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
        """A bootstrap interval (percentile, over rounds) for `paired_ratio`: whether a ratio
        differs from 1 by more than the rounds' own scatter, which the A/A pair's single
        ratio cannot say. Deterministic for a given `seed`."""
        ratios = self._ratios(variant, baseline)
        draw = random.Random(seed).choices
        medians = sorted(statistics.median(draw(ratios, k=len(ratios))) for _ in range(resamples))
        tail = (1.0 - level) / 2
        return medians[int(tail * (resamples - 1))], medians[int((1.0 - tail) * (resamples - 1))]

    def _ratios(self, variant: str, baseline: str) -> list[float]:
        return [a / b for a, b in zip(self.samples[variant], self.samples[baseline])]


def interleave(
    variants: dict[str, Callable[[], float]], rounds: int, warmup: int = 1
) -> Comparison:
    """Run each variant once per round, rotating the order; return the post-warm-up samples.

    Each callable returns its own measurement (so it can time only what matters). All ranks
    must call this with the same variants and rounds: the order is deterministic.
    """
    names = list(variants)
    result = Comparison(names)
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            value = variants[name]()
            if r >= warmup:
                result.add(name, value)
    return result


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls of `fn`."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(
    comparison: Comparison, baseline: str, aa: str | None, unit: str, scale: float = 1.0,
    extra: dict[str, dict[str, str]] | None = None,
) -> str:
    """Medians, interquartile spreads and paired ratios to `baseline` (with their 95 %
    bootstrap intervals) as a markdown table; `extra` adds columns (heading: variant: text)."""
    extra = extra or {}
    lines = [
        f"| variant | median {unit} | IQR {unit} | ratio to {baseline} | 95 % interval |"
        + "".join(f" {head} |" for head in extra),
        "|---|---:|---:|---:|---:|" + "---:|" * len(extra),
    ]
    for v in comparison.variants:
        lo, hi = comparison.spread(v)
        ratio = comparison.paired_ratio(v, baseline)
        r_lo, r_hi = comparison.ratio_interval(v, baseline)
        label = f"{v} (A/A noise)" if v == aa else v
        lines.append(
            f"| {label} | {comparison.median(v) * scale:.3f} | {lo * scale:.3f}–{hi * scale:.3f} "
            f"| {ratio:.3f} | {r_lo:.3f}–{r_hi:.3f} |"
            + "".join(f" {col.get(v, '')} |" for col in extra.values())
        )
    return "\n".join(lines)


def mismatched(
    same: dict[str, dict[str, float]], tolerance: float = 1e-3
) -> dict[str, dict[str, float]]:
    """The models whose variants ended with parameters unlike torch DDP's: a difference above
    `tolerance`, or NaN (a model that diverged compares as NaN, never as equal)."""
    return {
        m: diffs for m, diffs in same.items() if not all(d <= tolerance for d in diffs.values())
    }
