"""The Reducer's configuration: one frozen dataclass, validated without a process group."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch

from .bucketing import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES

__all__ = ["ReducerConfig"]


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
    """dtype in which buckets are summed across ranks (default: the bucket's own). Gradients are
    cast to it and divided by the world size in it, before the sum, so nothing overflows."""

    timeout: timedelta = timedelta(minutes=30)
    """How long the end of backward waits for one bucket's reduction before raising."""

    history: int = 16
    """How many finished iterations' timelines to keep (bounded memory)."""

    def __post_init__(self) -> None:
        limits = self.rebuild_bucket_size_limits
        if limits is not None and (len(limits) == 0 or any(int(x) < 0 for x in limits)):
            raise ValueError(
                f"rebuild_bucket_size_limits={limits!r}: give one or more byte limits >= 0, "
                "or None to keep the initial layout"
            )
        if self.timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={self.timeout!r} must be positive")
        if self.history < 1:
            raise ValueError(f"history={self.history} must be at least 1")
