"""Flat buffers lent out and taken back, for memory that lives only part of a step.

Sharded gradients hold a bucket's buffer only from its fill until its reduction has landed, and
a sharded optimizer holds a gather buffer only while parameters are on their way. Allocating
those afresh every step costs more than the copy they carry: large CPU allocations come from
the kernel as new pages, zeroed and faulted in on first touch (a 16 MiB bucket: milliseconds),
and on a GPU a new block can force the caching allocator to synchronise. A pool keeps at most
`keep` buffers between uses, so memory stays bounded by the buffers in flight while the pages
stay warm.

A lent buffer holds whatever its last user left in it: callers write or zero what they read.

On a GPU nothing here needs `record_stream`: a buffer comes back only after its collective was
waited for, and a device wait makes the current stream wait for the communication stream, so
its next user (or the caching allocator, if the pool drops it) runs on the current stream
after the collective has finished with it.
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Lends 1-D buffers at least as long as asked for; keeps at most `keep` returned ones."""

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"BufferPool(keep={keep}): expected at least 0")
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self.allocations = 0  # buffers made, not reused: what the pool exists to keep low

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The smallest free buffer that fits (its contents are stale), else a new one."""
        best = None
        for i, buffer in enumerate(self._free):
            if (buffer.dtype == dtype and buffer.device == device and buffer.numel() >= numel
                    and (best is None or buffer.numel() < self._free[best].numel())):
                best = i
        if best is not None:
            return self._free.pop(best)
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Take back a buffer no collective or view still uses. Beyond `keep`, the smallest
        free one is dropped: the next `take` of a big bucket then fits without a new one."""
        assert buffer.dim() == 1 and buffer._base is None, "give back what take lent, whole"
        self._free.append(buffer)
        if len(self._free) > self.keep:
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))

    @property
    def held_bytes(self) -> int:
        """Memory kept between uses."""
        return sum(b.numel() * b.element_size() for b in self._free)
