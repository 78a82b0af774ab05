"""`gradsync probe`: describe this machine's process group by measurement, for `gradsync simulate`.

Run on the ranks of interest (`gradsync probe --nproc N`, or under torchrun on several hosts),
it writes two files to `--out`:

* `load-N.json`: `planner.probe_under_load` (what an all-reduce adds to a step while every rank
  computes on the CPU, and how a synchronised step stretches), for `--load-probes`;
* `idle-N.json`: the idle all-reduce cost, and the ring network it amounts to (bandwidth and
  latency for `--bandwidth` / `--latency`).

Probe with the intra-op threads training uses (`--threads`): on a CPU host they decide whether
the cores are saturated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from .planner import probe_cost_model, probe_sizes, probe_under_load
from .simulate import Network

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """`gradsync probe`'s options (the CLI reference in the docs is generated from this)."""
    p = argparse.ArgumentParser(prog="gradsync probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/probes", help="folder for load-N.json and idle-N.json")
    p.add_argument("--gradient-mib", type=float, default=64.0,
                   help="largest message probed, in MiB: your model's gradient size (default 64)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per rank, as in training (default: torch's default)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.gradient_mib <= 0 or (args.threads is not None and args.threads < 1):
        p.error(
            "--gradient-mib must be > 0 and --threads >= 1, "
            f"got {args.gradient_mib} and {args.threads}"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    try:
        group = dist.group.WORLD
        assert group is not None
        sizes = probe_sizes(int(args.gradient_mib * 2**20))
        idle = probe_cost_model(group, sizes=sizes)
        load = probe_under_load(group, sizes=sizes)
        n = dist.get_world_size()
        if dist.get_rank() == 0:
            out = Path(args.out)
            network = Network.from_cost(idle, n) if n > 1 else None
            idle_fields = {"ranks": n, "alpha_ms": idle.alpha_ms,
                           "beta_ms_per_byte": idle.beta_ms_per_byte}
            if network is not None:
                idle_fields |= {"ring_bandwidth_gbps": network.bandwidth_gbps,
                                "ring_latency_us": network.latency_us}
            out.mkdir(parents=True, exist_ok=True)
            (out / f"idle-{n}.json").write_text(json.dumps(idle_fields, indent=1))
            load.save(out / f"load-{n}.json")
            print(f"{n} ranks, {torch.get_num_threads()} threads each")
            print(f"idle all-reduce: {idle.alpha_ms:.3f} ms + "
                  f"{idle.beta_ms_per_byte * 2**20:.3f} ms/MiB"
                  + (f" (a ring of {network.bandwidth_gbps:.2f} GB/s, "
                     f"{network.latency_us:.1f} us)" if network else ""))
            print(f"under load: {load.cost.alpha_ms:.3f} ms + "
                  f"{load.cost.beta_ms_per_byte * 2**20:.3f} ms/MiB; "
                  f"a synchronised step of {load.compute_ms:.2f} ms compute takes "
                  f"{load.step_ms:.2f} ms")
            print(f"written: {out / f'idle-{n}.json'}, {out / f'load-{n}.json'}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
