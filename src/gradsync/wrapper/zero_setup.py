"""The sharded optimizer's construction steps that need none of its state: checks and look-ups.

Each function checks one argument of `ZeroRedundancyOptimizer`, or finds the gradsync wrapper it
serves, and raises an exception that says what to change. A parameter knows its gradsync wrapper
(weakly) by the reference `DistributedDataParallel` sets on it: that is how the optimizer finds
the wrapper whose gradients it shards (ZeRO-2) or whose backward it steps in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..engine.reducer import Reducer
from .zero_shards import check_dense

__all__ = [
    "check_optimizer_class", "check_overlap_target", "check_shardable", "check_unique",
    "full_defaults", "reducer_of", "resolve_group", "sharding_wrapper",
]


def check_optimizer_class(optimizer_class: Any) -> None:
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("ZeroRedundancyOptimizer: torch.distributed is not initialised; "
                           "call init_process_group first or pass process_group")
    return group


def full_defaults(optimizer_class: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The class's whole defaults (Adam's betas, eps, ...) with the given ones, so that the
    sharded optimizer's groups, its state dicts' and an LR scheduler's view hold every
    hyperparameter, as the plain optimizer's do."""
    return optimizer_class([torch.zeros(1, requires_grad=True)], **defaults).defaults


def check_unique(params: list[torch.Tensor]) -> None:
    if len({id(p) for p in params}) != len(params):
        raise ValueError(
            "ZeroRedundancyOptimizer: a parameter appears twice in the parameter groups"
        )


def check_overlap_target(params: list[torch.Tensor]) -> None:
    """`overlap_with_ddp=True` needs one live gradsync wrapper holding all these parameters."""
    if reducer_of(params) is None:
        raise ValueError(
            "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside the backward "
            "of the gradsync.DistributedDataParallel whose parameters it holds: "
            "its trainable parameters must all be one live gradsync wrapper's (wrap "
            "the model with gradsync.DistributedDataParallel first; over torch's DDP "
            "use torch's class and its ddp_zero_hook), or leave overlap_with_ddp out"
        )


def sharding_wrapper(params: list[torch.Tensor], shard_gradients: bool | None) -> Any:
    """The wrapper whose gradients to shard (ZeRO-2), or None for ZeRO-1."""
    wrapper = _wrapper_of(params) if shard_gradients is not False else None
    if wrapper is None and shard_gradients:
        raise ValueError(
            "ZeroRedundancyOptimizer(shard_gradients=True): the parameters must belong to a "
            "gradsync.DistributedDataParallel (wrap the model first, then build the optimizer)"
        )
    return wrapper


def check_partition_allowed(params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """ZeRO-1: each wrapper these parameters belong to may refuse to have their optimizer
    state split across `group` (`check_sharded_optimizer`: gradsync.ft does, with the reason)."""
    for wrapper in _wrappers([p for p in params if p.requires_grad]).values():
        wrapper.check_sharded_optimizer(group)


def check_shardable(wrapper: Any, params: list[torch.Tensor]) -> None:
    """ZeRO-2: the optimizer must hold exactly the wrapper's trainable parameters, be the only
    one sharding its gradients, and every parameter's memory must be dense."""
    reducer: Reducer = wrapper.reducer
    ours = {id(p) for p in params if p.requires_grad}
    theirs = {id(p): n for n, p in zip(reducer.names, reducer.params)}
    missing = [n for i, n in theirs.items() if i not in ours]
    extra = [i for i in ours if i not in theirs]
    if missing or extra:
        named = {id(p): n for n, p in wrapper.module.named_parameters()}
        raise ValueError(
            "ZeroRedundancyOptimizer: to shard the gradients it must hold every trainable "
            "parameter of its gradsync.DistributedDataParallel and no others; missing: "
            f"{missing[:8] or 'none'}{' ...' if len(missing) > 8 else ''}; not synchronised by "
            f"that wrapper: {[named.get(i, '?') for i in extra][:8] or 'none'}. Give all of the "
            "wrapper's parameters to one sharded optimizer (parameter groups may differ), or pass "
            "shard_gradients=False (ZeRO-1)."
        )
    if reducer.shard_owner is not None and reducer.shard_owner() is not None:
        raise ValueError(
            "ZeroRedundancyOptimizer: another sharded optimizer already holds this wrapper's "
            "gradients; build one per wrapper"
        )
    check_dense(reducer)


def reducer_of(params: list[torch.Tensor]) -> Reducer | None:
    """The reducer of the one live gradsync wrapper all these trainable parameters belong to."""
    trainable = [p for p in params if p.requires_grad]
    wrappers = _wrappers(trainable)
    if len(wrappers) != 1 or any(
        getattr(p, "_gradsync_wrapper", _none)() is None for p in trainable
    ):
        return None
    return next(iter(wrappers.values())).reducer


def _wrapper_of(params: list[torch.Tensor]) -> Any:
    """The live gradsync wrapper these parameters belong to, if any (one is required)."""
    found = _wrappers(params)
    if len(found) > 1:
        raise ValueError(
            f"ZeroRedundancyOptimizer: the parameters belong to {len(found)} "
            "gradsync.DistributedDataParallel wrappers; to shard gradients give each "
            "wrapper's parameters to an optimizer of their own, or pass shard_gradients=False"
        )
    return next(iter(found.values()), None)


def _wrappers(params: list[torch.Tensor]) -> dict[int, Any]:
    return {id(w): w for p in params if (w := getattr(p, "_gradsync_wrapper", _none)()) is not None}


def _none() -> None:
    return None
