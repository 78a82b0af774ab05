"""Under torchrun: gradsync's ZeroRedundancyOptimizer against torch's, and against torch's DDP
with the plain optimizer, on the same model, data and seed; prints one line per comparison."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel, ZeroRedundancyOptimizer

OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}


def train(kind: str, optimizer: str, steps: int = 5) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    cls, kwargs = OPTIMIZERS[optimizer]
    wrapped = (DistributedDataParallel if kind == "gradsync" else TorchDDP)(model)
    if kind == "gradsync":
        opt = ZeroRedundancyOptimizer(model.parameters(), cls, **kwargs)
    elif kind == "torch zero":
        opt = TorchZero(model.parameters(), cls, **kwargs)
    else:
        opt = cls(model.parameters(), **kwargs)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        wrapped(torch.randn(6, 8, generator=g)).pow(2).mean().backward()
        opt.step()
    if kind != "plain":
        opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if kind == "plain" or dist.get_rank() == 0 else {}
    return [p.detach().clone() for p in model.parameters()], state


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for optimizer in OPTIMIZERS:
        ours, our_state = train("gradsync", optimizer)
        theirs, their_state = train("torch zero", optimizer)
        plain, plain_state = train("plain", optimizer)
        same_zero = all(torch.equal(a, b) for a, b in zip(ours, theirs))
        same_plain = all(torch.equal(a, b) for a, b in zip(ours, plain))
        line = f"rank {rank}: {optimizer}: equal to torch's ZeroRedundancyOptimizer {same_zero}, to DDP + {optimizer} {same_plain}"
        if rank == 0:  # consolidated states: the same tensors under the same global indices
            same_state = (sorted(our_state["state"]) == sorted(their_state["state"]) == sorted(plain_state["state"])
                          and all(torch.equal(torch.as_tensor(v), torch.as_tensor(plain_state["state"][i][k]))
                                  for i, s in our_state["state"].items() for k, v in s.items()))
            line += f", consolidated state equal {same_state}"
        print(line, flush=True)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
