"""The Reducer's buckets under one layout: which bucket holds each parameter and where, and
how they are reduced (all-reduce, or reduce-scatter when the gradients are sharded). Their
reductions in flight are `reductions.Reductions`'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import layout as layouts
from .bucket import Bucket, Sharding
from .bucket_shard import ReduceBy, member
from .comm import CommHook, sharded_hook_dtype
from .device import host_runs_collectives
from .pool import BufferPool

__all__ = ["BucketSet"]


class BucketSet:
    """Buckets for `params`, installed from a layout (lists of parameter indices)."""

    def __init__(self, params: Sequence[torch.Tensor], expect_sparse: Sequence[bool],
                 names: Sequence[str], dtype: torch.dtype | None, world_size: int,
                 divides_after_sum: bool) -> None:
        self.params, self.expect_sparse, self.names = list(params), list(expect_sparse), list(names)
        self.dtype, self.world_size, self.divides_after_sum = dtype, world_size, divides_after_sum
        self.buckets: list[Bucket] = []
        self.bucket_of: list[Bucket] = []  # parameter index -> its bucket
        self.position: list[int] = []  # parameter index -> its place in its bucket
        self.layout: list[list[int]] = []
        self.layout_bytes: list[int] = []
        self.shards: Sharding | None = None  # sharded gradients (`shard`)
        self.in_flight: int | None = None  # at most this many transient buckets reducing at once

    def install(self, layout: list[list[int]], as_view: bool) -> None:
        layouts.check_sparse_layout(layout, self.expect_sparse, self.names)
        # The old buckets go first: old and new together would be a gradient-sized spike.
        # (Gradients that are views of them keep their storage until adopted.)
        self.buckets, self.bucket_of = [], []
        self.buckets = layouts.make_buckets(layout, self.params, self.expect_sparse, self.dtype,
                                            self.world_size, self.shards)
        self.layout = [list(b.param_indices) for b in self.buckets]
        self.layout_bytes = [b.nbytes for b in self.buckets]
        self.bucket_of = [None] * len(self.params)  # type: ignore[list-item]
        self.position = [0] * len(self.params)
        for bucket in self.buckets:
            bucket.divides_after_sum = self.divides_after_sum
            for position, i in enumerate(bucket.param_indices):
                self.bucket_of[i] = bucket
                self.position[i] = position
            if as_view and not bucket.sparse:
                bucket.adopt_grads()

    def check_relayout(self) -> None:
        """A new layout may be installed only while the gradients are not sharded."""
        if self.shards is not None:
            raise RuntimeError(
                "install_layout: the gradients are sharded over the current buckets (a sharded "
                "optimizer holds state for each bucket's shard); the layout cannot change now"
            )

    def locate(self, index: int) -> tuple[int, int]:
        """(bucket index, position in that bucket) of parameter `index`."""
        return self.bucket_of[index].index, self.position[index]

    # ----------------------------------------------------------------------- sharding

    def shard(self, group: dist.ProcessGroup, in_flight: int | None,
              reduce_by: ReduceBy | str | None, comm_hook: tuple[object, CommHook] | None,
              casts_to_reduce_dtype: bool, as_view: bool) -> None:
        """Reduce-scatter from now on (`Reducer.shard_gradients`), as a registered averaging
        `comm_hook` does if there is one; `casts_to_reduce_dtype`: buckets cast first. Without
        bucket views (`as_view`) the buckets are transient: a buffer lives from its fill until its
        reduce-scatter has completed, and with `in_flight` no more than that many are reducing at
        once (backward waits for the oldest: memory bounded at the cost of overlap where the
        network is slower than backward). `reduce_by` (`ReduceBy`, or its string):
        "reduce_scatter" (the default on device backends), "all_to_all" (the default on host
        backends, gloo, whose all-to-all beats its reduce-scatter and all-reduce) or "all_reduce"
        (each bucket reduced whole, the shard copied out: DDP's very sums at any world size, where
        all-to-all's rank-order sum differs from gloo's ring in the last bit beyond 2 ranks)."""
        if in_flight is not None and in_flight < 1:
            raise ValueError(f"shard_gradients(in_flight={in_flight}): expected at least 1, "
                             "or None for no limit")
        dtype = None
        if comm_hook is not None:
            try:
                dtype = sharded_hook_dtype(comm_hook[0], comm_hook[1], group)
            except ValueError as error:
                raise ValueError(f"gradsync: cannot shard the gradients: {error}") from None
        if any(self.expect_sparse):
            raise ValueError("gradsync: cannot shard the gradients: some parameters get sparse "
                             "gradients")
        if reduce_by is None:
            reduce_by = (ReduceBy.ALL_TO_ALL if host_runs_collectives(group)
                         else ReduceBy.REDUCE_SCATTER)
        reduce_by = member(ReduceBy, reduce_by, f"shard_gradients(reduce_by={reduce_by!r})")
        transient = not as_view
        # Transient buffers are lent: as many as can be live at once (those reducing and the
        # one filling) stay warm between steps (`BufferPool`).
        keep = in_flight + 1 if in_flight is not None else 2
        # A cast beside each buffer, and a receive buffer for an all-to-all.
        per_bucket = ((2 if casts_to_reduce_dtype or dtype is not None else 1)
                      + (reduce_by is ReduceBy.ALL_TO_ALL))
        pool = BufferPool(keep=per_bucket * keep) if transient else None
        self.shards = Sharding(group.rank(), transient, reduce_by, pool, comm_hook is not None,
                               dtype)
        self.in_flight = in_flight

    def reduce_as_hook(self, state: object, hook: CommHook, group: dist.ProcessGroup) -> None:
        """Sharded buckets reduce as `hook`, a registered averaging hook, does (in its dtype)."""
        assert self.shards is not None
        try:
            hook_dtype = sharded_hook_dtype(state, hook, group)
        except ValueError as error:
            raise ValueError(f"register_comm_hook: the gradients are sharded; {error}") from None
        if self.shards.pool is not None and hook_dtype is not None:
            self.shards.pool.keep *= 2  # a cast beside each buffer
        self.shards = dataclasses.replace(self.shards, hooked=True, hook_dtype=hook_dtype)
        for bucket in self.buckets:  # in place: a sharded optimizer holds views of their shards
            bucket.reduce_as_hook(hook_dtype)

    @property
    def pool(self) -> BufferPool | None:
        return self.shards.pool if self.shards is not None else None
