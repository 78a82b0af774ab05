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

The checks made of the reports (`ReportChecks`), on every rank alike: gradients missing on some
rank, micro-step counts that differ across ranks, and the opt-in finite check's norms
(`checks`). Read back "now" they are checked at the end of backward. Read back "deferred" (a
device group's default) the summed reports and the norms go to the host behind an event and are
checked once landed, at a later iteration's start (never waited for), and those of the
iteration before last in any case; a rank's own missing gradients still raise at once.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .checks import PendingFinite
from .device import HostRead
from .errors import GradSyncError, missing_elsewhere_message, uneven_accumulation_message
from .waits import Waits

__all__ = ["RankReport", "ReportChecks", "Reports", "decode", "encode", "exact_counts",
           "saturation", "uneven"]


@dataclasses.dataclass(frozen=True)
class RankReport:
    micro_steps: int | None  # forwards this synchronisation covers (0: joined; None: see exact)
    missing: bool  # that rank's backward ended with some bucket's gradients missing


def saturation(dtype: torch.dtype) -> int:
    """The count written in place of any count at least this large, for `dtype` (a complex
    dtype's: its real part's)."""
    if dtype.is_complex:
        dtype = dtype.to_real()
    if dtype.is_floating_point:
        # 2 ** (mantissa bits + 1): integers exact to here
        exact = round(2 / torch.finfo(dtype).eps)
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
    """Every rank's report from the summed vector (as a list of numbers; complex ones, from a
    complex bucket, carry it in their real part)."""
    top = saturation(dtype)
    reports = []
    for value in values:
        code = int(round(value.real))
        count = code // 2
        reports.append(RankReport(micro_steps=None if count >= top else count,
                                  missing=bool(code % 2)))
    return reports


def exact_counts(reports: list[RankReport], exact: list[int]) -> list[RankReport]:
    """The reports with the exact counts (from the int64 all-reduce) put in."""
    return [dataclasses.replace(r, micro_steps=n) for r, n in zip(reports, exact)]


class Reports:
    """This rank's report for one synchronisation, and its exchange with the other ranks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.world_size = group.rank(), group.size()
        self._templates: dict[tuple[Any, ...], torch.Tensor] = {}
        self._pending: tuple[torch.Tensor, dist.Work | None] | None = None

    def _template(self, like: torch.Tensor, micro_steps: int, missing: bool) -> torch.Tensor:
        """This rank's report shaped, typed and placed as `like`, made once per count: one
        copy a step instead of a fill and a write (kernels, on a GPU)."""
        key = (micro_steps, missing, like.dtype, like.device, like.numel())
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) > 64:  # counts that keep changing: stay bounded
                self._templates.clear()
            template = self._templates[key] = encode(torch.empty_like(like), self.rank, micro_steps,
                                                     missing)
        return template

    def attach(self, tail: torch.Tensor, micro_steps: int, missing: bool) -> None:
        """Write the report into the last bucket's tail: it rides in that bucket's all-reduce."""
        tail.copy_(self._template(tail, micro_steps, missing))
        self._pending = (tail, None)  # waited for with the bucket itself

    def start(self, device: torch.device, micro_steps: int, missing: bool) -> None:
        """All-reduce the reports on their own (after every bucket, on every rank)."""
        if self.world_size == 1:
            return
        reports = torch.empty(self.world_size, dtype=torch.int64, device=device)
        reports.copy_(self._template(reports, micro_steps, missing))
        self._pending = (reports, self.group.allreduce([reports]))

    def finish(self, wait: Callable[[dist.Work, str], None],
               micro_steps: int) -> list[RankReport] | None:
        """Every rank's report (None at world size 1, where there is nobody to tell)."""
        if self._pending is None:
            return None
        values, work = self._pending
        self._pending = None
        if work is not None:
            wait(work, "all-reduce of the ranks' reports (micro-step counts)")
        reports = decode(values.tolist(), values.dtype)
        if any(r.micro_steps is None for r in reports):  # a count too large to ride: ask
            exact = torch.zeros(self.world_size, dtype=torch.int64, device=values.device)
            exact[self.rank] = micro_steps
            wait(self.group.allreduce([exact]), "all-reduce of exact micro-step counts")
            reports = exact_counts(reports, exact.tolist())
        return reports

    def finish_later(self, wait: Callable[[dist.Work, str], None]) -> HostRead | None:
        """As `finish`, without the host reading: the summed reports (sent on their own, in
        int64, so never saturated) on their way back, for `decode` once they have landed."""
        if self._pending is None:
            return None
        values, work = self._pending
        self._pending = None
        assert values.dtype == torch.int64, "deferred reports travel on their own, in int64"
        if work is not None:
            wait(work, "all-reduce of the ranks' reports (micro-step counts)")
        return HostRead(values)

    def received(self, values: torch.Tensor) -> None:
        """The summed reports arrived some other way (a joined rank's zero bucket)."""
        self._pending = (values, None)

    def abandon(self) -> None:
        self._pending = None


def uneven(reports: list[RankReport]) -> list[int] | None:
    """Each rank's count if the active ranks' differ (0: a joined rank, which has no say)."""
    active = {r.micro_steps for r in reports if r.micro_steps}
    return [r.micro_steps or 0 for r in reports] if len(active) > 1 else None


class ReportChecks:
    """This rank's reports and the checks of everyone's, now or once landed."""

    def __init__(self, group: dist.ProcessGroup, waits: Waits) -> None:
        self.reports = Reports(group)
        self.rank, self.waits = group.rank(), waits
        self._deferred: deque[tuple[int, HostRead]] = deque()  # (iteration, its reports)
        # deferred finite checks, one per bucket
        self._finite: deque[tuple[int, PendingFinite]] = deque()

    def start(self, device: torch.device, micro_steps: int, missing: bool) -> None:
        """This rank's report in a small all-reduce of its own (when it cannot ride along)."""
        self.reports.start(device, micro_steps, missing)

    def add_finite(self, iteration: int, pending: PendingFinite) -> None:
        self._finite.append((iteration, pending))

    def check_now(self, micro_steps: int, missing: bool, iteration: int, check_accumulation: bool,
                  missing_error: Callable[[], GradSyncError]) -> None:
        """Every rank's report, read now: raise `missing_error()` (a collective every rank
        enters: all saw the flag) or the uneven micro-step counts."""
        reports = self.reports.finish(self.waits, micro_steps)
        if missing if reports is None else any(r.missing for r in reports):
            raise missing_error()
        if reports is None:  # world size 1: nobody else to tell
            return
        counts = uneven(reports) if check_accumulation else None
        if counts is not None:
            raise GradSyncError(uneven_accumulation_message(counts, iteration))

    def check_later(self, iteration: int, check_accumulation: bool,
                    own_missing_error: Callable[[], GradSyncError] | None) -> None:
        """Deferred read-back: this rank's own missing gradients raise now (the host knows
        them); the summed reports are read once they have landed (`check_landed`)."""
        pending = self.reports.finish_later(self.waits)
        # what has landed (a joined rank never starts an iteration)
        self.check_landed(iteration, check_accumulation)
        if pending is not None:
            self._deferred.append((iteration, pending))
        if own_missing_error is not None:
            raise own_missing_error()

    def check_landed(self, iteration: int, check_accumulation: bool) -> None:
        """Check the reports and finite checks of earlier iterations that have landed (asking,
        not waiting), and those of the iteration before last in any case; raise what they show."""
        self._drain(self._finite, iteration, lambda _, finite: finite.check())
        self._drain(self._deferred, iteration,
                    lambda number, pending: self._check_reports_of(number, pending,
                                                                   check_accumulation))

    def _drain(self, queue: deque, iteration: int, check: Callable[[int, Any], None]) -> None:
        """Check, oldest first, the (iteration, pending read) entries of `queue` that have
        landed or are from before `iteration`; after one raises, drop the rest."""
        while queue:
            number, pending = queue[0]
            if number >= iteration and not pending.ready():
                return
            queue.popleft()
            try:
                check(number, pending)
            except GradSyncError:
                queue.clear()
                raise

    def _check_reports_of(self, iteration: int, pending: HostRead,
                          check_accumulation: bool) -> None:
        reports = decode(pending.get(), torch.int64)
        elsewhere = [r for r, report in enumerate(reports) if report.missing and r != self.rank]
        if elsewhere:
            raise GradSyncError(missing_elsewhere_message(elsewhere, iteration, self.rank))
        counts = uneven(reports) if check_accumulation else None
        if counts is not None:
            raise GradSyncError(uneven_accumulation_message(counts, iteration))
