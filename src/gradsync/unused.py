"""Which parameters can receive a gradient from these outputs: a walk of the autograd graph.

A parameter whose gradient accumulator is not reachable from the forward outputs will never fire
its hook, so the Reducer marks it ready up front; otherwise its bucket would wait forever.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["find_tensors", "reachable_parameters"]


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
    """`id()` of every leaf tensor whose gradient accumulator the outputs' graph reaches."""
    reached: set[int] = set()
    seen: set[object] = set()
    stack = []
    for out in outputs:
        if out.grad_fn is not None:
            stack.append(out.grad_fn)
        elif out.requires_grad:  # a leaf returned as is: it gets a gradient directly
            reached.add(id(out))
    while stack:
        fn = stack.pop()
        variable = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            reached.add(id(variable))
        for next_fn, _ in fn.next_functions:
            if next_fn is not None and next_fn not in seen:
                seen.add(next_fn)
                stack.append(next_fn)
    return reached
