"""The one-GPU check: gradsync on an NVIDIA GPU, in one command, under 5 minutes.

    python benchmarks/gpu_check.py                 # on a machine with one GPU (torch as installed)
    python benchmarks/gpu_check.py --device cpu    # the same checks' logic on CPU (gloo), here

Nothing is downloaded; gradsync comes from this source tree. Prints PASS, FAIL or SKIP per check
with its figures and writes out/gpu_check.json. One GPU cannot hold two NCCL ranks, so:

(A) NCCL at world size 1: construction with the defaults; the step path under
    torch.cuda.set_sync_debug_mode("error") (defaults, find_unused_parameters, the accumulation
    check on, ZeRO-2 stepping after backward, inside it and with overlapped gathers, ZeRO-1);
    a hook whose `.then` finishes late on a stream of its own; gradients produced on a side
    stream; the event-timed timeline against the step's device time and host enqueue
    times; the stall watchdog with a slowed bucket; 256 one-parameter buckets with a hook;
    ZeroRedundancyOptimizer with sharded gradients (NCCL's reduce-scatter and all-gather)
    against plain AdamW, and with the bf16 compression hook (reduce-scattered in bfloat16);
    step time against torch's DDP on a GPT-2-small shape in bf16
    autocast (defaults and find_unused_parameters).
(B) two ranks (threads) with gloo on CUDA tensors: parity with torch's DDP for the defaults,
    bucket views, mixed precision, the fp16 hook, PowerSGD, find_unused_parameters, static
    graph, no_sync, BatchNorm buffers and ZeRO-2 (sharded gradients, stepped after backward and
    inside it, against plain SGD).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import statistics
import sys
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
from gradsync.testing import make_gloo_group, run_processes, run_threaded, seeded  # noqa: E402

RESULTS: list[dict[str, Any]] = []
ONLY: list[str] = []  # --only: the checks to run, by words of their names


def check(name: str):
    """Run the decorated check; record PASS/FAIL/SKIP with what it returns (figures)."""

    def wrap(fn):
        def run(*args: Any) -> None:
            if ONLY and not any(word.lower() in name.lower() for word in ONLY):
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
            print(f"{status:4}  {name}  ({seconds} s)  {json.dumps(shown)[:400]}", flush=True)

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
        self.a, self.b, self.bn, self.out = nn.Linear(32, 64), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 4)

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


def steps(ddp: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int, **kwargs: Any) -> None:
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        ddp(x, **kwargs).float().pow(2).mean().backward()
        opt.step()


@check("A1 construction with defaults on the group's device")
def construction(group: dist.ProcessGroup, device: torch.device) -> dict:
    ddp = gradsync.DistributedDataParallel(mlp().to(device), process_group=group)
    return {"buckets": len(ddp.reducer.buckets), "device": str(ddp.reducer.buckets[0].buffer.device)}


@check("A2 step path under set_sync_debug_mode('error')")
def no_host_sync(group: dist.ProcessGroup, device: torch.device) -> Any:
    if device.type != "cuda":
        return "SKIP", {"why": "CUDA only (tests/threaded/test_device_paths.py is the CPU stand-in)"}
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


# (name, wrapper keywords, NaN check, ZeroRedundancyOptimizer keywords or None for plain SGD)
SMALL = {"bucket_cap_mb": 0.01}  # two buckets: a gather waited for by forward, one in flight
SYNC_FREE: list[tuple[str, dict, bool, dict | None]] = [
    ("defaults", {}, False, None),
    ("find_unused_parameters", {"find_unused_parameters": True}, False, None),
    ("NaN check (read back deferred)", {}, True, None),
    ("ZeRO-2 (sharded gradients, SGD momentum)", SMALL, False, {}),
    ("ZeRO-2 stepping inside backward (overlap_with_ddp)", SMALL, False, {"overlap_with_ddp": True}),
    ("ZeRO-2 gathers overlapped with forward", SMALL, False, {"overlap_param_gather": True}),
    ("ZeRO-1 over the wrapper", SMALL, False, {"shard_gradients": False}),
]


def _sync_free_setup(group: dist.ProcessGroup, device: torch.device, kwargs: dict, finite: bool,
                     zero: dict | None) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = Branchy().to(device)
    ddp = gradsync.DistributedDataParallel(model, process_group=group, **kwargs)
    ddp.reducer.configure(check_accumulation=True, check_finite=finite)
    opt = (torch.optim.SGD(model.parameters(), lr=0.01) if zero is None else
           gradsync.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group,
                                            lr=0.01, momentum=0.9, **zero))
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
                    torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the result is ready
                t.mul_(2)
            return t

        return fut.then(later)

    model = mlp().to(device)
    reference = mlp().to(device)
    x = torch.randn(32, 256, device=device)
    reference(x).pow(2).mean().backward()
    ddp = gradsync.DistributedDataParallel(model, process_group=group)
    ddp.register_comm_hook(None, doubling_late)
    ddp(x).pow(2).mean().backward()
    worst = max((p.grad - 2 * r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    assert worst < 1e-5, f"gradients written back before the hook's stream finished: off by {worst:.3g}"
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
    worst = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
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
    worst = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    assert len(ddp.reducer.buckets) == 256 and worst < 1e-6
    return {"buckets": len(ddp.reducer.buckets), "max_abs_error": worst}


@check("A9 sharded gradients (ZeRO-2): the backend's reduce-scatter and all-gather, AdamW")
def zero_sharded(group: dist.ProcessGroup, device: torch.device) -> dict:
    model, reference = mlp().to(device), mlp().to(device)
    ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
    opt = gradsync.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-3)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    x = torch.randn(16, 256, device=device)
    steps(ddp, opt, x, 5)
    steps(reference, plain, x, 5)
    worst = max((p - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    assert opt.shards_gradients and worst == 0.0, f"differs from plain AdamW by {worst:.3g}"
    return {"buckets": len(ddp.reducer.buckets), "reduced_by": ddp.reducer.shards_reduced_by,
            "max_abs_diff_vs_plain_adamw": worst}


@check("A10 sharded gradients with the bf16 compression hook: reduce-scattered in bfloat16")
def zero_compressed(group: dist.ProcessGroup, device: torch.device) -> dict:
    model, reference = mlp().to(device), mlp().to(device)
    ddp = gradsync.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.05)
    ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    opt = gradsync.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, lr=1e-3)
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    x = torch.randn(16, 256, device=device)
    steps(ddp, opt, x, 5)
    for _ in range(5):  # the hook's arithmetic at world size 1: each gradient rounded to bfloat16
        plain.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        for p in reference.parameters():
            p.grad.copy_(p.grad.to(torch.bfloat16))
        plain.step()
    worst = max((p - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))
    assert opt.shards_gradients and worst == 0.0, f"differs from AdamW on bf16-rounded gradients by {worst:.3g}"
    return {"buckets": len(ddp.reducer.buckets), "reduced_by": ddp.reducer.shards_reduced_by,
            "max_abs_diff_vs_reference": worst}


def gpt2_small(device: torch.device) -> nn.Module:
    torch.manual_seed(0)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(50257, 768), nn.Embedding(1024, 768)
            layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(768)
            self.head = nn.Linear(768, 50257, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
            h = self.blocks(self.tok(idx) + self.pos(pos), mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return GPT().to(device)


@check("A8 step time against torch's DDP: GPT-2-small shape, bf16 autocast")
def step_time(group: dist.ProcessGroup, device: torch.device, quick: bool) -> Any:
    if device.type != "cuda":
        return "SKIP", {"why": "timed on a GPU only (gradsync bench times CPU runs)"}
    idx = torch.randint(0, 50257, (8, 512), device=device)
    figures: dict[str, Any] = {}
    for name, kwargs in [("defaults", {}), ("find_unused_parameters", {"find_unused_parameters": True})]:
        variants = {}
        for label, cls in [("torch", TorchDDP), ("gradsync", gradsync.DistributedDataParallel), ("torch again", TorchDDP)]:
            model = gpt2_small(device)
            variants[label] = (cls(model, process_group=group, **kwargs),
                               torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(3 if quick else 6):  # rounds, variants interleaved
            for label, (ddp, opt) in variants.items():
                for _ in range(2):  # warm-up steps of this round
                    _gpt_step(ddp, opt, idx)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(5):
                    _gpt_step(ddp, opt, idx)
                end.record()
                end.synchronize()
                times[label].append(begin.elapsed_time(end) / 5)
        ms = {k: round(statistics.median(v), 2) for k, v in times.items()}
        paired = statistics.median(g / t for g, t in zip(times["gradsync"], times["torch"]))
        noise = statistics.median(a / t for a, t in zip(times["torch again"], times["torch"]))
        figures[name] = {"ms_per_step": ms, "gradsync_over_torch": round(paired, 3), "torch_aa": round(noise, 3)}
        del variants
        torch.cuda.empty_cache()
    worst = max(f["gradsync_over_torch"] for f in figures.values())
    return ("PASS" if worst <= 1.05 else "FAIL"), figures


def _gpt_step(ddp: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = ddp(idx)
    nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), idx.view(-1)).backward()
    opt.step()


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
    "BatchNorm buffers": {"broadcast_buffers": True},
    "ZeRO-2 (sharded gradients, SGD momentum)": {"zero": True},
    "ZeRO-2 stepping inside backward (overlap_with_ddp)": {"zero": True, "inside": True},
}


def _train(rank: int, group: dist.ProcessGroup, cls: type, device: torch.device, spec: dict) -> list[torch.Tensor]:
    spec = dict(spec)
    hook, mixed, branch, no_sync = spec.pop("hook", None), spec.pop("mixed", False), spec.pop("branch", False), spec.pop("no_sync", False)
    zero = spec.pop("zero", False) and cls is gradsync.DistributedDataParallel  # torch's side: plain SGD
    inside = spec.pop("inside", False)
    model = seeded(Branchy, 0).to(device)  # locked: the rank threads share torch's generator
    if mixed:  # torch's DDP policy, taken by both (torch's needs device events: CUDA only)
        from torch.nn.parallel.distributed import _MixedPrecision

        spec["mixed_precision"] = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                  buffer_dtype=torch.bfloat16)
    ddp = cls(model, process_group=group, **spec)
    if hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                   min_compression_rate=0.5, use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    opt = (gradsync.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group, lr=0.05,
                                            momentum=0.9, overlap_with_ddp=inside) if zero
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    gen = torch.Generator().manual_seed(rank)
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        micro = 2 if no_sync else 1
        for j in range(micro):
            x = torch.randn(8, 32, generator=gen).to(device)
            ctx = ddp.no_sync() if j < micro - 1 else contextlib.nullcontext()
            with ctx:
                kwargs = {"use_b": step % 2 == 0} if branch else {}
                ddp(x, **kwargs).float().pow(2).mean().backward()
        opt.step()
    params = [p.detach().float().cpu() for p in model.parameters()]
    buffers = [b.detach().float().cpu() for b in model.buffers() if b.is_floating_point()]
    return params + buffers, len(params)


def _threads(cls: type, device: torch.device, spec: dict) -> list:
    # Wrappers sit in reference cycles; collected inside a communication thread's callback,
    # one would destroy its process group on that group's own thread. Collected here instead.
    gc.collect()
    gc.disable()
    try:
        return run_threaded(_train, 2, cls, device, spec, timeout=120)
    finally:
        gc.enable()
        gc.collect()


def _processes(cls: type, device: torch.device, spec: dict) -> list:
    return run_processes(_train, 2, cls, device, spec, timeout=180)


def parity(device: torch.device) -> None:
    for name, spec in PARITY.items():
        @check(f"B parity with torch's DDP, 2 ranks, gloo on {device.type} tensors: {name}")
        def one(spec: dict = spec) -> dict:
            if spec.get("mixed") and device.type != "cuda":
                return "SKIP", {"why": "torch's DDP mixed precision needs device events (tests/threaded/test_ddp.py checks gradsync's against a direct reference)"}
            # PowerSGD seeds torch's global generator inside its hook: rank threads would race on
            # it, so that case runs its ranks as processes.
            ranks = _processes if spec.get("hook") == "powersgd" else _threads
            ours = ranks(gradsync.DistributedDataParallel, device, spec)
            theirs = ranks(TorchDDP, device, spec)
            # Parameters and buffers against torch's, rank by rank; parameters across ranks
            # (buffers end as each rank's last batch left them).
            worst = max((a - b).abs().max().item() for (o, _), (t, _) in zip(ours, theirs) for a, b in zip(o, t))
            n = ours[0][1]
            across = max((a - b).abs().max().item() for a, b in zip(ours[0][0][:n], ours[1][0][:n]))
            tolerance = 1e-3 if spec.get("mixed") or spec.get("hook") else 1e-5
            assert worst <= tolerance and across == 0.0, f"differs from torch by {worst:.3g}, across ranks by {across:.3g}"
            return {"max_abs_diff_vs_torch": worst, "across_ranks": across}

        one()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds")
    parser.add_argument("--out", default=str(ROOT / "out" / "gpu_check.json"))
    parser.add_argument("--only", action="append", default=[], metavar="WORDS",
                        help="run only the checks whose name contains WORDS (repeatable), for a rerun")
    args = parser.parse_args()
    ONLY.extend(args.only)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL  no CUDA device visible to torch (use --device cpu to run the checks' logic on CPU)")
        return 1
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(device)}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    start = time.perf_counter()
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
    parity(device)
    if dist.is_initialized():
        dist.destroy_process_group()
    failed = [r["check"] for r in RESULTS if r["status"] == "FAIL"]
    summary = {"device": str(device), "torch": torch.__version__, "seconds": round(time.perf_counter() - start, 1),
               "passed": sum(r["status"] == "PASS" for r in RESULTS), "failed": failed,
               "skipped": sum(r["status"] == "SKIP" for r in RESULTS), "checks": RESULTS}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"{'FAIL' if failed else 'PASS'}: {summary['passed']} passed, {len(failed)} failed, "
          f"{summary['skipped']} skipped in {summary['seconds']} s; {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
