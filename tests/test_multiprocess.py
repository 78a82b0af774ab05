"""The multi-process tier: what only real processes under torch's launcher show."""

from __future__ import annotations

import os

from gradsync.testing import run_torchrun

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def test_torchrun_training_matches_torch_ddp_step_for_step():
    result = run_torchrun(os.path.join(SCRIPTS, "train_parity.py"), 2, ["15"], timeout=120)
    assert result.returncode == 0, result.stdout
    for rank in range(2):
        assert f"rank {rank}: 15 steps matched torch DDP exactly" in result.stdout


def test_demo_trains_and_proves_synchronisation():
    result = run_torchrun(
        "gradsync.demo", 2, ["--epochs", "2", "--samples", "3000"], module=True, timeout=180
    )
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "parameters identical on all ranks: True" in out
    assert "max |gradsync - torch DDP| over all parameters: 0" in out
    accuracy = float(out.split("held-out accuracy:")[1].split("%")[0])
    assert accuracy > 30.0, out  # chance is 10 %


def test_readme_example_runs_under_torchrun():
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train.py")
    result = run_torchrun(example, 2, timeout=120)
    assert result.returncode == 0, result.stdout


def test_readme_shows_the_example_that_is_tested():
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(root, "examples", "train.py")) as f:
        example = f.read()
    assert example.strip() in readme
