"""The two ways gradsync reports gradients that never came.

At the end of backward (the usual way): every rank has launched every bucket, the ranks that
lacked gradients have said so in their report, so every rank gathers each rank's list (a
collective they all enter) and raises the same error. At the next forward (where the end of
backward could not be seen): this rank's list, with what the others published through the
stall monitor's store.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .collectives import all_gather_objects
from .errors import (
    GradSyncError,
    format_names,
    missing_gradients_message,
    unfinished_reduction_message,
)
from .waits import StallMonitor

__all__ = ["missing_gradients_error", "unfinished_iteration_error"]


def missing_gradients_error(
    mine: list[tuple[int, str]], iteration: int, rank: int, group: dist.ProcessGroup | None,
    timeout: timedelta, find_unused: bool, static: bool, frozen: list[str],
) -> GradSyncError:
    """The error for gradients that never came: this rank's `mine` ((bucket, name) pairs) and,
    with `group`, every rank's, gathered (a collective every rank enters); `frozen`, this
    rank's missing parameters that no longer require grad."""
    if group is None or group.size() == 1:
        per_rank = {rank: mine} if mine else {}
    else:
        everyone = all_gather_objects(group, mine, timeout)
        per_rank = {r: names for r, names in enumerate(everyone) if names}  # type: ignore[misc]
    return GradSyncError(missing_gradients_message(per_rank, iteration, find_unused, static, rank,  # type: ignore[arg-type]
                                                   frozen))


def unfinished_iteration_error(missing: list[str], rank: int, find_unused: bool, iteration: int,
                               monitor: StallMonitor | None, frozen: list[str]) -> GradSyncError:
    """The error at the next forward for an iteration whose end of backward was never seen:
    this rank's `missing` names (`frozen`: those that no longer require grad), and what the
    other ranks published through the monitor."""
    message = unfinished_reduction_message(missing, rank, find_unused, iteration, frozen)
    if monitor is not None:  # what the other ranks reported, if they got here first
        for other, names in sorted(monitor.publish_missing(iteration, missing).items()):
            message += f"\nRank {other} reported {len(names)} missing: {format_names(names)}"
    return GradSyncError(message)
