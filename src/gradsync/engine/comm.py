"""The communication-hook protocol of torch's DDP: `hook(state, bucket) -> Future[Tensor]`.

`GradBucket` is what a hook sees of one of our buckets, with the methods of torch's
`dist.GradBucket`, so hooks written for torch (compression, PowerSGD, research hooks) run
unchanged. `check_hook` refuses a hook that cannot work before any rank starts waiting on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .bucket import Bucket
from .errors import GradSyncError

__all__ = ["CommHook", "GradBucket", "averages_by_one_allreduce", "check_hook", "check_hook_result",
           "check_registration", "hook_name", "sharded_hook_dtype"]

# A hook sees a GradBucket: torch's class under torch's DDP, ours (same methods) under gradsync's.
CommHook = Callable[[Any, Any], torch.futures.Future]


# Hooks whose reduction is known and makes sense with sharded gradients: each averages the
# bucket by one all-reduce, `buffer.to(dtype).div_(world_size)` then a sum (torch's
# default_hooks and gradsync.comm_hooks alike), so a reduce-scatter of the same tensor gives each
# rank its shard of exactly the hook's result. Found by name: the engine imports no hooks.
_SHARDABLE_MODULES = ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
                      "gradsync.comm_hooks")
_SHARDABLE = {"allreduce_hook": None, "fp16_compress_hook": torch.float16,
              "bf16_compress_hook": torch.bfloat16}


def averages_by_one_allreduce(hook: CommHook) -> bool:
    """Whether `hook` is one of the known hooks that average a bucket by a single all-reduce,
    issued inside the call (their Futures' callbacks only cast or copy)."""
    name = getattr(hook, "__name__", "")
    return getattr(hook, "__module__", None) in _SHARDABLE_MODULES and name in _SHARDABLE


def sharded_hook_dtype(state: object, hook: CommHook, group: Any) -> torch.dtype | None:
    """The dtype a sharded bucket is reduced in for `hook` (None: the bucket's own); a
    ValueError naming the hooks that shard when `hook` is not one of them."""
    name = getattr(hook, "__name__", "")
    if not averages_by_one_allreduce(hook):
        raise ValueError(
            f"a communication hook ({hook_name(hook)}) with sharded gradients: only hooks that "
            "average each bucket by one all-reduce shard it (torch's or gradsync.comm_hooks' "
            "allreduce_hook, fp16_compress_hook, bf16_compress_hook); others return whole buckets. "
            "Use ZeroRedundancyOptimizer(shard_gradients=False) for other hooks"
        )
    if state is not None and (not isinstance(state, torch.distributed.ProcessGroup)
                              or state.size() != group.size()):
        raise ValueError(
            f"{name} with sharded gradients: its state must be None or the wrapper's process group "
            f"(size {group.size()}), got {state!r}"
        )
    return _SHARDABLE[name]


class GradBucket:
    """One bucket as a communication hook sees it (torch's `GradBucket` interface)."""

    def __init__(self, bucket: Bucket, is_last: bool) -> None:
        self._bucket = bucket
        self._buffer = bucket.buffer
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket (summed, not yet averaged: the hook averages)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view per parameter into `buffer()`, shaped like the parameter."""
        return list(self._bucket.views) if self._buffer is self._bucket.buffer else [
            self._buffer.narrow(0, o, n).view(p.shape)
            for o, n, p in zip(self._bucket.offsets, self._bucket.lengths, self._bucket.params)
        ]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """Whether this is the last bucket to be reduced in the iteration."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the flat buffer (e.g. by a cast copy); the Future must then carry a tensor
        of this one's shape and dtype."""
        if tensor.numel() != self._bucket.buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer: bucket {self.index()} holds "
                f"{self._bucket.buffer.numel()} elements, the new buffer has {tensor.numel()}"
            )
        self._buffer = tensor


def hook_name(hook: Callable) -> str:
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)


def check_hook(hook: object) -> None:
    """Refuse what cannot be a communication hook, at registration."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):
        return  # builtins and some callables have no signature: judged by their result instead
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) != 2 and not takes_varargs:
        raise TypeError(
            f"register_comm_hook: hook {hook_name(hook)}{inspect.signature(hook)} must take two "
            "arguments, (state, bucket), and return a torch.futures.Future of the reduced "
            "bucket tensor"
        )


def check_registration(current: tuple[object, CommHook] | None, hook: object, iterations: int,
                       casts_to_reduce_dtype: bool) -> None:
    """Refuse a registration torch's DDP refuses too (twice, late), or that cannot work yet."""
    if current is not None:
        raise RuntimeError(
            f"register_comm_hook can be called only once; {hook_name(current[1])} "
            f"is already registered (tried to add {hook_name(hook)})"  # type: ignore[arg-type]
        )
    if iterations > 0:
        raise RuntimeError(
            f"register_comm_hook must be called before the first forward/backward; "
            f"{iterations} iteration(s) have already run with the default all-reduce"
        )
    if casts_to_reduce_dtype:
        raise NotImplementedError("gradsync: communication hooks with mixed precision are not "
                                  "supported yet")
    check_hook(hook)


def check_hook_result(value: object, bucket: Bucket, expected: torch.Tensor, name: str,
                      where: str) -> torch.Tensor:
    """A hook's result, refused unless it is a tensor of the bucket's shape, in its dtype or the
    one the hook gave it (`GradBucket.set_buffer`). A complex bucket's may come as its real
    view (`torch.distributed.all_reduce` reduces a complex tensor as `view_as_real`, and so
    hands it back: torch's `allreduce_hook`), taken as the complex values it views."""
    if not isinstance(value, torch.Tensor):
        raise GradSyncError(
            f"gradsync: communication hook {name} completed {where} with "
            f"{type(value).__name__}; its Future must carry the reduced bucket tensor"
        )
    if expected.is_complex() and not value.is_complex() and value.shape == (*expected.shape, 2):
        value = torch.view_as_complex(value)
    # The bucket's own dtype, or the one the hook gave it with set_buffer (a compressed result
    # is written back through a cast, as torch does).
    dtypes = {bucket.buffer.dtype, expected.dtype}
    if value.shape != expected.shape or value.dtype not in dtypes:
        raise GradSyncError(
            f"gradsync: communication hook {name} returned a tensor of shape "
            f"{list(value.shape)} and dtype {value.dtype} for {where}; expected the bucket's "
            f"shape {list(expected.shape)} and dtype {' or '.join(sorted(str(d) for d in dtypes))}"
        )
    return value
