"""The Reducer's configuration: one frozen dataclass, validated without a process group."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from .bucketing import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES

__all__ = ["DEFAULT_TIMEOUT", "READ_BACK", "RUNTIME_FIELDS", "ReducerConfig"]

# The one default for every wait gradsync makes (torch's default for a gloo process group).
DEFAULT_TIMEOUT = timedelta(minutes=30)
READ_BACK = ("auto", "now", "deferred")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReducerConfig:
    """How a `Reducer` synchronises gradients. Every field has the meaning of torch DDP's."""

    find_unused_parameters: bool = False
    """Walk the autograd graph from the forward outputs and mark parameters that cannot get a
    gradient as ready at once; all-reduce a used-map so a parameter unused on every rank keeps
    the gradient it had (torch: untouched / None)."""

    gradient_as_bucket_view: bool = False
    """Make each `.grad` a view into its bucket's flat buffer, so nothing is copied back."""

    static_graph: bool = False
    """The set of used parameters and how often each one's hook fires (reentrant activation
    checkpointing fires a shared parameter's hook more than once) is the same every iteration:
    learned in the first, relied on afterwards."""

    rebuild_bucket_size_limits: tuple[int, ...] | None = (
        DEFAULT_FIRST_BUCKET_BYTES,
        DEFAULT_BUCKET_CAP_BYTES,
    )
    """Byte limits for the one-time rebuild of buckets in the order gradients became ready in the
    first synchronised iteration; None keeps the initial layout for good. The rebuild is skipped
    with find_unused_parameters (unless static_graph), whose ready order may change every
    iteration (as torch)."""

    bucket_dtype: torch.dtype | None = None
    """dtype of the flat buckets when it is not the parameters' own: under mixed precision the
    gradients arrive in the low-precision compute dtype."""

    reduce_dtype: torch.dtype | None = None
    """dtype in which buckets are summed across ranks (default: the bucket's own). Under mixed
    precision (a `bucket_dtype` or `reduce_dtype` set) gradients go into the buckets undivided,
    are cast to it, summed, and the sum is divided by the world size in it, as torch's
    mixed-precision hook does."""

    timeout: timedelta = DEFAULT_TIMEOUT
    """How long the end of backward waits for one bucket's reduction before raising."""

    history: int = 16
    """How many finished iterations' timelines to keep (bounded memory)."""

    check_finite: bool = False
    """Check each bucket's gradients for NaN and Inf, naming the parameter and the rank
    (costs a pass over the gradients): before they are sent when reports are read back
    "now"; read back "deferred", once the norms have reached the host, after the bucket was
    averaged (no host sync)."""

    report_unused: bool = False
    """With find_unused_parameters: all-gather every rank's used map instead of all-reducing
    it, to say which rank left which parameter unused."""

    check_accumulation: bool = True
    """Compare, across ranks, how many micro-steps each synchronisation covers (no_sync()
    entered on some ranks only is then an error, not silently mixed steps)."""

    read_back: str = "auto"
    """When the host reads each step's reports (micro-step counts, missing gradients on other
    ranks): "now", at the end of backward (on a GPU a host sync every step); "deferred", once
    they have landed, at a later iteration's start (never stops the host; such an error is
    raised one or two iterations late, and a rank's own missing gradients still at once);
    "auto": now for a group whose collectives run on the host (gloo), deferred on a device
    group (NCCL)."""

    record_events: bool = True
    """Record the per-iteration timeline (one list append per gradient); off, nothing is
    recorded and stats are empty (for measuring what recording costs), except the order in
    which gradients became ready until the buckets have been rebuilt in it (without times)."""

    clock: Callable[[], int] = time.perf_counter_ns
    """Where timeline times come from, in nanoseconds. With parameters on a GPU the default
    becomes device time (`events.EventClock`: CUDA events, resolved once they have passed);
    an `EventClock` given here is used as that."""

    time_gradients_every: int = 64
    """With device time (parameters on a GPU), read each gradient's ready time on one
    iteration in this many (1: every one). A reading is a CUDA event recorded from Python,
    microseconds of host time per gradient; the other iterations time buckets and iterations
    only, as torch's C++ reducer does. Host clocks time every gradient."""

    priority_tail_bytes: int = 0
    """The last this many bytes of gradients in ready order (the parameters nearest the
    input: ready last in backward, needed first by the next forward) are sent once all of them
    are ready, nearest the input first, in buckets of at most `chunk_bytes`
    (`layout.priority_tail`). 0: every bucket in ready order, as torch. Worth it where the
    next forward can start on what has landed (`DistributedDataParallel.overlap_optimizer`)."""

    chunk_bytes: int = 4 * 2**20
    """The size of the tail's buckets (`priority_tail_bytes`)."""

    credit_bytes: int = 0
    """With buckets landing in the next forward: the most bytes of the tail's chunks reducing
    at once (a credit of bytes in flight). A chunk beyond it starts once the next forward
    has landed enough of those before it, so the chunk it needs first is not sharing the link
    with the ones it needs later (gloo runs two collectives at once). 0: the whole tail at once.
    Always at least one chunk in flight, whatever its size."""

    def casts_to_reduce(self, param_dtype: torch.dtype) -> bool:
        """Whether buckets are cast to another dtype to be reduced (mixed precision)."""
        return (self.reduce_dtype is not None
                and self.reduce_dtype != (self.bucket_dtype or param_dtype))

    def __post_init__(self) -> None:
        limits = self.rebuild_bucket_size_limits
        if limits is not None and (len(limits) == 0 or any(int(x) < 0 for x in limits)):
            raise ValueError(
                f"rebuild_bucket_size_limits={limits!r}: give one or more byte limits >= 0, "
                "or None to keep the initial layout"
            )
        if self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={self.timeout!r} must be positive")
        if (isinstance(self.time_gradients_every, bool)
                or not isinstance(self.time_gradients_every, int)
                or self.time_gradients_every < 1):
            raise ValueError(f"time_gradients_every={self.time_gradients_every!r} must be an "
                             "int >= 1")
        for name in ("priority_tail_bytes", "chunk_bytes", "credit_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if self.history < 1:
            raise ValueError(f"history={self.history} must be at least 1")
        for name in ("find_unused_parameters", "gradient_as_bucket_view", "static_graph",
                     "check_finite", "report_unused", "check_accumulation", "record_events"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.read_back not in READ_BACK:
            raise ValueError(f"read_back={self.read_back!r}: expected one of "
                             f"{', '.join(READ_BACK)}")
        if self.report_unused and not self.find_unused_parameters:
            raise ValueError("report_unused=True needs find_unused_parameters=True (there is no "
                             "used map to report otherwise)")


# What `Reducer.configure` may change between iterations; the rest shapes the buckets.
RUNTIME_FIELDS = frozenset(
    {"timeout", "check_finite", "report_unused", "check_accumulation", "record_events", "clock",
     "read_back", "time_gradients_every"}
)
