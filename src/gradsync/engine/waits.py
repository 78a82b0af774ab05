"""Every wait gradsync makes goes through `wait` (one policy: a timeout, failures told from
timeouts by the clock). The Reducer's, at the end of backward, go through `Waits`: the error
names the iteration, the bucket and its parameters, and, with a stall monitor, reports what is
pending and which ranks have not arrived, logged once `warn_after` has passed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from .bucket import Bucket
from .config import DEFAULT_TIMEOUT
from .device import host_runs_collectives
from .errors import ReductionTimeoutError, format_names

__all__ = ["StallMonitor", "Waits", "wait", "wait_error"]

_log = logging.getLogger("gradsync")


def wait(
    work: dist.Work, what: str | Callable[[], str], group: dist.ProcessGroup, timeout: timedelta,
    host: bool | None = None,
) -> None:
    """Every wait gradsync makes: `work.wait(timeout)`, a failure turned into an error that
    says which collective (`what`, or what it returns: built only on failure) and whether it
    timed out, judged by the clock rather than by the message's wording.

    On a device backend (NCCL) the wait is stream-side and carries no timeout: a timed one
    would hold the host until the GPU is done, and a timed-out one aborts the communicator;
    the group's own timeout and watchdog bound it instead. `host`: `host_runs_collectives(group)`,
    when the caller knows it (asking the group costs microseconds, once a bucket a step)."""
    start = time.monotonic()
    try:
        if host_runs_collectives(group) if host is None else host:
            work.wait(timeout)
        else:
            work.wait()
    except RuntimeError as error:
        timed_out = time.monotonic() - start >= 0.95 * timeout.total_seconds()
        described = what() if callable(what) else what
        raise wait_error(error, described, group, timeout, timed_out) from error


def wait_error(
    error: Exception, what: str, group: dist.ProcessGroup, timeout: timedelta, timed_out: bool
) -> ReductionTimeoutError:
    """The error for a collective that failed or timed out (built only when one did)."""
    outcome = f"did not complete within {timeout}" if timed_out else "failed"
    return ReductionTimeoutError(
        f"gradsync: rank {group.rank()}/{group.size()}: {what} {outcome}: {error}\n"
        "Another rank probably failed, stalled, or is not running the same code path (e.g. "
        "skipped a backward); check its log. If the step is legitimately slow, raise the "
        "timeout."
    )


class StallMonitor(Protocol):
    """What the Reducer asks of a stall watchdog (observability's `StallWatchdog`)."""

    warn_after: timedelta

    def mark_progress(self, iteration: int) -> None: ...

    def publish_missing(self, iteration: int, missing: list[str]) -> dict[int, list[str]]: ...

    def report(self, iteration: int, waited: timedelta,
               pending: list[tuple[int, list[str]]]) -> str: ...


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
        self._done_within: Callable[[Bucket, float], bool] = _never_asked

    def begin(self, iteration: int, timeout: timedelta, buckets: list[Bucket],
              done_within: Callable[[Bucket, float], bool] | None = None) -> None:
        """Backward has ended: the waits for `buckets` start now, watched for stalls by asking
        `done_within(bucket, seconds)` (`Reductions.done_within`; None: not watched)."""
        self.iteration, self.timeout, self._buckets = iteration, timeout, buckets
        self._done_within = done_within or _never_asked
        self._started = time.monotonic()
        self._stall_report = ""
        if self.monitor is not None and done_within is not None:
            self._watch_for_stall()

    def end(self) -> None:
        """The iteration's waits are over: let go of its buckets and of `done_within` (a bound
        method of the buckets' owner, which holds these waits: kept, the two would keep each
        other and the process group alive until the interpreter tears them down at exit)."""
        self._buckets, self._done_within = [], _never_asked

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

    def _with_pending_report(self, failure: ReductionTimeoutError,
                             bucket: Bucket | None) -> ReductionTimeoutError:
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
            if not self._done_within(bucket, max(deadline - time.monotonic(), 0.0)):
                self._stall_report = self._pending()
                _log.warning(self._stall_report)
                return

    def _pending(self, outstanding: list[Bucket] | None = None) -> str:
        assert self.monitor is not None
        if outstanding is None:
            outstanding = [b for b in self._buckets if not self._done_within(b, 0.0)]
        pending = [(b.index, [self.names[i] for i in b.param_indices]) for b in outstanding]
        waited = timedelta(seconds=time.monotonic() - self._started)
        return self.monitor.report(self.iteration, waited, pending)


def _never_asked(_bucket: Bucket, _seconds: float) -> bool:
    raise AssertionError("no iteration's buckets are being watched")
