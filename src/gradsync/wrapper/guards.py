"""Opt-in guards against silent failures: ranks whose parameters drifted apart, and gradients
that are NaN or infinite before they are averaged into everyone else's.

Both raise on the rank(s) concerned with the parameter's name; the divergence check raises the
same error on every rank, because every rank takes part in it and reaches the same verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..engine.collectives import DEFAULT_TIMEOUT, all_reduce, broadcast_tensors, wait
from ..engine.errors import GradSyncError

__all__ = ["ParameterDivergenceError", "check_parameters_in_sync"]


class ParameterDivergenceError(GradSyncError):
    """Parameters that should be identical on every rank are not."""


def check_parameters_in_sync(
    named: Sequence[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Raise ParameterDivergenceError, on every rank, if any parameter differs across ranks.

    Cheap: two all-reduces of two float64 fingerprints per parameter (sum and sum of squares);
    only when they disagree is the first differing parameter compared in full, to say by how
    much and on which ranks.
    """
    with torch.no_grad():
        prints = torch.stack(
            [torch.stack([p.double().sum(), p.double().pow(2).sum()]) for _, p in named]
        )
        high, low = prints.clone(), prints.clone()
        all_reduce(group, high, dist.ReduceOp.MAX, "divergence check: fingerprints", timeout)
        all_reduce(group, low, dist.ReduceOp.MIN, "divergence check: fingerprints", timeout)
        differs = ((high != low).any(dim=1)).nonzero()
        if len(differs) == 0:
            return
        index = int(differs[0].item())
        name, param = named[index]
        reference = param.detach().clone()
        broadcast_tensors(group, [reference], 0, timeout, "divergence check: rank 0's copy")
        local = (param.detach() - reference).abs().max().double().reshape(1)
        every = [
            torch.zeros(1, dtype=torch.float64, device=local.device) for _ in range(group.size())
        ]
        wait(group.allgather([every], [local]), "divergence check: differences", group, timeout)
        ranks = [r for r, d in enumerate(every) if d.item() > 0]
        worst = max(d.item() for d in every)
    raise ParameterDivergenceError(
        f"gradsync: parameter {name!r} (shape {list(param.shape)}) differs across ranks: ranks "
        f"{ranks} differ from rank 0 by up to {worst:.3g} ({len(differs)} parameter(s) differ "
        "in all). Data-parallel replicas have drifted apart: a rank skipped a step or an "
        "update, changed parameters outside the optimizer, or used a nondeterministic op whose "
        "result fed back into the weights. Reload a checkpoint, or re-broadcast rank 0's "
        "parameters (torch.distributed.broadcast) if that is what you want."
    )
