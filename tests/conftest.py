"""Shared test set-up: keep torch to one intra-op thread so rank threads do not fight for the
two cores, and make the test models importable."""

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
