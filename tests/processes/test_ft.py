"""gradsync under torchft, with real processes under torchft's real lighthouse.

Three replica groups (one process each, examples/ft_train.py) train; faults are injected into
one: SIGKILL in the middle of its backward (then it is started again and recovers live from a
peer), an exception in its backward, a replica two seconds late. Every committed step is logged
(which replicas took part); at the end every replica must hold identical parameters and optimizer
state, equal to a reference that applies exactly the committed steps, each once.

The figures (seconds from the kill to the survivors' next committed step, from the restart to
the recovered replica's first committed step) are printed: `pytest -s tests/processes/test_ft.py`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("torchft")

from gradsync.testing import free_port, kill_process_tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ft_train.py"
STEPS = 40


def _example():
    spec = importlib.util.spec_from_file_location("ft_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Replicas:
    """A lighthouse on 127.0.0.1 and replica processes of examples/ft_train.py; all killed at the
    end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs, self.port = tmp, {}, free_port()
        exe = shutil.which("torchft_lighthouse") or str(
            Path(sys.executable).parent / "torchft_lighthouse"
        )
        self.lighthouse = subprocess.Popen(
            [
                exe,
                "--min_replicas",
                "2",
                "--bind",
                f"127.0.0.1:{self.port}",
                "--heartbeat_timeout_ms",
                "1000",
                "--join_timeout_ms",
                "3000",
                "--quorum_tick_ms",
                "20",
            ],
            stdout=(tmp / "lighthouse.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        self.log = tmp / "steps.jsonl"

    def start(self, replica: int, *flags: str, attempt: int = 0, go: str = "go") -> float:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
        out = (self.tmp / f"replica{replica}.{attempt}.log").open("w")
        self.procs[replica, attempt] = subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                "--replica-id",
                str(replica),
                "--lighthouse",
                f"http://127.0.0.1:{self.port}",
                "--steps",
                str(STEPS),
                "--min-replicas",
                "2",
                "--timeout",
                "5",
                "--log",
                str(self.log),
                "--save",
                str(self.tmp / f"final{replica}.pt"),
                "--marker",
                str(self.tmp / f"fault{replica}"),
                "--go",
                str(self.tmp / go),
                "--step-seconds",
                "0.15",
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        return time.time()

    def go(self, replicas: list[tuple[int, int]], go: str = "go") -> float:
        """Let them join once all have imported and built their model (so that the first quorum
        holds every one); return the time."""
        self.wait_for(
            lambda: all("ready to join" in self.output(r, a) for r, a in replicas) or None, 60
        )
        (self.tmp / go).touch()
        return time.time()

    def wait_for(self, what, timeout: float, poll: float = 0.05):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if (found := what()) is not None:
                return found
            for (r, _), p in self.procs.items():
                if p.poll() not in (None, 0, -9):
                    pytest.fail(f"replica {r} exited with {p.returncode}:\n{self.output(r)}")
            time.sleep(poll)
        pytest.fail(
            f"timed out after {timeout} s; outputs:\n"
            + "\n".join(self.output(r) for r, _ in self.procs)
        )

    def entries(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [
            json.loads(line) for line in self.log.read_text().splitlines() if line.endswith("}")
        ]

    def output(self, replica: int, attempt: int | None = None) -> str:
        pattern = f"replica{replica}.{'*' if attempt is None else attempt}.log"
        text = "\n".join(p.read_text() for p in sorted(self.tmp.glob(pattern)))
        return "\n".join(line for line in text.splitlines() if line.startswith("[replica_"))[-4000:]

    def finish(self, timeout: float) -> None:
        deadline = time.time() + timeout
        for (r, _), p in self.procs.items():
            if p.returncode == -9:  # the one the test killed
                continue
            try:
                p.wait(max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"replica {r} did not finish:\n{self.output(r)}")
            assert p.returncode == 0, self.output(r)

    def close(self) -> None:
        for p in [*self.procs.values(), self.lighthouse]:
            if p.poll() is None:
                kill_process_tree(p.pid)
            p.wait(10)


@pytest.fixture
def replicas(tmp_path):
    group = Replicas(tmp_path)
    yield group
    group.close()


def _reference(entries: list[dict], accumulate: int = 1, side: bool = False) -> dict:
    """Apply exactly the committed steps: step s sums the batches' gradients of the replicas that
    took part in it and divides by the Manager's count of participants, which (torchft's rule, with
    its asynchronous quorum) includes a replica recovering in that step, whose gradients are
    zeros."""
    ex = _example()
    model = ex.build_model(side)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(STEPS):
        takers = sorted({e["replica"] for e in entries if e["step"] == step and e["participating"]})
        counts = {e["participants"] for e in entries if e["step"] == step}
        assert takers and len(counts) == 1, f"step {step}: committed by {takers}, counts {counts}"
        grads = []
        for r in takers:
            model.zero_grad()
            for micro in range(accumulate):  # gradients add up over the micro-steps
                x, y = ex.batch(r, step, micro)
                use = side and ex.uses_side(r, step, micro)
                torch.nn.functional.cross_entropy(model(x, use), y).backward()
            grads.append(
                [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            )
        n = counts.pop()
        for i, p in enumerate(model.parameters()):
            # divided before the sum, as the hook does
            sent = [g[i] / n for g in grads if g[i] is not None]
            # unused by every replica: left alone (Adam skips it)
            p.grad = sum(sent) if sent else None
        optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def _check_final_states(tmp: Path, replicas: list[int], entries: list[dict], atol: float = 1e-6,
                        rtol: float = 1e-5, **reference: object) -> None:
    finals = [torch.load(tmp / f"final{r}.pt") for r in replicas]
    for r, state in zip(replicas[1:], finals[1:]):
        for name, tensor in finals[0]["model"].items():
            assert torch.equal(tensor, state["model"][name]), (
                f"replica {r} differs from {replicas[0]} in {name}"
            )
        for key, entry in finals[0]["optim"]["state"].items():
            for field, value in entry.items():
                assert torch.equal(value, state["optim"]["state"][key][field]), (
                    f"replica {r}: optimizer {key}.{field}"
                )
    expected = _reference(entries, **reference)  # type: ignore[arg-type]
    torch.testing.assert_close(finals[0]["model"], expected["model"], rtol=rtol, atol=atol)
    assert finals[0]["optim"]["state"].keys() == expected["optim"]["state"].keys()
    for key, entry in expected["optim"]["state"].items():
        for field, value in entry.items():
            torch.testing.assert_close(
                finals[0]["optim"]["state"][key][field], value, rtol=rtol, atol=atol / 10
            )
    assert int(finals[0]["optim"]["state"][0]["step"]) == STEPS  # none lost, none applied twice


def _committed_once(entries: list[dict], replica: int) -> list[int]:
    steps = [e["step"] for e in entries if e["replica"] == replica]
    assert len(steps) == len(set(steps)), f"replica {replica} committed a step twice: {steps}"
    return steps


@pytest.mark.timeout(150)
def test_killed_mid_backward_others_go_on_then_it_recovers_live(replicas, tmp_path):
    kill_at, restart_after = 8, 12
    for r in range(3):
        replicas.start(r, *(["--stall-at", str(kill_at)] if r == 2 else []))
    # its restart, imported ahead so that the test runs quickly
    replicas.start(2, attempt=1, go="go2")
    replicas.go([(0, 0), (1, 0), (2, 0)])
    marker = tmp_path / "fault2"
    replicas.wait_for(lambda: marker.exists() or None, 60)
    # well inside its backward: the later layers' buckets were launched before it stalled
    time.sleep(0.2)
    killed = time.time()
    kill_process_tree(replicas.procs[2, 0].pid)
    replicas.procs[2, 0].wait(10)

    def next_commit():
        after = [e for e in replicas.entries() if e["time"] > killed and e["replica"] in (0, 1)]
        return min(after, key=lambda e: e["time"]) if after else None

    first = replicas.wait_for(next_commit, 60)
    # the half step was not committed
    assert first["step"] == kill_at and first["participants"] == 2, first
    replicas.wait_for(
        lambda: next((e for e in replicas.entries() if e["step"] >= restart_after), None), 60
    )
    restarted = replicas.go([(2, 1)], go="go2")  # once it has imported torch and built its model
    replicas.finish(90)

    entries = replicas.entries()
    for r in (0, 1):
        steps = _committed_once(entries, r)
        # Every step from its first on. On a loaded machine a replica can start after the first
        # quorum (min 2 replicas) has committed step 0: it then joins by recovering live, and its
        # first entry is that recovery (not participating), not step 0.
        assert steps == list(range(steps[0], STEPS)), (r, steps)
        first_entry = next(e for e in entries if e["replica"] == r and e["step"] == steps[0])
        assert steps[0] == 0 or not first_entry["participating"], (r, first_entry)
    back = [e for e in entries if e["replica"] == 2 and e["time"] > restarted]
    assert back and back[0]["step"] > restart_after and not back[0]["participating"], back[:1]
    assert back[0]["step"] < STEPS - 5, (
        "it should train on after recovering (slow start: raise STEPS)"
    )
    assert [e["step"] for e in back] == list(range(back[0]["step"], STEPS))
    assert "recovered live from a peer" in replicas.output(2)
    _check_final_states(tmp_path, [0, 1, 2], entries)
    print(
        f"\nkill -> next committed step: {first['time'] - killed:.2f} s (step {first['step']}, "
        f"2 replicas); restart -> first committed step (recovered live at step {back[0]['step']}): "
        f"{back[0]['time'] - restarted:.2f} s; final parameters and Adam state identical "
        f"on 3 replicas and equal to the reference of the {STEPS} committed steps"
    )


@pytest.mark.timeout(150)
def test_a_replica_that_raises_and_a_slow_one(replicas, tmp_path):
    raise_at, slow_at = 5, 12
    replicas.start(0)
    replicas.start(1, "--raise-at", str(raise_at))
    replicas.start(2, "--slow-at", str(slow_at), "--slow-seconds", "2")
    replicas.go([(0, 0), (1, 0), (2, 0)])
    replicas.finish(120)
    entries = replicas.entries()
    for r in range(3):
        steps = _committed_once(entries, r)
        assert steps[-1] == STEPS - 1, (r, steps)
    assert "injected failure in backward" in replicas.output(1)
    assert f"step {raise_at}: not committed" in replicas.output(1)
    raised = float((tmp_path / "fault1").read_text())
    later = [e for e in entries if e["time"] > raised and e["step"] == raise_at]
    assert later, "the step that raised was never committed after"
    slow = float((tmp_path / "fault2").read_text())
    at_slow = [e for e in entries if e["step"] == slow_at]
    # waited for, not dropped
    assert {e["replica"] for e in at_slow if e["participating"]} == {0, 1, 2}, at_slow
    _check_final_states(tmp_path, [0, 1, 2], entries)
    print(f"\nraise -> step {raise_at} committed: {min(e['time'] for e in later) - raised:.2f} s; "
          f"slow replica (2 s late at step {slow_at}) kept in the quorum, step committed "
          f"{max(e['time'] for e in at_slow) - slow:.2f} s after it fell behind; states identical")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook", ["fp16", "torch-fp16"])  # gradsync.comm_hooks' and torch's own
def test_no_sync_find_unused_parameters_and_a_compression_hook(replicas, tmp_path, hook):
    flags = ["--accumulate", "2", "--find-unused", "--hook", hook]
    for r in range(2):
        replicas.start(r, *flags)
    replicas.go([(0, 0), (1, 0)])
    replicas.finish(90)
    entries = replicas.entries()
    for r in range(2):
        assert _committed_once(entries, r)[-1] == STEPS - 1
    # float16 on the wire: equal to the float32 reference to float16's rounding, identical across
    # replicas
    _check_final_states(tmp_path, [0, 1], entries, atol=1e-4, rtol=5e-3, accumulate=2, side=True)


@pytest.mark.timeout(120)
def test_replicas_that_accumulate_different_micro_steps_commit_nothing_and_say_so(replicas):
    # gradsync's engine sees one replica, so this check runs across replicas in gradsync.ft: each
    # sends its count with its first bucket, every replica reads the same sums and raises alike.
    replicas.start(0, "--accumulate", "2")
    replicas.start(1, "--accumulate", "1")
    replicas.go([(0, 0), (1, 0)])
    said = "covered different numbers of micro-steps"
    replicas.wait_for(lambda: all(said in replicas.output(r) for r in range(2)) or None, 60)
    for r, own in ((0, 2), (1, 1)):
        assert re.search(
            f"not committed \\(gradsync.ft: the 2 replicas of step [01] {said}", replicas.output(r)
        )
        assert f"3 in all, {own} on this replica" in replicas.output(r)
    # Step 0 may be committed: one replica usually recovers from the other in it (torchft's
    # init_sync), so one replica's gradients make it and there is nothing to compare. No step
    # in which both took part is committed.
    entries = replicas.entries()
    assert {e["step"] for e in entries} <= {0}
    assert sum(e["participating"] for e in entries) <= 1, entries


# ----------------------------------------------------------------- without a lighthouse

def _wrapped(**kwargs):
    from gradsync.ft import DistributedDataParallel

    manager = mock.MagicMock()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    return DistributedDataParallel(manager, model, **kwargs), manager


def test_layout_is_derived_from_the_model_in_reverse_order():
    from gradsync.ft import replica_layout

    params = [torch.zeros(256) for _ in range(5)]  # 1 KiB each
    assert replica_layout(params, [2048]) == [[4, 3], [2, 1], [0]]
    ddp, manager = _wrapped(bucket_cap_mb=0.0005)
    assert ddp.reducer.bucket_indices == replica_layout(ddp.reducer.params, [int(0.0005 * 2**20)])
    assert ddp.reducer.rebuilt  # no rebuild in ready order: the layout stays the model's
    manager.register_state_dict_fn.assert_called_once()


@pytest.mark.parametrize(
    "keyword",
    [
        {"process_group": object()},
        {"bucket_cap_mb": "auto"},
        {"init_sync": True},
        {"mixed_precision": object()},
    ],
)
def test_keywords_that_cannot_hold_under_torchft_are_refused(keyword):
    from gradsync.ft import DistributedDataParallel

    with pytest.raises(ValueError, match=list(keyword)[0]):
        DistributedDataParallel(None, torch.nn.Linear(2, 2), **keyword)


def test_sharded_optimizer_is_refused_with_the_reason():
    import gradsync

    ddp, _ = _wrapped()
    with pytest.raises(ValueError, match="takes its shard with it"):
        gradsync.ZeroRedundancyOptimizer(list(ddp.parameters()), torch.optim.SGD,
                                         process_group=ddp.process_group, lr=0.1)


def test_overlap_optimizer_is_refused_with_the_reason():
    ddp, _ = _wrapped()
    with pytest.raises(RuntimeError, match="decides after backward whether this step commits"):
        ddp.overlap_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))


def test_zero_1_across_replicas_is_refused_and_within_a_replica_of_one_rank_works():
    import gradsync

    ddp, _ = _wrapped()
    across = torch.distributed.ProcessGroup(0, 2)  # any group of more than one rank: never reached
    with pytest.raises(ValueError, match="takes its shard with it"):
        gradsync.ZeroRedundancyOptimizer(
            list(ddp.parameters()),
            torch.optim.SGD,
            process_group=across,
            shard_gradients=False,
            lr=0.1,
        )
    one = gradsync.ZeroRedundancyOptimizer(
        list(ddp.parameters()),
        torch.optim.SGD,
        process_group=ddp.process_group,
        shard_gradients=False,
        lr=0.1,
    )
    assert one.world_size == 1


def test_recovery_refuses_a_peer_with_other_buckets():
    ddp, manager = _wrapped(bucket_cap_mb=0.0005)
    load = manager.register_state_dict_fn.call_args.args[1]
    with pytest.raises(ValueError, match="other buckets"):
        load({"layout": [[0, 1, 2, 3, 4, 5]], "iteration": 3})
    load({"layout": ddp.reducer.bucket_indices, "iteration": 7})
    assert ddp.reducer.iteration == 7


class _StuckManager:
    """torchft's Manager where it matters here (its own wrap_future, a 0.5 s timeout), with a
    process group whose all-reduce never completes: a peer that hangs mid-collective."""

    _timeout = timedelta(seconds=0.5)
    _logger = logging.getLogger("test_ft")

    def __init__(self) -> None:
        from torchft.manager import Manager

        self.wrap_future = functools.partial(Manager.wrap_future, self)
        self.errors: list[Exception] = []

    def report_error(self, error: Exception) -> None:
        self.errors.append(error)

    def allreduce(self, tensor, reduce_op=None):
        return SimpleNamespace(_work=SimpleNamespace(get_future=torch.futures.Future))

    def num_participants(self) -> int:
        return 2


@pytest.mark.timeout(30)
def test_a_collective_that_never_completes_is_waited_for_at_most_the_managers_timeout():
    # The buckets' and the micro-step report's waits are bounded by the Manager's timeout
    # (`wrap_future`): the step goes on, the error is the Manager's, should_commit discards it.
    from gradsync.ft import ReplicaGroup

    manager = _StuckManager()
    replicas = ReplicaGroup(manager)  # type: ignore[arg-type]
    report = torch.tensor([1, 2, 4])
    replicas.send_with_next(report)
    bucket = replicas.allreduce([torch.ones(4)])
    start = time.monotonic()
    bucket.wait()
    replicas.report_work.wait()
    assert time.monotonic() - start < 5
    assert len(manager.errors) == 2 and all(
        isinstance(e, TimeoutError) for e in manager.errors
    ), manager.errors
    # this replica's own counts: nothing to compare
    assert replicas.report_work.result()[0] is report
