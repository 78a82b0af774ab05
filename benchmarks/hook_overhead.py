"""Hook overhead: microseconds per parameter tensor that DDP adds to a step, gradsync vs torch.

A 200-parameter model of tiny layers (so the arithmetic is cheap and the per-parameter work shows),
one process, a world-size-1 gloo group. Each variant times forward+backward; the DDP overhead per
parameter is (variant - plain module) / 200. Variants run interleaved; `torch DDP (again)` is a
second torch DDP instance, the A/A figure that shows the noise.

    .venv/bin/python benchmarks/hook_overhead.py [--rounds 15]

`--before SRC` adds another gradsync tree (a worktree's `src/`, say the last release's),
loaded as `gradsync_before` and interleaved with this one: the before/after paired ratio.

    git worktree add /tmp/before <commit> &&
        .venv/bin/python benchmarks/hook_overhead.py --before /tmp/before/src
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import make_gloo_group
from gradsync.tools.bench import interleave, markdown_table, timed

LAYERS = 100  # weight + bias each: 200 parameter tensors


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(LAYERS)])


def step_timer(module: nn.Module, x: torch.Tensor, repeat: int, events: bool = True):
    def run() -> float:
        def step() -> None:
            for p in module.parameters():
                p.grad = None
            module(x).sum().backward()

        return timed(step, repeat)

    if not events:  # recording switched off through the config, not by patching modules
        module.reducer.configure(record_events=False)  # type: ignore[union-attr]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--before", help="another gradsync tree's src/ folder, to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    group = make_gloo_group(dist.HashStore(), 0, 1)
    x = torch.randn(4, 16)
    variants = {
        "torch DDP": step_timer(TorchDDP(make_model(), process_group=group), x, args.repeat),
        "torch DDP (again)": step_timer(
            TorchDDP(make_model(), process_group=group), x, args.repeat
        ),
        "gradsync DDP": step_timer(GradsyncDDP(make_model(), process_group=group), x, args.repeat),
        "gradsync DDP, events off": step_timer(
            GradsyncDDP(make_model(), process_group=group), x, args.repeat, events=False
        ),
        "plain module": step_timer(make_model(), x, args.repeat),
    }
    if args.before:
        before = load_before(args.before)
        variants["gradsync before"] = step_timer(
            before(make_model(), process_group=group), x, args.repeat
        )
    result = interleave(variants, rounds=args.rounds, warmup=2)
    print(f"step time, {2 * LAYERS} parameter tensors, world size 1, {args.rounds} rounds:\n")
    print(markdown_table(result, "torch DDP", "torch DDP (again)", "ms", 1e3))
    plain = result.median("plain module")
    print("\nDDP overhead per parameter tensor (median step - plain step) / 200:")
    for v in [n for n in variants if n != "plain module"]:
        print(f"  {v:26s} {(result.median(v) - plain) / (2 * LAYERS) * 1e6:6.2f} us")
    on, off = result.median("gradsync DDP"), result.median("gradsync DDP, events off")
    print(f"\nalways-on event recording: {(on - off) / on:+.1%} of the step "
          f"(paired ratio {result.paired_ratio('gradsync DDP', 'gradsync DDP, events off'):.3f})")
    if args.before:
        print(
            f"now / before, paired: {result.paired_ratio('gradsync DDP', 'gradsync before'):.3f}; "
            f"A/A: {result.paired_ratio('torch DDP (again)', 'torch DDP'):.3f}"
        )


def load_before(src: str) -> type:
    """The DistributedDataParallel of the gradsync tree at `src`, as package `gradsync_before`
    (its own imports are relative, so a renamed copy loads beside this one)."""
    home = Path(tempfile.mkdtemp())
    shutil.copytree(Path(src) / "gradsync", home / "gradsync_before")
    sys.path.insert(0, str(home))
    return importlib.import_module("gradsync_before").DistributedDataParallel


if __name__ == "__main__":
    main()
