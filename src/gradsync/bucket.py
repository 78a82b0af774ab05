"""A bucket: one flat, contiguous gradient buffer and the parameters whose gradients live in it.

Layered nouns: the buffer owns the memory; each parameter gets a view of it with the parameter's
shape (and strides, for channels-last tensors), at its offset. The Reducer copies gradients in
(or lets `.grad` be the view), reduces the buffer as one tensor, and copies results out.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["FUSED_COPY_MIN_NUMEL", "Bucket"]

# Gradients at least this large are scaled while copied into their bucket, one pass each;
# smaller ones are copied in one batched call and scaled with the whole buffer.
FUSED_COPY_MIN_NUMEL = 1 << 15


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
    ):
        self.index = index
        self.param_indices = list(param_indices)
        self.params = [params[i] for i in self.param_indices]
        # A parameter with a sparse gradient has a bucket of its own and no flat buffer: the
        # sparse gradient itself is reduced, and the result replaces `.grad`.
        self.sparse = sparse
        self.sparse_grad: torch.Tensor | None = None
        # What is all-reduced when it is not the buffer itself (sparse gradient, or the buffer
        # cast to a separate reduce dtype); the reduced values are read back from it.
        self.payload: torch.Tensor = torch.empty(0)
        self.lengths = [0 if sparse else p.numel() for p in self.params]
        self.offsets = _running_offsets(self.lengths)
        self.all_small = all(n < FUSED_COPY_MIN_NUMEL for n in self.lengths)
        first = self.params[0]
        # `dtype` differs from the parameters' under mixed precision: gradients then arrive in
        # the low-precision compute dtype.
        numel = sum(self.lengths)
        # `wire` is what an all-reduce can send: the gradients (`buffer`) plus `tail` extra
        # elements after them, where the Reducer lets small per-rank counts ride along.
        self.wire = torch.zeros(numel + tail, dtype=dtype or first.dtype, device=first.device)
        self.buffer = self.wire.narrow(0, 0, numel) if tail else self.wire
        self.tail = self.wire.narrow(0, numel, tail) if tail else None
        self.views = [
            _view_like(self.buffer, offset, p) for offset, p in zip(self.offsets, self.params)
        ] if not sparse else []
        # Per-iteration state, reset by `reset()`.
        self.pending = len(self.params)
        self.work: torch.distributed.Work | None = None
        self.payload = self.buffer
        # With a communication hook: the Future it returned, set when complete, and its view.
        self.future: torch.futures.Future | None = None
        self.future_done: threading.Event | None = None
        self.hook_view: Any = None
        self.hook_error: Exception | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        self.sparse_grad = None
        self.payload = self.buffer
        self.future = None
        self.future_done = None
        self.hook_view = None
        self.hook_error = None

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


def _view_like(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """A view of `buffer` at `offset` shaped like `param`, with its strides where they are dense.

    Matching strides keeps `.grad` in the layout autograd would have produced (the "gradient
    layout contract"), so a channels-last convolution keeps channels-last gradients.
    """
    if not param.is_contiguous() and _is_dense_permutation(param):
        return buffer.as_strided(param.size(), param.stride(), buffer.storage_offset() + offset)
    return buffer.narrow(0, offset, param.numel()).view(param.shape)


def _is_dense_permutation(t: torch.Tensor) -> bool:
    """True when the strides are a permutation of a contiguous layout (no gaps, no overlap)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.size()) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True
