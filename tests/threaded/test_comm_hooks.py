"""Communication hooks: torch's own hooks run unchanged on gradsync and give torch's DDP's
parameters; gradsync's hooks; every misuse is an error, never a hang."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
from models import make_batches
from parity import assert_records_equal, train_wrapper
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import comm_hooks
from gradsync.testing import RankError, run_processes, run_threaded, seeded

STEPS = 4


def _hook_for(name, group):
    """(state, hook) for a hook by name; a fresh state per wrapper (PowerSGD keeps memory)."""
    if name == "allreduce":
        return group, torch_hooks.allreduce_hook
    if name == "fp16":
        return group, torch_hooks.fp16_compress_hook
    if name == "fp16_wrapper":
        return group, torch_hooks.fp16_compress_wrapper(torch_hooks.allreduce_hook)
    if name == "noop":
        return None, debugging_hooks.noop_hook
    if name.startswith("powersgd"):
        state = psgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=0.5, use_error_feedback=True, warm_start=True, random_seed=0,
        )
        return state, psgd.powerSGD_hook
    if name == "gradsync_allreduce":
        return group, comm_hooks.allreduce_hook
    if name == "gradsync_fp16":
        return group, comm_hooks.fp16_compress_hook
    raise KeyError(name)


def _train_with_hook(cls, rank, group, hook_name, model_name, batches, **kwargs):
    original = cls.__init__

    def init_and_register(self, *args, **kw):
        original(self, *args, **kw)
        self.register_comm_hook(*_hook_for(hook_name, group))

    patched = type(f"Hooked{cls.__name__}", (cls,), {"__init__": init_and_register})
    return train_wrapper(patched, rank, group, model_name, batches, **kwargs)


def _both(rank, group, hook_name, model_name, batches, kwargs):
    ours = _train_with_hook(GradsyncDDP, rank, group, hook_name, model_name, batches, **kwargs)
    theirs = _train_with_hook(TorchDDP, rank, group, hook_name, model_name, batches, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook_name", ["allreduce", "fp16", "fp16_wrapper", "noop", "powersgd"])
def test_torch_hooks_match_torch_ddp(hook_name, world_size):
    batches = make_batches(STEPS, world_size)
    # 10 KB buckets: several per model. (With one-parameter buckets torch's DDP itself hangs
    # under PowerSGD; gradsync does not, see the test below.)
    # PowerSGD seeds torch's global generator inside the hook: rank threads would race on it,
    # so it runs in processes.
    run = run_processes if hook_name.startswith("powersgd") else run_threaded
    results = run(_both, world_size, hook_name, "mlp", batches, {"bucket_cap_mb": 0.01},
                  timeout=120)
    for rank, (ours, theirs) in enumerate(results):
        assert_records_equal(ours, theirs, exact=world_size == 2, what=f"{hook_name} rank {rank}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_torchs_allreduce_hook_on_complex_parameters_matches_torch_ddp(world_size):
    # torch.distributed.all_reduce reduces a complex bucket as its real view and hands that
    # back: the hook's result is (n, 2) real numbers for n complex ones, which torch's DDP takes.
    batches = make_batches(STEPS, world_size)
    results = run_threaded(_both, world_size, "allreduce", "complex", batches,
                           {"bucket_cap_mb": 0.0005}, timeout=120)
    for rank, (ours, theirs) in enumerate(results):
        assert_records_equal(ours, theirs, exact=world_size == 2, what=f"rank {rank}")


@pytest.mark.parametrize("kwargs", [
    {"gradient_as_bucket_view": True},
    {"micro_steps": 2},
    {"static_graph": True},
])
@pytest.mark.processes
def test_powersgd_composes_with_wrapper_features(kwargs):
    batches = make_batches(STEPS, 2, per_rank=4)
    results = run_processes(_both, 2, "powersgd", "mlp", batches, kwargs, timeout=120)
    for ours, theirs in results:
        assert_records_equal(ours, theirs, exact=True, what=str(kwargs))


@pytest.mark.parametrize("hook_name", ["allreduce", "fp16"])
def test_hooks_compose_with_find_unused_parameters(hook_name):
    batches = make_batches(STEPS, 2, per_rank=4)
    results = run_threaded(_both, 2, hook_name, "unused_branch", batches,
                           {"find_unused_parameters": True, "bucket_cap_mb": 0.001})
    for ours, theirs in results:
        assert_records_equal(ours, theirs, exact=True, what=hook_name)


def _powersgd_unused(rank, group):
    batches = make_batches(STEPS, 2, per_rank=4)
    return _train_with_hook(GradsyncDDP, rank, group, "powersgd", "unused_branch", batches,
                            find_unused_parameters=True, bucket_cap_mb=0.001)


@pytest.mark.processes
def test_powersgd_with_find_unused_parameters_keeps_ranks_in_step():
    # torch 2.13's DDP fails this with a gloo collective mismatch ("Received data size doesn't
    # match expected size"): its used-map all-reduce interleaves with PowerSGD's nested ones.
    r0, r1 = run_processes(_powersgd_unused, 2, timeout=120)
    assert_records_equal(r0, r1, exact=True, what="rank 0 vs rank 1")
    assert r0["grads"][-1]["spare.weight"] is None


@pytest.mark.parametrize("hook", [comm_hooks.allreduce_hook, comm_hooks.compress_wrapper(
    torch.float32, comm_hooks.allreduce_hook)])
def test_gradsync_allreduce_hook_equals_no_hook(hook):
    def body(rank, group, with_hook):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        if with_hook:
            ddp.register_comm_hook(group, hook)
        for _ in range(3):
            ddp(torch.full((2, 8), float(rank + 1))).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    hooked, plain = run_threaded(body, 2, True), run_threaded(body, 2, False)
    for a, b in zip(hooked[0], plain[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,ours,torchs", [
    (torch.float16, comm_hooks.fp16_compress_hook, torch_hooks.fp16_compress_hook),
    (torch.bfloat16, comm_hooks.bf16_compress_hook, torch_hooks.bf16_compress_hook),
    (torch.bfloat16, comm_hooks.bf16_compress_wrapper(comm_hooks.allreduce_hook),
     torch_hooks.bf16_compress_wrapper(torch_hooks.allreduce_hook)),
])
def test_compression_hooks_reduce_in_the_low_precision(dtype, ours, torchs):
    # torch's DDP refuses bf16 hooks off NCCL; the reference is computed directly:
    # each rank's gradient cast to the low precision, divided by 2, summed, cast back.
    def body(rank, group, hook):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        ddp.register_comm_hook(group, hook)
        ddp(torch.full((2, 8), float(rank + 1))).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for hook in (ours, torchs):
        got = run_threaded(body, 2, hook)
        local = []
        for r in range(2):
            model = seeded(lambda: __import__("models").MLP(), 0)
            model(torch.full((2, 8), float(r + 1))).pow(2).sum().backward()
            local.append([p.grad for p in model.parameters()])
        for i, g in enumerate(got[0]):
            want = (local[0][i].to(dtype) / 2 + local[1][i].to(dtype) / 2).float()
            torch.testing.assert_close(g, want, rtol=0, atol=0)
            assert torch.equal(g, got[1][i])


def test_no_hook_runs_on_an_unsynchronised_step():
    calls = []

    def counting_hook(group, bucket):
        calls.append(bucket.index())
        return comm_hooks.allreduce_hook(group, bucket)

    def body(rank, group):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        ddp.register_comm_hook(group, counting_hook)
        with ddp.no_sync():
            ddp(torch.ones(2, 8)).sum().backward()
        assert calls == []
        ddp(torch.ones(2, 8)).sum().backward()
        return len(ddp.reducer.buckets)

    buckets = run_threaded(body, 1)[0]
    assert sorted(calls) == list(range(buckets))


def test_hook_sees_torchs_bucket_interface_and_rebuilt_buckets():
    seen = []

    def inspecting_hook(group, bucket):
        buf = bucket.buffer()
        assert sum(g.numel() for g in bucket.gradients()) == buf.numel()
        assert [g.shape for g in bucket.gradients()] == [p.shape for p in bucket.parameters()]
        seen.append((bucket.index(), bucket.is_last(), len(bucket.parameters())))
        return comm_hooks.allreduce_hook(group, bucket)

    def body(rank, group):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.002)
        ddp.register_comm_hook(group, inspecting_hook)
        for _ in range(2):
            ddp(torch.ones(2, 8)).sum().backward()
        return len(ddp.reducer.buckets)

    n = run_threaded(body, 1)[0]
    assert seen[0] == (0, True, 6)  # first iteration: one bucket for everything
    assert [s[0] for s in seen[1:]] == list(range(n)) and seen[-1][1] and n > 1


# ------------------------------------------------------------------------------- errors


def _error_case(rank, group, case):
    model = seeded(lambda: __import__("models").MLP(), 0)
    ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
    ddp.reducer.config = gradsync.ReducerConfig(timeout=timedelta(seconds=2))
    hooks = {
        "not_future": lambda g, b: b.buffer(),
        "wrong_shape": lambda g, b: _done(b.buffer()[:-1].clone()),
        "wrong_dtype": lambda g, b: _done(b.buffer().to(torch.int32)),
        "raises": _raising_hook,
        "raises_later": lambda g, b: _done(b.buffer()).then(_fail),
        "never_completes": lambda g, b: torch.futures.Future(),
    }
    if case == "twice":
        ddp.register_comm_hook(group, comm_hooks.allreduce_hook)
        ddp.register_comm_hook(group, comm_hooks.allreduce_hook)
    if case == "after_backward":
        ddp(torch.ones(2, 8)).sum().backward()
        ddp.register_comm_hook(group, comm_hooks.allreduce_hook)
    if case == "bad_signature":
        ddp.register_comm_hook(group, lambda bucket: None)
    ddp.register_comm_hook(group, hooks[case])
    ddp(torch.ones(2, 8)).sum().backward()


def _done(t):
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


def _raising_hook(group, bucket):
    raise ValueError("compression table missing")


def _fail(_fut):
    raise ValueError("decompression failed")


@pytest.mark.parametrize("case,match", [
    ("twice", "only once.*allreduce_hook"),
    ("after_backward", "before the first forward/backward; 1 iteration"),
    ("bad_signature", "must take two arguments"),
    ("not_future", "bucket 0.*returned Tensor; a hook must return a torch.futures.Future"),
    ("wrong_shape", r"shape \[\d+\].*for bucket 0.*expected the bucket's shape"),
    ("wrong_dtype", r"dtype torch.int32 for bucket 0.*expected.*torch.float32"),
    ("raises", "raised on bucket 0.*ValueError: compression table missing"),
    ("raises_later", "failed for bucket 0.*decompression failed"),
    ("never_completes", "did not complete within"),
])
def test_hook_misuse_is_a_clear_error_not_a_hang(case, match):
    with pytest.raises(RankError, match=f"(?s){match}"):
        run_threaded(_error_case, 1, case, timeout=30)


def _one_param_buckets(rank, group):
    model = seeded(lambda: __import__("models").MLP(), 0)
    ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.002)
    ddp.register_comm_hook(*_hook_for("powersgd", group))
    for _ in range(4):
        ddp(torch.full((2, 8), float(rank + 1))).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.processes
def test_powersgd_with_one_parameter_buckets_does_not_hang():
    # torch 2.13's DDP hangs here: see gradsync.engine.comm.HookChain for why gradsync does not.
    g0, g1 = run_processes(_one_param_buckets, 2, timeout=120)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def _already_complete_hook(group, bucket):
    """Reduce at once and return a completed Future, as NCCL's are at enqueue."""
    buffer = bucket.buffer()
    group.allreduce([buffer.div_(group.size())]).wait()
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def test_a_thousand_buckets_ready_at_once_with_completed_futures_do_not_recurse():
    # 1000 one-parameter buckets whose gradients arrive in reverse bucket order: the last
    # gradient releases every bucket at once, and each Future is complete when returned. The
    # chain used to launch the next bucket from inside the previous Future's callback, one
    # nesting per bucket, into Python's recursion limit.
    n = 1000

    def body(rank, group):
        params = [torch.nn.Parameter(torch.full((2,), float(i))) for i in range(n)]
        reducer = gradsync.Reducer(params, [[i] for i in range(n)], group)
        reducer.register_comm_hook(group, _already_complete_hook)
        loss = sum(p.sum() * (rank + 1) for p in params)  # backward reaches params[n-1] first
        reducer.prepare_for_backward(loss)
        loss.backward()
        return [p.grad[0].item() for p in params[:3]], reducer.history[-1].order(3)[:3]

    for grads, launches in run_threaded(body, 2, timeout=60):
        assert grads == [1.5, 1.5, 1.5]  # (1 + 2) / 2
        assert [i for _, i in launches] == [0, 1, 2]  # in bucket order all the same


def test_hooks_are_launched_on_the_backward_thread_never_from_a_communication_thread():
    # As torch's DDP launches them (see HookChain), whatever the Futures' callbacks run on.
    def body(rank, group):
        model = seeded(
            lambda: torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)]), 0
        )
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=1e-7)  # 24 one-tensor buckets
        threads = set()

        def slow_then_allreduce(state, bucket):
            threads.add(threading.current_thread().name)
            fut = group.allreduce([bucket.buffer()]).get_future()
            return fut.then(lambda f: (time.sleep(0.002), f.value()[0].div_(group.size()))[1])

        ddp.register_comm_hook(group, slow_then_allreduce)
        for _ in range(3):
            ddp(torch.ones(4, 16) * (rank + 1)).pow(2).sum().backward()
        return threads, len(ddp.reducer.buckets)

    for rank, (threads, buckets) in enumerate(run_threaded(body, 2, timeout=60)):
        assert buckets == 24 and threads == {f"rank{rank}"}


class _SlowWork(torch.distributed.Work):
    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def get_future(self) -> torch.futures.Future:
        return self._future


class _SlowGroup(torch.distributed.ProcessGroup):
    """The real group's all-reduce, its Future completed 30 ms after the data landed: a slow
    link."""

    def __init__(self, group) -> None:
        super().__init__(group.rank(), group.size())
        self.group = group

    def allreduce(self, tensors, opts=None):
        future, work = torch.futures.Future(), self.group.allreduce(tensors)

        def later():
            work.wait()
            time.sleep(0.03)
            future.set_result(tensors)

        threading.Thread(target=later, daemon=True).start()
        return _SlowWork(future)


def _mean_allreduce_elsewhere(group, bucket):  # the same arithmetic, not a hook gradsync knows
    return (
        group.allreduce([bucket.buffer().div_(group.size())])
        .get_future()
        .then(lambda f: f.value()[0])
    )


@pytest.mark.parametrize(
    "hook", [comm_hooks.allreduce_hook, torch_hooks.allreduce_hook, _mean_allreduce_elsewhere]
)
def test_known_one_allreduce_hooks_launch_as_buckets_fill_others_one_at_a_time(hook):
    # A known hook issues its one all-reduce inside the call, so it cannot interleave: the
    # chain launches it as soon as its bucket is full and the link never idles between buckets.
    # A hook gradsync does not know waits for the previous bucket's Future (see HookChain).
    def body(rank, group):
        params = [torch.nn.Parameter(torch.full((4,), float(i))) for i in range(4)]
        reducer = gradsync.Reducer(params, [[i] for i in range(4)], group)
        reducer.register_comm_hook(_SlowGroup(group), hook)
        loss = sum(p.sum() * (rank + 1) for p in params)
        reducer.prepare_for_backward(loss)
        loss.backward()
        return [p.grad[0].item() for p in params], reducer.history[-1].order(3, 4)

    for grads, order in run_threaded(body, 2, timeout=60):
        assert grads == [1.5] * 4  # (1 + 2) / 2
        kinds = [k for k, _ in order]
        if hook is _mean_allreduce_elsewhere:
            assert order == [(3, 0), (4, 0), (3, 1), (4, 1), (3, 2), (4, 2), (3, 3), (4, 3)]
        else:
            # every launch before the first completion
            assert kinds == [3, 3, 3, 3, 4, 4, 4, 4], order
