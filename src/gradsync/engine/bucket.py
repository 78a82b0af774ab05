"""A bucket: one flat, contiguous gradient buffer and the parameters whose gradients live in it.

Layered nouns: the buffer owns the memory; each parameter gets a view of it with the parameter's
shape (and strides, for channels-last tensors), at its offset. The bucket fills itself with the
gradients (or lets `.grad` be the view), starts its collective, and writes the results back.

Its collective is an all-reduce (every rank gets the whole sum: data-parallel training) or a
reduce-scatter (each rank gets only its `shard` of the sum: the seam for sharded optimizers; the
buffer is then padded to a multiple of the world size, and what a rank does with its shard is
the optimizer's business, not `write_back`'s). The shard, its collective and the memory a
transient bucket holds only for a while are a `BucketShard` (`bucket_shard.py`) the bucket owns.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .bucket_shard import BucketShard, ReduceBy, member, scaled_into
from .pool import BufferPool

__all__ = ["FUSED_COPY_MIN_NUMEL", "Bucket", "Collective", "ReduceBy", "Sharding", "carries_tail",
           "is_dense_permutation", "view_like"]


class Collective(str, enum.Enum):
    """A bucket's collective: every rank gets the whole sum, or only its shard of it."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"


# Gradients at least this large are scaled while copied into their bucket, one pass each;
# smaller ones are copied in one batched call and scaled with the whole buffer.
FUSED_COPY_MIN_NUMEL = 1 << 15


@dataclass(frozen=True)
class Sharding:
    """How a reducer's buckets are reduce-scattered (`Reducer.shard_gradients`)."""

    rank: int  # whose shard each bucket keeps
    transient: bool  # a buffer only from its fill until its reduction has landed
    reduce_by: ReduceBy
    pool: BufferPool | None = None  # lends transient buffers (else each is allocated anew)
    # Reduced as torch's averaging hooks do (`comm.sharded_hook_dtype`): cast to `hook_dtype`
    # (None: no cast), divided there by the world size, then summed.
    hooked: bool = False
    hook_dtype: torch.dtype | None = None


def carries_tail(sharding: Sharding | None, sparse: bool = False) -> bool:
    """Whether a bucket reduced so can carry elements after its gradients: an all-reduce of a
    dense buffer can (every rank gets every element back); a reduce-scatter cannot, nor a
    hook's reduction, which may send anything."""
    if sharding is None:
        return not sparse
    return sharding.reduce_by is ReduceBy.ALL_REDUCE and not sharding.hooked


class Bucket:
    """Flat gradient storage for a group of parameters of one dtype on one device."""

    def __init__(
        self,
        index: int,
        param_indices: Sequence[int],
        params: Sequence[torch.Tensor],
        sparse: bool = False,
        dtype: torch.dtype | None = None,
        tail: int = 0,
        world_size: int = 1,
        sharding: Sharding | None = None,
    ):
        """All-reduced, or with `sharding` reduce-scattered as it says. `tail`: elements after
        the gradients where small per-rank counts ride (`reports`; `carries_tail` says which
        bucket can); `dtype` differs from the parameters' under mixed precision, where
        gradients arrive in the low-precision compute dtype."""
        self.collective = Collective.ALL_REDUCE if sharding is None else Collective.REDUCE_SCATTER
        shards = sharding or Sharding(rank=0, transient=False, reduce_by=ReduceBy.REDUCE_SCATTER)
        reduce_by = member(ReduceBy, shards.reduce_by, f"reduce_by={shards.reduce_by!r}")
        if sharding is not None and (sparse or (tail and not carries_tail(sharding))):
            raise ValueError("a reduce-scatter bucket holds dense gradients only, and no tail "
                             "(unless reduced by all-reduce without a hook)")
        self.index, self.transient = index, shards.transient
        self._take_params(param_indices, params, sparse)
        self._dtype, self._device = dtype or self.params[0].dtype, self.params[0].device
        self._size_wire(tail, world_size)
        self._make_shard(world_size, shards.rank, reduce_by, shards.pool)
        self.hooked = False
        if shards.hooked:
            self.reduce_as_hook(shards.hook_dtype)
        self.views: list[torch.Tensor] = []
        if self.transient:
            self.release()
        else:
            self.allocate()
        self._start_state()

    def _take_params(self, param_indices: Sequence[int], params: Sequence[torch.Tensor],
                     sparse: bool) -> None:
        """The parameters, where their gradients lie in the buffer, and which are copied early."""
        self.param_indices = list(param_indices)
        self.params = [params[i] for i in self.param_indices]
        # A parameter with a sparse gradient has a bucket of its own and no flat buffer: the
        # sparse gradient itself is reduced, and the result replaces `.grad`.
        self.sparse = sparse
        self.lengths = [0 if sparse else p.numel() for p in self.params]
        self.offsets = _running_offsets(self.lengths)
        self.numel = sum(self.lengths)
        self.all_small = all(n < FUSED_COPY_MIN_NUMEL for n in self.lengths)
        # Large gradients are copied in at their own hook (`copy_early`), as torch copies each
        # at its hook: the bucket's launch then waits only for its last gradient's copy, not
        # for a pass over the whole bucket. Small ones wait for the fill, copied in one batch.
        self.early = [n >= FUSED_COPY_MIN_NUMEL for n in self.lengths]
        # The fill walks only the positions it must: the small ones, and the large ones only
        # while some was not taken at its hook (a per-parameter Python loop is the fill's cost).
        self._late = [j for j, large in enumerate(self.early) if not large]
        self._early = [j for j, large in enumerate(self.early) if large]
        self._copied = [False] * len(self.params)
        self._n_copied = 0
        self._unaliased = [False] * len(self.params)  # read only: no gradient is a view of ours
        # Whether some gradients are copied in at their hooks (`copy_early`): a dense bucket of
        # several parameters whose buffer lives across iterations (read on the hot path).
        self.copies_early = (not sparse and not self.transient and len(self.params) > 1
                             and any(self.early))

    def _size_wire(self, tail: int, world_size: int) -> None:
        """`wire` is what an all-reduce can send: the gradients (`buffer`) plus `tail` extra
        elements after them, where the Reducer lets small per-rank counts ride along; a
        reduce-scatter's is padded to a multiple of the world size."""
        numel = self.numel
        padded = (-(-numel // world_size) * world_size
                  if self.collective is Collective.REDUCE_SCATTER else numel)
        self._wire_numel, self._tail_numel = max(padded, numel + tail), tail

    def _make_shard(self, world_size: int, rank: int, reduce_by: ReduceBy,
                    pool: BufferPool | None) -> None:
        """The shard and its reduction (`BucketShard`). A transient bucket (sharded gradients)
        holds its buffer only from its fill until its reduce-scatter has completed, lent by
        `pool`: gradient memory is then the shards plus the buckets in flight, not a second
        copy of every gradient."""
        self._sharded = BucketShard(
            self.numel, self._wire_numel, self._device, self.params[0].dtype, world_size, rank,
            reduce_by, pool if self.transient else None,
            scattered=self.collective is Collective.REDUCE_SCATTER,
        )
        self.shard, self.shard_offset = self._sharded.shard, self._sharded.offset
        self.reduce_by = reduce_by

    def _start_state(self) -> None:
        """The per-iteration state (`reset` clears it) and how the sum is divided."""
        self.sparse_grad: torch.Tensor | None = None
        # What is all-reduced when it is not the buffer itself (sparse gradient, or the buffer
        # cast to a separate reduce dtype); the reduced values are read back from it.
        self.payload: torch.Tensor = self.buffer
        self.pending = len(self.params)  # gradients still to come this iteration
        self._cast: torch.Tensor | None = None  # the buffer in the reduce dtype (mixed precision)
        # Mixed precision (the Reducer sets it) reduces as torch's
        # `_reducer_allreduce_and_upcast_hook`: the gradients go in undivided, are summed (cast to
        # the reduce dtype first, if it differs), and the sum is divided in the dtype it was
        # summed in once landed (`_divided`): at 3 ranks and more, dividing first would round
        # differently.
        self.divides_after_sum = False
        self._sum_divisor = 1  # this iteration's, until its sum has been divided (1: nothing to)

    @property
    def by_all_reduce(self) -> bool:
        """A reduce-scatter bucket reduced whole by all-reduce, its shard copied out."""
        return self.reduce_by is ReduceBy.ALL_REDUCE

    @property
    def nbytes(self) -> int:
        return self.numel * self._dtype.itemsize

    @property
    def has_tail(self) -> bool:
        """Whether the wire carries the per-rank reports after the gradients (a transient
        bucket's `tail` exists only while its buffer does)."""
        return self._tail_numel > 0

    def allocate(self) -> None:
        """Give the bucket its buffer and the views. The buffer is not zeroed, new or lent by
        the pool (as torch's reducer allocates with `empty`): `fill` writes every view, zeros
        where a gradient is missing. Only what lies past the gradients (padding, tail) is."""
        self.wire = self._sharded.lend_wire(self._dtype)
        if self._wire_numel > self.numel:
            self.wire.narrow(0, self.numel, self._wire_numel - self.numel).zero_()
        self.buffer = (self.wire.narrow(0, 0, self.numel) if self._wire_numel != self.numel
                       else self.wire)
        self.tail = self.wire.narrow(0, self.numel, self._tail_numel) if self._tail_numel else None
        self.payload = self.buffer
        self.views = [
            view_like(self.buffer, offset, p) for offset, p in zip(self.offsets, self.params)
        ] if not self.sparse else []

    def release(self, reusable: bool = True) -> None:
        """Drop a transient bucket's buffers; back to the pool if `reusable` (its collective
        has been waited for: nothing but a view still unread, such as the tail, refers to it)."""
        self._drop_buffer(reusable)
        self._sharded.release(reusable)
        self.payload = self.buffer

    def _drop_buffer(self, reusable: bool) -> None:
        self._sharded.give_wire(reusable)
        self.wire = self.buffer = torch.empty(0, dtype=self._dtype, device=self._device)
        self.tail, self.views = None, []

    def reduce_as_hook(self, dtype: torch.dtype | None) -> None:
        """From now on reduce as torch's averaging hooks do, in `dtype` (`Sharding.hooked`):
        the buffer cast (padded) is what is reduced, and goes once cast (`_hooked_payload`)."""
        self.hooked, self._sharded.hook_dtype = True, dtype if dtype != self._dtype else None

    @property
    def holds_memory(self) -> bool:
        """A transient bucket between its fill and the landing of its reduction."""
        return bool(self.views) or self._sharded.holds_memory

    # ------------------------------------------------------------------ filling and writing back

    def copy_early(self, position: int, divisor: int, as_view: bool) -> None:
        """Copy the gradient at `position` in now, before the bucket is full, divided exactly
        as `fill` would divide it; `fill` then skips it."""
        grad = self.params[position].grad
        if grad is None:
            return  # zeroed by the fill
        view = self.views[position]
        _scale_into(grad, view, as_view and _aliases(grad, view), divisor)
        self._copied[position] = True
        self._n_copied += 1

    def fill(self, divisor: int, as_view: bool) -> None:
        """Copy the parameters' gradients in (those not taken already), divided by `divisor`
        (1: copied as they are, for a hook or a cast that averages later), zeros where a
        parameter has none. With `copy_early`, the only way gradients enter a bucket."""
        if self.transient and not self.views:
            self.allocate()
        grads = [p.grad for p in self.params]
        aliased = ([g is not None and _aliases(g, v) for g, v in zip(grads, self.views)]
                   if as_view else self._unaliased)
        if self._n_copied:
            self._fill_rest(grads, aliased, divisor)
        elif not any(aliased) and not any(g is not None and g.requires_grad for g in grads):
            _copy_in(self.views, grads, divisor, self.buffer if self.all_small else None)
        elif all(aliased):
            if divisor != 1:
                self.buffer.div_(divisor)
        else:  # some gradients are the views already, or carry a graph (create_graph=True)
            for g, v, alias in zip(grads, self.views, aliased):
                _scale_into(g, v, alias, divisor)
        if as_view:
            self.view_grads([g is not None and not a for g, a in zip(grads, aliased)])
        elif self.transient:  # the bucket holds them now; each rank will keep only its shard
            for param in self.params:
                param.grad = None

    def _fill_rest(self, grads: list[torch.Tensor | None], aliased: list[bool],
                   divisor: int) -> None:
        """The fill of a bucket some of whose gradients were taken at their hooks."""
        views, batch, bucket_views = [], [], self.views
        for j in self._late:
            grad = grads[j]
            if grad is None or aliased[j] or grad.requires_grad:
                _scale_into(grad, bucket_views[j], aliased[j], divisor)
            else:
                views.append(bucket_views[j])
                batch.append(grad)
        if self._n_copied < len(self._early):  # a large one without a gradient at its hook
            for j in self._early:
                if not self._copied[j]:
                    # scaled while copied
                    _scale_into(grads[j], bucket_views[j], aliased[j], divisor)
        _copy_batch(views, batch, divisor)

    def view_grads(self, which: Sequence[bool] | None = None) -> None:
        """Point `.grad` of the parameters (all, or those flagged) at their views: the one place
        a gradient becomes a bucket view (gradient_as_bucket_view)."""
        for i, (param, view) in enumerate(zip(self.params, self.views)):
            if which is None or which[i]:
                param.grad = view

    def adopt_grads(self) -> None:
        """Move gradients that exist into this (new) bucket and make them its views."""
        with torch.no_grad():
            for view, param in zip(self.views, self.params):
                if param.grad is not None and not _aliases(param.grad, view):
                    view.copy_(param.grad)
            self.view_grads([p.grad is not None for p in self.params])

    def write_back(self, used: Sequence[int] | None, as_view: bool) -> None:
        """Put the reduced values into `.grad`, leaving parameters unused on every rank
        (`used[i] == 0`) exactly as torch does: untouched."""
        if self.sparse:
            self.params[0].grad = self.sparse_grad  # the reduced one, once landed (`accept`)
            return
        if self.collective is Collective.REDUCE_SCATTER:
            return  # its result is `shard`, the sharded optimizer's business; `.grad` is left alone
        self._divided(self.payload)
        keep = _ALL if used is None else [bool(used[i]) for i in self.param_indices]
        if self.payload is not self.buffer:  # another dtype (mixed precision): cast each
            self._write_back_cast(keep)
            return
        if as_view:
            self.view_grads([keep[j] and (p.grad is None or not _aliases(p.grad, v))
                             for j, (p, v) in enumerate(zip(self.params, self.views))])
            return
        if keep is _ALL:  # the common case, in one pass of comprehensions (hundreds of tensors)
            grads = [p.grad for p in self.params]
            if grads and all(g is not None for g in grads):
                torch._foreach_copy_(grads, self.views)  # type: ignore[arg-type]
                return
        targets, sources = [], []
        for j, (param, view) in enumerate(zip(self.params, self.views)):
            if not keep[j]:
                continue
            if param.grad is None:
                param.grad = view.to(param.dtype, copy=True)
            else:
                targets.append(param.grad)
                sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)

    def _write_back_cast(self, keep: Sequence[bool] | _Everything) -> None:
        for j, (param, offset, length) in enumerate(zip(self.params, self.offsets, self.lengths)):
            if not keep[j]:
                continue
            value = self.payload.narrow(0, offset, length).view(param.shape)
            if param.grad is None or param.grad.dtype != param.dtype:
                param.grad = value.to(param.dtype, copy=True)
            else:
                param.grad.copy_(value)

    def start(self, group: torch.distributed.ProcessGroup,
              wire: torch.Tensor) -> torch.distributed.Work:
        """Start this bucket's collective on `wire` (the payload, or buffer and tail); its owner
        (`reductions.Reductions`) holds the work until it lands."""
        # sharded: `wire` unpadded, summed as DDP sums
        if self.collective is Collective.ALL_REDUCE or self.by_all_reduce:
            return group.allreduce([wire])
        return self._sharded.start(group, self.wire)

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, stop) of this rank's shard in the bucket's gradients: where its gradients
        lie, short of the padding (empty for a rank whose whole shard is padding)."""
        return self._sharded.shard_range

    def take_shard(self) -> None:
        """After the collective: this rank's shard of the sum (already there unless reduced by
        all-reduce, whose whole result is in the buffer)."""
        self._sharded.take(self.payload, self.by_all_reduce, self._divided)
        self._sum_divisor = 1  # a shard of padding only: nothing to divide
        # a persistent bucket drops its cast here (a transient one: `release`)
        if not self.transient:
            self._sharded.drop_cast()

    def fill_sparse(self, divisor: int) -> bool:
        """Take the sparse gradient, divided by `divisor`; False if there is none to take."""
        grad = self.params[0].grad
        if grad is None or not grad.is_sparse:
            return False
        self.sparse_grad = grad.coalesce() * (1.0 / divisor)
        return True

    def launch_payload(self, reduce_dtype: torch.dtype | None, divisor: int) -> torch.Tensor:
        """What to reduce: the buffer, the sparse gradient, or the buffer cast to `reduce_dtype`.
        With `divides_after_sum` the sum is divided by `divisor` once landed (`_divided`); else a
        cast is divided before the sum, so that the sum cannot overflow."""
        plain = self.sparse_grad is None and not self.hooked
        self._sum_divisor = divisor if plain and self.divides_after_sum else 1
        scale = 1 if self.divides_after_sum else divisor
        if self.sparse_grad is not None:
            self.payload = self.sparse_grad
        elif self.hooked:
            self.payload = self._hooked_payload(divisor)
        elif reduce_dtype is not None and self.collective is Collective.REDUCE_SCATTER:
            self.payload = self._cast_payload(reduce_dtype, scale, reciprocal=True)
        elif reduce_dtype is not None:  # into the same tensor every step, not a new one
            if self._cast is None or self._cast.dtype != reduce_dtype:
                self._cast = torch.empty(self.buffer.shape, dtype=reduce_dtype,
                                         device=self.buffer.device)
            self.payload = scaled_into(self.buffer, scale, self._cast)
        else:
            self.payload = self.buffer
        return self.payload

    def _divided(self, landed: torch.Tensor) -> torch.Tensor:
        """`landed` (this bucket's sum, or this rank's shard of it) divided in place by this
        iteration's divisor, when the sum is divided (`divides_after_sum`): `.div_` in the dtype it
        was summed in, as torch's mixed-precision hook divides. Once per iteration."""
        if self._sum_divisor != 1:
            landed.div_(self._sum_divisor)
            self._sum_divisor = 1
        return landed

    def _hooked_payload(self, divisor: int) -> torch.Tensor:
        """As torch's averaging hooks: `buffer.to(dtype).div_(world_size)`, then summed."""
        if self._sharded.hook_dtype is None:
            return self.buffer.div_(divisor)
        return self._cast_payload(self._sharded.hook_dtype, divisor, reciprocal=False)

    def _cast_payload(self, dtype: torch.dtype, divisor: int, reciprocal: bool) -> torch.Tensor:
        """A reduce-scatter bucket's buffer cast to `dtype` and divided there (`BucketShard.cast`).
        The cast, padded, replaces the buffer, which goes back at once."""
        cast = self._sharded.cast(self.buffer, dtype, divisor, reciprocal)
        if self.transient:
            self._drop_buffer(reusable=True)  # copied: nothing reads it again
        return cast

    def accept(self, value: torch.Tensor) -> None:
        """Take a communication hook's result as this bucket's reduced values (averaged: the
        hook's business, as torch's protocol has it)."""
        self._sum_divisor = 1
        if self.sparse:
            self.sparse_grad = value
        elif value.dtype == self.buffer.dtype:
            if value.data_ptr() != self.buffer.data_ptr():
                self.buffer.copy_(value)
            self.payload = self.buffer
        else:
            self.payload = value

    def reset(self, reusable: bool = True) -> None:
        """Ready for the next iteration. `reusable`: no collective of the last one still runs
        on a transient bucket's buffer (an iteration abandoned mid-flight), so it may be lent
        again."""
        if self.transient and self.holds_memory:
            self.release(reusable=reusable)
        self.pending = len(self.params)
        if self._n_copied:
            self._copied = [False] * len(self.params)
            self._n_copied = 0
        self._sum_divisor = 1
        self.sparse_grad = None
        self.payload = self.buffer

    def __repr__(self) -> str:
        return (
            f"Bucket(index={self.index}, params={self.param_indices}, "
            f"numel={self.buffer.numel()}, dtype={self.buffer.dtype})"
        )


def _running_offsets(lengths: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for n in lengths:
        offsets.append(total)
        total += n
    return offsets


def view_like(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """A view of `buffer` at `offset` shaped like `param`, with its strides where they are dense.

    Matching strides keeps `.grad` in the layout autograd would have produced (the "gradient
    layout contract"), so a channels-last convolution keeps channels-last gradients. Contiguous
    parameters take the same path, as in torch's reducer: a weight contiguous in two memory
    formats at once (a channels-last conv weight with one input channel) keeps the strides of
    its size-1 dimension, which `view` would make standard.
    """
    if is_dense_permutation(param):
        return buffer.as_strided(param.size(), param.stride(), buffer.storage_offset() + offset)
    return buffer.narrow(0, offset, param.numel()).view(param.shape)


def is_dense_permutation(t: torch.Tensor) -> bool:
    """True when the strides are a permutation of a contiguous layout (no gaps, no overlap)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.size()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


class _Everything:
    """`keep[j]` is True for every j: no used map, so every gradient is written back."""

    def __getitem__(self, _j: int) -> bool:
        return True


_ALL = _Everything()


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _copy_in(views: list[torch.Tensor], grads: list[torch.Tensor | None], divisor: int,
             whole: torch.Tensor | None) -> None:
    """views = grads / divisor, in as few passes over memory and kernel calls as we can;
    `whole`: the buffer the views tile, when all are small.

    Large gradients are scaled while copied (one pass each); small ones are copied with one
    batched call and scaled with another, which beats a call per tensor. Same arithmetic
    either way: a float multiply by 1/divisor.
    """
    inv = 1.0 / divisor
    if whole is not None and all(g is not None for g in grads):  # the common case
        torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
        if divisor != 1:
            whole.mul_(inv)
        return
    small_views, small_grads = [], []
    for view, grad in zip(views, grads):
        if grad is None:
            view.zero_()
        elif divisor != 1 and grad.numel() >= FUSED_COPY_MIN_NUMEL:
            torch.mul(grad, inv, out=view)
        else:
            small_views.append(view)
            small_grads.append(grad)
    _copy_batch(small_views, small_grads, divisor)


def _copy_batch(views: list[torch.Tensor], grads: list[torch.Tensor], divisor: int) -> None:
    """views = grads / divisor for small tensors: one batched copy, one batched multiply."""
    if views:
        torch._foreach_copy_(views, grads)
        if divisor != 1:
            _foreach_scale_(views, 1.0 / divisor)


def _foreach_scale_(views: list[torch.Tensor], factor: float) -> None:
    """views *= factor, rounded as `torch.mul(view, factor)` rounds it (the arithmetic of
    torch's reducer, and of `_scale_into`)."""
    if views[0].device.type == "cpu":
        # On the CPU the float overload rounds bfloat16 and float16 differently from
        # torch.mul (world sizes that are not a power of two), and costs three times as much
        # (a scalar wrapped per tensor); a 0-dim double tensor is torch.mul's own scalar.
        torch._foreach_mul_(views, torch.tensor(factor, dtype=torch.float64))
    else:
        torch._foreach_mul_(views, factor)


def _scale_into(grad: torch.Tensor | None, view: torch.Tensor, aliased: bool, divisor: int) -> None:
    """view = grad / divisor (1: copied as it is)."""
    if grad is None:
        view.zero_()
    elif aliased:
        if divisor != 1:
            view.div_(divisor)
    elif grad.requires_grad:  # backward(create_graph=True): leave `grad` itself intact
        view.copy_(grad.detach() * (1.0 / divisor) if divisor != 1 else grad.detach())
    elif divisor != 1:
        torch.mul(grad, 1.0 / divisor, out=view)
    else:
        view.copy_(grad)
