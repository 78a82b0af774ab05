"""What a checkpoint holds of the wrapper besides the model and optimizer, and its restore.

`DistributedDataParallel.gradsync_state()` saves the bucket layout (rebuilt or planned), the
planner's verdict, the iteration and synchronisation counts and the communication hook's state
(PowerSGD's error feedback, for one); `load_gradsync_state` puts them back after a restart, so
the run goes on exactly as an uninterrupted one would.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist

from ..engine.reducer import Reducer
from ..planning.autoplan import AutoBuckets

__all__ = ["restore_hook_state", "restore_layout", "saved_state"]


def saved_state(reducer: Reducer | None, auto: AutoBuckets | None, syncs: int) -> dict[str, Any]:
    return {
        "version": 2,
        "bucket_indices": reducer.bucket_indices if reducer else [],
        "rebuilt": bool(reducer and reducer.rebuilt),
        "iterations": reducer.iteration if reducer else 0,
        "plan": auto.plan if auto else None,
        "syncs": syncs,
        "hook_state": _hook_state_to_save(reducer),
    }


def restore_layout(
    state: dict[str, Any], reducer: Reducer | None, auto: AutoBuckets | None
) -> None:
    """The layout, the iteration count and the planner's decision of `saved_state`."""
    if state.get("version") not in (1, 2):
        raise ValueError(f"load_gradsync_state: unknown state version {state.get('version')!r}")
    if reducer is not None and state["bucket_indices"]:
        if state["rebuilt"]:
            reducer.install_layout(state["bucket_indices"])
        reducer.iteration = state["iterations"]
    if auto is not None and state["plan"] is not None and state["plan"].kept is not None:
        auto.plan = state["plan"]  # decided; a trial cut short by the stop starts over
        if reducer is not None and (tail := auto.plan.tail_settings) is not None:
            # the saved layout is cut so, and its chunks go in that order
            reducer.send_tail_first(tail[0], tail[1], credit=tail[2])


def _hook_state_to_save(reducer: Reducer | None) -> dict[str, Any] | None:
    """The registered hook's state object as a dict of its fields (copied: the hook keeps
    changing its tensors in place), without process groups, which cannot be saved."""
    if reducer is None or reducer.comm_hook is None:
        return None
    state = reducer.comm_hook[0]
    if state is None or isinstance(state, dist.ProcessGroup):
        return None
    # PowerSGDState's __getstate__ drops its process group itself.
    fields: Any = state.__getstate__()  # type: ignore[attr-defined]
    if not isinstance(fields, dict):  # a __slots__ object without its own __getstate__
        fields = {k: getattr(state, k) for k in getattr(type(state), "__slots__", ())}
    kept = {k: v for k, v in fields.items() if not isinstance(v, dist.ProcessGroup)}
    return {"type": type(state).__qualname__, "fields": copy.deepcopy(kept)}


def restore_hook_state(reducer: Reducer | None, saved: dict[str, Any] | None) -> None:
    if saved is None:
        return
    state = reducer.comm_hook[0] if reducer is not None and reducer.comm_hook else None
    if state is None or type(state).__qualname__ != saved["type"]:
        raise ValueError(
            f"load_gradsync_state: the checkpoint holds the state of a {saved['type']} hook, but "
            f"{'no hook' if state is None else f'a {type(state).__qualname__}'} is registered. "
            "Call register_comm_hook with the same kind of state before load_gradsync_state."
        )
    for name, value in saved["fields"].items():
        setattr(state, name, value)
