"""Pure bucket planning: which parameters share a flat gradient buffer.

Nothing here touches a process group. `compute_bucket_assignment_by_size` has the contract of
torch's private `torch.distributed._compute_bucket_assignment_by_size`, so layouts can be compared
one to one; `validate_bucket_indices` turns a user-given layout into a clear error before any rank
can wait on a bucket that will never fill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "compute_bucket_assignment_by_size",
    "validate_bucket_indices",
]

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_BYTES = 25 * MIB
# A small first bucket lets the all-reduce of the earliest gradients start sooner (torch: 1 MiB).
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB


def compute_bucket_assignment_by_size(
    tensors: Sequence[torch.Tensor],
    bucket_size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] | None = None,
    tensor_indices: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Group tensors into buckets of at most about `bucket_size_limits` bytes each.

    Tensors are grouped by (dtype, device). A bucket closes as soon as its size reaches the current
    limit of its group, and that group moves on to the next limit in the list (the last one
    repeats). A tensor expected to get a sparse gradient gets a bucket of its own, with limit 0.

    `tensor_indices[i]` is the index reported for `tensors[i]` (default: `i`); when it is given the
    tensors are taken to be in gradient-ready order and full buckets keep that order. Otherwise
    buckets are sorted by the smallest index they hold.

    Returns `(bucket_indices, per_bucket_size_limits)`.
    """
    _check_assignment_args(tensors, bucket_size_limits, expect_sparse_gradient, tensor_indices)
    limits = [int(limit) for limit in bucket_size_limits]
    result = _fill_buckets(tensors, limits, expect_sparse_gradient, tensor_indices)
    if tensor_indices is None:
        result.sort(key=lambda item: min(item[0]))
    return [indices for indices, _ in result], [limit for _, limit in result]


def _fill_buckets(
    tensors: Sequence[torch.Tensor],
    limits: list[int],
    expect_sparse_gradient: Sequence[bool] | None,
    tensor_indices: Sequence[int] | None,
) -> list[tuple[list[int], int]]:
    """One pass over `tensors` in the order given: `(indices, limit)` per bucket, full buckets
    in the order they filled, then each (dtype, device) group's partly filled one."""
    result: list[tuple[list[int], int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], _OpenBucket] = {}
    for i, tensor in enumerate(tensors):
        index = i if tensor_indices is None else int(tensor_indices[i])
        if expect_sparse_gradient and expect_sparse_gradient[index]:
            result.append(([index], 0))
            continue
        key = (tensor.dtype, tensor.device)
        bucket = open_buckets.setdefault(key, _OpenBucket())
        bucket.indices.append(index)
        bucket.size += tensor.numel() * tensor.element_size()
        bucket.limit = limits[min(bucket.limit_position, len(limits) - 1)]
        if bucket.size >= bucket.limit:
            result.append((bucket.indices, bucket.limit))
            open_buckets[key] = _OpenBucket(limit_position=bucket.limit_position + 1)
    # Leftovers: torch emits them in hash-map order; we keep first-seen order, which is the
    # same thing whenever one (dtype, device) group is in play.
    result.extend((b.indices, b.limit) for b in open_buckets.values() if b.indices)
    return result


class _OpenBucket:
    """A bucket still being filled during assignment."""

    __slots__ = ("indices", "size", "limit", "limit_position")

    def __init__(self, limit_position: int = 0) -> None:
        self.indices: list[int] = []
        self.size = 0
        self.limit = 0
        self.limit_position = limit_position


def _check_assignment_args(
    tensors: Sequence[torch.Tensor],
    bucket_size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] | None,
    tensor_indices: Sequence[int] | None,
) -> None:
    if len(tensors) == 0:
        raise ValueError("compute_bucket_assignment_by_size: got no tensors to assign to buckets")
    if len(bucket_size_limits) == 0:
        raise ValueError(
            "compute_bucket_assignment_by_size: bucket_size_limits is empty; give at least one "
            "limit in bytes, e.g. [25 * 1024 * 1024]"
        )
    if expect_sparse_gradient and len(expect_sparse_gradient) != len(tensors):
        raise ValueError(
            f"expect_sparse_gradient has {len(expect_sparse_gradient)} entries for "
            f"{len(tensors)} tensors; give one flag per tensor or none"
        )
    if tensor_indices is not None and len(tensor_indices) != len(tensors):
        raise ValueError(
            f"tensor_indices has {len(tensor_indices)} entries for {len(tensors)} tensors; "
            "give one index per tensor or none"
        )
    for i, tensor in enumerate(tensors):
        if tensor.is_sparse:
            raise ValueError(
                f"tensor {i} is sparse; buckets hold dense parameters (a parameter with a sparse "
                "gradient is flagged through expect_sparse_gradient instead)"
            )


def validate_bucket_indices(
    bucket_indices: Sequence[Sequence[int]],
    params: Sequence[torch.Tensor],
    names: Sequence[str],
) -> list[list[int]]:
    """Check a bucket layout against the parameters; return it as plain lists.

    Every parameter must be in exactly one non-empty bucket, and a bucket holds one dtype on one
    device. Raises ValueError naming the offending bucket and parameters.
    """
    layout = [[int(i) for i in bucket] for bucket in bucket_indices]
    seen: dict[int, int] = {}
    for b, bucket in enumerate(layout):
        if not bucket:
            raise ValueError(f"bucket {b} is empty; every bucket must hold at least one parameter")
        for i in bucket:
            if not 0 <= i < len(params):
                raise ValueError(
                    f"bucket {b} names parameter index {i}, out of range for {len(params)} "
                    f"parameters (valid: 0..{len(params) - 1})"
                )
            if i in seen:
                raise ValueError(
                    f"parameter {i} ({names[i]!r}) is in bucket {seen[i]} and again in bucket {b}; "
                    "each parameter belongs to exactly one bucket"
                )
            seen[i] = b
        _check_bucket_homogeneous(b, bucket, params, names)
    missing = [names[i] for i in range(len(params)) if i not in seen]
    if missing:
        raise ValueError(
            f"{len(missing)} parameter(s) are in no bucket: {_short_list(missing)}; every "
            "parameter that requires grad must be assigned to a bucket"
        )
    return layout


def _check_bucket_homogeneous(
    b: int, bucket: list[int], params: Sequence[torch.Tensor], names: Sequence[str]
) -> None:
    first = params[bucket[0]]
    for i in bucket[1:]:
        p = params[i]
        if p.dtype != first.dtype or p.device != first.device:
            raise ValueError(
                f"bucket {b} mixes {names[bucket[0]]!r} ({first.dtype}, {first.device}) with "
                f"{names[i]!r} ({p.dtype}, {p.device}); a bucket is one flat buffer, so it holds "
                "one dtype on one device. Split them into separate buckets."
            )


def _short_list(items: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(s) for s in items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
