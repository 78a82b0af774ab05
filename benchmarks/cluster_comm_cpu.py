"""What an all-reduce costs the machine's CPUs on the emulated cluster, link rate by link rate.

For each rate, two hosts (root only), one rank each, gloo: back-to-back all-reduces of each size
for a few seconds, the machine's busy CPU time from /proc/stat less its idle baseline
(`gradsync.planning.planner.measure_comm_cpu`, the bench's "links' CPU"). Prints one markdown
row per rate and size: wall time and CPU time per all-reduce, every core together.

    sudo .venv/bin/python benchmarks/cluster_comm_cpu.py  # 1, 2, 4 Gbit/s, unshaped
    sudo .venv/bin/python benchmarks/cluster_comm_cpu.py --links 2gbit,none --sizes 16

Why: overlap hides an all-reduce's wall time, not the CPU it takes from compute. On this machine
every host's network stack shares the cores that compute, and a slower link costs more CPU per
byte (the figures: docs/benchmarks/2026-12-03-comm-cpu-by-rate.md and, with 256 KiB packets,
docs/benchmarks/2026-12-04-comm-cpu-bigtcp.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

MIB = 2**20


def worker(args: argparse.Namespace) -> None:
    from gradsync.planning.planner import measure_comm_cpu

    dist.init_process_group("gloo")
    for mib in (float(s) for s in args.sizes.split(",")):
        cost = measure_comm_cpu(dist.group.WORLD, int(mib * MIB), seconds=args.seconds)  # type: ignore[arg-type]
        if dist.get_rank() == 0 and cost is not None:
            print(
                f"ROW | {args.label} | {mib:g} | {cost.allreduce_ms:.1f} | {cost.busy_ms:.1f} |",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--links", default="1gbit,2gbit,4gbit,none", help="rates; `none` leaves the link unshaped"
    )
    parser.add_argument("--sizes", default="2,16", help="all-reduce sizes in MiB")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each size runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    from gradsync.tools.cluster import EmulatedCluster

    print(
        "| link | MiB | wall ms per all-reduce | machine "
        "CPU ms per all-reduce |\n|---|---:|---:|---:|"
    )
    failed = 0
    for link in args.links.split(","):
        rate = None if link == "none" else link
        with EmulatedCluster(2, rate) as cluster:
            target = [
                __file__,
                "--worker",
                "--label",
                link,
                "--sizes",
                args.sizes,
                "--seconds",
                str(args.seconds),
            ]
            for done in cluster.torchrun(target, timeout=600, env={"OMP_NUM_THREADS": "1"}):
                rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
                if rows:
                    print("\n".join(rows), flush=True)
                if done.returncode:
                    failed += 1
                    print(done.stdout[-3000:], file=sys.stderr)
    print(
        f"\n{os.cpu_count()} cores; CPU is the whole "
        "machine's (both hosts, the bridge, tbf), less idle"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
