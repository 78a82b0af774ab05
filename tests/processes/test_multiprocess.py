"""The multi-process tier: what only real processes under torch's launcher show."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gradsync.testing import run_processes, run_torchrun

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def test_torchrun_training_matches_torch_ddp_step_for_step():
    result = run_torchrun(os.path.join(SCRIPTS, "train_parity.py"), 2, ["15"], timeout=120)
    assert result.returncode == 0, result.stdout
    for rank in range(2):
        assert f"rank {rank}: 15 steps matched torch DDP exactly" in result.stdout


def test_demo_trains_and_proves_synchronisation(tmp_path):
    result = run_torchrun(
        "gradsync.tools.demo",
        2,
        ["--epochs", "12", "--out", str(tmp_path)],
        module=True,
        timeout=180,
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


def test_demo_runs_without_the_plot_extra(tmp_path):
    # As a user who ran `pip install gradsync` meets it: no matplotlib. Every rank once died
    # in observability/plot.py after training; the picture is the one thing left out.
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "matplotlib.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    path = os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))
    result = run_torchrun(
        "gradsync.tools.demo",
        2,
        ["--epochs", "12", "--out", str(tmp_path / "out")],
        module=True,
        timeout=180,
        env={"PYTHONPATH": path},
    )
    assert result.returncode == 0, result.stdout
    assert "overlap timeline (PNG):  not drawn: matplotlib is not installed" in result.stdout
    assert "parameters identical on all 2 ranks: True" in result.stdout
    assert not (tmp_path / "out" / "overlap.png").exists()


def test_version_is_printed(capsys):
    from gradsync import __version__
    from gradsync.tools.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"gradsync {__version__}\n"


def test_demo_cli_refuses_bad_values():
    from gradsync.tools.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--lr", "-1"])
    with pytest.raises(SystemExit, match="--nproc must be at least 1"):
        main(["demo", "--nproc", "0"])


def test_readme_example_runs_under_torchrun():
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train.py")
    result = run_torchrun(example, 2, timeout=120)
    assert "rank 0: trained 100 steps" in result.stdout, result.stdout
    assert "rank 1: trained 100 steps" in result.stdout, result.stdout
    assert result.returncode == 0, result.stdout  # no abort at exit (see gradsync/__init__.py)


@pytest.mark.pure
def test_readme_shows_the_example_that_is_tested():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    with open(os.path.join(root, "examples", "train.py")) as f:
        example = f.read()
    assert example.strip() in readme


def test_bench_quick_runs_every_variant_and_checks_parameters(tmp_path):
    result = run_torchrun(
        "gradsync.tools.benchsuite",
        2,
        ["--quick", "--overlap-tails", "50", "--out", str(tmp_path)],
        module=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert set(summary) == {"many_small", "convnet"}
    for model in summary.values():
        assert set(model["median_ms"]) == {
            "torch DDP", "torch DDP (again)", "gradsync", "gradsync as_view", "gradsync planned",
            "gradsync overlap", "gradsync overlap planned",
            "no overlap", "compute only", "gradsync overlap, tail 50%",
        }
        assert max(model["max_param_diff_to_torch"].values()) <= 1e-3
        assert model["ratio_to_torch"]["torch DDP"] == 1.0
        # every variant's CPU per step
        assert set(model["cpu_ms_per_step"]) == set(model["median_ms"])
        assert all(0.0 < share for share in model["cpu_share_of_step"].values())
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "communication floor" in (tmp_path / "bench.md").read_text()


def test_ctrl_c_stops_every_rank_of_the_demo(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from gradsync.testing import kill_process_tree

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradsync.tools.cli",
            "demo",
            "--epochs",
            "100000",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_children(proc.pid)) < 2:
            time.sleep(0.2)  # wait until both ranks run
        workers = _children(proc.pid)
        assert len(workers) >= 2
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_process_tree(proc.pid)
    assert proc.returncode != 0
    assert "interrupted" in out or "SIGINT" in out or "Signal 2" in out, out[-2000:]
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
    assert alive == [], f"ranks still running after Ctrl-C: {alive}"


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _children(pid):
    from gradsync.testing import _descendants

    return _descendants(pid)


RESUME = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "resume.py")


@pytest.mark.timeout(400)
def test_under_torchrun_max_restarts_a_killed_rank_resumes_and_ends_exactly_like_an_uninterrupted_run(  # noqa: E501
    tmp_path,
):
    import torch

    # PowerSGD: its error feedback is state that must survive the restart too.
    a, b = _clean_and_restarted(tmp_path, ["--steps", "20", "--every", "5", "--powersgd"])
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("ending", ["destroy", "exit"])
def test_a_script_ending_with_the_last_steps_buckets_in_flight_exits_cleanly(ending):
    # Before: a gloo collective completing during interpreter finalization called back into
    # Python from gloo's thread and aborted every rank (SIGABRT, "terminate called without an
    # active exception"), 6 runs of 6. At exit the reducer now waits for what is in flight.
    result = run_torchrun(os.path.join(SCRIPTS, "ends_after_step.py"), 2, [ending], timeout=120)
    assert result.stdout.count("done") == 2, result.stdout
    assert "terminate called" not in result.stdout, result.stdout
    assert "phase: landing" in result.stdout, result.stdout  # the case this is about


@pytest.mark.timeout(400)
def test_the_overlapped_optimizer_resumes_in_a_new_torchrun_job_exactly(tmp_path):
    import torch

    # Each bucket stepped as it lands; its checkpoint is the plain optimizer's state dict.
    a, b = _clean_and_restarted(tmp_path, ["--steps", "20", "--every", "5", "--overlap"])
    plain = run_torchrun(RESUME, 2, ["--steps", "20", "--checkpoint", str(tmp_path / "c.pt"),
                                     "--out", str(tmp_path / "plain.pt")], timeout=120)
    assert plain.returncode == 0, plain.stdout
    c = torch.load(tmp_path / "plain.pt")  # the same SGD stepped after backward
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(a[name], c[name]), name


def _clean_and_restarted(tmp_path, common):
    """examples/resume.py run through, and run with rank 1 killed at step 12 and restarted by
    torchrun from the checkpoint of step 10: both final parameters."""
    import torch

    clean = run_torchrun(RESUME, 2, [*common, "--checkpoint", str(tmp_path / "a.pt"),
                                      "--out", str(tmp_path / "clean.pt")], timeout=120)
    assert clean.returncode == 0, clean.stdout
    # Rank 1 SIGKILLs itself at step 12; torch's launcher stops rank 0 and starts both again.
    restarted = run_torchrun(
        RESUME, 2,
        [*common, "--checkpoint", str(tmp_path / "b.pt"), "--out", str(tmp_path / "resumed.pt"),
         "--kill-at", "12"],
        launcher_args=["--standalone", "--max-restarts", "1"], timeout=200,
    )
    out = restarted.stdout
    assert restarted.returncode == 0, out
    assert "SIGKILL" in out or "exitcode: -9" in out or "Connection" in out  # the kill happened
    assert "rank 0: resumed at step 10" in out and "rank 1: resumed at step 10" in out, out
    assert "Connection refused" not in out, out  # see gradsync.wrapper.launch
    return torch.load(tmp_path / "clean.pt"), torch.load(tmp_path / "resumed.pt")


VALIDATE = os.path.join(
    os.path.dirname(__file__), "..", "..", "benchmarks", "validate_simulator.py"
)


def test_simulator_validation_measures_and_reports_every_mode(tmp_path):
    """A tiny real run of the validation (2 and 3 ranks, one model, short rounds)."""
    import subprocess
    import sys

    args = [sys.executable, VALIDATE, "--ranks", "2,3", "--models", "convnet", "--steps", "2",
            "--rounds", "1", "--repeat", "2", "--out", str(tmp_path)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "validation.md").read_text()
    for mode in ("2-rank profile, machine probed", "same run", "all from 2 ranks"):
        assert f"- {mode}: median error" in report
    assert "Noise floor" in report and "| convnet | 3 | no overlap |" in report
    repeats = json.loads((tmp_path / "validation.json").read_text())
    assert len(repeats) == 2 and set(repeats[0]) == {"2", "3"}
    run = repeats[0]["3"]["models"]["convnet"]
    assert run["load"]["step_ms"] > 0 and (
        set(run["measured_ms"]) == {"default", "planned", "no overlap"}
    )


def test_committed_simulator_validation_reports_again(tmp_path):
    """The committed measurements re-report (`--from-json`), as does a single older run."""
    import subprocess
    import sys

    committed = os.path.join(
        os.path.dirname(VALIDATE), "..", "docs", "benchmarks", "data",
        "2026-11-30-simulator-loopback", "validation.json",
    )
    single = tmp_path / "single.json"
    # one repeat, the old format
    single.write_text(json.dumps(json.loads(open(committed).read())[0]))
    for source in (committed, str(single)):
        result = subprocess.run(
            [sys.executable, VALIDATE, "--from-json", source, "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "2-rank profile, machine probed: median error" in result.stdout


def test_probe_describes_the_group_for_the_simulator(tmp_path, capsys):
    from gradsync.planning.simulate import Profile
    from gradsync.tools.cli import main as cli

    result = run_torchrun(
        "gradsync.planning.probe",
        2,
        ["--out", str(tmp_path), "--threads", "1", "--gradient-mib", "1"],
        module=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout
    assert "under load:" in result.stdout and "a ring of" in result.stdout
    idle = json.loads((tmp_path / "idle-2.json").read_text())
    assert idle["ranks"] == 2 and idle["ring_bandwidth_gbps"] > 0
    profile = Profile(2.0, (1.0, 2.0), (4096, 4096), ("a", "b"), 2).save(tmp_path / "profile.json")
    assert cli(["simulate", "--profile", str(profile), "--ranks", "2", "--cpu-collectives",
                "--cores-per-host", "2", "--ranks-per-host", "2", "--out", str(tmp_path),
                "--load-probes", str(tmp_path / "load-2.json")]) == 0
    assert "priced from load probes at ranks [2]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli(["probe", "--gradient-mib", "0"])  # refused before any rank starts


def _wrap_in_group_of_rank_0(rank, _group):
    import torch.distributed as dist

    import gradsync

    sub = dist.new_group([0])  # every rank calls it; rank 1 gets GroupMember.NON_GROUP_MEMBER
    try:
        gradsync.DistributedDataParallel(torch.nn.Linear(2, 2), process_group=sub)
        return "built"
    except ValueError as error:
        return str(error)


def test_a_process_group_this_rank_is_not_in_is_refused_naming_the_rank():
    # Before: AttributeError: 'int' object has no attribute 'size'.
    built, refused = run_processes(_wrap_in_group_of_rank_0, 2, timeout=60, default_group=True)
    assert built == "built"
    assert "global rank 1 is not a member of the group passed" in refused
    assert "if dist.get_rank() in ranks" in refused
