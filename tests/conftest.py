"""Shared test set-up: keep torch to one intra-op thread so rank threads do not fight for the
two cores, make the test helpers (models, parity, fuzz) importable, and mark every test with its
tier: the folder it lives in (pure/, threaded/, processes/), unless it says otherwise.

    pytest -m pure          # no process group: a few seconds
    pytest -m threaded      # real gloo groups in threads of this process
    pytest -m processes     # real processes: spawn, torchrun, network namespaces
"""

import os
import sys

# No AMX tiles in oneDNN (before torch's first matrix product reads it). On this project's
# machine, a nested virtual machine, the first AMX use in a process (a tile-state permission
# the kernel grants, then per-thread state it allocates on first use) disturbed other threads:
# a rank thread's tanh came out wrong (#14, see gradsync.testing._first_linear_here) and, about
# once per thousand threaded fuzz cases, a gloo thread died of a general-protection fault on a
# garbage pointer (libtorch_cpu `gloo::ring`+845, reading the options' output buffer). Both
# reducers run the same kernels either way; parity is unaffected.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _free_wrappers_promptly():
    """Collect each test's garbage (torch's DDP sits in reference cycles) while the test's
    process groups are still whole: a gloo group torn down at interpreter exit can abort it.

    A reducer dropped with collectives in flight waits for them (`reductions.quiesce`), up to
    10 s. The held groups' all-reduces (tests/held.py) complete only when waited for, which a
    dropped reducer never does, so each such reducer collected would wait the whole bound (it
    once added 20-30 s to a test): here the bound is 1 s, their gloo work being long done."""
    from gradsync.engine import reductions

    bound, reductions.QUIESCE_S = reductions.QUIESCE_S, 1.0
    try:
        yield
        gc.collect()
    finally:
        reductions.QUIESCE_S = bound


TIERS = ("pure", "threaded", "processes")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(t) for t in TIERS):
            continue  # a test whose tier differs from its folder's says so itself
        folder = item.path.parent.name
        if folder in TIERS:
            item.add_marker(getattr(pytest.mark, folder))
