"""The multi-process tier: what only real processes under torch's launcher show."""

from __future__ import annotations

import json
import os

import pytest

from gradsync.testing import run_torchrun

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def test_torchrun_training_matches_torch_ddp_step_for_step():
    result = run_torchrun(os.path.join(SCRIPTS, "train_parity.py"), 2, ["15"], timeout=120)
    assert result.returncode == 0, result.stdout
    for rank in range(2):
        assert f"rank {rank}: 15 steps matched torch DDP exactly" in result.stdout


def test_demo_trains_and_proves_synchronisation(tmp_path):
    result = run_torchrun(
        "gradsync.demo", 2, ["--epochs", "12", "--out", str(tmp_path)], module=True, timeout=180
    )
    out = result.stdout
    assert result.returncode == 0, out
    accuracy = float(out.split("held-out accuracy:")[1].split("%")[0])
    assert accuracy >= 95.0, out
    assert "parameters identical on all 2 ranks: True" in out
    assert "max |DDP - single process on whole batches|: 0.00e+00" in out
    assert "RESULT: PASS" in out and "overlap ratio" in out
    assert (tmp_path / "overlap.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_demo_cli_refuses_bad_values():
    from gradsync.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--lr", "-1"])
    with pytest.raises(SystemExit, match="--nproc must be at least 1"):
        main(["demo", "--nproc", "0"])


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


def test_bench_quick_runs_every_variant_and_checks_parameters(tmp_path):
    result = run_torchrun(
        "gradsync.benchsuite", 2, ["--quick", "--out", str(tmp_path)], module=True, timeout=300
    )
    assert result.returncode == 0, result.stdout
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert set(summary) == {"many_small", "convnet"}
    for model in summary.values():
        assert set(model["median_ms"]) == {
            "torch DDP", "gradsync", "gradsync as_view", "gradsync planned", "no overlap", "compute only"
        }
        assert max(model["max_param_diff_to_torch"].values()) <= 1e-3
        assert model["ratio_to_torch"]["torch DDP"] == 1.0
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "communication floor" in (tmp_path / "bench.md").read_text()
