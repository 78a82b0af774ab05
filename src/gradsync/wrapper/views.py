"""What the wrapper's helpers may read of a `DistributedDataParallel`: torch's public names.

Join's hook and torch's logging data are handed the wrapper, not its private state; these
protocols say which names they read (the wrapper is the one class that has them).
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch import nn

from ..engine.reducer import Reducer

__all__ = ["WrapperView"]


class WrapperView(Protocol):
    """torch's public names every helper of the wrapper reads."""

    @property
    def module(self) -> nn.Module: ...

    @property
    def process_group(self) -> dist.ProcessGroup: ...

    @property
    def reducer(self) -> Reducer | None: ...

    @property
    def forward_sync_buffers(self) -> bool: ...
