"""torch's own DDP mixed precision (`_MixedPrecision`) run on CPU: the reference for gradsync's.

torch's implementation (`DistributedDataParallel._root_copy_hook`, `_module_wait_for_copy_hook`,
`mixed_precision_hooks._reducer_allreduce_and_upcast_hook`) orders its casts with an
accelerator's streams and events, which a CPU build refuses (`torch.Event().record()`: "cpu
backend doesn't support events"; `torch.accelerator.current_stream()`: no accelerator). On a CPU
every kernel runs in program order, so stand-ins that order nothing are exact: `on_cpu()` swaps
them in for `torch.Stream`, `torch.Event` and `torch.accelerator.current_stream`, and torch's own
code runs unchanged. Patch only inside a spawned process (`train` does): the stand-ins must not
leak into a test process that may later meet a real accelerator.

`train` runs a few optimiser steps of one wrapper (torch's class or gradsync's) with a
`_MixedPrecision` config and records everything the comparison needs, bit for bit: each step's
`.grad` (dtype, value) and `.data` dtype after backward, and the final parameters and buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch import nn

__all__ = ["CpuEvent", "CpuStream", "Net", "batches", "differences", "loss", "on_cpu", "train"]


class CpuStream:
    """A stream on which everything has already happened: CPU kernels run in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> CpuStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        return event or CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuEvent:
    """An event that has always passed (see `CpuStream`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Let torch's DDP mixed precision run on CPU (see the module docstring)."""
    with mock.patch("torch.Stream", CpuStream), mock.patch("torch.Event", CpuEvent), \
            mock.patch("torch.accelerator.current_stream", lambda *a, **k: CpuStream()):
        yield


class Net(nn.Module):
    """Linear layers around a BatchNorm (whose int64 `num_batches_tracked` torch casts too) or,
    for configs without `buffer_dtype` (BatchNorm cannot run bf16 with float32 statistics on
    CPU), a LayerNorm; a 0-dim float buffer scales the activations either way. `spare`: a
    layer that forward never uses (created last: the others' initial values are unchanged)."""

    def __init__(self, batchnorm: bool = True, spare: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.LayerNorm(16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor(0.75))
        if spare:
            self.spare = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.inp(x)))
        return self.out(torch.relu(self.mid(x) * self.scale))


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's own data: (inputs, targets) per step."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(steps)]


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


def train(wrapper: type, rank: int, config: Any, *, steps: int = 4, batchnorm: bool = True,
          spare: bool = False, set_to_none: bool = True, warm_up: int = 0, hook: Any = None,
          eval_forwards: bool = False, **options: Any) -> dict[str, Any]:
    """`steps` SGD-with-momentum steps of `Net` wrapped by `wrapper(..., mixed_precision=config)`
    on the default group; every tensor recorded is a clone, compared bit for bit by the tests.
    `warm_up`: that many forwards and backwards first, their effects then undone (`_warm_up`);
    `hook`: registered as the communication hook; `eval_forwards`: a forward in eval mode
    without grad before each step's."""
    torch.set_num_threads(1)
    with on_cpu():
        torch.manual_seed(0)
        model = Net(batchnorm, spare)
        ddp = wrapper(model, mixed_precision=config, **options)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        _warm_up(ddp, model, warm_up)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        record: dict[str, Any] = {"grads": [], "data_dtypes": [], "outputs": []}
        for x, y in batches(rank, steps):
            opt.zero_grad(set_to_none=set_to_none)
            if eval_forwards:
                _eval_forward(ddp, model, x)
            out = ddp(x)
            loss(out, y).backward()
            record["outputs"].append(out.detach().clone())
            record["grads"].append({n: _clone(p.grad) for n, p in model.named_parameters()})
            record["data_dtypes"].append({n: p.dtype for n, p in model.named_parameters()})
            opt.step()
        record["state"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
        return record


def _warm_up(ddp: nn.Module, model: nn.Module, iterations: int) -> None:
    """`iterations` iterations, then the parameters, buffers and gradients as they were before.

    torch's first iteration reduces garbage: `Reducer._set_mixed_precision_param_dtype` replaces
    each bucket's flat tensor by a copy in `param_dtype` (`bucket.gradients.to(dtype)`), but the
    views the gradients are copied into still point at the old float32 tensor, so the hook
    all-reduces the new one's uninitialised contents. The buckets rebuilt after that iteration
    are made in `param_dtype` and are right (with `static_graph`, after the second iteration).
    Discarding those iterations leaves torch's arithmetic with its own (rebuilt) layout."""
    if not iterations:
        return
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    for x, _ in batches(-1, iterations):
        ddp(x).float().pow(2).mean().backward()
    with torch.no_grad():
        for name, value in model.state_dict().items():
            value.copy_(before[name])
    model.zero_grad(set_to_none=True)


def _eval_forward(ddp: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        ddp(x)
    model.train()


def differences(
    ours: dict[str, Any], theirs: dict[str, Any], skip: tuple[str, ...] = ()
) -> list[str]:
    """Where two `train` records differ at all: dtypes, None-ness, values (max |diff|). Names
    in `skip` (a parameter only one side has) are left out."""
    found: list[str] = []
    _walk(ours, theirs, "", found, skip)
    return found


def _walk(a: Any, b: Any, path: str, found: list[str], skip: tuple[str, ...]) -> None:
    if isinstance(a, dict):
        keys = [k for k in a if k.split(".")[0] not in skip]
        if sorted(keys) != sorted(k for k in b if k.split(".")[0] not in skip):
            found.append(f"{path}: names {sorted(keys)} vs {sorted(b)}")
        for k in keys:
            if k in b:
                _walk(a[k], b[k], f"{path}/{k}", found, skip)
    elif isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", found, skip)
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            found.append(f"{path}: dtype {a.dtype} vs {b.dtype}")
        elif not torch.equal(a, b):
            found.append(f"{path}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}")
    elif a != b:
        found.append(f"{path}: {a} vs {b}")


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()
