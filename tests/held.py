"""A gloo group whose all-reduces complete only when waited for, and a small model to run on it:
the overlapped optimizer's buckets then all land late, deterministically, each where it is
next needed (`tests/threaded/test_overlap_*`)."""

from __future__ import annotations

import torch


class Held:
    """A group whose all-reduces complete only when waited for: a link slower than anything
    else (deterministic), each wait logged with the size of what it waited for."""

    def __init__(self, group):
        self._group, self.waited = group, []

    def __getattr__(self, name):
        return getattr(self._group, name)

    def allreduce(self, tensors, *args):
        return HeldWork(self._group.allreduce(tensors, *args), tensors[0].numel(), self.waited)


class HeldWork:
    def __init__(self, work, numel, log):
        self._work, self._numel, self._log, self._waited = work, numel, log, False

    def is_completed(self):
        return self._waited

    def wait(self, *args):
        self._log.append(self._numel)
        self._waited = True
        return self._work.wait(*args)

    def __getattr__(self, name):
        return getattr(self._work, name)


def layers():
    """Four 8x8 linear layers in a row."""
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
