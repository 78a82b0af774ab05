"""`gradsync bench --device`: the device bench's path on CPU (gloo), with the built-in models
shrunk (`--tiny`) and with a user's model through the command line at world size 1, as a GPU
runs it with NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gradsync.testing import kill_process_tree, run_torchrun
from gradsync.tools.devicebench import COMPILED_VARIANTS, DEVICE_MODELS, DEVICE_VARIANTS

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")

USER_MODEL = '''
import torch
from torch import nn


def build():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    return model, (x,), lambda out, batch: nn.functional.cross_entropy(out.float(), y.to(out.device))
'''  # noqa: E501


def test_the_device_bench_runs_every_variant_of_the_three_models_and_they_end_alike(tmp_path):
    args = [
        "--device",
        "cpu",
        "--tiny",
        "--rounds",
        "2",
        "--repeat",
        "1",
        "--compile-backend",
        "aot_eager",
        "--out",
        str(tmp_path),
    ]
    result = run_torchrun("gradsync.tools.benchsuite", 2, args, module=True, timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert "world size 2 (gloo)" in summary["where"]
    assert list(summary["models"]) == list(DEVICE_MODELS)
    for name, model in summary["models"].items():
        variants = COMPILED_VARIANTS if name == "gpt_compiled" else DEVICE_VARIANTS
        assert list(model["median_ms"]) == list(variants)
        # the timed rounds, after the warm-up
        assert all(len(s) == 2 for s in model["samples_ms"].values())
        assert (
            model["ratio_to_torch"]["torch DDP"] == 1.0
            and "torch DDP (again) / torch DDP" in model["pairs"]
        )
        assert model["peak_mib"] == {}  # measured on a GPU only
        # the same steps from the same parameters: exact, at two ranks too (bf16 autocast included)
        assert set(model["max_param_diff_to_torch"]) == set(variants) - {"torch DDP", "no DDP"}
        assert max(model["max_param_diff_to_torch"].values()) == 0.0, (
            name,
            model["max_param_diff_to_torch"],
        )
    assert summary["models"]["gpt_many"]["parameter_tensors"] == 12 * 12 + 4
    assert "gradsync / torch's DDP, find_unused_parameters" in (tmp_path / "bench.md").read_text()
    assert "| A/A |" in result.stdout  # the summary table, printed


def test_a_users_model_is_benched_from_the_command_line_at_world_size_one(tmp_path):
    (tmp_path / "mymodels.py").write_text(USER_MODEL)
    cmd = [
        sys.executable,
        "-m",
        "gradsync.tools.cli",
        "bench",
        "--nproc",
        "1",
        "--model",
        "mymodels:build",
        "--autocast",
        "bf16",
        "--quick",
        "--variants",
        "no DDP,torch DDP,torch DDP (again),gradsync",
        "--out",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_process_tree(proc.pid)  # nothing left behind, whatever happened
    assert proc.returncode == 0, out[-6000:]
    summary = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert "world size 1 (gloo)" in summary["where"]
    model = summary["models"]["mymodels:build"]
    assert list(model["median_ms"]) == ["no DDP", "torch DDP", "torch DDP (again)", "gradsync"]
    assert model["parameter_tensors"] == 4 and (
        model["max_param_diff_to_torch"] == {"torch DDP (again)": 0.0, "gradsync": 0.0}
    )
    assert len(model["samples_ms"]["gradsync"]) == 3  # --quick: 3 rounds
    assert "### mymodels:build, bf16 autocast" in out
