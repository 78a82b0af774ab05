"""The communication-hook protocol of torch's DDP: `hook(state, bucket) -> Future[Tensor]`.

`GradBucket` is what a hook sees of one of our buckets, with the methods of torch's
`dist.GradBucket`, so hooks written for torch (compression, PowerSGD, research hooks) run
unchanged. `check_hook` refuses a hook that cannot work before any rank starts waiting on it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from .bucket import Bucket
from .device import on_stream
from .errors import GradSyncError, ReductionTimeoutError
from .events import EventClock
from .profiling import profiled as _profiled
from .timeline import EventKind

LAUNCH, COMPLETE = EventKind.LAUNCH, EventKind.COMPLETE

__all__ = ["CommHook", "GradBucket", "HookChain", "averages_by_one_allreduce", "check_hook", "check_registration",
           "hook_name", "sharded_hook_dtype"]

# A hook sees a GradBucket: torch's class under torch's DDP, ours (same methods) under gradsync's.
CommHook = Callable[[Any, Any], torch.futures.Future]


# Hooks whose reduction is known and makes sense with sharded gradients: each averages the
# bucket by one all-reduce, `buffer.to(dtype).div_(world_size)` then a sum (torch's
# default_hooks and gradsync.comm_hooks alike), so a reduce-scatter of the same tensor gives each
# rank its shard of exactly the hook's result. Found by name: the engine imports no hooks.
_SHARDABLE_MODULES = ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "gradsync.comm_hooks")
_SHARDABLE = {"allreduce_hook": None, "fp16_compress_hook": torch.float16, "bf16_compress_hook": torch.bfloat16}


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
            f"a communication hook ({hook_name(hook)}) with sharded gradients: only hooks that average "
            "each bucket by one all-reduce shard it (torch's or gradsync.comm_hooks' allreduce_hook, "
            "fp16_compress_hook, bf16_compress_hook); others return whole buckets. Use "
            "ZeroRedundancyOptimizer(shard_gradients=False) for other hooks"
        )
    if state is not None and (not isinstance(state, torch.distributed.ProcessGroup) or state.size() != group.size()):
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


def check_registration(current: tuple[object, CommHook] | None, hook: object, iterations: int, mixed: bool) -> None:
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
    if mixed:
        raise NotImplementedError("gradsync: communication hooks with mixed precision are not supported yet")
    check_hook(hook)


class HookChain:
    """Runs the communication hook over the buckets of one iteration, in order.

    Bucket k+1's hook starts only once bucket k's Future has completed. Hooks such as PowerSGD
    issue more collectives from their Futures' callbacks and wait for them there. Started all at
    once, those nested collectives interleave differently on each rank, and callbacks waiting
    on work queued behind them occupy every gloo worker thread: a hang (torch 2.13's DDP hangs
    on PowerSGD with one-parameter buckets for this reason). One at a time, every rank issues
    the same collectives in the same order. The known hooks that issue their one all-reduce
    inside the call (`averages_by_one_allreduce`) cannot interleave: they are launched as their
    buckets fill, without waiting (`in_order`), so a slow link is never left idle between two
    buckets (it carries every bucket under torchft).

    Hooks are launched where torch's DDP launches them, on the backward thread (`release`,
    `pump` from each gradient's hook, and `result` at the end of backward), never from a
    communication thread's callback: a hook's own work (a cast, a division) then runs where
    the user's backward runs, on its thread and stream, not on a gloo worker that other
    collectives are waiting for.
    """

    def __init__(
        self,
        state: object,
        hook: CommHook,
        buckets: list[Bucket],
        group: Any,
        events: list,
        describe: Callable[[int], str],
        clock: Callable[[], int] = time.perf_counter_ns,
        on_stream: Callable[[Any], contextlib.AbstractContextManager] = on_stream,
    ) -> None:
        self.state, self.hook, self.buckets = state, hook, buckets
        self._on_stream = on_stream  # a bucket's hook runs on the stream it was filled on
        self.group, self.events, self.describe, self.clock = group, events, describe, clock
        self._lock = threading.RLock()
        self._released = 0  # buckets full and in order, free to launch
        self._launched = 0
        self._pumping = False  # a launch loop is running (on the thread holding the lock)
        self.waiting = False  # released buckets wait for their predecessor's Future
        self.in_order = averages_by_one_allreduce(hook)  # launched at release, not after the predecessor

    def release(self, count: int) -> None:
        with self._lock:
            self._released = count
            self._pump()

    def pump(self) -> None:
        """Launch what has become launchable since (called from the backward thread)."""
        with self._lock:
            self._pump()

    def _pump(self) -> None:
        # Call with the lock held. A loop, not a recursion: a Future that is complete when
        # returned (NCCL's are, at enqueue) lets it go straight on to the next bucket, so a
        # thousand ready buckets never nest a thousand deep.
        if self._pumping:
            return
        self._pumping = True
        try:
            while self._launched < self._released:
                previous = self.buckets[self._launched - 1] if self._launched else None
                if not self.in_order and previous is not None and not previous.future_done.is_set():  # type: ignore[union-attr]
                    self.waiting = True
                    return
                bucket = self.buckets[self._launched]
                self._launched += 1
                self._launch(bucket)
            self.waiting = False
        finally:
            self._pumping = False

    def _launch(self, bucket: Bucket) -> None:
        bucket.future_done = threading.Event()
        self.events.append((self.clock(), LAUNCH, bucket.index))
        view = GradBucket(bucket, is_last=bucket.index == len(self.buckets) - 1)
        bucket.hook_view = view
        try:
            with _profiled(f"gradsync.comm_hook.bucket{bucket.index}"), self._on_stream(bucket.stream):
                future = self._call(bucket, view)
        except Exception as error:  # reported at the end of backward, on the backward thread
            bucket.hook_error = GradSyncError(
                f"gradsync: communication hook {hook_name(self.hook)} raised on "
                f"{self.describe(bucket.index)}: {type(error).__name__}: {error}"
            )
            bucket.hook_error.__cause__ = error
            bucket.future_done.set()
            return
        bucket.future = future
        # Held weakly: the callback runs on a communication thread, and if it held the last
        # reference to the chain (so to the process group), the group would be destroyed on
        # its own worker thread, which cannot join itself ("Resource deadlock avoided").
        future.add_done_callback(functools.partial(_chain_done, weakref.ref(self), bucket, bucket.future_done))

    def _call(self, bucket: Bucket, view: GradBucket) -> torch.futures.Future:
        if bucket.sparse:  # reduced as torch does, but in the chain's order
            return self.group.allreduce([bucket.payload]).get_future().then(lambda f: f.value()[0])
        future = self.hook(self.state, view)
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and the C++ kind
            raise TypeError(
                f"the hook returned {type(future).__name__}; a hook must return a "
                "torch.futures.Future whose value is the reduced bucket tensor (e.g. "
                "group.allreduce([t]).get_future().then(lambda f: f.value()[0]))"
            )
        return future

    def _on_done(self, bucket: Bucket, done: threading.Event, future: object) -> None:
        if isinstance(self.clock, EventClock):  # timed on the device, not at this callback
            self.clock.after(future, self.events, COMPLETE, bucket.index)
        else:
            self.events.append((self.clock(), COMPLETE, bucket.index))
        done.set()  # the next bucket is launched by the backward thread, not here

    def result(self, bucket: Bucket, timeout: timedelta) -> torch.Tensor:
        """The checked tensor of `bucket`'s Future, waiting at most `timeout` for it."""
        where = self.describe(bucket.index)
        name = hook_name(self.hook)
        self._pump_until_launched(bucket, timeout)
        assert bucket.future_done is not None
        if not bucket.future_done.wait(timeout.total_seconds()):
            raise ReductionTimeoutError(
                f"gradsync: the Future returned by communication hook {name} for {where} did "
                f"not complete within {timeout}. A hook whose collective is not issued on every "
                "rank, or a Future nobody completes, ends here instead of hanging."
            )
        if bucket.hook_error is not None:
            raise bucket.hook_error
        assert bucket.future is not None and bucket.hook_view is not None
        try:
            # wait(), not value(): on a GPU it makes the current stream wait for the hook's
            # work (NCCL's Futures complete at enqueue), so the copy out reads landed data.
            value = bucket.future.wait()
        except Exception as error:
            raise GradSyncError(f"gradsync: communication hook {name} failed for {where}: {error}") from error
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if bucket.sparse:
            return value
        return _checked(value, bucket, bucket.hook_view.buffer(), name, where)

    def _pump_until_launched(self, bucket: Bucket, timeout: timedelta) -> None:
        self.pump()
        if bucket.future_done is None:  # its predecessor has not completed yet: wait for it
            previous = self.buckets[bucket.index - 1]
            assert previous.future_done is not None
            # Normally already set (results are taken in order); bounded all the same.
            previous.future_done.wait(timeout.total_seconds())
            with self._lock:
                self._pump()
        if bucket.future_done is None:
            raise ReductionTimeoutError(
                f"gradsync: {self.describe(bucket.index)} was never launched: the previous "
                f"bucket's Future did not complete within {timeout}"
            )


def _checked(value: object, bucket: Bucket, expected: torch.Tensor, name: str, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise GradSyncError(
            f"gradsync: communication hook {name} completed {where} with "
            f"{type(value).__name__}; its Future must carry the reduced bucket tensor"
        )
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


def _chain_done(chain: weakref.ref[HookChain], bucket: Bucket, done: threading.Event, future: object) -> None:
    live = chain()
    if live is not None:
        live._on_done(bucket, done, future)
    else:
        done.set()
