"""The multi-rank harness itself: results come back by rank, a rank's exception surfaces with
its rank number, and a deadlock fails within the timeout without leaving anything behind."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from gradsync.testing import (
    RankError,
    RankTimeoutError,
    gloo_device_types,
    make_gloo_group,
    run_processes,
    run_threaded,
    run_torchrun,
)


def _allreduce_rank(rank, group):
    t = torch.tensor([float(rank + 1)])
    group.allreduce([t]).wait()
    return t.item()


@pytest.mark.threaded
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_threaded_allreduce_returns_results_by_rank(world_size):
    total = world_size * (world_size + 1) / 2
    assert run_threaded(_allreduce_rank, world_size) == [total] * world_size


def test_threaded_exception_on_rank_1_names_rank_1():
    def body(rank, group):
        if rank == 1:
            raise ValueError("boom on one rank")
        return rank

    with pytest.raises(RankError, match="rank 1 raised.*ValueError: boom on one rank") as info:
        run_threaded(body, 2)
    assert info.value.rank == 1


def test_threaded_deadlock_fails_within_the_timeout():
    def body(rank, group):
        if rank == 0:  # rank 1 never joins the collective
            group.allreduce([torch.zeros(1)]).wait()

    start = time.monotonic()
    with pytest.raises((RankTimeoutError, RankError)):
        run_threaded(body, 2, timeout=2)
    assert time.monotonic() - start < 10


def test_gloo_group_carries_the_cpu_and_cuda_where_a_gpu_is_visible():
    group = make_gloo_group(dist.HashStore(), 0, 1, 5)
    assert gloo_device_types() == (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))
    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert group._get_backend(torch.device("cpu")) is not None and t.tolist() == [1.0] * 3
    if not torch.cuda.is_available():  # nothing claims CUDA on a machine without it
        with pytest.raises(RuntimeError, match="No backend type associated with device type cuda"):
            group._get_backend(torch.device("cuda"))


def test_gloo_group_registers_gloo_for_each_device_type_asked_and_refuses_others():
    # The registration alone needs no GPU: one gloo backend answers for both device types, so
    # torch's DDP and gradsync find a backend for CUDA tensors ("No backend type associated with
    # device type cuda" on the GPU run before).
    group = make_gloo_group(dist.HashStore(), 0, 1, 5, devices=("cpu", "cuda"))
    assert group._get_backend(torch.device("cuda")) is group._get_backend(torch.device("cpu"))
    with pytest.raises(ValueError, match="mps"):
        make_gloo_group(dist.HashStore(), 0, 1, 5, devices=("cpu", "mps"))


def _process_body(rank, group, mode):
    if mode == "raise":
        # Both ranks connected first: else rank 0 may return and close its end while rank 1 is
        # still connecting, which then fails in gloo's connectFullMesh, not in the body (CI).
        group.allreduce([torch.zeros(1)]).wait()
        if rank == 1:
            raise KeyError("process rank failed")
    if mode == "hang" and rank == 0:
        group.allreduce([torch.zeros(1)]).wait()
        time.sleep(600)
    return _allreduce_rank(rank, group) if mode == "ok" else os.getpid()


def test_processes_return_results_by_rank():
    assert run_processes(_process_body, 2, "ok", timeout=60) == [3.0, 3.0]


def test_process_exception_names_its_rank():
    with pytest.raises(RankError, match="rank 1 raised.*KeyError"):
        run_processes(_process_body, 2, "raise", timeout=60)


def test_process_deadlock_fails_and_leaves_no_process_behind():
    import multiprocessing

    start = time.monotonic()
    with pytest.raises((RankTimeoutError, RankError)):
        run_processes(_process_body, 2, "hang", timeout=15)
    assert time.monotonic() - start < 40
    assert multiprocessing.active_children() == []


def test_torchrun_runs_a_script_on_two_ranks(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} sum {t.item():.0f}", flush=True)
        dist.destroy_process_group()
    """))
    result = run_torchrun(str(script), 2, timeout=90)
    assert result.returncode == 0, result.stdout
    assert "rank 0 sum 3" in result.stdout and "rank 1 sum 3" in result.stdout


def test_torchrun_timeout_kills_the_whole_launch(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match="did not finish"):
        run_torchrun(str(script), 2, timeout=15)
    assert time.monotonic() - start < 30
    # No worker of that launch survives: none of our children still runs the script.
    assert str(script) not in os.popen("ps -eo args").read()
    assert sys.executable


@pytest.mark.parametrize("launcher", ["local", "emulated cluster"])
def test_a_launch_interrupted_by_the_tests_own_timeout_leaves_no_worker(tmp_path, launcher):
    import signal

    from gradsync.tools.cluster import ClusterUnavailable, EmulatedCluster

    script, pids = tmp_path / "sleep.py", tmp_path / "pids"
    pids.mkdir()
    script.write_text(
        f"import os, time\nopen(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
        "time.sleep(600)\n"
    )
    cluster = EmulatedCluster(2) if launcher == "emulated cluster" else None
    if cluster is not None:
        try:
            cluster.build()
        except ClusterUnavailable as e:
            pytest.skip(str(e))
    workers = 1 if cluster is None else 2

    class Interrupted(Exception):  # what pytest-timeout raises in the test's thread
        pass

    def interrupt(*_):
        if len(os.listdir(pids)) == workers:
            raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5, 0.5)
    try:
        with pytest.raises(Interrupted):
            if cluster is None:
                run_torchrun(str(script), 1, timeout=90)
            else:
                cluster.torchrun([str(script)], timeout=90)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if cluster is not None:
            cluster.remove()
    started = [int(pid) for pid in os.listdir(pids)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(map(_alive, started)):
        time.sleep(0.1)
    assert not [pid for pid in started if _alive(pid)], "workers outlived the interrupted launch"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_init_process_group_keeps_restart_attempts_apart():
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "launch_prefix.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # Each attempt starts from an empty view, although the first left its key behind.
    assert "seen before writing, per attempt: [False, False]" in done.stdout, done.stdout


def test_a_script_that_runs_ranks_in_threads_exits_cleanly_without_collecting_itself(tmp_path):
    """torch's DDP in rank threads leaves reference cycles holding the threads' gloo groups;
    run_threaded collects them at exit, before interpreter finalization (which aborted)."""
    import subprocess

    script = tmp_path / "threads.py"
    script.write_text(textwrap.dedent("""
        import torch
        from gradsync.testing import run_threaded

        def body(rank, group):
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8), process_group=group)
            model(torch.ones(2, 8)).sum().backward()
            return rank

        print("ranks", run_threaded(body, 2), flush=True)
    """))  # noqa: E501
    # as a user's script runs
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    # Before: rc -6 (SIGABRT) in every run, after printing the ranks.
    assert done.returncode == 0 and "ranks [0, 1]" in done.stdout, (
        done.returncode,
        done.stdout + done.stderr,
    )
