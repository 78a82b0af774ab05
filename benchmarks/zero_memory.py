"""Memory per rank: gradsync's ZeroRedundancyOptimizer (gradients sharded, and ZeRO-1) against
torch's DDP with AdamW, torch's ZeroRedundancyOptimizer and FSDP2 (`fully_shard`, on CPU, gloo).

    python benchmarks/zero_memory.py                      # world sizes 2 and 3, ~2 minutes
    python benchmarks/zero_memory.py --world 2 --out docs/benchmarks/data/DATE-zero-memory

(a run kept goes to docs/benchmarks/data/DATE-NAME, with its page docs/benchmarks/DATE-NAME.md)

Each variant runs in a torchrun job of its own (so each process's peak is its own): a stack of
Linear(1024, 1024) layers (64 MiB of float32 parameters), AdamW, 3 steps on a small batch. Every
rank reports, in MiB, what it holds after one more backward, counted tensor by tensor:
parameters, gradients (`.grad` plus the wrapper's bucket buffers and shards that gradsync can
see; torch's C++ buckets are measured as the resident memory its wrapper adds at construction),
optimizer state; and the peak resident memory above the model alone, over steps 2 and 3 (the
kernel's high-water mark reset after the first step) and over the whole run. glibc is told
to map every allocation of 64 KiB or more on its own (`MALLOC_MMAP_THRESHOLD_`), so freed buffers
leave the resident set and the figures are the tensors', not the allocator's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

MIB = 1024 * 1024
LAYERS, WIDTH, BATCH, STEPS = 16, 1024, 8, 3
VARIANTS = [
    "torch DDP + AdamW",
    "torch ZeroRedundancyOptimizer",
    "FSDP2 (reshard_after_forward=False)",
    "gradsync ZeRO-1",
    "gradsync ZeRO-2",
    "gradsync ZeRO-2, 4 MiB buckets",
]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = getattr(t, "_local_tensor", t)  # a DTensor's own shard
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def worker(variant: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    base = _rss()
    wrapped, opt = model, None
    if variant == "FSDP2 (reshard_after_forward=False)":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=False)
    elif variant.startswith("gradsync"):
        from gradsync import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model, bucket_cap_mb=4 if variant.endswith("4 MiB buckets") else None
        )
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    wrapper_rss = _rss() - base
    kwargs = {"lr": 1e-3, "weight_decay": 0.01}
    if variant == "torch ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **kwargs)
        local = opt.optim
    elif variant.startswith("gradsync ZeRO"):
        from gradsync import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                      shard_gradients="ZeRO-2" in variant, **kwargs)
        local = opt.optim
    else:
        opt = local = torch.optim.AdamW(model.parameters(), **kwargs)
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        if step == 1:  # the peak of a step in the steady state, not of construction and the first
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        opt.zero_grad()
        wrapped(torch.randn(BATCH, WIDTH, generator=g)).pow(2).mean().backward()
        opt.step()
    peak = _peak_rss() - base
    # What a rank holds between steps, after backward (gradients are alive then): one more backward.
    wrapped(torch.randn(BATCH, WIDTH, generator=g)).pow(2).mean().backward()
    params = _bytes(model.parameters())
    grads = [p.grad for p in model.parameters()]
    reducer = getattr(wrapped, "reducer", None)
    buckets = (
        [t for b in reducer.buckets for t in (b.wire, b.shard)]
        if hasattr(reducer, "buckets")
        else []
    )
    grad_bytes = _bytes(grads + buckets)
    if variant in ("torch DDP + AdamW", "torch ZeroRedundancyOptimizer"):
        grad_bytes += wrapper_rss  # torch's C++ buckets, allocated (and touched) at construction
    state = _bytes(t for s in local.state.values() for t in s.values())
    first = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    Path(os.environ["ZERO_MEMORY_OUT"], f"rank{rank}.json").write_text(
        json.dumps(
            {
                "variant": variant,
                "world": world,
                "rank": rank,
                "params": params / MIB,
                "grads": grad_bytes / MIB,
                "state": state / MIB,
                "peak": peak / MIB,
                "peak_with_setup": first / MIB,
            }
        )
    )
    dist.destroy_process_group()


def run(world: int, variant: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        env = {
            **os.environ,
            "MALLOC_MMAP_THRESHOLD_": "65536",
            "OMP_NUM_THREADS": "1",
            "ZERO_MEMORY_OUT": folder,
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            __file__,
            "--variant",
            variant,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        rows = [json.loads(f.read_text()) for f in sorted(Path(folder).glob("rank*.json"))]
    if out.returncode != 0 or len(rows) != world:
        return [{"variant": variant, "world": world, "error": (out.stdout + out.stderr)[-800:]}]
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        f"Per rank, MiB ({LAYERS} x Linear({WIDTH}, {WIDTH}): "
        f"{LAYERS * (WIDTH * WIDTH + WIDTH) * 4 / MIB:.1f} MiB of float32 parameters; "
        "AdamW; after a backward, between steps; mean over ranks)",
        "",
        "| world | variant | parameters | gradients | "
        "optimizer state | peak in a step | peak incl. setup |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    by = {}
    for r in rows:
        by.setdefault((r["world"], r["variant"]), []).append(r)
    for (world, variant), rs in by.items():
        if "error" in rs[0]:
            lines.append(
                f"| {world} | {variant} | did not run: "
                f"{rs[0]['error'].splitlines()[-1][:80]} | | | | |"
            )
            continue
        mean = {
            k: sum(r[k] for r in rs) / len(rs)
            for k in ("params", "grads", "state", "peak", "peak_with_setup")
        }
        lines.append(
            f"| {world} | {variant} | {mean['params']:.1f} | {mean['grads']:.1f} | "
            f"{mean['state']:.1f} | {mean['peak']:.1f} | {mean['peak_with_setup']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", default=None, help="folder for memory.md and memory.json")
    args = parser.parse_args()
    if args.variant:
        worker(args.variant)
        return
    rows = [r for world in args.world for v in VARIANTS for r in run(world, v)]
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "memory.md").write_text(text)
        (Path(args.out) / "memory.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
