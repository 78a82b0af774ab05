"""The `gradsync` command line: `demo` (the demo job on local ranks), `bench` (gradsync vs
torch's DDP, side by side), `probe` (the process group measured, for the simulator) and
`simulate` (step time at scale from a recorded profile).

Ranks are started by torch's own launcher (`torch.distributed.run`), exactly as users start
their training: nothing here manages processes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

__all__ = ["build_parser", "main"]


def _run_on_ranks(args: argparse.Namespace, rest: list[str]) -> int:
    """demo, bench, probe: check the job's options once, then start it on local ranks."""
    module_name, fewest, usage = _ON_RANKS[args.command]
    module = importlib.import_module(module_name)
    if args.help:
        print(usage)
        module.parse_args(["--help"])
    parsed = module.parse_args(rest)  # bad values fail here, once, before any rank starts
    if args.command == "bench" and module.device_path(parsed):
        fewest = 1  # the device bench: a world of one is one GPU's step, with and without DDP
        if args.nproc is None and parsed.device == "cuda":
            import torch

            args.nproc = max(1, torch.cuda.device_count())  # a rank per GPU
    if args.nproc is None:
        args.nproc = 2
    if args.nproc < fewest:
        raise SystemExit(
            f"gradsync {args.command}: --nproc must be at least {fewest}, got {args.nproc}"
        )
    if getattr(args, "hosts", None):
        return _launch_on_cluster(args, module_name, rest)
    return _launch(args.nproc, module_name, rest, args.command)


def _launch_on_cluster(args: argparse.Namespace, module: str, rest: list[str]) -> int:
    """One rank per emulated host (`gradsync.tools.cluster`), each on its own shaped link."""
    from .cluster import ClusterUnavailable, EmulatedCluster

    links = args.link.split(",") if "," in args.link else args.link
    if args.command == "bench":
        rest = cluster_bench_args(rest)
    try:
        with EmulatedCluster(args.hosts, links) as cluster:
            print(f"gradsync {args.command}: on {cluster}", flush=True)
            done = cluster.torchrun(["-m", module, *rest], nproc_per_host=args.nproc_per_host,
                                    timeout=args.cluster_timeout)
    except ClusterUnavailable as e:
        raise SystemExit(f"gradsync {args.command} --hosts: {e}") from e
    print(done[0].stdout, flush=True)  # rank 0's host: the tables
    for i, proc in enumerate(done[1:], 1):
        if proc.returncode:
            print(f"--- host {i} (exit {proc.returncode}):\n{proc.stdout[-4000:]}", file=sys.stderr)
    return max(proc.returncode for proc in done)


def cluster_bench_args(rest: list[str]) -> list[str]:
    """The bench's options on a cluster: unless models are named, the ones sized for a slow
    network, where compute and communication are of one order and overlap matters."""
    if any(a == "--models" or a.startswith("--models=") for a in rest):
        return rest
    from .benchsuite import CLUSTER_MODELS

    return ["--models", ",".join(CLUSTER_MODELS), *rest]


def _launch(nproc: int, module: str, rest: list[str], what: str) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    launcher = ["--standalone", f"--nproc-per-node={nproc}", "-m", module, *rest]
    try:
        torchrun.main(launcher)
    except (KeyboardInterrupt, SignalException):
        print(
            f"\ngradsync {what}: interrupted; torch's launcher stopped every rank", file=sys.stderr
        )
        return 130
    return 0


DEMO_USAGE = """usage: gradsync demo [--nproc N] [job options]

Launches N local ranks (default 2) with torch.distributed.run and trains the demo job on them.
Job options, passed to every rank:"""

_ON_RANKS = {  # command: (module run on every rank, fewest ranks, usage)
    "demo": ("gradsync.tools.demo", 1, DEMO_USAGE),
    "bench": ("gradsync.tools.benchsuite", 2, "usage: gradsync bench [--nproc N] [bench options]\n"
              "(--nproc at least 2 for the CPU bench, 1 for the device bench)\n"),
    "probe": ("gradsync.planning.probe", 1, "usage: gradsync probe [--nproc N] [probe options]\n"),
}


_ON_RANKS_HELP = {
    "demo": "train a digit classifier on local ranks and prove the synchronisation",
    "bench": "gradsync vs torch's DDP on a benchmark set, side by side",
    "probe": "measure the process group (idle and under load) on local ranks, for simulate",
}


def build_parser() -> argparse.ArgumentParser:
    """The `gradsync` command and its subcommands; demo, bench and probe hand their own options
    to the job's parser (`build_parser` in its module). The docs' CLI reference comes from these."""
    parser = argparse.ArgumentParser(prog="gradsync", description="gradsync command line")
    parser.add_argument("--version", action="version", version=f"gradsync {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_on_ranks_commands(sub)
    _add_simulate_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in _ON_RANKS:
        return _run_on_ranks(args, rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    return _simulate(args)


def _version() -> str:
    # From the installed package's metadata: `tools` sits below the package's `__init__`, which
    # must not be imported from here (the layers point down).
    try:
        return importlib.metadata.version("gradsync")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: running from a source tree)"


def _add_on_ranks_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """demo, bench, probe: only the launcher's own options are parsed here; the rest go to
    the job on every rank, which checks them (`_run_on_ranks`)."""
    for name, help_text in _ON_RANKS_HELP.items():  # options after --nproc go to the ranks
        on_ranks = sub.add_parser(name, add_help=False, help=help_text)
        on_ranks.add_argument("--nproc", type=int, default=None,
                              help="local ranks (default 2; bench --device cuda: one per GPU)")
        on_ranks.add_argument("-h", "--help", action="store_true")
        if name == "bench":  # the emulated cluster: one host per rank, each on a shaped link
            on_ranks.add_argument("--hosts", type=int, default=0,
                                  help="run on an emulated cluster of N hosts (2-4; needs root)")
            on_ranks.add_argument(
                "--link", default="2gbit", help="each host's link rate (default 2gbit)"
            )
            on_ranks.add_argument("--nproc-per-host", type=int, default=1)
            on_ranks.add_argument("--cluster-timeout", type=float, default=3600.0)


def _add_simulate_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """simulate: runs here, in this process, with no ranks to start."""
    sim = sub.add_parser(
        "simulate",
        help="predict step time at 2..1024 ranks from a recorded timing profile",
        description="Replay a recorded timing profile (DistributedDataParallel."
        "save_timing_profile) over a modelled network: default, planned and no-overlap layouts.",
    )
    sim.add_argument("--profile", required=True, help="JSON written by save_timing_profile")
    sim.add_argument("--bandwidth", type=float, default=12.5, help="GB/s per link (default 12.5)")
    sim.add_argument(
        "--latency", type=float, default=10.0, help="microseconds per hop (default 10)"
    )
    sim.add_argument("--algorithm", choices=["ring", "tree"], default="ring")
    sim.add_argument("--ranks", default="2,4,8,16,32,64,128,256,512,1024")
    sim.add_argument("--ranks-per-host", type=int, default=1,
                     help="ranks sharing one host (default 1)")
    sim.add_argument(
        "--cores-per-host",
        type=int,
        default=None,
        help="cores per host: with more ranks than cores, compute stretches (default: enough)",
    )
    sim.add_argument("--cpu-collectives", action="store_true",
                     help="collectives run on the host's cores (gloo): on a saturated host they "
                     "add to compute instead of overlapping it")
    sim.add_argument(
        "--load-probes",
        nargs="+",
        default=[],
        metavar="JSON",
        help=(
            "probes under load (gradsync probe, or planner.probe_under_load(...).save), one per "
            "rank count, the profile's included: on a saturated host they price the step"
        ),
    )
    sim.add_argument("--out", default="out", help="folder for simulate.png (default out/)")


def _simulate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..planning.planner import LoadProbe
    from ..planning.simulate import Host, Network, Profile, markdown, plot, simulate

    try:
        ranks = [int(r) for r in args.ranks.split(",")]
        if any(r < 1 for r in ranks):
            raise ValueError
    except ValueError:
        raise SystemExit("gradsync simulate: --ranks must be positive integers, "
                         f"got {args.ranks!r}") from None
    try:
        profile = Profile.load(args.profile)
        network = Network(args.bandwidth, args.latency, args.algorithm)
        host = Host(args.ranks_per_host, args.cores_per_host, args.cpu_collectives)
        loads = {probe.ranks: probe for probe in map(LoadProbe.load, args.load_probes)}
    except (OSError, ValueError) as error:
        raise SystemExit(f"gradsync simulate: {error}") from None
    if loads and not (args.cpu_collectives and args.cores_per_host):
        raise SystemExit("gradsync simulate: --load-probes describe a host whose cores all run "
                         "ranks, with CPU collectives: add --cpu-collectives and --cores-per-host")
    if loads and profile.world_size not in loads:
        raise SystemExit("gradsync simulate: no load probe at the profile's "
                         f"{profile.world_size} ranks (have {sorted(loads)}): the stretch is "
                         "measured relative to it")
    predictions = simulate(profile, network, ranks, host, loads)
    print(f"profile: forward {profile.forward_ms:.3f} ms, backward {profile.backward_ms:.3f} ms, "
          f"{sum(profile.nbytes) / 2**20:.2f} MiB of gradients in {len(profile.nbytes)} tensors")
    print(f"network: {network.bandwidth_gbps} GB/s, {network.latency_us} us, {network.algorithm}")
    priced = [n for n in ranks if host.saturated(n) and n in loads]
    if priced:
        print(f"saturated host, priced from load probes at ranks {priced}")
    print()
    print(markdown(predictions))
    print(f"\nplot: {plot(predictions, Path(args.out) / 'simulate.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
