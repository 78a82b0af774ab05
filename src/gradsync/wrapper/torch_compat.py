"""What frameworks reach for on a torch DDP object, answered by gradsync's wrapper.

HF Trainer (through Accelerate), Lightning, Fabric and Composer build
`torch.nn.parallel.DistributedDataParallel` themselves, test `isinstance` against it, and then
call into it: `no_sync`, `require_backward_grad_sync`, `_get_ddp_logging_data()`, and, on
`ddp.reducer`, the C++ Reducer's `prepare_for_backward`, `_rebuild_buckets` and
`_delay_all_reduce`. gradsync's wrapper is a subclass of torch's class (so the checks pass) that
never runs torch's constructor (so no C++ reducer, no second set of hooks). This module holds
the pieces of that: torch's reducer method names on gradsync's Reducer, the logging data,
and clear errors for the parts of torch's class that belong to its C++ reducer. It reads the
wrapper only through `LoggedWrapper` (torch's public names) and what it is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

# torch's own class, imported before anything could replace the name (`patch_torch_ddp`).
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from ..engine.reducer import Phase, Reducer
from ..engine.timeline import EventKind
from ..observability.stats import Stats
from .views import WrapperView

__all__ = [
    "LoggedWrapper",
    "TorchDDP",
    "TorchNamedReducer",
    "graph_was_static",
    "logging_data",
    "refuse_torch_internals",
]

# torch's methods that need nothing of its constructor's state; inherited as they are.
_INHERITED = frozenset({
    "_get_active_ddp_module", "_get_data_parallel_params", "_active_ddp_module", "scatter",
    "gather", "train", "broadcast_buffers", "_distributed_rank",
})


def refuse_torch_internals(cls: type) -> type:
    """Class decorator: every method or property of torch's class that `cls` does not define
    itself (and that needs torch's constructor) raises an error naming it, instead of an
    AttributeError from deep inside torch's code."""
    own = {name for klass in cls.__mro__[: cls.__mro__.index(TorchDDP)] for name in vars(klass)}
    for name, member in vars(TorchDDP).items():
        if name in own or name in _INHERITED or name.startswith("__") or name.startswith("_abc"):
            continue
        if callable(member) or isinstance(member, (property, staticmethod, classmethod)):
            setattr(
                cls, name, _refusal(f"DistributedDataParallel.{name}", isinstance(member, property))
            )
    return cls


def _refuse_cxx_reducer_methods(cls: type) -> type:
    """The same for the C++ Reducer's methods on `ddp.reducer`. (Not a `__getattr__`: defining
    one slows every attribute read of the reducer, and its hooks read many.)"""
    cxx = torch._C._distributed_c10d.Reducer
    for name in dir(cxx):
        if not name.startswith("__") and not name.startswith("_pybind") and not hasattr(cls, name):
            setattr(cls, name, _refusal(f"reducer.{name}", False))
    return cls


def _refusal(what: str, is_property: bool) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"gradsync: {what} belongs to torch's C++-reducer implementation, which gradsync "
            "replaces, and gradsync does not provide it. If a framework needs it, please report "
            "which framework and where."
        )

    refuse.__name__ = what.rpartition(".")[2]
    return property(refuse) if is_property else refuse


@_refuse_cxx_reducer_methods
class TorchNamedReducer(Reducer):
    """gradsync's Reducer as `ddp.reducer`, answering the C++ Reducer's methods frameworks call.

    Lightning's manual optimisation and Accelerate's `trigger_sync_in_backward` call
    `prepare_for_backward(outputs)` themselves after a forward that did not prepare: the
    forwards counted since the last synchronisation (the accumulation check) come from the
    wrapper then, through the Reducer's `take_micro_steps`, which it sets.
    """

    def _rebuild_buckets(self) -> bool:
        """torch: rebuild the buckets in ready order if due; True if it happened now.
        gradsync rebuilds at `prepare_for_backward` anyway; doing it here first is the same."""
        if self.phase in (Phase.PREPARED, Phase.BACKWARD, Phase.LAUNCHED) or self.rebuilt:
            return False
        self.rebuild_if_due()
        return self.rebuilt

    def _delay_all_reduce(self) -> None:
        """torch: the static graph's first iteration reduces everything at its end. gradsync
        does that itself when that backward ends; called again it has nothing left to do,
        unless backward is still running (then it finishes the iteration now, as torch's)."""
        self.finish_learning_iteration()

    def _set_static_graph(self) -> None:
        self.set_static_graph()



class LoggedWrapper(WrapperView, Protocol):
    """What `logging_data` reads of the wrapper: torch's public names, and `stats()`."""

    @property
    def device_ids(self) -> list[torch.device] | None: ...

    @property
    def output_device(self) -> torch.device | None: ...

    @property
    def bucket_bytes_cap(self) -> int: ...

    @property
    def find_unused_parameters(self) -> bool: ...

    @property
    def gradient_as_bucket_view(self) -> bool: ...

    @property
    def static_graph(self) -> bool: ...

    def stats(self) -> Stats: ...


def logging_data(
    ddp: LoggedWrapper, params: list[nn.Parameter], join_enabled: bool, searches_unused: bool
) -> dict[str, Any]:
    """torch's `_get_ddp_logging_data()` keys (those that mean something here), and gradsync's:
    of `ddp` synchronising `params`, inside join() or not, searching for unused ones or not."""
    reducer, group = ddp.reducer, ddp.process_group
    layout = reducer.bucket_indices if reducer is not None else []
    sizes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in layout]
    data: dict[str, Any] = {
        "world_size": group.size(),
        "rank": group.rank(),
        "module_name": type(ddp.module).__name__,
        "backend_name": _backend(group),
        "device_ids": ", ".join(str(d) for d in ddp.device_ids or []),
        "output_device": ddp.output_device.index if ddp.output_device is not None else -1,
        "dtypes": ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "is_multi_device_module": int(len({p.device for p in params}) > 1),
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "bucket_sizes": ", ".join(str(s) for s in sizes),
        "has_rebuilt_buckets": int(
            bool(reducer is not None and reducer.rebuilt and reducer.iteration)
        ),
        "iteration": reducer.iteration if reducer is not None else 0,
        "join_uneven_inputs": int(join_enabled),
        "has_sync_bn": int(
            any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules())
        ),
        "gradsync": 1,
    }
    data.update(_keys_when_set(ddp, searches_unused))
    return data


def _keys_when_set(ddp: LoggedWrapper, searches_unused: bool) -> dict[str, Any]:
    """torch's keys that appear only when they are set, and the measured times."""
    data: dict[str, Any] = {}
    reducer = ddp.reducer
    if ddp.static_graph:
        data["static_graph"] = 1
    if reducer is not None and reducer.comm_hook is not None:
        data["comm_hook"] = _hook_name(reducer.comm_hook[1])
    if searches_unused:  # as torch: only where the graph is searched each iteration
        data["can_set_static_graph"] = int(graph_was_static(reducer))
    if reducer is not None and reducer.history:
        data.update(_timing_figures(ddp))
    return data


def graph_was_static(reducer: Reducer | None) -> bool:
    """As torch's `can_set_static_graph`: unused-parameter search is on (not a static
    graph) and every recent iteration left the same parameters unused."""
    if reducer is None or not reducer.history:
        return False
    unused = [frozenset(t.times(EventKind.UNUSED)) for t in reducer.history]
    return len(set(unused)) == 1


def _timing_figures(ddp: LoggedWrapper) -> dict[str, Any]:
    """torch's average times (nanoseconds) where gradsync measures the same, and its own."""
    stats = ddp.stats()
    ns = {f: int(stats.median(f) * 1e6) for f in ("backward_ms", "comm_ms", "exposed_comm_ms")}
    return {
        "avg_backward_compute_time": ns["backward_ms"],
        "avg_backward_comm_time": ns["comm_ms"],
        "avg_backward_compute_comm_overlap_time": max(ns["comm_ms"] - ns["exposed_comm_ms"], 0),
        "gradsync_exposed_comm_time": ns["exposed_comm_ms"],
        "gradsync_overlap_ratio": round(stats.median("overlap_ratio"), 4),
    }


def _backend(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group made outside torch.distributed's registry
        return group.name() if hasattr(group, "name") else type(group).__name__


def _hook_name(hook: Callable[..., Any]) -> str:
    return getattr(hook, "__qualname__", type(hook).__name__)
