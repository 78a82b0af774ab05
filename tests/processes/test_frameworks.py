"""The real frameworks under torchrun (2 CPU ranks, gloo), each run twice in one job: under
torch's DistributedDataParallel, then with `gradsync.patch_torch_ddp()` (imported after the
framework, so the name is replaced in modules that already bound it). Same losses, same final
parameters bit for bit, identical across ranks, and the wrapper really gradsync's.

The frameworks are test extras (`pip install -e '.[frameworks]'`, which `make test` does); a
missing one skips its test with the install command."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from gradsync.testing import run_torchrun

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts", "frameworks")

# framework -> (the package it needs, its script, the configurations it runs)
FRAMEWORKS = {
    "hf_trainer": ("transformers", "hf_trainer.py", ["default", "find_unused", "overlap"]),
    "accelerate": ("accelerate", "accelerate_loop.py", ["accumulate", "trigger_sync", "overlap"]),
    "lightning": ("lightning", "lightning_trainer.py",
                  ["automatic", "manual", "manual_static_graph", "static_graph_hook", "overlap",
                   "overlap_manual"]),
    "fabric": ("lightning", "fabric_loop.py", ["no_backward_sync"]),
}
GRADSYNC_CLASS = "gradsync.wrapper.ddp.DistributedDataParallel"
TORCH_CLASS = "torch.nn.parallel.distributed.DistributedDataParallel"


def _results(out_dir: str) -> dict:
    runs = {}
    for path in glob.glob(os.path.join(out_dir, "*.json")):
        with open(path) as f:
            r = json.load(f)
        runs[(r["config"], r["impl"], r["rank"])] = r
    return runs


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_trains_exactly_as_under_torch_ddp(framework, tmp_path):
    package, script, configs = FRAMEWORKS[framework]
    pytest.importorskip(package, reason=f"pip install -e '.[frameworks]' (needs {package})")
    result = run_torchrun(os.path.join(SCRIPTS, script), 2, [str(tmp_path)], timeout=240)
    assert result.returncode == 0, result.stdout[-6000:]
    runs = _results(str(tmp_path))
    for config in configs:
        ours = [runs[(config, "gradsync", r)] for r in (0, 1)]
        theirs = [runs[(config, "torch", r)] for r in (0, 1)]
        for rank in (0, 1):
            what = f"{framework}/{config} rank {rank}"
            assert ours[rank]["wrapper"] == GRADSYNC_CLASS and ours[rank]["is_torch_ddp"], what
            assert theirs[rank]["wrapper"] == TORCH_CLASS, what
            assert len(ours[rank]["losses"]) >= 4, what
            assert ours[rank]["losses"] == theirs[rank]["losses"], what
            assert ours[rank]["params"] == theirs[rank]["params"], what
            assert ours[rank]["comm_hook"] == theirs[rank]["comm_hook"], what
        assert ours[0]["params"] == ours[1]["params"], f"{framework}/{config}: ranks differ"


def test_python_m_gradsync_patch_runs_a_script_unchanged_with_gradsyncs_class(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, gradsync\n"
        "from torch.nn.parallel.distributed import DistributedDataParallel as DDP\n"
        "print(sys.argv, __name__, DDP is gradsync.DistributedDataParallel,\n"
        "      torch.nn.parallel.DistributedDataParallel is gradsync.DistributedDataParallel)\n"
    )
    out = subprocess.run([sys.executable, "-m", "gradsync.patch", str(script), "--lr", "0.1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{str(script)!r}, '--lr', '0.1'] __main__ True True"
