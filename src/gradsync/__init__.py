"""gradsync: data-parallel gradient synchronisation for PyTorch, in readable Python.

`gradsync.DistributedDataParallel` is a drop-in for torch's; `gradsync.Reducer` is the engine
underneath (bucketed all-reduce overlapped with backward), usable on its own.
"""

# torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is first
# imported. Imported after init_process_group (the first optimizer does it, through
# torch._dynamo -> fsdp -> _shard), those defaults keep the default group alive past
# destroy_process_group(); its gloo threads then free the last works during interpreter
# shutdown and abort the process ("terminate called without an active exception"). Imported
# here, while no group exists, the defaults are None.
import torch.distributed.nn  # noqa: F401

from .engine.bucketing import compute_bucket_assignment_by_size
from .engine.config import ReducerConfig
from .engine.errors import GradSyncError, ReductionTimeoutError
from .engine.reducer import Reducer
from .engine.timeline import EventKind, IterationTimeline
from .observability.log import configure_from_env
from .observability.stats import BucketStats, IterationStats, Stats
from .observability.trace import chrome_trace, merge_traces, write_chrome_trace
from .wrapper.ddp import DistributedDataParallel, exclude_from_sync
from .wrapper.guards import ParameterDivergenceError
from .wrapper.launch import init_process_group
from .wrapper.replace import TorchDDPReplacement, patch_torch_ddp
from .wrapper.zero import (
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)

__all__ = [
    "BucketStats",
    "IterationStats",
    "Stats",
    "chrome_trace",
    "merge_traces",
    "write_chrome_trace",
    "DistributedDataParallel",
    "EventKind",
    "GradSyncError",
    "ParameterDivergenceError",
    "IterationTimeline",
    "Reducer",
    "ZeroRedundancyOptimizer",
    "ReducerConfig",
    "ReductionTimeoutError",
    "TorchDDPReplacement",
    "compute_bucket_assignment_by_size",
    "exclude_from_sync",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "init_process_group",
    "patch_torch_ddp",
]

__version__ = "0.1.0"

configure_from_env(strict=False)  # importing gradsync never raises
