"""Check `gradsync simulate` against real runs at 2, 3 and 4 ranks on this machine.

    python benchmarks/validate_simulator.py            # writes out/simulator/validation.md

For each world size a torchrun job (gloo on 127.0.0.1) trains each model with gradsync's default
layout and records its timing profile (`gradsync.planning.simulate.timing_profile`, every rank's,
the slowest kept), probes the all-reduce cost idle (`probe_cost_model`) and under load
(`probe_under_load`), then measures three wrappers that differ only in their layout: default,
planned (the simulator's plan for this run) and no overlap (one bucket, launched when the last
gradient is ready). They run interleaved, in rounds whose first step is dropped; a layout's time is
the slowest rank's median step, forward start to gradients written back. The whole validation is
repeated (`--repeat`) to show the noise: the median difference between two repeats' measurements of
the same case is reported as the noise floor.

Three predictions are compared with what was measured:

* 2-rank profile, machine probed: the profile of the 2-rank run (one core per rank) and the
  probes of the rank count predicted: a model profiled once, on a machine described by
  measurement, as the simulator is meant to be used;
* same run: the profile and probes of the run predicted (at 3 and 4 ranks the profile itself was
  recorded on oversubscribed cores);
* all from 2 ranks: only the 2-rank profile and idle probe, extrapolated with the ring formula and
  a fair-share stretch: can the network model alone predict scaling it has not seen?

All describe this machine as one host of `os.cpu_count()` cores shared by every rank, with
gloo's collectives on those cores (`Host(cpu_collectives=True)`).

Network mode, on the emulated cluster (`gradsync.tools.cluster`; needs root):

    python benchmarks/validate_simulator.py --cluster  # writes out/simulator-cluster/validation.md

One rank per host, gloo over tbf-shaped links. The reference case, 2 hosts at 2gbit, records each
model's profile, idle probe (`Network.from_cost(cost, ranks=2)`) and contention (how much an
all-reduce in flight slows compute beside it, `measure_contention`: the links are the kernel's,
on this machine's cores), and measures the three layouts; then 2 hosts at each `--links` rate
and each `--hosts` count at 2gbit are measured, each on a cluster built for it, their planned
layout the one the simulator plans for them from the reference. Every case is predicted from
the reference alone: the bandwidth scaled by the rate, the ring formula for the host count,
compute stretched by hosts / cores where hosts outnumber this machine's cores, the contention's
CPU per GB/s kept (`Host.with_contention`). `--from-json` on its validation.json redoes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve()
LAYOUTS = ("default", "planned", "no overlap")
LOOPBACK_MODELS = "wide_mlp,tiny_gpt,convnet"
# --cluster: models sized for a slow network (gradsync.tools.benchsuite), the reference case (its
# profile and probe predict every case), and the defaults sized for about 15 minutes in all.
CLUSTER_MODELS = "residual_mlp,gpt_16mib"
REFERENCE = (2, "2gbit")
CLUSTER_STEPS, CLUSTER_ROUNDS, CLUSTER_REPEAT = 8, 3, 2


# ------------------------------------------------------------------ worker (under torchrun)


def _host(ranks: int):
    """This machine, as the simulator sees it: every rank on one host of `os.cpu_count()` cores,
    gloo's collectives on those cores."""
    from gradsync.planning.simulate import Host

    return Host(ranks=ranks, cores=os.cpu_count() or 1, cpu_collectives=True)


def _cluster_host(
    hosts: int, cores: int | None = None, share: float = 0.0, bandwidth_gbps: float = 1.0
):
    """The emulated cluster as the simulator sees it: one rank per host, gloo waiting on the
    link rather than the CPU (`cpu_collectives=False`: never saturated). But every host is a
    namespace of this one machine: they all share its `cores`, so with more hosts than cores
    compute stretches by hosts / cores (the `Host` is the machine, its ranks the hosts). And the
    links are the kernel's, on those same cores: `share`, a `measure_contention` share measured
    at `hosts` hosts over links of `bandwidth_gbps`, says how much of them a collective in
    flight takes (`Host.with_contention`)."""
    from gradsync.planning.simulate import Host

    host = Host(ranks=hosts, cores=cores or os.cpu_count() or 1, cpu_collectives=False)
    return host.with_contention(share, hosts, bandwidth_gbps) if share > 0 else host


def _contention_bytes(total: int) -> int:
    """The all-reduce `measure_contention` times: the gradients' size, as `AutoBuckets` does."""
    return min(max(total, 1 << 20), 16 << 20)


def _measure_model(name: str, steps: int, rounds: int, cluster: bool = False,
                   planned: list[list[str]] | None = None) -> dict:
    """One model's profile, probes and measured layouts. `cluster`: on the emulated cluster (one
    rank per host, no load probe, planned for an unsaturated host); `planned`: the planned
    layout to measure, as parameter names per bucket (None: plan it from this run)."""
    from gradsync import DistributedDataParallel
    from gradsync.planning.planner import (
        measure_contention,
        probe_cost_model,
        probe_sizes,
        probe_under_load,
    )
    from gradsync.planning.simulate import Network, Profile, simulate, timing_profile
    from gradsync.tools.benchsuite import MODELS, _loss

    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    make_input = MODELS[name]()[1]
    batches = [make_input(g) for _ in range(4)]

    def build(wrap):
        torch.manual_seed(0)
        return wrap(MODELS[name]()[0])

    # Three wrappers that differ only in their bucket layout.
    layouts = {k: build(DistributedDataParallel) for k in LAYOUTS}
    default = layouts["default"]

    def run(layout: str, n: int) -> list[float]:
        model, times = layouts[layout], []
        for i in range(n):
            model.zero_grad()
            start = time.perf_counter()
            _loss(model(batches[i % 4])).backward()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    # The profile: gradsync's default layout, every rank's timings, the slowest rank's kept.
    run("default", 6)
    run("default", steps)
    profiles: list = [None] * world
    dist.all_gather_object(profiles, timing_profile(default.reducer, window=steps))
    profile = Profile.slowest(profiles)
    sizes = probe_sizes(sum(profile.nbytes))
    cost = probe_cost_model(dist.group.WORLD, sizes=sizes, repeats=5)  # type: ignore[arg-type]
    # The planned layout is the one the simulator plans (and prices) for this run, unless given;
    # no overlap is one bucket, launched when the last gradient is ready.
    load = contention = None
    if cluster:  # how much of the cores an all-reduce in flight takes from compute
        contention = measure_contention(
            dist.group.WORLD,  # type: ignore[arg-type]
            _contention_bytes(sum(profile.nbytes)),
            repeats=7,
        )
    if planned is None:
        if cluster:
            network = Network.from_cost(cost, world)
            host = _cluster_host(world, None, contention.share, network.bandwidth_gbps)  # type: ignore[union-attr]
            (prediction,) = simulate(profile, network, [world], host)
        else:
            load = probe_under_load(dist.group.WORLD, sizes=sizes)  # type: ignore[arg-type]
            (prediction,) = simulate(
                profile, Network.from_cost(cost, world), [world], _host(world), {world: load}
            )
        planned = [[profile.names[p] for p in b] for b in prediction.planned_layout]
    index = {n: i for i, n in enumerate(default.reducer.names)}
    layouts["planned"].reducer.install_layout([[index[n] for n in b] for b in planned])
    layouts["no overlap"].reducer.install_layout([list(range(len(index)))])

    # Measured in rounds, the layouts interleaved (order rotating), each round's first step dropped.
    samples: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    for r in range(rounds):
        for layout in LAYOUTS[r % 3:] + LAYOUTS[: r % 3]:
            samples[layout] += run(layout, steps + 1)[1:]
    agreed = torch.tensor([statistics.median(samples[k]) for k in LAYOUTS], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    result = {
        "measured_ms": dict(zip(LAYOUTS, agreed.tolist())),
        "profile": {**profile.__dict__},
        "cost": [cost.alpha_ms, cost.beta_ms_per_byte],
        "planned_buckets": len(planned),
    }
    if load is not None:
        result["load"] = {
            "cost": [load.cost.alpha_ms, load.cost.beta_ms_per_byte],
            "compute_ms": load.compute_ms,
            "step_ms": load.step_ms,
        }
    if contention is not None:
        result["contention"] = {
            "compute_ms": contention.compute_ms,
            "allreduce_ms": contention.allreduce_ms,
            "together_ms": contention.together_ms,
            "share": contention.share,
        }
    if cluster:
        result["planned_layout"] = planned
    return result


def worker(models: list[str], steps: int, rounds: int, out: str, cluster: bool = False,
           layouts: str | None = None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    planned = json.loads(Path(layouts).read_text()) if layouts else {}
    try:
        results = {m: _measure_model(m, steps, rounds, cluster, planned.get(m)) for m in models}
        if dist.get_rank() == 0:
            Path(out).write_text(
                json.dumps({"world_size": dist.get_world_size(), "models": results})
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver


def _load(run: dict, ranks: int):
    from gradsync.planning.planner import CostModel, LoadProbe

    if "load" not in run:  # measured before loaded probes existed
        return None
    load = run["load"]
    return LoadProbe(ranks, CostModel(*load["cost"]), load["compute_ms"], load["step_ms"])


def _profile(run: dict):
    from gradsync.planning.simulate import Profile

    p = run["profile"]
    return Profile(
        p["forward_ms"],
        tuple(p["ready_ms"]),
        tuple(p["nbytes"]),
        tuple(p["names"]),
        p["world_size"],
        p.get("fill_ms_per_byte", 0.0),
        p.get("tail_ms", 0.0),
    )


def predict(source: dict, ranks: int, host, target: dict | None) -> dict[str, float]:
    """Predict `ranks` ranks from `source` (a model's run: profile and probes). `target`: the
    same model's run at `ranks`, whose probes describe the machine there (None: extrapolate
    the source's network and the fair-share stretch)."""
    from gradsync.planning.planner import CostModel
    from gradsync.planning.simulate import Network, simulate

    profile = _profile(source)
    loads = {}
    if target is not None:
        network = Network.from_cost(CostModel(*target["cost"]), ranks)
        loads = {r: load for r, run in ((profile.world_size, source), (ranks, target))
                 if (load := _load(run, r)) is not None}
    else:
        network = Network.from_cost(CostModel(*source["cost"]), profile.world_size)
    (pred,) = simulate(profile, network, [ranks], host, loads)
    return {
        "default": pred.default_ms,
        "planned": pred.planned_ms,
        "no overlap": pred.no_overlap_ms,
    }


MODES = {
    "2-rank profile, machine probed": (
        "the 2-rank run's profile; the probes of the predicted rank count"
    ),
    "same run": (
        "the profile and probes of the run predicted (at 3 and 4 ranks "
        "the profile was recorded on oversubscribed cores, "
        "where a rank's own timings already hold part of the stretch, unevenly)"
    ),
    "all from 2 ranks": (
        "the 2-rank run's profile and idle probe, extrapolated (ring formula, fair-share stretch)"
    ),
}


def _predictions(runs: dict[int, dict], host) -> dict[tuple[str, int, str, str], float]:
    """(model, ranks, layout, mode) -> predicted ms, for one repeat's runs."""
    out = {}
    for n, run in runs.items():
        for model, data in run["models"].items():
            two = runs[2]["models"][model] if 2 in runs else None
            sources = {
                "2-rank profile, machine probed": (two, data),
                "same run": (data, data),
                "all from 2 ranks": (two, None) if n != 2 else (None, None),
            }
            for mode, (source, target) in sources.items():
                if source is None:
                    continue
                for layout, ms in predict(source, n, host, target).items():
                    out[(model, n, layout, mode)] = ms
    return out


def report(
    repeats: list[dict[int, dict]],
) -> tuple[str, dict[str, list[float]], list[dict[str, float]], float]:
    """The table (medians over repeats), the absolute relative errors per prediction mode
    (every repeat's prediction against that repeat's measurement), each repeat's median error
    per mode, and the noise floor: the median |a / b - 1| between two repeats' measurements of
    the same case, the error a perfect simulator fed one repeat would show on another."""
    host = _host(max(max(r) for r in repeats))
    predicted = [_predictions(r, host) for r in repeats]
    errors: dict[str, list[float]] = {m: [] for m in MODES}
    per_repeat: list[dict[str, float]] = []
    noise = []
    lines = [
        f"Host: {os.cpu_count()} cores shared by all ranks; torch {torch.__version__}, "
        f"gloo on 127.0.0.1; {len(repeats)} independent repeats, medians shown.",
        "",
        "| model | ranks | layout | measured ms (min-max) | "
        + " | ".join(f"{m}: predicted (error)" for m in MODES)
        + " |",
        "|---|---:|---|---:|" + "---:|" * len(MODES),
    ]
    for runs, pred in zip(repeats, predicted):
        mine: dict[str, list[float]] = {m: [] for m in MODES}
        for (model, n, layout, mode), ms in pred.items():
            mine[mode].append(abs(ms / runs[n]["models"][model]["measured_ms"][layout] - 1))
        for mode, e in mine.items():
            errors[mode] += e
        per_repeat.append({mode: statistics.median(e) for mode, e in mine.items() if e})
    first = repeats[0]
    for model in first[min(first)]["models"]:
        for n in sorted(first):
            for layout in LAYOUTS:
                measured = [r[n]["models"][model]["measured_ms"][layout] for r in repeats]
                noise += [abs(a / b - 1) for i, a in enumerate(measured) for b in measured[i + 1 :]]
                m = statistics.median(measured)
                cells = []
                for mode in MODES:
                    guesses = [
                        p[(model, n, layout, mode)]
                        for p in predicted
                        if (model, n, layout, mode) in p
                    ]
                    if not guesses:
                        cells.append("-")
                        continue
                    g = statistics.median(guesses)
                    cells.append(f"{g:.2f} ({g / m - 1:+.0%})")
                lines.append(
                    (
                        f"| {model} | {n} | {layout} | {m:.2f} "
                        f"({min(measured):.1f}-{max(measured):.1f}) | "
                    )
                    + " | ".join(cells)
                    + " |"
                )
    return "\n".join(lines), errors, per_repeat, statistics.median(noise) if noise else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cluster", action="store_true",
                    help="network mode: on emulated hosts (gradsync.tools.cluster), one rank each")
    ap.add_argument("--ranks", default="2,3,4", help="loopback mode: rank counts (default 2,3,4)")
    ap.add_argument(
        "--links",
        default="1gbit,2gbit,4gbit",
        help=(
            "--cluster: link rates at 2 hosts (default 1gbit,2gbit,4gbit; "
            f"{REFERENCE[1]} is the reference)"
        ),
    )
    ap.add_argument(
        "--hosts",
        default="3",
        help=f"--cluster: host counts also measured, at {REFERENCE[1]} (default 3)",
    )
    ap.add_argument("--models", default=None,
                    help=f"default: {LOOPBACK_MODELS}; with --cluster, {CLUSTER_MODELS}")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps per layout per round (at most 16; default 12, --cluster {CLUSTER_STEPS})",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"rounds, the layouts interleaved (default 4, --cluster {CLUSTER_ROUNDS})",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=None,
        help=f"independent repeats of the whole validation (default 3, --cluster {CLUSTER_REPEAT})",
    )
    ap.add_argument(
        "--out",
        default=None,
        help=(
            "folder for validation.md and .json (default out/simulator, --cluster "
            "out/simulator-cluster; a run kept goes to docs/benchmarks/data/DATE-NAME, with "
            "its page docs/benchmarks/DATE-NAME.md)"
        ),
    )
    ap.add_argument(
        "--case-timeout",
        type=float,
        default=600.0,
        help="--cluster: seconds before one case's run is killed on every host (default 600)",
    )
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--layouts", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument(
        "--from-json", help="report on the measurements of an earlier run (validation.json)"
    )
    args = ap.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        args.cluster = isinstance(data, dict) and data.get("mode") == "cluster"
    defaults = (
        (CLUSTER_MODELS, CLUSTER_STEPS, CLUSTER_ROUNDS, CLUSTER_REPEAT, "out/simulator-cluster")
        if args.cluster
        else (LOOPBACK_MODELS, 12, 4, 3, "out/simulator")
    )
    for field, value in zip(("models", "steps", "rounds", "repeat", "out"), defaults):
        if getattr(args, field) is None:
            setattr(args, field, value)
    models = args.models.split(",")
    if args.worker:
        worker(models, args.steps, args.rounds, args.worker, args.cluster, args.layouts)
        return
    out = Path(args.out)
    if args.cluster:
        if not args.from_json:
            data = {
                "mode": "cluster",
                "reference": list(REFERENCE),
                "cores": os.cpu_count() or 1,
                "torch": torch.__version__,
                "repeats": [measure_cluster(args) for _ in range(args.repeat)],
            }
        text = cluster_report(data)
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.md").write_text(text)
        (out / "validation.json").write_text(json.dumps(data))
        print(text)
        return
    if args.from_json:
        repeats = [
            {int(k): v for k, v in r.items()} for r in (data if isinstance(data, list) else [data])
        ]
    else:
        repeats = [measure(args) for _ in range(args.repeat)]
    table, errors, per_repeat, noise = report(repeats)
    summary = "\n".join(
        f"- {mode}: median error {statistics.median(e):.0%}, max {max(e):.0%}, "
        f"{sum(x <= 0.15 for x in e)} of {len(e)} predictions within 15 % (median per repeat: "
        f"{', '.join(f'{r[mode]:.0%}' for r in per_repeat)})"
        for mode, e in errors.items() if e
    )
    out.mkdir(parents=True, exist_ok=True)
    modes = "\n".join(f"- {mode}: {what}" for mode, what in MODES.items())
    text = (
        f"# Simulator against real runs\n\n`{' '.join(['python', *sys.argv])}`\n\nPredictions "
        f"from:\n\n{modes}\n\n{table}\n\nPrediction error, |predicted / measured - 1|, "
        f"every repeat's prediction against its own measurement:\n\n{summary}\n\nNoise floor: "
        f"two repeats' measurements of the same case differ by {noise:.0%} (median |a / b - 1|).\n"
    )
    (out / "validation.md").write_text(text)
    (out / "validation.json").write_text(json.dumps(repeats))
    print(text)


# ------------------------------------------------------------------ driver, network mode


def _same_case(a: tuple[int, str], b: tuple[int, str]) -> bool:
    from gradsync.tools.cluster import parse_rate

    return a[0] == b[0] and parse_rate(a[1]) == parse_rate(b[1])


def cluster_cases(links: str, hosts: str) -> list[tuple[int, str]]:
    """(hosts, link) measured, the reference first: 2 hosts at each rate, then each host count
    at the reference rate."""
    cases = [REFERENCE]
    for case in [(2, link) for link in links.split(",") if link] + [
        (int(h), REFERENCE[1]) for h in hosts.split(",") if h
    ]:
        if not any(_same_case(case, c) for c in cases):
            cases.append(case)
    return cases


CLUSTER_MODES = {
    "network + contention": (
        "the reference's network, and the share of the cores a collective in flight took "
        "there (`measure_contention`, as CPU per GB/s of link: `Host.with_contention`)"
    ),
    "network only": (
        "the reference's network alone (collectives hide behind compute, taking no CPU)"
    ),
}


def cluster_predict(
    reference: dict, model: str, hosts: int, link: str, cores: int, contended: bool = True
):
    """`model` on `hosts` hosts at `link`, from the reference run alone: its profile (slowest
    rank) and idle probe as a ring network, the bandwidth scaled by the link rate over the
    reference's (latency kept), compute stretched where hosts outnumber the machine's cores;
    `contended`: with the CPU a collective in flight took there. Returns the prediction, the
    network and the host it used."""
    from dataclasses import replace

    from gradsync.planning.planner import CostModel
    from gradsync.planning.simulate import Network, simulate
    from gradsync.tools.cluster import parse_rate

    run = reference["models"][model]
    base = Network.from_cost(CostModel(*run["cost"]), reference["world_size"])
    network = replace(
        base, bandwidth_gbps=base.bandwidth_gbps * parse_rate(link) / parse_rate(reference["link"])
    )
    share = run.get("contention", {}).get("share", 0.0) if contended else 0.0
    measured = _cluster_host(reference["world_size"], cores, share, base.bandwidth_gbps)
    host = replace(_cluster_host(hosts, cores), comm_cores_per_gbps=measured.comm_cores_per_gbps)
    (prediction,) = simulate(_profile(run), network, [hosts], host)
    return prediction, network, host


def measure_cluster(args: argparse.Namespace) -> list[dict]:
    """One repeat: every case on a cluster built for it. The reference runs first; every other
    case measures, as its planned layout, the one the simulator plans for it from the reference."""
    from gradsync.tools.cluster import EmulatedCluster

    runs: list[dict] = []
    models = args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for hosts, link in cluster_cases(args.links, args.hosts):
            path = os.path.join(tmp, f"{hosts}-{link}.json")
            argv = [str(HERE), "--cluster", "--models", args.models, "--steps", str(args.steps),
                    "--rounds", str(args.rounds), "--worker", path]
            if runs:
                reference, layouts = runs[0], {}
                for m in models:
                    prediction, _, _ = cluster_predict(
                        reference, m, hosts, link, os.cpu_count() or 1
                    )
                    names = _profile(reference["models"][m]).names
                    layouts[m] = [[names[p] for p in b] for b in prediction.planned_layout]
                Path(tmp, "layouts.json").write_text(json.dumps(layouts))
                argv += ["--layouts", os.path.join(tmp, "layouts.json")]
            start = time.monotonic()
            with EmulatedCluster(hosts=hosts, link=link) as cluster:
                done = cluster.torchrun(argv, nproc_per_host=1, timeout=args.case_timeout)
            if not os.path.exists(path):
                outputs = "\n".join(
                    f"--- host {i} (exit {d.returncode}):\n{d.stdout[-2000:]}"
                    for i, d in enumerate(done)
                )
                raise SystemExit(f"{hosts} hosts at {link} failed:\n{outputs}")
            run = {**json.loads(Path(path).read_text()), "hosts": hosts, "link": link,
                   "seconds": time.monotonic() - start}
            runs.append(run)
            print(f"measured {hosts} hosts at {link} ({run['seconds']:.0f} s)", flush=True)
    return runs


def cluster_report(data: dict) -> str:
    """validation.md for the network mode: every case's measured and predicted step per layout
    (medians over repeats), the errors (every repeat's prediction against its own measurement),
    the noise floor, and what the prediction assumed (compute, whole-gradient all-reduce,
    contention) next to what each case's own run measured."""
    from gradsync.planning.planner import CostModel

    reference, cores, repeats = tuple(data["reference"]), data["cores"], data["repeats"]
    cases = [(r["hosts"], r["link"]) for r in repeats[0]]
    models = list(repeats[0][0]["models"])

    def find(runs: list[dict], case: tuple[int, str]) -> dict:
        return next(r for r in runs if _same_case((r["hosts"], r["link"]), case))

    measured: dict[tuple, list[float]] = {}
    predicted: dict[tuple, list[float]] = {}
    checks: dict[tuple, list[tuple[float, ...]]] = {}
    errors: dict[tuple[str, str], list[float]] = {}
    per_repeat: dict[str, list[float]] = {mode: [] for mode in CLUSTER_MODES}
    for runs in repeats:
        ref, mine = find(runs, reference), {mode: [] for mode in CLUSTER_MODES}
        for case in cases:
            run, which = (
                find(runs, case),
                "reference case" if _same_case(case, reference) else "extrapolated",
            )
            for m in models:
                data_m = run["models"][m]
                for mode in CLUSTER_MODES:
                    prediction, network, host = cluster_predict(
                        ref, m, case[0], case[1], cores, mode != "network only"
                    )
                    guesses = (
                        prediction.default_ms,
                        prediction.planned_ms,
                        prediction.no_overlap_ms,
                    )
                    for layout, guess in zip(LAYOUTS, guesses):
                        got = data_m["measured_ms"][layout]
                        predicted.setdefault((m, case, layout, mode), []).append(guess)
                        error = abs(guess / got - 1)
                        errors.setdefault((mode, which), []).append(error)
                        mine[mode].append(error)
                for layout in LAYOUTS:
                    measured.setdefault((m, case, layout), []).append(data_m["measured_ms"][layout])
                prediction, network, host = cluster_predict(ref, m, case[0], case[1], cores, True)
                own, total = _profile(data_m), sum(_profile(data_m).nbytes)
                checks.setdefault((m, case), []).append((
                    own.forward_ms + own.backward_ms, prediction.compute_ms,
                    CostModel(*data_m["cost"]).time_ms(total), network.cost(case[0]).time_ms(total),
                    data_m.get("contention", {}).get("share", float("nan")),
                    host.contention(case[0], network.bandwidth_gbps), data_m["planned_buckets"]))
        for mode, e in mine.items():
            per_repeat[mode].append(statistics.median(e))
    noise = [abs(a / b - 1) for v in measured.values() for i, a in enumerate(v) for b in v[i + 1:]]

    rows = ["| model | hosts | link | layout | measured ms (min-max) | "
            + " | ".join(f"{mode}: predicted (error)" for mode in CLUSTER_MODES) + " |",
            "|---|---:|---|---|---:|" + "---:|" * len(CLUSTER_MODES)]
    for m in models:
        for case in cases:
            for layout in LAYOUTS:
                got = measured[(m, case, layout)]
                mid = statistics.median(got)
                cells = []
                for mode in CLUSTER_MODES:
                    guess = statistics.median(predicted[(m, case, layout, mode)])
                    cells.append(f"{guess:.1f} ({guess / mid - 1:+.0%})")
                rows.append(
                    (
                        f"| {m} | {case[0]} | {case[1]} | {layout} | "
                        f"{mid:.1f} ({min(got):.1f}-{max(got):.1f}) | "
                    )
                    + " | ".join(cells)
                    + " |"
                )
    table = [
        "| model | hosts | link | compute ms: own profile / predicted | whole-gradient all-reduce "
        "ms: probed there / predicted | contention: measured there / predicted | planned buckets |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for m in models:
        for case in cases:
            d = [statistics.median(x) for x in zip(*checks[(m, case)])]
            table.append(
                f"| {m} | {case[0]} | {case[1]} | {d[0]:.1f} / {d[1]:.1f} | "
                f"{d[2]:.1f} / {d[3]:.1f} | {d[4]:.2f} / {d[5]:.2f} | {d[6]:.0f} |"
            )
    summary = []
    for mode in CLUSTER_MODES:
        every = errors[(mode, "reference case")] + errors.get((mode, "extrapolated"), [])
        parts = [
            f"all {statistics.median(every):.0%} (max {max(every):.0%}, "
            f"{sum(x <= 0.15 for x in every)} of {len(every)} within 15 %)"
        ]
        parts += [
            f"{which} {statistics.median(e):.0%}"
            for which in ("reference case", "extrapolated")
            if (e := errors.get((mode, which)))
        ]
        summary.append(f"- {mode}: median error {', '.join(parts)}; median per repeat "
                       f"{', '.join(f'{e:.0%}' for e in per_repeat[mode])}")
    floor = (
        f"{statistics.median(noise):.0%} (median |a / b - 1|)"
        if noise
        else "not measured (one repeat)"
    )
    modes = "\n".join(f"- {mode}: {what}" for mode, what in CLUSTER_MODES.items())
    ref = f"{reference[0]} hosts at {reference[1]}"
    return f"""# Simulator against the emulated cluster (network mode)

`{' '.join(['python', *sys.argv])}`

Each case runs on an emulated cluster built for it (`gradsync.tools.cluster.EmulatedCluster`:
one network namespace per host on a bridge, every link shaped with tbf to the rate in both
directions), one rank per host, gloo over the links; torch {data.get("torch", "?")}, {cores} cores.
A run records each model's timing profile with gradsync's default layout (every rank's, the
slowest kept), the idle all-reduce cost (`probe_cost_model`) and how much an all-reduce of the
gradients' size slows compute running beside it (`measure_contention`), then measures three
layouts interleaved in rounds (first step of each dropped; a layout's time is the slowest
rank's median step, forward start to gradients written back): default, planned and no overlap
(one bucket after backward).

Every prediction comes from the reference run alone ({ref}): its profile, and its probe as a
ring network (`Network.from_cost(cost, ranks=2)`); another rate scales that network's
bandwidth by rate / {reference[1]}, keeping its latency; another host count uses the ring
formula. The planned layout measured in a case is the one the simulator plans for it from the
reference. Hosts are not saturated: each runs one rank, and gloo's transfers wait on the link
(`Host(cpu_collectives=False)`). But all the namespaces share this machine's {cores} cores: the
simulator's `Host` is the machine, holding every host's rank (`Host(ranks=hosts, cores={cores})`),
so compute stretches by hosts / cores where hosts outnumber cores (1.5x at 3 hosts on 2 cores,
none at 2 hosts). And the links are the kernel's, on those same cores: moving a link's bytes
takes CPU from compute. Two predictions:

{modes}

The contention's CPU per GB/s is taken as fixed, so the share of compute it takes grows with
the link rate and, once hosts outnumber cores, with the host count (`Host.contention`).
{len(repeats)} independent repeats (each with its own reference run), medians shown.

{chr(10).join(rows)}

Prediction error, |predicted / measured - 1|, every repeat's prediction against its own
measurement (the reference case is the run the prediction came from):

{chr(10).join(summary)}

Noise floor: two repeats' measurements of the same case differ by {floor}.

What the predictions assumed (network + contention), next to what each case's own run measured
(medians over repeats): compute is forward plus backward in the run's own profile (recorded with
the default layout); the all-reduce is of the whole gradient, by the run's own idle probe and by
the network model; contention is the share of compute speed an all-reduce of the gradients' size
in flight takes.

{chr(10).join(table)}
"""


def measure(args: argparse.Namespace) -> dict[int, dict]:
    from gradsync.testing import run_torchrun

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(r) for r in args.ranks.split(",")):
            path = os.path.join(tmp, f"{n}.json")
            result = run_torchrun(
                str(HERE),
                n,
                [
                    "--models",
                    args.models,
                    "--steps",
                    str(args.steps),
                    "--rounds",
                    str(args.rounds),
                    "--worker",
                    path,
                ],
                timeout=900,
            )
            if not os.path.exists(path):
                raise SystemExit(f"{n} ranks failed:\n{result.stdout[-3000:]}")
            runs[n] = json.loads(Path(path).read_text())
            print(f"measured {n} ranks", flush=True)
    return runs


if __name__ == "__main__":
    main()
