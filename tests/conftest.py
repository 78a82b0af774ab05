"""Shared test set-up: keep torch to one intra-op thread so rank threads do not fight for the
two cores, make the test helpers (models, parity, fuzz) importable, and mark every test with its
tier: the folder it lives in (pure/, threaded/, processes/), unless it says otherwise.

    pytest -m pure          # no process group: a few seconds
    pytest -m threaded      # real gloo groups in threads of this process
    pytest -m processes     # real processes: spawn, torchrun, network namespaces
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _free_wrappers_promptly():
    """Collect each test's garbage (torch's DDP sits in reference cycles) while the test's
    process groups are still whole: a gloo group torn down at interpreter exit can abort it."""
    yield
    gc.collect()


TIERS = ("pure", "threaded", "processes")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(t) for t in TIERS):
            continue  # a test whose tier differs from its folder's says so itself
        folder = item.path.parent.name
        if folder in TIERS:
            item.add_marker(getattr(pytest.mark, folder))
