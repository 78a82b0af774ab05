"""An optimizer stepped per bucket as each bucket's averages land
(`DistributedDataParallel.overlap_optimizer`).

torch's DDP overlaps communication with backward and nothing else: the optimizer step waits
for the last bucket, the one nearest the input, ready last in backward, and the next forward
waits for the step. Here the wrapped optimizer's own code steps each bucket's parameters as
that bucket lands (`Reducer.step_each_bucket`): `step()` those landed by then, the rest where
their parameters are needed next, in the next forward (a bucket lands when a
torch function is first given one of its parameters, `reducer.LandOnUse`), so the next forward
runs over the communication still in flight. Any optimizer that steps each parameter
from its own gradient and state gives the same parameters and state as stepping them all at
once (SGD, Adam, AdamW, RMSprop, Adagrad...): its per-parameter arithmetic runs on a subset at
a time.

The loop stays `loss.backward(); opt.step(); opt.zero_grad()`; `step()` returns at once. A
bucket landed before `step()` is stepped by it, as the plain optimizer would step it, so what
comes between backward and `step()` is torch's: more synchronised backwards accumulate,
`zero_grad` drops the gradients, a parameter or gradient written is stepped from the write.
Until a bucket lands, its parameters' `.grad` is an alias that lands it when a torch function
is first given it (`_LandsOnRead`): clipping, GradScaler and a logged norm read averages, in
a trainer's loop too. What differs, and is refused rather than silently wrong:

- Between `step()` and the next forward buckets may still be landing: read parameters after
  `opt.wait()` (an EMA); with `GRADSYNC_DEBUG=DETAIL`, a torch function given a parameter
  still landing raises, naming it (`_ReadGuard`); a read through memory taken earlier (a
  view or `.data` kept from before, `.data_ptr()`, numpy) is not seen. A parameter written
  after `step()` without `opt.wait()` is refused where a bucket could land next, and a
  gradient written through a view kept from before backward ended where its bucket lands
  or at `step()`. Gradients cleared after `step()` (`zero_grad`, the module's too) are
  cleared again once the bucket still landing has been stepped.
- The wrapper's `state_dict()`, `no_sync()`, `join()`, a forward that will not synchronise
  (eval, no grad) and the next backward land everything first.
- A bucket holding a parameter this optimizer does not step lands as backward ends, as
  without it (`_steps_whole`): another optimizer steps that parameter right after backward,
  from its average. The ranks' optimizers must hold the same parameters, which
  `overlap_optimizer` and `add_param_group` check (`agree_on_parameters`).
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.optim import Optimizer
from torch.overrides import TorchFunctionMode, resolve_name

from ..engine.bucket import Bucket
from ..engine.collectives import all_gather_objects
from ..engine.layout import priority_tail
from ..engine.reducer import Reducer, arguments_among, flat_arguments
from ..observability.log import detail_enabled
from ..planning.autoplan import after_pause, agreed_max
from .module_guards import LocalRef

__all__ = ["DEFAULT_CHUNK_MB", "DEFAULT_CREDIT_MB", "DEFAULT_OVERLAP_BUCKET_MB", "DEFAULT_TAIL_MB",
           "MeasuredTail", "OverlappedOptimizer", "agree_on_parameters", "agree_on_tail", "held_by",
           "refuse_another", "tail_bytes"]

# Measured on the emulated cluster (docs/benchmarks/2026-12-06-overlap-optimizer.md).
DEFAULT_TAIL_MB = 4.0
DEFAULT_CHUNK_MB = 1.0
DEFAULT_CREDIT_MB = 0.0  # the whole tail at once; the planner tries one chunk at a time
# The buckets' cap where bucket_cap_mb was left out (torch's 25 MiB otherwise).
DEFAULT_OVERLAP_BUCKET_MB = 4.0

_Held = tuple[torch.Tensor, "torch.Tensor | None", int]  # a parameter, its gradient, its version


class OverlappedOptimizer(Optimizer):
    """`optimizer`, stepped per bucket as `reducer`'s buckets land.

    Has the optimizer's interface: `param_groups`, `state` and `defaults` are the wrapped
    optimizer's own (LR schedulers change its learning rates), `state_dict()` is the plain
    optimizer's format (a checkpoint loads into either), `zero_grad`, `add_param_group`.
    Reading parameters or gradients between `step()` and the next forward needs `wait()`.
    """

    def __init__(self, reducer: Reducer, optimizer: Optimizer,
                 module: torch.nn.Module | None = None) -> None:
        _check_steps_per_parameter(optimizer)
        self.optimizer = optimizer
        self._reducer = weakref.ref(reducer)
        self._as_view = reducer.config.gradient_as_bucket_view
        self._in_buckets = {id(p): n for p, n in zip(reducer.params, reducer.names)}
        self._regroup()
        # the versions of `_bucketed` when `step()` returned, until checked (`_check_untouched`)
        self._untouched: list[tuple[torch.Tensor, int]] | None = None
        self._subsets: weakref.WeakKeyDictionary[Bucket, list[list[torch.Tensor]]] = (
            weakref.WeakKeyDictionary())
        self._iteration: int | None = None  # the reducer's last synchronised iteration
        self._acknowledged: int | None = None  # the iteration `step()` was last called after
        # Buckets landing after backward: their gradients as backward left them, each `.grad`
        # a `_LandsOnRead` until the bucket lands.
        self._pending: dict[int, list[_Held]] = {}
        self._dropping = False  # zero_grad() before `step()`: landing them to clear them
        self._early: set[int] = set()  # of those, stepped by `step()` (their `.grad` replaced)
        # .grad as the user left it since step(), put back once the bucket is stepped
        self._resets: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._zero_after: dict[int, bool] = {}  # zero_grad(set_to_none) for buckets landing
        # The groups' settings (lr...) when `step()` was called: the buckets landing after it
        # are stepped with them, not with what an LR scheduler has set since.
        self._settings: list[dict[str, Any]] = []
        self._own = _Own()  # gradsync's own calls in progress: the read guard lets them be
        self._guard: _ReadGuard | None = None  # GRADSYNC_DEBUG=DETAIL only (`_guard_reads`)
        self._attach(reducer, module)

    def _attach(self, reducer: Reducer, module: torch.nn.Module | None) -> None:
        """Told by `reducer` of each bucket landing, and where buckets could land; `module`'s
        state dicts land them all first. Detached when this optimizer goes."""
        stepper = _Stepper(self)
        reducer.step_each_bucket(stepper, lazily=True)
        # Where the guard may come off the mode stack: every bucket landed, a forward's end.
        reducer.on_use_ended = stepper.release_guard
        reducer.before_landing = stepper.before_landing
        finished = reducer.register_finish_hook(stepper.release_guard)
        # The state_dict() and load_state_dict() of the wrapped `module` and of each module in
        # it land every bucket first, as the wrapper's do: a checkpoint taken without the
        # wrapper (Lightning's, Accelerate's `unwrap_model(model).state_dict()`, a submodule's)
        # holds the stepped parameters. Landing when nothing is landing costs a comparison.
        land = _LandFirst(reducer)
        hooks = [] if module is None else [
            hook for m in module.modules() for hook in (m.register_state_dict_pre_hook(land),
                                                        m.register_load_state_dict_pre_hook(land))]
        weakref.finalize(self, _detach, reducer, finished, hooks)

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
        """As the optimizer's; the gradients of buckets still landing once they are stepped.
        Between a synchronised backward and its `step()` every bucket lands first and its
        averages are cleared, as the plain optimizer clears them (a skipped step)."""
        if self._before_step():  # dropped: what their gradients held no longer matters
            self._dropping = True  # `wait` lands every bucket, and its checks are skipped
            try:
                self.wait()
            finally:
                self._dropping = False
        # Gradients still backward's, to be written into and stepped: zeroed once stepped
        # (zeroed now, a gradient_as_bucket_view one would corrupt the reduction). Cleared now,
        # their averages land into backward's tensor all the same (`_pending` holds it), and
        # `.grad` is put back as left: None, or what a backward since accumulated (a loss over
        # the parameters alone).
        landing = set() if set_to_none else {
            id(p) for held in self._pending.values() for p, g, _ in held if _grad(p) is g}
        if not set_to_none:
            self._zero_after.update((index, False) for index in self._pending)
        with self._own:
            self._with_groups([[p for p in g["params"] if id(p) not in landing]
                               for g in self.optimizer.param_groups],
                              lambda: self.optimizer.zero_grad(set_to_none))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As the optimizer's; on every rank alike (checked: one collective)."""
        self.wait()
        self.optimizer.add_param_group(param_group)
        self._regroup()
        self._subsets.clear()
        if (reducer := self._reducer()) is not None:
            agree_on_parameters(reducer.process_group, reducer.names,
                                held_by(self.optimizer, reducer.params))

    def __repr__(self) -> str:
        return f"OverlappedOptimizer({self.optimizer!r})"

    # ------------------------------------------------------------------ stepping

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Steps every parameter as the plain optimizer would, except those of buckets still
        landing, and returns: those are stepped as they land. Checks first that no gradient
        of a bucket was changed while buckets were landing. A `closure` (forward and backward:
        Lightning's automatic optimization passes one) is called once first, with gradients
        enabled, as an optimizer that steps per parameter calls it; its loss is returned."""
        if closure is None:
            self._step()
            return None
        with torch.enable_grad():
            loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        if self._iteration is not None and self._iteration == self._acknowledged:
            # A second step() after one backward: torch's optimizer steps the same gradients
            # again, every parameter, so every bucket lands first and then the whole of it.
            self.wait()
            with self._own:
                self.optimizer.step()
            return
        # One pass over the gradients still landing (a model of many small tensors pays for
        # each): written through a view since backward is refused (`_check_landed`); a `.grad`
        # replaced (None, a tensor of the user's) is stepped now, as the plain optimizer steps
        # it, its bucket's average landing into backward's tensor (`_early`).
        self._early, landing, changed = set(), set(), []
        with torch._C.DisableTorchFunction():  # `.grad` in a forward: `LandOnUse` would land
            for held in self._pending.values():
                for p, g, v in held:
                    if _grad(p) is not g:
                        self._early.add(id(p))
                    else:
                        landing.add(id(p))
                        if _version(g) != v:
                            changed.append((p, g))
        if changed:
            raise RuntimeError(_CHANGED.format(names=self._named(changed)))
        now = [[p for p in g["params"] if id(p) not in landing]
               for g in self.optimizer.param_groups]
        if any(now):  # else every bucket is stepped as it lands: no empty step (host time)
            self._with_groups(now, self.optimizer.step)
        self._settings = [{k: v for k, v in g.items() if k != "params"}
                          for g in self.optimizer.param_groups]
        reducer = self._reducer()
        self._acknowledged = reducer.iteration if reducer else None
        with torch._C.DisableTorchFunction():  # `_version` of a parameter is a torch function
            self._untouched = [(p, p._version) for p in self._bucketed]
        self._guard_reads()

    def _before_step(self) -> bool:
        """Whether a synchronised backward came since the last `step()`."""
        return self._iteration is not None and self._iteration != self._acknowledged

    def _check_landed(self) -> None:
        """Before `step()`: no gradient of a bucket still landing was written since backward
        through a view taken before (`.data` or numpy would not show): its average would land
        over the write. A torch function given one lands its bucket first (`_LandsOnRead`),
        and a `.grad` replaced is stepped from (`_early`): `step()` steps what the gradients
        then hold, as the plain optimizer would."""
        self._check_unchanged([h for held in self._pending.values() for h in held])

    def _before_landing(self) -> None:
        """Where buckets could land (`Reducer.before_landing`), on every rank alike: the checks
        of what was written since backward or `step()`."""
        self._check_untouched()
        if self._before_step() and not self._dropping:
            self._check_landed()

    def _check_untouched(self) -> None:
        """Where buckets still landing would land first, on every rank alike: no parameter of
        a bucket may have been written since `step()`. Checked against every bucket, landed on
        this rank or not, so that all ranks raise here together, wherever their buckets are;
        else a rank whose buckets had all landed would go on to the next collective alone."""
        if self._untouched is None:
            return
        with torch._C.DisableTorchFunction():
            written = [(p, None) for p, version in self._untouched if p._version != version]
        self._untouched = None
        if written:
            raise RuntimeError(_PARAMETER_CHANGED.format(names=self._named(written)))

    def wait(self) -> None:
        """Land every bucket still landing, and step it after `step()`: call before reading
        parameters between `step()` and the next forward (the next forward does it itself),
        or gradients through memory taken before backward ended (`.grad` itself lands its
        bucket when read)."""
        reducer = self._reducer()
        if reducer is not None:
            with self._own:
                reducer.land()
        self._release_guard()

    def _backward_ended(self, pending: Sequence[Bucket]) -> None:
        reducer = self._reducer()
        self._begin(reducer.iteration if reducer is not None else None)
        self._pending, self._resets, self._zero_after = {}, {}, {}
        for bucket in pending:  # one pass per gradient: a model of many small ones pays each
            held = self._pending[bucket.index] = []
            for p in self._held(bucket):
                g = p.grad
                held.append((p, g, -1 if g is None else g._version))
                if g is not None and g.layout is torch.strided:
                    p.grad = _LandsOnRead.of(g, self, bucket.index)

    def _land_read(self, indices: list[int]) -> None:
        """A torch function was given the gradients of buckets `indices` still landing: land
        them (and step them, after `step()`), so it reads their averages."""
        reducer = self._reducer()
        if reducer is not None:
            with self._own:
                reducer.land(indices)

    def _landing(self, bucket: Bucket) -> None:
        """Before the bucket's write-back: a `.grad` replaced since backward (before `step()`,
        to be stepped from; after it, a reset for the next backward) is put back once the
        average has landed in backward's tensor (and been stepped, after `step()`)."""
        held = self._pending.pop(bucket.index, None)
        if not held:
            return
        reducer = self._reducer()
        after_step = reducer is not None and self._acknowledged == reducer.iteration
        changed = []
        for p, g, v in held:  # `.grad` back to the gradient itself where still its alias
            grad = p.grad
            if type(grad) is _LandsOnRead and grad._gradient is g:
                p.grad = grad = g
            if grad is not g or _version(g) != v:
                changed.append((p, g))
        if after_step and self._as_view and (
                into := [(p, g) for p, g, v in held if _version(g) != v]):
            raise RuntimeError(_CHANGED_IN_FLIGHT.format(names=self._named(into)))
        # Cleared (None), or a tensor of the user's: the averages go into backward's tensor
        # (stepped from after `step()`), then .grad is put back. Backward's tensor changed in
        # place (`model.zero_grad(set_to_none=False)` through memory taken before, or as
        # zero_grad() drops them): zeroed again once stepped (`_ZEROED`).
        resets = []
        for p, g in changed:
            resets.append((p, _ZEROED if p.grad is g else p.grad))
            p.grad = g
        self._resets[bucket.index] = resets

    def _written(self, bucket: Bucket) -> None:
        """After `step()`, step the parameters of `bucket` this optimizer holds (its averages
        just written back) with the settings `step()` saw. Before it, leave them to `step()`,
        as the plain optimizer: accumulated over more backwards, cleared, clipped."""
        reducer = self._reducer()
        number = reducer.iteration if reducer is not None else None
        self._begin(number)
        subsets = self._subsets_of(bucket)
        if self._acknowledged == number:
            early = self._early
            self._with_groups([[p for p in subset if id(p) not in early] for subset in subsets]
                              if early else subsets, self.optimizer.step, self._settings)
        resets = self._resets.pop(bucket.index, [])
        for param, grad in resets:
            if grad is _ZEROED:
                param.grad.zero_()  # type: ignore[union-attr]
            else:
                param.grad = grad
        if (to_none := self._zero_after.pop(bucket.index, None)) is not None:
            put_back = {id(p) for p, grad in resets if grad is not _ZEROED}  # since zero_grad
            for param in [p for group in subsets for p in group if id(p) not in put_back]:
                if to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

    # ------------------------------------------------------------------ helpers

    def _begin(self, number: int | None) -> None:
        """Iteration `number` lands from now on. The last one's buckets have all landed (the
        next backward lands them first); without a `step()` since, their averages stay in
        `.grad`, accumulated into, as with torch's DDP."""
        if number == self._iteration:
            return
        self._iteration, self._early = number, set()
        # what an iteration dropped before all its buckets landed (an error) left behind
        for held in self._pending.values():
            _unwrap(held)
        self._pending, self._resets, self._zero_after = {}, {}, {}
        if self._guard is not None:  # its buckets' indices mean other buckets after a rebuild
            self._guard.disarm()

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

    def _steps_whole(self, bucket: Bucket) -> bool:
        """Whether this optimizer holds every parameter of `bucket` (else it lands as backward
        ends: another optimizer steps the rest from their averages right after backward)."""
        return sum(len(subset) for subset in self._subsets_of(bucket)) == len(bucket.params)

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
        # `.grad` is a torch function: inside a forward, `LandOnUse` would land the bucket
        with torch._C.DisableTorchFunction():
            changed = [(p, g) for p, g, v in held if _grad(p) is g and _version(g) != v]
        if changed:
            raise RuntimeError(_CHANGED.format(names=self._named(changed)))

    def _named(self, changed: list[tuple[torch.Tensor, Any]]) -> str:
        names = [self._in_buckets[id(p)] for p, _ in changed]
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    def _regroup(self) -> None:
        """The optimizer's parameters in the buckets."""
        self._bucketed = [p for g in self.optimizer.param_groups for p in g["params"]
                          if id(p) in self._in_buckets]

    # ------------------------------------------------------------------ the read guard

    def _guard_reads(self) -> None:
        """GRADSYNC_DEBUG=DETAIL: until the buckets still landing have landed, a torch function
        given one of their parameters or gradients raises (`_ReadGuard`). Pushed here, on the
        caller's thread, rather than where backward ends: the autograd engine puts back the
        mode stack it found once backward is over, dropping a mode pushed inside it. One guard
        at most: one left on the stack (under a mode of the user's) is armed again."""
        if not detail_enabled():
            self._release_guard()  # DETAIL turned off since: nothing new, the old one goes
            return
        held = [(index, p, g) for index, pending in self._pending.items() for p, g, _ in pending]
        if not held:
            self._release_guard()
            return
        guard = self._guard if self._guard is not None and _on_stack(self._guard) else None
        if guard is None:
            guard = self._guard = _ReadGuard(self)
            _push_at_bottom(guard)
        guard.arm({id(p): index for index, p, _ in held},
                  {id(g): p for _, p, g in held if g is not None})

    def _release_guard(self) -> None:
        """Pop the read guard once nothing it watches is still landing, where it is on top of
        the mode stack; under a mode pushed since, it stays, inert, until a later call finds it
        on top. Not inside backward (the engine puts the stack back as it was, the pop too) nor
        inside the forward's `LandOnUse` (above it; its exit calls this again)."""
        guard = self._guard
        if guard is None or guard.watching() or torch._C._current_graph_task_id() != -1 \
                or self._own.depth:  # a landing of ours: maybe inside a mode, popped for it
            return
        reducer = self._reducer()
        if reducer is not None and reducer.on_use is not None:
            return
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is guard:
            torch._C._pop_torch_function_stack()
            self._guard = None
        elif not _on_stack(guard):  # popped by someone else (a `with` block of the user's)
            self._guard = None

    def _read_error(self, func: Callable, params: list[torch.Tensor],
                    grads_of: list[torch.Tensor]) -> RuntimeError:
        what = [f"the {kind} {self._named([(p, None) for p in ps])}"
                for kind, ps in (("parameters", params), ("gradients of", grads_of)) if ps]
        return RuntimeError(_READ_PENDING.format(function=_function_name(func),
                                                 what=" and ".join(what)))


class _Own:
    """gradsync's own calls in progress (landing, stepping, waiting, zeroing), counted: the read
    guard lets them read the parameters of buckets still landing, which they do on purpose."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1


# Metadata and identity, not values: what gradsync's own checks, `model.zero_grad()` (a
# supported clear of `.grad`) and `model.parameters()` use on any parameter. The `.data`
# property is a read: the tensor it gives shares the parameter's memory, out of the guard's
# sight from then on.
_DATA = torch._C.TensorBase.__dict__["data"]
_METADATA = frozenset({
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndimension, torch.Tensor.numel,
    torch.Tensor.nelement, torch.Tensor.stride, torch.Tensor.storage_offset,
    torch.Tensor.is_contiguous, torch.Tensor.element_size, torch.Tensor.data_ptr,
    torch.Tensor.__len__, torch.Tensor.requires_grad_, torch.Tensor.register_hook,
})


# What zeroes a gradient in place: `model.zero_grad(set_to_none=False)`, the optimizer's
# `zero_grad(set_to_none=False)` called on the plain optimizer. Compared by identity: some
# functions a mode is given are unhashable.
_CLEARS = (torch.Tensor.zero_, torch._foreach_zero_, torch.Tensor.detach_)


def _metadata(func: Callable) -> bool:
    """Whether `func` reads no parameter's values: a property (`.grad`, `.device`, `.shape`)
    other than `.data`, or one of `_METADATA`."""
    if getattr(func, "__name__", "") in ("__get__", "__set__"):
        return getattr(func, "__self__", None) is not _DATA
    try:
        return func in _METADATA
    except TypeError:  # unhashable
        return False


class _ReadGuard(TorchFunctionMode):
    """GRADSYNC_DEBUG=DETAIL, from `step()` until every bucket still landing has landed: a
    torch function given a parameter of one of those buckets, or the gradient it had as
    backward ended, raises, naming it, instead of reading the values from before the step (an
    EMA, a logged norm: `opt.wait()` first). What gradsync does itself passes: the wrapper's
    forward (`LandOnUse` lands each bucket first), the landing and stepping, `wait()`,
    `zero_grad()`, and a gradient zeroed in place (`model.zero_grad(set_to_none=False)`: it is
    zeroed again once its bucket lands). Inert once nothing it watches is landing;
    `OverlappedOptimizer._release_guard` pops it from the mode stack."""

    def __init__(self, optimizer: OverlappedOptimizer) -> None:
        super().__init__()
        self._optimizer = weakref.ref(optimizer)
        self.watched: dict[int, int] = {}  # id(parameter or gradient) -> its bucket's index
        # id(gradient) -> its parameter. The gradients are held by `_pending` while their
        # bucket is landing, so no new tensor takes one's id and is taken for it.
        self._grads: dict[int, torch.Tensor] = {}
        self._buckets: frozenset[int] = frozenset()  # the buckets' indices

    def arm(self, params: dict[int, int], grads: dict[int, torch.Tensor]) -> None:
        self.watched = params | {g: params[id(p)] for g, p in grads.items()}
        self._grads, self._buckets = grads, frozenset(params.values())

    def disarm(self) -> None:
        self.watched, self._grads, self._buckets = {}, {}, frozenset()

    def watching(self) -> bool:
        """Whether a bucket it watches is still landing; disarmed for good once none is."""
        optimizer = self._optimizer()
        pending = optimizer._pending if optimizer is not None else {}
        if self.watched and not any(index in pending for index in self._buckets):
            self.disarm()
        return bool(self.watched)

    def __torch_function__(self, func: Callable, types: object, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.watched and not _metadata(func):  # armed: never once every bucket landed
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func: Callable, args: tuple, kwargs: dict) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            return
        reducer = optimizer._reducer()
        if optimizer._own.depth or (reducer is not None and reducer.on_use is not None):
            return
        if read := self._landing(args, kwargs, optimizer._pending):
            grads = self._grads
            if any(func is c for c in _CLEARS):  # zeroed: again as it lands; not a read
                read = [a for a in read if id(a) not in grads]
            if read:
                raise optimizer._read_error(func, [a for a in read if id(a) not in grads],
                                            [grads[id(a)] for a in read if id(a) in grads])

    def _landing(self, args: tuple, kwargs: dict, pending: dict) -> list[torch.Tensor]:
        """The arguments (inside lists and tuples too) that are watched parameters or
        gradients still landing, each once."""
        watched = self.watched
        return [a for a in arguments_among(args, kwargs, watched) if watched[id(a)] in pending]


def _function_name(func: Callable) -> str:
    """`torch.Tensor.add_`, `torch.stack`, `torch.Tensor.data` (the property)."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") in ("__get__", "__set__") and owner is not None:
        return f"torch.Tensor.{getattr(owner, '__name__', '?')}"
    try:
        return resolve_name(func) or repr(func)
    except TypeError:  # unhashable: not in torch's tables
        return repr(func)


def _push_at_bottom(mode: TorchFunctionMode) -> None:
    """Push `mode` under every mode on torch's function-mode stack: a `with` block of the
    user's open around `step()` then pops its own mode when it exits (a mode exits by popping
    the top, whatever it is), not this one. The modes above are put back as they were."""
    above = [torch._C._pop_torch_function_stack()
             for _ in range(torch._C._len_torch_function_stack())]
    torch._C._push_on_torch_function_stack(mode)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def _on_stack(mode: TorchFunctionMode) -> bool:
    return any(torch._C._get_function_stack_at(i) is mode
               for i in range(torch._C._len_torch_function_stack()))


_ZEROED = torch.empty(0)  # a gradient zeroed in place since step() (`_landing`): zeroed again


def _version(grad: torch.Tensor | None) -> int:
    return -1 if grad is None else grad._version


class _LandsOnRead(torch.Tensor):
    """`.grad` of a parameter from the end of backward until its bucket lands: an alias of
    the gradient (its memory and version counter) that lands the bucket when a torch function
    is first given it (its metadata aside: `.shape`, `.dtype`...), then runs the function on
    the gradient itself. So what reads or changes gradients after backward sees their
    averages, as with the plain optimizer, with no mode on the stack: `clip_grad_norm_` (a
    trainer's too), GradScaler's unscaling and inf check, a logged norm. Each bucket read
    lands early, where its gradients are read."""

    _landing: tuple[weakref.ref[OverlappedOptimizer], int | None, int]
    _gradient: torch.Tensor  # what backward left in `.grad`, where the average lands

    @staticmethod
    def of(grad: torch.Tensor, optimizer: OverlappedOptimizer, bucket: int) -> _LandsOnRead:
        alias = grad.as_subclass(_LandsOnRead)
        alias._landing = (weakref.ref(optimizer), optimizer._iteration, bucket)
        alias._gradient = grad
        return alias

    @classmethod
    def __torch_function__(cls, func: Callable, types: object, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        wanted: dict[int, tuple[OverlappedOptimizer, set[int]]] = {}
        for item in flat_arguments(args, kwargs) if not _metadata(func) else ():
            if type(item) is cls:
                ref, iteration, bucket = item._landing
                if (opt := ref()) is not None and opt._iteration == iteration \
                        and bucket in opt._pending:
                    wanted.setdefault(id(opt), (opt, set()))[1].add(bucket)
        for opt, buckets in wanted.values():
            opt._land_read(sorted(buckets))
        return func(*_plain(args), **dict(zip(kwargs, _plain(tuple(kwargs.values())))))


def _plain(args: tuple) -> list[Any]:
    """`args` with each `_LandsOnRead` (inside lists and tuples too) its gradient itself: the
    function then runs on plain tensors (a result, a repr, as without the overlap)."""
    def plain(item: Any) -> Any:
        return item._gradient if type(item) is _LandsOnRead else item

    return [type(arg)(plain(item) for item in arg) if type(arg) in (list, tuple) else plain(arg)
            for arg in args]


def _grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param.grad`, the gradient itself where it is still a `_LandsOnRead`."""
    grad = param.grad
    return grad._gradient if type(grad) is _LandsOnRead else grad


def _unwrap(held: list[_Held]) -> None:
    """`.grad` back to the gradient itself where it is still a `_LandsOnRead` of it."""
    for p, g, _ in held:
        if type(p.grad) is _LandsOnRead and p.grad._gradient is g:
            p.grad = g


class _Stepper:
    """What the Reducer holds (`engine.reductions.BucketStepper`): the optimizer, weakly."""

    def __init__(self, optimizer: OverlappedOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)

    @property
    def stepped_by(self) -> Optimizer | None:
        """The optimizer the overlapped one wraps (None once it is gone)."""
        optimizer = self._optimizer()
        return optimizer.optimizer if optimizer is not None else None

    def backward_ended(self, pending: Sequence[Bucket]) -> None:
        if (optimizer := self._optimizer()) is not None:
            with optimizer._own:
                optimizer._backward_ended(pending)

    def landing(self, bucket: Bucket) -> None:
        if (optimizer := self._optimizer()) is not None:
            with optimizer._own:
                optimizer._landing(bucket)

    def written(self, bucket: Bucket) -> None:
        if (optimizer := self._optimizer()) is not None:
            with optimizer._own:
                optimizer._written(bucket)

    def may_land_later(self, bucket: Bucket) -> bool:
        optimizer = self._optimizer()
        return optimizer is None or optimizer._steps_whole(bucket)

    def before_landing(self) -> None:
        if (optimizer := self._optimizer()) is not None:
            optimizer._before_landing()

    def release_guard(self) -> None:
        """Every bucket landed, or a forward's `LandOnUse` exited: the read guard may go."""
        if (optimizer := self._optimizer()) is not None and optimizer._guard is not None:
            optimizer._release_guard()


def _detach(reducer: Reducer, finished: Any, hooks: list[Any]) -> None:
    reducer.step_each_bucket(None)
    reducer.on_use_ended = None
    reducer.before_landing = None
    for handle in [finished, *hooks]:
        handle.remove()


class _LandFirst:
    """A state-dict pre-hook of the wrapped module and of each module in it: every bucket still
    landing lands first. Pickled with the module (`torch.save(model)`), a no-op."""

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = LocalRef(reducer)

    def __call__(self, *_args: Any) -> None:
        if (live := self.reducer()) is not None:
            live.land()


def refuse_another(reducer: Reducer, optimizer: Optimizer) -> None:
    """Refuse to overlap `optimizer` where another overlapped optimizer steps the buckets
    already, naming it and the fix; alike on every rank, before any collective."""
    if (current := reducer.bucket_stepper) is None:
        return
    held = getattr(current, "stepped_by", None)
    raise RuntimeError(
        f"overlap_optimizer: this wrapper's buckets are already stepped by an overlapped "
        f"{type(held).__name__} (over {sum(held_by(held, reducer.params))} of its "
        f"{len(reducer.params)} parameters), and one optimizer at a time steps them. Step "
        f"other parameters with a plain optimizer after backward (their buckets land as "
        f"backward ends), or drop the first (del opt) before overlapping "
        f"{type(optimizer).__name__}")


def held_by(optimizer: object, params: Sequence[torch.Tensor]) -> list[bool]:
    """Whether `optimizer` holds each of `params` (none, for what is no optimizer: refused
    after the ranks have agreed, so that every rank passes the same collectives)."""
    groups = getattr(optimizer, "param_groups", None)
    held = {id(p) for group in groups or () if isinstance(group, dict)
            for p in group.get("params", ())}
    return [id(p) in held for p in params]


def tail_bytes(tail_mb: float | None, chunk_mb: float | None,
               credit_mb: float | None = None) -> tuple[int, int, int]:
    """(tail, chunk, credit) in bytes, from MiB (None: the defaults), checked."""
    sizes = []
    for name, value, default in (("tail_mb", tail_mb, DEFAULT_TAIL_MB),
                                 ("chunk_mb", chunk_mb, DEFAULT_CHUNK_MB),
                                 ("credit_mb", credit_mb, DEFAULT_CREDIT_MB)):
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"overlap_optimizer({name}={value!r}): expected a size in MiB >= 0")
        sizes.append(int(value * 2**20))
    return sizes[0], sizes[1], sizes[2]


def agree_on_tail(group: Any, tail: int, chunk: int, credit: int = 0) -> None:
    """Every rank must cut and order the buckets alike, and hold the same chunks back: a
    difference would pair different buckets' collectives across ranks. Raised on every rank,
    naming them, before any is sent."""
    everyone = cast(list[tuple[int, int, int]],
                    all_gather_objects(group, (tail, chunk, credit)))
    if len(set(everyone)) > 1:
        shown = ", ".join(f"rank {r}: tail {t} B, chunk {c} B, credit {k} B"
                          for r, (t, c, k) in enumerate(everyone))
        raise ValueError(f"overlap_optimizer: the ranks asked for different tails ({shown}); "
                         "pass the same tail_mb, chunk_mb and credit_mb on every rank")


class MeasuredTail:
    """The tail held where `overlap_optimizer` is given no `tail_mb`: `DEFAULT_TAIL_MB` for the
    first synchronised iterations, then what the link could not have carried before backward
    ended (`IterationTimeline.backlog_bytes`: the median of the last iterations', the least
    over the ranks, at least a chunk), if it proves faster. Held, those gradients cost the link
    no time in backward and go nearest the input first; a fixed tail holds too much on a link
    faster than backward (it idles through the end of backward) and too little on a slower one
    (the next forward's first chunks queue behind buckets still on the wire). But where the
    collectives take the cores that compute (loopback, a rank per core) there is no separate
    link, and holding more only delays: so the two tails take turns for a few slots, each
    timed from its forward to its backward's return, and the backlog is kept only if its steps
    are faster on every rank (`margin`). Measured on the emulated cluster and on loopback:
    docs/benchmarks/2026-12-08-overlap-measured-tail.md. Not inside `join()`
    (`DistributedDataParallel.join_hook` drops it): a joined rank could not take part."""

    after = 6  # synchronised forwards first: the one-time rebuild, then timed iterations
    window = 4  # timelines the backlog is the median of
    per_slot = 3  # iterations each tail runs in turn (the first after a switch is not timed)
    rounds = 4  # slots of each tail
    margin = 0.02  # the backlog's steps must be this much faster

    def __init__(self, chunk: int, credit: int) -> None:
        self.chunk, self.credit = chunk, credit
        self.syncs = 0
        self.tail: int | None = None  # bytes, once decided
        self.trial: dict[str, Any] = {}  # the two tails, the slots run, their steps (if tried)
        self.backlog: int | None = None  # bytes, once measured
        self.score: float | None = None  # the backlog's steps over the default's, agreed

    def maybe_decide(self, reducer: Reducer) -> None:
        """Call at every synchronised forward, alike on every rank (a relayout at each slot's
        start and two agreements, all at the same forwards on every rank)."""
        self.syncs += 1
        k = self.syncs - self.after  # this iteration's place in the trial
        if self.tail is not None or k < 0 or not reducer.lands_lazily:  # else landed at the end
            return
        if k == 0:
            self._measure(reducer)
        if not self.trial:
            return
        self._time_last(reducer)
        if k == 2 * self.rounds * self.per_slot:
            self._decide(reducer)
            return
        if k % self.per_slot == 0:  # a slot begins: the two tails in turn
            self._use(reducer, self.trial["tails"][(k // self.per_slot) % 2])
        self.trial["ran"][reducer.iteration + 1] = (k // self.per_slot, k % self.per_slot)

    def _measure(self, reducer: Reducer) -> None:
        backlogs = [b for t in list(reducer.history)[-self.window:]
                    if (b := t.backlog_bytes()) is not None]
        least, unknown = agreed_max(
            reducer, [-statistics.median(backlogs) if backlogs else 0.0, float(not backlogs)])
        if unknown:  # a rank records no timings (record_events=False): the default stays
            self.tail = reducer.config.priority_tail_bytes
            return
        # At least a chunk: a link that keeps up on the median iteration still queues the
        # gradients nearest the input behind the ones before them in the others (a convnet's
        # first layers at 2 Gbit/s: 0.961 of torch's step with its 0.1 MiB backlog held, 0.929
        # with 4 MiB; the same page).
        self.backlog = backlog = max(int(-least), self.chunk)
        current = reducer.config.priority_tail_bytes
        base = reducer.layout_by_caps()
        if _cut(reducer, base, backlog, self.chunk) == _cut(reducer, base, current, self.chunk):
            self.tail = current  # the same buckets (a model smaller than both): nothing to try
            return
        self.trial = {"tails": (current, backlog), "ran": {}, "steps": {}}

    def _time_last(self, reducer: Reducer) -> None:
        """The last finished iteration's step, if it ran in the trial, not first in its slot,
        and not after a pause (its forward then found every bucket landed)."""
        history = list(reducer.history)[-2:]
        if not history or (last := history[-1]).iteration not in self.trial["ran"]:
            return
        slot, place = self.trial["ran"].pop(last.iteration)
        if place == 0 or not (last.forward_start_ns and last.backward_returned_ns):
            return
        ms = (last.backward_returned_ns - last.forward_start_ns) * 1e-6
        if not after_pause(history, ms):
            self.trial["steps"].setdefault(slot, []).append(ms)

    def _use(self, reducer: Reducer, tail: int) -> None:
        if reducer.config.priority_tail_bytes != tail:
            reducer.send_tail_first(tail, self.chunk, layout=reducer.layout_by_caps(),
                                    credit=self.credit)

    def _decide(self, reducer: Reducer) -> None:
        """Each round's backlog slot over its default slot; the median of those, the largest
        over the ranks: the backlog is kept only if it was faster on every rank."""
        steps = self.trial["steps"]
        ratios = [statistics.median(steps[2 * r + 1]) / statistics.median(steps[2 * r])
                  for r in range(self.rounds) if steps.get(2 * r) and steps.get(2 * r + 1)]
        (score,) = agreed_max(reducer, [statistics.median(ratios) if ratios else math.inf])
        current, backlog = self.trial["tails"]
        self.score, self.trial = score, {}
        self.tail = backlog if score < 1 - self.margin else current
        self._use(reducer, self.tail)

    @property
    def decided_by(self) -> int:
        """Synchronised forwards by which the tail is decided."""
        return self.after + 2 * self.rounds * self.per_slot


def _cut(reducer: Reducer, layout: list[list[int]], tail: int, chunk: int) -> list[list[int]]:
    """`layout` as `Reducer.send_tail_first` would cut it for `tail` bytes."""
    return priority_tail(layout, reducer.params, reducer.expect_sparse_gradient, tail, chunk)[0]


def agree_on_parameters(group: Any, names: Sequence[str], held: Sequence[bool]) -> None:
    """Every rank's optimizer must step the same of the wrapper's parameters (`held[i]`: the
    i-th). Where one does not hold a bucket whole, that rank lands the bucket as backward ends
    (`_steps_whole`) and the others in the next forward; with a credit, the chunks the landing
    lets start would then start at different points of the program on different ranks, and
    pair with other collectives there (a buffers' broadcast). Raised on every rank, naming the
    ranks and the parameters, before any bucket is sent."""
    everyone = cast(list[bytes], all_gather_objects(group, bytes(held)))
    differ = [i for i in range(len(names)) if len({mask[i] for mask in everyone}) > 1]
    if not differ:
        return
    counts = ", ".join(f"rank {r}: {sum(mask)} of {len(names)}" for r, mask in enumerate(everyone))
    shown = "; ".join(f"{names[i]} on ranks {[r for r, m in enumerate(everyone) if m[i]]}"
                      for i in differ[:5])
    more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
    raise ValueError(
        f"overlap_optimizer: the ranks' optimizers step different parameters of the wrapper "
        f"({counts}; {shown}{more}); build the optimizer over the same parameters on every "
        "rank, and call add_param_group alike on every rank")


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
    "OverlappedOptimizer: the gradients of {names} were written in place through a view taken "
    "before backward ended, while their bucket was still landing: its average lands over the "
    "write. Change gradients through .grad (p.grad.mul_, clip_grad_norm_, GradScaler), which "
    "lands the bucket first, or call opt.wait() after backward and before writing: step() "
    "then steps what the gradients hold, as the plain optimizer would."
)
_PARAMETER_CHANGED = (
    "OverlappedOptimizer: the parameters {names} were written in place after step() while "
    "buckets may still be landing, each stepped as it lands from the values it had: the write "
    "and the step would mix. Call opt.wait() before writing to parameters between step() and "
    "the next forward (weight clipping, a projection; an EMA reads them after it too; a "
    "checkpoint load through the wrapper waits by itself)."
)
_CHANGED_IN_FLIGHT = (
    "OverlappedOptimizer: the gradients of {names} were changed in place after step() through "
    "a view taken before backward ended, while their bucket was still reducing into them "
    "(gradient_as_bucket_view: .grad is the bucket): the reduction would be corrupted. Change "
    "them through .grad (its bucket lands first), or call opt.wait() before writing."
)
_READ_PENDING = (
    "OverlappedOptimizer (GRADSYNC_DEBUG=DETAIL): {function} was given {what}, still being "
    "updated by the overlapped step: their bucket has not landed yet, so this reads the values "
    "from before this step (a parameter not yet stepped, a gradient not yet averaged; a write "
    "would mix with the step). Call opt.wait() before reading parameters or gradients between "
    "step() and the next forward (an EMA, a logged norm); the wrapper's own forward, its "
    "state_dict() and opt.wait() wait by themselves."
)
