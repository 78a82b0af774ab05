"""The end of backward: wait for every bucket, check the ranks' reports, write the averages
back into `.grad` (or leave them in the shards).

Without a used map to wait for (no unused-parameter search, no static graph) and unsharded,
each bucket is written back as soon as it has landed, so the copy into `.grad` hides under the
reductions still running (as torch's finalize_backward does). Otherwise every bucket and the
used map are waited for first, and only what some rank used is written back. Either way the
reports are checked before the last write-back, so an error leaves `.grad` alike on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from .bucket import Bucket
from .bucket_set import BucketSet
from .errors import GradSyncError
from .iteration import Iteration
from .launch import Launcher
from .missing import missing_gradients_error
from .report_checks import ReportChecks
from .settings import Settings
from .used_map import UsedMap
from .waits import Waits

__all__ = ["Finisher"]


class Finisher:
    """Lands and writes back the buckets of `buckets`; checks the reports on the way."""

    def __init__(self, settings: Settings, buckets: BucketSet, group: dist.ProcessGroup, waits: Waits,
                 used: UsedMap, checks: ReportChecks, launcher: Launcher) -> None:
        self.settings, self.set, self.group, self.waits = settings, buckets, group, waits
        self.used, self.checks, self.launcher = used, checks, launcher

    def write_back(self, it: Iteration) -> list[int] | None:
        """Every bucket landed and written back; the used map it was written with (None: all)."""
        s = self.settings
        if self.set.shards is None and not s.find_unused and s.static is None:
            self._write_back_as_landed(it)
            return None
        return self._write_back_with_used_map(it)

    def _write_back_with_used_map(self, it: Iteration) -> list[int] | None:
        """Wait for every bucket and the used map, then write back what some rank used."""
        s, buckets = self.settings, self.set.buckets
        for bucket in buckets:
            self.land(it, bucket)
        if it.chain is not None and (s.find_unused or (s.static is not None and s.static.used_map is None)):
            # Only now: a collective started earlier could interleave with the chain's.
            self.used.start(buckets[0].buffer.device, s.config.report_unused)
        if not it.ride:  # after every bucket and the used map, on every rank
            self.start_reports(it)
        used = self.used.finish(self.waits)
        self.check_reports(it)  # raises before any gradient is written back
        if s.static is not None:  # the first iteration's used map holds for good
            used = s.static.settle_used_map(used)
        # Used on some rank, every one (the common case): written back as without a map, in one
        # batch per bucket rather than parameter by parameter.
        keep = None if used is None or all(used) else used
        for bucket in buckets:
            bucket.write_back(keep, s.config.gradient_as_bucket_view)
        return used

    def _write_back_as_landed(self, it: Iteration) -> None:
        """Wait for each bucket in order and write it back at once. The reports are checked
        once the last bucket has landed, before its write-back: an error leaves the earlier
        buckets' averages in `.grad`, on every rank alike."""
        buckets = self.set.buckets
        for bucket in buckets:
            self.land(it, bucket)
            if bucket is buckets[-1]:
                if not it.ride:  # after every bucket, on every rank
                    self.start_reports(it)
                self.check_reports(it)
            bucket.write_back(None, self.settings.config.gradient_as_bucket_view)

    def land(self, it: Iteration, bucket: Bucket) -> None:
        self.set.land(bucket, it, self.waits, self.launcher.completion_recorder(it), self.settings.config.timeout)

    def start_reports(self, it: Iteration) -> None:
        """This rank's report in a small all-reduce of its own (when it cannot ride along)."""
        self.checks.start(self.set.buckets[0].buffer.device, it.micro_steps, bool(it.missing))

    def check_reports(self, it: Iteration) -> None:
        """Every rank's report: gradients missing somewhere, uneven micro-step counts."""
        accumulation = self.settings.config.check_accumulation
        if not self.settings.defer:
            self.checks.check_now(it.micro_steps, bool(it.missing), it.number, accumulation,
                                  self._missing_error(it, everyone=True))
        else:
            own = self._missing_error(it, everyone=False) if it.missing else None
            self.checks.check_later(it.number, accumulation, own)

    def _missing_error(self, it: Iteration, everyone: bool) -> Callable[[], GradSyncError]:
        def error() -> GradSyncError:
            names, params = self.set.names, self.set.params
            mine = [(self.set.bucket_of[i].index, names[i]) for i in it.missing]
            frozen = [names[i] for i in it.missing if not params[i].requires_grad]
            return missing_gradients_error(
                mine, it.number, self.group.rank(), self.group if everyone else None,
                self.settings.config.timeout, self.settings.find_unused, self.settings.static is not None,
                frozen,
            )

        return error

    def reports_ride_along(self) -> bool:
        """Whether this rank's report rides after the last bucket's gradients in its
        all-reduce (free). Not with a hook (a tiny all-reduce of its own, after every bucket),
        nor read back deferred (in int64, never saturated, no follow-up collective), nor under
        mixed precision (more elements would change how gloo sums a bucket in its own dtype,
        and torch's hook sends the gradients alone)."""
        s = self.settings
        return s.comm_hook is None and not s.divides_sums and not s.defer and self.set.buckets[-1].has_tail
