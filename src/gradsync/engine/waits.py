"""How the Reducer waits at the end of backward: every wait through `collectives.wait` (one
policy: the configured timeout, failures told from timeouts by the clock), with the error
naming the iteration, the bucket and its parameters, and, with a stall monitor, a report of
what is pending and which ranks have not arrived, logged once `warn_after` has passed."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from .bucket import Bucket
from .collectives import DEFAULT_TIMEOUT, wait
from .device import host_runs_collectives
from .errors import ReductionTimeoutError, format_names

__all__ = ["StallMonitor", "Waits"]

_log = logging.getLogger("gradsync")


class StallMonitor(Protocol):
    """What the Reducer asks of a stall watchdog (observability's `StallWatchdog`)."""

    warn_after: timedelta

    def mark_progress(self, iteration: int) -> None: ...

    def publish_missing(self, iteration: int, missing: list[str]) -> dict[int, list[str]]: ...

    def report(self, iteration: int, waited: timedelta, pending: list[tuple[int, list[str]]]) -> str: ...


class Waits:
    """The end of one iteration's waits, described well when one fails."""

    def __init__(self, group: dist.ProcessGroup, names: Sequence[str]) -> None:
        self.group, self.names = group, list(names)
        self._host = host_runs_collectives(group)
        self.monitor: StallMonitor | None = None
        self.iteration = 0
        self.timeout = DEFAULT_TIMEOUT  # until `begin` sets the configured one
        self._stall_report = ""
        self._started = 0.0
        self._buckets: list[Bucket] = []

    def begin(self, iteration: int, timeout: timedelta, buckets: list[Bucket], watch: bool = True) -> None:
        """Backward has ended: the waits for `buckets` start now (watched for stalls)."""
        self.iteration, self.timeout, self._buckets = iteration, timeout, buckets
        self._started = time.monotonic()
        self._stall_report = ""
        if self.monitor is not None and watch:
            self._watch_for_stall()

    def __call__(self, work: dist.Work | None, what: str, bucket: Bucket | None = None) -> None:
        assert work is not None, f"{what} was never started"
        try:  # the message is built only on failure, off the normal path
            wait(work, lambda: self._describe(what, bucket), self.group, self.timeout, self._host)
        except ReductionTimeoutError as failure:
            raise self._with_pending_report(failure, bucket) from failure.__cause__

    def _describe(self, what: str, bucket: Bucket | None) -> str:
        if bucket is not None:
            what += f" holding {format_names([self.names[i] for i in bucket.param_indices], 5)}"
        if self._stall_report:
            what += f"\n{self._stall_report}\n"
        return f"iteration {self.iteration}: {what}"

    def _with_pending_report(self, failure: ReductionTimeoutError, bucket: Bucket | None) -> ReductionTimeoutError:
        if self.monitor is None or self._stall_report or bucket is None:
            return failure
        # Failed before the monitor's warning (a peer crashed): report now. Buckets are taken
        # in order, so this one and every later one are still outstanding.
        return ReductionTimeoutError(f"{failure}\n{self._pending(self._buckets[bucket.index :])}")

    def _watch_for_stall(self) -> None:
        """Wait up to the monitor's warn_after for every bucket; past it, log who is missing."""
        assert self.monitor is not None
        deadline = time.monotonic() + self.monitor.warn_after.total_seconds()
        for bucket in self._buckets:
            if not bucket.done_within(max(deadline - time.monotonic(), 0.0)):
                self._stall_report = self._pending()
                _log.warning(self._stall_report)
                return

    def _pending(self, outstanding: list[Bucket] | None = None) -> str:
        assert self.monitor is not None
        if outstanding is None:
            outstanding = [b for b in self._buckets if not b.done_within(0.0)]
        pending = [(b.index, [self.names[i] for i in b.param_indices]) for b in outstanding]
        waited = timedelta(seconds=time.monotonic() - self._started)
        return self.monitor.report(self.iteration, waited, pending)

