"""gradsync under torchft against torchft's own DDP and against gradsync without fault tolerance,
on the emulated cluster (two hosts, one replica each, links shaped to `--link`; root only).

    sudo .venv/bin/python benchmarks/ft_bench.py  # 2 Gbit/s, residual_mlp and gpt_16mib
    sudo .venv/bin/python benchmarks/ft_bench.py --link 1gbit --rounds 8 --steps 12

Each host runs one process holding all three variants side by side, started from the same seed:

* "gradsync": `gradsync.DistributedDataParallel` over a fixed gloo group (no fault tolerance),
  built twice ("gradsync A/A": the same model again, for the noise of a paired ratio);
* "gradsync.ft": `gradsync.ft.DistributedDataParallel(manager, model)` under a torchft Manager;
* "torchft DDP": `torchft.ddp.DistributedDataParallel(manager, model)` under the same Manager.

The lighthouse runs on host 0. A round runs `--steps` timed steps (after one untimed) of each
variant in turn, in an order that rotates from round to round; the table gives each variant's
median step time and the paired per-round ratios (median, min-max over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

VARIANTS = ("gradsync", "gradsync A/A", "gradsync.ft", "torchft DDP")
DIST_PORT, LIGHTHOUSE_PORT = 29500, 29510


def _build(variant: str, model_name: str, manager, cap_mb: float, lr: float = 1e-3):
    import torch
    import torchft

    import gradsync
    import gradsync.ft
    from gradsync.tools.benchsuite import MODELS

    torch.manual_seed(0)
    model, make_input = MODELS[model_name]()
    if variant in ("gradsync", "gradsync A/A"):
        wrapped = gradsync.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        return wrapped, torch.optim.SGD(wrapped.parameters(), lr=lr), make_input
    if variant == "gradsync.ft":
        wrapped = gradsync.ft.DistributedDataParallel(manager, model, bucket_cap_mb=cap_mb)
    else:
        wrapped = torchft.ddp.DistributedDataParallel(manager, model, bucket_cap_mb=cap_mb)
    return (
        wrapped,
        torchft.Optimizer(manager, torch.optim.SGD(wrapped.parameters(), lr=lr)),
        make_input,
    )


def _steps(wrapped, optim, make_input, steps: int, seed: int) -> list[list[float]]:
    """Per timed step: [whole step, zero_grad, forward and backward, optimizer step] in seconds."""
    import torch

    g = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps + 1):  # the first is not timed
        x = make_input(g)
        start = time.perf_counter()
        optim.zero_grad()  # under torchft: starts this step's quorum
        zeroed = time.perf_counter()
        wrapped(x).float().pow(2).mean().backward()
        backward = time.perf_counter()
        optim.step()  # under torchft: should_commit, then the step
        end = time.perf_counter()
        times.append([end - start, zeroed - start, backward - zeroed, end - backward])
    return times[1:]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    rank, me = args.rank, args.addresses.split(",")[args.rank]
    host0 = args.addresses.split(",")[0]
    store = dist.TCPStore(host0, DIST_PORT, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    local = dist.TCPStore(me, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
        load_state_dict=lambda _: None,
        state_dict=dict,
        min_replica_size=2,
        replica_id=f"bench_{rank}",
        store_addr=me,
        store_port=local.port,
        rank=0,
        world_size=1,
        lighthouse_addr=f"http://{host0}:{LIGHTHOUSE_PORT}",
        hostname=me,
        init_sync=False,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120),
    )
    results: dict[str, dict[str, list[list[list[float]]]]] = {}
    for model_name in args.models.split(","):
        built = {v: _build(v, model_name, manager, args.bucket_cap_mb) for v in VARIANTS}
        per = results.setdefault(model_name, {v: [] for v in VARIANTS})
        for r in range(args.rounds):
            for k in range(len(VARIANTS)):
                variant = VARIANTS[(r + k) % len(VARIANTS)]
                dist.barrier()  # both hosts start each block together
                per[variant].append(_steps(*built[variant], args.steps, seed=1000 * r + k))
        committed = manager.current_step()
        if rank == 0:
            print(f"[{model_name}: {committed} steps committed under torchft]", flush=True)
            # where the communication went: overlapped or exposed
            for variant in ("gradsync", "gradsync.ft"):
                print(f"[{model_name}, {variant}]\n{built[variant][0].stats()}", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def table(results: dict, link: str, steps: int, cap_mb: float) -> str:
    lines = [
        f"Step time on two emulated hosts at {link} (one replica per host, gloo, {steps} steps per "
        f"block, bucket_cap_mb={cap_mb:g}, medians; ratios paired by round: median [min-max])",
        "",
        "| model | gradsync ms | gradsync.ft ms | torchft DDP ms | gradsync.ft / torchft DDP "
        "| gradsync.ft / gradsync | A/A: gradsync / gradsync |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    def paired(med: dict[str, list[float]], a: str, b: str) -> str:
        rs = [x / y for x, y in zip(med[a], med[b])]
        return f"{statistics.median(rs):.3f} [{min(rs):.3f}-{max(rs):.3f}]"

    phases = [
        "",
        "Where the time goes (median ms per step: zero_grad | forward and backward | optimizer "
        "step; under torchft, zero_grad starts the quorum and the step asks should_commit):",
        "",
        "| model | variant | zero_grad | forward + backward | step |",
        "|---|---|---:|---:|---:|",
    ]
    for model, per in results.items():
        med = {
            v: [statistics.median(step[0] for step in block) * 1e3 for block in per[v]]
            for v in VARIANTS
        }
        for v in VARIANTS:
            cols = [
                statistics.median(step[k] for block in per[v] for step in block) * 1e3
                for k in (1, 2, 3)
            ]
            phases.append(f"| {model} | {v} | " + " | ".join(f"{c:.1f}" for c in cols) + " |")
        lines.append(
            f"| {model} | {statistics.median(med['gradsync']):.1f} "
            f"| {statistics.median(med['gradsync.ft']):.1f} "
            f"| {statistics.median(med['torchft DDP']):.1f} "
            f"| {paired(med, 'gradsync.ft', 'torchft DDP')} "
            f"| {paired(med, 'gradsync.ft', 'gradsync')} "
            f"| {paired(med, 'gradsync', 'gradsync A/A')} |"
        )
    return "\n".join(lines + phases)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--link", default="2gbit")
    p.add_argument("--models", default="residual_mlp,gpt_16mib")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=4.0,
        help=(
            "every variant's cap (the default 25 MiB leaves "
            "a 14 MiB model two buckets: little to overlap)"
        ),
    )
    p.add_argument(
        "--out", type=Path, help="also write the table and the raw times here (.md, .json)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--addresses", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    from gradsync.testing import kill_process_tree
    from gradsync.tools.cluster import EmulatedCluster

    lighthouse = str(Path(sys.executable).parent / "torchft_lighthouse")
    logs = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]  # torchft logs every step
    with EmulatedCluster(hosts=2, link=args.link) as cluster:
        addresses = ",".join(h.address for h in cluster.hosts)
        procs = [
            subprocess.Popen(
                cluster.command(
                    0,
                    [
                        lighthouse,
                        "--min_replicas",
                        "2",
                        "--bind",
                        f"{cluster.hosts[0].address}:{LIGHTHOUSE_PORT}",
                    ],
                ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        ]
        try:
            time.sleep(0.5)
            for i in range(2):
                argv = [
                    sys.executable,
                    __file__,
                    "--worker",
                    "--rank",
                    str(i),
                    "--addresses",
                    addresses,
                    "--models",
                    args.models,
                    "--rounds",
                    str(args.rounds),
                    "--steps",
                    str(args.steps),
                    "--bucket-cap-mb",
                    str(args.bucket_cap_mb),
                ]
                procs.append(
                    subprocess.Popen(
                        cluster.command(i, argv),
                        stdout=logs[i],
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env={**os.environ, **cluster.env(i)},
                    )
                )
            procs[1].wait(1800)
            procs[2].wait(120)
        finally:
            for proc in procs:
                kill_process_tree(proc.pid)
    logs[0].seek(0)
    out = logs[0].read().decode(errors="replace")
    found = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if not found:
        print(out[-6000:], file=sys.stderr)
        return 1
    results = json.loads(found[0].removeprefix("RESULT "))
    text = table(results, args.link, args.steps, args.bucket_cap_mb)
    print("\n".join(line for line in out.splitlines() if line.startswith(("[", "|", " "))))
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
