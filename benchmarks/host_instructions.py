"""Host work per step, counted rather than timed: the instructions one training step executes
under torch's DDP, under gradsync and with no DDP at all, each variant in a process of its own
under valgrind's callgrind, counting only the measured steps (switched on and off from outside
with `callgrind_control` once the variant has warmed up).

A count does not move with the load on a shared machine, so a change of a few microseconds a
step shows where `host_time.py`'s clocks (a few per cent of noise on two shared cores) cannot.
It is the host's share that a GPU step waits for when the step is host-bound. What it does not
see: time blocked, cache misses (`--cache-sim` adds them), and that an instruction of the Python
interpreter is not worth one of a C++ loop. The kernels themselves run valgrind's code paths
(no AVX-512), so totals are larger than a real run's; the differences between variants are the
wrappers' work (the same model, batches and optimizer in each).

    python benchmarks/host_instructions.py --model gpt2_small
    python benchmarks/host_instructions.py --model gpt_many --against /path/to/other/src

Needs valgrind (`apt install valgrind`); about a minute a variant, two at a time.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import os
import re
import select
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

VARIANTS = ("no DDP", "torch DDP", "gradsync")
HERE = Path(__file__).resolve().parents[1] / "src"


def child(variant: str, model: str, steps: int) -> None:
    """Warm up, say "ready", wait for "go" on stdin, run `steps` steps, say "done", wait."""
    import torch
    import torch.distributed as dist

    import gradsync  # the tree measured (PYTHONPATH); the models and the step are this tree's

    bench = _this_trees_devicebench()
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    work = bench.builtin_workload(model, 0, True, "inductor")
    net = copy.deepcopy(work.model)
    wrapped = bench._wrap(
        variant, net, torch.device("cpu"), None, gradsync_ddp=gradsync.DistributedDataParallel
    )
    step = bench._training_step(
        work,
        wrapped,
        torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=False),
        torch.device("cpu"),
    )
    for _ in range(8):  # past the one-time rebuild and the first iterations' bookkeeping
        step()
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(steps):
        step()
    print("done", flush=True)
    sys.stdin.readline()
    dist.destroy_process_group()


def _this_trees_devicebench() -> Any:
    """`gradsync.tools.devicebench` of this tree, loaded under a name of its own, so that a tree
    from before it existed (`--against`) is measured on the same models and step."""
    spec = importlib.util.spec_from_file_location(
        "gradsync_bench_models",
        HERE / "gradsync" / "__init__.py",
        submodule_search_locations=[str(HERE / "gradsync")],
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return importlib.import_module("gradsync_bench_models.tools.devicebench")


def count(variant: str, model: str, steps: int, src: str, cache: bool) -> dict[str, int]:
    """Run one variant under callgrind; the events it collected over the measured steps."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "valgrind.log"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--log-file={log}",
            f"--callgrind-out-file={tmp}/callgrind.out",
            *(["--cache-sim=yes"] if cache else []),
            sys.executable,
            __file__,
            "--child",
            variant,
            "--model",
            model,
            "--steps",
            str(steps),
        ]
        env = {**os.environ, "PYTHONPATH": src}
        with subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        ) as proc:
            assert proc.stdin is not None and proc.stdout is not None
            _expect(proc, "ready", log)
            subprocess.run(
                ["callgrind_control", "--instr=on", str(proc.pid)], check=True, capture_output=True
            )
            proc.stdin.write("go\n")
            proc.stdin.flush()
            _expect(proc, "done", log)
            subprocess.run(
                ["callgrind_control", "--instr=off", str(proc.pid)], check=True, capture_output=True
            )
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            proc.wait(timeout=300)
        return _collected(log.read_text())


def _expect(proc: subprocess.Popen, word: str, log: Path, timeout: float = 1200) -> None:
    """Read the variant's next line (its process is killed if none comes within `timeout` s:
    a variant hung under valgrind must not hang the benchmark)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
    line = proc.stdout.readline().strip() if ready else f"nothing in {timeout:.0f} s"
    if line != word:
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(
            f"the variant's process said {line!r}, not {word!r}; valgrind's log ends:\n{tail}"
        )


def _collected(log: str) -> dict[str, int]:
    """{event: count} from the log's "Events :" and "Collected :" lines."""
    events = re.search(r"Events\s*:\s*(.+)", log)
    collected = re.search(r"Collected\s*:\s*(.+)", log)
    if events is None or collected is None:
        raise RuntimeError(f"no counts in valgrind's log:\n{log[-2000:]}")
    return dict(zip(events.group(1).split(), map(int, collected.group(1).split())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="gpt2_small", help="gpt2_small or gpt_many (eager, tiny shapes)"
    )
    parser.add_argument("--steps", type=int, default=10, help="steps counted per variant")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=(
            f"comma-separated, from {', '.join(VARIANTS)}, 'torch DDP find_unused', "
            "'gradsync as_view', 'gradsync find_unused', 'gradsync no events'"
        ),
    )
    parser.add_argument("--against", help="another tree's src directory: its gradsync counted too")
    parser.add_argument("--cache-sim", action="store_true", help="count cache misses too (slower)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.steps)
        return
    variants = [v.strip() for v in args.variants.split(",")]
    missing = [v for v in ("no DDP", "torch DDP") if v not in variants]
    if missing:
        parser.error(f"--variants must include {missing}: the floor and the reference")
    runs = [(v, str(HERE), v) for v in variants]
    if args.against:
        runs += [(v, args.against, f"{v} (against)") for v in variants if v.startswith("gradsync")]
    with ThreadPoolExecutor(2) as pool:  # two cores: two processes
        counts = list(
            pool.map(lambda r: count(r[0], args.model, args.steps, r[1], args.cache_sim), runs)
        )
    per_step = {
        label: {k: n / args.steps for k, n in c.items()} for (_, _, label), c in zip(runs, counts)
    }
    floor = per_step["no DDP"]["Ir"]
    print(
        f"{args.model}, tiny shapes, world size 1, {args.steps} steps "
        "counted per variant: instructions per step; a wrapper's work over no DDP, "
        "and its ratio to torch's DDP's with the same options"
    )
    for label, c in per_step.items():
        over = c["Ir"] - floor
        reference = (
            "torch DDP find_unused"
            if "find_unused" in label and "torch DDP find_unused" in per_step
            else "torch DDP"
        )
        torch_over = per_step[reference]["Ir"] - floor
        ratio = (
            f"  / {reference}'s: {over / torch_over:.3f}"
            if label != "no DDP" and torch_over > 0
            else ""
        )
        extra = "  ".join(f"{k} {v:,.0f}" for k, v in c.items() if k != "Ir")
        print(
            f"  {label:32s} {c['Ir']:>14,.0f}  over no DDP {over:>11,.0f}{ratio}  {extra}".rstrip()
        )


if __name__ == "__main__":
    main()
