"""Under torchrun: gradsync's ZeroRedundancyOptimizer (gradients sharded over gradsync's wrapper,
and ZeRO-1 with shard_gradients=False) against torch's, and against torch's DDP with the plain
optimizer, on the same model, data and seed; prints one line per comparison.

`zero_vs_torch.py save DIR` trains 3 steps, checkpoints (consolidated) to DIR, trains 3 more
and saves those parameters; `zero_vs_torch.py resume DIR`, a new job, loads the checkpoint,
trains the last 3 steps and prints whether it reached the same parameters."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel, ZeroRedundancyOptimizer

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


def batch(step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + dist.get_rank()))


def train(kind: str, optimizer: str, steps: int = 5) -> tuple[list[torch.Tensor], dict]:
    model = build()
    cls, kwargs = OPTIMIZERS[optimizer]
    wrapped = (DistributedDataParallel if kind.startswith("gradsync") else TorchDDP)(
        model, bucket_cap_mb=0.002
    )
    if kind.startswith("gradsync"):
        opt = ZeroRedundancyOptimizer(
            model.parameters(), cls, shard_gradients=kind == "gradsync", **kwargs
        )
        assert opt.shards_gradients == (kind == "gradsync")
    elif kind == "torch zero":
        opt = TorchZero(model.parameters(), cls, **kwargs)
    else:
        opt = cls(model.parameters(), **kwargs)
    for step in range(steps):
        opt.zero_grad()
        wrapped(batch(step)).pow(2).mean().backward()
        opt.step()
    if kind != "plain":
        opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if kind == "plain" or dist.get_rank() == 0 else {}
    return [p.detach().clone() for p in model.parameters()], state


def compare() -> None:
    rank = dist.get_rank()
    for optimizer in OPTIMIZERS:
        theirs, their_state = train("torch zero", optimizer)
        plain, plain_state = train("plain", optimizer)
        for kind in ("gradsync", "gradsync zero1"):
            ours, our_state = train(kind, optimizer)
            same_zero = all(torch.equal(a, b) for a, b in zip(ours, theirs))
            same_plain = all(torch.equal(a, b) for a, b in zip(ours, plain))
            line = (
                f"rank {rank}: {kind}: {optimizer}: equal to torch's "
                f"ZeroRedundancyOptimizer {same_zero}, to DDP + {optimizer} {same_plain}"
            )
            if rank == 0:  # consolidated states: the same tensors under the same global indices
                same_state = (
                    sorted(our_state["state"])
                    == sorted(their_state["state"])
                    == sorted(plain_state["state"])
                ) and all(
                    torch.equal(torch.as_tensor(v), torch.as_tensor(plain_state["state"][i][k]))
                    for i, s in our_state["state"].items()
                    for k, v in s.items()
                )
                line += f", consolidated state equal {same_state}"
            print(line, flush=True)


def checkpointed(folder: str, resume: bool) -> None:
    """Adam with sharded gradients; 3 steps, a checkpoint, 3 more (or, resuming, only those)."""
    model = build()
    wrapped = DistributedDataParallel(model, bucket_cap_mb=0.002)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    path = os.path.join(folder, "checkpoint.pt")
    if resume:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    for step in range(3 if resume else 0, 6):
        if step == 3 and not resume:
            opt.consolidate_state_dict(to=0)
            if dist.get_rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        opt.zero_grad()
        wrapped(batch(step)).pow(2).mean().backward()
        opt.step()
    final = [p.detach().clone() for p in model.parameters()]
    if not resume:
        torch.save(final, os.path.join(folder, f"uninterrupted{dist.get_rank()}.pt"))
        print(f"rank {dist.get_rank()}: saved", flush=True)
        return
    want = torch.load(os.path.join(folder, f"uninterrupted{dist.get_rank()}.pt"), weights_only=True)
    same = all(torch.equal(a, b) for a, b in zip(final, want))
    print(f"rank {dist.get_rank()}: resumed equal to uninterrupted {same}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    if len(sys.argv) > 2:
        checkpointed(sys.argv[2], resume=sys.argv[1] == "resume")
    else:
        compare()
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
