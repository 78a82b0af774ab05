"""A bucket's shard: this rank's slice of a reduce-scatter's sum, how it is reduced, and the
memory a sharded bucket holds only for a while.

`Bucket` owns one and keeps the gradients; this is the rest of a reduce-scatter. It starts
the collective on the bucket's (padded) wire: the backend's reduce-scatter, or an all-to-all
and a local sum in rank order (`take`); it casts the wire first for a reduce dtype or a
compression hook's; and it lends a transient bucket its buffers from a `BufferPool` (the wire,
the cast, the all-to-all's receive buffer) and gives them back once the reduction has landed
(`release`). An all-reduce bucket's shard is empty, and only its wire is allocated here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

import torch

from .pool import BufferPool

__all__ = ["BucketShard", "ReduceBy", "as_real", "member", "scaled_into"]

_Mode = TypeVar("_Mode", bound=enum.Enum)


def as_real(tensor: torch.Tensor) -> torch.Tensor:
    """A flat complex tensor as the real one it is made of (twice the elements), others as they
    are: gloo's all-gather and all-to-all refuse complex tensors, and what torch's own
    `torch.distributed` functions do for them is this view."""
    return torch.view_as_real(tensor).view(-1) if tensor.is_complex() else tensor


class ReduceBy(str, enum.Enum):
    """How a reduce-scatter bucket is reduced."""

    REDUCE_SCATTER = "reduce_scatter"  # the backend's own (the device backends')
    # An all-to-all and a local sum in rank order: gloo's fastest way, with half the bytes of an
    # all-reduce (figures: docs/benchmarks/design-figures.md#gloo-all-to-all).
    ALL_TO_ALL = "all_to_all"
    ALL_REDUCE = "all_reduce"  # the whole bucket, the shard copied out: DDP's very sums at any size



def member(kind: type[_Mode], value: object, what: str) -> _Mode:
    """`value` as a member of `kind` (given as the member or its string), or a ValueError
    saying `what` was given and the values it may take."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{what}: expected one of {', '.join(m.value for m in kind)}") from None


class BucketShard:
    """This rank's shard of a bucket's `wire_numel` (padded) elements, `numel` of them gradients."""

    def __init__(self, numel: int, wire_numel: int, device: torch.device, shard_dtype: torch.dtype,
                 world_size: int, rank: int, reduce_by: ReduceBy, pool: BufferPool | None,
                 scattered: bool) -> None:
        self.numel, self.wire_numel, self.device = numel, wire_numel, device
        # A reduce-scatter's result: this rank's slice of the summed (padded) buffer, in the
        # parameters' own dtype (under mixed precision the bucket's is the compute dtype): the
        # sharded optimizer steps the parameters with views of it. Empty unless `scattered`.
        chunk = wire_numel // world_size if scattered else 0
        self.shard = torch.zeros(chunk, dtype=shard_dtype, device=device)
        self.offset = rank * chunk
        self.rank, self.world_size = rank, world_size
        # On gloo each rank sends each shard to its owner by an all-to-all and sums what it
        # receives (`take`; `ReduceBy`): gloo's reduce-scatter copies its input and is slower
        # (figures: docs/benchmarks/design-figures.md#gloo-all-to-all).
        self.reduce_by = reduce_by
        self.pool = pool  # lends a transient bucket's buffers (None: each allocated anew)
        self.hook_dtype: torch.dtype | None = None  # a compression hook's (`Bucket.reduce_as_hook`)
        self.lent: torch.Tensor | None = None  # the pool's buffer the bucket's wire is a view of
        # With a cast (a reduce dtype, a hook's): the cast (padded) is what is reduced, and the
        # reduce-scatter's result in that dtype.
        self.cast_wire: torch.Tensor | None = None
        self.cast_lent: torch.Tensor | None = None
        self.cast_shard: torch.Tensor | None = None
        self.received: torch.Tensor | None = None  # all-to-all: the ranks' parts of this shard
        self.received_lent: torch.Tensor | None = None
        self.own: torch.Tensor | None = None  # all-to-all: this rank's part, left where it lies

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, stop) of this rank's shard in the bucket's gradients: where its gradients
        lie, short of the padding (empty for a rank whose whole shard is padding)."""
        start = min(self.offset, self.numel)
        return start, min(start + self.shard.numel(), self.numel)

    @property
    def holds_memory(self) -> bool:
        """A cast or a receive buffer is held (a reduction in flight, or not yet released)."""
        return self.cast_wire is not None or self.received is not None

    # ------------------------------------------------------------------ memory

    def lend_wire(self, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `wire_numel` elements for the bucket's wire, lent by the pool if there is
        one (not zeroed: the bucket writes what it reads)."""
        if self.pool is None:
            return torch.empty(self.wire_numel, dtype=dtype, device=self.device)
        self.lent = self.pool.take(self.wire_numel, dtype, self.device)
        return self.lent.narrow(0, 0, self.wire_numel)

    def give_wire(self, reusable: bool) -> None:
        """The bucket dropped its wire: back to the pool if `reusable`."""
        if self.lent is not None and reusable and self.pool is not None:
            self.pool.give(self.lent)
        self.lent = None

    def release(self, reusable: bool) -> None:
        """Drop the cast and the receive buffer; back to the pool if `reusable` (the collective
        has been waited for)."""
        if self.cast_lent is not None and reusable and self.pool is not None:
            self.pool.give(self.cast_lent)
        if self.received_lent is not None and reusable and self.pool is not None:
            self.pool.give(self.received_lent)
        self.cast_lent = self.cast_wire = self.cast_shard = None
        self.received = self.received_lent = self.own = None

    def drop_cast(self) -> None:
        """A persistent bucket's cast, once its shard is taken (a transient one's: `release`)."""
        self.cast_wire = self.cast_shard = None

    def cast(self, buffer: torch.Tensor, dtype: torch.dtype, divisor: int,
             reciprocal: bool) -> torch.Tensor:
        """`buffer` cast to `dtype` and divided there (`reciprocal`: multiplied by 1/divisor, as
        the all-reduce path's cast is (not at all for 1); else divided, as torch's hooks
        do). The cast, padded, is what is reduced from now on; returned without the padding."""
        padded, numel = self.wire_numel, self.numel
        if self.pool is not None:
            self.cast_lent = self.pool.take(padded, dtype, self.device)
            self.cast_wire = self.cast_lent.narrow(0, 0, padded)
        else:
            self.cast_wire = torch.empty(padded, dtype=dtype, device=self.device)
        cast = self.cast_wire.narrow(0, 0, numel)
        if reciprocal:
            scaled_into(buffer, divisor, cast)
        else:
            cast.copy_(buffer).div_(divisor)
        if padded > numel:
            self.cast_wire.narrow(0, numel, padded - numel).zero_()
        return cast

    # ------------------------------------------------------------------ reducing

    def start(self, group: torch.distributed.ProcessGroup,
              wire: torch.Tensor) -> torch.distributed.Work:
        """Reduce-scatter the cast if there is one, else `wire`, into the shard."""
        source = self.cast_wire if self.cast_wire is not None else wire
        if self.reduce_by is ReduceBy.ALL_TO_ALL:
            return self._all_to_all(group, source)
        target = self.shard
        if source.dtype != self.shard.dtype:  # summed in its own dtype, taken into the shard's
            target = self.cast_shard = torch.empty(self.shard.numel(), dtype=source.dtype,
                                                   device=self.device)
        return group._reduce_scatter_base(as_real(target), as_real(source),
                                          torch.distributed.ReduceScatterOptions())

    def _all_to_all(self, group: torch.distributed.ProcessGroup,
                    source: torch.Tensor) -> torch.distributed.Work:
        """Send each rank its part of `source` and receive every rank's part of this rank's
        shard. The first and last ranks send nothing to themselves (what they would send lies
        outside one contiguous run only for the others): they receive N-1 parts, not N, so
        at 2 ranks a bucket in flight holds half a bucket more, not a whole one."""
        chunk, rank, world = self.shard.numel(), self.rank, self.world_size
        self.own = None
        if world > 1 and rank in (0, world - 1):
            self.own = source.narrow(0, rank * chunk, chunk)
            send = source.narrow(0, chunk if rank == 0 else 0, (world - 1) * chunk)
            splits = [0 if r == rank else chunk for r in range(world)]
        else:
            send, splits = source, [chunk] * world
        self.received = self._receive_buffer(send.numel(), source)
        if source.is_complex():  # sent as the real numbers it is made of: two each
            splits = [2 * n for n in splits]
        return group.alltoall_base(as_real(self.received), as_real(send), splits, splits,
                                   torch.distributed.AllToAllOptions())

    def _receive_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """Where an all-to-all lands: the ranks' parts of this shard, in rank order."""
        if self.pool is not None:
            self.received_lent = self.pool.take(numel, like.dtype, like.device)
            return self.received_lent.narrow(0, 0, numel)
        # kept: a persistent bucket
        if self.received_lent is None or self.received_lent.dtype != like.dtype:
            self.received_lent = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self.received_lent.narrow(0, 0, numel)

    def take(self, payload: torch.Tensor, by_all_reduce: bool,
             divided: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the collective: this rank's shard of the sum (already there unless reduced by
        all-reduce, whose whole result is `payload`), `divided` as the bucket divides a sum."""
        start, stop = self.shard_range
        if self.received is not None:
            self._sum_received(self.received, divided)
        elif by_all_reduce:  # the payload: the buffer, or its cast (a hook, mixed precision)
            if stop > start:
                self.shard.narrow(0, 0, stop - start).copy_(
                    divided(payload.narrow(0, start, stop - start)))
        elif self.cast_shard is not None:
            self.shard.copy_(divided(self.cast_shard))
        elif stop > start:  # summed into the shard itself, in its dtype
            divided(self.shard)

    def _sum_received(self, received: torch.Tensor,
                      divided: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The shard: the ranks' parts added in rank order, in their dtype (as the collective
        would sum), then taken into the shard's. At 2 ranks one addition: all-reduce's sum."""
        parts = list(received.view(-1, self.shard.numel()))
        if self.own is not None:  # this rank's own part was not sent: it is first or last
            parts.insert(0 if self.rank == 0 else len(parts), self.own)
        if len(parts) == 1:  # world size 1
            self.shard.copy_(divided(parts[0]))
            return
        total = self.shard if received.dtype == self.shard.dtype else torch.empty_like(parts[0])
        torch.add(parts[0], parts[1], out=total)
        for part in parts[2:]:
            total.add_(part)
        divided(total)
        if total is not self.shard:
            self.shard.copy_(total)


def scaled_into(source: torch.Tensor, divisor: int, out: torch.Tensor) -> torch.Tensor:
    """`out` = `source` times 1/`divisor`, in `out`'s dtype; a plain copy for divisor 1."""
    if divisor != 1:
        return torch.mul(source, 1.0 / divisor, out=out)
    return out.copy_(source)
