"""Training loops for parity tests: the same model, data and seed under gradsync's Reducer, torch's
DistributedDataParallel and one process on the whole batch. Each returns, per step, every
parameter's gradient (None kept as None) and, at the end, the parameters."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from models import MODELS
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.testing import seeded

__all__ = [
    "Record",
    "train_wrapper",
    "assert_records_equal",
    "train_single",
    "train_reducer",
    "train_torch_ddp",
]

Record = dict[str, Any]


def _build(model_name: str) -> torch.nn.Module:
    return seeded(MODELS[model_name], 0)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return batch.chunk(world_size)[rank]


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: _grad_copy(p.grad) for n, p in module.named_parameters()}


def _grad_copy(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    return grad.detach().to_dense() if grad.is_sparse else grad.detach().clone()


def _run(module, step_fn, batches, set_to_none: bool = True) -> Record:
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for i, batch in enumerate(batches):
        opt.zero_grad(set_to_none=set_to_none)
        step_fn(i, batch)
        grads.append(_snapshot(module))
        opt.step()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return {"grads": grads, "params": params}


def train_single(model_name: str, batches: list[torch.Tensor], world_size: int) -> Record:
    model = _build(model_name)

    def step(_i: int, batch: torch.Tensor) -> None:
        # The mean over ranks of each rank's mean loss: what data-parallel training optimises.
        sum(_loss(model(x)) for x in batch.chunk(world_size)).div(world_size).backward()

    return _run(model, step, batches)


def train_reducer(
    rank: int,
    group,
    model_name: str,
    batches: list[torch.Tensor],
    *,
    bucket_cap_bytes: int = 25 * 2**20,
    config: gradsync.ReducerConfig | None = None,
    keep: list | None = None,
) -> Record:
    model = _build(model_name)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    layout, _ = gradsync.compute_bucket_assignment_by_size(params, [bucket_cap_bytes])
    reducer = gradsync.Reducer(
        params, list(reversed(layout)), group, param_names=[n for n, _ in named], config=config
    )
    ws = group.size()

    def step(_i: int, batch: torch.Tensor) -> None:
        out = model(_shard(batch, rank, ws))
        reducer.prepare_for_backward(out)
        _loss(out).backward()

    record = _run(model, step, batches)
    record["timelines"] = list(reducer.history)
    record["layout"] = reducer.bucket_indices
    if keep is not None:
        keep.append(reducer)
    return record


def train_torch_ddp(
    rank: int, group, model_name: str, batches: list[torch.Tensor], **ddp_kwargs: Any
) -> Record:
    model = _build(model_name)
    ddp = TorchDDP(model, process_group=group, **ddp_kwargs)
    ws = group.size()

    def step(_i: int, batch: torch.Tensor) -> None:
        _loss(ddp(_shard(batch, rank, ws))).backward()

    return _run(model, step, batches)


def assert_records_equal(got: Record, want: Record, *, exact: bool, what: str = "") -> None:
    rtol, atol = (0.0, 0.0) if exact else (1e-5, 1e-6)
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        assert g.keys() == w.keys()
        for name in g:
            a, b = g[name], w[name]
            assert (a is None) == (b is None), f"{what} step {step} {name}: None-ness differs"
            if a is not None:
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=rtol,
                    atol=atol,
                    msg=lambda m, n=name, s=step: f"{what} step {s} grad {n}: {m}",
                )
    for name, p in got["params"].items():
        torch.testing.assert_close(
            p,
            want["params"][name],
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{what} param {n}: {m}",
        )


def train_wrapper(
    wrapper_cls,
    rank: int,
    group,
    model_name: str,
    batches: list[torch.Tensor],
    *,
    micro_steps: int = 1,
    accumulate_with: str = "no_sync",
    set_to_none: bool = True,
    **ddp_kwargs: Any,
) -> Record:
    """A training loop as users write it, for torch's DDP class or gradsync's.

    With `micro_steps > 1` each rank's shard is split into micro-batches whose gradients are
    accumulated without synchronisation (`no_sync()` or `require_backward_grad_sync = False`),
    the last one synchronising.
    """
    model = _build(model_name)
    ddp = wrapper_cls(model, process_group=group, **ddp_kwargs)
    ws = group.size()

    def step(_i: int, batch: torch.Tensor) -> None:
        micro = _shard(batch, rank, ws).chunk(micro_steps)
        for j, x in enumerate(micro):
            last = j == len(micro) - 1
            if accumulate_with == "no_sync":
                ctx = contextlib.nullcontext() if last else ddp.no_sync()
                with ctx:
                    _loss(ddp(x)).div(len(micro)).backward()
            else:
                ddp.require_backward_grad_sync = last
                _loss(ddp(x)).div(len(micro)).backward()

    record = _run(model, step, batches, set_to_none=set_to_none)
    record["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    return record
