"""What a GPU asks of the step path, shown on CPU groups: small collectives on the group's
device, reports read back without stopping the host (`read_back="deferred"`, the default on a
device group), no host read of a tensor on the step path, and the construction broadcast in
chunks. The same code runs on CUDA; `benchmarks/gpu_check.py` checks it there."""

from __future__ import annotations

import contextlib
import sys
import time

import pytest
import torch
from models import MODELS
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import EventKind, Reducer, ReducerConfig
from gradsync.engine.collectives import (
    IN_PLACE_BYTES,
    Broadcasts,
    all_gather_objects,
    broadcast_tensors,
)
from gradsync.engine.device import HostRead, host_runs_collectives, object_device
from gradsync.engine.errors import GradSyncError
from gradsync.engine.events import EventClock
from gradsync.engine.reducer import Timelines
from gradsync.engine.timeline import IterationTimeline
from gradsync.testing import run_threaded, seeded


class _DeviceGroup:
    """Only what `object_device` reads of a group: an NCCL-like group's device types."""

    def __init__(self, types, bound=None):
        self._device_types = types
        self.bound_device_id = bound


def test_small_collectives_live_on_the_groups_device():
    assert object_device(_DeviceGroup([torch.device("cpu")])) == torch.device("cpu")
    assert object_device(
        _DeviceGroup([torch.device("cpu"), torch.device("cuda")])
    ) == torch.device("cpu")
    assert object_device(
        _DeviceGroup([torch.device("cuda")], torch.device("cuda", 3))
    ) == torch.device("cuda", 3)
    assert not host_runs_collectives(_DeviceGroup([torch.device("cuda")], torch.device("cuda", 0)))

    def body(rank, group):
        return (
            object_device(group),
            host_runs_collectives(group),
            all_gather_objects(group, {"rank": rank}),
        )

    for device, on_host, gathered in run_threaded(body, 2):
        assert device == torch.device("cpu") and on_host
        assert gathered == [{"rank": 0}, {"rank": 1}]


def test_host_read_of_a_cpu_tensor_is_there_at_once():
    read = HostRead(torch.tensor([3, 4]))
    assert read.ready() and read.get() == [3, 4]


def test_construction_broadcast_in_chunks_gives_rank_0s_values():
    def body(rank, group):
        tensors = [
            torch.full((n,), float(rank + 1), dtype=dtype)
            for n, dtype in [
                (5, torch.float32),
                (3, torch.float64),
                (7, torch.float32),
                (1, torch.float32),
            ]
        ]
        broadcast_tensors(group, tensors, src=0, chunk_bytes=24)  # 6 floats: several chunks
        return tensors

    for tensors in run_threaded(body, 3):
        assert all(torch.equal(t, torch.ones_like(t)) for t in tensors)


def test_broadcasts_from_several_roots_in_flight_at_once_large_tensors_in_place():
    # Rank r owns tensors[r]: a large contiguous one (broadcast where it lies), a large
    # transposed one and small ones (flat); every root's broadcasts start before any wait.
    big = IN_PLACE_BYTES // 4

    def owned(root, rank):
        return [
            torch.full((big,), float(rank + 1)),
            torch.full((64, big // 64), float(rank + 1)).t(),
            torch.full((3,), float(rank + 1), dtype=torch.float64),
        ]

    def body(rank, group):
        tensors = [owned(root, rank) for root in range(3)]
        storage = tensors[1][0].data_ptr()
        broadcasts = Broadcasts(group)
        for root in range(3):
            broadcasts.start(tensors[root], root, f"broadcast from {root}")
        broadcasts.finish()
        return tensors, storage == tensors[1][0].data_ptr()

    for tensors, kept in run_threaded(body, 3):
        assert kept
        for root, mine in enumerate(tensors):
            assert all(torch.equal(t, torch.full_like(t, float(root + 1))) for t in mine)


def test_broadcasts_a_peer_never_joins_raise_within_the_timeout():
    from datetime import timedelta

    from gradsync.engine.errors import ReductionTimeoutError

    def body(rank, group):
        if rank == 1:  # alive, in no collective: rank 0 must give up by its timeout
            time.sleep(3)
            return "left"
        broadcasts = Broadcasts(group, timedelta(seconds=1))
        broadcasts.start(
            [torch.ones(IN_PLACE_BYTES // 4), torch.ones(3)], 0, "broadcast of rank 0's parameters"
        )
        start = time.monotonic()
        with pytest.raises(
            ReductionTimeoutError, match="broadcast of rank 0's parameters did not complete"
        ):
            broadcasts.finish()
        return time.monotonic() - start

    waited, left = run_threaded(body, 2, timeout=30)
    assert left == "left" and waited < 10


def _train(rank, group, cls, read_back, steps=4, find_unused=False):
    model = seeded(MODELS["unused_branch" if find_unused else "mlp"], 0)
    ddp = cls(model, process_group=group, find_unused_parameters=find_unused)
    if cls is GradsyncDDP:
        ddp.reducer.configure(read_back=read_back)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        ddp(torch.ones(2, 8) * (step + rank + 1)).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("find_unused", [False, True])
def test_deferred_read_back_trains_exactly_as_torch(find_unused):
    ours = run_threaded(_train, 2, GradsyncDDP, "deferred", 4, find_unused)
    theirs = run_threaded(_train, 2, TorchDDP, "now", 4, find_unused)
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


class _Skippable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare, self.out = (
            torch.nn.Linear(8, 16),
            torch.nn.Linear(8, 16),
            torch.nn.Linear(16, 4),
        )

    def forward(self, x, skip=False):
        h = self.used(x) if skip else self.used(x) + self.spare(x)
        return self.out(torch.relu(h))


def test_deferred_missing_gradients_raise_at_once_on_their_rank_and_later_elsewhere():
    def body(rank, group):
        model = seeded(_Skippable, 0)
        ddp = GradsyncDDP(model, process_group=group)  # no find_unused: a skipped spare is missing
        ddp.reducer.configure(read_back="deferred")
        for step in range(5):
            try:
                ddp(torch.ones(2, 8), skip=rank == 1 and step == 1).sum().backward()
            except GradSyncError as error:
                return step, str(error)
        return "no error"

    (step0, message0), (step1, message1) = run_threaded(body, 2, timeout=30)
    assert step1 == 1 and "rank 1: bucket(s)" in message1 and "spare.weight" in message1
    assert step0 in (2, 3) and "rank(s) 1 ended the backward of iteration 2" in message0


@pytest.mark.parametrize("read_back", ["deferred", "now"])
def test_step_path_reads_no_tensor_on_the_host_when_read_back_is_deferred(monkeypatch, read_back):
    """The CPU stand-in for torch.cuda.set_sync_debug_mode("error"): with the defaults,
    find_unused_parameters and the accumulation check on, steps after the first read no
    tensor's value on the host, except through `device.HostRead` (pinned memory, once landed);
    nor does the opt-in finite check. Read back "now" (gloo's default), the same steps do
    read: the count is a real one."""
    reads: list[str] = []
    allowed = ("gradsync/engine/device.py",)

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "gradsync" in caller and not caller.endswith(allowed) and counting_on[0]:
                reads.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)

        return read

    counting_on = [False]
    for name in ("item", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))

    def body(rank, group, find_unused):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group, find_unused_parameters=find_unused)
        ddp.reducer.configure(read_back=read_back, check_accumulation=True, check_finite=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            if step == 2 and rank == 0:
                counting_on[0] = True  # after the bucket rebuild, in the steady state
            opt.zero_grad()
            ddp(torch.ones(2, 8) * (step + 1)).pow(2).sum().backward()
            opt.step()
        return True

    for find_unused in (False, True):
        run_threaded(body, 2, find_unused, timeout=30)
        counting_on[0] = False
    if read_back == "deferred":
        assert reads == []
    else:
        assert any("reports.py" in r for r in reads), reads
        assert any("checks.py" in r for r in reads), reads


def test_deferred_finite_check_names_the_gradient_at_a_later_iteration():
    """Read back deferred, a NaN made on rank 1 in iteration 2 is averaged (no host read
    stopped it) and named by rank 1 once the norms have landed: at the end of that backward
    or a later iteration's start, either way outside any collective, so the rank can go on
    and the others are not left waiting. Read back now, it is named before the bucket is
    sent (`test_reliability`)."""
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["mlp"], 0), process_group=group)
        ddp.reducer.configure(read_back="deferred", check_finite=True)
        errors = []
        for step in range(1, 6):
            x = torch.ones(2, 8)
            if rank == 1 and step == 2:
                x[0, 0] = float("nan")
            ddp.zero_grad()  # rank 0's own gradients stay finite (its averages were not)
            try:
                out = ddp(x)
            except GradSyncError as error:  # raised before this iteration's collectives
                errors.append((step, str(error)))
                out = ddp(x)
            try:
                out.sum().backward()
            except GradSyncError as error:  # raised once every collective had landed
                errors.append((step, str(error)))
        return errors

    errors0, errors1 = run_threaded(body, 2, timeout=30)
    assert errors0 == []
    [(step, message)] = errors1
    assert step in (2, 3, 4), step
    assert "on rank 1 holds NaN in iteration 2" in message and "read_back" in message
    assert any(f"'net.{i}." in message for i in range(6)), message


def test_finite_check_takes_half_precision_norms_in_float32():
    """An fp16 gradient whose fp16 norm overflows is finite: no error; an infinity is one."""
    from gradsync.engine.checks import check_finite

    big = torch.full((100_000,), 300.0, dtype=torch.float16)  # its fp16 norm is inf
    check_finite([big], ["big"], 0, 1)
    big[7] = float("inf")
    with pytest.raises(GradSyncError, match="'big' on rank 0 holds infinite values in iteration 1"):
        check_finite([big], ["big"], 0, 1)


class _FakeEvent:
    """A CUDA event's protocol on the host: recorded at a host time, landed when told."""

    landed = True

    def record(self):
        self.t = time.perf_counter_ns()

    def query(self):
        return _FakeEvent.landed

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) / 1e6


def _event_clock():
    return EventClock(new_event=_FakeEvent, side_stream=contextlib.nullcontext)


def test_event_clock_turns_tokens_into_nanoseconds_anchored_once():
    clock = _event_clock()
    start = time.perf_counter_ns()
    tokens = [clock() for _ in range(3)]
    assert tokens == [1, 2, 3]
    times = [clock.ns(t) for t in tokens]
    assert start <= times[0] <= times[1] <= times[2] <= time.perf_counter_ns()
    assert clock.ns(0) == 0


def test_device_timed_timelines_are_published_once_landed_and_read_in_device_time():
    def body(rank, group):
        model = seeded(MODELS["many_small"], 0)
        params = list(model.parameters())
        config = ReducerConfig(clock=_event_clock(), rebuild_bucket_size_limits=(256,))
        reducer = Reducer(params, [[i] for i in reversed(range(len(params)))], group, config=config)
        seen = []
        reducer.iteration_listeners.append(lambda r, t: seen.append(t.iteration))
        states = []
        for step in range(4):
            _FakeEvent.landed = step >= 2  # iterations 1 and 2 still "in flight" on the device
            out = model(torch.ones(2, 8))
            reducer.prepare_for_backward(out)
            out.sum().backward()
            states.append((list(seen), len(reducer._unresolved)))
        history = list(reducer.history)  # reading it resolves what is left
        return states, history, seen

    for states, history, seen in run_threaded(body, 2, timeout=60):
        # Nothing published while in flight; once landed, published at the next iteration's start.
        assert states[0] == ([], 1) and states[1] == ([], 2)
        assert states[2][0] == [1, 2] and states[3][0] == [1, 2, 3]
        assert seen == [1, 2, 3, 4] and [t.iteration for t in history] == [1, 2, 3, 4]
        for timeline in history:
            launched = timeline.times(EventKind.LAUNCH)
            completed = timeline.times(EventKind.COMPLETE)
            assert launched and set(completed) == set(launched)
            assert all(0 <= launched[b] <= completed[b] for b in launched)
            assert timeline.start_ns <= timeline.backward_end_ns <= timeline.finish_ns
            assert timeline.start_ns > 10**6  # nanoseconds on the host clock's scale, not tokens


def test_device_timelines_nobody_reads_keep_only_the_historys_events():
    def body(rank, group):
        model = seeded(MODELS["many_small"], 0)
        params = list(model.parameters())
        clock = _event_clock()
        config = ReducerConfig(clock=clock, rebuild_bucket_size_limits=None, history=3)
        reducer = Reducer(params, [[i] for i in reversed(range(len(params)))], group, config=config)
        kept = []
        for _ in range(30):
            out = model(torch.ones(2, 8))
            reducer.prepare_for_backward(out)
            out.sum().backward()
            kept.append(len(clock._events))
        return kept, len(reducer._unresolved), [t.iteration for t in reducer.history]

    _FakeEvent.landed = True
    for kept, unresolved, history in run_threaded(body, 2, timeout=60):
        assert unresolved == 3 and history == [28, 29, 30]
        # bounded: the last 3 iterations' and the anchor
        assert kept[-1] == kept[10] == max(kept[5:]), kept


def test_an_unread_timeline_dropped_leaves_the_next_iterations_readings_and_a_late_completion():
    # Iteration 2 has begun when iteration 1's completion is read (from a comm thread, late):
    # dropping 1 unread must keep 2's readings and the late one, and reuse 1's events.
    _FakeEvent.landed = True
    clock = _event_clock()
    timelines = Timelines(keep=1, rank=0, device_clock=clock)

    def iteration(number: int) -> IterationTimeline:
        start, ready, end, finish = clock(), clock(), clock(), clock()
        return IterationTimeline(number, start, [[0]], [4], [(ready, EventKind.BUCKET_READY, 0)],
                                 backward_end_ns=end, finish_ns=finish)

    first = iteration(1)
    timelines.add(first, device_timed=True)
    second = iteration(2)
    first.events.append((clock(), EventKind.COMPLETE, 0))  # read after 2's readings
    second.events.append((clock(), EventKind.COMPLETE, 0))
    made = len(clock._events) + len(clock._free)
    timelines.add(second, device_timed=True)  # keep=1: the first goes, unread
    assert [t.iteration for t in timelines.unresolved] == [2]
    assert clock._free, "the dropped iteration's events are kept for reuse"
    (kept,) = timelines.recent
    assert kept.iteration == 2 and kept.start_ns <= kept.backward_end_ns <= kept.finish_ns
    assert all(t >= kept.start_ns > 0 for t, _, _ in kept.events), kept.events
    clock()  # a new reading takes a freed event rather than a new one
    assert len(clock._events) + len(clock._free) == made
