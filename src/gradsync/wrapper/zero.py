"""`gradsync.ZeroRedundancyOptimizer`: optimizer state sharded across ranks (ZeRO stage 1).

A drop-in for torch's class of that name. Every rank holds every parameter and, after data
parallel's all-reduce, every averaged gradient; each rank *owns* a partition of the parameters
and keeps optimizer state for those only, about 1/N of it. `step()` steps the owned parameters
with a local optimizer of the given class, then each owner broadcasts its updated parameters to
the others (flat, one broadcast per dtype and device). The partition is torch's: per parameter
group, largest first, each parameter to the rank holding the fewest elements so far; so the
same parameters end on the same ranks as under torch's class.

For an elementwise optimizer (SGD, Adam, AdamW, ...) a parameter's update depends only on its
own gradient and state, so the results are the unsharded optimizer's, bit for bit.

State dicts are the unsharded optimizer's format: `consolidate_state_dict(to=r)` gathers every
rank's share onto rank r, whose `state_dict()` then indexes state by the parameter's position
over all groups, as `torch.optim.Optimizer.state_dict()` does. Such a dict is independent of the
world size: it loads into a sharded optimizer of any world size, or into the plain optimizer.

Every `step()` first agrees, in one small all-gather, that each rank has the same parameter
groups and has run a backward since its last step; a rank that differs makes every rank raise
the same error, naming the ranks and their values, instead of leaving the others waiting in a
broadcast. On a GPU that agreement reads a few integers back to the host once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..engine.collectives import DEFAULT_TIMEOUT, all_gather_objects, broadcast_tensors

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(Optimizer):
    """Wraps `optimizer_class(**defaults)`; each rank keeps the state of its own parameters."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        timeout: timedelta = DEFAULT_TIMEOUT,
        **defaults: Any,
    ) -> None:
        if overlap_with_ddp:
            raise ValueError(
                "gradsync.ZeroRedundancyOptimizer(overlap_with_ddp=True): torch's form runs the step "
                "inside a DDP comm hook; gradsync's is not built yet. Leave overlap_with_ddp out: "
                "the results are the same, the step runs after backward."
            )
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self._ready = False
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("ZeroRedundancyOptimizer: torch.distributed is not initialised; "
                               "call init_process_group first or pass process_group")
        self.process_group: dist.ProcessGroup = group
        self.world_size, self.rank = self.process_group.size(), self.process_group.rank()
        self.optimizer_class, self.timeout = optimizer_class, timeout
        self.parameters_as_bucket_view = parameters_as_bucket_view  # accepted: broadcasts are flat anyway
        self._optim_defaults = defaults
        # The class's whole defaults (Adam's betas, eps, ...), so that our groups, the state
        # dicts' and an LR scheduler's view hold every hyperparameter, as the plain optimizer's do.
        full = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults).defaults
        super().__init__(params, full)
        params_all = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params_all}) != len(params_all):
            raise ValueError("ZeroRedundancyOptimizer: a parameter appears twice in the parameter groups")
        self._backward_seen = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._saw_backward) for p in params_all if p.requires_grad]
        self._partition: list[list[list[torch.Tensor]]] = []  # [group][rank] -> parameters
        self._loads = [0] * self.world_size
        for g in self.param_groups:
            self._partition.append(self._split(g["params"]))
        self.optim: Optimizer | None = None
        self._build_local_optimizer()
        self._consolidated: dict[str, Any] | None = None
        self._ready = True

    # ------------------------------------------------------------------ partition

    def _split(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """torch's greedy partition of one group, continuing from the groups before it."""
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            rank = self._loads.index(min(self._loads))
            per_rank[rank].append(p)
            self._loads[rank] += p.numel()
        return per_rank

    def _local_groups(self) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": part[self.rank]}
                for g, part in zip(self.param_groups, self._partition)]

    def _build_local_optimizer(self) -> None:
        groups = self._local_groups()
        owned = [g for g in groups if g["params"]]
        # A rank that owns nothing (more ranks than parameters) steps nothing.
        self.optim = self.optimizer_class(groups, **self._optim_defaults) if owned else None

    def owner(self, param: torch.Tensor) -> int:
        """The rank that steps `param` and holds its optimizer state."""
        for part in self._partition:
            for rank, params in enumerate(part):
                if any(p is param for p in params):
                    return rank
        raise KeyError("ZeroRedundancyOptimizer.owner: not one of this optimizer's parameters")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (the next `step()` checks that all did): it is partitioned
        after the existing ones, which keep their owners and state."""
        super().add_param_group(param_group)
        if not getattr(self, "_ready", False):
            return  # the constructor partitions the initial groups itself
        group = self.param_groups[-1]
        self._hooks += [p.register_post_accumulate_grad_hook(self._saw_backward) for p in group["params"] if p.requires_grad]
        self._partition.append(self._split(group["params"]))
        mine = self._local_groups()[-1]
        if self.optim is None:
            self._build_local_optimizer()
        elif mine["params"]:
            self.optim.add_param_group(mine)
        else:  # keep the local groups aligned with the global ones
            self.optim.param_groups.append({**mine, "params": []})

    # ------------------------------------------------------------------ step

    def _saw_backward(self, _param: torch.Tensor) -> None:
        self._backward_seen = True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the owned parameters, then broadcast every owner's parameters to the others."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._agree_before_step()
        self._backward_seen = False
        if self.optim is not None:
            for local, group in zip(self.optim.param_groups, self.param_groups):
                for key, value in group.items():  # an LR scheduler writes into our groups
                    if key != "params":
                        local[key] = value
            self.optim.step()
        self._broadcast_parameters()
        return loss

    def _broadcast_parameters(self) -> None:
        for rank in range(self.world_size):
            owned = [p for part in self._partition for p in part[rank]]
            if owned:
                broadcast_tensors(self.process_group, owned, src=rank, timeout=self.timeout,
                                  what=f"broadcast of the parameters rank {rank} stepped")

    def _agree_before_step(self) -> None:
        """Refuse, on every rank alike, a step some rank is not ready for."""
        mine = (len(self.param_groups), sum(p.numel() for g in self.param_groups for p in g["params"]),
                self._backward_seen)
        every = all_gather_objects(self.process_group, mine, self.timeout)
        if len({v[:2] for v in every}) > 1:  # type: ignore[index]
            seen = ", ".join(f"rank {r}: {v[0]} groups, {v[1]} elements" for r, v in enumerate(every))  # type: ignore[index]
            raise ValueError(
                f"ZeroRedundancyOptimizer.step: the ranks hold different parameter groups ({seen}). "
                "Call add_param_group with the same group on every rank."
            )
        idle = [r for r, v in enumerate(every) if not v[2]]  # type: ignore[index]
        if idle:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.step: no backward since the last step on rank(s) {idle} "
                f"(of {self.world_size}): run loss.backward() before every step(), on every rank."
            )

    # ------------------------------------------------------------------ state dicts

    def _local_to_global(self) -> list[int]:
        """Each local parameter's position over all groups (the unsharded state dict's index)."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return [index[id(p)] for part in self._partition for p in part[self.rank]]

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state onto rank `to` (call on every rank)."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict(to={to}): expected a rank in 0..{self.world_size - 1}")
        local = self.optim.state_dict()["state"] if self.optim is not None else {}
        # Local state keys run over the local groups in order, as _local_to_global does.
        mine = {g: local[i] for i, g in enumerate(self._local_to_global()) if i in local}
        gathered = all_gather_objects(self.process_group, mine, self.timeout)
        if self.rank != to:
            self._consolidated = None
            return
        state: dict[int, Any] = {}
        for part in gathered:
            state.update(part)  # type: ignore[call-overload]
        self._consolidated = {"state": dict(sorted(state.items())), "param_groups": self._global_groups()}

    def _global_groups(self) -> list[dict[str, Any]]:
        start, groups = 0, []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return groups

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, on the rank `consolidate_state_dict(to=...)` named."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict on rank {self.rank}: call consolidate_state_dict(to=r) "
                "on every rank first; then rank r holds the whole state"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (consolidated or unsharded) state dict; each rank keeps its share."""
        groups, total = state_dict.get("param_groups"), sum(len(g["params"]) for g in self.param_groups)
        if not isinstance(groups, list) or [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            sizes = [len(g["params"]) for g in groups] if isinstance(groups, list) else groups
            raise ValueError(
                f"ZeroRedundancyOptimizer.load_state_dict: the dict's parameter groups hold {sizes} parameters, "
                f"this optimizer's {[len(g['params']) for g in self.param_groups]} ({total} in all)"
            )
        for ours, theirs in zip(self.param_groups, groups):
            ours.update({k: v for k, v in theirs.items() if k != "params"})
        state = {int(k): v for k, v in state_dict.get("state", {}).items()}
        if self.optim is not None:
            local = self.optim.state_dict()
            local["state"] = {i: state[g] for i, g in enumerate(self._local_to_global()) if g in state}
            local["param_groups"] = [{**{k: v for k, v in g.items() if k != "params"}, "params": lg["params"]}
                                     for g, lg in zip(self.param_groups, local["param_groups"])]
            self.optim.load_state_dict(local)
        self._consolidated = None

    def __repr__(self) -> str:
        owned = sum(len(part[self.rank]) for part in self._partition)
        return (f"gradsync.ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank} of "
                f"{self.world_size}, owns {owned} of {sum(len(g['params']) for g in self.param_groups)} parameters)")

