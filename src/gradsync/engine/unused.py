"""Which parameters can receive a gradient from these outputs: the unused-parameter search.

A parameter whose gradient accumulator is not reachable from the forward outputs will never fire
its hook, so the Reducer marks it ready up front; otherwise its bucket would wait forever. Two
ways to find them: a walk of the autograd graph from the outputs, in Python, at the end of
forward (`reachable_parameters`); or, from inside backward, the autograd engine's own answer
for each parameter's accumulator (`Accumulators`), which the engine worked out in C++ when
backward started. The Reducer asks the engine when it can give the same answer as the walk
(`prepare.start_search` says when) and walks otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = [
    "Accumulators", "current_accumulators", "reachable_from", "reachable_parameters",
    "route_through_sink",
]


def reachable_parameters(outputs: Iterable[torch.Tensor]) -> set[int]:
    """`id()` of every leaf tensor whose gradient accumulator the outputs' graph reaches."""
    roots: list[Any] = []
    reached: set[int] = set()
    for out in outputs:
        if out.grad_fn is not None:
            roots.append(out.grad_fn)
        elif out.requires_grad:  # a leaf returned as is: it gets a gradient directly
            reached.add(id(out))
    return reachable_from(roots, reached)


def reachable_from(roots: list[Any], reached: set[int] | None = None) -> set[int]:
    """`id()` of every leaf tensor whose gradient accumulator these autograd nodes reach,
    added to `reached` if given.

    Run every forward where the search walks, over every node of the graph: the loop is kept to
    what each node needs (its next functions; an accumulator, which has none, its leaf)."""
    reached = set() if reached is None else reached
    stack = list(roots)
    seen: set[object] = {None, *stack}  # None: an input that needs no gradient
    push, see = stack.append, seen.add
    while stack:
        fn = stack.pop()
        next_functions = fn.next_functions
        if not next_functions:  # AccumulateGrad nodes hold their leaf
            variable = getattr(fn, "variable", None)
            if variable is not None:
                reached.add(id(variable))
            continue
        for next_fn, _ in next_functions:
            if next_fn not in seen:
                see(next_fn)
                push(next_fn)
    return reached


class Accumulators:
    """Each parameter's gradient accumulator (its `AccumulateGrad` node), held for good as
    torch's C++ Reducer holds its `grad_accumulators_`: every graph built on the parameter then
    ends in the same node, and from inside a backward the engine says whether it will run it
    (`torch._C._will_engine_execute_node`, a set look-up in C++), where the walk visits every
    node of the graph in Python."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)
        self._nodes = current_accumulators(self._params)

    def unused(self) -> list[int] | None:
        """Inside backward: the parameters whose accumulator this backward will not run. None
        inside `torch.autograd.grad`, which runs none (it captures the gradients it returns;
        the engine refuses to be asked about an accumulator there)."""
        will_run = torch._C._will_engine_execute_node
        try:
            idle = [i for i, node in enumerate(self._nodes) if node is None or not will_run(node)]
        except RuntimeError as error:
            if "autograd.grad" in str(error):
                return None
            raise
        if not idle:
            return idle
        # Setting `p.data` to another dtype or device drops the parameter's accumulator, and
        # autograd makes a new one at its next use: look again before calling it unused. A
        # parameter frozen since (`requires_grad_(False)`) has none now: it is unused, as in
        # torch's DDP, and the node held stays its accumulator if it is unfrozen.
        unused = []
        for i, node in zip(idle, current_accumulators([self._params[i] for i in idle])):
            if node is not None and node is not self._nodes[i]:
                self._nodes[i] = node
                if will_run(node):
                    continue
            unused.append(i)
        return unused


def current_accumulators(params: Sequence[torch.Tensor]) -> list[Any]:
    """Each parameter's `AccumulateGrad` node now (made if it has none; None for a parameter
    that does not require grad), all in one look-up: the edges of one autograd node taking them
    all (`get_gradient_edge` makes a view per parameter: slower,
    docs/benchmarks/design-figures.md#accumulator-look-up)."""
    with torch.enable_grad():  # inside backward it is off, and the node would not be made
        node = _Edges.apply(*params).grad_fn
    if node is None:  # none of them requires grad
        return [None] * len(params)
    return [edge for edge, _ in node.next_functions]


class _Edges(torch.autograd.Function):
    """A node whose next functions are its inputs' gradient edges; never run."""

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.empty(0)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor) -> None:  # type: ignore[override]
        raise AssertionError("gradsync's accumulator look-up is never backpropagated")


# ------------------------------------------------------------------ outputs left out of the loss
#
# A parameter reachable from one of forward's outputs is not marked unused by the search, so its
# bucket waits for its gradient. If that output is left out of the loss, autograd never visits
# its subgraph and the gradient never comes. As torch's DDP does (`_DDPSink`), every output
# passes through one autograd node: the engine then reaches every output from the loss, and
# visits the subgraph behind an unused one with an undefined gradient. Its parameters' hooks
# fire with no gradient, and the Reducer counts them as unused on this rank (`.grad` left as is).


class _OutputSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        # Cloned, as torch does: a view returned from a Function cannot be modified in place.
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return grads


def route_through_sink(output: Any) -> Any:
    """`output` with every tensor that has a `grad_fn` replaced by its pass through one shared
    autograd node (see above); the structure (tuples, lists, dicts, named tuples, dataclasses,
    pytree-registered types such as HF's ModelOutput) is rebuilt around the new tensors."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map_tensors(output, collect)
    if not found:
        return output
    routed = iter(_OutputSink.apply(*found))
    return _map_tensors(output, lambda _t: next(routed))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` rebuilt with `fn(t)` for each tensor `t` that has a grad_fn, in a fixed order."""
    leaves, spec = pytree.tree_flatten(obj, is_leaf=_is_plain_dataclass)
    mapped = [_map_leaf(leaf, fn) for leaf in leaves]
    return pytree.tree_unflatten(mapped, spec)


def _map_leaf(leaf: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(leaf, torch.Tensor):
        return fn(leaf) if leaf.grad_fn is not None else leaf
    if _is_plain_dataclass(leaf):
        fields = [f.name for f in dataclasses.fields(leaf) if f.init]
        changes = {name: _map_tensors(getattr(leaf, name), fn) for name in fields}
        try:
            return dataclasses.replace(leaf, **changes)
        except Exception:  # an __init__ or __post_init__ we cannot replay: leave it, as torch does
            return leaf
    return leaf


def _is_plain_dataclass(obj: Any) -> bool:
    """A dataclass instance that pytree does not know how to flatten itself."""
    return (
        dataclasses.is_dataclass(obj)
        and not isinstance(obj, type)
        and type(obj) not in pytree.SUPPORTED_NODES
    )
