"""Launched by the multi-process tests under torchrun: one training loop, run in lockstep with
gradsync's DistributedDataParallel and torch's, compared after every step."""

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn

import gradsync


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ours_model, theirs_model = make_model(), make_model()
    ours = gradsync.DistributedDataParallel(ours_model, bucket_cap_mb=0.01)
    theirs = nn.parallel.DistributedDataParallel(theirs_model, bucket_cap_mb=0.01)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours_model, theirs_model)]
    g = torch.Generator().manual_seed(100 + rank)  # every rank sees different data
    for step in range(steps):
        x = torch.randn(8, 16, generator=g)
        for ddp, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), x[:, :4]).backward()
            opt.step()
        for (name, a), b in zip(ours_model.named_parameters(), theirs_model.parameters()):
            if not torch.equal(a, b):
                raise SystemExit(f"rank {rank} step {step}: {name} differs from torch DDP")
    print(f"rank {rank}: {steps} steps matched torch DDP exactly", flush=True)
    if len(sys.argv) > 2 and rank == 0:  # where to save the final parameters
        torch.save(ours_model.state_dict(), sys.argv[2])
    del ours, theirs
    gc.collect()  # see gradsync.tools.demo: free wrappers before the group goes
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
