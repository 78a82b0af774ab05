"""Check `gradsync simulate` against real runs at 2, 3 and 4 ranks on this machine.

    python benchmarks/validate_simulator.py            # writes docs/simulator/validation.md

For each world size a torchrun job (gloo on 127.0.0.1) trains each model with gradsync's default
layout, records its timing profile (`Reducer.timing_profile`) and probes the all-reduce cost,
then measures the planned layout (planned on rank 0 from that profile and cost) and no overlap
(backward, then one flat all-reduce). Step time here is forward start to gradients written back.

Two predictions are compared with what was measured:

* same run: the simulator gets the profile and the probed cost of the run it predicts: does the
  overlap model price the three layouts right?
* from 2 ranks: only the 2-rank profile and probe, extrapolated to 3 and 4 ranks with the ring
  formula: can it predict scaling it has not seen?

Both describe this machine as one host of 2 cores shared by all ranks, with gloo's collectives
on those cores (`Host(ranks=4, cores=2, cpu_collectives=True)`): once every core has a rank's
compute, communication adds to it instead of overlapping it.
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


def _timeline_ms(reducer, last: int) -> float:
    spans = [(t.finish_ns - t.forward_start_ns) * 1e-6 for t in list(reducer.history)[-last:]]
    return statistics.median(spans)


def _measure_model(name: str, steps: int) -> dict:
    from gradsync import DistributedDataParallel
    from gradsync.benchsuite import MODELS, _FlatAfterBackward, _loss
    from gradsync.planner import plan_buckets, probe_cost_model, probe_sizes

    torch.manual_seed(0)
    model, make_input = MODELS[name]()
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [make_input(g) for _ in range(4)]
    ddp = DistributedDataParallel(model)
    reducer = ddp.reducer

    def run(n: int) -> None:
        for i in range(n):
            model.zero_grad()
            _loss(ddp(batches[i % 4])).backward()

    run(6)
    run(steps)
    default_ms = _timeline_ms(reducer, steps)
    profile = reducer.timing_profile(window=steps)
    total = sum(profile.nbytes)
    cost = probe_cost_model(dist.group.WORLD, sizes=probe_sizes(total), repeats=5)  # type: ignore[arg-type]
    index = {n: i for i, n in enumerate(reducer.names)}
    positions = plan_buckets(list(profile.ready_ms), list(profile.nbytes), cost)
    layout = [[[index[profile.names[p]] for p in bucket] for bucket in positions]]
    dist.broadcast_object_list(layout, src=0)  # rank 0's plan everywhere
    reducer.install_layout(layout[0])
    run(3)
    run(steps)
    planned_ms = _timeline_ms(reducer, steps)

    torch.manual_seed(0)
    plain, _ = MODELS[name]()
    flat = _FlatAfterBackward(plain, None)
    times = []
    for i in range(3 + steps):
        plain.zero_grad()
        start = time.perf_counter()
        _loss(flat(batches[i % 4])).backward()
        flat.sync()
        times.append((time.perf_counter() - start) * 1e3)
    measured = {"default": default_ms, "planned": planned_ms, "no overlap": statistics.median(times[3:])}
    agreed = torch.tensor([measured[k] for k in LAYOUTS], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
    return {
        "measured_ms": dict(zip(LAYOUTS, agreed.tolist())),
        "profile": {**profile.__dict__},
        "cost": [cost.alpha_ms, cost.beta_ms_per_byte],
        "planned_buckets": len(layout[0]),
    }


def worker(models: list[str], steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {m: _measure_model(m, steps) for m in models}
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps({"world_size": dist.get_world_size(), "models": results}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- driver


def predict(run: dict, ranks: int, host) -> dict[str, float]:
    from gradsync.planner import CostModel
    from gradsync.simulate import Network, Profile, simulate

    p = run["profile"]
    profile = Profile(p["forward_ms"], tuple(p["ready_ms"]), tuple(p["nbytes"]), tuple(p["names"]), p["world_size"])
    network = Network.from_cost(CostModel(*run["cost"]), profile.world_size)
    (pred,) = simulate(profile, network, [ranks], host)
    return {"default": pred.default_ms, "planned": pred.planned_ms, "no overlap": pred.no_overlap_ms}


MODES = {"same run": False, "from 2 ranks": True}


def report(runs: dict[int, dict]) -> tuple[str, dict[str, list[float]]]:
    """The table, and per prediction mode the absolute relative errors."""
    from gradsync.simulate import Host

    host = Host(ranks=max(runs), cores=os.cpu_count() or 1, cpu_collectives=True)
    lines = [
        f"Host: {os.cpu_count()} cores shared by all ranks; torch {torch.__version__}, gloo on 127.0.0.1.",
        "",
        "| model | ranks | layout | measured ms | " + " | ".join(f"{m}: predicted (error)" for m in MODES) + " |",
        "|---|---:|---|---:|" + "---:|" * len(MODES),
    ]
    errors: dict[str, list[float]] = {m: [] for m in MODES}
    for model in runs[min(runs)]["models"]:
        for n in sorted(runs):
            run = runs[n]["models"][model]
            predictions = {}
            for mode, from_two in MODES.items():
                if from_two and (n == 2 or 2 not in runs):
                    continue
                source = runs[2]["models"][model] if from_two else run
                predictions[mode] = predict(source, n, host)
            for layout in LAYOUTS:
                m = run["measured_ms"][layout]
                cells = []
                for mode in MODES:
                    if mode not in predictions:
                        cells.append("-")
                        continue
                    err = predictions[mode][layout] / m - 1
                    errors[mode].append(abs(err))
                    cells.append(f"{predictions[mode][layout]:.2f} ({err:+.0%})")
                lines.append(f"| {model} | {n} | {layout} | {m:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines), errors


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--models", default="wide_mlp,tiny_gpt,convnet")
    ap.add_argument("--steps", type=int, default=14, help="measured steps per layout (at most 16)")
    ap.add_argument("--out", default="docs/simulator")
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--from-json", help="report on the measurements of an earlier run (validation.json)")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    if args.worker:
        worker(models, args.steps, args.worker)
        return
    if args.from_json:
        runs = {int(k): v for k, v in json.loads(Path(args.from_json).read_text()).items()}
    else:
        runs = measure(args)
    table, errors = report(runs)
    summary = "\n".join(
        f"- {mode}: median error {statistics.median(e):.0%}, max {max(e):.0%} ({len(e)} predictions)"
        for mode, e in errors.items() if e
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = (f"# Simulator against real runs\n\n`{' '.join(['python', *sys.argv])}`\n\n{table}\n\n"
            f"Prediction error, |predicted / measured - 1|:\n\n{summary}\n")
    (out / "validation.md").write_text(text)
    (out / "validation.json").write_text(json.dumps(runs))
    print(text)


def measure(args: argparse.Namespace) -> dict[int, dict]:
    from gradsync.testing import run_torchrun

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(r) for r in args.ranks.split(",")):
            path = os.path.join(tmp, f"{n}.json")
            result = run_torchrun(str(HERE), n, ["--models", args.models, "--steps", str(args.steps),
                                                 "--worker", path], timeout=900)
            if not os.path.exists(path):
                raise SystemExit(f"{n} ranks failed:\n{result.stdout[-3000:]}")
            runs[n] = json.loads(Path(path).read_text())
            print(f"measured {n} ranks", flush=True)
    return runs


if __name__ == "__main__":
    main()
