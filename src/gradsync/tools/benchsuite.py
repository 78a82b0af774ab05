"""`gradsync bench`: gradsync against torch's DDP, side by side, on a small benchmark set.

Run through torch's launcher (`gradsync bench` does it): every rank builds each variant from the
same seed; in every round each variant trains `--repeat` steps on the same batches (the order of
variants rotates round by round; the first rounds are warm-up, long enough for planned
buckets to finish their trial). Rank 0 reports medians, spreads
and paired ratios to torch's DDP, the measured all-reduce cost, each model's communication
floor and the CPU time an all-reduce costs the machine (and the floor that counts it), each
variant's CPU time per step on the rank (how close its step is to being CPU-bound), checks
that every synchronising variant ended with the same parameters, and writes a markdown table,
a JSON file and a PNG chart.

Variants: torch's DDP (twice: the A/A pair shows the noise); gradsync default; gradsync with
gradient_as_bucket_view; gradsync with planned buckets (`bucket_cap_mb="auto"`); gradsync
overlap (`overlap_optimizer`: each bucket stepped as it lands, the tail sent nearest the input
first, the next forward over it), and the same on planned buckets, whose trial then learns the
tail too; no overlap (plain
backward, then one flat all-reduce); and the compute-only floor (no communication at all).

With --device cuda (or cpu) or --model: the device bench (`gradsync.tools.devicebench`,
described at the end of --help): GPU-sized models, CUDA-event times, peak memory, your own model.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..planning.autoplan import AutoBuckets
from ..planning.planner import measure_comm_cpu, probe_cost_model, probe_sizes
from ..wrapper.ddp import DistributedDataParallel
from ..wrapper.overlap import MeasuredTail
from .bench import Comparison, interleave, markdown_table, mismatched, timed

__all__ = ["CLUSTER_MODELS", "LOOPBACK_MODELS", "MODELS", "build_parser", "main", "mismatched"]

VARIANTS = (
    "torch DDP",
    "torch DDP (again)",
    "gradsync",
    "gradsync as_view",
    "gradsync planned",
    "gradsync overlap",
    "gradsync overlap planned",
    "no overlap",
    "compute only",
)


class TinyGPT(nn.Module):
    """A small GPT-style decoder: embeddings, causal self-attention blocks, LM head."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        block = nn.TransformerEncoderLayer(
            dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.blocks(self.embed(tokens) + self.pos(positions), mask=self.mask, is_causal=True)
        return self.head(h)


def _many_small() -> tuple[nn.Module, Callable[[torch.Generator], torch.Tensor]]:
    return (
        nn.Sequential(*[nn.Linear(16, 16) for _ in range(100)]),
        lambda g: torch.randn(32, 16, generator=g),
    )


def _gpt():
    return TinyGPT(), lambda g: torch.randint(0, 256, (8, 32), generator=g)


def _convnet():
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 10),
    )
    return model, lambda g: torch.randn(16, 3, 32, 32, generator=g)


def _wide_mlp():
    return (
        nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]),
        lambda g: torch.randn(32, 1024, generator=g),
    )


class ResidualMLP(nn.Module):
    """`layers` residual blocks x + tanh(linear(x)) / 8 (bounded, so 100 of them stay finite):
    many tensors, each ready in turn."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x)) / 8
        return x


# Sized for a slow network (the cluster models), where compute and communication are
# of one order (figures: docs/benchmarks/design-figures.md#cluster-bench-models).
def _residual_mlp():  # 200 tensors, 14 MiB
    return ResidualMLP(192, 100), lambda g: torch.randn(256, 192, generator=g)


def _gpt_16mib():  # 64 tensors, 16 MiB
    return (
        TinyGPT(vocab=512, dim=256, layers=5, seq=64),
        lambda g: torch.randint(0, 512, (8, 64), generator=g),
    )


def _convnet_12mib():  # 12 tensors, 12 MiB (8 of them in the first linear, ready early)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(128, 256, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(256, 256, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(256 * 16, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )
    return model, lambda g: torch.randn(16, 3, 32, 32, generator=g)


def _wide_mlp_64mib():  # 8 tensors, 64 MiB: communication-bound
    return (
        nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]),
        lambda g: torch.randn(128, 2048, generator=g),
    )


MODELS = {
    "many_small": _many_small, "tiny_gpt": _gpt, "convnet": _convnet, "wide_mlp": _wide_mlp,
    "residual_mlp": _residual_mlp, "gpt_16mib": _gpt_16mib, "convnet_12mib": _convnet_12mib,
    "wide_mlp_64mib": _wide_mlp_64mib,
}
LOOPBACK_MODELS = ("many_small", "tiny_gpt", "convnet", "wide_mlp")
CLUSTER_MODELS = ("residual_mlp", "gpt_16mib", "convnet_12mib", "wide_mlp_64mib")


class _FlatAfterBackward(nn.Module):
    """No overlap: gradients all-reduced in one flat message after backward returns."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.module, self.group = module, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def sync(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(dist.get_world_size(self.group))
        parts = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(parts, grads)])


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _wrap_variant(name: str, model: nn.Module) -> nn.Module:
    """The variant's wrapper around `model`, chosen by its name (`VARIANTS`)."""
    if name.startswith("torch DDP"):  # "(again)": the A/A pair that shows the noise
        return nn.parallel.DistributedDataParallel(model)
    if name.startswith("gradsync"):
        kwargs: dict[str, Any] = {"gradient_as_bucket_view": True} if "as_view" in name else {}
        if "planned" in name:
            kwargs["bucket_cap_mb"] = "auto"
        return DistributedDataParallel(model, **kwargs)
    if name == "no overlap":
        return _FlatAfterBackward(model, None)
    return model


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    # torch's fused CPU kernel: one pass over each parameter, where the default per-tensor
    # loop makes about ten (about five times faster on one core, and less of the core taken)
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True),
}


def _tail_mb(name: str, model: nn.Module) -> float | None:
    """The tail of an overlap variant named "gradsync overlap, tail P%" (`--overlap-tails`): P %
    of the model's gradients; None (the default tail) for the others."""
    if ", tail " not in name:
        return None
    tail = name.rsplit(" ", 1)[1]
    if tail.endswith("MiB"):
        return float(tail[:-3])
    share = float(tail.rstrip("%")) / 100
    return share * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def _measured(wrapped: Any) -> str:
    """What `overlap.MeasuredTail` chose: the tail, the backlog it tried, how it scored."""
    measured = wrapped.measured_tail
    if measured is None or measured.tail is None:
        return "tail not decided yet"
    tried = "" if measured.backlog is None else f"; backlog {measured.backlog / 2**20:.2f} MiB"
    scored = "" if measured.score is None else (
        f", its steps x{measured.score:.3f} the default tail's")
    return f"tail measured: {measured.tail / 2**20:.2f} MiB{tried}{scored}"


def _make_variant(
    name: str, model_name: str, rank: int, repeat: int, state: dict, cpu: dict[str, list],
    optimizer: str = "sgd",
):
    torch.manual_seed(0)
    model, make_input = MODELS[model_name]()
    wrapped = _wrap_variant(name, model)
    opt = OPTIMIZERS[optimizer](model.parameters())
    # each bucket stepped as it lands, the next forward over the tail
    if name.startswith("gradsync overlap"):
        opt = wrapped.overlap_optimizer(opt, tail_mb=_tail_mb(name, model))  # type: ignore[operator]
    land = getattr(opt, "wait", lambda: None)
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [make_input(g) for _ in range(4)]
    counter = [0]

    def step() -> None:
        opt.zero_grad()
        _loss(wrapped(batches[counter[0] % len(batches)])).backward()
        if isinstance(wrapped, _FlatAfterBackward):
            wrapped.sync()
        opt.step()
        counter[0] += 1

    def run() -> float:
        # The CPU time of every thread of this rank (gloo's too, and the kernel's network work
        # charged to them), per step and as a share of the steps' wall time.
        # And the whole machine's (every rank, the kernel's network work wherever charged).
        cpu_start, wall_start, machine_start = (time.process_time(), time.perf_counter(),
                                                _machine_busy())
        seconds = timed(step, repeat)
        land()  # the last step's tail, before the next variant runs (timed in the next round)
        busy = time.process_time() - cpu_start
        machine = _machine_busy() - machine_start
        cpu.setdefault(name, []).append((busy / repeat, busy / (time.perf_counter() - wall_start),
                                         machine / repeat))
        return seconds

    state[name] = model
    if "planned" in name:
        state["plan of " + name] = lambda: str(wrapped.bucket_plan())  # type: ignore[operator]
    elif name == "gradsync overlap":  # the tail it measured (`overlap.MeasuredTail`)
        state["plan of " + name] = lambda: _measured(wrapped)
    return run


def run_model(model_name: str, rounds: int, repeat: int, rank: int, settle: bool = True,
              optimizer: str = "sgd", names: tuple[str, ...] = VARIANTS) -> dict:
    models: dict[str, nn.Module] = {}
    cpu: dict[str, list[tuple[float, ...]]] = {}
    variants = {v: _make_variant(v, model_name, rank, repeat, models, cpu, optimizer)
                for v in names}
    # Warm-up (two rounds: the rebuild after the first iteration), long enough with planned
    # variants for "auto" to measure, plan and finish its trial before timing starts
    # (every variant trains the same steps, so all still end with the same parameters). A smoke
    # run (`settle=False`) times planned buckets mid-trial: it checks that they run and stay exact.
    planner, planned = AutoBuckets(), [v for v in names if "planned" in v]
    settles = 0 if not (settle and planned) else (
        planner.tail_decided_by if "gradsync overlap planned" in planned else planner.decided_by)
    if settle and "gradsync overlap" in names:  # its tail measured before timing starts
        settles = max(settles, MeasuredTail(0, 0).decided_by + 1)
    result = interleave(variants, rounds=rounds, warmup=max(2, math.ceil(settles / repeat)))
    nbytes = sum(p.numel() * p.element_size() for p in models["torch DDP"].parameters())
    cost = probe_cost_model(dist.group.WORLD, sizes=probe_sizes(nbytes), repeats=3)  # type: ignore[arg-type]
    comm_cpu = measure_comm_cpu(dist.group.WORLD, nbytes)  # type: ignore[arg-type]
    plans = {
        k: models.pop(k)()  # type: ignore[operator]
        for k in [k for k in models if k.startswith("plan of ")]
    }
    same = _same_parameters(models)
    return {
        "result": result,
        "nbytes": nbytes,
        "cost": cost,
        "same": same,
        "plans": plans,
        "comm_cpu": comm_cpu,
        # the timed rounds, after the warm-up
        "cpu": {v: got[-rounds:] for v, got in cpu.items()},
    }


def _same_parameters(models: dict[str, nn.Module]) -> dict[str, float]:
    """Max |difference| of each synchronising variant's parameters to torch DDP's."""
    ref = [p.detach() for p in models["torch DDP"].parameters()]
    out = {}
    for name, model in models.items():
        if name in ("torch DDP", "compute only"):
            continue
        out[name] = max(
            (a.detach() - b).abs().max().item() for a, b in zip(model.parameters(), ref)
        )
    return out


def report(model_name: str, data: dict, rounds: int, repeat: int) -> str:
    result: Comparison = data["result"]
    cost = data["cost"]
    floor = cost.time_ms(data["nbytes"])
    lines = [
        f"### {model_name}: {data['nbytes'] / 2**20:.2f} MiB of gradients, world size "
        f"{dist.get_world_size()}, {rounds} rounds x {repeat} steps",
        "",
        markdown_table(result, "torch DDP", "torch DDP (again)", "ms", 1e3),
        "",
        f"all-reduce here ≈ {cost.alpha_ms:.3f} ms + {cost.beta_ms_per_byte * 2**20:.3f} ms/MiB "
        f"({cost.bandwidth_gbps:.2f} GB/s); communication floor for this model: {floor:.2f} ms",
        _floor_line(result, _floor_ms(data)),
        *_cpu_floor_lines(data),
        *_cpu_use_lines(data),
        *_against_plain_lines(result),
        "same parameters as torch DDP (max |diff|): "
        + ", ".join(f"{k} {v:.1e}" for k, v in data["same"].items()),
        *(f"{k[len('plan of '):]}: {v}" for k, v in data["plans"].items()),
    ]
    return "\n".join(lines)


def _floor_ms(data: dict, compute_extra_ms: float = 0.0) -> float:
    """The best a step can be: compute (plus `compute_extra_ms`) and communication overlapped
    perfectly."""
    compute = data["result"].median("compute only") * 1e3 + compute_extra_ms
    return max(compute, data["cost"].time_ms(data["nbytes"]))


def _cpu_floor_ms(data: dict) -> float | None:
    """The floor where moving the bytes takes CPU from compute (every core computing, as on
    the emulated cluster and loopback): max(compute + the all-reduce's CPU per core,
    communication). None where the CPU cost was not measured."""
    cpu = data.get("comm_cpu")
    return None if cpu is None else _floor_ms(data, cpu.per_core_ms)


def _cpu_floor_lines(data: dict) -> list[str]:
    cpu, floor = data.get("comm_cpu"), _cpu_floor_ms(data)
    if cpu is None or floor is None:
        return []
    return [
        "an all-reduce of these gradients keeps this machine's CPUs busy "
        f"{cpu.busy_ms:.1f} ms ({cpu.per_core_ms:.1f} ms on each of {cpu.cores} cores) "
        f"over its {cpu.allreduce_ms:.1f} ms; with every core computing, "
        f"that floor is max(compute + {cpu.per_core_ms:.1f}, communication) = {floor:.2f} ms",
        _floor_line(data["result"], floor, "with the links' CPU"),
    ]


def _machine_busy() -> float:
    """Seconds every CPU of this machine has been busy since boot (/proc/stat: all but idle
    and iowait), counting what the kernel spends on the network whoever it is charged to; nan
    where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except OSError:
        return math.nan
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_use(data: dict) -> dict[str, tuple[float, float]]:
    """Per variant: median CPU ms per step of this rank's threads, and median share of the
    step's wall time they were busy (1.0: a core's worth the whole step)."""
    return {
        v: (statistics.median(r[0] for r in rows) * 1e3, statistics.median(r[1] for r in rows))
        for v, rows in data.get("cpu", {}).items() if rows
    }


def machine_cpu(data: dict) -> dict[str, float]:
    """Per variant: median CPU ms per step of the whole machine (every rank on it, and the
    kernel), where measured."""
    return {
        v: statistics.median(r[2] for r in rows) * 1e3
        for v, rows in data.get("cpu", {}).items()
        if rows and len(rows[0]) > 2 and not any(math.isnan(r[2]) for r in rows)
    }


def _cpu_use_lines(data: dict) -> list[str]:
    use = cpu_use(data)
    if not use:
        return []
    shares = ", ".join(f"{v} {ms:.1f} ms ({share:.0%})" for v, (ms, share) in use.items())
    return [
        "CPU time per step of this rank's threads (gloo's and the kernel's "
        "network work charged to them included), and its share of the step: "
        f"{shares}. Near 100 % a step is bound by this host's core, not by the link "
        "or the layout: the CPU the overlapped transfers cost it adds to the step."
    ] + ([
        "CPU time per step of the whole machine (every rank on it, and the kernel's network "
        "work whoever it is charged to): "
        + ", ".join(f"{v} {ms:.1f} ms" for v, ms in machine.items())
    ] if (machine := machine_cpu(data)) else [])


def against_plain(result: Comparison) -> dict[str, tuple[float, float, float]]:
    """Each overlap variant's step over plain gradsync's in the same round (paired median,
    95 % interval): the loopback goal is never slower than gradsync without the overlap."""
    if "gradsync" not in result.variants:
        return {}
    return {v: (result.paired_ratio(v, "gradsync"), *result.ratio_interval(v, "gradsync"))
            for v in result.variants if v.startswith("gradsync overlap")}


def _against_plain_lines(result: Comparison) -> list[str]:
    ratios = against_plain(result)
    return [
        "step over plain gradsync's in the same round (paired median, 95 % interval): "
        + ", ".join(f"{v} {r:.3f} ({lo:.3f}–{hi:.3f})" for v, (r, lo, hi) in ratios.items())
    ] if ratios else []


def _floor_line(
    result: Comparison, floor: float, which: str = "max(compute, communication)"
) -> str:
    shares = ", ".join(
        f"{v} {result.median(v) * 1e3 / floor:.2f}x" for v in result.variants
        if v != "compute only"
    )
    return f"floor {which} = {floor:.2f} ms; step time / floor: {shares}"


def chart(results: dict[str, dict], path: Path) -> Path:
    from ..observability.plot import figure, save_figure

    names = [v for v in next(iter(results.values()))["result"].variants
             if v != "torch DDP"]  # the A/A bar shows the noise
    fig, ax = figure(9, 4)
    width = 0.8 / len(names)
    for k, v in enumerate(names):
        ratios = [results[m]["result"].paired_ratio(v, "torch DDP") for m in results]
        ax.bar([i + k * width for i in range(len(results))], ratios, width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], list(results))
    ax.set_ylabel("step time / torch DDP's (lower is faster)")
    ax.legend(fontsize="small", ncol=3)
    return save_figure(fig, path)


DEVICE_HELP = """\
The device bench (--device cuda or cpu, or --model): one device per rank (cuda:LOCAL_RANK;
NCCL on a GPU, gloo on CPU), every variant from the same parameters with AdamW: the step
without DDP (the floor), torch's DDP twice (A/A), gradsync by default, with
gradient_as_bucket_view, and torch's DDP and gradsync with find_unused_parameters; variants
interleaved round by round; CUDA-event step times on a GPU; paired ratios with 95 % intervals;
peak memory per variant; the largest parameter difference from torch's DDP at the end.
Built-in models: gpt2_small (GPT-2-small shape: vocab 50257, d=768, 12 layers, tied head, bf16
autocast, 8 x 512 tokens), gpt_many (48 layers, d=256, 580 parameter tensors, 8 x 128 tokens),
gpt_compiled (torch.compile of a 4-layer GPT-2-shape model, 8 x 512 tokens); --tiny shrinks them.

  gradsync bench --device cuda --nproc 1                 # one GPU, NCCL at world size 1
  gradsync bench --device cuda --quick                   # a smoke run: 3 rounds of 2 steps
  torchrun --nproc-per-node 8 -m gradsync.tools.benchsuite --device cuda   # your cluster
  gradsync bench --model mymodels:build --device cuda    # your own model

--model MODULE:FUNCTION (or path/to/file.py:FUNCTION): FUNCTION() returns (model, batch) or
(model, batch, loss_fn). It is called once per rank with torch's seed set to 0; the model and
the batch are moved to the rank's device; every variant trains a copy of the model on the batch.
The batch is a tensor (passed as is), a tuple or list (unpacked as positional arguments) or a
dict (unpacked as keywords). loss_fn(output, batch) returns the scalar to backpropagate;
without it the loss is output.float().pow(2).mean() (of the first tensor of a tuple, list or
dict output).
MODULE is imported from the current folder or the Python path.
"""


def device_path(args: argparse.Namespace) -> bool:
    """Whether these options run the device bench (`devicebench`) rather than the CPU one."""
    return args.device is not None


def build_parser() -> argparse.ArgumentParser:
    """`gradsync bench`'s options (the CLI reference in the docs is generated from this)."""
    from .devicebench import DEVICE_MODELS, DEVICE_VARIANTS, OPTIONAL_VARIANTS

    return _parser(DEVICE_MODELS, DEVICE_VARIANTS + OPTIONAL_VARIANTS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .devicebench import DEVICE_MODELS, DEVICE_VARIANTS, OPTIONAL_VARIANTS

    p = build_parser()
    args = p.parse_args(argv)
    if args.model is not None and args.device is None:
        args.device = "cpu"
    if device_path(args):
        return _device_args(p, args, DEVICE_MODELS, DEVICE_VARIANTS + OPTIONAL_VARIANTS)
    if args.models is None:
        args.models = ",".join(LOOPBACK_MODELS)
    args.rounds = 25 if args.rounds is None else args.rounds
    args.repeat = 8 if args.repeat is None else args.repeat
    args.out = args.out or "out/bench"
    if args.quick:
        args.rounds, args.repeat, args.models = 2, 2, "many_small,convnet"
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown or args.rounds < 1 or args.repeat < 1:
        p.error(f"unknown models {unknown} (choose from {list(MODELS)}), or rounds/repeat below 1")
    only = [v for v in (args.only or "").split(",") if v]
    if [v for v in only if v not in VARIANTS]:
        p.error(f"--only: unknown {[v for v in only if v not in VARIANTS]} (choose from "
                f"{list(VARIANTS)})")
    always = ("torch DDP", "torch DDP (again)", "compute only")  # the baseline, A/A, floor
    args.cpu_variants = tuple(v for v in VARIANTS if not only or v in only or v in always)
    args.cpu_variants += tuple(f"gradsync overlap, tail {t}" for t in args.overlap_tails)
    return args


def _tails(text: str) -> list[str]:
    """--overlap-tails: comma-separated percentages of the gradients or sizes in MiB ("50",
    "4MiB"), as the variants name them (a word that is not a number: argparse's error, from
    float's ValueError)."""
    tails = []
    for word in (t for t in text.split(",") if t):
        mib = word.endswith("MiB")
        value = float(word[:-3] if mib else word)
        if value < 0 or (not mib and value > 100):
            raise argparse.ArgumentTypeError(f"percentages from 0 to 100 or sizes in MiB "
                                             f"(got {text!r})")
        tails.append(f"{value:g}MiB" if mib else f"{value:g}%")
    return tails


def _parser(device_models: tuple[str, ...],
            device_variants: tuple[str, ...]) -> argparse.ArgumentParser:
    """The bench's options; defaults that depend on which bench runs are left None for
    `parse_args` (the CPU bench) or `_device_args` (the device bench) to fill in."""
    p = argparse.ArgumentParser(prog="gradsync bench", description=__doc__, epilog=DEVICE_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None,
                   help=f"comma-separated, from {', '.join(MODELS)} (default: "
                   f"{', '.join(LOOPBACK_MODELS)}; with --hosts, sized for a slow network: "
                   f"{', '.join(CLUSTER_MODELS)}); with --device, from "
                   f"{', '.join(device_models)} (default: all three; none with --model)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measured rounds after the warm-up (default 25; with --device 15)")
    p.add_argument("--repeat", type=int, default=None,
                   help="steps per variant per round (default 8; with --device 5)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds of 2 steps, "
                   "two small models, no warm-up for planned buckets' trial; with --device, "
                   "3 rounds of 2 steps")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                   help="every variant's optimizer (default sgd)")
    p.add_argument("--only", default=None, help=f"comma-separated, from {', '.join(VARIANTS)} "
                   "(default: all; torch DDP, its A/A pair and compute only always run)")
    p.add_argument("--overlap-tails", type=_tails, default=[], metavar="TAILS",
                   help="comma-separated percentages P or sizes NMiB: for each, a variant "
                   "\"gradsync overlap, tail P%%\" (overlap_optimizer with tail_mb P %% of the "
                   "model's gradients) or \"..., tail NMiB\" (tail_mb N; 4MiB: the fixed "
                   "default before the tail was measured)")
    p.add_argument("--out", default=None, help="folder for bench.md, bench.json (and bench.png) "
                   "(default out/bench; with --device, out/bench-DEVICE)")
    _device_options(p.add_argument_group("the device bench"), device_variants)
    return p


def _device_options(d: argparse._ArgumentGroup, device_variants: tuple[str, ...]) -> None:
    """The device bench's own options (its models are chosen with --models)."""
    d.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="run the device bench on this device (default: the CPU bench above; "
                   "cpu with --model)")
    d.add_argument("--model", default=None, metavar="MODULE:FUNCTION",
                   help="bench your own model (see below)")
    d.add_argument("--variants", default=None,
                   help=f"comma-separated, from {', '.join(device_variants)} (default: all but "
                   "the optional ones; under torch.compile not the find_unused pair)")
    d.add_argument("--tiny", action="store_true",
                   help="the built-in models shrunk (same structure), for CPU")
    d.add_argument("--compile", action="store_true",
                   help="torch.compile your --model (the built-in gpt_compiled always is)")
    d.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (default inductor)")
    d.add_argument("--autocast", choices=["none", "bf16"], default="none",
                   help="autocast your --model's forward (the built-in models always use bf16)")


def _device_args(p: argparse.ArgumentParser, args: argparse.Namespace, models: tuple[str, ...],
                 variants: tuple[str, ...]) -> argparse.Namespace:
    if args.models is None:
        args.device_models = [] if args.model else list(models)
    else:
        args.device_models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.device_models if m not in models]
    if unknown:
        p.error(
            f"--device: unknown models {unknown} (choose from "
            f"{list(models)}, or bench your own with --model)"
        )
    if args.quick:
        args.rounds, args.repeat = args.rounds or 3, args.repeat or 2
    args.rounds = 15 if args.rounds is None else args.rounds
    args.repeat = 5 if args.repeat is None else args.repeat
    if args.rounds < 2 or args.repeat < 1:
        p.error(
            "--device: --rounds must be at least 2 (a spread needs two) and --repeat at least 1"
        )
    wrong = [v for v in (args.variants or "").split(",") if v and v not in variants]
    if wrong:
        p.error(f"--variants: unknown {wrong} (choose from {list(variants)})")
    if args.model is not None and ":" not in args.model:
        p.error(f"--model {args.model!r}: expected MODULE:FUNCTION or path/to/file.py:FUNCTION")
    args.out = args.out or f"out/bench-{args.device}"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if device_path(args):
        from . import devicebench

        devicebench.main(args)
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        results = {
            m: run_model(m, args.rounds, args.repeat, rank, settle=not args.quick,
                         optimizer=args.optimizer, names=args.cpu_variants)
            for m in args.models.split(",")
        }
        if rank == 0:
            _write(args, results)
        gc.collect()  # free every wrapper while the group still exists
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _write(args: argparse.Namespace, results: dict[str, dict]) -> None:
    text = "\n\n".join(report(m, d, args.rounds, args.repeat) for m, d in results.items())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(text + "\n")
    summary = {
        m: {
            "median_ms": {v: d["result"].median(v) * 1e3 for v in d["result"].variants},
            "ratio_to_torch": {v: d["result"].paired_ratio(v, "torch DDP")
                               for v in d["result"].variants},
            "ratio_interval_to_torch": {
                v: d["result"].ratio_interval(v, "torch DDP") for v in d["result"].variants
            },
            "gradient_bytes": d["nbytes"],
            "allreduce_alpha_ms": d["cost"].alpha_ms,
            "allreduce_ms_per_mib": d["cost"].beta_ms_per_byte * 2**20,
            "max_param_diff_to_torch": d["same"],
            "floor_ms": _floor_ms(d),
            "comm_cpu_ms": d["comm_cpu"].busy_ms if d["comm_cpu"] is not None else None,
            "floor_with_comm_cpu_ms": _cpu_floor_ms(d),
            "cpu_ms_per_step": {v: ms for v, (ms, _) in cpu_use(d).items()},
            "cpu_share_of_step": {v: share for v, (_, share) in cpu_use(d).items()},
            "machine_cpu_ms_per_step": machine_cpu(d),
            "ratio_to_gradsync": against_plain(d["result"]),
            "plans": {k[len("plan of "):]: v for k, v in d["plans"].items()},
            "samples_ms": {v: [x * 1e3 for x in d["result"].samples[v]]
                           for v in d["result"].variants},
        }
        for m, d in results.items()
    }
    (out / "bench.json").write_text(json.dumps(summary, indent=1))
    png = chart(results, out / "bench.png")
    print(text)
    print(f"\nwritten: {out / 'bench.md'}, {out / 'bench.json'}, {png}")
    bad = mismatched({m: d["same"] for m, d in results.items()})
    if bad:
        raise SystemExit(f"gradsync bench: variants ended with different parameters: {bad}")


if __name__ == "__main__":
    main()
