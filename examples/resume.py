"""Training that survives a killed rank: checkpoint, let torchrun restart, resume exactly.

    torchrun --nproc-per-node 2 --max-restarts 1 examples/resume.py --out final.pt

Every `--every` steps rank 0 writes model, optimizer and every rank's gradsync state to
`--checkpoint` (atomically: a temporary file, then a rename). gradsync's state is per rank: a
hook's state, such as PowerSGD's error feedback, differs from rank to rank. When a rank dies, torch's launcher stops the
others and starts them all again (`--max-restarts`); each then loads the last checkpoint and goes
on from its step, with data chosen by step number, so the final parameters are exactly those of
an uninterrupted run. `--kill-at STEP` makes rank 1 SIGKILL itself at that step on the first
attempt, to try it. `--powersgd` reduces gradients with torch's PowerSGD hook, whose error
feedback and low-rank memories are part of gradsync's state: without them the resumed run
would drift from the uninterrupted one. `--overlap` steps each bucket as it lands
(`ddp.overlap_optimizer`): its checkpoint is the plain optimizer's, read after `opt.wait()`.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import gradsync


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(step * 100 + rank))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--checkpoint", default="out/resume/checkpoint.pt")
    p.add_argument("--kill-at", type=int, default=-1,
                   help="rank 1 SIGKILLs itself at this step (on a launcher's first attempt, and "
                   "only when no checkpoint is there yet to resume from)")
    p.add_argument("--out", default="out/resume/final.pt")
    p.add_argument("--powersgd", action="store_true", help="use torch's PowerSGD hook")
    p.add_argument("--overlap", action="store_true", help="step each bucket as it lands")
    args = p.parse_args()

    gradsync.init_process_group("gloo")  # torch's, with restart attempts kept apart
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.005)
    if args.powersgd:  # register before loading: the checkpoint restores the hook's state
        hook_state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=3, random_seed=0)
        ddp.register_comm_hook(hook_state, powerSGD.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.overlap:  # loads and saves the plain optimizer's state dict
        opt = ddp.overlap_optimizer(opt)
    start = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        ddp.load_gradsync_state(state["gradsync"][rank])  # this rank's own
        start = state["step"]
        print(f"rank {rank}: resumed at step {start}", flush=True)

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and start == 0
    for step in range(start, args.steps):
        if rank == 1 and step == args.kill_at and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        x = batch(step, rank)
        torch.nn.functional.mse_loss(ddp(x), x).backward()
        opt.step()
        if (step + 1) % args.every == 0:
            if args.overlap:  # the last buckets land in the next forward: land them now
                opt.wait()
            per_rank: list = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, ddp.gradsync_state())
            if rank == 0:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                         "gradsync": per_rank, "step": step + 1}
                os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
                torch.save(state, args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            dist.barrier()
    if args.overlap:
        opt.wait()
    if rank == 0:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        torch.save(model.state_dict(), args.out)
        print(f"rank 0: finished {args.steps} steps, parameters in {args.out}", flush=True)
    del ddp, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
