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

from typing import TYPE_CHECKING

import torch

from .comm import HookChain

if TYPE_CHECKING:
    from .bucket import Bucket
    from .reducer import Reducer

__all__ = ["shadow_iteration"]


def shadow_iteration(reducer: Reducer) -> None:
    reducer._rebuild_if_due()
    reducer._missing, reducer._micro_steps = [], 0
    reducer._waits.begin(reducer.iteration, reducer.config.timeout, [], watch=False)
    ride = reducer._reports_ride_along()
    device = reducer.buckets[0].buffer.device
    try:
        for bucket in reducer.buckets:
            _zero(bucket)
        if reducer.comm_hook is not None and not reducer.sharded:  # sharded: the buckets run it
            _shadow_hooks(reducer)
        else:
            for bucket in reducer.buckets:
                _shadow_bucket(reducer, bucket, ride)
        used = _shadow_used_map(reducer, device)
        if not ride:
            reducer._start_reports()  # it counts 0 micro-steps, nothing missing
        reducer._check_reports()
        for bucket in reducer.buckets:  # nothing for a sharded bucket: its sum is its shard
            if not bucket.sparse:  # a sparse one sent a dense zero: nothing of its own to take
                bucket.write_back(used, reducer.config.gradient_as_bucket_view)
        reducer.last_used, reducer.reductions = used, reducer.reductions + 1
    finally:
        reducer._clear_reduction()


def _zero(bucket: Bucket) -> None:
    if bucket.sparse:
        return
    if bucket.transient and not bucket.views:
        bucket.allocate()
    bucket.wire.zero_()


def _shadow_bucket(reducer: Reducer, bucket: Bucket, ride: bool) -> None:
    """The bucket's collective on zeros, as `Reducer._launch_ready` starts it, waited for."""
    if bucket.sparse:  # an active rank's sparse sum: this rank's part is a dense zero
        reducer._waits(reducer.process_group.allreduce([torch.zeros_like(bucket.buffer)]),
                       f"shadow all-reduce {bucket.index} of a joined rank")
        bucket.sparse_grad = None
        return
    payload = bucket.launch_payload(reducer.config.reduce_dtype if reducer._scale_at_launch else None,
                                    reducer._divisor)
    tail = bucket.tail if ride else None
    work = bucket.start(reducer.process_group, payload if tail is None else bucket.wire)
    reducer._waits(work, f"shadow reduction {bucket.index} of a joined rank")
    if tail is not None:  # the active ranks' reports came back in the last bucket's tail
        reducer._reports.received(tail.clone() if bucket.transient else tail)
    if bucket.collective == "reduce_scatter":  # its shard taken, its buffer back to the pool;
        reducer._settle(bucket, record=False)  # no iteration's timeline of this rank to add to


def _shadow_used_map(reducer: Reducer, device: torch.device) -> list[int] | None:
    """The used map with nothing used here: which parameters the active ranks used."""
    if not reducer._find_unused:
        return None
    reducer._used.clear()
    reducer._used.start(device, reducer.config.report_unused)
    return reducer._used.finish(reducer._waits)


def _shadow_hooks(reducer: Reducer) -> None:
    """Run the hook on the zeroed buckets: it issues the same collectives as the active
    ranks', and its results are taken as theirs are."""
    state, hook = reducer.comm_hook  # type: ignore[misc]
    chain = HookChain(
        state, hook, reducer.buckets, reducer.process_group, [], lambda b: f"joined rank's bucket {b}", reducer._clock
    )
    chain.release(len(reducer.buckets))
    for bucket in reducer.buckets:
        bucket.accept(chain.result(bucket, reducer.config.timeout))
