"""Seeing inside iterations: stats, Perfetto traces, profiler ranges, the stall watchdog,
unused-parameter reports and logging."""

from __future__ import annotations

import datetime
import json
import logging
import time

import pytest
import torch
from models import MODELS

import gradsync
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.observability.log import configure_from_env
from gradsync.observability.watchdog import StallWatchdog
from gradsync.testing import RankError, run_threaded, seeded


def _train(rank, group, steps=3, **kwargs):
    model = seeded(MODELS["many_small"], 0)
    ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.0005, **kwargs)
    for _ in range(steps):
        ddp(torch.full((4, 8), float(rank + 1))).pow(2).mean().backward()
    return ddp


def test_stats_describe_the_last_iteration_consistently():
    def body(rank, group):
        ddp = _train(rank, group)
        return ddp.stats(), str(ddp.stats()), sum(p.numel() * 4 for p in ddp.module.parameters())

    for stats, text, nbytes in run_threaded(body, 2):
        last = stats.last
        assert stats.iterations == 3 and len(stats.window) == 3 and last.iteration == 3
        assert last.nbytes == nbytes
        assert len(last.buckets) > 1
        assert 0.0 <= last.overlap_ratio <= 1.0
        assert 0.0 <= last.exposed_comm_ms <= last.comm_ms + 1e-9
        assert last.backward_ms > 0 and last.total_ms >= last.backward_ms
        for b in last.buckets:
            assert b.ready_ms <= b.launch_ms <= b.complete_ms
        assert [b.launch_ms for b in last.buckets] == sorted(b.launch_ms for b in last.buckets)
        assert "overlap ratio" in text and "bucket" in text


def test_timeline_trace_is_valid_perfetto_json_with_one_event_per_bucket(tmp_path):
    def body(rank, group):
        ddp = _train(rank, group, steps=4)
        path = ddp.export_timeline(str(tmp_path / "trace.json"))
        return path, [t.bucket_indices for t in ddp.reducer.history]

    results = run_threaded(body, 2)
    traces = []
    for rank, (path, layouts) in enumerate(results):
        assert path.endswith(f"trace.rank{rank}.json")
        with open(path) as f:
            trace = json.load(f)
        traces.append(trace)
        events = trace["traceEvents"]
        for e in events:
            assert {"name", "ph", "pid", "tid"} <= e.keys()
            assert e["ph"] in {"X", "i", "M"}
            if e["ph"] != "M":
                assert isinstance(e["ts"], float) and e["pid"] == rank
            if e["ph"] == "X":
                assert e["dur"] >= 0
        comm = [e for e in events if e.get("cat") == "allreduce"]
        assert len(comm) == sum(len(layout) for layout in layouts)  # per bucket per iteration
        ready = [e for e in events if e.get("cat") == "ready"]
        assert len(ready) == 4 * 60 and ready[0]["s"] == "t"
        names = {e["args"]["name"] for e in events if e["ph"] == "M"}
        assert {"backward", "communication", f"rank {rank}"} <= names
    merged = gradsync.merge_traces(traces)
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}


def test_buckets_appear_in_torch_profiler_traces():
    def body(rank, group):
        ddp = _train(rank, group, steps=2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ddp(torch.ones(4, 8)).sum().backward()
        return {e.key for e in prof.key_averages()}

    keys = run_threaded(body, 1)[0]
    assert "gradsync.finish_backward" in keys
    assert any(k.startswith("gradsync.allreduce.bucket") for k in keys)
    assert "gradsync.DistributedDataParallel.forward" in keys


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_watchdog_names_the_late_rank_then_training_continues():
    handler = _Collect()
    logging.getLogger("gradsync").addHandler(handler)
    try:
        def body(rank, group, store):
            model = seeded(MODELS["mlp"], 0)
            ddp = GradsyncDDP(model, process_group=group)
            ddp.enable_stall_watchdog(warn_after=0.3, timeout=20, store=store)
            for step in range(2):
                out = ddp(torch.ones(2, 8))
                if rank == 1 and step == 1:
                    time.sleep(1.5)  # rank 1 is late for iteration 2
                out.sum().backward()
            return True

        assert run_threaded(body, 2, with_store=True, timeout=60) == [True, True]
    finally:
        logging.getLogger("gradsync").removeHandler(handler)
    reports = [m for m in handler.messages if "has waited" in m]
    assert reports, handler.messages
    assert any("rank 0 has waited" in m and "pending buckets" in m for m in reports)


def test_watchdog_error_names_the_rank_that_skipped_backward():
    def body(rank, group, store):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group)
        ddp.enable_stall_watchdog(warn_after=0.3, timeout=1.5, store=store)
        ddp(torch.ones(2, 8)).sum().backward()
        out = ddp(torch.ones(2, 8))
        if rank == 0:
            out.sum().backward()  # rank 1 never runs its second backward
        else:
            time.sleep(3)  # ...and stays alive, stuck elsewhere
        return "ok"

    with pytest.raises(RankError) as info:
        run_threaded(body, 2, with_store=True, timeout=30)
    message = str(info.value)
    assert info.value.rank == 0
    assert "did not complete within" in message and "pending buckets" in message
    assert "net.0.weight" in message
    assert "every rank has reached iteration 2" in message  # rank 1 ran forward, skipped backward


def test_watchdog_error_names_a_rank_that_never_reached_the_iteration():
    def body(rank, group, store):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group)
        ddp.enable_stall_watchdog(warn_after=0.3, timeout=1.5, store=store)
        for _ in range(2):
            ddp(torch.ones(2, 8)).sum().backward()
        if rank == 0:
            ddp(torch.ones(2, 8)).sum().backward()
        else:
            time.sleep(3)  # rank 1 is stuck before its third iteration (say, loading data)
        return "ok"

    with pytest.raises(RankError, match=r"(?s)not reached iteration 3: rank 1 \(at iteration 2\)"):
        run_threaded(body, 2, with_store=True, timeout=30)


def test_unfinished_reduction_error_carries_other_ranks_reports():
    # Without outputs the end of backward is not seen; the watchdog's store carries what the
    # ranks that got to the next iteration first reported.
    def body(rank, group, store):
        model = seeded(MODELS["unused_branch"], 0)
        named = list(model.named_parameters())
        reducer = gradsync.Reducer(
            [p for _, p in named],
            [list(range(len(named)))],
            group,
            param_names=[n for n, _ in named],
        )
        reducer.set_stall_monitor(StallWatchdog(datetime.timedelta(seconds=5), store, rank, 2))
        reducer.prepare_for_backward(None)
        model(torch.ones(2, 8)).sum().backward()
        if rank == 1:
            time.sleep(0.5)  # rank 0 reports first
        try:
            reducer.prepare_for_backward(None)
        except gradsync.GradSyncError as error:
            return str(error)
        return "no error"

    m0, m1 = run_threaded(body, 2, with_store=True)
    assert "spare.weight" in m0 and "spare.weight" in m1
    assert "Rank 0 reported 2 missing: spare.weight, spare.bias" in m1


def test_unused_parameter_report_says_which_rank_left_what():
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x, rank):
            out = self.a(x)
            return self.b(out) if rank == 0 else out

    def body(rank, group):
        ddp = GradsyncDDP(seeded(Branchy, 0), process_group=group, find_unused_parameters=True)
        ddp.report_unused_parameters()
        ddp(torch.ones(2, 4), rank).sum().backward()
        return ddp.unused_parameters(), ddp.module.b.weight.grad is not None

    (report, has_b), (report1, _), _ = run_threaded(body, 3)
    assert report == report1
    assert report == {
        "b.weight": [1, 2],
        "b.bias": [1, 2],
        "c.weight": [0, 1, 2],
        "c.bias": [0, 1, 2],
    }
    assert has_b


@pytest.mark.pure
def test_debug_switch_levels():
    logger = logging.getLogger("gradsync")
    old = logger.level
    try:
        assert configure_from_env("OFF") is None
        assert configure_from_env("info") == logging.INFO
        assert configure_from_env("DETAIL") == logging.DEBUG
        with pytest.raises(ValueError, match="GRADSYNC_DEBUG='LOUD'"):
            configure_from_env("loud")
    finally:
        logger.setLevel(old)
        for h in list(logger.handlers):
            if getattr(h, "_gradsync", False):
                logger.removeHandler(h)


def test_overlap_png_is_rendered(tmp_path):
    from gradsync.observability.plot import render_overlap_png

    def body(rank, group):
        return _train(rank, group).reducer.history[-1]

    timelines = run_threaded(body, 2)
    path = render_overlap_png(timelines, tmp_path / "overlap.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.processes
def test_importing_gradsync_with_a_bad_debug_setting_warns_instead_of_raising():
    import os
    import subprocess
    import sys

    env = {**os.environ, "GRADSYNC_DEBUG": "loud"}
    run = subprocess.run([sys.executable, "-c", "import gradsync; print('imported')"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "imported" in run.stdout and "GRADSYNC_DEBUG='LOUD'" in run.stderr


def test_recording_is_switched_through_the_config():
    def body(rank, group):
        ddp = _train(rank, group, steps=1)
        ddp.reducer.configure(record_events=False)
        ddp(torch.ones(4, 8)).sum().backward()
        quiet = ddp.reducer.history[-1]
        ddp.reducer.configure(record_events=True)
        ddp(torch.ones(4, 8)).sum().backward()
        return len(quiet.events), quiet.start_ns, len(ddp.reducer.history[-1].events)

    for quiet_events, quiet_start, events in run_threaded(body, 2):
        assert quiet_events == 0 and quiet_start == 0 and events > 0


def test_timeline_times_come_from_the_configured_clock():
    ticks = iter(range(10**9, 10**10, 1000))

    def body(rank, group):
        ddp = _train(rank, group, steps=1)
        ddp.reducer.configure(clock=lambda: next(ticks))
        ddp(torch.ones(4, 8)).sum().backward()
        return [t for t, _, _ in ddp.reducer.history[-1].events]

    (times,) = run_threaded(body, 1)
    assert times and all(t % 1000 == 0 and t >= 10**9 for t in times)


@pytest.mark.parametrize(
    "changes,error",
    [
        (dict(bucket_dtype=torch.float16), "cannot change after construction"),
        (dict(report_unused=True), "needs find_unused_parameters"),
        (dict(check_finite="yes"), "must be True or False"),
        (dict(timeout=datetime.timedelta(0)), "must be positive"),
    ],
)
def test_reducer_configure_validates(changes, error):
    def body(rank, group):
        _train(rank, group, steps=1).reducer.configure(**changes)

    with pytest.raises(RankError, match=error):
        run_threaded(body, 1)


@pytest.mark.pure
def test_every_documented_error_is_exported():
    assert issubclass(gradsync.ParameterDivergenceError, Exception)
    assert (
        {"GradSyncError", "ReductionTimeoutError", "ParameterDivergenceError"}
        <= set(gradsync.__all__)
    )
