"""A joined rank's side of a synchronised iteration (uneven inputs, `join()`).

A rank that has run out of data still answers, with zeros, every collective that one
synchronised iteration of the ranks still training issues, in the same order: each bucket (or
the hook's collectives, run on zero buckets), the used map, and the reports, where it counts
0 micro-steps, which have no say in the comparison.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .bucket import Bucket
from .comm import HookChain

if TYPE_CHECKING:
    from .reducer import Reducer

__all__ = ["shadow_iteration"]


def shadow_iteration(reducer: Reducer) -> None:
    reducer._rebuild_if_due()
    reducer._missing, reducer._micro_steps = [], 0
    reducer._waits.begin(reducer.iteration, reducer.config.timeout, [], watch=False)
    ride = reducer._reports_ride_along()
    device = reducer.buckets[0].buffer.device
    if reducer.comm_hook is not None:
        _shadow_hooks(reducer)
    else:
        zeros = [torch.zeros_like(b.wire if ride else b.buffer) for b in reducer.buckets]
        for i, tensor in enumerate(zeros):
            reducer._waits(reducer.process_group.allreduce([tensor]), f"shadow all-reduce {i} of a joined rank")
        if ride:  # the active ranks' reports came back in the last bucket's tail
            last = reducer.buckets[-1]
            reducer._reports.received(zeros[-1].narrow(0, last.buffer.numel(), reducer.world_size))
        _shadow_used_map(reducer, device)
    if not ride:
        reducer._reports.start(device, 0, False)
    reducer._check_reports()


def _shadow_used_map(reducer: Reducer, device: torch.device) -> None:
    if reducer._find_unused:
        used = torch.zeros(len(reducer.params), dtype=torch.int32, device=device)
        reducer._waits(reducer.process_group.allreduce([used]), "joined rank's used map")


def _shadow_hooks(reducer: Reducer) -> None:
    """Run the hook on zero buckets: it issues the same collectives as the active ranks'."""
    zero = [Bucket(b.index, b.param_indices, reducer.params, dtype=reducer.config.bucket_dtype) for b in reducer.buckets]
    state, hook = reducer.comm_hook  # type: ignore[misc]
    chain = HookChain(
        state, hook, zero, reducer.process_group, [], lambda b: f"joined rank's bucket {b}", reducer._clock
    )
    chain.release(len(zero))
    for bucket in zero:
        chain.result(bucket, reducer.config.timeout)
    _shadow_used_map(reducer, zero[0].buffer.device)
