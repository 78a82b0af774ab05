"""The checks made of each synchronisation's reports, on every rank alike: gradients missing
on some rank, micro-step counts that differ across ranks (`accumulation`), and the opt-in
finite check's norms (`checks`).

Read back "now" they are checked at the end of backward. Read back "deferred" (a device
group's default) the summed reports and the norms go to the host behind an event and are
checked once landed, at a later iteration's start (never waited for), and those of the
iteration before last in any case; a rank's own missing gradients still raise at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .accumulation import Reports, decode, uneven
from .checks import PendingFinite
from .device import HostRead
from .errors import GradSyncError, missing_elsewhere_message, uneven_accumulation_message
from .waits import Waits

__all__ = ["ReportChecks"]


class ReportChecks:
    """This rank's reports and the checks of everyone's, now or once landed."""

    def __init__(self, group: dist.ProcessGroup, waits: Waits) -> None:
        self.reports = Reports(group)
        self.rank, self.waits = group.rank(), waits
        self._deferred: deque[tuple[int, HostRead]] = deque()  # (iteration, its reports)
        self._finite: deque[tuple[int, PendingFinite]] = deque()  # deferred finite checks, one per bucket

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
        self.check_landed(iteration, check_accumulation)  # what has landed (a joined rank never starts an iteration)
        if pending is not None:
            self._deferred.append((iteration, pending))
        if own_missing_error is not None:
            raise own_missing_error()

    def check_landed(self, iteration: int, check_accumulation: bool) -> None:
        """Check the reports and finite checks of earlier iterations that have landed (asking,
        not waiting), and those of the iteration before last in any case; raise what they show."""
        self._drain(self._finite, iteration, lambda _, finite: finite.check())
        self._drain(self._deferred, iteration,
                    lambda number, pending: self._check_reports_of(number, pending, check_accumulation))

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

    def _check_reports_of(self, iteration: int, pending: HostRead, check_accumulation: bool) -> None:
        reports = decode(pending.get(), torch.int64)
        elsewhere = [r for r, report in enumerate(reports) if report.missing and r != self.rank]
        if elsewhere:
            raise GradSyncError(missing_elsewhere_message(elsewhere, iteration, self.rank))
        counts = uneven(reports) if check_accumulation else None
        if counts is not None:
            raise GradSyncError(uneven_accumulation_message(counts, iteration))
