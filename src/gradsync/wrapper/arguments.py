"""torch 2.13's constructor keywords, checked and resolved into what the wrapper keeps.

Pure functions of the arguments and the module (no collective): the process group, the devices,
the buffer policy, the bucket limits, which parameters the Reducer synchronises, mixed
precision; and the parameters and buffers a user excluded (`exclude_from_sync`). Each error
names the argument and says what to pass instead.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.bucketing import DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES, MIB
from .mixed import MixedPrecisionParams

__all__ = [
    "bucket_limits",
    "buffer_policy",
    "check_keywords",
    "check_module",
    "default_group",
    "exclude_from_sync",
    "expects_sparse_gradient",
    "frozen_parameters",
    "ignored",
    "mixed_precision_params",
    "module_buffers",
    "refuse_sharding",
    "resolve_devices",
    "resolve_group",
    "trainable_parameters",
    "warn_deprecated",
]


# The constructor's flags: torch reads each as a truth value (pybind accepts bool, int, None).
FLAGS = (
    "broadcast_buffers", "init_sync", "find_unused_parameters", "check_reduction",
    "gradient_as_bucket_view", "static_graph", "skip_all_reduce_unused_params", "batched_grad_copy",
    "forward_sync_buffers",
)


def check_module(module: Any) -> None:
    """Raise if `module` cannot be wrapped: not a module, or parameters not yet materialised."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"gradsync.DistributedDataParallel: module must be a torch.nn.Module, got "
            f"{type(module).__name__} ({module!r:.80}). Wrap the model itself: "
            "DistributedDataParallel(model, ...)."
        )
    lazy = [n for n, p in module.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise RuntimeError(
            f"gradsync.DistributedDataParallel: {len(lazy)} parameter(s) of the module are not "
            f"initialised yet (lazy modules such as nn.LazyLinear): {', '.join(lazy[:10])}. Their "
            "shapes are unknown until the first forward, so no bucket can hold them. Run one "
            "forward on a sample batch first (model(sample)), then wrap the model."
        )


def check_keywords(
    module: Any, device_ids: Any, output_device: Any, dim: Any, process_group: Any,
    bucket_cap_mb: Any, bucket_cap_mb_list: Any, mixed_precision: Any, device_mesh: Any,
    delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any, **flags: Any,
) -> None:
    """The constructor's keywords, all of them: raise, naming the keyword, for a value of the
    wrong type or out of range, before anything else runs, so no rank enters a collective its
    peers never reach. (The delayed all-reduce's pair is checked with the module's parameters,
    `DelayedAllReduce.from_arguments`.)"""
    assert set(flags) == set(FLAGS), f"keywords not checked: {set(flags) ^ set(FLAGS)}"
    check_module(module)
    for name, value in flags.items():
        if not _is_flag(value):
            raise TypeError(f"{name}={value!r}: expected True or False")
    if not isinstance(dim, numbers.Integral) or isinstance(dim, bool):
        raise TypeError(
            f"dim={dim!r}: expected an int, the batch dimension of the inputs (0 by default)"
        )
    if device_ids is not None and not isinstance(device_ids, (list, tuple)):
        raise TypeError(
            f"device_ids={device_ids!r}: expected a list of one device, e.g. [local_rank], or None"
        )
    _check_group(process_group, device_mesh)
    if not (bucket_cap_mb is None or bucket_cap_mb == "auto" or _is_size(bucket_cap_mb)):
        raise _size_error(
            bucket_cap_mb, f"bucket_cap_mb={bucket_cap_mb!r}: expected a bucket size in MiB (a "
            'number >= 0, e.g. 25) or "auto" (planned from measurements)')
    if bucket_cap_mb_list is not None:
        message = (f"bucket_cap_mb_list={bucket_cap_mb_list!r}: expected a list of bucket "
                   "sizes in MiB (numbers >= 0), one a bucket, or None")
        if not isinstance(bucket_cap_mb_list, (list, tuple)):
            raise TypeError(message)
        for size in bucket_cap_mb_list:
            if not _is_size(size):
                raise _size_error(size, message)
    if mixed_precision is not None:
        _check_mixed_precision(mixed_precision)


def _is_flag(value: Any) -> bool:
    """True, False, an int or None, as torch's DDP reads them (numpy's bool too); not a string."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    return value is None or isinstance(value, numbers.Integral) or numpy_bool


def _is_size(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value) and float(value) >= 0


def _size_error(value: Any, message: str) -> Exception:
    """A number out of range is a ValueError; anything else, a TypeError."""
    return ValueError(message) if isinstance(value, numbers.Real) else TypeError(message)


def _check_group(group: Any, mesh: Any) -> None:
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        rank = f"global rank {dist.get_rank()}" if dist.is_initialized() else "this rank"
        raise ValueError(
            f"process_group: {rank} is not a member of the group passed (torch.distributed."
            "new_group returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out). Build "
            "the wrapper only on the group's ranks (if dist.get_rank() in ranks: ...), or pass a "
            "group this rank belongs to."
        )
    if group is not None and not all(
        callable(getattr(group, m, None)) for m in ("rank", "size", "allreduce")
    ):
        raise TypeError(
            f"process_group={group!r:.80}: expected a torch.distributed.ProcessGroup (from "
            "dist.new_group(...)) or None for the default group"
        )
    if mesh is not None and not hasattr(mesh, "get_group"):
        raise TypeError(
            f"device_mesh={mesh!r:.80}: expected a torch.distributed.device_mesh.DeviceMesh "
            "(one-dimensional), or None"
        )


def _check_mixed_precision(config: Any) -> None:
    dtypes = {n: getattr(config, n, None) for n in ("param_dtype", "reduce_dtype", "buffer_dtype")}
    if not hasattr(config, "param_dtype") or not all(
        d is None or isinstance(d, torch.dtype) for d in dtypes.values()
    ):
        raise TypeError(
            f"mixed_precision={config!r:.80}: expected torch's mixed precision config, "
            "torch.nn.parallel.distributed._MixedPrecision(param_dtype=torch.bfloat16, ...), with "
            "torch dtypes (or None) for param_dtype, reduce_dtype and buffer_dtype"
        )


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
        for name, given in (("device_ids", device_ids), ("output_device", output_device)):
            if given or (name == "output_device" and given is not None):
                raise ValueError(
                    f"{name}={given} only applies to a module on a single accelerator; "
                    f"this module's parameters are on {sorted(str(d) for d in devices)}. "
                    f"Pass {name}=None."
                )
        return None, None
    ids = [
        torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in device_ids
    ]
    if len(ids) != 1:
        raise ValueError(f"device_ids={device_ids}: give exactly one device per process")
    return ids, torch.device(output_device) if output_device is not None else ids[0]


def warn_deprecated(broadcast_buffers: bool | None, forward_sync: bool | None,
                    check_reduction: bool) -> None:
    """torch 2.13's FutureWarnings for the arguments it deprecates, where it gives them (the
    arguments still work as they do there)."""
    if broadcast_buffers is not None and forward_sync is not None:
        warnings.warn("DistributedDataParallel(broadcast_buffers=...) is deprecated in torch "
                      "2.13, and ignored since forward_sync_buffers was given too",
                      FutureWarning, stacklevel=3)
    elif broadcast_buffers is not None:
        warnings.warn("DistributedDataParallel(broadcast_buffers=...) is deprecated in torch "
                      "2.13: pass forward_sync_buffers instead (forward_sync_buffers=False still "
                      "broadcasts the buffers once at construction, which broadcast_buffers=False "
                      "does not: keep broadcast_buffers=False for buffers that must stay "
                      "rank-local)", FutureWarning, stacklevel=3)
    if check_reduction:  # accepted and unused, in torch too
        warnings.warn("DistributedDataParallel(check_reduction=True) is deprecated in torch "
                      "and does nothing: a reduction always completes, parameters without "
                      "a gradient included; leave it out", FutureWarning, stacklevel=3)


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


def frozen_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters left out because they did not require grad (not excluded on purpose)."""
    left_out = ignored(module)
    return [
        (n, p) for n, p in module.named_parameters() if not p.requires_grad and n not in left_out
    ]


def expects_sparse_gradient(module: nn.Module, names: list[str]) -> list[bool]:
    """Per parameter: does its module produce a sparse gradient (Embedding(sparse=True))?"""
    sparse: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            sparse.update(
                f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False)
            )
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
