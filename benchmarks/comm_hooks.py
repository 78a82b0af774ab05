"""Compression hooks on a communication-heavy model: gradsync vs torch's DDP, world size 2.

A wide MLP (about 16 MB of float32 gradients) in two real processes over gloo on 127.0.0.1.
Variants interleave round by round; ratios are paired per round against torch's DDP with the same
hook. torch's DDP refuses bf16 hooks off NCCL, so bf16 is gradsync-only (ratio to torch fp16).

    .venv/bin/python benchmarks/comm_hooks.py [--rounds 7]
"""

from __future__ import annotations

import argparse

import torch
from step_time import _variant, wide_mlp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import comm_hooks
from gradsync.testing import run_processes
from gradsync.tools.bench import interleave, markdown_table


def _hooked(cls, group, hook):
    def wrap(model):
        ddp = cls(model, process_group=group)
        if hook is not None:
            ddp.register_comm_hook(group, hook)
        return ddp

    return wrap


def bench_rank(rank: int, group, rounds: int, repeat: int):
    torch.set_num_threads(1)
    variants = {
        "torch DDP + fp16 hook": _variant(
            wide_mlp, _hooked(TorchDDP, group, torch_hooks.fp16_compress_hook), repeat
        ),
        "torch DDP + fp16 hook (again)": _variant(
            wide_mlp, _hooked(TorchDDP, group, torch_hooks.fp16_compress_hook), repeat
        ),
        "gradsync + torch's fp16 hook": _variant(
            wide_mlp, _hooked(GradsyncDDP, group, torch_hooks.fp16_compress_hook), repeat
        ),
        "gradsync + gradsync fp16 hook": _variant(
            wide_mlp, _hooked(GradsyncDDP, group, comm_hooks.fp16_compress_hook), repeat
        ),
        "gradsync + gradsync bf16 hook": _variant(
            wide_mlp, _hooked(GradsyncDDP, group, comm_hooks.bf16_compress_hook), repeat
        ),
        "torch DDP, no hook": _variant(wide_mlp, _hooked(TorchDDP, group, None), repeat),
        "gradsync, no hook": _variant(wide_mlp, _hooked(GradsyncDDP, group, None), repeat),
    }
    result = interleave(variants, rounds=rounds, warmup=1)
    if rank != 0:
        return None
    return markdown_table(
        result, "torch DDP + fp16 hook", "torch DDP + fp16 hook (again)", "ms", 1e3
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=8)
    args = parser.parse_args()
    table = run_processes(bench_rank, 2, args.rounds, args.repeat, timeout=1800)[0]
    print(
        "### wide MLP (16 MB of gradients), world size 2, "
        f"{args.rounds} rounds x {args.repeat} steps\n"
    )
    print(table)


if __name__ == "__main__":
    main()
