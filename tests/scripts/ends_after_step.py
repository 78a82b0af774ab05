"""Launched by `tests/processes/test_multiprocess.py` under torchrun: a script that ends right
after the overlapped optimizer's last `step()`, with that step's buckets still reducing, as a
training script may (no `opt.wait()`, no checkpoint).

    ends_after_step.py destroy|exit

`destroy` calls `dist.destroy_process_group()` and then exits; `exit` just exits. Each rank
prints the reducer's phase after the last step ("landing": buckets still reducing) and "done"
as its last lines. 32 MiB of gradients: their all-reduce is still in flight when the
interpreter begins to finalize."""

import sys

import torch
import torch.distributed as dist
from torch import nn

import gradsync


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=1.0)
    # Every bucket in the tail, within a credit of two 4 MiB chunks: at the end of the last
    # backward two chunks are reducing and the rest wait for the next forward, which never
    # comes. (Left to themselves, the buckets sometimes all land before backward ends.)
    opt = ddp.overlap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), tail_mb=64,
                                chunk_mb=4, credit_mb=8)
    for _ in range(3):
        ddp(torch.randn(32, 1024)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    print(f"phase: {ddp.reducer.phase.value}", flush=True)
    if sys.argv[1] == "destroy":
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
