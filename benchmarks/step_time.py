"""End-to-end step time at world size 2: gradsync's DDP vs torch's, side by side.

Two real processes (spawn) over gloo on 127.0.0.1; in each round every variant runs `--repeat`
training steps (forward, backward, SGD step) and reports its median step; variants interleave
round by round, warm-up dropped. Ratios are paired per round against torch's DDP; `torch DDP
(again)` is a second torch instance, the A/A figure for the noise of this shared machine.

    .venv/bin/python benchmarks/step_time.py [--rounds 9] [--models wide_mlp,many_small,convnet]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import run_processes
from gradsync.tools.bench import interleave, markdown_table, timed


def wide_mlp() -> tuple[nn.Module, torch.Tensor]:
    """Communication-heavy: about 16 MB of float32 gradients."""
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]), torch.randn(32, 1024)


def many_small() -> tuple[nn.Module, torch.Tensor]:
    """200 tiny parameter tensors: per-parameter overhead dominates."""
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(100)]), torch.randn(32, 16)


def convnet() -> tuple[nn.Module, torch.Tensor]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 10),
    )
    return model, torch.randn(16, 3, 32, 32)


MODELS = {"wide_mlp": wide_mlp, "many_small": many_small, "convnet": convnet}


def _variant(make, wrap, repeat: int):
    torch.manual_seed(0)
    model, x = make()
    ddp = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        ddp(x).float().pow(2).mean().backward()
        opt.step()

    return lambda: timed(step, repeat)


def bench_rank(rank: int, group, model_name: str, rounds: int, repeat: int):
    torch.set_num_threads(1)
    make = MODELS[model_name]
    variants = {
        "torch DDP": _variant(make, lambda m: TorchDDP(m, process_group=group), repeat),
        "torch DDP (again)": _variant(make, lambda m: TorchDDP(m, process_group=group), repeat),
        "gradsync DDP": _variant(make, lambda m: GradsyncDDP(m, process_group=group), repeat),
        "gradsync as_view": _variant(
            make,
            lambda m: GradsyncDDP(m, process_group=group, gradient_as_bucket_view=True),
            repeat,
        ),
        "gradsync planned (auto)": _variant(
            make, lambda m: GradsyncDDP(m, process_group=group, bucket_cap_mb="auto"), repeat
        ),
    }
    result = interleave(variants, rounds=rounds, warmup=1)
    return (
        markdown_table(result, "torch DDP", "torch DDP (again)", "ms", 1e3) if rank == 0 else None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeat", type=int, default=10, help="steps per variant per round")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    for name in args.models.split(","):
        table = run_processes(bench_rank, 2, name, args.rounds, args.repeat, timeout=1200)[0]
        print(
            f"\n### {name}: step time at world size 2, {args.rounds} rounds x {args.repeat} steps\n"
        )
        print(table, flush=True)


if __name__ == "__main__":
    main()
