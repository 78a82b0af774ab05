"""Launched by the multi-process tests under torchrun: one training loop, run in lockstep with
gradsync's DistributedDataParallel and torch's, compared after every step.

    train_parity.py STEPS [SAVE_PATH or -] [auto]

With `auto`, gradsync plans its buckets (`bucket_cap_mb="auto"`) with a short trial, so the run
goes through every layout switch of planning, trial and decision."""

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn

import gradsync


def make_model(width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    planned = sys.argv[3:4] == ["auto"]
    # Planned: 1 MiB layers, so that a plan splits them into buckets the trial switches between.
    ours_model, theirs_model = (
        make_model(512 if planned else 64),
        make_model(512 if planned else 64),
    )
    ours = gradsync.DistributedDataParallel(ours_model, bucket_cap_mb="auto" if planned else 0.01)
    # plan early, try each candidate twice, confirm twice, one step a slot; overlap allowed,
    if planned:
        # so the candidates differ from the current layout whatever the contention probe says
        ours._auto.warmup, ours._auto.rounds, ours._auto.per_slot = 2, 2, 1
        ours._auto.confirm_rounds = 2  # the trial ends by step 27 (`decided_by`), well inside 40
        ours._auto.saturated = False
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
    if planned:
        print(f"rank {rank}: {ours.bucket_plan()}", flush=True)
    if len(sys.argv) > 2 and sys.argv[2] != "-" and rank == 0:  # where to save the final parameters
        torch.save(ours_model.state_dict(), sys.argv[2])
    del ours, theirs
    gc.collect()  # see gradsync.tools.demo: free wrappers before the group goes
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
