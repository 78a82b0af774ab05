"""Randomized parity with torch's DDP: generated models x configurations, one seed a case.

`Case.from_seed(seed)` draws a model (branches used by rank or iteration, outputs left out of the
loss, frozen and tied parameters, buffers, sparse and dense embeddings, a float64 branch, two
convolutions in channels-last memory, a complex weight) and a
configuration (find_unused_parameters, static_graph, bucket caps down to one parameter per
bucket, gradient_as_bucket_view, no_sync accumulation, requires_grad turned off (and on again)
after wrapping, torch's and gradsync's communication
hooks, SGD or Adam, world size 2 or 3, and on gradsync's side sometimes its
ZeroRedundancyOptimizer with sharded gradients) within what torch's DDP accepts. `run_case` trains
it under gradsync's wrapper and torch's, side by side on the same gloo groups, and returns the
differences: gradients (None-ness and memory layout included) every step, parameters and buffers
at the end, and parameters across ranks. The same seed always gives the same case:

    python benchmarks/random_parity.py --seed 1234      # rerun one case
    pytest tests/threaded/test_random_parity.py         # the fast slice
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import comm_hooks
from gradsync.testing import run_threaded, seeded

__all__ = ["Case", "run_case"]

# When a block takes part: always, on some ranks, in some iterations, or both.
USES = ("always", "rank", "iter", "rank_iter", "never")
# The same hook on both sides. torch refuses its own bf16 hook off NCCL; gradsync's runs on both.
ADAM_LR = 0.01
CLIP_NORM = 0.05  # below the generated models' gradient norms, so clipping scales them
HOOKS = ("none", "torch_allreduce", "torch_fp16", "gradsync_fp16", "gradsync_bf16")


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str  # linear | branch | frozen | tied | double | embed | bn | conv | complex
    use: str = "always"  # for branch: when it runs
    aux: str = "none"  # if not "none": its output is also returned, and the loss uses it then
    head: str = "linear"  # the aux output's head: a Linear of its own, or parameter-free
    sparse: bool = False  # embed only


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    width: int
    blocks: tuple[Block, ...]
    container: str  # how forward returns its outputs: tuple | dict | list
    world_size: int
    find_unused: bool
    static_graph: bool
    bucket_cap_mb: float | None
    as_view: bool
    micro_steps: int
    accumulate_with: str  # no_sync | flag
    hook: str
    optimizer: str  # sgd | adam
    set_to_none: bool
    broadcast_buffers: bool
    steps: int
    zero: bool = False  # gradsync's side steps a ZeroRedundancyOptimizer with sharded gradients
    inside: bool = False  # ... inside backward (overlap_with_ddp=True)
    # requires_grad changed after wrapping: none | off (from step `freeze_at` on) | off_on (off
    # at that step, on again at the next) | off_first (off before the first forward); on the
    # module `freeze` names (a key of `dict(Generated.named_modules())`).
    refreeze: str = "none"
    freeze: str = ""
    freeze_at: int = 0
    overlap: bool = False  # gradsync's side steps each bucket as it lands (overlap_optimizer)
    # ... with this (tail_mb, chunk_mb, credit_mb): the tail sent nearest the input first in
    # chunks, some held back by a credit; None: the defaults (the whole tiny model one chunk)
    tail: tuple[float, float, float] | None = None
    # Every micro-step's backward synchronises (neither no_sync nor the flag): the averages
    # accumulate in .grad, stepped once (with overlap_optimizer too). Not sharded, whose step
    # is the last synchronised backward's.
    sync_every: bool = False
    # The gradients clipped by their global norm between backward and step(), before anything
    # else reads them: with overlap_optimizer, without opt.wait(), so the clipping's reads land
    # the buckets still landing. Not sharded (no .grad) nor sparse (no norm of its own).
    clip: bool = False
    # With overlap_optimizer's tail left out: the synchronised forward at which it is measured
    # (`MeasuredTail.after`, 6 by default, beyond these runs), then tried for one iteration
    # and decided at the next; 0: left at 6.
    measure_at: int = 0

    @classmethod
    def from_seed(cls, seed: int) -> Case:
        rng = random.Random(seed)
        # A static graph may differ between ranks, not between iterations; and torch's refuses
        # an output left out of the loss (on some rank) whose head has parameters of its own
        # (it waits for their gradients from the second iteration on).
        static = rng.random() < 0.25
        uses = ("always", "rank") if static else USES[:4]
        blocks = [Block("linear")]
        for _ in range(rng.randint(1, 5)):
            kind = rng.choice(
                ("linear", "branch", "branch", "frozen", "tied", "double", "embed", "bn")
            )
            use = rng.choice(uses) if kind == "branch" else "always"
            aux = "none"
            if kind in ("linear", "branch", "double"):
                aux = rng.choice(("none", "none") + (uses + ("never",) if static else USES))
            head = (
                "free"
                if static and aux in ("never", "rank")
                else rng.choice(("linear", "linear", "free"))
            )
            blocks.append(
                Block(kind, use, aux, head, sparse=kind == "embed" and rng.random() < 0.5)
            )
        sparse = any(b.sparse for b in blocks)
        varies = any(b.use != "always" or b.aux not in ("none", "always", "never") for b in blocks)
        left_out = any(b.aux == "never" and b.head == "linear" for b in blocks)
        # torch refuses these (so they are not drawn): a parameter that goes unused without
        # find_unused_parameters; sparse gradients with a hook, a bucket view or Adam.
        find_unused = (varies or left_out) and not static or rng.random() < 0.3
        hook = "none" if sparse else rng.choice(HOOKS)
        case = cls(
            seed=seed,
            width=rng.choice((4, 6, 8)),
            blocks=tuple(blocks),
            container=rng.choice(("tuple", "dict", "list")),
            world_size=rng.choice((2, 3)),
            find_unused=find_unused,
            static_graph=static,
            bucket_cap_mb=rng.choice((None, 0.0005, 1e-7)),
            as_view=not sparse and rng.random() < 0.4,
            micro_steps=rng.choice((1, 1, 2, 3)),
            accumulate_with=rng.choice(("no_sync", "flag")),
            hook=hook,
            optimizer="sgd" if sparse else rng.choice(("sgd", "adam")),
            set_to_none=rng.random() < 0.7,
            broadcast_buffers=rng.random() < 0.7,
            steps=rng.choice((3, 4)),
        )
        # Drawn last, so every other field of a seed stays what it was before this existed.
        # Sharded gradients refuse sparse gradients and hooks other than the averaging and
        # compression ones (the bf16 case is a wrapper, unknown to them); they never accumulate
        # by the flag alone: the step needs a synchronised backward, the last micro-step's.
        shardable = hook in ("none", "torch_allreduce", "torch_fp16", "gradsync_fp16")
        zero = shardable and not sparse and rng.random() < 0.6
        case = dataclasses.replace(case, zero=zero, inside=zero and rng.random() < 0.4)
        if rng.random() < 0.3:  # drawn after those, for the same reason
            blocks.insert(rng.randint(1, len(blocks)), Block("conv"))
            case = dataclasses.replace(case, blocks=tuple(blocks))
        case = _draw_refreeze(case, rng)  # after those, for the same reason
        # Last of all, for the same reason: every backward that synchronises steps, so not with
        # a sharded optimizer (which steps its shards itself).
        case = dataclasses.replace(case, overlap=not case.zero and rng.random() < 0.35)
        if case.overlap and rng.random() < 0.6:  # after that, for the same reason
            case = dataclasses.replace(case, tail=(rng.choice((0.0002, 0.001)),
                                                   rng.choice((0.00003, 0.0001)),
                                                   rng.choice((0.0, 0.00003, 0.0001))))
        # After those, for the same reason: a complex layer, not under a compression hook
        # (which casts the bucket to a real dtype, dropping the imaginary parts, torch's too);
        # last, so the blocks' indices that the fields above name stay theirs.
        if hook in ("none", "torch_allreduce") and rng.random() < 0.25:
            case = dataclasses.replace(case, blocks=case.blocks + (Block("complex"),))
        if case.micro_steps > 1 and not case.zero and rng.random() < 0.3:  # after those
            case = dataclasses.replace(case, sync_every=True)
        if not case.zero and not sparse and rng.random() < 0.3:  # after those
            case = dataclasses.replace(case, clip=True)
        # Last of all; where buckets land in the next forward, as the tail is measured only
        # there (no used map to wait for, no hook's chain).
        lazily = not (case.find_unused or case.static_graph) and case.hook == "none"
        if case.overlap and lazily and rng.random() < 0.8:  # the tail left out, to measure
            case = dataclasses.replace(case, measure_at=rng.choice((2, 3)), tail=None)
        return case

    def torch_kwargs(self) -> dict[str, Any]:
        """torch's DDP for the same case. Its static_graph fails an internal assert on
        accumulation (no_sync or the flag); a static graph changes nothing in the results, so
        torch then runs the dynamic equivalent."""
        kwargs = self.ddp_kwargs()
        if self.static_graph and self.micro_steps > 1:
            kwargs.update(static_graph=False, find_unused_parameters=True)
        return kwargs

    def ddp_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            find_unused_parameters=self.find_unused,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.as_view,
            broadcast_buffers=self.broadcast_buffers,
        )
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs

    def rerun(self) -> str:
        return f"python benchmarks/random_parity.py --seed {self.seed}"


def _draw_refreeze(case: Case, rng: random.Random) -> Case:
    """Trainability changed after wrapping, where torch's DDP trains: a parameter frozen from
    some step on counts as unused, so only with find_unused_parameters (a static graph raises
    once it has learned the parameter as used), or before the first forward (then a static
    graph learns it unused)."""
    if rng.random() >= 0.4:
        return case
    choices = ("off", "off_on", "off_first") if case.find_unused and not case.static_graph else ()
    choices += ("off_first",) if case.static_graph else ()
    if not choices:
        return case
    refreeze = rng.choice(choices)
    # Not a sparse embedding: torch's DDP raises for any unused sparse gradient.
    modules = ["inp"] + [
        f"layers.{i}" for i, b in enumerate(case.blocks) if b.kind != "frozen" and not b.sparse
    ]
    modules += [
        f"heads.{i}" for i, b in enumerate(case.blocks) if b.aux != "none" and b.head == "linear"
    ]
    at = 0 if refreeze == "off_first" else rng.randint(1, case.steps - 1)
    return dataclasses.replace(case, refreeze=refreeze, freeze=rng.choice(modules), freeze_at=at)


def change_trainability(case: Case, model: nn.Module, step: int) -> None:
    """Before `step`'s forwards: the case's change of requires_grad, if it falls there."""
    if case.refreeze == "none":
        return
    module = dict(model.named_modules())[case.freeze]
    if step == case.freeze_at:
        module.requires_grad_(False)
    elif case.refreeze == "off_on" and step == case.freeze_at + 1:
        module.requires_grad_(True)


def used(use: str, rank: int, step: int) -> bool:
    return {
        "always": True,
        "never": False,
        "rank": rank % 2 == 0,
        "iter": step % 2 == 1,
        "rank_iter": (rank + step) % 2 == 0,
    }[use]


class Generated(nn.Module):
    """The model a `Case` describes; forward(x, rank, step) returns the outputs and which of
    them the loss takes."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        d = case.width
        self.case = case
        self.inp = nn.Linear(8, d)
        self.layers = nn.ModuleList()
        self.heads = nn.ModuleDict()
        for i, block in enumerate(case.blocks):
            layer: nn.Module
            if block.kind == "embed":
                layer = nn.Embedding(16, d, sparse=block.sparse)
            elif block.kind == "bn":
                layer = nn.BatchNorm1d(d)
            elif block.kind == "double":
                layer = nn.Linear(d, d).double()
            elif block.kind == "complex":
                layer = _Spectral(d)
            elif block.kind == "conv":
                # Channels-last weights of both kinds: (3, 1, 3, 3) is contiguous in both memory
                # formats, (1, 3, 3, 3) only in channels-last; their gradients' strides must
                # be torch's (the gradient layout contract).
                layer = nn.Sequential(
                    nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 1, 3, padding=1)
                )
                layer.to(memory_format=torch.channels_last)
            elif block.kind == "tied":
                layer = nn.Linear(d, d, bias=True)
                layer.weight = self.layers[0].weight  # shared with the first block
            else:
                layer = nn.Linear(d, d)
            if block.kind == "frozen":
                layer.requires_grad_(False)
            self.layers.append(layer)
            if block.aux != "none":
                self.heads[str(i)] = nn.Linear(d, 3) if block.head == "linear" else nn.Tanh()

    def forward(self, x: torch.Tensor, rank: int, step: int) -> Any:
        h = torch.tanh(self.inp(x))
        outputs: dict[str, torch.Tensor] = {}
        for i, (block, layer) in enumerate(zip(self.case.blocks, self.layers)):
            if block.kind == "branch" and not used(block.use, rank, step):
                pass  # skipped: its parameters take no part on this rank in this step
            elif block.kind == "embed":
                idx = (x[:, :2].abs() * 5).long().clamp(max=15)
                h = h + layer(idx).mean(dim=1)
            elif block.kind == "double":
                h = h + torch.tanh(layer(h.double())).float()
            elif block.kind == "complex":
                h = torch.tanh(h + layer(h))
            elif block.kind == "conv":  # the width as a one-channel 2 x width/2 image
                image = h.reshape(h.shape[0], 1, 2, -1).contiguous(
                    memory_format=torch.channels_last
                )
                h = torch.tanh(h + layer(image).reshape(h.shape))
            else:
                h = torch.tanh(layer(h))
            if str(i) in self.heads:
                outputs[f"aux{i}"] = self.heads[str(i)](h)
        outputs["main"] = h
        if self.case.container == "dict":
            return outputs
        values = list(outputs.values())
        return tuple(values) if self.case.container == "tuple" else values


class _Spectral(nn.Module):
    """A complex weight, as in a spectral (Fourier) layer: |h W|."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d, dtype=torch.cfloat) / d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h.to(torch.cfloat) @ self.weight).abs()


def loss_of(case: Case, outputs: Any, rank: int, step: int) -> torch.Tensor:
    named = outputs if isinstance(outputs, dict) else dict(
        zip([k for k in _output_names(case)], outputs)
    )
    loss = named["main"].pow(2).mean()
    for i, block in enumerate(case.blocks):
        if block.aux != "none" and used(block.aux, rank, step):
            loss = loss + named[f"aux{i}"].pow(2).mean()
    return loss


def _output_names(case: Case) -> list[str]:
    return [f"aux{i}" for i, b in enumerate(case.blocks) if b.aux != "none"] + ["main"]


def _register_hook(ddp: Any, case: Case, group: Any) -> None:
    if case.hook == "none":
        return
    hook: Any = {
        "torch_allreduce": default_hooks.allreduce_hook,
        "torch_fp16": default_hooks.fp16_compress_hook,
        "gradsync_fp16": comm_hooks.fp16_compress_hook,
        "gradsync_bf16": comm_hooks.bf16_compress_hook,
    }[case.hook]
    if case.hook == "gradsync_bf16":  # torch refuses a hook of this name off NCCL; not its code
        inner = hook

        def hook(state, bucket):  # unannotated: torch checks annotations, and these are strings
            return inner(state, bucket)

    ddp.register_comm_hook(group, hook)


def train(
    wrapper_cls: type, rank: int, group: Any, case: Case, batches: list[torch.Tensor]
) -> dict:
    model = seeded(lambda: Generated(case), case.seed)
    kwargs = case.torch_kwargs() if wrapper_cls is TorchDDP else case.ddp_kwargs()
    ddp = wrapper_cls(model, process_group=group, **kwargs)
    _register_hook(ddp, case, group)
    params = [p for p in model.parameters() if p.requires_grad]
    cls, defaults = (
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
        if case.optimizer == "sgd"
        else (torch.optim.Adam, {"lr": ADAM_LR})
    )
    sharded = case.zero and wrapper_cls is not TorchDDP
    opt: torch.optim.Optimizer = (
        gradsync.ZeroRedundancyOptimizer(
            params, cls, process_group=group, overlap_with_ddp=case.inside, **defaults
        )
        if sharded
        else cls(params, **defaults)
    )
    if case.overlap and wrapper_cls is not TorchDDP:
        # measured (tail left out) in chunks small enough for these models to be cut
        opt = ddp.overlap_optimizer(opt, *(case.tail or ((None, 0.00003) if case.measure_at
                                                         else ())))
        if case.measure_at:  # the tail measured, tried and decided mid-run: cut again twice
            measured = ddp.measured_tail
            measured.after, measured.rounds, measured.per_slot = case.measure_at, 1, 1
    ws = group.size()
    grads = []
    for step, batch in enumerate(batches):
        change_trainability(case, model, step)
        opt.zero_grad(set_to_none=case.set_to_none)
        micro = batch.chunk(ws)[rank].chunk(case.micro_steps)
        for j, x in enumerate(micro):
            last = j == len(micro) - 1
            if case.sync_every:
                ctx = contextlib.nullcontext()
            elif case.accumulate_with == "no_sync":
                ctx = contextlib.nullcontext() if last else ddp.no_sync()
            else:
                ddp.require_backward_grad_sync = last
                ctx = contextlib.nullcontext()
            with ctx:
                loss_of(case, ddp(x, rank, step), rank, step).div(len(micro)).backward()
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        elif case.overlap and wrapper_cls is not TorchDDP:
            opt.wait()  # read after backward: the buckets still landing first
        grads.append({n: _copy(p.grad) for n, p in model.named_parameters()})
        opt.step()
    if case.overlap and wrapper_cls is not TorchDDP:
        opt.wait()
    result = {
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }
    del ddp, opt
    return result


def _copy(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    return grad.detach().to_dense().clone() if grad.is_sparse else grad.detach().clone()


def _both(rank: int, group: Any, case: Case, batches: list[torch.Tensor]) -> tuple[dict, dict]:
    ours = train(gradsync.DistributedDataParallel, rank, group, case, batches)
    theirs = train(TorchDDP, rank, group, case, batches)
    return ours, theirs


def compare(case: Case, results: list[tuple[dict, dict]]) -> list[str]:
    """Every difference, described; empty when gradsync matches torch on every rank."""
    exact = case.world_size == 2
    precision = case.hook[-4:] if case.hook.endswith(("fp16", "bf16")) else "fp32"
    # Adam's step is sign-like for a gradient near zero: where gradients agree only to half
    # precision, a parameter may move by up to 2 lr per step differently (seed 1274).
    adam_slack = (
        2 * ADAM_LR * case.steps if case.optimizer == "adam" and precision != "fp32" else 0.0
    )
    problems: list[str] = []
    for rank, (ours, theirs) in enumerate(results):
        for step, (g, t) in enumerate(zip(ours["grads"], theirs["grads"])):
            if case.zero:  # gradsync's gradients are sharded: no whole `.grad` to compare
                break
            for name in t:
                what = f"rank {rank} step {step} grad {name}"
                problems += _differs(g[name], t[name], exact, what, precision)
                if (
                    g[name] is not None
                    and t[name] is not None
                    and g[name].stride() != t[name].stride()
                ):
                    problems.append(
                        f"{what}: strides {g[name].stride()}, torch's {t[name].stride()}"
                    )
        for kind in ("params", "buffers"):
            for name in theirs[kind]:
                problems += _differs(
                    ours[kind][name],
                    theirs[kind][name],
                    exact,
                    f"rank {rank} {kind[:-1]} {name}",
                    precision,
                    slack=adam_slack if kind == "params" else 0.0,
                )
    for rank in range(1, len(results)):
        for name, p in results[0][0]["params"].items():
            problems += _differs(
                results[rank][0]["params"][name],
                p,
                True,
                f"gradsync rank {rank} vs rank 0 param {name}",
            )
    return problems


def _differs(
    a: torch.Tensor | None, b: torch.Tensor | None, exact: bool, what: str, precision: str = "fp32",
    slack: float = 0.0,
) -> list[str]:
    if (a is None) != (b is None):
        return [
            f"{what}: gradsync {'None' if a is None else 'a tensor'}, "
            f"torch {'None' if b is None else 'a tensor'}"
        ]
    if a is None or b is None:
        return []
    if a.is_complex() or b.is_complex():  # both parts compared (`double()` drops the imaginary)
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    # At 3 ranks a ring all-reduce sums each element in an order set by where the bucket's
    # chunks fall, so a layout torch does not share (a static graph that accumulates is
    # compared with torch's dynamic one, ZeRO's reduce-scatter with torch's all-reduce)
    # differs in the last bits, which Adam and 4-row batch norms grow in a few steps: seed 2073
    # (ZeRO, Adam, a batch norm after a float64 layer) went from 1.5e-8 after the first step to
    # 2.1e-5 after the second and 5.0e-5 after the third, on values of 0.38. A hook that
    # reduces in half precision rounds at its precision instead. Judged against the tensor's
    # largest value: a real fault (a bucket not reduced, a wrong divisor) is of the size of
    # the values.
    if exact:
        same = torch.equal(a, b)
    else:
        rtol, atol = {"fp16": (1e-2, 1e-4), "bf16": (5e-2, 1e-3)}.get(precision, (2e-4, 1e-5))
        scale = max(a.abs().max().item(), b.abs().max().item()) if a.numel() else 0.0
        same = (
            (a.double() - b.double()).abs().max().item() <= rtol * scale + atol + slack
            if a.numel()
            else True
        )
    if same:
        return []
    return [f"{what}: max |diff| {(a.double() - b.double()).abs().max().item():.3e}"]


def run_case(case: Case, timeout: float = 60.0) -> list[str]:
    g = torch.Generator().manual_seed(case.seed)
    per_rank = 4 * case.micro_steps
    batches = [torch.randn(case.world_size * per_rank, 8, generator=g) for _ in range(case.steps)]
    # torch's DDP sits in reference cycles. Collected by an automatic collection inside a rank
    # thread, in the middle of that rank's backward, an earlier case's wrapper can crash the
    # process; so cycles are collected here only, between cases, with no rank running.
    gc.collect()
    gc.disable()
    try:
        results = run_threaded(_both, case.world_size, case, batches, timeout=timeout)
    except Exception as error:  # a raise or a hang on any rank is a mismatch too
        return [f"raised: {type(error).__name__}: {str(error).splitlines()[0][:500]}"]
    finally:
        gc.enable()
        gc.collect()
    return compare(case, results)
