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

import torch

from .iteration import Iteration
from .reductions import Reductions
from .used_map import UsedMap

__all__ = ["shadow_iteration"]


def shadow_iteration(reductions: Reductions, used_map: UsedMap, it: Iteration) -> list[int] | None:
    """One iteration's collectives on zeroed buckets (`it`: joined, no micro-step, nothing
    missing), started and landed in order as an active rank's are (`Reductions`: a sparse
    bucket sends a dense zero); the sums written back as an active rank's are. Returns the used
    map written back with."""
    s = reductions.settings
    buckets = reductions.buckets
    reductions.begin(it)
    for bucket in buckets:
        if bucket.transient and not bucket.views:
            bucket.allocate()
        bucket.wire.zero_()
        bucket.pending = 0
    reductions.start_ready(it)
    for bucket in buckets:
        reductions.finish(it, bucket)
    used = _shadow_used_map(reductions, used_map, buckets[0].buffer.device)
    reductions.start_reports(it)  # it counts 0 micro-steps, nothing missing
    reductions.check_reports(it)
    for bucket in buckets:  # nothing for a sharded bucket: its sum is its shard
        if not bucket.sparse:  # a sparse one sent a dense zero: nothing of its own to take
            bucket.write_back(used, s.config.gradient_as_bucket_view)
    return used


def _shadow_used_map(reductions: Reductions, used: UsedMap,
                     device: torch.device) -> list[int] | None:
    """The used map with nothing used here: which parameters the active ranks used."""
    if not reductions.settings.find_unused:
        return None
    used.clear()
    used.start(device, reductions.settings.config.report_unused)
    return used.finish(reductions.waits)
