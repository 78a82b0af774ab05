"""The start of a synchronised iteration: its state (`iteration.Iteration`) made from what
forward returned, the parameters to mark ready up front, and how its gradients are timed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .bucket_set import BucketSet
from .iteration import Iteration
from .settings import Settings
from .timeline import DiscardedEvents, IterationTimeline, untimed
from .unused import reachable_parameters

__all__ = ["new_iteration", "unused_up_front", "watch_backward_start"]


def new_iteration(s: Settings, buckets: BucketSet, number: int, divisor: int, micro_steps: int,
                  forward_start_ns: int, needs_order: bool) -> Iteration:
    """Iteration `number`'s state, its timeline started now. `needs_order`: the ready order is
    recorded whatever the config says, for the rebuild that reads it (without it the first
    iteration's single bucket stayed for good, and nothing overlapped)."""
    grad_clock = gradient_clock(s, number)
    timeline = IterationTimeline(
        iteration=number,
        start_ns=s.clock(),
        bucket_indices=buckets.layout,  # shared, not copied: a layout is never mutated
        bucket_bytes=buckets.layout_bytes,
        events=[] if s.config.record_events or needs_order else DiscardedEvents(),
        forward_start_ns=forward_start_ns,
        gradients_timed=grad_clock is not untimed,
    )
    return Iteration(number, [False] * len(buckets.params), timeline, grad_clock, divisor, micro_steps)


def watch_backward_start(it: Iteration, outputs: list[torch.Tensor], hook: Callable[[object], None]) -> None:
    """Register `hook` to run when backward reaches `outputs`' nodes. Backward reaches
    forward's outputs first, in the outermost backward (a reentrant checkpoint's nested
    backward comes later, inside it); a callback queued from there runs when that whole
    backward has ended: the one place to see a bucket left unfilled."""
    nodes = {id(t.grad_fn): t.grad_fn for t in outputs if t.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(hook)
    it.watching = bool(nodes)


def gradient_clock(s: Settings, number: int) -> Callable[[], int]:
    """A CUDA event per gradient costs the host microseconds each: on the device, gradients
    are timed on sampled iterations only (buckets and the iteration always are)."""
    if not s.device_timed or number % s.config.time_gradients_every == 0:
        return s.clock
    return untimed


def unused_up_front(s: Settings, params: Sequence[torch.Tensor], outputs: list[torch.Tensor]) -> list[int]:
    """Parameters to mark ready at the first hook: unreachable from `outputs` (unused-parameter
    search), or, with a static graph once learned, never fired."""
    unused: list[int] = []
    if s.find_unused:
        reached = reachable_parameters(outputs)
        unused = [i for i, p in enumerate(params) if id(p) not in reached]
    if s.static is not None:
        s.static.start_iteration()
        if s.static.learned:
            unused = list(s.static.unused)
    return unused
