"""static_graph=True: what the first iteration learns and every later one relies on.

The first iteration only watches: it counts how often each parameter's hook fires (reentrant
activation checkpointing fires a shared parameter's hook more than once), and everything is
reduced at the very end of its backward. Later iterations mark a parameter ready on its last
firing, and mark the parameters that never fired ready up front. The first iteration's global
used map (which parameters got a gradient on some rank) holds for good.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .iteration import Iteration
from .timeline import EventKind
from .used_map import UsedMap

__all__ = ["StaticGraph", "finish_first_iteration", "learning_fire"]


class StaticGraph:
    """Hook counts per parameter: learned once, then the readiness rule."""

    def __init__(self, n_params: int) -> None:
        self.n = n_params
        self.counts: list[int] = []  # firings per parameter in the first iteration
        self.unused: list[int] = []  # parameters that never fired then
        self.used_map: list[int] | None = None  # the first iteration's global used map
        self.fires = [0] * n_params
        self.learning = False

    @property
    def learned(self) -> bool:
        return bool(self.counts)

    def start_iteration(self) -> None:
        self.fires = [0] * self.n
        self.learning = not self.learned

    def fire(self, index: int) -> bool:
        """Count one firing of `index`'s hook; True when that was its last (ready)."""
        self.fires[index] += 1
        return not self.learning and self.fires[index] >= self.counts[index]

    def learn(self) -> list[int]:
        """End of the first iteration: keep the counts; return the parameters never fired."""
        self.counts = list(self.fires)
        self.unused = [i for i, n in enumerate(self.fires) if n == 0]
        self.learning = False
        return self.unused

    def settle_used_map(self, used: list[int] | None) -> list[int] | None:
        """The used map to write back with: the first iteration's, from then on."""
        if self.used_map is None:
            self.used_map = used
        return self.used_map


def learning_fire(static: StaticGraph, it: Iteration, used: UsedMap, index: int,
                  param: torch.Tensor, queue_end: Callable[[Iteration], None]) -> None:
    """A hook in the first iteration: counted (by `StaticGraph.fire`); reduced at its end."""
    if param.grad is not None:  # fired without a gradient: unused here, as torch counts it
        used.local[index] = 1
    if static.fires[index] == 1:
        it.timeline.events.append((it.grad_clock(), EventKind.READY, index))
    if not it.watching and not it.end_queued:  # no outputs seen: best effort
        queue_end(it)


def finish_first_iteration(static: StaticGraph, it: Iteration,
                           mark: Callable[[Iteration, int, int], None],
                           start_used_map: Callable[[Iteration], None],
                           finish: Callable[[], None]) -> None:
    """End of the first backward: learn the counts, then reduce everything (`mark` each
    parameter ready, the fired ones in their order), the used map too, and `finish`."""
    fired = it.timeline.ready_order()
    unused = static.learn()
    it.timeline.events.clear()
    for index in fired:
        mark(it, index, EventKind.READY)
    for index in unused:
        mark(it, index, EventKind.UNUSED)
    start_used_map(it)
    finish()
