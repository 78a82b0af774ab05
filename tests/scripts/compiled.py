"""torch.compile on gradsync's wrapper, against torch's DDP compiled the same way (2 ranks).

    torchrun --nproc-per-node 2 tests/scripts/compiled.py OUT_DIR BACKEND   # aot_eager | inductor

For each wrapper: eager; compiled with dynamo's DDPOptimizer (the graph split at bucket
boundaries, `optimize_ddp=True`, the default); compiled whole (`optimize_ddp=False`); and with
AdamW, eager and split, gradsync's overlapped (`overlap_optimizer`). Each rank
writes the final parameters and, for gradsync, per iteration where the first bucket launch fell
in backward: how many launches came before the input's gradient (the last thing backward
computes), and the fraction of backward elapsed at the first launch.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.engine.timeline import EventKind

WIDTH, LAYERS, STEPS, CAP_MB = 512, 4, 5, 1.0  # about one layer (1 MiB) per bucket


def build() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 8))


def train(cls: type, backend: str, mode: str, overlap: bool = False) -> dict:
    """`overlap`: AdamW, and gradsync's overlapped AdamW (each bucket landing in the next
    forward, a graph break each, its step run as written, never compiled with the graph)."""
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = mode != "whole"
    model = build()
    ddp = cls(model, bucket_cap_mb=CAP_MB)
    step_fn = ddp if mode == "eager" else torch.compile(ddp, backend=backend)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if overlap
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    if overlap and cls is gradsync.DistributedDataParallel:
        opt = ddp.overlap_optimizer(opt)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    started, inputs_done, losses = [], [], []
    for _ in range(STEPS):
        x = torch.randn(32, WIDTH, generator=g).requires_grad_()
        x.register_hook(lambda grad: inputs_done.append(time.perf_counter_ns()))
        out = step_fn(x)
        out.register_hook(lambda grad: started.append(time.perf_counter_ns()))
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if hasattr(opt, "wait"):
        opt.wait()  # the last step's buckets, before the parameters are read
    result = {
        "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
        "losses": losses,
    }
    if cls is gradsync.DistributedDataParallel:
        result["overlap"] = [
            _overlap(*args) for args in zip(ddp.reducer.history, started, inputs_done)
        ]
        result["buckets"] = len(ddp.reducer.buckets)
    return result


def _overlap(timeline, start: int, input_grad_ns: int) -> dict:
    """Launches before the input's gradient (the last thing backward computes), and the
    fraction of backward (from the output's gradient to the input's) at the first launch."""
    launches = sorted(t for t, kind, _ in timeline.events if kind == EventKind.LAUNCH)
    span = max(input_grad_ns - start, 1)
    return {"launched_before_input_grad": sum(t < input_grad_ns for t in launches),
            "first_launch_fraction": round((launches[0] - start) / span, 3) if launches else None,
            "buckets": len(launches)}


def main() -> None:
    out_dir, backend = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    results = {}
    for name, cls in (
        ("torch", torch.nn.parallel.DistributedDataParallel),
        ("gradsync", gradsync.DistributedDataParallel),
    ):
        for mode in ("eager", "split", "whole"):
            results[f"{name}.{mode}"] = train(cls, backend, mode)
        for mode in ("eager", "split"):
            results[f"{name}.{mode}.overlap"] = train(cls, backend, mode, overlap=True)
    with open(os.path.join(out_dir, f"compiled.{backend}.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
