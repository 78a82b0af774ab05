"""The one-GPU check: gradsync on an NVIDIA GPU, in one command, under 5 minutes.

    python benchmarks/gpu_check.py                 # on a machine with one GPU (torch as installed)
    python benchmarks/gpu_check.py --device cpu    # the same checks' logic on CPU (gloo), here

Nothing is downloaded; gradsync comes from this source tree. Prints PASS, FAIL or SKIP per check
with its figures and writes out/gpu_check.json. One GPU cannot hold two NCCL ranks, so:

(A) NCCL at world size 1: construction with the defaults; the step path under
    torch.cuda.set_sync_debug_mode("error") (defaults, find_unused_parameters, the accumulation
    check on, ZeRO-2 stepping after backward, inside it and with overlapped gathers, ZeRO-1,
    the overlapped optimizer stepping each bucket as it lands);
    a hook whose `.then` finishes late on a stream of its own; gradients produced on a side
    stream; the event-timed timeline against the step's device time and host enqueue
    times; the stall watchdog with a slowed bucket; 256 one-parameter buckets with a hook;
    ZeroRedundancyOptimizer with sharded gradients (NCCL's reduce-scatter and all-gather)
    against plain AdamW, and with the bf16 compression hook (reduce-scattered in bfloat16);
    step time against torch's DDP on a GPT-2-small shape in bf16 autocast (a call of
    `gradsync bench --device cuda`'s: defaults, bucket views, find_unused_parameters).
(B) two ranks as two spawned processes, ONE pair for every case (gloo on CUDA tensors deadlocks
    between rank threads of one process, torch's DDP too), gloo on CUDA tensors: parity with
    torch's DDP, both wrappers trained in the same processes one after the other, for the
    defaults, bucket views, mixed precision, the fp16 hook, PowerSGD, find_unused_parameters,
    static graph, no_sync, BatchNorm buffers, ZeRO-2 (sharded gradients, stepped after
    backward and inside it, against plain SGD) and `overlap_optimizer` (each bucket stepped as it
    lands, against torch's DDP and the same SGD stepped after backward). Each case fails alone
    (its own groups, errors caught per case); mixed precision trains torch's twice (is it
    deterministic?), gradsync's, and a one-process reference with torch's arithmetic, and
    reports every pairwise difference.

    python benchmarks/gpu_check.py --only B  # rerun the (B) half alone ("--only A3": one check)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import logging
import os
import pickle
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import gradsync  # noqa: E402
from gradsync import EventKind  # noqa: E402
from gradsync.testing import make_gloo_group, run_processes, seeded  # noqa: E402

RESULTS: list[dict[str, Any]] = []
ONLY: list[str] = []  # --only: the checks to run, by their ids (A3, B) or words of their names
CHECKS: list[str] = []  # the (A) checks' names, as declared


def selected(name: str) -> bool:
    """Whether --only picks check `name`: a word that is an id ("A3", "A", "B") picks by the
    name's first word (A3 is not A30; "B" is every two-rank check), any other by a
    case-insensitive part of the name ("mixed precision")."""
    if not ONLY:
        return True
    ident = name.split()[0].upper()
    for word in (w.strip() for w in ONLY):
        if re.fullmatch(r"[ABab]\d*", word):
            if ident == word.upper() or (len(word) == 1 and ident.startswith(word.upper())):
                return True
        elif word.lower() in name.lower():
            return True
    return False


def check(name: str):
    """Run the decorated check; record PASS/FAIL/SKIP with what it returns (figures)."""

    CHECKS.append(name)

    def wrap(fn):
        def run(*args: Any) -> None:
            if not selected(name):
                return
            start = time.perf_counter()
            try:
                outcome = fn(*args)
                status, figures = ("PASS", outcome) if not isinstance(outcome, tuple) else outcome
            except Exception as error:  # noqa: BLE001 - a failing check is a result, not a crash
                status, figures = "FAIL", {"error": f"{type(error).__name__}: {error}"[:800],
                                           "trace": traceback.format_exc()[-1500:]}
            seconds = round(time.perf_counter() - start, 2)
            RESULTS.append({"check": name, "status": status, "seconds": seconds, **(figures or {})})
            shown = {k: v for k, v in (figures or {}).items() if k != "trace"}
            print(f"{status:4}  {name}  ({seconds} s)  {json.dumps(shown)[:1200]}", flush=True)

        return run

    return wrap


def mlp(width: int = 256, depth: int = 4) -> nn.Module:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 8))

    return seeded(build, 0)  # locked: rank threads share torch's global generator


class Branchy(nn.Module):
    """A branch used every other step (find_unused_parameters), and BatchNorm buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.bn, self.out = (
            nn.Linear(32, 64),
            nn.Linear(64, 64),
            nn.BatchNorm1d(64),
            nn.Linear(64, 4),
        )

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_b:
            h = h + torch.relu(self.b(h))
        return self.out(self.bn(h))


# --------------------------------------------------------------------------- (A) one rank

def world_of_one(device: torch.device) -> dist.ProcessGroup:
    if device.type == "cuda":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device)
        return dist.group.WORLD  # type: ignore[return-value]
    return make_gloo_group(dist.HashStore(), 0, 1, 60)


def steps(
    ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int, **kwargs: Any
) -> None:
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        ddp(x, **kwargs).float().pow(2).mean().backward()
        opt.step()


@check("A1 construction with defaults on the group's device")
def construction(group: dist.ProcessGroup, device: torch.device) -> dict:
    ddp = gradsync.DistributedDataParallel(mlp().to(device), process_group=group)
    return {
        "buckets": len(ddp.reducer.buckets),
        "device": str(ddp.reducer.buckets[0].buffer.device),
    }


@check("A2 step path under set_sync_debug_mode('error')")
def no_host_sync(group: dist.ProcessGroup, device: torch.device) -> Any:
    if device.type != "cuda":
        return "SKIP", {
            "why": "CUDA only (tests/threaded/test_device_paths.py is the CPU stand-in)"
        }
    figures = {}
    for name, kwargs, finite, zero in SYNC_FREE:
        ddp, opt, x = _sync_free_setup(group, device, kwargs, finite, zero)
        steps(ddp, opt, x, 3)  # construction-time reads and the bucket rebuild happen here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            steps(ddp, opt, x, 5)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        figures[name] = "no sync in 5 steps"
    return figures


# (name, wrapper keywords, NaN check, the optimizer: ZeroRedundancyOptimizer keywords, OVERLAP
# for plain SGD stepped per bucket as each lands, or None for plain SGD)
SMALL = {"bucket_cap_mb": 0.01}  # two buckets: a gather waited for by forward, one in flight
OVERLAP = "overlap"
SYNC_FREE: list[tuple[str, dict, bool, dict | str | None]] = [
    ("defaults", {}, False, None),
    ("find_unused_parameters", {"find_unused_parameters": True}, False, None),
    ("NaN check (read back deferred)", {}, True, None),
    ("ZeRO-2 (sharded gradients, SGD momentum)", SMALL, False, {}),
    (
        "ZeRO-2 stepping inside backward (overlap_with_ddp)",
        SMALL,
        False,
        {"overlap_with_ddp": True},
    ),
    ("ZeRO-2 gathers overlapped with forward", SMALL, False, {"overlap_param_gather": True}),
    ("ZeRO-1 over the wrapper", SMALL, False, {"shard_gradients": False}),
    ("overlap_optimizer: each bucket stepped as it lands, the rest in the next forward", SMALL,
     False, OVERLAP),
]


def _sync_free_setup(group: dist.ProcessGroup, device: torch.device, kwargs: dict, finite: bool,
                     zero: dict | str | None,
                     ) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = Branchy().to(device)
    ddp = gradsync.DistributedDataParallel(model, process_group=group, **kwargs)
    ddp.reducer.configure(check_accumulation=True, check_finite=finite)
    if zero == OVERLAP:
        plain = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return ddp, ddp.overlap_optimizer(plain), torch.randn(16, 32, device=device)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.01)
        if zero is None
        else gradsync.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=group, lr=0.01, momentum=0.9, **zero
        )
    )
    return ddp, opt, torch.randn(16, 32, device=device)


@check("A3 a hook whose .then finishes late on its own stream")
def late_hook(group: dist.ProcessGroup, device: torch.device) -> dict:
    side = torch.cuda.Stream() if device.type == "cuda" else None

    def doubling_late(state: Any, bucket: Any) -> torch.futures.Future:
        fut = group.allreduce([bucket.buffer()]).get_future()

        def later(f: torch.futures.Future) -> torch.Tensor:
            t = f.value()[0]
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream())
                    # ~tens of ms of GPU time before the result is ready
                    torch.cuda._sleep(50_000_000)
                t.mul_(2)
            # the hook's duty: the Future covers the current stream's work only
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
            return t

        return fut.then(later)

    model = mlp().to(device)
    reference = mlp().to(device)
    x = torch.randn(32, 256, device=device)
    reference(x).pow(2).mean().backward()
    ddp = gradsync.DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(None, doubling_late)
    ddp(x).pow(2).mean().backward()
    worst = max(
        (p.grad - 2 * r.grad).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters())
    )
    assert worst < 1e-5, (
        f"gradients written back before the hook's stream finished: off by {worst:.3g}"
    )
    return {"max_abs_error": worst}


@check("A4 gradients produced on a side stream")
def side_stream(group: dist.ProcessGroup, device: torch.device) -> Any:
    if device.type != "cuda":
        return "SKIP", {"why": "CUDA only"}
    model, reference = mlp().to(device), mlp().to(device)
    x = torch.randn(64, 256, device=device)
    reference(x).pow(2).mean().backward()
    ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # the side stream lags: a missing wait would read zeros
        ddp(x).pow(2).mean().backward()
    torch.cuda.current_stream().wait_stream(s)
    worst = max(
        (p.grad - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters())
    )
    assert worst < 1e-5, f"bucket copied before the side stream's gradients: off by {worst:.3g}"
    return {"max_abs_error": worst, "buckets": len(ddp.reducer.buckets)}


@check("A5 event-timed timeline against device and host time")
def event_timeline(group: dist.ProcessGroup, device: torch.device) -> dict:
    model = mlp(width=2048, depth=6).to(device)
    ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(512, 2048, device=device)
    steps(ddp, opt, x, 3)
    spans, device_ms, host_ms = [], [], []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss = ddp(x).pow(2).mean()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        host = time.perf_counter()
        loss.backward()
        host_ms.append((time.perf_counter() - host) * 1e3)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            device_ms.append(begin.elapsed_time(end))
        opt.step()
    for timeline in list(ddp.reducer.history)[-5:]:
        ready = timeline.times(EventKind.READY)
        complete = timeline.times(EventKind.COMPLETE)
        spans.append((max(complete.values()) - min(ready.values())) / 1e6)
    figures = {"timeline_ready_to_complete_ms": round(statistics.median(spans), 3),
               "host_enqueue_backward_ms": round(statistics.median(host_ms), 3)}
    if device_ms:
        figures["device_backward_ms"] = round(statistics.median(device_ms), 3)
        ratio = figures["timeline_ready_to_complete_ms"] / figures["device_backward_ms"]
        figures["timeline_over_device"] = round(ratio, 3)
        assert 0.5 < ratio < 1.3, "the timeline does not follow device time"
    return figures


@check("A6 stall watchdog with a slowed bucket")
def watchdog(group: dist.ProcessGroup, device: torch.device) -> dict:
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Catch()
    logging.getLogger("gradsync").addHandler(handler)

    def slow_first(state: Any, bucket: Any) -> torch.futures.Future:
        fut = default_hooks.allreduce_hook(group, bucket)
        if bucket.index() != 0:
            return fut

        # A peer that arrives late: the Future completes 1.5 s after launch, on a thread of its
        # own. (A `.then` callback would run inline when the all-reduce of a world of one has
        # already completed, stalling backward inside the hook instead of at its end.)
        late = torch.futures.Future(devices=[device] if device.type == "cuda" else None)

        def complete() -> None:
            time.sleep(1.5)
            late.set_result(fut.wait())

        threading.Thread(target=complete, daemon=True).start()
        return late

    try:
        model = mlp().to(device)
        ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
        ddp.register_comm_hook(None, slow_first)
        ddp.enable_stall_watchdog(warn_after=0.5, timeout=60, store=dist.HashStore())
        x = torch.randn(8, 256, device=device)
        start = time.perf_counter()
        ddp(x).pow(2).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        logging.getLogger("gradsync").removeHandler(handler)
    reports = [m for m in seen if "pending" in m or "stall" in m.lower()]
    assert reports, f"no stall report in {elapsed:.2f} s with warn_after=0.5 s (logged: {seen[:3]})"
    return {"seconds": round(elapsed, 2), "reports": len(reports), "first": reports[0][:200]}


@check("A7 256 one-parameter buckets with a hook")
def many_buckets(group: dist.ProcessGroup, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(256)]).to(device)
    reference = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(256)]).to(device)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, device=device)
    reference(x).pow(2).mean().backward()
    ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=1e-7)
    ddp.register_comm_hook(group, default_hooks.allreduce_hook)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
    worst = max(
        (p.grad - r.grad).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters())
    )
    assert len(ddp.reducer.buckets) == 256 and worst < 1e-6
    return {"buckets": len(ddp.reducer.buckets), "max_abs_error": worst}


@check("A9 sharded gradients (ZeRO-2): the backend's reduce-scatter and all-gather, AdamW")
def zero_sharded(group: dist.ProcessGroup, device: torch.device) -> dict:
    model, reference = mlp().to(device), mlp().to(device)
    ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
    opt = gradsync.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-3
    )
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    x = torch.randn(16, 256, device=device)
    steps(ddp, opt, x, 5)
    steps(reference, plain, x, 5)
    worst = max(
        (p - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())
    )
    assert opt.shards_gradients and worst == 0.0, f"differs from plain AdamW by {worst:.3g}"
    return {"buckets": len(ddp.reducer.buckets), "reduced_by": ddp.reducer.shards_reduced_by,
            "max_abs_diff_vs_plain_adamw": worst}


@check("A10 sharded gradients with the bf16 compression hook: reduce-scattered in bfloat16")
def zero_compressed(group: dist.ProcessGroup, device: torch.device) -> dict:
    model, reference = mlp().to(device), mlp().to(device)
    ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
    ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    opt = gradsync.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-3
    )
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    x = torch.randn(16, 256, device=device)
    steps(ddp, opt, x, 5)
    for _ in range(5):  # the hook's arithmetic at world size 1: each gradient rounded to bfloat16
        plain.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        for p in reference.parameters():
            p.grad.copy_(p.grad.to(torch.bfloat16))
        plain.step()
    worst = max(
        (p - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())
    )
    assert opt.shards_gradients and worst == 0.0, (
        f"differs from AdamW on bf16-rounded gradients by {worst:.3g}"
    )
    return {"buckets": len(ddp.reducer.buckets), "reduced_by": ddp.reducer.shards_reduced_by,
            "max_abs_diff_vs_reference": worst}


@check(
    "A8 step time against torch's DDP: GPT-2-small shape, "
    "bf16 autocast (gradsync bench --device cuda)"
)
def step_time(group: dist.ProcessGroup, device: torch.device, quick: bool) -> Any:
    """`gradsync bench --device cuda`'s GPT-2-small, in this process's world of one: torch's
    DDP twice, gradsync by default, with bucket views and with find_unused_parameters."""
    if device.type != "cuda":
        return "SKIP", {"why": "timed on a GPU only (gradsync bench times CPU runs)"}
    from gradsync.tools.devicebench import bench_model, builtin_workload, summary_json

    work = builtin_workload("gpt2_small", 0, False, "inductor", device)
    data = summary_json(bench_model(work, device, group, rounds=4 if quick else 8, repeat=5))
    ratios = {k: round(v["ratio"], 3) for k, v in data["pairs"].items()}
    worst = max(v for k, v in ratios.items() if k.startswith("gradsync") and "/ no DDP" not in k)
    same = max(data["max_param_diff_to_torch"].values())
    figures = {
        "ms_per_step": {k: round(v, 2) for k, v in data["median_ms"].items()},
        "ratios": ratios,
        "max_param_diff_to_torch": same,
    }
    return ("PASS" if worst <= 1.03 and same == 0.0 else "FAIL"), figures


# ------------------------------------------------------------------------- (B) two ranks

PARITY = {
    "defaults": {},
    "bucket views": {"gradient_as_bucket_view": True},
    "mixed precision": {"mixed": True},
    "fp16 hook": {"hook": "fp16"},
    "PowerSGD": {"hook": "powersgd"},
    "find_unused_parameters": {"find_unused_parameters": True, "branch": True},
    "static graph": {"static_graph": True},
    "no_sync": {"no_sync": True},
    "BatchNorm buffers": {"forward_sync_buffers": True},
    "ZeRO-2 (sharded gradients, SGD momentum)": {"zero": True},
    "ZeRO-2 stepping inside backward (overlap_with_ddp)": {"zero": True, "inside": True},
    # each bucket stepped as it lands, against torch's DDP + the same SGD after backward
    "overlap_optimizer (SGD momentum, small buckets)": {"overlap": True, "bucket_cap_mb": 0.01},
    # ... with the tail in chunks, one reducing at a time (tail_mb, chunk_mb, credit_mb)
    "overlap_optimizer (tail in chunks, a credit of one)": {
        "overlap": True, "bucket_cap_mb": 0.01, "tail": (0.02, 0.002, 0.002)},
}
B_STEPS, B_LR, B_MOMENTUM = 5, 0.05, 0.9
COLLECTIVE_TIMEOUT = 30.0  # s, each case's groups: a case that hangs fails alone
BARRIER_TIMEOUT = 120.0  # s, ranks meet between trainings: longer than a collective's timeout
TORCH_MP_ON_CPU = (
    "torch's DDP mixed precision needs device events ('cpu backend doesn't support events'): "
    "on CPU gradsync's is checked against the reference alone"
)


def _b_name(case: str, device: torch.device) -> str:
    return f"B parity with torch's DDP, 2 ranks (processes), gloo on {device.type} tensors: {case}"


def _mixed_policy() -> Any:
    from torch.nn.parallel.distributed import _MixedPrecision

    return _MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16
    )


def _train(
    rank: int, group: dist.ProcessGroup, cls: type, device: torch.device, spec: dict
) -> tuple[list, int]:
    """B_STEPS steps of SGD with momentum on this rank's data; parameters then float buffers, on
    CPU."""
    spec = dict(spec)
    hook, mixed, branch, no_sync = (
        spec.pop("hook", None),
        spec.pop("mixed", False),
        spec.pop("branch", False),
        spec.pop("no_sync", False),
    )
    # torch's side: plain SGD
    zero = spec.pop("zero", False) and cls is gradsync.DistributedDataParallel
    overlap = spec.pop("overlap", False) and cls is gradsync.DistributedDataParallel
    tail = spec.pop("tail", ())
    inside, warm_up = spec.pop("inside", False), spec.pop("warm_up", False)
    model = seeded(Branchy, 0).to(device)
    if mixed:  # torch's DDP policy, taken by both (torch's needs device events: CUDA only)
        spec["mixed_precision"] = _mixed_policy()
    ddp = cls(model, process_group=group, **spec)
    if warm_up:  # one iteration, then parameters and buffers as they were: its buckets are rebuilt
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ddp(
            torch.randn(8, 32, generator=torch.Generator().manual_seed(100 + rank)).to(device)
        ).float().pow(2).mean().backward()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.copy_(before[k])
        model.zero_grad(set_to_none=True)
    if hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=2,
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = (
        gradsync.ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            process_group=group,
            lr=B_LR,
            momentum=B_MOMENTUM,
            overlap_with_ddp=inside,
        )
        if zero
        else torch.optim.SGD(model.parameters(), lr=B_LR, momentum=B_MOMENTUM)
    )
    if overlap:
        opt = ddp.overlap_optimizer(opt, *tail)
    gen = torch.Generator().manual_seed(rank)
    for step in range(B_STEPS):
        opt.zero_grad(set_to_none=True)
        micro = 2 if no_sync else 1
        for j in range(micro):
            x = torch.randn(8, 32, generator=gen).to(device)
            ctx = ddp.no_sync() if j < micro - 1 else contextlib.nullcontext()
            with ctx:
                kwargs = {"use_b": step % 2 == 0} if branch else {}
                ddp(x, **kwargs).float().pow(2).mean().backward()
        opt.step()
    if overlap:
        opt.wait()  # the last buckets land in the next forward, or here
    if device.type == "cuda":
        torch.cuda.synchronize()
    params = [p.detach().float().cpu() for p in model.parameters()]
    buffers = [b.detach().float().cpu() for b in model.buffers() if b.is_floating_point()]
    return params + buffers, len(params)


def _mixed_reference(device: torch.device) -> tuple[list, int]:
    """torch's DDP mixed-precision arithmetic in one process, for the parameters: each step, per
    rank, bfloat16 copies of the float32 parameters and of the input, forward and backward in
    bfloat16 (BatchNorm on the batch's statistics: its buffers, on bfloat16 copies, do not reach
    the parameters in training mode), each gradient cast to float32 (the reduce dtype), the two
    ranks' summed then divided by 2 (torch's hook: all-reduce, then `div_`), and the same SGD."""
    from torch.func import functional_call

    model = seeded(Branchy, 0).to(device)
    names = [n for n, _ in model.named_parameters()]
    buffers = [{n: (b.detach().to(torch.bfloat16) if b.is_floating_point() else b.detach()).clone()
                for n, b in model.named_buffers()} for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=B_LR, momentum=B_MOMENTUM)
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    for _ in range(B_STEPS):
        opt.zero_grad(set_to_none=True)
        per_rank = []
        for r in range(2):
            x = torch.randn(8, 32, generator=gens[r]).to(device)
            low = {
                n: p.detach().to(torch.bfloat16).requires_grad_()
                for n, p in model.named_parameters()
            }
            out = functional_call(model, {**low, **buffers[r]}, (x.to(torch.bfloat16),))
            grads = torch.autograd.grad(out.float().pow(2).mean(), [low[n] for n in names])
            per_rank.append([g.to(torch.float32) for g in grads])
        for p, g0, g1 in zip(model.parameters(), *per_rank):
            p.grad = (g0 + g1).div_(2)
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    params = [p.detach().float().cpu() for p in model.parameters()]
    return params, len(params)


# torch's DDP mixed precision reduces garbage in its first iteration (2.13 on CPU with stand-ins
# for streams and events: gradients of 1e21-1e34): `Reducer._set_mixed_precision_param_dtype`
# gives each bucket a new flat tensor in param_dtype while the gradients' views still point into
# the old one, so the hook all-reduces uninitialised memory; the buckets rebuilt after that
# iteration are right (see tests/torch_mp_on_cpu.py). torch's, once more after a warm-up
# iteration whose effects are undone: torch's arithmetic without that first iteration.
WARMED = "torch warmed up"


def _runs(spec: dict, device: torch.device) -> list[tuple[str, Any]]:
    """The trainings of one case: gradsync's and torch's; for mixed precision, where torch's runs,
    torch's twice (is it deterministic?) and once more after a warm-up iteration (see WARMED),
    and the single-process reference."""
    runs: list[tuple[str, Any]] = [
        ("gradsync", gradsync.DistributedDataParallel),
        ("torch", TorchDDP),
    ]
    if spec.get("mixed"):
        runs = (
            runs[:1]
            if device.type != "cuda"
            else [*runs, ("torch again", TorchDDP), (WARMED, TorchDDP)]
        )
        runs.append(("reference", None))
    return runs


def _parity_ranks(
    rank: int,
    group: dist.ProcessGroup,
    device_type: str,
    cases: list[str],
    store_path: str,
    out_dir: str,
) -> int:
    """Every (B) case in this one rank process, each training on gloo groups of its own (a case
    that breaks its group or hangs fails alone); a case's results are written to out_dir as soon
    as it is done, so a crash or the deadline loses only the cases not yet reached."""
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # two ranks' thread pools on a few shared cores spin against each other (40 ms BatchNorms)
    else:
        torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    groups: list[dist.ProcessGroup] = []
    gc.collect()
    # torch's and the script's objects: the collections between trainings skip them (0.3 s each)
    gc.freeze()
    for i, case in enumerate(cases):
        spec = PARITY[case]
        record: dict[str, Any] = {"results": {}, "errors": {}, "seconds": {}}
        for label, cls in _runs(spec, device):
            start = time.perf_counter()
            # Wrappers sit in reference cycles; collected inside a communication thread's
            # callback, one would destroy its group on that group's own thread: collected here,
            # after each training (below).
            gc.disable()
            try:
                if cls is None:
                    record["results"][label] = _mixed_reference(device)
                else:
                    sub = make_gloo_group(
                        dist.PrefixStore(f"case{i}/{label}", store), rank, 2, COLLECTIVE_TIMEOUT
                    )
                    # Kept until the process ends: a hook's Future callback (PowerSGD's) can
                    # drop the last reference to its state on gloo's own thread, and a group
                    # destroyed there aborts the process ("Resource deadlock avoided").
                    groups.append(sub)
                    record["results"][label] = _train(
                        rank, sub, cls, device, {**spec, "warm_up": label == WARMED}
                    )
            except Exception as error:  # noqa: BLE001 - reported per case; the others go on
                record["errors"][label] = (
                    f"{type(error).__name__}: {error}"[:600] + "\n" + traceback.format_exc()[-1200:]
                )
            finally:
                gc.enable()
                gc.collect()
            record["seconds"][label] = round(time.perf_counter() - start, 2)
            key = f"met/{i}/{label}"  # both ranks leave this training before either starts the next
            store.set(f"{key}/{rank}", "1")
            store.wait([f"{key}/{1 - rank}"], datetime.timedelta(seconds=BARRIER_TIMEOUT))
        path = os.path.join(out_dir, f"{i}-{rank}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(record, f)
        os.replace(path + ".tmp", path)
    return len(cases)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def _judge(
    case: str, spec: dict, device: torch.device, ranks: list[dict | None], crash: str | None
) -> Any:
    """PASS/FAIL and figures for one case; a training that raised fails the case, and every
    difference the trainings that did finish allow is reported with it."""
    if any(r is None for r in ranks):
        return "FAIL", {
            "error": f"case not reached or not written by every rank ({crash or 'no reason given'})"
        }
    done = [r["results"] for r in ranks]  # type: ignore[index]
    # finished on both
    results = [{label: r[label] for label in done[0] if label in done[1]} for r in done]
    figures: dict[str, Any] = {"seconds_in_ranks": ranks[0]["seconds"]}  # type: ignore[index]
    errors = {
        f"rank {k} {label}": e
        for k, r in enumerate(ranks)
        for label, e in r["errors"].items()  # type: ignore[union-attr]
    }
    if errors:
        figures["errors"] = {k: v.split("\n")[0] for k, v in errors.items()}
        figures["trace"] = next(iter(errors.values()))
    tolerance = 1e-3 if spec.get("mixed") or spec.get("hook") else 1e-5
    if spec.get("mixed"):
        status, figures = _judge_mixed(results[0].keys(), results, tolerance, figures)
    elif {"gradsync", "torch"} <= results[0].keys():
        # Parameters and buffers against torch's, rank by rank; parameters across ranks (buffers
        # end as each rank's last batch left them).
        n = results[0]["gradsync"][1]
        worst = max(_max_diff(r["gradsync"][0], r["torch"][0]) for r in results)
        across = _max_diff(results[0]["gradsync"][0][:n], results[1]["gradsync"][0][:n])
        torch_across = _max_diff(results[0]["torch"][0][:n], results[1]["torch"][0][:n])
        figures.update(
            {
                "max_abs_diff_vs_torch": worst,
                "across_ranks": across,
                "torch_across_ranks": torch_across,
            }
        )
        status = "PASS" if worst <= tolerance and across == 0.0 else "FAIL"
        if status == "FAIL":
            figures["error"] = (
                f"differs from torch by {worst:.3g} (tolerance "
                f"{tolerance:g}), across ranks by {across:.3g}"
            )
    else:
        status = "FAIL"
    return ("FAIL" if errors else status), figures


def _judge_mixed(
    present: Any, results: list[dict], tolerance: float, figures: dict
) -> tuple[str, dict]:
    """All pairwise max |diff| of the parameters (worst rank), and of the buffers between the
    wrappers; PASS when gradsync's equals torch's (self-consistent), or the reference where
    torch's after a warm-up iteration equals the reference, or torch's is not self-consistent,
    or does not run."""
    labels = [
        label
        for label in ("gradsync", "torch", "torch again", WARMED, "reference")
        if label in present
    ]
    pairs: dict[str, float] = {}
    buffers: dict[str, float] = {}
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            n = results[0][a][1]
            pairs[f"{a} vs {b}"] = max(_max_diff(r[a][0][:n], r[b][0][:n]) for r in results)
            if "reference" not in (a, b):
                buffers[f"{a} vs {b}"] = max(_max_diff(r[a][0][n:], r[b][0][n:]) for r in results)
    across = {
        label: _max_diff(
            results[0][label][0][: results[0][label][1]],
            results[1][label][0][: results[1][label][1]],
        )
        for label in labels
    }
    figures.update(
        {"params_max_abs_diff": pairs, "buffers_max_abs_diff": buffers, "across_ranks": across}
    )
    if "torch" not in labels and "torch" not in str(figures.get("errors")):
        figures["torch"] = "skipped: " + TORCH_MP_ON_CPU
    inf = float("inf")
    twice = "torch vs torch again" in pairs
    consistent = twice and pairs["torch vs torch again"] == 0.0
    warmed_ok = pairs.get(f"{WARMED} vs reference", inf) <= tolerance
    if consistent and pairs.get("gradsync vs torch", inf) <= tolerance:
        judged_by, diff = "torch's (self-consistent)", pairs["gradsync vs torch"]
    elif "gradsync vs reference" in pairs and (
        warmed_ok or (twice and not consistent) or "torch" in figures
    ):
        why = ("torch's after a warm-up iteration equals it" if warmed_ok else
               "torch's differs from itself" if twice else "torch's does not run here")
        judged_by, diff = f"reference ({why})", pairs["gradsync vs reference"]
    elif "gradsync vs torch" in pairs:
        judged_by, diff = "torch's", pairs["gradsync vs torch"]
    else:
        figures["error"] = "nothing to judge gradsync's against"
        return "FAIL", figures
    figures["judged_against"], figures["bit_equal"] = judged_by, diff == 0.0
    if diff <= tolerance and across["gradsync"] == 0.0:
        return "PASS", figures
    figures["error"] = (f"gradsync differs from the {judged_by.split(' (')[0]} by {diff:.3g} "
                        f"(tolerance {tolerance:g}), across ranks by {across['gradsync']:.3g}")
    return "FAIL", figures


def parity(device: torch.device, timeout: float) -> None:
    """Every selected (B) case in ONE spawned pair of rank processes (gloo on CUDA tensors
    deadlocks between rank threads of one process, torch's DDP too); each case reported as a
    check of its own."""
    cases = [case for case in PARITY if selected(_b_name(case, device))]
    if not cases:
        return
    crash = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-b-") as tmp:
        try:
            run_processes(
                _parity_ranks,
                2,
                device.type,
                cases,
                os.path.join(tmp, "store"),
                tmp,
                timeout=timeout,
            )
        except Exception as error:  # noqa: BLE001 - the cases written so far are still reported
            crash = f"{type(error).__name__}: {error}"[:600]
        ranks: dict[int, list[dict | None]] = {}
        for i in range(len(cases)):
            ranks[i] = []
            for rank in range(2):
                path = os.path.join(tmp, f"{i}-{rank}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        ranks[i].append(pickle.load(f))
                else:
                    ranks[i].append(None)
    seconds = round(time.perf_counter() - start, 1)
    print(f"      B: {len(cases)} cases in one pair of rank processes in {seconds} s"
          + (f"; the pair ended with {crash.splitlines()[0]}" if crash else ""), flush=True)
    B_SUMMARY.update({"cases": len(cases), "seconds": seconds, "error": crash})
    for i, case in enumerate(cases):
        @check(_b_name(case, device))
        def one(i: int = i, case: str = case) -> Any:
            return _judge(case, PARITY[case], device, ranks[i], crash)

        one()


B_SUMMARY: dict[str, Any] = {}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
    parser.add_argument("--out", default=str(ROOT / "out" / "gpu_check.json"))
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="WORDS",
        help=(
            "run only these checks (repeatable), for a rerun: an id (A3; A or B for a "
            "whole half) or words of a check's name ('mixed precision')"
        ),
    )
    parser.add_argument(
        "--b-timeout",
        type=float,
        default=240.0,
        metavar="S",
        help="deadline for the (B) pair of rank processes; cases done by then are reported",
    )
    args = parser.parse_args()
    ONLY.extend(args.only)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "FAIL  no CUDA device visible to torch (use "
            "--device cpu to run the checks' logic on CPU)"
        )
        return 1
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"{torch.cuda.get_device_name(device)}, "
            f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
            flush=True,
        )
    start = time.perf_counter()
    if any(selected(name) for name in CHECKS):  # the (A) checks, declared above
        group = world_of_one(device)
        construction(group, device)
        no_host_sync(group, device)
        late_hook(group, device)
        side_stream(group, device)
        event_timeline(group, device)
        watchdog(group, device)
        many_buckets(group, device)
        zero_sharded(group, device)
        zero_compressed(group, device)
        step_time(group, device, args.quick)
    parity(device, args.b_timeout)
    if dist.is_initialized():
        dist.destroy_process_group()
    failed = [r["check"] for r in RESULTS if r["status"] == "FAIL"]
    summary = {
        "device": str(device),
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "passed": sum(r["status"] == "PASS" for r in RESULTS),
        "failed": failed,
        "skipped": sum(r["status"] == "SKIP" for r in RESULTS),
        "b_pair": B_SUMMARY,
        "checks": RESULTS,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"{'FAIL' if failed else 'PASS'}: {summary['passed']} passed, {len(failed)} failed, "
          f"{summary['skipped']} skipped in {summary['seconds']} s; {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
