"""The two ways gradsync reports gradients that never came.

At the end of backward (the usual way): every rank has launched every bucket, the ranks that
lacked gradients have said so in their report, so every rank gathers each rank's list (a
collective they all enter) and raises the same error. At the next forward (where the end of
backward could not be seen): this rank's list, with what the others published through the
stall monitor's store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .collectives import all_gather_objects
from .errors import (
    GradSyncError,
    format_names,
    missing_gradients_message,
    unfinished_reduction_message,
)

if TYPE_CHECKING:
    from .reducer import Reducer

__all__ = ["missing_gradients_error", "unfinished_iteration_error"]


def missing_gradients_error(reducer: Reducer) -> GradSyncError:
    mine = [(reducer._bucket_of[i].index, reducer.names[i]) for i in reducer._missing]
    everyone = [mine] if reducer.world_size == 1 else all_gather_objects(
        reducer.process_group, mine, reducer.config.timeout
    )
    per_rank = {r: names for r, names in enumerate(everyone) if names}
    return GradSyncError(missing_gradients_message(
        per_rank, reducer.iteration, reducer._find_unused, reducer._static is not None, reducer.rank  # type: ignore[arg-type]
    ))


def unfinished_iteration_error(reducer: Reducer) -> GradSyncError:
    missing = [reducer.names[i] for i, done in enumerate(reducer._marked) if not done]
    message = unfinished_reduction_message(missing, reducer.rank, reducer._find_unused, reducer.iteration)
    monitor = reducer._waits.monitor
    if monitor is not None:  # what the other ranks reported, if they got here first
        for rank, names in sorted(monitor.publish_missing(reducer.iteration, missing).items()):
            message += f"\nRank {rank} reported {len(names)} missing: {format_names(names)}"
    return GradSyncError(message)
