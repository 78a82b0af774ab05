"""What one training step asks of the device, counted on CPU: stand-ins for the device calls
(`gradsync.engine.device.DeviceCalls`: event record, query, elapsed time, current stream, the
side stream) take the Reducer down its GPU path on a gloo group. A step makes none per
gradient and a small constant per bucket and per iteration, as torch's C++ reducer (a handful
of events per iteration); each gradient is timed only on sampled iterations
(`ReducerConfig.time_gradients_every`). The gradients stay those of the host path. And the
tensor operations a step adds (each a kernel launch on a GPU) are a few batched ones per
bucket, where torch's C++ reducer issues two or three per gradient.

(At 3757ea6, before `DeviceCalls`, the GPU path made one event record and two current-stream
calls per gradient, one query and one elapsed time per gradient per iteration.)
"""

from __future__ import annotations

import contextlib
import itertools
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradsync import DistributedDataParallel, EventKind, Reducer, ReducerConfig
from gradsync.engine.device import DeviceCalls
from gradsync.testing import run_threaded, seeded
from gradsync.wrapper.overlap import OverlappedOptimizer


class _Stream:
    def __init__(self, calls: CountingCalls) -> None:
        self.calls = calls

    def wait_stream(self, _other: object) -> None:
        self.calls.counts["wait_stream"] += 1


class _Event:
    def __init__(self, calls: CountingCalls) -> None:
        self.calls, self.at = calls, 0.0

    def record(self) -> None:
        self.calls.counts["record"] += 1
        self.at = next(self.calls.clock)

    def query(self) -> bool:
        self.calls.counts["query"] += 1
        return True

    def synchronize(self) -> None:
        self.calls.counts["synchronize"] += 1

    def elapsed_time(self, other: _Event) -> float:
        self.calls.counts["elapsed_time"] += 1
        return other.at - self.at  # milliseconds: each record one later than the last


class CountingCalls:
    """`DeviceCalls` that count, on a stream that is always the same one."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.clock = itertools.count(1.0)
        self.stream = _Stream(self)

    def event(self) -> _Event:
        self.counts["event"] += 1
        return _Event(self)

    def current_stream(self) -> _Stream:
        self.counts["current_stream"] += 1
        return self.stream

    def on_stream(self, _stream: object) -> contextlib.AbstractContextManager:
        self.counts["on_stream"] += 1
        return contextlib.nullcontext()

    def side_stream(self) -> contextlib.AbstractContextManager:
        self.counts["side_stream"] += 1
        return contextlib.nullcontext()


def _model(layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])


def _bucketed(params: list[torch.Tensor], buckets: int) -> list[list[int]]:
    """`buckets` buckets in backward order (the last layers first)."""
    order = list(reversed(range(len(params))))
    size = -(-len(order) // buckets)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _count_steps(rank, group, layers, buckets, steps, every, hook, listen=False, history=16):
    model = seeded(lambda: _model(layers), 0)
    params = list(model.parameters())
    calls: DeviceCalls = CountingCalls()
    config = ReducerConfig(
        rebuild_bucket_size_limits=None, time_gradients_every=every, history=history
    )
    reducer = Reducer(params, _bucketed(params, buckets), group, config=config, device_calls=calls)
    if hook:
        reducer.register_comm_hook(None, _averaging_hook(group))
    if listen:  # someone wants every iteration's timeline as it lands
        reducer.iteration_listeners.append(lambda _rank, _timeline: None)
    x = torch.full((4, 16), float(rank + 1))
    per_step = []
    for _ in range(steps):
        before = Counter(calls.counts)
        model.zero_grad(set_to_none=True)
        out = model(x)
        reducer.prepare_for_forward()
        reducer.prepare_for_backward(out)
        out.pow(2).mean().backward()
        per_step.append(calls.counts - before)
    before = Counter(calls.counts)
    history = list(reducer.history)  # reading it resolves what has not been
    per_step.append(calls.counts - before)  # last: what the read asked of the device
    return per_step, history, {n: p.grad.clone() for n, p in model.named_parameters()}


def _averaging_hook(group):
    def hook(_state, bucket):
        tensor = bucket.buffer().div_(group.size())
        return group.allreduce([tensor]).get_future().then(lambda f: f.value()[0])

    return hook


@pytest.mark.timeout(120)
@pytest.mark.parametrize("listen", [False, True], ids=["nobody_listening", "listener"])
@pytest.mark.parametrize("hook", [False, True], ids=["allreduce", "comm_hook"])
def test_a_step_makes_no_device_call_per_gradient(hook, listen):
    # Same buckets, twice and four times the gradients: the counts per step do not change.
    counts = {}
    for layers in (8, 16, 32):
        results = run_threaded(_count_steps, 2, layers, 4, 6, 64, hook, listen, timeout=60)
        per_step, history, _ = results[0]
        steady = per_step[3:-1]  # after the first iterations' extra resolution work
        assert all(s == steady[0] for s in steady), steady
        counts[layers] = steady[0]
    assert counts[8] == counts[16] == counts[32], counts
    step = counts[8]
    buckets = 4
    # Per iteration: forward's and backward's start, backward's end, the finish (4 events);
    # per bucket: ready, launch, completion. One current stream per backward and per bucket.
    assert step["record"] == 4 + 3 * buckets, step
    # Events made anew: none once the resolved ones are recorded again (with a listener,
    # from the second iteration on; nobody listening, past the history: see below).
    assert step["event"] == (0 if listen else step["record"]), step
    assert step["current_stream"] == 1 + buckets, step
    assert step["side_stream"] == buckets, step
    if listen:
        # The previous iteration resolved at this one's start: its end and completions
        # queried, each timed reading's elapsed time taken once, nothing waited for.
        assert step["query"] == 1 + buckets and step["synchronize"] == 0, step
        assert step["elapsed_time"] == 4 + 3 * buckets, step
    else:
        # Nobody looking: nothing asked of the events (torch's reducer reads its events on
        # sampled iterations only); reading the history resolves the 6 iterations then.
        assert step["query"] == step["synchronize"] == step["elapsed_time"] == 0, step
        read = per_step[-1]
        assert read["elapsed_time"] == 6 * (4 + 3 * buckets) and read["synchronize"] == 0, read
        assert [t.iteration for t in history] == list(range(1, 7))
    assert step["wait_stream"] == 0, step  # one stream: nothing to order
    assert step["on_stream"] == (buckets if hook else 0), step


@pytest.mark.timeout(120)
def test_sampled_iterations_time_each_gradient_and_others_take_their_buckets_time():
    results = run_threaded(_count_steps, 2, 8, 4, 6, 3, False, timeout=60)
    per_step, history, _ = results[0]
    params = 16
    for iteration, step in enumerate(per_step[:-1], start=1):  # the last: the history read
        timed = iteration % 3 == 0
        assert step["record"] == 4 + 3 * 4 + (params if timed else 0), (iteration, step)
    for timeline in history:
        assert timeline.gradients_timed == (timeline.iteration % 3 == 0)
        ready, bucket_ready = (
            timeline.times(EventKind.READY),
            timeline.times(EventKind.BUCKET_READY),
        )
        assert set(ready) == set(range(params))
        for b, members in enumerate(timeline.bucket_indices):
            # Read before the bucket was (sampled), or its bucket's time (not): at the latest.
            assert all(0 < ready[i] <= bucket_ready[b] for i in members), (timeline.iteration, b)
            if not timeline.gradients_timed:
                assert {ready[i] for i in members} == {bucket_ready[b]}


@pytest.mark.timeout(120)
def test_the_device_path_on_cpu_gives_the_host_paths_gradients():
    def host(rank, group):
        model = seeded(lambda: _model(8), 0)
        params = list(model.parameters())
        reducer = Reducer(
            params,
            _bucketed(params, 4),
            group,
            config=ReducerConfig(rebuild_bucket_size_limits=None),
        )
        out = model(torch.full((4, 16), float(rank + 1)))
        reducer.prepare_for_backward(out)
        out.pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    device = run_threaded(_count_steps, 2, 8, 4, 1, 64, False, timeout=60)
    for (_, _, grads), want in zip(device, run_threaded(host, 2, timeout=60)):
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=0, atol=0)


class _CountOps(TorchDispatchMode):
    """Counts the tensor operations dispatched on this thread (each a kernel or more on a GPU),
    the top-level ones only: a batched `_foreach_copy_` is one, whatever it does inside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _wrapper_ops(rank, group, layers, wrapper, options):
    """The tensor operations one training step's synchronisation adds: the wrapped model's
    step counted, less the same step of the bare model (forward, backward, nothing else)."""
    x = torch.full((4, 16), float(rank + 1))

    def counted(model):
        for _ in range(3):  # past the first iterations (bucket rebuild, views set up)
            model.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
        with _CountOps() as mode:
            model(x).pow(2).mean().backward()  # gradients accumulated: no zero_grad in the count
        return mode.ops

    bare = counted(seeded(lambda: _model(layers), 0))
    module = seeded(lambda: _model(layers), 0)
    if wrapper == "torch":
        wrapped = nn.parallel.DistributedDataParallel(module, process_group=group, **options)
    else:
        wrapped = DistributedDataParallel(module, process_group=group, **options)
    return counted(wrapped) - bare


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_as_bucket_view": True}, {"find_unused_parameters": True}],
    ids=["default", "as_view", "find_unused"],
)
def test_a_step_issues_no_tensor_operation_per_gradient(options):
    # One bucket of 16, then 64 small gradients: gradsync issues the same few batched
    # operations (copy in, all-reduce, scale, copy out), torch's C++ reducer two or three per
    # gradient (divide into the bucket, view, copy back): on a GPU, kernels the host launches
    # one by one inside backward. (A gradient of FUSED_COPY_MIN_NUMEL elements or more is
    # divided while copied, one operation of its own, as torch does: one pass over its memory.)
    ops = {}
    for wrapper in ("gradsync", "torch"):
        for layers in (8, 32):
            ops[wrapper, layers] = run_threaded(
                _wrapper_ops, 2, layers, wrapper, options, timeout=60
            )[0]
    assert ops["gradsync", 8] == ops["gradsync", 32], ops
    assert ops["gradsync", 8]["allreduce_"] >= 1, ops  # the counter sees gradsync's collectives
    assert sum(ops["gradsync", 8].values()) <= 12, ops["gradsync", 8]  # a few per bucket and step
    if not options.get("gradient_as_bucket_view"):
        assert ops["gradsync", 8]["_foreach_copy_"] == 2, ops["gradsync", 8]  # in and out, batched
    # torch's grows with the gradients: the counter sees a C++ reducer's operations too.
    grown = sum(ops["torch", 32].values()) - sum(ops["torch", 8].values())
    assert grown >= 2 * (64 - 16), ops


@pytest.mark.timeout(120)
def test_unread_device_timelines_past_the_history_are_dropped_unasked():
    # 12 steps, history 4, nobody listening: the events of the 8 oldest iterations are never
    # asked about and not kept; reading the history resolves the last 4.
    def body(rank, group):
        per_step, history, _ = _count_steps(rank, group, 8, 4, 12, 64, False, history=4)
        return per_step, history

    for per_step, history in run_threaded(body, 2, timeout=60):
        assert all(step["query"] == step["elapsed_time"] == 0 for step in per_step[:-1]), per_step
        # the dropped ones' events reused
        assert all(step["event"] == 0 for step in per_step[6:-1]), per_step
        assert [t.iteration for t in history] == [9, 10, 11, 12]
        assert per_step[-1]["elapsed_time"] == 4 * (4 + 3 * 4), per_step[-1]
        for timeline in history:
            assert timeline.start_ns <= timeline.backward_end_ns <= timeline.finish_ns
            assert timeline.start_ns > 0 and all(t > 0 for t, _, _ in timeline.events)


def _count_overlapped_steps(rank, group, layers, steps, device_calls):
    """`overlap_optimizer`'s path: each bucket stepped as it lands, the rest landing in the next
    forward (the wrapper's forward runs under `landing_on_use`). Counts per step, parameters."""
    model = seeded(lambda: _model(layers), 0)
    params = list(model.parameters())
    calls = CountingCalls() if device_calls else None
    config = ReducerConfig(rebuild_bucket_size_limits=None, time_gradients_every=64)
    reducer = Reducer(params, _bucketed(params, 4), group, config=config, device_calls=calls)
    opt = OverlappedOptimizer(reducer, torch.optim.SGD(params, lr=0.01, momentum=0.9))
    x = torch.full((4, 16), float(rank + 1))
    per_step = []
    for _ in range(steps):
        before = Counter(calls.counts if calls else {})
        reducer.prepare_for_forward()
        with reducer.landing_on_use():
            out = model(x)
        reducer.prepare_for_backward(out)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        per_step.append(Counter(calls.counts if calls else {}) - before)
    opt.wait()
    return per_step, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_the_overlapped_optimizer_makes_no_device_call_per_gradient_and_never_waits_on_the_host():
    # Each bucket's write-back and step are queued on the stream after its collective: no
    # event synchronised, nothing per gradient, and the parameters of the host path.
    counts = {}
    for layers in (8, 16, 32):
        per_step, params = run_threaded(_count_overlapped_steps, 2, layers, 6, True, timeout=60)[0]
        steady = per_step[2:]
        assert all(s == steady[0] for s in steady), steady
        counts[layers] = steady[0]
        assert steady[0]["synchronize"] == 0, steady[0]
        if layers == 8:
            host = run_threaded(_count_overlapped_steps, 2, layers, 6, False, timeout=60)[0][1]
            for name, want in host.items():
                torch.testing.assert_close(params[name], want, rtol=0, atol=0)
    assert counts[8] == counts[16] == counts[32], counts
    # As without the optimizer, and per bucket two more: its write-back and step, timed (the
    # trace's "write-back and step" track); per iteration one more: backward's return, which
    # the planner's trials time the step to.
    assert counts[8]["record"] == 4 + 1 + 3 * 4 + 2 * 4, counts[8]
    assert counts[8]["query"] == counts[8]["elapsed_time"] == 0, counts[8]  # nothing read back
