"""gradsync's ZeroRedundancyOptimizer against torch's own, which needs a process group that
torch.distributed registered (real processes under torchrun): equal parameters bit for bit with
SGD (momentum), Adam and AdamW, and consolidated state dicts equal to the plain optimizer's."""

from __future__ import annotations

import os

import pytest

from gradsync.testing import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "zero_vs_torch.py")


@pytest.mark.timeout(240)
def test_gradsyncs_zero_equals_torchs_and_ddp_with_the_plain_optimizer():
    result = run_torchrun(SCRIPT, 2, timeout=200)
    assert result.returncode == 0, result.stdout[-6000:]
    for rank in (0, 1):
        for optimizer in ("sgd", "adam", "adamw"):
            line = f"rank {rank}: {optimizer}: equal to torch's ZeroRedundancyOptimizer True, to DDP + {optimizer} True"
            assert line in result.stdout, result.stdout[-6000:]
    assert result.stdout.count("consolidated state equal True") == 3, result.stdout[-6000:]
