"""gradsync's own communication hooks: short functions that compose.

Each hook has torch's signature, `hook(group, bucket) -> Future[Tensor]`, so it can be given to
`register_comm_hook` of gradsync's or torch's DistributedDataParallel alike:

    model.register_comm_hook(group, gradsync.comm_hooks.fp16_compress_hook)
    model.register_comm_hook(group, gradsync.comm_hooks.compress_wrapper(torch.bfloat16, my_hook))

`group` is the process group to reduce over (None: torch's default group). They use only the
group's own methods, so they work on any `dist.ProcessGroup`.
"""

# No `from __future__ import annotations` here: torch's DDP reads the hooks' annotations at
# registration and accepts only the real `dist.GradBucket` and `Future[Tensor]` objects.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]

Hook = Callable[[Any, Any], torch.futures.Future]
Bucket = dist.GradBucket  # what torch hands a hook; gradsync hands one with the same methods
Result = torch.futures.Future[torch.Tensor]


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


def mean_allreduce(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> Result:
    """Average `tensor` across the group, in place; divide first so half precision can't
    overflow."""
    group = _group(group)
    tensor.div_(group.size())
    return group.allreduce([tensor]).get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(group: dist.ProcessGroup | None, bucket: Bucket) -> Result:
    """The default behaviour as a hook: average the bucket across ranks."""
    return mean_allreduce(group, bucket.buffer())


def compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    """Run `hook` on the bucket cast to `dtype`; hand back the result in the bucket's dtype."""

    def compressed_hook(state: Any, bucket: Bucket) -> Result:
        full = bucket.buffer()
        bucket.set_buffer(full.to(dtype))
        return hook(state, bucket).then(lambda fut: full.copy_(_value(fut)))

    compressed_hook.__name__ = compressed_hook.__qualname__ = (
        f"compress_wrapper({dtype}, {_name(hook)})"
    )
    return compressed_hook


def fp16_compress_hook(group: dist.ProcessGroup | None, bucket: Bucket) -> Result:
    """Average in float16: half the bytes on the wire."""
    return _compress_allreduce(torch.float16, group, bucket)


def bf16_compress_hook(group: dist.ProcessGroup | None, bucket: Bucket) -> Result:
    """Average in bfloat16: half the bytes on the wire, float32's range."""
    return _compress_allreduce(torch.bfloat16, group, bucket)


def fp16_compress_wrapper(hook: Hook) -> Hook:
    return compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    return compress_wrapper(torch.bfloat16, hook)


def _compress_allreduce(
    dtype: torch.dtype, group: dist.ProcessGroup | None, bucket: Bucket
) -> Result:
    full = bucket.buffer()
    return mean_allreduce(group, full.to(dtype)).then(lambda fut: full.copy_(fut.value()))


def _value(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    return value[0] if isinstance(value, (list, tuple)) else value


def _name(hook: Hook) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)
