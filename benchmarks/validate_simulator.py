"""Check `gradsync simulate` against real runs at 2, 3 and 4 ranks on this machine.

    python benchmarks/validate_simulator.py            # writes docs/simulator/validation.md

For each world size a torchrun job (gloo on 127.0.0.1) trains each model with gradsync's default
layout and records its timing profile (`gradsync.planning.simulate.timing_profile`, every rank's, the slowest kept),
probes the all-reduce cost idle (`probe_cost_model`) and under load (`probe_under_load`), then
measures three wrappers that differ only in their layout: default, planned (the simulator's
plan for this run) and no overlap (one bucket, launched when the last gradient is ready). They
run interleaved, in rounds whose first step is dropped; a layout's time is the slowest rank's
median step, forward start to gradients written back. The whole validation is repeated
(`--repeat`) to show the noise: the median difference between two repeats' measurements of
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


# ------------------------------------------------------------------ worker (under torchrun)


def _host(ranks: int):
    """This machine, as the simulator sees it: every rank on one host of `os.cpu_count()` cores,
    gloo's collectives on those cores."""
    from gradsync.planning.simulate import Host

    return Host(ranks=ranks, cores=os.cpu_count() or 1, cpu_collectives=True)


def _measure_model(name: str, steps: int, rounds: int) -> dict:
    from gradsync import DistributedDataParallel
    from gradsync.planning.planner import probe_cost_model, probe_sizes, probe_under_load
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
    load = probe_under_load(dist.group.WORLD, sizes=sizes)  # type: ignore[arg-type]
    # The planned layout is the one the simulator plans (and prices) for this run; no overlap
    # is one bucket, launched when the last gradient is ready.
    (prediction,) = simulate(profile, Network.from_cost(cost, world), [world], _host(world), {world: load})
    index = {n: i for i, n in enumerate(default.reducer.names)}
    layouts["planned"].reducer.install_layout(
        [[index[profile.names[p]] for p in b] for b in prediction.planned_layout])
    layouts["no overlap"].reducer.install_layout([list(range(len(index)))])

    # Measured in rounds, the layouts interleaved (order rotating), each round's first step dropped.
    samples: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    for r in range(rounds):
        for layout in LAYOUTS[r % 3:] + LAYOUTS[: r % 3]:
            samples[layout] += run(layout, steps + 1)[1:]
    agreed = torch.tensor([statistics.median(samples[k]) for k in LAYOUTS], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    return {
        "measured_ms": dict(zip(LAYOUTS, agreed.tolist())),
        "profile": {**profile.__dict__},
        "cost": [cost.alpha_ms, cost.beta_ms_per_byte],
        "load": {"cost": [load.cost.alpha_ms, load.cost.beta_ms_per_byte], "compute_ms": load.compute_ms,
                 "step_ms": load.step_ms},
        "planned_buckets": prediction.planned_buckets,
    }


def worker(models: list[str], steps: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {m: _measure_model(m, steps, rounds) for m in models}
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps({"world_size": dist.get_world_size(), "models": results}))
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


def predict(source: dict, ranks: int, host, target: dict | None) -> dict[str, float]:
    """Predict `ranks` ranks from `source` (a model's run: profile and probes). `target`: the
    same model's run at `ranks`, whose probes describe the machine there (None: extrapolate
    the source's network and the fair-share stretch)."""
    from gradsync.planning.planner import CostModel
    from gradsync.planning.simulate import Network, Profile, simulate

    p = source["profile"]
    profile = Profile(p["forward_ms"], tuple(p["ready_ms"]), tuple(p["nbytes"]), tuple(p["names"]), p["world_size"])
    loads = {}
    if target is not None:
        network = Network.from_cost(CostModel(*target["cost"]), ranks)
        loads = {r: load for r, run in ((profile.world_size, source), (ranks, target))
                 if (load := _load(run, r)) is not None}
    else:
        network = Network.from_cost(CostModel(*source["cost"]), profile.world_size)
    (pred,) = simulate(profile, network, [ranks], host, loads)
    return {"default": pred.default_ms, "planned": pred.planned_ms, "no overlap": pred.no_overlap_ms}


MODES = {
    "2-rank profile, machine probed": "the 2-rank run's profile; the probes of the predicted rank count",
    "same run": "the profile and probes of the run predicted (at 3 and 4 ranks the profile was recorded "
                "on oversubscribed cores, where a rank's own timings already hold part of the stretch, unevenly)",
    "all from 2 ranks": "the 2-rank run's profile and idle probe, extrapolated (ring formula, fair-share stretch)",
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


def report(repeats: list[dict[int, dict]]) -> tuple[str, dict[str, list[float]], list[dict[str, float]], float]:
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
        f"Host: {os.cpu_count()} cores shared by all ranks; torch {torch.__version__}, gloo on 127.0.0.1; "
        f"{len(repeats)} independent repeats, medians shown.",
        "",
        "| model | ranks | layout | measured ms (min-max) | " + " | ".join(f"{m}: predicted (error)" for m in MODES) + " |",
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
                    guesses = [p[(model, n, layout, mode)] for p in predicted if (model, n, layout, mode) in p]
                    if not guesses:
                        cells.append("-")
                        continue
                    g = statistics.median(guesses)
                    cells.append(f"{g:.2f} ({g / m - 1:+.0%})")
                lines.append(f"| {model} | {n} | {layout} | {m:.2f} ({min(measured):.1f}-{max(measured):.1f}) | "
                             + " | ".join(cells) + " |")
    return "\n".join(lines), errors, per_repeat, statistics.median(noise) if noise else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--models", default="wide_mlp,tiny_gpt,convnet")
    ap.add_argument("--steps", type=int, default=12, help="steps per layout per round (at most 16)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the layouts interleaved (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="independent repeats of the whole validation")
    ap.add_argument("--out", default="docs/simulator")
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--from-json", help="report on the measurements of an earlier run (validation.json)")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    if args.worker:
        worker(models, args.steps, args.rounds, args.worker)
        return
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        repeats = [{int(k): v for k, v in r.items()} for r in (data if isinstance(data, list) else [data])]
    else:
        repeats = [measure(args) for _ in range(args.repeat)]
    table, errors, per_repeat, noise = report(repeats)
    summary = "\n".join(
        f"- {mode}: median error {statistics.median(e):.0%}, max {max(e):.0%}, "
        f"{sum(x <= 0.15 for x in e)} of {len(e)} predictions within 15 % (median per repeat: "
        f"{', '.join(f'{r[mode]:.0%}' for r in per_repeat)})"
        for mode, e in errors.items() if e
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = "\n".join(f"- {mode}: {what}" for mode, what in MODES.items())
    text = (f"# Simulator against real runs\n\n`{' '.join(['python', *sys.argv])}`\n\n"
            f"Predictions from:\n\n{modes}\n\n{table}\n\n"
            f"Prediction error, |predicted / measured - 1|, every repeat's prediction against its own "
            f"measurement:\n\n{summary}\n\nNoise floor: two repeats' measurements of the same case differ "
            f"by {noise:.0%} (median |a / b - 1|).\n")
    (out / "validation.md").write_text(text)
    (out / "validation.json").write_text(json.dumps(repeats))
    print(text)


def measure(args: argparse.Namespace) -> dict[int, dict]:
    from gradsync.testing import run_torchrun

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(r) for r in args.ranks.split(",")):
            path = os.path.join(tmp, f"{n}.json")
            result = run_torchrun(str(HERE), n, ["--models", args.models, "--steps", str(args.steps),
                                                 "--rounds", str(args.rounds), "--worker", path], timeout=900)
            if not os.path.exists(path):
                raise SystemExit(f"{n} ranks failed:\n{result.stdout[-3000:]}")
            runs[n] = json.loads(Path(path).read_text())
            print(f"measured {n} ranks", flush=True)
    return runs


if __name__ == "__main__":
    main()
