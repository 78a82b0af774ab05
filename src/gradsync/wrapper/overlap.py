"""An optimizer stepped per bucket as each bucket's averages land
(`DistributedDataParallel.overlap_optimizer`).

torch's DDP overlaps communication with backward and nothing else: the optimizer step waits
for the last bucket, the one nearest the input, ready last in backward, and the next forward
waits for the step. Here the wrapped optimizer's own code steps each bucket's parameters as
that bucket lands (`Reducer.step_each_bucket`): at the end of backward those landed already,
the rest where their parameters are needed next, in the next forward (a bucket lands when a
torch function is first given one of its parameters, `reducer.LandOnUse`), so the next forward
runs over the communication still in flight. Any optimizer that steps each parameter
from its own gradient and state gives the same parameters and state as stepping them all at
once (SGD, Adam, AdamW, RMSprop, Adagrad...): its per-parameter arithmetic runs on a subset at
a time.

The loop stays `loss.backward(); opt.step(); opt.zero_grad()`; `step()` returns at once. What
differs, and is refused rather than silently wrong:

- Every synchronised backward steps. Accumulate under `no_sync()` (torch's way); a second
  synchronised backward with no `step()` since the last raises, naming the fix.
- Between backward and the next forward the parameters and `.grad` may still be landing: read
  them after `opt.wait()` (an EMA, a logged norm). A gradient changed before `step()` (torch's
  `clip_grad_norm_`, `GradScaler.unscale_`) comes too late for a step decided by the reduced
  values: `step()` or the landing raises. `torch.amp.GradScaler` is refused at its `step`,
  before any parameter has moved: until the first `step()` no bucket is stepped on landing,
  the landed ones wait for `step()` and its checks (the first iteration overlaps less).
  Gradients cleared or zeroed after `step()` (`zero_grad`, the module's too) are cleared or
  zeroed again once the bucket still landing has been stepped.
- The wrapper's `state_dict()`, `no_sync()`, `join()`, a forward that will not synchronise
  (eval, no grad) and the next backward land everything first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.optim import Optimizer

from ..engine.bucket import Bucket
from ..engine.collectives import all_gather_objects
from ..engine.reducer import Reducer

__all__ = ["DEFAULT_CHUNK_MB", "DEFAULT_TAIL_MB", "OverlappedOptimizer", "agree_on_tail",
           "tail_bytes"]

# Measured on the emulated cluster (docs/benchmarks/2026-12-06-overlap-optimizer.md).
DEFAULT_TAIL_MB = 4.0
DEFAULT_CHUNK_MB = 1.0

_Held = tuple[torch.Tensor, "torch.Tensor | None", int]  # a parameter, its gradient, its version


class OverlappedOptimizer(Optimizer):
    """`optimizer`, stepped per bucket as `reducer`'s buckets land.

    Has the optimizer's interface: `param_groups`, `state` and `defaults` are the wrapped
    optimizer's own (LR schedulers change its learning rates), `state_dict()` is the plain
    optimizer's format (a checkpoint loads into either), `zero_grad`, `add_param_group`.
    Reading parameters or gradients between `step()` and the next forward needs `wait()`.
    """

    # GradScaler then calls `step` itself instead of unscaling first: refused there, by name.
    _step_supports_amp_scaling = True

    def __init__(self, reducer: Reducer, optimizer: Optimizer) -> None:
        _check_steps_per_parameter(optimizer)
        self.optimizer = optimizer
        self._reducer = weakref.ref(reducer)
        self._as_view = reducer.config.gradient_as_bucket_view
        self._in_buckets = {id(p): n for p, n in zip(reducer.params, reducer.names)}
        self._rest = self._outside_buckets()
        self._subsets: weakref.WeakKeyDictionary[Bucket, list[list[torch.Tensor]]] = (
            weakref.WeakKeyDictionary())
        self._iteration: int | None = None  # the reducer's iteration stepped last
        self._acknowledged: int | None = None  # the iteration `step()` was last called after
        self._steps: set[int] = set()  # every iteration `step()` was called after (recent ones)
        self._stepped: list[_Held] = []  # stepped before `step()`: unchanged until it?
        # Landed before the first `step()`, which steps them after its checks: a GradScaler's
        # or a clipping's refusal then comes before any parameter has moved.
        self._deferred: list[list[list[torch.Tensor]]] = []
        self._pending: dict[int, list[_Held]] = {}  # buckets landing after backward
        self._resets: dict[int, list[tuple[torch.Tensor, bool]]] = {}  # cleared since step()
        self._zero_after: dict[int, bool] = {}  # zero_grad(set_to_none) for buckets landing
        self._versions: dict[int, list[tuple[torch.Tensor, int]]] = {}  # their parameters'
        # The groups' settings (lr...) when `step()` was called: the buckets landing after it
        # are stepped with them, not with what an LR scheduler has set since.
        self._settings: list[dict[str, Any]] = []
        reducer.step_each_bucket(_Stepper(self), lazily=True)
        weakref.finalize(self, _detach, reducer)

    # ------------------------------------------------------------------ the optimizer's face

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        self.wait()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait()
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the optimizer's; the gradients of buckets still landing once they are stepped."""
        landing = {id(p) for index in self._pending for p, _, _ in self._pending[index]}
        for index in self._pending:
            self._zero_after[index] = set_to_none
        self._with_groups([[p for p in g["params"] if id(p) not in landing]
                           for g in self.optimizer.param_groups],
                          lambda: self.optimizer.zero_grad(set_to_none))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.wait()
        self.optimizer.add_param_group(param_group)
        self._deferred = [subsets + [[]] for subsets in self._deferred]  # none in the new group
        self._rest = self._outside_buckets()
        self._subsets.clear()

    def __repr__(self) -> str:
        return f"OverlappedOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------------ stepping

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Returns at once: the buckets are stepped as they land. Checks that no gradient
        was changed since backward, and steps what no bucket holds (the wrapper's delayed or
        excluded parameters, others the optimizer holds)."""
        if closure is not None:
            raise ValueError("OverlappedOptimizer.step: a closure re-evaluates the loss, but each "
                             "bucket is stepped when its gradients land; use the plain "
                             "optimizer for closure-based optimizers")
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) \
                is not None:
            raise RuntimeError(_GRAD_SCALER)
        self._check_unchanged(self._stepped + [h for held in self._pending.values() for h in held])
        for subsets in self._deferred:
            self._with_groups(subsets, self.optimizer.step)
        self._deferred = []
        if any(self._rest):
            self._with_groups(self._rest, self.optimizer.step)
        self._settings = [{k: v for k, v in g.items() if k != "params"}
                          for g in self.optimizer.param_groups]
        reducer = self._reducer()
        self._acknowledged, self._stepped = (reducer.iteration if reducer else None), []
        self._steps.add(self._acknowledged)  # type: ignore[arg-type]

    def wait(self) -> None:
        """Land and step every bucket still landing: call before reading parameters or
        gradients between `step()` and the next forward (the next forward does it itself)."""
        reducer = self._reducer()
        if reducer is not None:
            reducer.land()

    def _backward_ended(self, pending: Sequence[Bucket]) -> None:
        reducer = self._reducer()
        self._begin(reducer.iteration if reducer is not None else None)
        self._pending = {b.index: [(p, p.grad, _version(p.grad)) for p in self._held(b)]
                         for b in pending}
        self._versions = {index: [(p, p._version) for p, _, _ in held]
                          for index, held in self._pending.items()}
        self._resets, self._zero_after = {}, {}

    def _landing(self, bucket: Bucket) -> None:
        """Before the bucket's write-back: a gradient changed since backward is an error
        before `step()` (too late for this step), a reset after it (for the next backward)."""
        held = self._pending.pop(bucket.index, None)
        if not held:
            return
        versions = self._versions.pop(bucket.index, ())
        if written := [(p, None) for p, version in versions if p._version != version]:
            raise RuntimeError(_PARAMETER_CHANGED.format(names=self._named(written)))
        reducer = self._reducer()
        if reducer is None or self._acknowledged != reducer.iteration:
            self._check_unchanged(held)
            return
        changed = [(p, g) for p, g, v in held if p.grad is not g or _version(g) != v]
        if self._as_view and any(p.grad is g for p, g in changed):
            raise RuntimeError(_CHANGED_IN_FLIGHT.format(names=self._named(changed)))
        self._resets[bucket.index] = [(p, p.grad is None) for p, _ in changed]

    def _written(self, bucket: Bucket) -> None:
        """Step the parameters of `bucket` this optimizer holds (its averages just written
        back); the first bucket of an iteration checks that the last one's step was taken."""
        reducer = self._reducer()
        number = reducer.iteration if reducer is not None else None
        self._begin(number)
        subsets = self._subsets_of(bucket)
        after_step = self._acknowledged == number
        if self._acknowledged is None:  # before the first `step()`: stepped by it
            self._deferred.append(subsets)
        else:
            self._with_groups(subsets, self.optimizer.step, self._settings if after_step else None)
        zero = self._zero_after.pop(bucket.index, None)
        clear = [] if zero is None else [(p, zero) for group in subsets for p in group]
        for param, to_none in self._resets.pop(bucket.index, []) + clear:
            if to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()
        if not after_step:  # before `step()`: it checks that none changed since
            self._stepped += [(p, p.grad, _version(p.grad))
                              for group in subsets for p in group if p.grad is not None]

    # ------------------------------------------------------------------ helpers

    def _begin(self, number: int | None) -> None:
        """Iteration `number` steps from now on: the last one stepped must have been followed
        by `step()` (else gradients were accumulated across synchronised backwards)."""
        if number == self._iteration:
            return
        if self._iteration is not None and self._iteration not in self._steps:
            raise RuntimeError(_ACCUMULATED)
        self._steps = {n for n in self._steps if n >= (number or 0)}
        self._iteration, self._stepped, self._deferred = number, [], []
        # what an iteration dropped before all its buckets landed (an error) left behind
        self._pending, self._versions, self._resets, self._zero_after = {}, {}, {}, {}

    def _subsets_of(self, bucket: Bucket) -> list[list[torch.Tensor]]:
        """Per group of the optimizer, its parameters in `bucket`."""
        subsets = self._subsets.get(bucket)
        if subsets is None or len(subsets) != len(self.optimizer.param_groups):
            inside = {id(p) for p in bucket.params}
            subsets = [[p for p in g["params"] if id(p) in inside]
                       for g in self.optimizer.param_groups]
            self._subsets[bucket] = subsets
        return subsets

    def _held(self, bucket: Bucket) -> list[torch.Tensor]:
        return [p for group in self._subsets_of(bucket) for p in group]

    def _with_groups(self, subsets: list[list[torch.Tensor]], run: Callable[[], Any],
                     settings: list[dict[str, Any]] | None = None) -> None:
        """`run()` (the wrapped optimizer's step or zero_grad) over `subsets[i]` of each group
        i, with `settings[i]` in force if given: its own code, on those parameters only."""
        groups = self.optimizer.param_groups
        held = [dict(g) for g in groups]
        try:
            for i, (group, subset) in enumerate(zip(groups, subsets)):
                group["params"] = subset
                if settings is not None and i < len(settings):
                    group.update(settings[i])
            run()
        finally:
            for group, kept in zip(groups, held):
                group.update(kept)

    def _check_unchanged(self, held: list[_Held]) -> None:
        changed = [(p, g) for p, g, v in held if p.grad is not g or _version(g) != v]
        if changed:
            raise RuntimeError(_CHANGED.format(names=self._named(changed)))

    def _named(self, changed: list[tuple[torch.Tensor, Any]]) -> str:
        names = [self._in_buckets[id(p)] for p, _ in changed]
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    def _outside_buckets(self) -> list[list[torch.Tensor]]:
        return [[p for p in g["params"] if id(p) not in self._in_buckets]
                for g in self.optimizer.param_groups]


def _version(grad: torch.Tensor | None) -> int:
    return -1 if grad is None else grad._version


class _Stepper:
    """What the Reducer holds (`engine.reductions.BucketStepper`): the optimizer, weakly."""

    def __init__(self, optimizer: OverlappedOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    def backward_ended(self, pending: Sequence[Bucket]) -> None:
        if (optimizer := self._optimizer()) is not None:
            optimizer._backward_ended(pending)

    def landing(self, bucket: Bucket) -> None:
        if (optimizer := self._optimizer()) is not None:
            optimizer._landing(bucket)

    def written(self, bucket: Bucket) -> None:
        if (optimizer := self._optimizer()) is not None:
            optimizer._written(bucket)


def _detach(reducer: Reducer) -> None:
    reducer.step_each_bucket(None)


def tail_bytes(tail_mb: float | None, chunk_mb: float | None) -> tuple[int, int]:
    """(tail, chunk) in bytes, from MiB (None: the defaults), checked."""
    sizes = []
    for name, value, default in (("tail_mb", tail_mb, DEFAULT_TAIL_MB),
                                 ("chunk_mb", chunk_mb, DEFAULT_CHUNK_MB)):
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"overlap_optimizer({name}={value!r}): expected a size in MiB >= 0")
        sizes.append(int(value * 2**20))
    return sizes[0], sizes[1]


def agree_on_tail(group: Any, tail: int, chunk: int) -> None:
    """Every rank must cut and order the buckets alike: a difference would pair different
    buckets' collectives across ranks. Raised on every rank, naming them, before any is sent."""
    everyone = cast(list[tuple[int, int]], all_gather_objects(group, (tail, chunk)))
    if len(set(everyone)) > 1:
        shown = ", ".join(f"rank {r}: tail {t} B, chunk {c} B"
                          for r, (t, c) in enumerate(everyone))
        raise ValueError(f"overlap_optimizer: the ranks asked for different tails ({shown}); "
                         "pass the same tail_mb and chunk_mb on every rank")


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


_CHANGED = (
    "OverlappedOptimizer: the gradients of {names} were changed after backward, but each "
    "bucket is stepped with the reduced values as it lands, so the change would be lost "
    "(torch.nn.utils.clip_grad_norm_ or GradScaler.unscale_ between backward and step?). Step "
    "with the plain optimizer to clip by the global norm or to scale the loss; read gradients "
    "after opt.wait()."
)
_PARAMETER_CHANGED = (
    "OverlappedOptimizer: the parameters {names} were changed in place after backward while "
    "their bucket was still landing, to be stepped from the values they had: the change and "
    "the step would mix. Call opt.wait() before writing to parameters between step() and the "
    "next forward (an EMA may read them after it; a checkpoint load through the wrapper waits "
    "by itself)."
)
_CHANGED_IN_FLIGHT = (
    "OverlappedOptimizer: the gradients of {names} were changed in place after step() while "
    "their bucket was still reducing into them (gradient_as_bucket_view: .grad is the bucket): "
    "the reduction would be corrupted. Clear them with opt.zero_grad() (which waits for the "
    "bucket), or model.zero_grad(set_to_none=True)."
)
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
