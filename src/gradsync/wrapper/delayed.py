"""Delayed all-reduce: some parameters are reduced together, once, when a chosen one is ready.

torch's `delay_all_reduce_named_params` / `param_to_hook_all_reduce`: the named parameters stay
out of the Reducer's buckets; when `param_to_hook_all_reduce` has its gradient (pick one whose
gradient comes last, e.g. the first layer's weight), all their gradients are flattened and
all-reduced in one go, overlapping whatever backward still has to do, and written back at the
end of backward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..engine.collectives import broadcast_tensors, wait
from ..engine.config import DEFAULT_TIMEOUT

__all__ = ["DelayedAllReduce"]


class DelayedAllReduce:
    """One flat all-reduce of `params`' gradients, started by `trigger`'s gradient hook."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        trigger: torch.Tensor,
        group: dist.ProcessGroup,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.timeout = timeout
        self.enabled = False  # set per iteration by the wrapper (False under no_sync)
        self._flat: torch.Tensor | None = None
        self._work: dist.Work | None = None
        me = weakref.ref(self)
        self._handle = trigger.register_post_accumulate_grad_hook(functools.partial(_start, me))
        weakref.finalize(self, self._handle.remove)

    @classmethod
    def from_arguments(
        cls, module: nn.Module, named: Sequence[tuple[str, nn.Parameter]] | None, trigger: object,
        group: dist.ProcessGroup,
    ) -> DelayedAllReduce | None:
        if (named is None) != (trigger is None):
            raise ValueError(
                "delay_all_reduce_named_params and param_to_hook_all_reduce go together: pass "
                f"both or neither (got delay_all_reduce_named_params={named!r}, "
                f"param_to_hook_all_reduce={'set' if trigger is not None else None})"
            )
        if named is None:
            return None
        if not isinstance(trigger, torch.Tensor) or not trigger.requires_grad:
            raise ValueError(
                f"param_to_hook_all_reduce={trigger!r:.60} must be a parameter that requires grad")
        pairs = isinstance(named, (list, tuple)) and all(
            isinstance(e, (list, tuple))
            and len(e) == 2
            and isinstance(e[0], str)
            and isinstance(e[1], torch.Tensor)
            for e in named
        )
        if not pairs:
            raise TypeError(
                f"delay_all_reduce_named_params={named!r:.60}: expected a list of (name, "
                "parameter) pairs, e.g. list(model.head.named_parameters(prefix='head'))"
            )
        known = dict(module.named_parameters())
        unknown = [n for n, p in named if known.get(n) is not p]
        if unknown:
            raise ValueError(
                f"delay_all_reduce_named_params: {unknown} are not this module's parameters"
            )
        return cls([p for _, p in named], trigger, group)

    def broadcast_from_rank0(self) -> None:
        if self.group.size() > 1:
            broadcast_tensors(self.group, [p.detach() for p in self.params], src=0)

    def start(self) -> None:
        if not self.enabled or self._work is not None:
            return
        with torch.no_grad():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            self._flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.group.size())
        self._work = self.group.allreduce([self._flat])
        torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        work, flat = self._work, self._flat
        self._work, self._flat = None, None
        assert work is not None and flat is not None
        wait(work, "delayed all-reduce", self.group, self.timeout)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                value = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)


def _start(me: weakref.ref[DelayedAllReduce], _param: torch.Tensor) -> None:
    live = me()
    if live is not None:
        live.start()
