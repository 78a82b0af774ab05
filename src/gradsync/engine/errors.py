"""Error messages that say what happened, show the values, and give numbered fixes."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "GradSyncError",
    "ReductionTimeoutError",
    "format_names",
    "marked_twice_message",
    "missing_gradients_message",
    "uneven_accumulation_message",
    "unfinished_reduction_message",
]


class GradSyncError(RuntimeError):
    """A misuse or failure detected by gradsync (a RuntimeError, as torch's DDP raises)."""


class ReductionTimeoutError(GradSyncError):
    """A bucket's reduction did not finish within the configured timeout."""


def format_names(names: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


_TWICE_CAUSES = {
    "unused": "It was marked unused (it is not reachable from forward's outputs), and then "
    "received a gradient anyway: it was used outside forward's outputs.",
    "repeat": "Its gradient hook fired twice in one backward pass.",
    "late": "Its gradient arrived after this iteration's gradients had already been reduced, "
    "so it would have been left out of the average.",
}


def marked_twice_message(name: str, index: int, rank: int, cause: str) -> str:
    return (
        f"gradsync: parameter {name!r} (index {index}) on rank {rank} was marked ready for "
        f"reduction twice in the same iteration. {_TWICE_CAUSES[cause]}\n"
        "Possible causes and fixes:\n"
        "  1. The parameter is used outside the module's forward (e.g. in the loss): move that "
        "use inside forward, or make forward return what the loss needs.\n"
        "  2. Activation checkpointing with reentrant backward, or a parameter shared by several "
        "reentrant backward passes: use torch.utils.checkpoint(..., use_reentrant=False), or "
        "static_graph=True if the graph does not change between iterations.\n"
        "  3. backward() was called twice on graphs from one forward: run forward again, or "
        "do the extra backward under no_sync()."
    )


def frozen_since_wrapping_fix(frozen: Sequence[str], static_graph: bool) -> list[str]:
    """The fix for gradients missing because `requires_grad` was turned off after wrapping."""
    if not frozen:
        return []
    what = (
        f"{format_names(frozen)} had requires_grad=True when the wrapper was built and has "
        "requires_grad=False now, so no gradient comes for it."
    )
    rebuild = (
        "build the wrapper again after changing requires_grad (it takes the parameters that "
        "require grad when it is built)"
    )
    if static_graph:
        return [f"{what} static_graph=True needs the same parameters trained in every iteration: "
                f"{rebuild}, or drop static_graph=True and pass find_unused_parameters=True."]
    return [f"{what} Pass find_unused_parameters=True (a frozen parameter is then treated as "
            f"unused, as torch's DDP does), or {rebuild}."]


def unfinished_reduction_message(
    missing: Sequence[str], rank: int, find_unused: bool, iteration: int,
    frozen: Sequence[str] = (),
) -> str:
    detail = (
        f"On rank {rank}, {len(missing)} parameter(s) got no gradient in iteration {iteration}: "
        f"{format_names(missing)}."
    )
    fixes = _WITHOUT_SEARCH
    if find_unused:
        fixes = [
            "Make sure every tensor forward returns is used in the loss: gradsync walks the "
            "graph from forward's outputs, so an output left out of the loss hides its "
            "parameters from the search.",
            "Return the outputs as tensors inside tuples, lists, dicts or dataclasses, which "
            "gradsync can look into.",
        ]
    fixes = frozen_since_wrapping_fix(frozen, False) + fixes
    numbered = "\n".join(f"  {n}. {fix}" for n, fix in enumerate(fixes, 1))
    return (
        "gradsync: a new iteration started before the previous one finished reducing "
        f"gradients. {detail} Their buckets never filled, so the gradients were not "
        f"all-reduced.\nFixes:\n{numbered}"
    )


# What to do about gradients that never came when find_unused_parameters is off.
_WITHOUT_SEARCH = [
    "Pass find_unused_parameters=True if some parameters take no part in the loss in some "
    "iterations or on some ranks (outputs left out of the loss, skipped branches); it costs "
    "a graph walk per iteration.",
    "Otherwise make every parameter take part in the loss, or set requires_grad=False on the "
    "ones that never train before building the wrapper.",
]


def missing_gradients_message(
    per_rank: dict[int, list[tuple[int, str]]],
    iteration: int,
    find_unused: bool,
    static_graph: bool,
    rank: int,
    frozen: Sequence[str] = (),
) -> str:
    """Backward ended on some rank with buckets whose gradients never all came; `frozen`: those
    of them that do not require grad now."""
    lines = []
    for r, entries in sorted(per_rank.items()):
        buckets = sorted({b for b, _ in entries})
        names = format_names([n for _, n in entries])
        lines.append(f"  rank {r}: bucket(s) {', '.join(map(str, buckets))}: {names}")
    if static_graph:
        fixes = [
            "With static_graph=True the parameters that get a gradient, and how often, must be "
            "the same in every iteration as in the first: a branch taken in the first iteration "
            "was skipped here. Drop static_graph=True (and pass find_unused_parameters=True) "
            "if the graph changes.",
        ]
    elif find_unused:
        fixes = [
            "Compute the loss from the tensors forward returns: gradsync walks the graph from "
            "them, and a loss built from something else (a tensor kept on the module, a second "
            "forward) hides parameters from the search.",
            "Do not restrict backward to some tensors (backward(inputs=...)) or take gradients "
            "with torch.autograd.grad alone: the parameters' .grad must be accumulated.",
        ]
    else:
        fixes = _WITHOUT_SEARCH
    fixes = frozen_since_wrapping_fix(frozen, static_graph) + fixes
    numbered = "\n".join(f"  {n}. {fix}" for n, fix in enumerate(fixes, 1))
    return (
        f"gradsync: backward ended in iteration {iteration} with gradients that never came, so "
        "their buckets could not be reduced (raised on every rank; this is rank "
        f"{rank}). Parameters without a gradient, by rank:\n" + "\n".join(lines) + "\n"
        "The gradients were not written back.\nFixes:\n" + numbered
    )


def missing_elsewhere_message(ranks: Sequence[int], iteration: int, rank: int) -> str:
    """Read back late (deferred reports): other ranks' backward ended with gradients missing."""
    return (
        f"gradsync: rank(s) {', '.join(map(str, ranks))} ended the backward of iteration "
        f"{iteration} with gradients that never came (this is rank {rank}; read back "
        "after that iteration, since this group's reports are deferred: read_back='deferred' "
        "or a device group). The error on those ranks names the parameters; the gradients "
        "of that iteration here were averaged with zeros in their place."
    )


def uneven_accumulation_message(micro_steps: Sequence[int], iteration: int) -> str:
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(micro_steps) if n > 0)
    return (
        f"gradsync: ranks synchronised different numbers of micro-steps in iteration "
        f"{iteration} (forward passes since each rank's previous synchronisation: {per_rank}). "
        "no_sync() was entered on some ranks only, so this all-reduce mixed gradients of "
        "different steps (the gradients were not written back), and the rank that skipped a "
        "synchronisation would leave the others waiting at the end.\n"
        "Fixes:\n"
        "  1. Enter no_sync() (or set require_backward_grad_sync=False) on every rank for the "
        "same micro-steps, e.g. from the step number, not from rank-local data.\n"
        "  2. If each rank accumulating a different number of micro-batches is intended, "
        "call ddp.set_accumulation_check(False) on every rank."
    )
