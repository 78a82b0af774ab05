"""What the wrapper watches on the module it wraps, off the step path (the checks made on every
forward, `Placement` and `ForwardWatcher`, live beside the forward in `ddp`), and the weak
reference its hooks on that module hold (`LocalRef`).

A forward whose output holds no tensor leaves nothing to search from for unused parameters. A
parameter frozen when wrapped and unfrozen later trains on each rank apart: said once
(`UnsynchronisedGradients`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..engine.errors import GradSyncError
from ..engine.reducer import find_tensors

__all__ = ["LocalRef", "UnsynchronisedGradients", "check_outputs_hold_tensors"]


class LocalRef:
    """A weak reference, held by what gradsync hangs on a user's module or parameters (a
    parameter's wrapper, forward and state-dict hooks): pickled or copied with them
    (`torch.save(model)`, `copy.deepcopy(model)` for an EMA) it becomes dead, since a copy is
    not wrapped, and a live one would not pickle."""

    __slots__ = ("_ref",)

    def __init__(self, obj: Any) -> None:
        self._ref = weakref.ref(obj) if obj is not None else None

    def __call__(self) -> Any:
        return self._ref() if self._ref is not None else None

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (LocalRef, (None,))


class UnsynchronisedGradients:
    """A gradient hook on each parameter that did not require grad when wrapped: the wrapper
    (as torch's DDP) never synchronises it, so if it is unfrozen later each rank trains it
    apart and the replicas drift. torch's DDP says nothing; the first such gradient warns here,
    once per parameter. The hooks go with the wrapper (`remove`)."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]]) -> None:
        self.handles = []
        for name, param in named:
            # torch refuses a hook on a tensor that needs no gradient, but the hook is kept on
            # the tensor and runs once it does: register it with the flag on for a moment.
            param.requires_grad_(True)
            try:
                self.handles.append(param.register_post_accumulate_grad_hook(self._warner(name)))
            finally:
                param.requires_grad_(False)

    @staticmethod
    def _warner(name: str) -> Any:
        warned = False

        def warn(_param: torch.Tensor) -> None:
            nonlocal warned
            if not warned:
                warned = True
                warnings.warn(
                    f"gradsync: parameter {name!r} did not require grad when the wrapper was "
                    "built, so its gradient is not synchronised: each rank now trains it apart "
                    "and the replicas drift (torch's DDP does the same). Build the wrapper "
                    "again after setting requires_grad, or exclude it on purpose with "
                    "gradsync.exclude_from_sync before wrapping.",
                    stacklevel=2,
                )

        return warn

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def check_outputs_hold_tensors(output: Any, wants_outputs: bool) -> None:
    """Raise if the graph must be searched from `output` (`wants_outputs`) and it has no tensor."""
    if wants_outputs and torch.is_grad_enabled() and not find_tensors(output):
        raise GradSyncError(
            f"gradsync: forward returned {type(output).__name__} with no tensor in "
            "it. With find_unused_parameters=True (or static_graph=True) gradsync "
            "walks the autograd graph from forward's output tensors to see which "
            "parameters took part. Return the tensors the loss is computed from "
            "(in a tuple, list, dict or dataclass is fine)."
        )
