"""Which parameters can receive a gradient from these outputs: a walk of the autograd graph.

A parameter whose gradient accumulator is not reachable from the forward outputs will never fire
its hook, so the Reducer marks it ready up front; otherwise its bucket would wait forever.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["find_tensors", "reachable_parameters", "route_through_sink"]


def find_tensors(obj: object) -> list[torch.Tensor]:
    """All tensors inside an arbitrary forward output: tuples, lists, dicts, dataclasses."""
    found: list[torch.Tensor] = []
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif id(item) in seen or isinstance(item, (str, bytes)):
            continue
        elif isinstance(item, Mapping):
            seen.add(id(item))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            seen.add(id(item))
            stack.extend(item)
        elif hasattr(item, "__dataclass_fields__"):
            seen.add(id(item))
            stack.extend(getattr(item, f) for f in item.__dataclass_fields__)
    return found


def reachable_parameters(outputs: Iterable[torch.Tensor]) -> set[int]:
    """`id()` of every leaf tensor whose gradient accumulator the outputs' graph reaches.

    Run every forward with the search on, over every node of the graph: the loop is kept to
    what each node needs (its next functions; an accumulator, which has none, its leaf)."""
    reached: set[int] = set()
    stack: list[Any] = []  # autograd nodes
    for out in outputs:
        if out.grad_fn is not None:
            stack.append(out.grad_fn)
        elif out.requires_grad:  # a leaf returned as is: it gets a gradient directly
            reached.add(id(out))
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
