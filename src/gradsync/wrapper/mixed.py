"""Mixed precision for the wrapper: torch's `_MixedPrecision`, bit for bit where torch's works.

Parameters live in full precision. For each forward they are swapped for low-precision copies
(`param_dtype`), so forward and backward compute in it; floating-point inputs are cast too, and
a `.grad` left from before is cast down, so autograd adds the step's gradient to it in
`param_dtype`. `buffer_dtype` casts every buffer once, integer ones such as BatchNorm's
`num_batches_tracked` included, as torch's `_cast_buffers` does. The Reducer copies the
low-precision gradients into its buckets undivided, casts each bucket to `reduce_dtype` if it
differs, sums it, and divides the sum by the world size in `reduce_dtype` (torch's
`_reducer_allreduce_and_upcast_hook`); at the end of backward the full-precision parameters come
back and the averages are written into float32 `.grad`. Compared with torch's own, run on CPU:
tests/processes/test_mixed_precision_vs_torch.py.

Where torch 2.13's own fails, gradsync does this instead. Its first iteration (two with
static_graph) all-reduces uninitialised memory (`_set_mixed_precision_param_dtype` replaces each
bucket's tensor, not the views the gradients are copied into): gradsync's is right. Under
`no_sync` torch's raises (its per-forward gradient hooks are removed only by a synchronised
backward): gradsync sums the micro-steps' gradients in full precision, then the synchronised
step follows torch's arithmetic. With `find_unused_parameters` torch's hook raises (casting
`.data` gives the parameters new gradient accumulators, which its graph search misses): gradsync
reduces as usual and leaves gradients unused on every rank untouched. A forward without grad
raises in torch's: gradsync casts and restores at once. `reduce_dtype` alone fails in torch's
(its reducer reads the missing `param_dtype` as some dtype): gradsync sums and divides in
`reduce_dtype`, as documented. torch refuses a communication hook on top (its mixed precision
is one); gradsync runs one on the low-precision buckets when `reduce_dtype` is `param_dtype`,
and refuses it otherwise.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from ..engine.reducer import find_tensors

__all__ = ["MixedPrecisionParams"]


class MixedPrecisionParams:
    """Swaps a module's parameters between full and low precision around each iteration."""

    def __init__(self, module: nn.Module, config: Any, ignored: set[str]) -> None:
        self.param_dtype: torch.dtype | None = getattr(config, "param_dtype", None)
        self.reduce_dtype: torch.dtype | None = (
            getattr(config, "reduce_dtype", None) or self.param_dtype
        )
        self.buffer_dtype: torch.dtype | None = getattr(config, "buffer_dtype", None)
        self.params = [p for n, p in module.named_parameters() if n not in ignored]
        self._full: dict[int, torch.Tensor] = {}
        self._stashed_grads: dict[int, torch.Tensor] = {}
        self._restore_queued = False
        self._written_back = False
        self._before: dict[int, torch.Tensor | None] = {}  # full-precision .grad before forward
        if self.buffer_dtype is not None:
            for name, buf in module.named_buffers():
                # every one, integer counters too, as torch's `_cast_buffers`
                if name not in ignored:
                    buf.data = buf.to(self.buffer_dtype)

    def cast_down(self, sync: bool, written_back: bool = False, sharded: bool = False) -> None:
        """Before forward: low-precision parameters; on unsynchronised steps, set the
        full-precision gradient aside, to add this step's gradient to it in float32 later.

        `written_back`: the Reducer writes this backward's averages back in full precision,
        so `restore` puts back the full-precision gradient tensors as they were (the Reducer
        overwrites those it averages and leaves the rest untouched, as torch does) instead of
        casting each low-precision gradient up only to have it overwritten. `sharded`: the
        Reducer keeps only its shards of the averages (ZeRO-2), so `.grad` is left None."""
        if self.param_dtype is None:
            return
        self._restore_queued = False
        self._written_back = written_back
        for p in self.params:
            if id(p) in self._full:  # a forward never followed by backward
                continue
            self._full[id(p)] = p.data
            grad = p.grad
            p.grad = None
            p.data = p.data.to(self.param_dtype)
            if written_back:
                self._before[id(p)] = None if sharded else grad
            if grad is not None:
                if sync:  # the reducer must see the whole accumulated gradient
                    p.grad = grad.to(self.param_dtype)
                else:
                    self._stashed_grads[id(p)] = grad

    def cast_inputs(self, obj: Any) -> Any:
        if self.param_dtype is None:
            return obj
        if isinstance(obj, torch.Tensor):
            return obj.to(self.param_dtype) if obj.is_floating_point() else obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.cast_inputs(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self.cast_inputs(v) for k, v in obj.items()}
        return obj

    def restore_after_backward(self, output: Any) -> None:
        """Arrange for `restore` to run at the end of the backward through `output` (or now)."""
        if self.param_dtype is None:
            return
        nodes = [t.grad_fn for t in find_tensors(output) if t.grad_fn is not None]
        if not torch.is_grad_enabled() or not nodes:
            self.restore()
            return
        me = weakref.ref(self)
        for node in nodes:
            # Runs when backward reaches the outputs, i.e. in the outermost backward, so the
            # callback it queues comes after everything, reentrant passes included, and
            # before the Reducer's own end-of-backward work, which it queues later.
            node.register_prehook(functools.partial(_queue_restore, me))

    def restore(self) -> None:
        with torch.no_grad():
            for p in self.params:
                full = self._full.pop(id(p), None)
                if full is None:
                    continue
                grad = p.grad
                p.grad = None
                p.data = full
                if self._written_back:  # this backward's gradients are in the buckets already
                    p.grad = self._before.pop(id(p), None)
                    continue
                stashed = self._stashed_grads.pop(id(p), None)
                if grad is not None:
                    grad = grad.to(full.dtype)
                    p.grad = grad if stashed is None else stashed.add_(grad)
                elif stashed is not None:
                    p.grad = stashed


def _queue_restore(me: weakref.ref[MixedPrecisionParams], _grads: object) -> None:
    live = me()
    if live is not None and not live._restore_queued:
        live._restore_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(live.restore)
