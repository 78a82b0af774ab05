"""What a rank owns under sharded gradients (ZeRO-2): its slice of every reduce-scattered bucket.

The buckets' flat space, element for element, is the parameters' memory in bucket order; rank r
owns elements [r*c, (r+1)*c) of each bucket (c = the bucket's padded size / world size), which
reduce-scatter leaves summed in `Bucket.shard`. A *piece* is the part of one parameter inside
one rank's slice: the parameter itself when the slice holds all of it, else a flat view of the
elements it holds. Each piece's gradient is a view of the shard, so the local optimizer steps
the pieces in place, on the parameters' own memory, with no copy in and none out.

After the step each bucket's slices are all-gathered back into the parameters (`Gathers`),
started at once. By default the step waits for them all; with `overlap_param_gather` each is
waited for just before a module that uses the bucket runs forward (forward pre-hooks), so the
gathers overlap the next forward. Everything still pending is then finished at the end of the
wrapped module's forward, before its `state_dict()`, and at the next `step()`; a read of a
parameter's raw values between the step and those points (an EMA update, logging a norm) would
see other ranks' parts unchanged, so it must call `ZeroRedundancyOptimizer.wait_parameters()`
first. That is why overlapping is not the default.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..engine.bucket import Bucket, is_dense_permutation, view_like
from ..engine.bucket_shard import as_real
from ..engine.collectives import all_reduce, wait
from ..engine.pool import BufferPool
from ..engine.reducer import Reducer
from .module_guards import LocalRef

__all__ = [
    "Gathers",
    "Piece",
    "check_dense",
    "clip_sharded",
    "flat",
    "group_pieces",
    "pieces_of",
    "set_piece_grads",
]


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of parameter `index` (its position over all groups) that this rank steps."""

    index: int
    start: int  # first element, in the parameter's memory order
    numel: int
    whole: bool  # the whole parameter: `tensor` has its shape, the state dicts' tensors too
    tensor: torch.Tensor  # what the local optimizer steps: an alias of the parameter's memory
    grad: torch.Tensor | None  # its slice of the bucket's shard (None: ZeRO-1, `.grad` is whole)
    reducer_index: int = -1  # the parameter's index in the Reducer (for its used map)


def flat(param: torch.Tensor) -> torch.Tensor:
    """`param`'s elements as one flat view in memory order (its bucket view's order)."""
    return param.detach().as_strided((param.numel(),), (1,), param.storage_offset())


def check_dense(reducer: Reducer) -> None:
    gaps = [
        n
        for n, p in zip(reducer.names, reducer.params)
        if not (p.is_contiguous() or is_dense_permutation(p))
    ]
    if gaps:
        raise ValueError(
            "ZeroRedundancyOptimizer: cannot shard the gradients of parameters whose memory has "
            f"gaps ({', '.join(gaps[:5])}); make them contiguous, or pass shard_gradients=False"
        )


def pieces_of(reducer: Reducer, position: dict[int, int]) -> list[Piece]:
    """This rank's pieces of every bucket, in bucket order; `position` maps id(parameter) to
    its index over the optimizer's groups."""
    pieces = []
    for bucket in reducer.buckets:
        lo, hi = bucket.shard_range
        for j, offset, length in zip(bucket.param_indices, bucket.offsets, bucket.lengths):
            a, e = max(offset, lo), min(offset + length, hi)
            if a >= e:
                continue
            param = reducer.params[j]
            whole = a == offset and e == offset + length
            tensor = param.detach() if whole else flat(param)[a - offset:e - offset]
            grad = (
                view_like(bucket.shard, a - lo, param)
                if whole
                else bucket.shard.narrow(0, a - lo, e - a)
            )
            pieces.append(Piece(position[id(param)], a - offset, e - a, whole, tensor, grad, j))
    return pieces


def group_pieces(pieces: Sequence[Piece], group_sizes: Sequence[int]) -> list[list[Piece]]:
    """`pieces` per parameter group (given each group's number of parameters), in order."""
    by_group: list[list[Piece]] = [[] for _ in group_sizes]
    ends = list(itertools.accumulate(group_sizes))
    for piece in pieces:
        by_group[bisect.bisect_right(ends, piece.index)].append(piece)
    return by_group


def set_piece_grads(
    pieces: Sequence[Piece], used: Sequence[int] | None, had_grad: set[int]
) -> None:
    """Give each piece its shard slice as `.grad`. Where its parameter was unused on every
    rank, DDP leaves `.grad` untouched: None if it had none (the optimizer skips it), else the
    zeros `zero_grad(set_to_none=False)` left, which is what the shard holds (`had_grad`:
    the parameters with a gradient since the last `zero_grad(set_to_none=True)`)."""
    for piece in pieces:
        j = piece.reducer_index
        if used is None or used[j]:
            had_grad.add(j)
            piece.tensor.grad = piece.grad
        else:
            piece.tensor.grad = piece.grad if j in had_grad else None


class Gathers:
    """The all-gathers that bring every rank's updated slices back into the parameters."""

    def __init__(self, reducer: Reducer, pieces: Sequence[Piece], module: nn.Module,
                 group: dist.ProcessGroup, timeout: timedelta) -> None:
        self.group, self.timeout = group, timeout
        self.buckets = list(reducer.buckets)
        # `_mine[b]`: this rank's pieces of bucket b, flat, in order: its slice of the bucket.
        self._mine: list[list[torch.Tensor]] = [[] for _ in self.buckets]
        bucket_of = {j: b for b, bucket in enumerate(self.buckets) for j in bucket.param_indices}
        for piece in pieces:  # in bucket order, covering each bucket's slice in order
            self._mine[bucket_of[piece.reducer_index]].append(
                flat(piece.tensor) if piece.whole else piece.tensor
            )
        # What `finish` writes: the parts of the parameters outside this rank's slice (its own
        # part is what its optimizer stepped, in place), as (before, after) the slice.
        self._others = [_outside(bucket) for bucket in self.buckets]
        # gloo's all-gather copies its output and is slower than one broadcast per rank
        # (figures: docs/benchmarks/design-figures.md#gloo-all-gather-against-broadcasts): where
        # the buckets were not reduce-scattered by the backend (host backends) the slices are
        # broadcast; device backends all-gather.
        self._by_broadcasts = reducer.shards_reduced_by != "reduce_scatter"
        # Gather buffers are borrowed from the reducer's pool: the buckets' buffers are idle
        # from the end of backward to the next fill, which is when parameters are gathered.
        self._pool = reducer.buffer_pool or BufferPool(keep=2)
        self._pending: dict[int, tuple[torch.Tensor, list[dist.Work]]] = {}
        self._handles = _attach(self, module, reducer, bucket_of)

    @property
    def pending(self) -> bool:
        """Whether some bucket's gather is still in flight (the forward hooks ask)."""
        return bool(self._pending)

    @property
    def order(self) -> list[int]:
        """The buckets in the order the next forward needs them: buckets follow the order
        gradients became ready, the reverse of forward's, so the last bucket first."""
        return list(reversed(range(len(self.buckets))))

    def start(self, buckets: Sequence[int], window: int | None = None) -> None:
        """Start these buckets' all-gathers (their slices stepped); with a `window`, at most
        that many in flight (each needs a buffer of its bucket's size), the oldest finished
        first."""
        with torch.no_grad():
            for b in buckets:
                if window is not None and len(self._pending) >= window:
                    self.finish([next(iter(self._pending))])  # started first (dicts keep order)
                bucket = self.buckets[b]
                chunk, rank = bucket.shard.numel(), self.group.rank()
                lent = self._pool.take(
                    chunk * self.group.size(), bucket.shard.dtype, bucket.shard.device
                )
                full = lent.narrow(0, 0, chunk * self.group.size())
                if self._mine[b]:  # past this rank's pieces: padding, never read back
                    torch._foreach_copy_(_runs(full, rank * chunk, self._mine[b]), self._mine[b])
                self._pending[b] = (lent, self._gather(full, chunk))

    def _gather(self, full: torch.Tensor, chunk: int) -> list[dist.Work]:
        if not self._by_broadcasts:  # in place: each rank's slice is already where it belongs
            mine = full.narrow(0, self.group.rank() * chunk, chunk)
            return [self.group._allgather_base(as_real(full), as_real(mine))]
        works = []
        for root in range(self.group.size()):
            options = dist.BroadcastOptions()
            options.rootRank = root
            works.append(self.group.broadcast([as_real(full.narrow(0, root * chunk, chunk))],
                                              options))
        return works

    def finish(self, indices: Sequence[int]) -> None:
        """Wait for these buckets' gathers (those still pending) and write the parameters."""
        for b in indices:
            entry = self._pending.pop(b, None)
            if entry is None:
                continue
            lent, works = entry
            for work in works:
                wait(work, f"all-gather of the parameters of bucket {b}", self.group, self.timeout)
            (before, stop, after) = self._others[b]
            if before or after:  # nothing at world size 1: every part is this rank's
                with torch.no_grad():
                    torch._foreach_copy_(
                        before + after, _runs(lent, 0, before) + _runs(lent, stop, after)
                    )
            self._pool.give(lent)

    def finish_all(self) -> None:
        self.finish(list(self._pending))  # in the order they started

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()


def _outside(bucket: Bucket) -> tuple[list[torch.Tensor], int, list[torch.Tensor]]:
    """Flat views of a bucket's parameters outside this rank's slice [start, stop): those
    tiling [0, start) in order, `stop`, and those tiling [stop, numel)."""
    start, stop = bucket.shard_range
    before: list[torch.Tensor] = []
    after: list[torch.Tensor] = []
    for param, offset, length in zip(bucket.params, bucket.offsets, bucket.lengths):
        whole = flat(param)
        if offset < start:
            before.append(whole.narrow(0, 0, min(length, start - offset)))
        if offset + length > stop:
            skip = max(stop - offset, 0)
            after.append(whole.narrow(0, skip, length - skip))
    return before, stop, after


def _runs(buffer: torch.Tensor, start: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of `buffer` from `start`, one as long as each of `tensors` (one
    `split`: cheaper than a `narrow` per tensor, which `finish` would pay every step)."""
    lengths = [t.numel() for t in tensors]
    return list(buffer.narrow(0, start, sum(lengths)).split(lengths)) if lengths else []


def _attach(
    gathers: Gathers, module: nn.Module, reducer: Reducer, bucket_of: dict[int, int]
) -> list:
    """Forward pre-hooks that finish, before a module runs, the gathers of the buckets holding
    its own parameters; hooks that finish everything after the whole forward and before a
    state dict is taken. They hold the gathers weakly."""
    me = LocalRef(gathers)  # pickled with the module (`torch.save(model)`): dead
    index = {id(p): j for j, p in enumerate(reducer.params)}
    handles = []
    for sub in module.modules():
        buckets = sorted(
            {bucket_of[index[id(p)]] for p in sub.parameters(recurse=False) if id(p) in index}
        )
        if buckets:
            handles.append(sub.register_forward_pre_hook(_Before(me, buckets)))
    everything = _All(me)
    handles.append(module.register_forward_hook(everything))
    handles.append(module.register_state_dict_pre_hook(everything))
    return handles


class _Before:
    def __init__(self, gathers: LocalRef, buckets: list[int]) -> None:
        self.gathers, self.buckets = gathers, buckets

    def __call__(self, *_: object) -> None:
        live = self.gathers()
        if live is not None and live.pending:
            live.finish(self.buckets)


class _All:
    def __init__(self, gathers: LocalRef) -> None:
        self.gathers = gathers

    def __call__(self, *_: object, **__: object) -> None:
        live = self.gathers()
        if live is not None and live.pending:
            live.finish_all()


def clip_sharded(
    pieces: Sequence[Piece], max_norm: float, norm_type: float, group: dist.ProcessGroup,
    timeout: timedelta, error_if_nonfinite: bool,
) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every rank's pieces: the global norm from the
    shards' norms (one all-reduce), then every shard scaled by the same coefficient."""
    grads = [p.tensor.grad for p in pieces if p.tensor.grad is not None]
    device = pieces[0].grad.device if pieces and pieces[0].grad is not None else torch.device("cpu")
    norm_type = float(norm_type)
    local = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type)
                                                   for g in grads]), norm_type)
             if grads else torch.zeros((), device=device))
    local = local.to(torch.float32).reshape(1)
    if norm_type == float("inf"):
        total = all_reduce(group, local, dist.ReduceOp.MAX, "all-reduce of the gradient norm",
                           timeout)[0]
    else:
        powered = all_reduce(group, local.pow(norm_type), dist.ReduceOp.SUM,
                             "all-reduce of the gradient norm", timeout)
        total = powered[0].pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from the optimizer's "
            "parameters is non-finite, so it cannot be clipped. To disable this error and "
            "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))
    return total
