"""Checks of the gradients themselves, run by the Reducer as it fills a bucket (opt-in).

The finite check takes one fused norm per bucket, in float32 whatever the gradients' dtype (a
half-precision norm overflows to inf on gradients that are all finite). A NaN anywhere makes
the norm NaN; an infinity, with no NaN, makes it inf: the norms alone say which.

Read back "now" (gloo's default), the norms are read on the host before the bucket is sent, so
nothing non-finite reaches another rank. Read back "deferred" (a device group's default), they
go to the host behind an event (`device.HostRead`) and are read once landed, at the end of a
backward or a later iteration's start: no host sync on the step path, but the bucket has been
averaged by then.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .device import HostRead
from .errors import GradSyncError

__all__ = ["PendingFinite", "check_finite", "check_finite_later"]


class PendingFinite:
    """One bucket's gradient norms on their way to the host (deferred read-back)."""

    def __init__(self, names: list[str], norms: torch.Tensor, rank: int, iteration: int) -> None:
        self.names, self.rank, self.iteration = names, rank, iteration
        self._read = HostRead(norms)

    def ready(self) -> bool:
        return self._read.ready()

    def check(self) -> None:
        """Raise naming the first gradient whose norm was not finite."""
        for name, norm in zip(self.names, self._read.get()):
            if not math.isfinite(norm):
                raise GradSyncError(_message(name, norm, self.rank, self.iteration, deferred=True))


def _norms(grads: Sequence[torch.Tensor | None],
           names: Sequence[str]) -> tuple[list[str], torch.Tensor] | None:
    present = [(g, n) for g, n in zip(grads, names) if g is not None and not g.is_sparse]
    if not present:
        return None
    norms = torch._foreach_norm([g for g, _ in present], dtype=torch.float32)
    return [n for _, n in present], torch.stack(norms)


def check_finite(
    grads: Sequence[torch.Tensor | None], names: Sequence[str], rank: int, iteration: int
) -> None:
    """Raise naming the first gradient with a NaN or an infinity (reads the norms at once)."""
    found = _norms(grads, names)
    if found is None or torch.isfinite(found[1]).all():
        return
    for name, norm in zip(found[0], found[1].tolist()):
        if not math.isfinite(norm):
            raise GradSyncError(_message(name, norm, rank, iteration, deferred=False))


def check_finite_later(
    grads: Sequence[torch.Tensor | None], names: Sequence[str], rank: int, iteration: int
) -> PendingFinite | None:
    """The same check, read once the norms have reached the host (`PendingFinite.check`)."""
    found = _norms(grads, names)
    return None if found is None else PendingFinite(found[0], found[1], rank, iteration)


def _message(name: str, norm: float, rank: int, iteration: int, deferred: bool) -> str:
    kind = "NaN" if math.isnan(norm) else "infinite values"
    if deferred:
        when = ("when it was sent; read back deferred, this is known only now, after its bucket "
                "was averaged into every rank's gradients (configure(read_back=\"now\") stops "
                "it before communication, at the cost of a host sync per bucket)")
    else:
        when = "before communication: averaging it would spread it to every rank"
    return (
        f"gradsync: the gradient of {name!r} on rank {rank} holds {kind} in iteration "
        f"{iteration}, {when}. Lower the learning rate, use gradient clipping or loss scaling, "
        "or check this rank's input data."
    )
