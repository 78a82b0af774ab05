"""The package as a user meets it: the wheel built from this tree installs into a fresh virtual
environment with no extras (torch at the pinned CPU build, as `make` installs it), prints its
version and runs the demo to its PASS. matplotlib is not there: the demo must say the PNG was
skipped, not die (`pyproject.toml` promises everything but the PNG works without the plot extra).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
TORCH_PIN = "torch==2.13.0"  # the Makefile's pin: the CPU wheel on disk here


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout + done.stderr


@pytest.mark.timeout(900)
def test_the_wheel_installs_without_extras_and_runs_the_demo(tmp_path):
    tree = tmp_path / "tree"  # a copy: building in the checkout would leave build/ behind
    shutil.copytree(ROOT / "src", tree / "src",
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dist), str(tree)],
         tmp_path, 600)
    (wheel,) = dist.glob("gradsync-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", TORCH_PIN, str(wheel)], tmp_path, 600)
    assert "matplotlib" not in _run([python, "-m", "pip", "list"], tmp_path, 60)

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    gradsync = str(venv / "bin" / "gradsync")
    assert _run([gradsync, "--version"], tmp_path, 60).strip() == f"gradsync {version}"
    out = _run([gradsync, "demo", "--epochs", "3", "--out", str(tmp_path / "demo")], tmp_path, 300)
    assert "RESULT: PASS" in out, out
    assert "matplotlib" in out  # the PNG is skipped with the reason, and the run still passes


@pytest.mark.pure
def test_the_torch_range_claimed_is_the_range_tested():
    import torch
    from packaging.requirements import Requirement

    (claim,) = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())
                ["project"]["dependencies"] if d.startswith("torch")]
    assert torch.__version__.split("+")[0] in claim.specifier, (
        f"the tests run on torch {torch.__version__}, outside the range pyproject.toml claims "
        f"({claim}): test that version or state the range the tests run on"
    )
