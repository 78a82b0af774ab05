"""The few blocking collectives gradsync needs outside the hot path, each with a timeout.

They take the process group as an argument and use only its own methods, so they work on any
`dist.ProcessGroup`, registered with torch's default world or not (threaded test groups are not).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import DEFAULT_TIMEOUT
from .errors import ReductionTimeoutError

__all__ = ["DEFAULT_TIMEOUT", "all_gather_objects", "all_reduce", "broadcast_tensors", "wait", "wait_error"]


def wait(
    work: dist.Work, what: str | Callable[[], str], group: dist.ProcessGroup, timeout: timedelta
) -> None:
    """Every wait gradsync makes: `work.wait(timeout)`, a failure turned into an error that
    says which collective (`what`, or what it returns: built only on failure) and whether it
    timed out, judged by the clock rather than by the message's wording."""
    start = time.monotonic()
    try:
        work.wait(timeout)
    except RuntimeError as error:
        timed_out = time.monotonic() - start >= 0.95 * timeout.total_seconds()
        described = what() if callable(what) else what
        raise wait_error(error, described, group, timeout, timed_out) from error


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


def wait_error(
    error: Exception, what: str, group: dist.ProcessGroup, timeout: timedelta, timed_out: bool
) -> ReductionTimeoutError:
    """The error for a collective that failed or timed out (built only when one did)."""
    outcome = f"did not complete within {timeout}" if timed_out else "failed"
    return ReductionTimeoutError(
        f"gradsync: rank {group.rank()}/{group.size()}: {what} {outcome}: {error}\n"
        "Another rank probably failed, stalled, or is not running the same code path (e.g. "
        "skipped a backward); check its log. If the step is legitimately slow, raise the "
        "timeout."
    )


def all_gather_objects(
    group: dist.ProcessGroup, obj: object, timeout: timedelta = DEFAULT_TIMEOUT
) -> list[object]:
    """Every rank's `obj` (picklable), in rank order."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
    wait(group.allgather([sizes], [size]), "all-gather of object sizes", group, timeout)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(group.size())]
    wait(group.allgather([gathered], [padded]), "all-gather of objects", group, timeout)
    return [
        pickle.loads(bytes(g[: int(s.item())].tolist())) for g, s in zip(gathered, sizes)
    ]


def broadcast_tensors(
    group: dist.ProcessGroup,
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    timeout: timedelta = DEFAULT_TIMEOUT,
    what: str = "broadcast of parameters and buffers",
) -> None:
    """Overwrite `tensors` on every rank with rank `src`'s values, one collective per dtype."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_kind.values():
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
            opts = dist.BroadcastOptions()
            opts.rootRank = src
            wait(group.broadcast([flat], opts), what, group, timeout)
            offset = 0
            for t in group_tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
