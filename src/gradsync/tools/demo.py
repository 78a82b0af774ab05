"""The demo job: train a digit classifier on several local ranks with gradsync, and prove it.

Run through torch's launcher (`gradsync demo` does this for you):

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m gradsync.tools.demo --epochs 20

Data: scikit-learn's bundled 8x8 handwritten digits (1,797 images, nothing downloaded), 80/20
train/test split. Each step every rank takes its share of a global batch; gradsync averages the
gradients. Target: at least 95 % accuracy on the held-out split. At the end rank 0 shows the
proof of synchronisation (parameters identical on every rank, and equal to one process training
on the whole batches with the same seed), the last iterations' stats, and writes the overlap
timeline as a PNG and a Perfetto trace.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..wrapper.ddp import DistributedDataParallel

__all__ = ["build_parser", "load_data", "main", "make_model", "parse_args"]

ACCURACY_TARGET = 0.95
HOOKS = ("none", "fp16", "bf16")


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised digits, split 80/20 with a fixed permutation: the same on every rank."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return x[:cut], y[:cut], x[cut:], y[cut:]


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )


def global_batches(n: int, batch: int, world: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """Index tensors of the global batches of one epoch (each split evenly across ranks)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    size = batch * world
    return [order[i : i + size] for i in range(0, n - size + 1, size)]


def build_parser() -> argparse.ArgumentParser:
    """`gradsync demo`'s options (the CLI reference in the docs is generated from this)."""
    p = argparse.ArgumentParser(
        prog="gradsync demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--epochs", type=int, default=20, help="passes over the training split (default 20)"
    )
    p.add_argument(
        "--batch-size", type=int, default=32, help="samples per rank per step (default 32)"
    )
    p.add_argument(
        "--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for weights, split and batch order")
    p.add_argument("--bucket-cap-mb", default=None,
                   help="bucket size in MiB (default: torch's 25), or 'auto' to plan buckets "
                   "from measured timings")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="search the graph for unused parameters every iteration")
    p.add_argument("--comm-hook", choices=HOOKS, default="none",
                   help="compress gradients for communication (default none)")
    p.add_argument(
        "--out", default="out/demo", help="folder for the PNG and trace (default out/demo)"
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be positive, got {args.lr}")
    if args.bucket_cap_mb not in (None, "auto"):
        try:
            args.bucket_cap_mb = float(args.bucket_cap_mb)
        except ValueError:
            p.error(
                f"--bucket-cap-mb must be a number of MiB or 'auto', got {args.bucket_cap_mb!r}"
            )
        if args.bucket_cap_mb <= 0:
            p.error(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")


def wrap(model: nn.Module, args: argparse.Namespace) -> DistributedDataParallel:
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=args.bucket_cap_mb, find_unused_parameters=args.find_unused_parameters
    )
    if args.comm_hook != "none":
        from .. import comm_hooks

        hook = {"fp16": comm_hooks.fp16_compress_hook, "bf16": comm_hooks.bf16_compress_hook}
        ddp.register_comm_hook(None, hook[args.comm_hook])
    return ddp


def train(
    args: argparse.Namespace, rank: int, world: int
) -> tuple[DistributedDataParallel, list[dict]]:
    train_x, train_y, test_x, test_y = load_data(args.seed)
    ddp = wrap(make_model(args.seed), args)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    history = []
    progress = _progress(rank, args.epochs)
    for epoch in range(args.epochs):
        losses, times = [], []
        for batch in global_batches(len(train_x), args.batch_size, world, epoch, args.seed):
            mine = batch.chunk(world)[rank]
            start = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(train_x[mine]), train_y[mine])
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
        with torch.no_grad():
            accuracy = (ddp.module(test_x).argmax(1) == test_y).float().mean().item()
        stats = ddp.stats().last
        row = {
            "epoch": epoch + 1, "loss": sum(losses) / len(losses), "accuracy": accuracy,
            "step_ms": 1e3 * sorted(times)[len(times) // 2],
            "hidden": stats.overlap_ratio if stats else 0.0,
        }
        history.append(row)
        if progress is not None:
            progress.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{accuracy:.1%}",
                                 step=f"{row['step_ms']:.2f}ms", hidden=f"{row['hidden']:.0%}")
            progress.update(1)
    if progress is not None:
        progress.close()
    return ddp, history


def _progress(rank: int, epochs: int):
    if rank != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=epochs, desc="gradsync demo", unit="epoch", dynamic_ncols=True)


def single_process_reference(args: argparse.Namespace, world: int) -> nn.Module:
    """One process, whole global batches, the same seed and order: what DDP must reproduce."""
    train_x, train_y, _, _ = load_data(args.seed)
    model = make_model(args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        for batch in global_batches(len(train_x), args.batch_size, world, epoch, args.seed):
            opt.zero_grad()
            # The mean over ranks of each rank's mean loss (equal shards).
            losses = [
                nn.functional.cross_entropy(model(train_x[part]), train_y[part])
                for part in batch.chunk(world)
            ]
            torch.stack(losses).mean().backward()
            opt.step()
    return model


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        ddp, history = train(args, rank, world)
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        timelines: list = [None] * world
        reducer = ddp.reducer
        assert reducer is not None
        dist.all_gather_object(timelines, reducer.history[-1])
        traces: list = [None] * world
        from ..observability.trace import chrome_trace

        dist.all_gather_object(traces, chrome_trace(reducer.history, rank, reducer.names))
        if rank == 0:
            _report(args, world, ddp, history, gathered, timelines, traces)
        del ddp
        # Free every wrapper while the group still exists: a process group torn down by the
        # interpreter at exit can abort with "terminate called without an active exception".
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _report(args, world, ddp, history, gathered, timelines, traces) -> None:
    from ..observability.trace import merge_traces, write_chrome_trace

    same = all(torch.equal(gathered[0], g) for g in gathered[1:])
    reference = single_process_reference(args, world)
    vs_single = max(
        (a - b).abs().max().item() for a, b in zip(ddp.module.parameters(), reference.parameters())
    )
    final = history[-1]
    out = Path(args.out)
    png = _overlap_png(timelines, out / "overlap.png")
    trace = write_chrome_trace(out / "trace.json", merge_traces(traces))
    tolerance = 1e-3 if args.comm_hook == "none" else 5e-2
    print(
        f"\ngradsync demo: {world} ranks, {args.epochs} epochs, "
        f"{args.batch_size} samples per rank per step"
    )
    print(f"  held-out accuracy: {final['accuracy']:.1%} (target {ACCURACY_TARGET:.0%})")
    print(f"  parameters identical on all {world} ranks: {same}")
    print(
        f"  max |DDP - single process on whole batches|: {vs_single:.2e} (tolerance {tolerance:g})"
    )
    print(
        f"  median step: {final['step_ms']:.2f} ms; "
        f"communication hidden behind backward: {final['hidden']:.0%}"
    )
    print(f"\n{ddp.stats()}\n")
    print(f"  overlap timeline (PNG):  {png}")
    print(f"  Perfetto trace (all ranks): {trace}  -> open in https://ui.perfetto.dev")
    ok = same and vs_single <= tolerance and final["accuracy"] >= ACCURACY_TARGET
    print(f"\nRESULT: {'PASS' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit("gradsync demo: a check failed (see above)")


def _overlap_png(timelines, path: Path) -> str:
    """The overlap picture, or why there is none: matplotlib is an extra (`gradsync[plot]`)."""
    try:
        from ..observability.plot import render_overlap_png

        return str(render_overlap_png(timelines, path))
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        return "not drawn: matplotlib is not installed (pip install 'gradsync[plot]')"


if __name__ == "__main__":
    main()
