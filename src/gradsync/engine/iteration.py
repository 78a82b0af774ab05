"""One synchronised iteration's state, as an object of its own.

`Reducer.prepare_for_backward` makes it; the phases that follow (marking gradients ready,
launching buckets, the end of backward, the finish and write-back, the static graph's first
iteration, the missing-gradient report) are handed it and read or advance only it. Between
iterations the last one is kept: its marks tell a late gradient from a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .timeline import IterationTimeline, untimed

__all__ = ["Iteration"]


@dataclasses.dataclass(slots=True, eq=False)
class Iteration:
    """What one iteration has marked, launched and still waits for."""

    number: int
    marked: list[bool]
    """Per parameter: marked ready (by its hook, or up front as unused)."""
    timeline: IterationTimeline
    grad_clock: Callable[[], int] = untimed
    """Reads a gradient's ready time (untimed on device iterations not sampled)."""
    divisor: int = 1
    """The number of ranks the gradients are averaged over."""
    micro_steps: int = 1
    """Forwards this synchronisation covers (1 + those under no_sync)."""
    unused: list[int] = dataclasses.field(default_factory=list)
    """Parameters marked ready up front: unreachable from the outputs, or never fired."""
    unused_pending: bool = False
    """The unused parameters are still to be marked (at the first hook, as torch does)."""
    search: Callable[[], object] | None = None
    """The unused-parameter search, waiting for backward: a weak reference to the node every
    output comes from (`Reducer._answer_in_backward`); None once answered for good, or walked."""
    answered: bool = False
    """The search was answered by the backward now running (the outputs' node's prehook)."""
    reports_in_tail: bool = False
    """This rank's report rides in the last bucket's all-reduce."""
    joined: bool = False
    """A joined rank's shadow of the active ranks' iteration (`shadow`)."""
    missing: list[int] = dataclasses.field(default_factory=list)
    """Parameters without a gradient when backward ended."""
    end_queued: bool = False
    """The end of backward is queued on the autograd engine (or nothing is left to finish)."""
    watching: bool = False
    """The outputs' backward nodes will queue the end of backward."""
    again: int = -1
    """Once reduced: the graph task of a later backward through the outputs' nodes (a second
    backward of a retained graph), whose gradients are late ones, not a backward of its own."""
    backward_stream: Any = None
    """On a GPU: the stream of this backward's first hook."""

    @classmethod
    def idle(cls, number: int, n_params: int, divisor: int) -> Iteration:
        """The state before any iteration (or after one was abandoned): nothing marked."""
        return cls(number, [False] * n_params, IterationTimeline(number, 0, [], []),
                   divisor=divisor)

    def unmarked(self) -> list[int]:
        return [i for i, done in enumerate(self.marked) if not done]
