"""Where a step goes on the emulated cluster: phases and each bucket's launch and landing.

Two hosts on the emulated cluster (root only), one rank each, gloo. Variants run interleaved,
round after round, 3 steps each; rank 0 prints per variant the median forward, backward (the
call, which includes waiting for every bucket and the write-back), optimizer step and whole
step in ms, and for gradsync's variants, in ms since backward began, the first gradient ready,
each bucket's launch `L<b>` and completion `C<b>`, the end of backward and the finish.

    sudo .venv/bin/python benchmarks/cluster_timeline.py  # residual MLP, 2 Gbit/s
    sudo .venv/bin/python benchmarks/cluster_timeline.py --link 1gbit \
        --variants torch,25,2,L0.5_2,minimal

Variants: `torch` (torch's DDP), `plain` (no communication), a number (gradsync with that
`bucket_cap_mb`), `L<a>_<b>_...` (gradsync with an explicit layout: buckets of a, b, ... MiB
in reverse parameter order, the last size repeated) and `minimal` (a reference with the least
Python a bucketed all-reduce can have: one multiply per hook, all-reduces launched in order,
a batched write-back per bucket, no checks; on the layout of the first gradsync variant). What
it showed: docs/benchmarks/2026-12-03-cluster-timeline.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

MIB = 2**20


class Minimal(nn.Module):
    """Bucketed all-reduce with the least Python: the yardstick for gradsync's own overhead."""

    def __init__(self, module: nn.Module, layout: list[list[int]], world_size: int) -> None:
        super().__init__()
        self.module, self.layout, self.scale = module, layout, 1.0 / world_size
        self.params = list(module.parameters())
        self.views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        self.bucket_of = [0] * len(self.params)
        self.flats = []
        for b, indices in enumerate(layout):
            flat = torch.empty(sum(self.params[i].numel() for i in indices))
            offset = 0
            for i in indices:
                n = self.params[i].numel()
                self.views[i], self.bucket_of[i] = (
                    flat[offset : offset + n].view_as(self.params[i]),
                    b,
                )
                offset += n
            self.flats.append(flat)
        self._reset()
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._hook, i))

    def _reset(self) -> None:
        self.pending, self.works, self.next, self.queued = (
            [len(b) for b in self.layout],
            [],
            0,
            False,
        )

    def _hook(self, index: int, param: torch.Tensor) -> None:
        torch.mul(param.grad, self.scale, out=self.views[index])
        self.pending[self.bucket_of[index]] -= 1
        while self.next < len(self.layout) and self.pending[self.next] == 0:
            self.works.append(dist.all_reduce(self.flats[self.next], async_op=True))
            self.next += 1
        if self.next == len(self.layout) and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        for indices, work in zip(self.layout, self.works):
            work.wait()
            torch._foreach_copy_(
                [self.params[i].grad for i in indices], [self.views[i] for i in indices]
            )
        self._reset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def layout_of_sizes(params: list[torch.Tensor], sizes_mib: list[float]) -> list[list[int]]:
    """Buckets of the given sizes (the last repeated), in reverse parameter order."""
    from gradsync import compute_bucket_assignment_by_size

    order = list(reversed(range(len(params))))
    limits = [int(size * MIB) for size in sizes_mib]
    return compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, tensor_indices=order
    )[0]


def build(variant: str, model_name: str, rank: int, state: dict):
    from gradsync import DistributedDataParallel
    from gradsync.tools.benchsuite import MODELS, _loss

    torch.manual_seed(0)
    model, make_input = MODELS[model_name]()
    wrapped: nn.Module
    if variant == "torch":
        wrapped = nn.parallel.DistributedDataParallel(model)
    elif variant == "plain":
        wrapped = model
    elif variant == "minimal":
        if "layout" not in state:
            raise SystemExit(
                "minimal needs a gradsync variant before it in --variants (it takes its layout)"
            )
        wrapped = Minimal(model, state["layout"], dist.get_world_size())
    else:
        wrapped = DistributedDataParallel(
            model, bucket_cap_mb=25 if variant.startswith("L") else float(variant)
        )
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [make_input(g) for _ in range(4)]
    # past the first rebuild, then the layout asked for
    if isinstance(wrapped, DistributedDataParallel):
        for batch in batches[:2]:
            _loss(wrapped(batch)).backward()
        if variant.startswith("L"):
            wrapped.reducer.install_layout(
                layout_of_sizes(
                    list(model.parameters()), [float(v) for v in variant[1:].split("_")]
                )
            )
        state.setdefault("layout", [list(b.param_indices) for b in wrapped.reducer.buckets])
    return wrapped, torch.optim.SGD(model.parameters(), lr=1e-3), batches


def phases(wrapped: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, float]:
    from gradsync import DistributedDataParallel
    from gradsync.engine.timeline import EventKind
    from gradsync.tools.benchsuite import _loss

    t0 = time.perf_counter_ns()
    opt.zero_grad()
    loss = _loss(wrapped(x))
    t1 = time.perf_counter_ns()
    loss.backward()
    t2 = time.perf_counter_ns()
    opt.step()
    t3 = time.perf_counter_ns()
    row = {"fwd": t1 - t0, "bwd": t2 - t1, "opt": t3 - t2, "step": t3 - t0}
    if isinstance(wrapped, DistributedDataParallel):
        tl = wrapped.reducer.history[-1]
        base = t1 - tl.start_ns  # backward's start on the timeline's clock
        row["first_ready"] = min(tl.times(EventKind.READY).values()) - base
        for b, t in sorted(tl.times(EventKind.LAUNCH).items()):
            row[f"L{b}"] = t - base
            row[f"C{b}"] = tl.times(EventKind.COMPLETE).get(b, base) - base
        row["bwd_end"] = tl.backward_end_ns - tl.start_ns - base
        row["finish"] = tl.finish_ns - tl.start_ns - base
    return {k: v / 1e6 for k, v in row.items()}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    # no rank waits for good on a stuck peer
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    rank, state = dist.get_rank(), {}
    built = {v: build(v, args.model, rank, state) for v in args.variants.split(",")}
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in built}
    for r in range(args.warmup + args.rounds):
        for variant, (wrapped, opt, batches) in built.items():
            for k in range(3):
                row = phases(wrapped, opt, batches[k % len(batches)])
                if r >= args.warmup:
                    rows[variant].append(row)
    if rank == 0:
        print(f"{args.model} at {args.link}, {args.rounds} rounds x 3 steps, medians in ms")
        for variant, got in rows.items():
            print(
                f"{variant:>10s} "
                + " ".join(f"{k}={statistics.median(r[k] for r in got):.1f}" for k in got[0])
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="residual_mlp")
    parser.add_argument("--link", default="2gbit")
    parser.add_argument("--variants", default="torch,2,minimal,plain")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from gradsync.tools.cluster import EmulatedCluster

    with EmulatedCluster(2, args.link) as cluster:
        target = [__file__, "--worker", *sys.argv[1:]]
        for i, done in enumerate(cluster.torchrun(target, timeout=1800)):
            lines = [line for line in done.stdout.splitlines() if not line.startswith("[W")]
            if done.returncode or i == 0:
                print("\n".join(lines[-40:]))


if __name__ == "__main__":
    main()
