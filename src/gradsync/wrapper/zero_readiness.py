"""Whether every rank is ready for a sharded optimizer's step, checked before any parameter is sent.

Without sharded gradients, on a host group (gloo), every `step()` agrees, in one small
all-gather in flight while each rank steps its own share, that each rank has the same parameter
groups and has run a backward since its last step (`start_agreement` / `finish_agreement`); a
rank that differs makes every rank raise the same error before any parameter is sent. Elsewhere
(sharded gradients, a device group) each rank checks only itself (`check_own_backward`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..engine.collectives import GatheringInts, finish_all_gather_ints, start_all_gather_ints
from ..engine.reducer import Reducer

__all__ = ["BackwardSeen", "check_own_backward", "finish_agreement", "start_agreement"]


class BackwardSeen:
    """A parameter's post-accumulate-grad hook (ZeRO-1): notes that backward ran since the last
    step. The hooks live on the parameters' C++ side, out of the garbage collector's sight, so
    they hold this flag only: a reference to the optimizer there would keep it, its wrapper's
    reducer and the process group alive for as long as the parameters."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, _param: torch.Tensor | None = None) -> None:
        self.seen = True

    def take(self) -> bool:
        """Whether backward ran since the last `take()`; the flag is cleared."""
        seen, self.seen = self.seen, False
        return seen


def start_agreement(
    group: dist.ProcessGroup, param_groups: list[dict[str, Any]], seen: bool
) -> GatheringInts:
    """Start agreeing that every rank is ready for this step (the same parameter groups, a
    backward since its last step), to finish after this rank's local step: the round trip hides
    behind the step."""
    mine = [len(param_groups), sum(p.numel() for g in param_groups for p in g["params"]), int(seen)]
    return start_all_gather_ints(group, mine)


def finish_agreement(
    agreement: GatheringInts, group: dist.ProcessGroup, timeout: timedelta
) -> None:
    """Refuse, on every rank alike, a step some rank was not ready for, before any parameter
    is sent: the ranks that were have stepped their own share (a rank with no backward has
    not), so the error leaves the ranks' parameters apart; it is an error to stop on."""
    every = finish_all_gather_ints(agreement, group, timeout)
    if len({tuple(v[:2]) for v in every}) > 1:
        seen = ", ".join(f"rank {r}: {v[0]} groups, {v[1]} elements" for r, v in enumerate(every))
        raise ValueError(
            f"ZeroRedundancyOptimizer.step: the ranks hold different parameter groups ({seen}). "
            "Call add_param_group with the same group on every rank."
        )
    idle = [r for r, v in enumerate(every) if not v[2]]
    if idle:
        raise RuntimeError(
            f"ZeroRedundancyOptimizer.step: no backward since the last step on rank(s) {idle} "
            f"(of {group.size()}): run loss.backward() before every step(), on every rank."
        )


def check_own_backward(
    reducer: Reducer | None, syncs: int, seen: bool, group: dist.ProcessGroup
) -> None:
    """Without the agreement collective (sharded gradients: a per-step round trip saved,
    figures in docs/benchmarks/design-figures.md#zero-agreement-round-trip, and the groups
    cannot change since `add_param_group` is refused; a device group: no host read per step) a
    rank without a backward knows it.
    It raises here; a rank that did run one is then waiting in a collective this rank never
    joins, and raises within its timeout (the process group's, on a device group).
    `syncs`: the reducer's count of synchronised backwards at the last step."""
    if reducer is not None:
        if reducer.reductions > syncs:
            return
        what = (
            "synchronised backward",
            "the gradients are sharded only by a backward outside no_sync(); ",
        )
    elif seen:
        return
    else:
        what = ("backward", "")
    raise RuntimeError(
        f"ZeroRedundancyOptimizer.step: no {what[0]} since the last step on rank {group.rank()} "
        f"(of {group.size()}): {what[1]}run one before every step(), on every rank."
    )
