"""The callables through which a sharded optimizer steps outside its own `step()`.

`StepInBackward` is the Reducer's finish hook under `overlap_with_ddp` (the step inside
backward); `ZeroJoinHook` is its `Join` hook, for a rank that has run out of data. Each is
given the one method it calls, so neither knows the optimizer's insides.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch.distributed.algorithms.join import JoinHook

__all__ = ["StepInBackward", "ZeroJoinHook", "remove_all"]


class StepInBackward:
    """The reducer's finish hook under `overlap_with_ddp`: the step, inside backward, as soon as
    the synchronised iteration is finished (torch's hook steps there too, in the last bucket's
    hook). The wrapper's mixed-precision restore has run by then: it is queued first. It holds
    the step weakly: the reducer, which holds this hook, must not keep the optimizer alive."""

    def __init__(self, step: weakref.WeakMethod[Callable[[], None]]) -> None:
        self.step = step

    def __call__(self) -> None:
        step = self.step()
        if step is not None:
            step()


class ZeroJoinHook(JoinHook):
    """`Join`'s hook: after each synchronised iteration of the ranks still training, a joined
    rank runs `joined_step` (which decides whether there is anything to step)."""

    def __init__(self, joined_step: Callable[[], None]) -> None:
        self.joined_step = joined_step

    def main_hook(self) -> None:
        self.joined_step()


def remove_all(handles: Iterable[Any]) -> None:
    for handle in handles:
        handle.remove()
