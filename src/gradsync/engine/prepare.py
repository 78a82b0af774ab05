"""The start of a synchronised iteration: its state (`iteration.Iteration`) made from what
forward returned, the parameters to mark ready up front, and how its gradients are timed."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .bucket_set import BucketSet
from .iteration import Iteration
from .settings import Settings
from .timeline import DiscardedEvents, IterationTimeline, untimed
from .unused import Accumulators, reachable_from, reachable_parameters

__all__ = [
    "answer_in_backward", "held_accumulators", "new_iteration", "settle_search", "start_search", "watch_backward_start",
]


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


def start_search(it: Iteration, s: Settings, params: Sequence[torch.Tensor], outputs: list[torch.Tensor],
                 accumulators: Accumulators | None) -> None:
    """`it.unused`, the parameters to mark ready at the first hook: unreachable from `outputs`
    (unused-parameter search), or, with a static graph once learned, never fired. Or the search
    left for backward (`answer_in_backward`): `it.search`, a weak reference to the one node
    every output comes from."""
    unused: list[int] = []
    search = None
    if s.find_unused:
        search = _deferrable(outputs) if accumulators is not None else None
        if search is None:
            unused = _unreached(params, reachable_parameters(outputs))
    if s.static is not None:
        s.static.start_iteration()
        if s.static.learned:
            unused, search = list(s.static.unused), None
    it.unused, it.search, it.unused_pending = unused, search, bool(unused) or search is not None


def held_accumulators(s: Settings, params: Sequence[torch.Tensor]) -> Accumulators | None:
    """The parameters' accumulators, held for the search to ask the engine about (None: the
    search walks). Not with parameters cast each forward (`bucket_dtype`: mixed precision),
    which get new accumulators each time."""
    return Accumulators(params) if s.find_unused and s.config.bucket_dtype is None else None


def settle_search(it: Iteration, accumulators: Accumulators | None, params: Sequence[torch.Tensor],
                  first: int | None) -> list[int]:
    """At the iteration's first gradient (`first`, its index): the parameters to mark unused
    now, the search's answer for good (asked now if backward has not reached the outputs'
    node yet)."""
    if it.search is not None:
        if not it.answered:
            it.unused = answer_in_backward(accumulators, params, it.search, first)
        it.search = None
    it.unused_pending = False
    return it.unused


def _deferrable(outputs: list[torch.Tensor]) -> Callable[[], object] | None:
    """A weak reference to the node every output comes from (the wrapper's output sink), or
    None where the search must walk now: outputs from several nodes, a leaf among them, or a
    node that cannot be held weakly (holding it strongly would keep a graph never
    backpropagated alive)."""
    nodes = {t.grad_fn for t in outputs}
    if len(nodes) != 1:
        return None
    node = nodes.pop()
    if not isinstance(node, torch._C._FunctionBase):  # None (a leaf), or a C++ node
        return None
    return weakref.ref(node)


def answer_in_backward(accumulators: Accumulators | None, params: Sequence[torch.Tensor],
                       search: Callable[[], Any], first: int | None) -> list[int]:
    """The search left for backward, answered there: in the outputs' node's prehook (`first` is
    None), or at a gradient that came before backward reached that node (`first`, its index).

    The engine's answer is the walk's whenever backward runs through the outputs' node: all it
    reaches from there, the engine runs (what it runs besides are parameters used outside
    forward, which torch's DDP rejects). A gradient that came first, while that node is still to
    run, is one of those: torch's DDP marks it unused, then ready, and raises; so does the
    Reducer, given it as unused. A backward that does not run through the node gets the walk's
    answer, or, the node gone with its graph, the engine's."""
    assert accumulators is not None, "a search waits for backward only with accumulators held"
    node = search() if first is not None else None
    if first is None or node is None:
        return accumulators.unused()
    if torch._C._will_engine_execute_node(node):
        return [first]
    return _unreached(params, reachable_from([node]))


def _unreached(params: Sequence[torch.Tensor], reached: set[int]) -> list[int]:
    return [i for i, p in enumerate(params) if id(p) not in reached]
