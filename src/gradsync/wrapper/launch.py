"""Starting the default process group so that torchrun's restarts work.

Under `torchrun --max-restarts`, torch 2.13's launcher gives every restart attempt the same
TCP store (its own, TORCHELASTIC_USE_AGENT_STORE=True). The previous attempt's keys are still
there, among them each rank's gloo address; a restarted rank can read the address of a rank that
died with the previous attempt and fail with "connectFullMesh ... Connection refused" (reproduced
with torch alone, not in every run: figures in docs/benchmarks/design-figures.md#torchrun-restarts;
pytorch/pytorch#167288 reports the same with NCCL). `init_process_group` here gives each attempt
a key prefix of its own, and is torch's otherwise.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..engine.config import DEFAULT_TIMEOUT

__all__ = ["init_process_group"]


def init_process_group(
    backend: str | None = None, timeout: timedelta | None = None, **kwargs: Any
) -> None:
    """`torch.distributed.init_process_group`, safe to restart under torchrun.

    Use it instead of torch's at the top of a training script launched by torchrun; outside
    torchrun, or with an explicit `store` or `init_method`, it is torch's call unchanged.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if attempt is None or not agent_store or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
        return
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,  # the launcher's agent hosts this store
        timeout=timeout or DEFAULT_TIMEOUT,
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"gradsync/attempt{attempt}", base),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        **kwargs,
    )
