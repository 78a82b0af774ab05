"""One gradient's path in a few files: the source files of gradsync that one default
synchronised step enters (forward and backward, after warm-up), counted by a profiler.

A reader follows one step through these files and no others; a change that spreads the
default path over more files fails here, and says which it entered (the other configurations
branch off the default path where they differ, and are not counted)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

import gradsync
from gradsync.testing import run_threaded

SRC = Path(gradsync.__file__).resolve().parent
# 19 at 7794a92, before a bucket's collective had one owner (#50); 9 at 15dd25b; 6 since the
# timelines live with the Reducer, the forward's guards with the forward, and the log listener
# is not called while logging is off.
MAX_FILES = 6


def _files_one_step_enters(rank: int, group: object) -> dict[str, set[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ddp = gradsync.DistributedDataParallel(model, process_group=group)
    x = torch.randn(8, 32)
    for _ in range(3):  # past the first iterations' rebuild of the buckets in ready order
        ddp(x).sum().backward()
    entered: dict[str, set[str]] = {}

    def profile(frame, event, _arg):  # noqa: ANN001, ANN202
        if event == "call" and frame.f_code.co_filename.startswith(str(SRC)):
            name = str(Path(frame.f_code.co_filename).relative_to(SRC))
            entered.setdefault(name, set()).add(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        ddp(x).sum().backward()
    finally:
        sys.setprofile(None)
    return entered


def test_one_default_step_enters_few_files():
    for entered in run_threaded(_files_one_step_enters, 2, timeout=120):
        listing = "\n".join(
            f"  {f}: {', '.join(sorted(names))}" for f, names in sorted(entered.items()))
        assert len(entered) <= MAX_FILES, f"one step entered {len(entered)} files:\n{listing}"
        path = {"wrapper/ddp.py", "engine/reducer.py", "engine/reductions.py", "engine/bucket.py",
                "engine/reports.py", "engine/waits.py"}
        assert set(entered) <= path, f"one step entered files off its path:\n{listing}"
