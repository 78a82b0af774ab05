"""Bucket layouts: building the buckets of a layout, and the one-time rebuild in ready order.

torch's DDP starts with one bucket in reverse definition order (or capped buckets when it
searches for unused parameters), then rebuilds once, in the order gradients became ready in a
real iteration: rank 0's order, broadcast, so every rank installs the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .bucket import Bucket, Sharding, carries_tail
from .bucketing import compute_bucket_assignment_by_size
from .collectives import broadcast_tensors
from .errors import format_names
from .timeline import EventKind, IterationTimeline

__all__ = ["check_sparse_layout", "make_buckets", "priority_tail", "rebuilt_layout"]


def make_buckets(
    layout: list[list[int]],
    params: Sequence[torch.Tensor],
    sparse: Sequence[bool],
    dtype: torch.dtype | None,
    world_size: int,
    shards: Sharding | None = None,
) -> list[Bucket]:
    """The buckets of `layout`, all-reduced or, with `shards`, reduce-scattered. The last one
    carries one element per rank after its gradients, where each rank's report rides
    (`reports`), if its reduction can carry it (`carries_tail`)."""
    last = len(layout) - 1

    def tail(b: int, indices: list[int]) -> int:
        rides = b == last and world_size > 1 and carries_tail(shards, sparse[indices[0]])
        return world_size if rides else 0

    return [Bucket(b, indices, params, sparse=sparse[indices[0]], dtype=dtype,
                   tail=tail(b, indices), world_size=world_size, sharding=shards)
            for b, indices in enumerate(layout)]


def priority_tail(
    layout: list[list[int]], params: Sequence[torch.Tensor], sparse: Sequence[bool],
    tail_bytes: int, chunk_bytes: int,
) -> tuple[list[list[int]], list[int]]:
    """`layout` with its last `tail_bytes` of gradients (to the nearest parameter boundary)
    cut into buckets (chunks) of at most `chunk_bytes` each (a larger parameter is a chunk of
    its own), and the order to start the buckets in: those before the tail as they fill, then
    the tail's, once all are full, nearest the input first.

    In ready order the last buckets hold the parameters nearest the input: ready last in
    backward, needed first by the next forward. Sent last in ready order they are the
    communication tail; sent nearest-first, the next forward's first modules wait only for
    their own chunks. A pure function of the layout: the same on every rank."""
    nbytes = [p.numel() * p.element_size() for p in params]
    head: list[list[int]] = []
    tail: list[int] = []  # the tail's parameters, in ready order
    budget = tail_bytes
    for bucket in reversed(layout):
        if budget <= 0 or any(sparse[i] for i in bucket):
            head.insert(0, bucket)
            budget = 0
            continue
        # A parameter joins while that brings the tail nearer `tail_bytes`: a large one beyond
        # stays in the head, sent as it is ready (held, it idled the link through backward).
        cut = len(bucket)
        while cut > 0 and nbytes[bucket[cut - 1]] < 2 * budget:
            cut -= 1
            budget -= nbytes[bucket[cut]]
        tail[:0] = bucket[cut:]
        if cut:  # the tail ends inside this bucket
            head.insert(0, bucket[:cut])
            budget = 0
    chunks: list[list[int]] = []
    kind = [(p.dtype, p.device) for p in params]  # a bucket holds one dtype on one device
    filled = 0  # bytes in the last chunk
    for i in tail:
        if chunks and kind[chunks[-1][0]] == kind[i] and filled + nbytes[i] <= chunk_bytes:
            chunks[-1].append(i)
            filled += nbytes[i]
        else:
            chunks.append([i])
            filled = nbytes[i]
    order = list(range(len(head))) + list(range(len(head) + len(chunks) - 1, len(head) - 1, -1))
    return head + chunks, order


def check_sparse_layout(layout: Sequence[Sequence[int]], sparse: Sequence[bool],
                        names: Sequence[str]) -> None:
    if len(sparse) != len(names):
        raise ValueError(f"expect_sparse_gradient has {len(sparse)} flags for {len(names)} "
                         "parameters")
    for b, indices in enumerate(layout):
        if len(indices) > 1 and any(sparse[i] for i in indices):
            raise ValueError(
                f"bucket {b} puts a parameter with a sparse gradient "
                f"({format_names([names[i] for i in indices])}) with others; a sparse "
                "gradient is reduced on its own, so give it a bucket of its own"
            )


def rebuilt_layout(
    last: IterationTimeline | None,
    params: Sequence[torch.Tensor],
    sparse: Sequence[bool],
    limits: Sequence[int],
    group: dist.ProcessGroup,
    timeout: timedelta,
) -> list[list[int]] | None:
    """The layout in rank 0's ready order of `last` (its unused parameters, which torch hears
    of only at the end, last); None, on every rank alike, if rank 0 did not see them all."""
    local = ([i for _, i in last.order(EventKind.READY)]
             + [i for _, i in last.order(EventKind.UNUSED)] if last else [])
    order = _broadcast_order(local, len(params), params[0].device, group, timeout)
    if sorted(order) != list(range(len(params))):
        return None
    layout, _ = compute_bucket_assignment_by_size([params[i] for i in order], list(limits), sparse,
                                                  order)
    return layout


def _broadcast_order(
    order: list[int], n: int, device: torch.device, group: dist.ProcessGroup, timeout: timedelta
) -> list[int]:
    t = torch.full((n,), -1, dtype=torch.int64, device=device)
    if len(order) == n:
        t.copy_(torch.tensor(order, dtype=torch.int64))
    broadcast_tensors(group, [t], 0, timeout, "broadcast of rank 0's bucket order")
    return t.tolist()
