"""The sharded optimizer's state dicts, in the unsharded optimizer's format.

`consolidate` gathers every rank's pieces of state onto one rank and joins them into whole
parameters' state, indexed by the parameter's position over all groups, as
`torch.optim.Optimizer.state_dict()` does; `load` cuts such a dict back into this rank's pieces.
Such a dict is independent of the world size: it loads into a sharded optimizer of any world
size, or into the plain optimizer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..engine.collectives import all_gather_objects
from .zero_shards import Piece, flat

__all__ = ["consolidate", "load"]

# One rank's share of one parameter's state: (first element, elements, whole, state).
_Share = tuple[int, int, bool, dict[str, Any]]


def consolidate(optim: Optimizer | None, pieces: list[Piece], param_groups: list[dict[str, Any]],
                group: dist.ProcessGroup, timeout: timedelta, to: int) -> dict[str, Any] | None:
    """Every rank's state gathered onto rank `to` (a collective: call on every rank), which gets
    the whole state dict; the others None. `pieces`: what `optim` steps, in its order."""
    local = optim.state_dict()["state"] if optim is not None else {}
    # Local state keys run over the local pieces in order.
    mine = [
        (p.index, p.start, p.numel, p.whole, local[i]) for i, p in enumerate(pieces) if i in local
    ]
    gathered = all_gather_objects(group, mine, timeout)
    if group.rank() != to:
        return None
    params = [p for g in param_groups for p in g["params"]]
    by_param: dict[int, list[_Share]] = {}
    for part in gathered:
        for index, start, numel, whole, state in part:  # type: ignore[attr-defined]
            by_param.setdefault(index, []).append((start, numel, whole, state))
    merged = {
        i: _join_pieces(params[i], sorted(shares, key=lambda t: t[0]))
        for i, shares in by_param.items()
    }
    return {"state": dict(sorted(merged.items())), "param_groups": _global_groups(param_groups)}


def load(optim: Optimizer | None, pieces: list[Piece], param_groups: list[dict[str, Any]],
         state_dict: dict[str, Any]) -> None:
    """Load a whole (consolidated or unsharded) state dict: its hyperparameters into
    `param_groups`, this rank's share of its state into `optim`."""
    groups = state_dict.get("param_groups")
    _check_groups(groups, param_groups)
    assert isinstance(groups, list)
    for ours, theirs in zip(param_groups, groups):
        ours.update({k: v for k, v in theirs.items() if k != "params"})
    state = {int(k): v for k, v in state_dict.get("state", {}).items()}
    params = [p for g in param_groups for p in g["params"]]
    if optim is None:
        return
    local = optim.state_dict()
    local["state"] = {i: _cut_piece(params[p.index], p, state[p.index])
                      for i, p in enumerate(pieces) if p.index in state}
    local["param_groups"] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": lg["params"]}
        for g, lg in zip(param_groups, local["param_groups"])
    ]
    optim.load_state_dict(local)


def _check_groups(groups: Any, param_groups: list[dict[str, Any]]) -> None:
    ours = [len(g["params"]) for g in param_groups]
    if not isinstance(groups, list) or [len(g["params"]) for g in groups] != ours:
        sizes = [len(g["params"]) for g in groups] if isinstance(groups, list) else groups
        raise ValueError(
            "ZeroRedundancyOptimizer.load_state_dict: the dict's parameter groups "
            f"hold {sizes} parameters, this optimizer's {ours} ({sum(ours)} in all)"
        )


def _global_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    start, groups = 0, []
    for g in param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return groups


def _per_element(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def _join_pieces(param: torch.Tensor, pieces: list[_Share]) -> dict[str, Any]:
    """One parameter's state from its pieces' (in order): per-element tensors concatenated into
    the parameter's shape and layout, everything else (a step count) from the first piece."""
    if len(pieces) == 1 and pieces[0][2]:
        return pieces[0][3]
    first = pieces[0][3]
    joined: dict[str, Any] = {}
    for key, value in first.items():
        if _per_element(value, pieces[0][1]):
            whole = torch.empty_strided(param.size(), param.stride(), dtype=value.dtype)
            flat(whole).copy_(torch.cat([state[key] for _, _, _, state in pieces]))
            joined[key] = whole
        else:
            joined[key] = value
    return joined


def _cut_piece(param: torch.Tensor, piece: Piece, state: dict[str, Any]) -> dict[str, Any]:
    """A piece's share of one parameter's whole state (the inverse of `_join_pieces`)."""
    if piece.whole:
        return state
    cut: dict[str, Any] = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == param.shape:
            laid = torch.empty_strided(
                param.size(), param.stride(), dtype=value.dtype, device=value.device
            )
            laid.copy_(value)
            cut[key] = flat(laid)[piece.start:piece.start + piece.numel].clone()
        else:
            cut[key] = value
    return cut
