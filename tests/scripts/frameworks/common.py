"""Shared by the framework scripts: data, a small model, and what each run records.

Each script trains the same configurations twice in one torchrun job: under torch's
DistributedDataParallel, then with `gradsync.patch_torch_ddp()` in force (the framework was
imported before it, the case that needs the name replaced in already-imported modules). Every
rank writes what it saw as JSON; tests/processes/test_frameworks.py compares the two.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync

IN, HIDDEN, CLASSES = 12, 24, 4


class Net(nn.Module):
    """Two layers and a head; `spare` (if asked for) never takes part: find_unused must cope."""

    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh()
        )
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.spare = nn.Linear(HIDDEN, CLASSES) if spare else None
        self.losses: list[float] = []

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
            self.losses.append(out["loss"].item())
        return out


def model(seed: int = 0, spare: bool = False) -> Net:
    torch.manual_seed(seed)
    return Net(spare)


class Points(torch.utils.data.Dataset):
    """A fixed labelled set; every rank builds the same one (the framework shards it)."""

    def __init__(self, n: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, IN, generator=g)
        self.y = (self.x[:, :CLASSES] * 3).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def record(out_dir: str, framework: str, impl: str, config: str, net: nn.Module,
           losses: list[float], wrapper: object) -> None:
    """This rank's losses, final parameters (as exact floats, read as a checkpoint of the
    module reads them: with gradsync's overlapped optimizer the last step's buckets land
    first) and the wrapper's class."""
    rank = dist.get_rank()
    params = {n: p.detach().double().flatten().tolist() for n, p in net.state_dict().items()}
    cls = type(wrapper)
    result = {
        "framework": framework, "impl": impl, "config": config, "rank": rank,
        "losses": losses, "params": params, "wrapper": f"{cls.__module__}.{cls.__qualname__}",
        "is_torch_ddp": isinstance(wrapper, torch.nn.parallel.DistributedDataParallel),
        "comm_hook": wrapper._get_ddp_logging_data().get("comm_hook"),  # type: ignore[attr-defined]
    }
    path = os.path.join(out_dir, f"{framework}.{config}.{impl}.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(result, f)


@contextlib.contextmanager
def implementation(impl: str) -> Iterator[None]:
    if impl == "torch":
        yield
        return
    with gradsync.patch_torch_ddp():
        assert torch.nn.parallel.DistributedDataParallel is gradsync.DistributedDataParallel
        yield
    assert torch.nn.parallel.DistributedDataParallel is not gradsync.DistributedDataParallel


def main(framework: str, configs: dict[str, Callable[[str, str], None]]) -> None:
    """`script OUT_DIR [CONFIG...]`: run each configuration under torch, then gradsync."""
    out_dir, chosen = sys.argv[1], sys.argv[2:] or list(configs)
    for config in chosen:
        for impl in ("torch", "gradsync"):
            with implementation(impl):
                configs[config](out_dir, impl)
    if dist.is_initialized():
        dist.barrier()
        # torch asks for it before exit. Without it, on a loaded machine a rank now and then
        # aborted at interpreter exit ("terminate called without an active exception"), after
        # every result was written (HF Trainer's script, torch's run and gradsync's in one
        # process; not seen with either alone).
        dist.destroy_process_group()
    print(f"{framework}: done {chosen}", flush=True)
