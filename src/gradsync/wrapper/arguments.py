"""torch 2.13's constructor keywords, checked and resolved into what the wrapper keeps.

Pure functions of the arguments and the module (no collective): the process group, the devices,
the buffer policy, the bucket limits, which parameters the Reducer synchronises, mixed
precision; and the parameters and buffers a user excluded (`exclude_from_sync`). Each error
names the argument and says what to pass instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.bucketing import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES, MIB
from .mixed import MixedPrecisionParams

__all__ = [
    "bucket_limits",
    "buffer_policy",
    "default_group",
    "exclude_from_sync",
    "expects_sparse_gradient",
    "ignored",
    "mixed_precision_params",
    "module_buffers",
    "refuse_sharding",
    "resolve_devices",
    "resolve_group",
    "trainable_parameters",
]


def resolve_group(group: dist.ProcessGroup | None, mesh: Any) -> dist.ProcessGroup:
    if mesh is None:
        return group if group is not None else default_group()
    if group is not None:
        raise RuntimeError("pass either process_group or device_mesh, not both")
    if mesh.ndim != 1:
        raise RuntimeError(
            f"device_mesh must be one-dimensional for data parallelism, got {mesh.ndim} "
            f"dimensions {tuple(mesh.shape)}; pass device_mesh[\"dp\"] (a 1-D slice)"
        )
    return mesh.get_group()


def default_group() -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            "gradsync.DistributedDataParallel needs a process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment "
            "for it), or pass process_group=..."
        )
    return dist.group.WORLD  # type: ignore[return-value]


def resolve_devices(
    module: nn.Module, device_ids: list | None, output_device: Any
) -> tuple[list[torch.device] | None, torch.device | None]:
    devices = {p.device for p in module.parameters()}
    if device_ids is None or len(devices) > 1 or devices <= {torch.device("cpu")}:
        if device_ids:
            raise ValueError(
                f"device_ids={device_ids} only applies to a module on a single accelerator; "
                f"this module's parameters are on {sorted(str(d) for d in devices)}. "
                "Pass device_ids=None."
            )
        return None, None
    ids = [torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in device_ids]
    if len(ids) != 1:
        raise ValueError(f"device_ids={device_ids}: give exactly one device per process")
    return ids, torch.device(output_device) if output_device is not None else ids[0]


def buffer_policy(broadcast_buffers: bool | None, forward_sync: bool | None) -> tuple[bool, bool]:
    """(sync buffers at each forward, sync buffers at construction), as torch 2.13 decides."""
    if forward_sync is not None:
        return forward_sync, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def bucket_limits(
    cap_mb: float | None, cap_mb_list: list[float] | None
) -> tuple[list[int], bool]:
    """(byte limits, whether they are explicit per-bucket caps), as torch 2.13 sets them."""
    caps = list(cap_mb_list or []) + ([] if cap_mb is None else [cap_mb])
    bad = [c for c in caps if c < 0]
    if bad:
        raise ValueError(f"bucket sizes must be >= 0 MiB, got {bad}")
    if cap_mb_list:
        return [int(c * MIB) for c in cap_mb_list], True
    if cap_mb is None:
        return [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES], False
    return [int(cap_mb * MIB)], False


def trainable_parameters(
    module: nn.Module, delayed: set[str], has_delayed: bool
) -> list[tuple[str, nn.Parameter]]:
    """The parameters the Reducer synchronises: trainable, neither excluded nor delayed."""
    left_out = ignored(module) | delayed
    named = [
        (n, p)
        for n, p in module.named_parameters()  # shared parameters are listed once
        if p.requires_grad and n not in left_out
    ]
    if not named and not has_delayed:
        raise RuntimeError(
            "gradsync.DistributedDataParallel: the module has no parameter that requires a "
            "gradient, so there is nothing to synchronise. Wrap a module with trainable "
            "parameters, or train without DistributedDataParallel."
        )
    return named


def expects_sparse_gradient(module: nn.Module, names: list[str]) -> list[bool]:
    """Per parameter: does its module produce a sparse gradient (Embedding(sparse=True))?"""
    sparse: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            sparse.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False))
    return [n in sparse for n in names]


def mixed_precision_params(
    module: nn.Module, config: Any, as_view: bool
) -> MixedPrecisionParams | None:
    if config is None:
        return None
    if as_view:
        raise NotImplementedError(
            "gradsync: mixed_precision with gradient_as_bucket_view=True is not supported (the "
            "bucket holds low-precision gradients while .grad is float32); drop one of them"
        )
    return MixedPrecisionParams(module, config, ignored(module))


def refuse_sharding(auto: bool, delayed: bool) -> None:
    """Raise if a wrapper built with these options cannot hand its gradients to ZeRO-2."""
    refused = [why for cond, why in (
        (auto, 'bucket_cap_mb="auto" (the planner changes the layout; sharded state follows it)'),
        (delayed, "delay_all_reduce_named_params"),
    ) if cond]
    if refused:
        raise ValueError(
            f"gradsync: cannot shard this wrapper's gradients with {', '.join(refused)}; pass a "
            "numeric bucket_cap_mb and leave the others out, or use "
            "ZeroRedundancyOptimizer(shard_gradients=False) (ZeRO-1)"
        )


def exclude_from_sync(module: nn.Module, names: list[str]) -> None:
    """Leave these parameters and buffers (by qualified name) out of synchronisation.

    Call before wrapping: excluded parameters keep rank-local gradients and are not broadcast
    at construction; excluded buffers are never broadcast. Same effect as torch's
    `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`.
    """
    known = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"exclude_from_sync: {unknown} are not parameters or buffers of this module; "
            f"valid names include {sorted(known)[:10]}"
        )
    module._ddp_params_and_buffers_to_ignore = list(names)  # type: ignore[assignment]


def ignored(module: nn.Module) -> set[str]:
    """The names `exclude_from_sync` (or torch's equivalent) left out."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def module_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers that are broadcast: all but the excluded ones."""
    left_out = ignored(module)
    return [b for n, b in module.named_buffers() if n not in left_out]
