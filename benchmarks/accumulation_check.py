"""What the no_sync consistency check costs: gradsync with it on (twice, for the noise) and off,
and torch's DDP, interleaved, on 100 small Linear layers (200 tensors: latency-bound, where an
extra collective would show).

    torchrun --nproc-per-node 2 benchmarks/accumulation_check.py [--rounds 60]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import gradsync


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    variants: dict[str, nn.Module] = {}
    for name in ("check on", "check off", "check on (again)", "torch DDP"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(100)])
        if name == "torch DDP":
            variants[name] = nn.parallel.DistributedDataParallel(model)
        else:
            ddp = gradsync.DistributedDataParallel(model)
            ddp.set_accumulation_check(name != "check off")
            variants[name] = ddp
    x = torch.randn(32, 16)
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            for _ in range(args.steps):
                variants[name](x).pow(2).mean().backward()
            samples[name].append((time.perf_counter() - start) / args.steps * 1e3)
    if dist.get_rank() == 0:
        base = samples["check off"][3:]
        for name, values in samples.items():
            kept = values[3:]  # the first rounds warm up
            ratio = statistics.median(a / b for a, b in zip(kept, base))
            print(
                f"{name:18s} median {statistics.median(kept):.3f} ms/step, "
                f"paired ratio to check off {ratio:.3f}"
            )
    variants.clear()
    gc.collect()  # free the wrappers while the group exists
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
