"""One line that has every framework build gradsync's wrapper instead of torch's.

    import gradsync
    gradsync.patch_torch_ddp()          # or: with gradsync.patch_torch_ddp(): trainer.fit(...)

HF Trainer, Accelerate, Lightning and Fabric construct `torch.nn.parallel.DistributedDataParallel`
themselves. Some look the name up when they wrap (Accelerate, Transformers); others bound it
when they were imported (`from torch.nn.parallel.distributed import DistributedDataParallel` in
Lightning and Fabric). So the name is replaced in both places torch exposes it, which covers
everything imported later, and in every module already imported that holds torch's class.
torch's own modules keep it (gradsync's class is a subclass, so their checks still pass), and
so do gradsync's.
`undo()` (or leaving the `with` block) puts torch's class back where it was replaced.
"""

from __future__ import annotations

import sys
from types import ModuleType, TracebackType

import torch.nn.parallel
import torch.nn.parallel.distributed

from .ddp import DistributedDataParallel
from .torch_compat import TorchDDP

__all__ = ["TorchDDPReplacement", "patch_torch_ddp"]

_TORCH_PLACES = (torch.nn.parallel, torch.nn.parallel.distributed)


class TorchDDPReplacement:
    """The places where torch's class was replaced by gradsync's; `undo()` restores them."""

    def __init__(self, places: list[tuple[ModuleType, str]]) -> None:
        self.places = places

    def undo(self) -> None:
        """Put torch's class back where this replacement put gradsync's (and it is still there).
        Modules imported while the replacement was in place keep what they imported."""
        for module, name in self.places:
            if getattr(module, name, None) is DistributedDataParallel:
                setattr(module, name, TorchDDP)
        self.places = []

    def __enter__(self) -> TorchDDPReplacement:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.undo()

    def __repr__(self) -> str:
        names = ", ".join(f"{m.__name__}.{n}" for m, n in self.places)
        return f"TorchDDPReplacement({names or 'undone'})"


def patch_torch_ddp() -> TorchDDPReplacement:
    """Make `torch.nn.parallel.DistributedDataParallel` gradsync's class, for every framework
    (imported before or after this call) until the returned object's `undo()`."""
    places = []
    for module in list(sys.modules.values()):
        if not isinstance(module, ModuleType) or not _may_replace_in(module):
            continue
        for name, value in list(vars(module).items()):
            if value is TorchDDP:
                setattr(module, name, DistributedDataParallel)
                places.append((module, name))
    return TorchDDPReplacement(places)


def _may_replace_in(module: ModuleType) -> bool:
    # Not in torch's own code (but in its two public places), nor in gradsync's, which keeps
    # torch's class under its own name.
    name = getattr(module, "__name__", "")
    own = any(name == top or name.startswith(f"{top}.") for top in ("torch", "gradsync"))
    return not own or any(module is place for place in _TORCH_PLACES)
