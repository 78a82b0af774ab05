"""What the device asks of gradsync: where its small tensors live, how it waits, how it reads a
value back without stopping the host.

On CPU with gloo a collective runs on host threads: a wait with a timeout is the only way to
bound it, and reading a tensor costs nothing. On a GPU with NCCL the host must run ahead of the
device: a collective's `wait()` without a timeout only makes the current stream wait (a timed
one spins the host until the GPU is done, and a timed-out one aborts the communicator), hangs
are the process group's watchdog's business (its own timeout), and a value the host needs is
copied back without a sync and read once its event has passed (`HostRead`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["CudaCalls", "DeviceCalls", "HostRead", "host_runs_collectives", "object_device",
           "on_stream"]


class DeviceCalls(Protocol):
    """Every call the Reducer's step path makes to the device, in one place: `CudaCalls` on a
    GPU; stand-ins that count them in the CPU tests (tests/threaded/test_device_calls.py), which
    pin how many a step makes: none per gradient, a few per bucket and per iteration (as torch's
    C++ reducer, which times an iteration with a handful of events)."""

    def event(self) -> Any:
        """A new timing event (`record`, `query`, `elapsed_time`, `synchronize`)."""

    def current_stream(self) -> Any:
        """The stream work is queued on now (a hook runs on its gradient's stream)."""

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Queue work on `stream` (None: where we are)."""

    def side_stream(self) -> contextlib.AbstractContextManager:
        """Queue work on a stream of the caller's own (made once), e.g. to time a collective's
        completion without holding up the compute stream."""


class CudaCalls:
    """`DeviceCalls` on CUDA. The side stream is made at first use and kept."""

    def __init__(self) -> None:
        self._side: torch.cuda.Stream | None = None

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return on_stream(stream)

    def side_stream(self) -> contextlib.AbstractContextManager:
        if self._side is None:
            self._side = torch.cuda.Stream()
        return torch.cuda.stream(self._side)


def object_device(group: dist.ProcessGroup) -> torch.device:
    """Where tensors for `group`'s own small collectives (objects, flags, counts) must live:
    the CPU when the group has a CPU backend (gloo), else its accelerator (NCCL has no CPU
    backend), as torch's `_get_object_coll_device` chooses."""
    types = [torch.device(t).type for t in getattr(group, "_device_types", ())]
    if not types or "cpu" in types:
        return torch.device("cpu")
    kind = types[0]
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    module = getattr(torch, kind, None)
    index = (module.current_device() if module is not None and hasattr(module, "current_device")
             else 0)
    return torch.device(kind, index)


def host_runs_collectives(group: dist.ProcessGroup) -> bool:
    """Whether `group`'s collectives run on host threads (gloo), so that a wait may carry a
    timeout; False for a device backend (NCCL), whose waits are stream-side."""
    return object_device(group).type == "cpu"


def on_stream(stream: object) -> contextlib.AbstractContextManager:
    """Run on `stream` (a CUDA stream; None: wherever we are). A bucket launched from a
    communication thread's callback is launched on the stream that filled it."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()  # type: ignore[arg-type]


class HostRead:
    """A small device tensor's value for the host, read when it is there.

    On the CPU the value is there at once. On a GPU it is copied into pinned memory with
    `non_blocking=True` behind an event; `ready` asks the event (no sync) and `get` reads it,
    synchronising only if it is asked before the copy has landed.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host = host
        else:
            self._host = tensor

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> list:
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return self._host.tolist()
