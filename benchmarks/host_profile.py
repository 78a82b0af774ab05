"""Where the host's time goes in a training step: gradsync against torch's DDP, profiled.

    PYTHONPATH=src python benchmarks/host_profile.py --device cuda --model gpt_many
    python benchmarks/host_profile.py --device cpu --tiny        # the same on CPU, small shapes

A world of one (NCCL on a GPU, gloo on CPU). For each wrapper: a few warm-up steps, then
cProfile over `--steps` steps; prints the host time per step (wall, the device drained at the
end), the functions with the most own time, and the calls per step into torch.cuda and into
gradsync's engine, so a per-gradient device call shows up as a count near the number of
parameter tensors. Models are `gradsync bench --device`'s (`gradsync.tools.devicebench`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gradsync.tools.devicebench import _call, _to, _wrap, builtin_workload  # noqa: E402


def profile(name: str, work, device: torch.device, steps: int, top: int) -> None:
    import copy

    model = copy.deepcopy(work.model)
    ddp = _wrap(name, model, device, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        batch = work.batches[i % len(work.batches)]
        with torch.autocast(device.type, dtype=work.autocast) if work.autocast else _null():
            out = _call(ddp, batch)
        work.loss(out, batch).backward()
        opt.step()

    for i in range(4):
        step(i)
    _drain(device)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for i in range(steps):
        step(i)
    profiler.disable()
    host = (time.perf_counter() - start) / steps
    _drain(device)
    wall = (time.perf_counter() - start) / steps
    stats = pstats.Stats(profiler)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    calls = {}
    for (file, _line, fn), (_cc, nc, _tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "torch/cuda" in file or "gradsync" in file:
            calls[f"{Path(file).parent.name}/{Path(file).name}:{fn}"] = nc / steps
    print(
        f"\n=== {name}: {work.name}, {sum(1 for _ in model.parameters())} parameter tensors: host "
        f"{host * 1e3:.2f} ms/step under cProfile (wall with the device drained {wall * 1e3:.2f})"
    )
    busiest = sorted(calls.items(), key=lambda kv: -kv[1])[:15]
    print("calls per step (torch.cuda, gradsync): " + "; ".join(f"{k} {v:.0f}" for k, v in busiest))
    print("\n".join(out.getvalue().splitlines()[:top + 12]))


def _null():
    import contextlib

    return contextlib.nullcontext()


def _drain(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--model", action="append", default=[], help="gpt2_small, gpt_many (repeatable)"
    )
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        for name in args.model or ["gpt_many", "gpt2_small"]:
            work = builtin_workload(name, 0, args.tiny, "inductor", device)
            work.batches = [_to(b, device) for b in work.batches]
            for variant in ("torch DDP", "gradsync"):
                profile(variant, work, device, args.steps, args.top)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
