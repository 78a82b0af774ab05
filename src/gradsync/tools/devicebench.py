"""`gradsync bench --device cuda` (or `--device cpu`, or `--model module:function`): a training
step with and without data parallelism, torch's DDP against gradsync, on one device per rank.

Every rank runs each variant of a model from the same initial parameters on the same batches
(AdamW, the same number of steps). In every round each variant trains `--repeat` steps, the
order of variants rotating round by round; the first round is warm-up. A step's time is the
time of the round's steps over `--repeat`: from CUDA events on a GPU (so a host-bound step is
timed as the device sees it: idle while the host launches), from the host clock on CPU. Rank 0
reports medians, spreads and paired ratios with their 95 % bootstrap intervals, each variant's
peak memory (on a GPU), and the largest parameter difference from torch's DDP at the end.

Variants: the step without DDP (the floor); torch's DDP twice (the A/A pair shows the noise);
gradsync by default; gradsync with gradient_as_bucket_view; torch's DDP and gradsync with
find_unused_parameters (a pair; not under torch.compile unless named in --variants). Also
available through --variants: "gradsync no events" (the timeline not recorded).

Peak memory is what the variant would hold alone: its own state (parameters, gradients,
optimizer state, buckets; measured when it was built) plus the most its steps allocated above
what was allocated when its turn began (torch.cuda.max_memory_allocated, reset every turn).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..wrapper.ddp import DistributedDataParallel
from .bench import Comparison, interleave, markdown_table, mismatched, timed

__all__ = [
    "DEVICE_MODELS", "DEVICE_VARIANTS", "OPTIONAL_VARIANTS", "PAIRS", "Workload", "bench_model",
    "load_user_workload", "main", "summary_table",
]

DEVICE_VARIANTS = (
    "no DDP", "torch DDP", "torch DDP (again)", "gradsync", "gradsync as_view",
    "torch DDP find_unused", "gradsync find_unused",
)
OPTIONAL_VARIANTS = ("gradsync no events",)
COMPILED_VARIANTS = ("no DDP", "torch DDP", "torch DDP (again)", "gradsync", "gradsync as_view")
# (variant, baseline, column heading) of the summary table; a pair runs where both ran.
PAIRS = (
    ("torch DDP", "no DDP", "torch's DDP / no DDP"),
    ("gradsync", "torch DDP", "gradsync / torch's DDP"),
    ("gradsync as_view", "torch DDP", "gradsync as_view / torch's DDP"),
    ("gradsync as_view", "no DDP", "gradsync as_view / no DDP"),
    (
        "gradsync find_unused",
        "torch DDP find_unused",
        "gradsync / torch's DDP, find_unused_parameters",
    ),
    ("gradsync no events", "torch DDP", "gradsync no events / torch's DDP"),
    ("torch DDP (again)", "torch DDP", "A/A"),
)
REFERENCE = "torch DDP"


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, pre-norm causal self-attention
    blocks, a final LayerNorm and an LM head tied to the token embedding."""

    def __init__(
        self, vocab: int, dim: int, layers: int, heads: int, positions: int = 1024
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        h = self.blocks(self.tok(idx) + self.pos(pos), mask=mask, is_causal=True)
        return self.head(self.norm(h))


def _next_token_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    targets = torch.roll(idx, -1, dims=1)
    return nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


@dataclass
class Workload:
    """One model to bench: its module (every variant trains a copy), the batches cycled
    through, the loss of an output and its batch, autocast and torch.compile settings."""

    name: str
    model: nn.Module
    batches: list[Any]
    loss: Callable[[Any, Any], torch.Tensor]
    autocast: torch.dtype | None = None
    compile_backend: str | None = None
    variants: tuple[str, ...] = DEVICE_VARIANTS
    describe: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# name: (vocab, dim, layers, heads, batch, tokens, compiled), full and tiny (the same structure,
# for a check of the path on CPU).
SHAPES = {
    "gpt2_small": ((50257, 768, 12, 12, 8, 512, False), (512, 64, 2, 2, 4, 32, False)),
    "gpt_many": ((50257, 256, 48, 4, 8, 128, False), (256, 16, 12, 2, 2, 16, False)),
    "gpt_compiled": ((50257, 768, 4, 12, 8, 512, True), (256, 32, 2, 2, 2, 16, True)),
}
DEVICE_MODELS = tuple(SHAPES)
DESCRIBE = {
    "gpt2_small": "GPT-2-small shape",
    "gpt_many": "many-tensor GPT",
    "gpt_compiled": "GPT under torch.compile",
}


def builtin_workload(name: str, rank: int, tiny: bool, compile_backend: str,
                     device: torch.device | None = None) -> Workload:
    """A built-in model, initialised on `device` (faster on a GPU than on the host)."""
    vocab, dim, layers, heads, batch, tokens, compiled = SHAPES[name][1 if tiny else 0]
    torch.manual_seed(0)
    with device or torch.device("cpu"):
        model = GPT(vocab, dim, layers, heads, positions=max(tokens, 32))
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, vocab, (batch, tokens), generator=g) for _ in range(4)]
    describe = (
        f"{DESCRIBE[name]}{f' ({compile_backend})' if compiled else ''}: {layers} layers, d={dim}, "
        f"vocab {vocab}, tied head, bf16 autocast, {batch} x {tokens} tokens"
    )
    return Workload(name, model, batches, _next_token_loss, torch.bfloat16,
                    compile_backend if compiled else None,
                    COMPILED_VARIANTS if compiled else DEVICE_VARIANTS, describe)


# ------------------------------------------------------------------------------ user models


def default_loss(output: Any, batch: Any = None) -> torch.Tensor:
    """The loss of a user's model that brings none: output.float().pow(2).mean(), of the
    output or, for a tuple, list or dict, of its first tensor."""
    if isinstance(output, dict):
        output = next(iter(output.values()))
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output.float().pow(2).mean()


def _load_function(spec: str) -> Callable[[], Any]:
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"--model {spec!r}: expected MODULE:FUNCTION or path/to/file.py:FUNCTION")
    if module_name.endswith(".py") or os.sep in module_name:
        path = Path(module_name).resolve()
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None or not path.exists():
            raise ValueError(f"--model {spec!r}: no Python file {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules.setdefault(path.stem, module)
        loader_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` would: a module in the current folder
        module = importlib.import_module(module_name)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {function}")
    return fn


def load_user_workload(spec: str, autocast: torch.dtype | None = None,
                       compile_backend: str | None = None) -> Workload:
    """`--model module:function`: function() returns (model, batch) or (model, batch, loss_fn).
    The batch is a tensor (model(batch)), a tuple or list (model(*batch)) or a dict
    (model(**batch)); loss_fn(output, batch) returns the scalar to backpropagate (default
    `default_loss`). Called once, with torch's seed set to 0, on every rank."""
    fn = _load_function(spec)
    torch.manual_seed(0)
    got = fn()
    if (
        not isinstance(got, (tuple, list))
        or len(got) not in (2, 3)
        or not isinstance(got[0], nn.Module)
    ):
        raise ValueError(f"--model {spec!r}: the function must return (model, batch) or "
                         f"(model, batch, loss_fn), got {type(got).__name__}")
    model, batch = got[0], got[1]
    loss = got[2] if len(got) == 3 else default_loss
    describe = f"{spec}" + (", bf16 autocast" if autocast is not None else "") \
        + (f", torch.compile ({compile_backend})" if compile_backend else "")
    variants = COMPILED_VARIANTS if compile_backend else DEVICE_VARIANTS
    return Workload(spec, model, [batch], loss, autocast, compile_backend, variants, describe)


# ------------------------------------------------------------------------------- the bench


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def _call(model: Callable[..., Any], batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def _wrap(name: str, model: nn.Module, device: torch.device, group: dist.ProcessGroup | None,
          gradsync_ddp: Callable[..., Any] = DistributedDataParallel) -> nn.Module:
    """Variant `name` of `model`; `gradsync_ddp`: the gradsync class to wrap with (another
    tree's, when a benchmark compares trees on this one's models)."""
    if name == "no DDP":
        return model
    device_ids: list[int | torch.device] | None = [device] if device.type == "cuda" else None
    unused = "find_unused" in name
    if name.startswith("torch DDP"):  # "(again)": the A/A pair that shows the noise
        return nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, process_group=group, find_unused_parameters=unused
        )
    if name.startswith("gradsync"):
        ddp = gradsync_ddp(
            model,
            device_ids=device_ids,
            process_group=group,
            find_unused_parameters=unused,
            gradient_as_bucket_view="as_view" in name,
        )
        if "no events" in name and ddp.reducer is not None:
            ddp.reducer.configure(record_events=False)
        return ddp
    raise ValueError(f"unknown variant {name!r}")


class _Memory:
    """Bytes allocated on a GPU (None elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def allocated(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None


def variant_peak(own: int | None, start: int | None, peak: int | None) -> int | None:
    """What a variant would peak at alone: its own state plus the most its turn allocated above
    what was allocated when the turn began (everything else resident then included)."""
    if own is None or start is None or peak is None:
        return None
    return own + max(0, peak - start)


def _make_variant(name: str, work: Workload, device: torch.device, group: dist.ProcessGroup | None,
                  repeat: int, models: dict[str, nn.Module], peaks: dict[str, list[int]],
                  build_s: dict[str, float]) -> Callable[[], float]:
    memory = _Memory(device)
    before = memory.allocated()
    started = time.perf_counter()
    model = copy.deepcopy(work.model)  # every variant from the same parameters
    wrapped = _wrap(name, model, device, group)
    runner: Callable[..., Any] = wrapped
    if work.compile_backend:
        runner = torch.compile(wrapped, backend=work.compile_backend)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=True if device.type == "cuda" else None
    )
    step = _training_step(work, runner, opt, device)
    step()  # gradients, optimizer state, buckets (and the compiled graphs) exist from here on
    own = None if before is None else memory.allocated() - before  # type: ignore[operator]
    build_s[name] = time.perf_counter() - started
    models[name] = model

    def run() -> float:
        start = memory.allocated()
        memory.reset_peak()
        seconds = _seconds_per_step(step, repeat, device)
        got = variant_peak(own, start, memory.peak())
        if got is not None:
            peaks.setdefault(name, []).append(got)
        return seconds

    return run


def _training_step(work: Workload, runner: Callable[..., Any], opt: torch.optim.Optimizer,
                   device: torch.device) -> Callable[[], None]:
    """One optimizer step of `runner` on the workload's next batch (they take turns)."""
    counter = [0]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        batch = work.batches[counter[0] % len(work.batches)]
        if work.autocast is not None:
            with torch.autocast(device.type, dtype=work.autocast):
                out = _call(runner, batch)
        else:
            out = _call(runner, batch)
        work.loss(out, batch).backward()
        opt.step()
        counter[0] += 1

    return step


def _seconds_per_step(step: Callable[[], None], repeat: int, device: torch.device) -> float:
    """`repeat` steps back to back, timed per step: on a GPU by CUDA events around them all
    (the host returns before the device is done, so a host clock would time the launches)."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeat):
            step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / repeat
    return timed(step, repeat)


def _warm_device(work: Workload, device: torch.device) -> None:
    """One eager step on a throwaway copy: the device's libraries set up their workspaces
    before any variant is measured, so the first variant built is not charged for them."""
    model = copy.deepcopy(work.model)
    batch = work.batches[0]
    with (
        torch.autocast(device.type, dtype=work.autocast)
        if work.autocast is not None
        else contextlib.nullcontext()
    ):
        out = _call(model, batch)
    work.loss(out, batch).backward()
    del model, out
    gc.collect()


def bench_model(work: Workload, device: torch.device, group: dist.ProcessGroup | None, rounds: int,
                repeat: int, variants: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every variant of `work`, interleaved round by round (each rank calls this alike)."""
    names = tuple(variants or work.variants)
    work.model = work.model.to(device)
    work.batches = [_to(b, device) for b in work.batches]
    if device.type == "cuda":
        _warm_device(work, device)
    models: dict[str, nn.Module] = {}
    peaks: dict[str, list[int]] = {}
    build_s: dict[str, float] = {}
    if work.compile_backend:
        torch._dynamo.reset()
    runs = {v: _make_variant(v, work, device, group, repeat, models, peaks, build_s) for v in names}
    result = interleave(runs, rounds=rounds, warmup=1)
    params = [p for p in work.model.parameters() if p.requires_grad]
    data = {
        "result": result,
        "tensors": len(params),
        "parameters": sum(p.numel() for p in params),
        "nbytes": sum(p.numel() * p.element_size() for p in params),
        "peak_bytes": {v: max(got) for v, got in peaks.items()},
        "build_s": build_s,
        "same": same_parameters(models),
        "describe": work.describe,
        "rounds": rounds,
        "repeat": repeat,
    }
    del runs, models
    gc.collect()
    if work.compile_backend:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return data


def same_parameters(models: dict[str, nn.Module]) -> dict[str, float]:
    """Max |difference| of each synchronising variant's parameters to torch DDP's."""
    if REFERENCE not in models:
        return {}
    ref = [p.detach() for p in models[REFERENCE].parameters()]
    out = {}
    for name, model in models.items():
        if name in (REFERENCE, "no DDP"):
            continue
        diffs = [
            (a.detach().float() - b.float()).abs().max() for a, b in zip(model.parameters(), ref)
        ]
        out[name] = torch.stack(diffs).max().item() if diffs else 0.0
    return out


# ------------------------------------------------------------------------------- reporting


def _ratio_cell(result: Comparison, variant: str, baseline: str) -> str:
    if variant not in result.samples or baseline not in result.samples:
        return ""
    lo, hi = result.ratio_interval(variant, baseline)
    return f"{result.paired_ratio(variant, baseline):.3f} ({lo:.3f}–{hi:.3f})"


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per model: the paired ratios that answer the issue (with 95 % intervals)."""
    pairs = [(v, b, head) for v, b, head in PAIRS if any(
        v in d["result"].samples and b in d["result"].samples for d in results.values())]
    lines = ["| model | parameter tensors | " + " | ".join(head for _, _, head in pairs) + " |",
             "|---|---:|" + "---:|" * len(pairs)]
    for name, d in results.items():
        cells = [_ratio_cell(d["result"], v, b) for v, b, _ in pairs]
        lines.append(f"| {d['describe'] or name} | {d['tensors']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(name: str, data: dict[str, Any], where: str) -> str:
    result: Comparison = data["result"]
    peak = {v: f"{b / 2**20:,.0f}" for v, b in data["peak_bytes"].items()}
    build = {v: f"{s:.1f}" for v, s in data["build_s"].items()}
    extra = {"build s": build} | ({"peak MiB": peak} if peak else {})
    baseline = REFERENCE if REFERENCE in result.samples else result.variants[0]
    lines = [
        f"""### {data['describe'] if data['describe'].startswith(name)
                 else f'{name}: ' + data['describe']}""",
        f"{data['tensors']} parameter tensors, "
        f"{data['parameters'] / 1e6:.1f} M parameters ({data['nbytes'] / 2**20:.1f} MiB); "
        f"{where}; {data['rounds']} rounds x {data['repeat']} steps",
        "",
        markdown_table(result, baseline, "torch DDP (again)", "ms", 1e3, extra=extra),
        "",
    ]
    for v, b, head in PAIRS:
        cell = _ratio_cell(result, v, b)
        if cell and b != baseline:
            lines.append(f"{head}: {cell}")
    lines.append(
        "same parameters as torch DDP at the end (max |diff|): "
        + (", ".join(f"{k} {v:.1e}" for k, v in data["same"].items()) or "no torch DDP variant")
    )
    return "\n".join(lines)


def summary_json(data: dict[str, Any]) -> dict[str, Any]:
    result: Comparison = data["result"]
    names = result.variants
    out: dict[str, Any] = {
        "describe": data["describe"],
        "parameter_tensors": data["tensors"],
        "parameters": data["parameters"],
        "gradient_bytes": data["nbytes"],
        "rounds": data["rounds"],
        "repeat": data["repeat"],
        "median_ms": {v: result.median(v) * 1e3 for v in names},
        "iqr_ms": {v: [x * 1e3 for x in result.spread(v)] for v in names},
        "samples_ms": {v: [x * 1e3 for x in result.samples[v]] for v in names},
        "peak_mib": {v: b / 2**20 for v, b in data["peak_bytes"].items()},
        "build_s": data["build_s"],
        "max_param_diff_to_torch": data["same"],
        "pairs": {},
    }
    for v, b, _ in PAIRS:
        if v in result.samples and b in result.samples:
            out["pairs"][f"{v} / {b}"] = {"ratio": result.paired_ratio(v, b),
                                           "interval": list(result.ratio_interval(v, b))}
    if REFERENCE in result.samples:
        out["ratio_to_torch"] = {v: result.paired_ratio(v, REFERENCE) for v in names}
    return out


# ------------------------------------------------------------------------------- the ranks


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("gradsync bench --device cuda: no CUDA device visible to torch")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _init_group(device: torch.device) -> None:
    """torch's default group: from torchrun's environment, or a world of one without it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def _where(device: torch.device) -> str:
    world = dist.get_world_size()
    backend = dist.get_backend()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else ""
        return (
            f"world size {world} ({backend}{' ' + nccl if nccl else ''}), {name}, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, times from CUDA events"
        )
    return (
        f"world size {world} ({backend}), CPU, torch {torch.__version__}, times from the host clock"
    )


def workloads(args: argparse.Namespace, rank: int, device: torch.device) -> Iterator[Workload]:
    """The models named, built one at a time (each freed before the next is built)."""
    for name in args.device_models:
        yield builtin_workload(name, rank, args.tiny, args.compile_backend, device)
    if args.model:
        autocast = torch.bfloat16 if args.autocast == "bf16" else None
        yield load_user_workload(
            args.model, autocast, args.compile_backend if args.compile else None
        )


def main(args: argparse.Namespace) -> None:
    device = _device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    _init_group(device)
    try:
        rank = dist.get_rank()
        variants = tuple(args.variants.split(",")) if args.variants else None
        results = {}
        for work in workloads(args, rank, device):
            started, name = time.perf_counter(), work.name
            results[name] = bench_model(work, device, None, args.rounds, args.repeat, variants)
            results[name]["seconds"] = seconds = time.perf_counter() - started
            del work  # the next model is built after this one is freed
            if rank == 0:
                print(f"gradsync bench: {name} done in {seconds:.1f} s", flush=True)
        bad = write(args, results, _where(device)) if rank == 0 else {}
        gc.collect()  # free every wrapper while the group still exists
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if bad:
        raise SystemExit(f"gradsync bench: variants ended with different parameters: {bad}")


def write(
    args: argparse.Namespace, results: dict[str, dict[str, Any]], where: str
) -> dict[str, dict[str, float]]:
    """Print and write rank 0's report; return the models whose variants ended unlike torch DDP."""
    text = "\n\n".join(
        [f"## gradsync bench --device {args.device}: {where}", summary_table(results)]
        + [report(m, d, where) for m, d in results.items()]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(text + "\n")
    summary = {"where": where, "models": {m: summary_json(d) for m, d in results.items()}}
    (out / "bench.json").write_text(json.dumps(summary, indent=1))
    print(text)
    print(f"\nwritten: {out / 'bench.md'}, {out / 'bench.json'}; "
          f"{sum(d.get('seconds', 0.0) for d in results.values()):.1f} s in all", flush=True)
    return mismatched({m: d["same"] for m, d in results.items()})
