"""Per-gradient overhead of two gradsync trees, interleaved in one process: this checkout's
against another (say, the last release), with torch's DDP twice for the noise.

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before/src [--rounds 25]

The other tree's package is loaded under the name `gradsync_before` (its imports are relative).
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


def load_before(src: str) -> type:
    home = Path(tempfile.mkdtemp())
    shutil.copytree(Path(src) / "gradsync", home / "gradsync_before")
    sys.path.insert(0, str(home))
    return importlib.import_module("gradsync_before").DistributedDataParallel


def step_timer(module: nn.Module, x: torch.Tensor, repeat: int):
    def step() -> None:
        for p in module.parameters():
            p.grad = None
        module(x).sum().backward()

    return lambda: timed(step, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the other tree's src/ folder")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=20, help="steps per variant per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = load_before(args.before)
    group = make_gloo_group(dist.HashStore(), 0, 1)
    x = torch.randn(4, 16)
    variants = {
        "torch DDP": step_timer(TorchDDP(make_model(), process_group=group), x, args.repeat),
        "torch DDP (again)": step_timer(TorchDDP(make_model(), process_group=group), x, args.repeat),
        "gradsync before": step_timer(before(make_model(), process_group=group), x, args.repeat),
        "gradsync now": step_timer(GradsyncDDP(make_model(), process_group=group), x, args.repeat),
        "plain module": step_timer(make_model(), x, args.repeat),
    }
    result = interleave(variants, rounds=args.rounds, warmup=2)
    print(f"step time, {2 * LAYERS} parameter tensors, world size 1, {args.rounds} rounds:\n")
    print(markdown_table(result, "torch DDP", "torch DDP (again)", "ms", 1e3))
    plain = result.median("plain module")
    print("\nDDP overhead per parameter tensor (median step - plain step) / 200:")
    for v in ("torch DDP", "torch DDP (again)", "gradsync before", "gradsync now"):
        print(f"  {v:20s} {(result.median(v) - plain) / (2 * LAYERS) * 1e6:6.2f} us")
    print(f"\nnow / before, paired: {result.paired_ratio('gradsync now', 'gradsync before'):.3f}; "
          f"A/A (torch again / torch): {result.paired_ratio('torch DDP (again)', 'torch DDP'):.3f}")


if __name__ == "__main__":
    main()
