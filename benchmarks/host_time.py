"""Host time per step where the host is the bottleneck: gradsync against torch's DDP at world
size 1, the device bench's models at their tiny shapes on CPU (microsecond kernels), so that
what each wrapper costs the host is most of what differs. A stand-in for a GPU step that is
host-bound; a GPU itself is measured by `gradsync bench --device cuda`.

In one process, variants interleaved round by round (`gradsync.tools.bench.interleave`: the
order rotates, the first round is warm-up), one thread, each round `--steps` steps; prints the
median wall and thread-CPU time per step and the median of the paired ratios to torch's DDP,
with torch's DDP again as the A/A pair.

    python benchmarks/host_time.py --model gpt2_small           # this tree
    python benchmarks/host_time.py --model gpt2_small --against /path/to/other/src --runs 4

`--against`: also time another source tree (an earlier commit's `src`, e.g. from
`git worktree add`), in alternating processes, and print both trees' ratios run by run.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

VARIANTS = ("torch DDP", "gradsync", "torch DDP (again)")


def measure(args: argparse.Namespace) -> dict[str, tuple[float, float, float, float]]:
    """{variant: (wall ms, thread-CPU ms, wall ratio, CPU ratio)}, medians over the rounds."""
    import torch
    import torch.distributed as dist

    from gradsync.tools.bench import Comparison, interleave
    from gradsync.tools.devicebench import _training_step, _wrap, builtin_workload

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    work = builtin_workload(args.model, 0, True, "inductor")
    cpu = Comparison(VARIANTS)

    def variant(name: str) -> Callable[[], float]:
        model = copy.deepcopy(work.model)
        wrapped = _wrap(name, model, torch.device("cpu"), None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        step = _training_step(work, wrapped, opt, torch.device("cpu"))
        for _ in range(5):
            step()

        def run() -> float:  # wall ms per step; the thread's CPU ms on the side
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                step()
            cpu.add(name, (time.thread_time() - c0) / args.steps * 1e3)
            return (time.perf_counter() - t0) / args.steps * 1e3

        return run

    wall = interleave({name: variant(name) for name in VARIANTS}, args.rounds)
    dist.destroy_process_group()
    base = VARIANTS[0]
    return {
        n: (wall.median(n), cpu.median(n), wall.paired_ratio(n, base), cpu.paired_ratio(n, base))
        for n in VARIANTS
    }

def alternate(args: argparse.Namespace) -> None:
    """This tree and `--against`, in alternating processes: gradsync / torch's DDP, and A/A."""
    here = str(Path(__file__).resolve().parents[1] / "src")
    for run in range(args.runs):
        for label, src in (("against", args.against), ("this tree", here)):
            command = [
                sys.executable,
                __file__,
                "--model",
                args.model,
                "--rounds",
                str(args.rounds),
                "--steps",
                str(args.steps),
                "--quiet",
            ]
            out = subprocess.run(
                command,
                env={**os.environ, "PYTHONPATH": src},
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            print(
                f"run {run + 1} {label:9s} {args.model}: gradsync / torch's "
                f"DDP {out[0]} (CPU {out[1]}), A/A {out[2]} (CPU {out[3]})",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="gpt2_small", help="gpt2_small or gpt_many (eager, tiny shapes)"
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="steps per variant per round")
    parser.add_argument("--against", help="another tree's src directory to alternate with")
    parser.add_argument("--runs", type=int, default=3, help="alternations with --against")
    # for --against's children
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against:
        alternate(args)
        return
    results = measure(args)
    if args.quiet:
        g, again = results["gradsync"], results["torch DDP (again)"]
        print(f"{g[2]:.3f} {g[3]:.3f} {again[2]:.3f} {again[3]:.3f}")
        return
    for name, (wall, cpu, wall_ratio, cpu_ratio) in results.items():
        print(f"{name:18s} wall {wall:7.3f} ms  thread CPU {cpu:7.3f} ms  "
              f"/ torch's DDP: wall {wall_ratio:.3f}, CPU {cpu_ratio:.3f}")


if __name__ == "__main__":
    if "--quiet" not in sys.argv and "--against" not in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    main()
