"""Checks of the gradients themselves, run by the Reducer as it fills a bucket (opt-in)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import GradSyncError

__all__ = ["check_finite"]


def check_finite(
    grads: Sequence[torch.Tensor | None], names: Sequence[str], rank: int, iteration: int
) -> None:
    """Raise naming the first gradient with a NaN or an infinity (one fused norm per call)."""
    present = [(g, n) for g, n in zip(grads, names) if g is not None and not g.is_sparse]
    if not present:
        return
    norms = torch._foreach_norm([g for g, _ in present])
    if torch.isfinite(torch.stack(norms)).all():
        return
    for (grad, name), norm in zip(present, norms):
        if not torch.isfinite(norm):
            kind = "NaN" if torch.isnan(grad).any() else "infinite values"
            raise GradSyncError(
                f"gradsync: the gradient of {name!r} on rank {rank} holds {kind} in iteration "
                f"{iteration}, before communication: averaging it would spread it to every "
                "rank. Lower the learning rate, use gradient clipping or loss scaling, or check "
                "this rank's input data."
            )
