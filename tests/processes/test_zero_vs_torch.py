"""gradsync's ZeroRedundancyOptimizer against torch's own, which needs a process group that
torch.distributed registered (real processes under torchrun): equal parameters bit for bit with
SGD (momentum), Adam and AdamW, gradients sharded or not, and consolidated state dicts equal to
the plain optimizer's; a sharded checkpoint resumed by a new torchrun job."""

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
        for kind in ("gradsync", "gradsync zero1"):
            for optimizer in ("sgd", "adam", "adamw"):
                line = (
                    f"rank {rank}: {kind}: {optimizer}: equal to torch's "
                    f"ZeroRedundancyOptimizer True, to DDP + {optimizer} True"
                )
                assert line in result.stdout, result.stdout[-6000:]
    assert result.stdout.count("consolidated state equal True") == 6, result.stdout[-6000:]


@pytest.mark.timeout(240)
def test_a_sharded_checkpoint_resumes_in_a_new_torchrun_job(tmp_path):
    saved = run_torchrun(SCRIPT, 2, ["save", str(tmp_path)], timeout=100)
    assert saved.returncode == 0 and saved.stdout.count(": saved") == 2, saved.stdout[-6000:]
    resumed = run_torchrun(SCRIPT, 2, ["resume", str(tmp_path)], timeout=100)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    for rank in (0, 1):
        assert f"rank {rank}: resumed equal to uninterrupted True" in resumed.stdout, (
            resumed.stdout[-6000:]
        )
