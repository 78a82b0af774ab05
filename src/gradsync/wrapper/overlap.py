"""An optimizer stepped per bucket as each bucket's averages land
(`DistributedDataParallel.overlap_optimizer`).

torch's DDP overlaps communication with backward and nothing else: the optimizer step waits
for the last bucket, the one nearest the input, ready last in backward. Here the wrapped
optimizer's own code steps each bucket's parameters as soon as that bucket is written back at
the end of backward (`Reducer.step_each_bucket`), while the later buckets are still on the
wire. `loss.backward()` returns with the parameters stepped, and `step()` then steps only
what no bucket holds. Any optimizer that steps each parameter from its own gradient and
state gives the same parameters and state as stepping them all at once (SGD, Adam, AdamW,
RMSprop, Adagrad...): its per-parameter arithmetic runs on a subset at a time.

The loop stays `loss.backward(); opt.step(); opt.zero_grad()`. What differs, and is refused
rather than silently wrong:

- Every synchronised backward steps. Accumulate under `no_sync()` (torch's way); a second
  synchronised backward with no `step()` since the last raises, naming the fix.
- Gradients are used by the end of backward, so a change to them after it comes too late:
  `step()` raises when a stepped gradient was modified in place since (torch's
  `clip_grad_norm_`, `GradScaler.unscale_`), and `torch.amp.GradScaler` is refused at its
  `step` (its unscale and inf check need every gradient before any parameter moves).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from ..engine.bucket import Bucket
from ..engine.reducer import Reducer

__all__ = ["OverlappedOptimizer"]


class OverlappedOptimizer(Optimizer):
    """`optimizer`, stepped per bucket inside the synchronised backward of `reducer`'s wrapper.

    Has the optimizer's interface: `param_groups`, `state` and `defaults` are the wrapped
    optimizer's own (LR schedulers change its learning rates), `state_dict()` is the plain
    optimizer's format (a checkpoint loads into either), `zero_grad`, `add_param_group`.
    Reading the parameters after backward needs nothing more: they are stepped when
    `loss.backward()` returns (`wait()` is there for loops written for a lazier step).
    """

    # GradScaler then calls `step` itself instead of unscaling first: refused there, by name.
    _step_supports_amp_scaling = True

    def __init__(self, reducer: Reducer, optimizer: Optimizer) -> None:  # noqa: D107
        _check_steps_per_parameter(optimizer)
        self.optimizer = optimizer
        self._in_buckets = {id(p) for p in reducer.params}
        self._rest = self._outside_buckets()
        self._subsets: weakref.WeakKeyDictionary[Bucket, list[list[torch.Tensor]]] = (
            weakref.WeakKeyDictionary())
        self._stepped: list[tuple[str, torch.Tensor, int]] = []  # (name, grad, its version)
        self._names = {id(p): n for p, n in zip(reducer.params, reducer.names)}
        self._due = False  # stepped in a backward, `step()` not called since
        reducer.step_each_bucket(_StepBucket(self))
        weakref.finalize(self, reducer.step_each_bucket, None)

    # ------------------------------------------------------------------ the optimizer's face

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._rest = self._outside_buckets()
        self._subsets.clear()

    def __repr__(self) -> str:
        return f"OverlappedOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------------ stepping

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """The buckets were stepped at the end of backward: step what no bucket holds (the
        wrapper's delayed or excluded parameters, others the optimizer holds), after
        checking that no stepped gradient was changed since."""
        if closure is not None:
            raise ValueError("OverlappedOptimizer.step: a closure re-evaluates the loss, but each "
                             "bucket was stepped when its gradients landed; use the plain "
                             "optimizer for closure-based optimizers")
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) \
                is not None:
            raise RuntimeError(_GRAD_SCALER)
        self._check_unchanged()
        if any(self._rest):
            self._step_subset(self._rest)
        self._due = False

    def wait(self) -> None:
        """Every bucket's step is done by the end of backward: nothing to wait for."""

    def step_bucket(self, bucket: Bucket) -> None:
        """Step the parameters of `bucket` this optimizer holds (its averages just written
        back); the first bucket of a backward checks that the last one's step was taken."""
        if bucket.index == 0:
            if self._due:
                raise RuntimeError(_ACCUMULATED)
            self._due, self._stepped = True, []
        subsets = self._subsets.get(bucket)
        if subsets is None or len(subsets) != len(self.optimizer.param_groups):
            inside = {id(p) for p in bucket.params}
            subsets = [[p for p in g["params"] if id(p) in inside]
                       for g in self.optimizer.param_groups]
            self._subsets[bucket] = subsets
        self._step_subset(subsets)
        self._stepped += [(self._names[id(p)], p.grad, p.grad._version)
                          for group in subsets for p in group if p.grad is not None]

    def _step_subset(self, subsets: list[list[torch.Tensor]]) -> None:
        """The wrapped optimizer's own step, over `subsets[i]` of each group i."""
        groups = self.optimizer.param_groups
        held = [g["params"] for g in groups]
        try:
            for group, subset in zip(groups, subsets):
                group["params"] = subset
            self.optimizer.step()
        finally:
            for group, params in zip(groups, held):
                group["params"] = params

    def _check_unchanged(self) -> None:
        changed = [name for name, grad, version in self._stepped if grad._version != version]
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5
                                              else "")
            raise RuntimeError(
                f"OverlappedOptimizer.step: the gradients of {shown} were changed after their "
                "bucket was stepped, at the end of backward (torch.nn.utils.clip_grad_norm_ or "
                "GradScaler.unscale_ between backward and step?). The change came too late to "
                "reach the parameters. Step with the plain optimizer to clip by the global norm "
                "or to scale the loss."
            )

    def _outside_buckets(self) -> list[list[torch.Tensor]]:
        return [[p for p in g["params"] if id(p) not in self._in_buckets]
                for g in self.optimizer.param_groups]


class _StepBucket:
    """What the Reducer holds: the optimizer weakly (the wrapper outliving it steps nothing)."""

    def __init__(self, optimizer: OverlappedOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def __call__(self, bucket: Bucket) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer.step_bucket(bucket)


def _check_steps_per_parameter(optimizer: object) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"overlap_optimizer: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, OverlappedOptimizer):
        raise ValueError("overlap_optimizer: this optimizer is overlapped already")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("overlap_optimizer: LBFGS re-evaluates the loss through a closure "
                         "over every parameter at once; it cannot be stepped per bucket")
    if hasattr(optimizer, "shards_gradients"):  # gradsync.ZeroRedundancyOptimizer
        raise ValueError("overlap_optimizer: a ZeroRedundancyOptimizer steps its own shard "
                         "after collectives of its own, not per parameter; build it with "
                         "overlap_with_ddp=True to step inside backward instead")


_ACCUMULATED = (
    "OverlappedOptimizer: a second synchronised backward came without step() since the last: "
    "with overlap_optimizer every synchronised backward steps the parameters, at its end. "
    "Accumulate gradients under model.no_sync() (the backwards that do not step), as with "
    "torch's DDP, or use the plain optimizer to accumulate across synchronised backwards."
)
_GRAD_SCALER = (
    "OverlappedOptimizer: torch.amp.GradScaler needs every gradient unscaled and checked for "
    "inf before any parameter moves, but each bucket was stepped at the end of backward. Use "
    "the plain optimizer with a GradScaler, or train in bfloat16 (no loss scaling needed)."
)
