"""A joined rank's side of a synchronised iteration (uneven inputs, `join()`).

A rank that has run out of data still answers, with zeros, every collective that one
synchronised iteration of the ranks still training issues, in the same order: each bucket (or
the hook's collectives, run on zero buckets), the used map, and the reports, where it counts
0 micro-steps, which have no say in the comparison.

It runs them on its own buckets, zeroed, so the sums land where an active rank's do: in `.grad`
(as torch's joined rank does not: it drops them), or in each bucket's shard under sharded
gradients. A sharded optimizer joined beside the wrapper then steps its share with this
iteration's averages, exactly as the ranks still training step theirs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .accumulation import Reports
from .bucket import Bucket
from .bucket_set import BucketSet, settle
from .comm import HookChain
from .finish import Finisher
from .iteration import Iteration
from .settings import Settings
from .used_map import UsedMap
from .waits import Waits

__all__ = ["Joined", "shadow_iteration"]


@dataclasses.dataclass(frozen=True)
class Joined:
    """What a joined rank's shadow iteration runs through: the Reducer's units."""

    settings: Settings
    buckets: BucketSet
    group: dist.ProcessGroup
    waits: Waits
    used: UsedMap
    reports: Reports
    finisher: Finisher


def shadow_iteration(parts: Joined, it: Iteration) -> list[int] | None:
    """One iteration's collectives on zeroed buckets (`it`: no micro-step, nothing missing);
    the sums written back as an active rank's are. Returns the used map written back with."""
    buckets, s = parts.buckets.buckets, parts.settings
    for bucket in buckets:
        _zero(bucket)
    if s.comm_hook is not None and parts.buckets.shards is None:  # sharded: the buckets run it
        _shadow_hooks(parts)
    else:
        for bucket in buckets:
            _shadow_bucket(parts, it, bucket)
    used = _shadow_used_map(parts, buckets[0].buffer.device)
    if not it.ride:
        parts.finisher.start_reports(it)  # it counts 0 micro-steps, nothing missing
    parts.finisher.check_reports(it)
    for bucket in buckets:  # nothing for a sharded bucket: its sum is its shard
        if not bucket.sparse:  # a sparse one sent a dense zero: nothing of its own to take
            bucket.write_back(used, s.config.gradient_as_bucket_view)
    return used


def _zero(bucket: Bucket) -> None:
    if bucket.sparse:
        return
    if bucket.transient and not bucket.views:
        bucket.allocate()
    bucket.wire.zero_()


def _shadow_bucket(parts: Joined, it: Iteration, bucket: Bucket) -> None:
    """The bucket's collective on zeros, as `Launcher._launch` starts it, waited for."""
    if bucket.sparse:  # an active rank's sparse sum: this rank's part is a dense zero
        parts.waits(parts.group.allreduce([torch.zeros_like(bucket.buffer)]),
                    f"shadow all-reduce {bucket.index} of a joined rank")
        bucket.sparse_grad = None
        return
    s = parts.settings
    payload = bucket.launch_payload(s.config.reduce_dtype if s.scale_at_launch else None, it.divisor)
    tail = bucket.tail if it.ride else None
    work = bucket.start(parts.group, payload if tail is None else bucket.wire)
    parts.waits(work, f"shadow reduction {bucket.index} of a joined rank")
    if tail is not None:  # the active ranks' reports came back in the last bucket's tail
        parts.reports.received(tail.clone() if bucket.transient else tail)
    if bucket.collective == "reduce_scatter":  # its shard taken, its buffer back to the pool;
        settle(bucket, parts.waits, None)  # no iteration's timeline of this rank to add to


def _shadow_used_map(parts: Joined, device: torch.device) -> list[int] | None:
    """The used map with nothing used here: which parameters the active ranks used."""
    if not parts.settings.find_unused:
        return None
    parts.used.clear()
    parts.used.start(device, parts.settings.config.report_unused)
    return parts.used.finish(parts.waits)


def _shadow_hooks(parts: Joined) -> None:
    """Run the hook on the zeroed buckets: it issues the same collectives as the active
    ranks', and its results are taken as theirs are."""
    state, hook = parts.settings.comm_hook  # type: ignore[misc]
    buckets = parts.buckets.buckets
    chain = HookChain(state, hook, buckets, parts.group, [], lambda b: f"joined rank's bucket {b}", parts.settings.clock)
    chain.release(len(buckets))
    for bucket in buckets:
        bucket.accept(chain.result(bucket, parts.settings.config.timeout))
