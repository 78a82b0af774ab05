"""Where a step's time goes, phase by phase (zero_grad, forward, backward, optimizer step),
for torch's DDP, gradsync's wrapper and the sharded optimizers, side by side on loopback.

    python benchmarks/step_phases.py                       # tiny_gpt, 40 rounds, ~1 minute
    python benchmarks/step_phases.py --model wide_mlp --rounds 20
    python benchmarks/step_phases.py --variants torch,gradsync,torch-again

Two ranks (spawned, gloo); variants interleaved round by round, each round 5 steps, the
order rotated; rank 0 prints the median of each phase and the median of the per-round ratios
of the whole step to torch's DDP (`torch-again` is the A/A pair). A profile, not a benchmark:
the phases are host times, and `zero_speed.py` is what measures the steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = (
    "torch",
    "gradsync",
    "zero-1",
    "zero-2",
    "zero-2-overlapped",
    "zero-2-inside",
    "torch-again",
    "torch-zero",
    "torch-zero-1",
    "zero-1-views",
)
PHASES = ("zero_grad", "forward", "backward", "step", "total")


def _build(name: str, model_name: str, rank: int):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from gradsync import DistributedDataParallel, ZeroRedundancyOptimizer
    from gradsync.tools.benchsuite import MODELS

    torch.manual_seed(0)
    model, make_input = MODELS[model_name]()
    kw = {"lr": 1e-3, "weight_decay": 0.01}
    # torch's DDP, with torch's optimizers or gradsync's ZeRO-1 ("torch-zero-1")
    if name.startswith("torch"):
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        opt = (
            TorchZero(model.parameters(), torch.optim.AdamW, **kw)
            if name == "torch-zero"
            else ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kw)
            if name == "torch-zero-1"
            else torch.optim.AdamW(model.parameters(), **kw)
        )
    else:
        wrapped = DistributedDataParallel(model)
        opt = (torch.optim.AdamW(model.parameters(), **kw) if name == "gradsync" else
               ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                       shard_gradients=not name.startswith("zero-1"),
                                       parameters_as_bucket_view=name == "zero-1-views",
                                       overlap_param_gather=name == "zero-2-overlapped",
                                       overlap_with_ddp=name == "zero-2-inside", **kw))
    g = torch.Generator().manual_seed(1000 + rank)
    return wrapped, opt, [make_input(g) for _ in range(4)]


def _worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as zero_speed.py: AdamW's denormals swamp everything else
    names = args.variants.split(",")
    built = {n: _build(n, args.model, rank) for n in names}
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in names}
    clock = time.perf_counter
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            wrapped, opt, batches = built[name]
            spent = dict.fromkeys(PHASES, 0.0)
            dist.barrier()
            start = clock()
            for i in range(5):
                a = clock()
                opt.zero_grad()
                b = clock()
                loss = wrapped(batches[i % 4]).float().pow(2).mean()
                c = clock()
                loss.backward()
                d = clock()
                opt.step()
                e = clock()
                for phase, took in zip(PHASES, (b - a, c - b, d - c, e - d)):
                    spent[phase] += took
            spent["total"] = clock() - start
            if r >= 3:  # warm-up
                for phase in PHASES:
                    times[name][phase].append(spent[phase] / 5 * 1e3)
    if rank == 0:
        print(f"{args.model}: median ms per step on rank 0, {args.rounds - 3} rounds x 5 steps")
        print(f"{'variant':20}" + "".join(f"{p:>10}" for p in PHASES) + "  vs torch")
        for name in names:
            ratio = statistics.median(
                a / b for a, b in zip(times[name]["total"], times[names[0]]["total"])
            )
            print(
                f"{name:20}"
                + "".join(f"{statistics.median(times[name][p]):10.2f}" for p in PHASES)
                + f"  {ratio:8.3f}"
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny_gpt")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated; the first is the reference"
    )
    parser.add_argument("--port", type=int, default=29541)
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    mp.spawn(_worker, args=(args,), nprocs=2)


if __name__ == "__main__":
    main()
