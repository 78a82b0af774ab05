"""Soak: thousands of iterations of gradsync's DDP and torch's side by side, at world size 3.

Not a CI test: a long run that looks for what only time shows (drift, leaks, rare hangs). Each
rank is a real process (spawn, gloo on 127.0.0.1) holding two identical copies of a model with
several branches: one wrapped in `gradsync.DistributedDataParallel`, one in torch's, both with
`find_unused_parameters=True` on the same process group. They train in lockstep on the same
per-rank data (every rank draws different data). Per iteration a seeded RNG, identical on all
ranks, picks

* which branches each rank's forward uses (sometimes the same subset everywhere, sometimes a
  different one per rank; a branch can be unused on some ranks or on all),
* a run of 0-3 `no_sync()` micro-steps before the synchronised one.

Every `--rewrap-every` iterations both modules are wrapped afresh with the next communication
hook (none, torch's allreduce and fp16 hooks on both wrappers, gradsync's own hooks against the
matching torch hook), the next bucket cap (about one parameter per bucket, a few, all in one)
and `gradient_as_bucket_view` on or off; the old wrappers must then be garbage (weak references
dead, gradsync's autograd hooks gone from the parameters). Every `--check-every` iterations:
gradients and parameters (and BatchNorm's buffers) against torch's (max |diff|), checksums of the
parameters across ranks (all-gather), and this process's memory (VmRSS, VmHWM, gc objects, file
descriptors, threads).

The default tolerance is 0: both wrappers fill the same buckets and reduce them with the same
arithmetic (divide, then sum; fp16 hooks divide in fp16), so gloo sums the same chunks in the
same order and the results are bit-identical, at world size 3 too. torch's C++ reducer may warn
once per wrapper that it "did not find any unused parameters" on an iteration that used every
branch; that is expected here.

    .venv/bin/python benchmarks/soak.py [--iters 3000] [--world-size 3] [--check-every 100]
                                        [--rewrap-every 500] [--out out/soak]

Writes `soak.json` and `soak.md` under `--out`; exits 1 on FAIL (a mismatch, a leak, memory
growth past `--rss-growth-mb`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import random
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import comm_hooks
from gradsync.engine.collectives import all_gather_objects
from gradsync.testing import make_gloo_group, run_processes

# (gradsync wrapper's hook, torch wrapper's hook) per name. The same torch hook on both wrappers
# tests that gradsync runs torch's hooks as torch does; gradsync's hooks are matched with the
# torch hook that does the same arithmetic (divide in the reduced dtype, then sum), so the
# results must be identical too.
HOOKS: dict[str, tuple[Any, Any]] = {
    "none": (None, None),
    "torch allreduce_hook (both)": (torch_hooks.allreduce_hook, torch_hooks.allreduce_hook),
    "torch fp16_compress_hook (both)": (
        torch_hooks.fp16_compress_hook,
        torch_hooks.fp16_compress_hook,
    ),
    "gradsync allreduce_hook vs torch's": (comm_hooks.allreduce_hook, torch_hooks.allreduce_hook),
    "gradsync fp16_compress_hook vs torch's": (
        comm_hooks.fp16_compress_hook,
        torch_hooks.fp16_compress_hook,
    ),
    "gradsync fp16_compress_wrapper(allreduce) vs torch's": (
        comm_hooks.fp16_compress_wrapper(comm_hooks.allreduce_hook),
        torch_hooks.fp16_compress_wrapper(torch_hooks.allreduce_hook),
    ),
}
# Bucket caps per wrap, in MiB: a few hundred bytes (about one parameter per bucket), a few
# parameters per bucket, and torch's default (everything in one bucket for this model).
BUCKET_CAPS_MB = (0.0005, 0.01, 25.0)
BRANCHES = 5
WIDTH = 32
IN_FEATURES = 16
OUT_FEATURES = 4
BATCH = 8


class Branchy(nn.Module):
    """A stem, `BRANCHES` residual branches and a head; forward runs the branches it is given.

    The stem's BatchNorm adds buffers, which both wrappers broadcast from rank 0 at every
    synchronised forward.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(IN_FEATURES, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh())
        self.branches = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
            for _ in range(BRANCHES)
        )
        self.head = nn.Linear(WIDTH, OUT_FEATURES)

    def forward(self, x: torch.Tensor, active: tuple[int, ...]) -> torch.Tensor:
        h = self.stem(x)
        for i in active:
            h = h + self.branches[i](h)
        return self.head(h)


# ------------------------------------------------------------------------------ the plan


def draw_iteration(rng: random.Random, world_size: int) -> list[list[tuple[int, ...]]]:
    """Per micro-step (the no_sync ones, then the synchronised one): each rank's branches.

    Drawn from `rng`, which every rank seeds alike, so all ranks agree on the plan and only
    their data differ.
    """
    no_sync_steps = 0 if rng.random() < 0.5 else rng.randint(1, 3)
    steps = []
    for _ in range(no_sync_steps + 1):
        if rng.random() < 0.3:  # the same subset on every rank
            shared = _subset(rng)
            steps.append([shared] * world_size)
        else:  # each rank its own: a branch used on some ranks only
            steps.append([_subset(rng) for _ in range(world_size)])
    return steps


def _subset(rng: random.Random) -> tuple[int, ...]:
    return tuple(i for i in range(BRANCHES) if rng.random() < 0.5)


def draw_wrap(epoch: int) -> dict[str, Any]:
    """How the modules are wrapped for epoch `epoch`: hooks, bucket caps and
    gradient_as_bucket_view in turn, so that the six epochs of the default run meet every hook
    and every (bucket cap, as_view) pair."""
    names = list(HOOKS)
    return {
        "epoch": epoch,
        "hook": names[epoch % len(names)],
        "bucket_cap_mb": BUCKET_CAPS_MB[epoch % len(BUCKET_CAPS_MB)],
        "gradient_as_bucket_view": (epoch // len(BUCKET_CAPS_MB)) % 2 == 1,
    }


# --------------------------------------------------------------------------- measuring


def read_memory() -> dict[str, float]:
    """This process's resident set and its high-water mark (MB), from /proc/self/status."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) / 1024  # reported in kB
    return {"rss_mb": found.get("VmRSS", 0.0), "hwm_mb": found.get("VmHWM", 0.0)}


def memory_sample(iteration: int, phase: str) -> dict[str, Any]:
    """Memory and what tends to leak with it; `phase`: "start", "check" or "teardown"."""
    return {
        "iteration": iteration,
        "phase": phase,
        **read_memory(),
        "gc_objects": len(gc.get_objects()),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
    }


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """An integer over the exact bits of float32 tensors: equal bits, equal sums.

    Position-weighted, so swapped values change it too. Integer arithmetic, so it does not
    depend on summation order the way a float sum would.
    """
    total = 0
    for i, t in enumerate(tensors):
        bits = t.detach().contiguous().view(torch.int32).reshape(-1).long()
        weights = torch.arange(bits.numel(), dtype=torch.long) % 65521 + i + 1
        total += int((bits * weights).sum())
    return total


def max_diff(ours: dict[str, torch.Tensor | None], theirs: dict[str, torch.Tensor | None]):
    """(max |diff|, name of the worst tensor, names whose None-ness differs)."""
    worst, worst_name, none_mismatch = 0.0, "", []
    for name, a in ours.items():
        b = theirs[name]
        if (a is None) != (b is None):
            none_mismatch.append(name)
            continue
        if a is None or b is None:
            continue
        d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        if d > worst or not worst_name:
            worst, worst_name = d, name
    return worst, worst_name, none_mismatch


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach() for n, p in module.named_parameters()}


def _state(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Parameters and floating-point buffers (BatchNorm's running statistics)."""
    state: dict[str, torch.Tensor | None] = {n: p.detach() for n, p in module.named_parameters()}
    state.update({n: b for n, b in module.named_buffers() if b.is_floating_point()})
    return state


# ------------------------------------------------------------------------------ a rank


class Pair:
    """The two wrappers of one epoch, and weak references to check they die with it."""

    def __init__(self, ours_model, theirs_model, group, wrap: dict[str, Any]) -> None:
        ours_hook, theirs_hook = HOOKS[wrap["hook"]]
        kwargs = {
            "process_group": group,
            "find_unused_parameters": True,
            "bucket_cap_mb": wrap["bucket_cap_mb"],
            "gradient_as_bucket_view": wrap["gradient_as_bucket_view"],
        }
        self.ours = GradsyncDDP(ours_model, **kwargs)
        self.theirs = TorchDDP(theirs_model, **kwargs)
        if ours_hook is not None:
            self.ours.register_comm_hook(group, ours_hook)
            self.theirs.register_comm_hook(group, theirs_hook)
        self.buckets = len(self.ours.reducer.buckets) if self.ours.reducer else 0


class RankSoak:
    """One rank's soak: the models, optimizers, data, plan and everything it records."""

    def __init__(self, rank: int, group: dist.ProcessGroup, opts: argparse.Namespace) -> None:
        self.rank, self.group, self.opts = rank, group, opts
        self.world_size = group.size()
        self.ours_model = _seeded_model(opts.seed)
        self.theirs_model = _seeded_model(opts.seed)
        # Momentum: a parameter whose gradient is None is skipped, one with a zero gradient
        # still moves, so a None-ness difference shows up in the parameters.
        self.ours_opt = torch.optim.SGD(self.ours_model.parameters(), lr=0.02, momentum=0.9)
        self.theirs_opt = torch.optim.SGD(self.theirs_model.parameters(), lr=0.02, momentum=0.9)
        self.data = torch.Generator().manual_seed(opts.seed * 1000 + rank)
        self.plan = random.Random(opts.seed)  # same seed on every rank: the same plan
        self.pair: Pair | None = None
        self.hook_baseline = _hook_counts(self.ours_model)
        self.epochs: list[dict[str, Any]] = []
        self.mismatches: list[dict[str, Any]] = []
        self.leaks: list[dict[str, Any]] = []
        self.memory: list[dict[str, Any]] = []
        self.max_param_diff = 0.0
        self.max_grad_diff = 0.0
        self.checks = 0
        self.micro_steps = 0
        self.no_sync_steps = 0
        self.unused_somewhere = 0

    # ----------------------------------------------------------------------- training

    def step(self, iteration: int, check: bool) -> None:
        """One optimizer step: the drawn no_sync micro-steps, then the synchronised one."""
        plan = draw_iteration(self.plan, self.world_size)
        pair = self.pair
        assert pair is not None
        self.ours_opt.zero_grad(set_to_none=True)
        self.theirs_opt.zero_grad(set_to_none=True)
        for k, branches in enumerate(plan):
            synced = k == len(plan) - 1
            x = torch.randn(BATCH, IN_FEATURES, generator=self.data)
            y = torch.randn(BATCH, OUT_FEATURES, generator=self.data)
            mine = branches[self.rank]
            for ddp in (pair.ours, pair.theirs):
                with contextlib.nullcontext() if synced else ddp.no_sync():
                    out = ddp(x, mine)
                    (out - y).pow(2).mean().div(len(plan)).backward()
            self.micro_steps += 1
            self.no_sync_steps += not synced
            used = set().union(*map(set, branches))  # a branch missing from any rank: unused there
            self.unused_somewhere += any(set(b) != used for b in branches) or len(used) < BRANCHES
        if check:
            self.compare_grads(iteration)
        self.ours_opt.step()
        self.theirs_opt.step()

    # ---------------------------------------------------------------------- wrapping

    def rewrap(self, iteration: int) -> None:
        """Drop the current wrappers (they must be collected) and wrap with the next hook."""
        self.drop_pair(iteration)
        wrap = draw_wrap(len(self.epochs))
        self.pair = Pair(self.ours_model, self.theirs_model, self.group, wrap)
        hooks = _hook_counts(self.ours_model)
        expected = {n: c + 1 for n, c in self.hook_baseline.items()}
        if hooks != expected:
            self.leaks.append({"iteration": iteration, "what": "gradsync autograd hooks per "
                               "parameter after wrapping", "got": hooks, "expected": expected})
        self.epochs.append(
            {**wrap, "start_iteration": iteration, "gradsync_buckets": self.pair.buckets}
        )

    def drop_pair(self, iteration: int) -> None:
        """Free the wrappers and check nothing of them survives a garbage collection."""
        if self.pair is None:
            return
        # .grad may be a view into the old wrapper's bucket (gradient_as_bucket_view): drop it
        # as training code would before re-wrapping, so only a real leak keeps the bucket.
        self.ours_opt.zero_grad(set_to_none=True)
        self.theirs_opt.zero_grad(set_to_none=True)
        refs = {
            "gradsync DistributedDataParallel": weakref.ref(self.pair.ours),
            "gradsync Reducer": weakref.ref(self.pair.ours.reducer),
            "torch DistributedDataParallel": weakref.ref(self.pair.theirs),
        }
        self.pair = None
        gc.collect()
        for what, ref in refs.items():
            if ref() is not None:
                self.leaks.append({"iteration": iteration, "what": f"{what} still alive after "
                                   f"re-wrapping (referrers: {_referrers(ref())})"})
        hooks = _hook_counts(self.ours_model)
        if hooks != self.hook_baseline:
            self.leaks.append({"iteration": iteration, "what": "gradsync autograd hooks left on "
                               "parameters after the wrapper was dropped", "got": hooks})

    # ----------------------------------------------------------------------- checking

    def compare_grads(self, iteration: int) -> None:
        """Right after the synchronised backward: the averaged gradients, and their None-ness."""
        diff, name, none_mismatch = max_diff(_grads(self.ours_model), _grads(self.theirs_model))
        self.max_grad_diff = max(self.max_grad_diff, diff)
        if none_mismatch:
            self.record_mismatch(iteration, "grad is None on one side only", none_mismatch[0], None)
        if diff > self.opts.tolerance:
            self.record_mismatch(iteration, "gradient differs from torch DDP", name, diff)

    def check(self, iteration: int) -> None:
        """Parameters against torch's, across ranks, and a memory sample."""
        self.checks += 1
        diff, name, _ = max_diff(_state(self.ours_model), _state(self.theirs_model))
        self.max_param_diff = max(self.max_param_diff, diff)
        if diff > self.opts.tolerance:
            self.record_mismatch(iteration, "parameter differs from torch DDP", name, diff)
            self.resync()
        params = [*self.ours_model.parameters(), *self.theirs_model.parameters()]
        sums = all_gather_objects(self.group, checksum(params))
        if len(set(sums)) != 1:
            self.record_mismatch(
                iteration, f"parameters differ across ranks: checksums {sums}", "", None
            )
        self.memory.append(memory_sample(iteration, "check"))

    def record_mismatch(self, iteration: int, what: str, name: str, diff: float | None) -> None:
        if len(self.mismatches) < 50:
            self.mismatches.append({"iteration": iteration, "rank": self.rank, "what": what,
                                    "tensor": name, "diff": diff})

    def resync(self) -> None:
        """After a reported mismatch, copy torch's state over gradsync's, so later checks see
        new differences rather than the old one carried forward."""
        with torch.no_grad():
            for a, b in zip(
                self.ours_model.state_dict().values(), self.theirs_model.state_dict().values()
            ):
                a.copy_(b)

    def result(self, wall_s: float, iters: int) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "iterations": iters,
            "loop_wall_s": wall_s,
            "micro_steps": self.micro_steps,
            "no_sync_micro_steps": self.no_sync_steps,
            "micro_steps_with_unused_branches": self.unused_somewhere,
            "checks": self.checks,
            "max_param_diff": self.max_param_diff,
            "max_grad_diff": self.max_grad_diff,
            "mismatches": self.mismatches,
            "leaks": self.leaks,
            "epochs": self.epochs,
            "memory": self.memory,
        }


def _seeded_model(seed: int) -> Branchy:
    torch.manual_seed(seed)  # each rank is its own process: the global generator is ours
    return Branchy()


def _hook_counts(module: nn.Module) -> dict[str, int]:
    """Post-accumulate-grad hooks per parameter: gradsync's Reducer adds one to each."""
    return {n: len(getattr(p, "_post_accumulate_grad_hooks", None) or ())
            for n, p in module.named_parameters()}


def _referrers(obj: object) -> list[str]:
    return sorted({type(r).__name__ for r in gc.get_referrers(obj)})[:8]


def soak_rank(rank: int, _default: dist.ProcessGroup, store_path: str, opts: argparse.Namespace):
    """Run the soak on this rank; return what it recorded."""
    torch.set_num_threads(1)  # ranks share two cores; intra-op threads would fight
    # run_processes' own group times out its collectives after the whole run's deadline; the
    # soak's group gets a short collective timeout so that a hang surfaces in minutes.
    store = dist.FileStore(store_path, opts.world_size)
    group = make_gloo_group(store, rank, opts.world_size, opts.collective_timeout)
    soak = RankSoak(rank, group, opts)
    soak.memory.append(memory_sample(0, "start"))
    progress = _progress(opts.iters) if rank == 0 else None
    start = time.perf_counter()
    for it in range(opts.iters):
        if it % opts.rewrap_every == 0:
            soak.rewrap(it)
        last = it == opts.iters - 1
        check = (it + 1) % opts.check_every == 0 or last
        soak.step(it, check)
        if check:
            soak.check(it)
        if progress is not None:
            progress.update()
            if check:
                progress.set_postfix(maxdiff=f"{soak.max_param_diff:.1e}",
                                     rss=f"{soak.memory[-1]['rss_mb']:.0f}MB", refresh=False)
    wall = time.perf_counter() - start
    soak.drop_pair(opts.iters)
    soak.memory.append(memory_sample(opts.iters, "teardown"))  # the last wrappers are gone
    if progress is not None:
        progress.close()
    all_gather_objects(group, "done")  # no rank tears the group down while others still send
    return soak.result(wall, opts.iters)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="soak", unit="it", dynamic_ncols=True, mininterval=1.0)


# ------------------------------------------------------------------------------ verdict


def memory_verdict(samples: list[dict[str, Any]], iters: int, limit_mb: float) -> dict[str, Any]:
    """RSS at about 10 % of the run (past warm-up) against the end; flat if it grew < limit."""
    checks = [s for s in samples if s["phase"] == "check"]
    # A check's "iteration" is the index of the step just done: iteration + 1 steps are behind it.
    base = next(s for s in checks if s["iteration"] + 1 >= iters // 10 or s is checks[-1])
    end = checks[-1]
    growth = end["rss_mb"] - base["rss_mb"]
    return {
        "baseline_iteration": base["iteration"],
        "rss_start_mb": samples[0]["rss_mb"],
        "rss_baseline_mb": base["rss_mb"],
        "rss_end_mb": end["rss_mb"],
        "rss_after_teardown_mb": samples[-1]["rss_mb"],
        "hwm_mb": max(s["hwm_mb"] for s in samples),
        "rss_growth_mb": growth,
        "gc_objects_baseline": base["gc_objects"],
        "gc_objects_end": end["gc_objects"],
        "fds_baseline": base["fds"],
        "fds_end": end["fds"],
        "threads_baseline": base["threads"],
        "threads_end": end["threads"],
        "flat": growth <= limit_mb,
    }


def summarise(
    results: list[dict[str, Any]], opts: argparse.Namespace, wall_s: float
) -> dict[str, Any]:
    memory = [memory_verdict(r["memory"], opts.iters, opts.rss_growth_mb) for r in results]
    mismatches = [m for r in results for m in r["mismatches"]]
    leaks = [{"rank": r["rank"], **leak} for r in results for leak in r["leaks"]]
    loop = max(r["loop_wall_s"] for r in results)
    passed = not mismatches and not leaks and all(m["flat"] for m in memory)
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/soak.py", *sys.argv[1:]]) if opts.from_cli else None,
        "options": {k: v for k, v in vars(opts).items() if k != "from_cli"},
        "torch": torch.__version__,
        "iterations": opts.iters,
        "world_size": opts.world_size,
        "wall_s": wall_s,
        "loop_wall_s": loop,
        "it_per_s": opts.iters / loop if loop else 0.0,
        "micro_steps": results[0]["micro_steps"],
        "no_sync_micro_steps": results[0]["no_sync_micro_steps"],
        "micro_steps_with_unused_branches": results[0]["micro_steps_with_unused_branches"],
        "checks": results[0]["checks"],
        "max_param_diff": max(r["max_param_diff"] for r in results),
        "max_grad_diff": max(r["max_grad_diff"] for r in results),
        "tolerance": opts.tolerance,
        "mismatches": mismatches,
        "leaks": leaks,
        "epochs": results[0]["epochs"],
        "memory": memory,
        "memory_samples": [r["memory"] for r in results],
        "verdict": "PASS" if passed else "FAIL",
    }


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"# gradsync soak: {s['verdict']}",
        "",
        f"- date: {s['date']}; torch {s['torch']}",
        f"- command: `{s['command'] or 'soak.main(...)'}`",
        f"- {s['iterations']} iterations at world size {s['world_size']}: {s['micro_steps']} "
        f"micro-steps per rank, {s['no_sync_micro_steps']} of them under no_sync, "
        f"{s['micro_steps_with_unused_branches']} with branches unused on some or all ranks",
        f"- wall time {s['wall_s']:.1f} s (training loop {s['loop_wall_s']:.1f} s, "
        f"{s['it_per_s']:.1f} it/s)",
        f"- {s['checks']} checks against torch's DDP: max |param diff| {s['max_param_diff']:.3g}, "
        f"max |grad diff| {s['max_grad_diff']:.3g} (tolerance {s['tolerance']:g})",
        f"- mismatches: {len(s['mismatches'])}; leaks: {len(s['leaks'])}",
        "",
        "## Wraps (a new pair of wrappers each)",
        "",
        "| epoch | from iteration | hook | bucket cap MiB | as_view | gradsync buckets |",
        "|---:|---:|---|---:|---|---:|",
    ]
    lines += [
        f"| {e['epoch']} | {e['start_iteration']} | {e['hook']} | {e['bucket_cap_mb']:g} | "
        f"{e['gradient_as_bucket_view']} | {e['gradsync_buckets']} |"
        for e in s["epochs"]
    ]
    lines += [
        "",
        "## Memory per rank (MB; baseline = first check at or after 10 % of the run)",
        "",
        "| rank | RSS start | RSS baseline (iter) | RSS end | growth | RSS after "
        "teardown | high-water | gc objects baseline → end | fds | threads | flat |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    lines += [
        (
            f"| {r} | {m['rss_start_mb']:.1f} | {m['rss_baseline_mb']:.1f} "
            f"({m['baseline_iteration']}) | {m['rss_end_mb']:.1f} | {m['rss_growth_mb']:+.1f} "
            f"| {m['rss_after_teardown_mb']:.1f} | {m['hwm_mb']:.1f} | "
            f"{m['gc_objects_baseline']} → {m['gc_objects_end']} | {m['fds_baseline']} → "
            f"{m['fds_end']} | {m['threads_baseline']} → {m['threads_end']} | {m['flat']} |"
        )
        for r, m in enumerate(s["memory"])
    ]
    for title, items in (("Mismatches", s["mismatches"]), ("Leaks", s["leaks"])):
        if items:
            lines += ["", f"## {title}", ""] + [f"- {json.dumps(i)}" for i in items]
    return "\n".join(lines) + "\n"


def print_summary(s: dict[str, Any], out: Path) -> None:
    print(f"\ngradsync soak: {s['iterations']} iterations, world size {s['world_size']}, "
          f"{s['micro_steps']} micro-steps per rank ({s['no_sync_micro_steps']} no_sync), "
          f"{len(s['epochs'])} wraps")
    print(
        f"  wall time: {s['wall_s']:.1f} s (loop "
        f"{s['loop_wall_s']:.1f} s, {s['it_per_s']:.1f} it/s)"
    )
    print(f"  max |param diff| vs torch DDP: {s['max_param_diff']:.3g}; "
          f"max |grad diff|: {s['max_grad_diff']:.3g} (tolerance {s['tolerance']:g})")
    for m in s["mismatches"][:10]:
        print(f"  MISMATCH at iteration {m['iteration']} rank {m['rank']}: {m['what']} "
              f"({m['tensor']}, diff {m['diff']})")
    for leak in s["leaks"][:10]:
        print(f"  LEAK at iteration {leak['iteration']} rank {leak['rank']}: {leak['what']}")
    for r, m in enumerate(s["memory"]):
        print(f"  rank {r}: RSS {m['rss_start_mb']:.1f} -> {m['rss_baseline_mb']:.1f} "
              f"(iter {m['baseline_iteration']}) -> {m['rss_end_mb']:.1f} MB "
              f"(growth {m['rss_growth_mb']:+.1f}), high-water {m['hwm_mb']:.1f} MB, "
              f"gc objects {m['gc_objects_baseline']} -> {m['gc_objects_end']}")
    print(f"  summary: {out / 'soak.md'}, {out / 'soak.json'}")
    print(f"RESULT: {s['verdict']}", flush=True)


# --------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=3000, help="optimizer steps (default 3000)")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--check-every", type=int, default=100, help="iterations between checks")
    parser.add_argument("--rewrap-every", type=int, default=500, help="iterations per wrapper pair")
    parser.add_argument("--out", default="out/soak", help="folder for soak.json and soak.md")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.0,
                        help="allowed max |diff| against torch's DDP (default 0: bit-identical)")
    parser.add_argument("--rss-growth-mb", type=float, default=16.0,
                        help="allowed RSS growth from 10%% of the run to the end, per rank")
    parser.add_argument("--collective-timeout", type=float, default=120.0,
                        help="seconds before a stalled collective fails the run")
    parser.add_argument("--timeout", type=float, default=None,
                        help="deadline for the whole run (default 300 s + 1 s per iteration)")
    opts = parser.parse_args(argv)
    for name in ("iters", "world_size", "check_every", "rewrap_every"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    opts.from_cli = argv is None
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = opts.timeout or 300.0 + opts.iters
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradsync-soak-") as tmp:
        results = run_processes(soak_rank, opts.world_size, os.path.join(tmp, "store"), opts,
                                timeout=deadline)
    summary = summarise(results, opts, time.perf_counter() - start)
    (out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "soak.md").write_text(markdown(summary))
    print_summary(summary, out)
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
