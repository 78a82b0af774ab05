"""What seeing inside costs: gradsync with its always-on event recording vs. with recording
patched out, and with the stall watchdog on, at world size 2 (real processes, torch's default
group and store). Variants interleave; ratios are paired per round against the default.

    .venv/bin/python benchmarks/observability_overhead.py [--rounds 11]
"""

from __future__ import annotations

import argparse

import torch
from step_time import MODELS, _variant

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import run_processes
from gradsync.tools.bench import interleave, markdown_table


def _without_events(make, repeat):
    """A variant whose reducer records nothing (`ReducerConfig.record_events`)."""

    def quiet(model: torch.nn.Module) -> GradsyncDDP:
        ddp = GradsyncDDP(model)
        ddp.reducer.configure(record_events=False)  # type: ignore[union-attr]
        return ddp

    return _variant(make, quiet, repeat)


def _with_watchdog(model: torch.nn.Module) -> GradsyncDDP:
    ddp = GradsyncDDP(model)
    ddp.enable_stall_watchdog(warn_after=60)
    return ddp


def bench_rank(rank: int, group, model_name: str, rounds: int, repeat: int):
    torch.set_num_threads(1)
    make = MODELS[model_name]
    variants = {
        "gradsync (events on)": _variant(make, lambda m: GradsyncDDP(m), repeat),
        "gradsync (again)": _variant(make, lambda m: GradsyncDDP(m), repeat),
        "gradsync, events off": _without_events(make, repeat),
        "gradsync + watchdog": _variant(make, _with_watchdog, repeat),
    }
    result = interleave(variants, rounds=rounds, warmup=1)
    return (
        markdown_table(result, "gradsync (events on)", "gradsync (again)", "ms", 1e3)
        if rank == 0
        else None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--models", default="many_small,convnet")
    args = parser.parse_args()
    for name in args.models.split(","):
        table = run_processes(
            bench_rank, 2, name, args.rounds, args.repeat, timeout=1800, default_group=True
        )[0]
        print(f"\n### {name}: world size 2, {args.rounds} rounds x {args.repeat} steps\n")
        print(table, flush=True)


if __name__ == "__main__":
    main()
