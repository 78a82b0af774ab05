"""gradsync: data-parallel gradient synchronisation for PyTorch, in readable Python.

`gradsync.DistributedDataParallel` is a drop-in for torch's; `gradsync.Reducer` is the engine
underneath (bucketed all-reduce overlapped with backward), usable on its own.
"""

from .bucketing import compute_bucket_assignment_by_size
from .config import ReducerConfig
from .ddp import DistributedDataParallel, exclude_from_sync
from .errors import GradSyncError, ReductionTimeoutError
from .reducer import Reducer
from .timeline import EventKind, IterationTimeline

__all__ = [
    "DistributedDataParallel",
    "EventKind",
    "GradSyncError",
    "IterationTimeline",
    "Reducer",
    "ReducerConfig",
    "ReductionTimeoutError",
    "compute_bucket_assignment_by_size",
    "exclude_from_sync",
]

__version__ = "0.1.0"
