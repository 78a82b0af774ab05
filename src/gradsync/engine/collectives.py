"""The few collectives gradsync needs outside the hot path, each with a timeout: blocking ones,
and broadcasts started together and finished together (`Broadcasts`).

They take the process group as an argument and use only its own methods, so they work on any
`dist.ProcessGroup`, registered with torch's default world or not (threaded test groups are not).
Their small tensors live where the group can reach them (`device.object_device`: the CPU for
gloo, the GPU for NCCL, which has no CPU backend).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import DEFAULT_TIMEOUT
from .device import object_device
from .waits import wait, wait_error

# As torch's DDP broadcasts module states at construction.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024

__all__ = ["BROADCAST_CHUNK_BYTES", "DEFAULT_TIMEOUT", "Broadcasts", "all_gather_ints",
           "all_gather_objects", "all_reduce", "broadcast_tensors", "finish_all_gather_ints",
           "start_all_gather_ints", "wait", "wait_error"]


def all_reduce(
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType,
    what: str,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> torch.Tensor:
    """All-reduce `tensor` in place with `op` and wait (at most `timeout`); return it."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op  # type: ignore[assignment]
    wait(group.allreduce([tensor], opts), what, group, timeout)
    return tensor


def all_gather_objects(
    group: dist.ProcessGroup, obj: object, timeout: timedelta = DEFAULT_TIMEOUT
) -> list[object]:
    """Every rank's `obj` (picklable), in rank order."""
    device = object_device(group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(group.size())]
    wait(group.allgather([sizes], [size]), "all-gather of object sizes", group, timeout)
    lengths = torch.cat(sizes).tolist()
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(group.size())]
    wait(group.allgather([gathered], [padded.to(device)]), "all-gather of objects", group, timeout)
    return [pickle.loads(bytes(g[:n].cpu().tolist())) for g, n in zip(gathered, lengths)]


def all_gather_ints(
    group: dist.ProcessGroup, values: Sequence[int], timeout: timedelta = DEFAULT_TIMEOUT
) -> list[list[int]]:
    """Every rank's `values` (the same count on every rank), in rank order: one collective."""
    return finish_all_gather_ints(start_all_gather_ints(group, values), group, timeout)


GatheringInts = tuple[dist.Work, torch.Tensor, torch.Tensor]


def start_all_gather_ints(group: dist.ProcessGroup, values: Sequence[int]) -> GatheringInts:
    """`all_gather_ints` set in flight, to be finished by `finish_all_gather_ints` after
    whatever can run meanwhile."""
    device = object_device(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    every = torch.empty(len(values) * group.size(), dtype=torch.int64, device=device)
    return group._allgather_base(every, mine), every, mine


def finish_all_gather_ints(
    started: GatheringInts, group: dist.ProcessGroup, timeout: timedelta = DEFAULT_TIMEOUT
) -> list[list[int]]:
    work, every, _mine = started
    wait(work, "all-gather of per-rank values", group, timeout)
    return every.view(group.size(), -1).tolist()


def broadcast_tensors(
    group: dist.ProcessGroup,
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    timeout: timedelta = DEFAULT_TIMEOUT,
    what: str = "broadcast of parameters and buffers",
    chunk_bytes: int = BROADCAST_CHUNK_BYTES,
) -> None:
    """Overwrite `tensors` on every rank with rank `src`'s values (`Broadcasts`, started and
    finished at once)."""
    broadcasts = Broadcasts(group, timeout)
    broadcasts.start(tensors, src, what, chunk_bytes)
    broadcasts.finish()


# A tensor this large is broadcast where it lies, on its own: copying it into a flat buffer
# and out again costs more than a collective of its own
# (figures: docs/benchmarks/design-figures.md#flat-broadcast-threshold).
IN_PLACE_BYTES = 1 << 20


class Broadcasts:
    """Broadcasts started together and finished together (several roots' in flight at once).
    Small tensors travel flat, one collective per dtype and device in chunks of about
    `chunk_bytes` (torch's 250 MB), so a whole model is never copied at once; large contiguous
    ones in place. Every rank cuts the same chunks: they follow the tensors' shapes alone."""

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.group, self.timeout = group, timeout
        self._pending: list[tuple[dist.Work, str, torch.Tensor | None, list[torch.Tensor]]] = []

    def start(self, tensors: Sequence[torch.Tensor], src: int, what: str,
              chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
        with torch.no_grad():
            for chunk in _chunks(tensors, chunk_bytes):
                alone = len(chunk) == 1 and _in_place(chunk[0])
                flat = (chunk[0].detach() if alone
                        else torch.cat([t.detach().reshape(-1) for t in chunk]))
                self._pending.append((self._broadcast(flat, src), what, None if alone else flat,
                                      chunk))

    def start_in_place(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Broadcast one contiguous tensor where it lies, whatever its size (a flat buffer that
        parameters view: nothing to copy in or out)."""
        self._pending.append((self._broadcast(tensor.detach(), src), what, None, [tensor]))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.group.broadcast([tensor], opts)

    def finish(self) -> None:
        """Wait for every broadcast started, in order, and write the flat ones out."""
        pending, self._pending = self._pending, []
        with torch.no_grad():
            for work, what, flat, chunk in pending:
                wait(work, what, self.group, self.timeout)
                if flat is not None:
                    torch._foreach_copy_([t.detach() for t in chunk], _views(flat, chunk))


def _in_place(t: torch.Tensor) -> bool:
    return t.numel() * t.element_size() >= IN_PLACE_BYTES and t.is_contiguous()


def _views(flat: torch.Tensor, chunk: list[torch.Tensor]) -> list[torch.Tensor]:
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in chunk]), chunk)]


def _chunks(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> list[list[torch.Tensor]]:
    """`tensors` by dtype and device, each kind cut into runs of at most `chunk_bytes`; a
    large contiguous tensor (`IN_PLACE_BYTES`), or one larger than a chunk, is a run of its own."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    alone: list[list[torch.Tensor]] = []
    for t in tensors:
        if _in_place(t):
            alone.append([t])
            continue
        kind, nbytes = (t.dtype, t.device), t.numel() * t.element_size()
        runs = by_kind.setdefault(kind, [[]])
        if runs[-1] and sizes[kind] + nbytes > chunk_bytes:
            runs.append([])
            sizes[kind] = 0
        runs[-1].append(t)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    return alone + [run for runs in by_kind.values() for run in runs if run]
