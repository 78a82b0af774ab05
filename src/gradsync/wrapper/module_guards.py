"""What the wrapper keeps watching on the module it wraps, and why.

The Reducer's buckets were allocated for the parameters as they were when wrapped, so a module
moved, cast or given new parameter tensors afterwards is refused (`Placement`), not
half-synchronised. A forward of the wrapped module itself, not through the wrapper, starts a
graph of its own whose gradients are local, as under torch's DDP (`ForwardWatcher`). And a
forward whose output holds no tensor leaves nothing to search from for unused parameters. A
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
from ..engine.reducer import Reducer, find_tensors

__all__ = ["ForwardWatcher", "Placement", "UnsynchronisedGradients", "check_outputs_hold_tensors"]


class ForwardWatcher:
    """Forward pre-hook on the wrapped module: tells the reducer (held weakly) that a forward
    started. Pickles (with the module) to a no-op; the unpickled wrapper adds its own."""

    def __init__(self, reducer: Reducer | None) -> None:
        self.reducer = weakref.ref(reducer) if reducer is not None else None

    def __call__(self, _module: nn.Module, _inputs: Any) -> None:
        alive = self.reducer() if self.reducer is not None else None
        if alive is not None:
            alive.note_module_forward()

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return (ForwardWatcher, (None,))


class Placement:
    """Where the wrapped parameters were: buckets live on their device and in their dtype, so
    a module moved or cast after wrapping must be refused, not half-synchronised."""

    SAMPLE = 4  # checked on every forward: the first and last few (a whole-module move)

    def __init__(
        self, module: nn.Module, named: list[tuple[str, nn.Parameter]], dtype_swaps: bool
    ) -> None:
        owners = dict(module.named_modules())
        self.entries = []
        for name, param in named:
            owner, _, attr = name.rpartition(".")
            self.entries.append((name, owners[owner], attr, param, param.device, param.dtype))
        k = self.SAMPLE
        self.sample = (
            self.entries if len(self.entries) <= 2 * k else self.entries[:k] + self.entries[-k:]
        )
        self.dtype_swaps = dtype_swaps

    def check(self, sample: bool) -> None:
        for name, owner, attr, param, device, dtype in self.sample if sample else self.entries:
            current = owner._parameters.get(attr)
            if current is not param:
                self._refuse(
                    name, f"was replaced by a new tensor ({_where(current)})", device, dtype
                )
            if param.device != device or (param.dtype != dtype and not self.dtype_swaps):
                self._refuse(name, f"is now {_where(param)}", device, dtype)

    @staticmethod
    def _refuse(name: str, now: str, device: torch.device, dtype: torch.dtype) -> None:
        raise GradSyncError(
            f"gradsync: parameter {name!r} was on {device} as {dtype} when the module was "
            f"wrapped and {now}: the module was moved or cast after wrapping. gradsync's "
            "gradient buckets were allocated for the parameters as they were, so they can no "
            "longer be synchronised.\nFix: move or cast the module first, then wrap it: "
            "model.to(device); ddp = gradsync.DistributedDataParallel(model, ...)."
        )


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


def _where(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"on {t.device} as {t.dtype}"


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
