"""The wrapper's construction steps that talk to the other ranks or build the engine.

In the order the constructor takes them: every rank checks that all hold the same parameters
(before any bucket collective could hang on a mismatch), rank 0's parameters and buffers are
broadcast, and the Reducer is built with torch's layout policy: one bucket for the first
iteration, rebuilt in gradient-ready order.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from ..engine.bucketing import compute_bucket_assignment_by_size as assign_buckets
from ..engine.collectives import all_gather_objects, broadcast_tensors
from ..engine.config import ReducerConfig
from ..observability.log import IterationLog
from .arguments import expects_sparse_gradient, ignored
from .mixed import MixedPrecisionParams
from .torch_compat import TorchNamedReducer

__all__ = [
    "broadcast_state",
    "build_reducer",
    "check_same_parameters",
    "definition_order_layout",
    "reducer_config",
]


def check_same_parameters(group: dist.ProcessGroup, named: list[tuple[str, nn.Parameter]]) -> None:
    """Raise, on every rank, if the ranks hold different parameters (names, shapes, dtypes)."""
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    everyone = all_gather_objects(group, mine)
    problem = _first_mismatch(everyone)  # every rank computes the same verdict
    if problem is not None:
        raise ValueError(
            f"gradsync.DistributedDataParallel: ranks hold different parameters. {problem}\n"
            "Every rank must build the same model (same classes, arguments and requires_grad "
            "settings) before wrapping it; check for rank-dependent model code or a "
            "checkpoint loaded on only some ranks."
        )


def _first_mismatch(everyone: list) -> str | None:
    """Describe the first parameter that differs between ranks, or None if all agree."""
    counts = [len(params) for params in everyone]
    for i in range(max(counts)):
        entries = [params[i] if i < len(params) else None for params in everyone]
        if any(e != entries[0] for e in entries):
            per_rank = "; ".join(
                f"rank {r}: " + ("(none)" if e is None else f"{e[0]!r} shape {list(e[1])} {e[2]}")
                for r, e in enumerate(entries)
            )
            return f"Parameter #{i} differs: {per_rank}. Parameter counts per rank: {counts}."
    return None


def broadcast_state(
    module: nn.Module, group: dist.ProcessGroup, buffers: list[torch.Tensor] | None
) -> None:
    """Rank 0's parameters (all but the excluded, frozen ones too) and `buffers`, to every rank."""
    left_out = ignored(module)
    tensors = [p.detach() for n, p in module.named_parameters() if n not in left_out]
    if buffers is not None:
        tensors += buffers
    if tensors and group.size() > 1:
        broadcast_tensors(group, tensors, src=0)


def reducer_config(
    searches_unused: bool,
    static_graph: bool,
    mixed: MixedPrecisionParams | None,
    as_view: bool,
    limits: list[int],
) -> ReducerConfig:
    return ReducerConfig(
        find_unused_parameters=searches_unused,
        static_graph=static_graph,
        bucket_dtype=mixed.param_dtype if mixed else None,
        reduce_dtype=mixed.reduce_dtype if mixed else None,
        gradient_as_bucket_view=as_view,
        rebuild_bucket_size_limits=tuple(limits),
    )


def build_reducer(
    module: nn.Module,
    named: list[tuple[str, nn.Parameter]],
    group: dist.ProcessGroup,
    config: ReducerConfig,
    limits: tuple[list[int], bool],
) -> TorchNamedReducer:
    """The Reducer over `named`, its first layout as torch's, logging each iteration."""
    params, names = [p for _, p in named], [n for n, _ in named]
    sparse = expects_sparse_gradient(module, names)
    byte_limits, per_bucket = limits
    # As torch: without unused-parameter search the first iteration uses one bucket and the
    # rebuild orders buckets by real arrival; with it, buckets follow reversed definition
    # order. Explicit per-bucket caps (bucket_cap_mb_list) apply from the start.
    initial = byte_limits if config.find_unused_parameters or per_bucket else [sys.maxsize]
    layout, _ = assign_buckets(params, initial, sparse)
    reducer = TorchNamedReducer(
        params,
        list(reversed(layout)),
        group,
        param_names=names,
        config=config,
        expect_sparse_gradient=sparse,
    )
    reducer.iteration_listeners.append(IterationLog())
    return reducer


def definition_order_layout(params: list[nn.Parameter], limits: list[int]) -> list[list[int]]:
    """Buckets capped at `limits`, in reverse definition order (the sharded layout, for good)."""
    layout, _ = assign_buckets(params, limits, [False] * len(params))
    return list(reversed(layout))
