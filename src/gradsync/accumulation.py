"""What every rank tells the others at the end of each synchronisation: how many micro-steps
(forwards) it covers, and whether its backward ended with gradients missing.

Each rank owns one element of a small vector and writes only that one; the vector is summed
across ranks, so each rank's value arrives unchanged (x + 0 + ... + 0 = x, exactly). The vector
rides after the last bucket's gradients in its own all-reduce when it can (free), in the
bucket's dtype; one element per rank also keeps a ring all-reduce's chunks where torch's are,
so gradients stay bit-identical to torch's DDP at 3 ranks and more.

A rank writes 2 * count + missing. That is exact while it fits the dtype's integers (float32:
counts to 8,388,606; float16: 1,022; bfloat16: 126); a larger count is written as the largest
one that fits, which every rank then reads as "look again": they all run one small int64
all-reduce of the exact counts (`exact_counts`). So counts are exact for any value, and the extra
collective runs only in a synchronisation where some rank covered that many micro-steps.

A joined rank (uneven inputs) contributes zeros: count 0, which has no say in the comparison.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["RankReport", "decode", "encode", "exact_counts", "saturation"]


@dataclasses.dataclass(frozen=True)
class RankReport:
    micro_steps: int | None  # forwards this synchronisation covers (0: joined; None: see exact)
    missing: bool  # that rank's backward ended with some bucket's gradients missing


def saturation(dtype: torch.dtype) -> int:
    """The count written in place of any count at least this large, for `dtype`."""
    if dtype.is_floating_point:
        exact = round(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1): integers exact to here
    else:
        exact = 2**62
    return exact // 2 - 1


def encode(out: torch.Tensor, rank: int, micro_steps: int, missing: bool) -> torch.Tensor:
    """Fill `out` (one element per rank) with zeros and this rank's report."""
    if micro_steps < 0:
        raise ValueError(f"micro-step count {micro_steps} is negative")
    out.zero_()
    out[rank] = 2 * min(micro_steps, saturation(out.dtype)) + int(missing)
    return out


def decode(values: list[float], dtype: torch.dtype) -> list[RankReport]:
    """Every rank's report from the summed vector (as a list of numbers)."""
    top = saturation(dtype)
    reports = []
    for value in values:
        code = int(round(value))
        count = code // 2
        reports.append(RankReport(micro_steps=None if count >= top else count, missing=bool(code % 2)))
    return reports


def exact_counts(reports: list[RankReport], exact: list[int]) -> list[RankReport]:
    """The reports with the exact counts (from the int64 all-reduce) put in."""
    return [dataclasses.replace(r, micro_steps=n) for r, n in zip(reports, exact)]
