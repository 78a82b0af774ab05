"""The Reducer on real gloo groups in threads: parity with one process and with torch's DDP,
overlap of communication with backward, the bucket rebuild, and every error it raises."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from models import make_batches
from parity import assert_records_equal, train_reducer, train_single, train_torch_ddp

import gradsync
from gradsync import EventKind, GradSyncError, ReducerConfig, ReductionTimeoutError
from gradsync.testing import RankError, run_threaded, seeded

STEPS = 3
SMALL = ReducerConfig(rebuild_bucket_size_limits=(256,))  # keep many buckets after rebuild


def _side_by_side(rank, group, model_name, batches, reducer_kwargs, ddp_kwargs):
    ours = train_reducer(rank, group, model_name, batches, **reducer_kwargs)
    theirs = train_torch_ddp(rank, group, model_name, batches, **ddp_kwargs)
    return ours, theirs


@pytest.mark.parametrize(
    "model_name,world_size",
    [("mlp", 1), ("mlp", 2), ("mlp", 3), ("mlp", 4), ("many_small", 2), ("many_small", 3),
     ("many_small", 4), ("tied", 2), ("tied", 3), ("frozen", 2), ("conv", 2), ("conv", 3)],
)
@pytest.mark.parametrize("bucket_cap_bytes", [256, 25 * 2**20])
def test_gradients_match_single_process_and_torch_ddp(model_name, world_size, bucket_cap_bytes):
    batches = make_batches(STEPS, world_size)
    results = run_threaded(
        _side_by_side, world_size, model_name, batches,
        {"bucket_cap_bytes": bucket_cap_bytes}, {}, timeout=60,
    )
    single = train_single(model_name, batches, world_size)
    exact = world_size <= 2
    for rank, (ours, theirs) in enumerate(results):
        assert_records_equal(ours, theirs, exact=exact, what=f"rank {rank} vs torch DDP")
        assert_records_equal(ours, single, exact=False, what=f"rank {rank} vs single process")
    # Every rank ends with the same parameters.
    for ours, _ in results[1:]:
        assert_records_equal(ours, results[0][0], exact=True, what="rank vs rank 0")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("as_view", [False, True])
def test_unused_branch_with_find_unused_matches_torch(world_size, as_view):
    batches = make_batches(STEPS, world_size)
    config = ReducerConfig(find_unused_parameters=True, gradient_as_bucket_view=as_view)
    results = run_threaded(
        _side_by_side, world_size, "unused_branch", batches,
        {"config": config, "bucket_cap_bytes": 256},
        {"find_unused_parameters": True, "gradient_as_bucket_view": as_view}, timeout=60,
    )
    for ours, theirs in results:
        assert ours["grads"][-1]["spare.weight"] is None  # unused everywhere: left untouched
        assert_records_equal(ours, theirs, exact=world_size == 2, what="unused branch")


def test_parameter_unused_on_some_ranks_gets_the_average():
    def body(rank, group):
        model = seeded(
            lambda: torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]), 0
        )
        params = list(model.parameters())
        reducer = gradsync.Reducer(
            params, [[2, 3], [0, 1]], group, config=ReducerConfig(find_unused_parameters=True)
        )
        x = torch.ones(2, 4) * (rank + 1)
        out = model[0](x)
        if rank == 0:  # the second layer is used on rank 0 only
            out = model[1](out)
        reducer.prepare_for_backward(out)
        out.sum().backward()
        return [None if p.grad is None else p.grad.clone() for p in params]

    g0, g1 = run_threaded(body, 2)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Rank 1 contributed zeros for layer 1, so the average is half of rank 0's local gradient.
    model = seeded(lambda: torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]), 0)
    model[1](model[0](torch.ones(2, 4))).sum().backward()
    torch.testing.assert_close(g0[2], model[1].weight.grad / 2)


def _many_small_timelines():
    """Every rank's timelines of a few iterations of 60 small parameters in ~256-byte buckets."""
    batches = make_batches(STEPS, 2)
    results = run_threaded(
        lambda r, g: train_reducer(r, g, "many_small", batches, bucket_cap_bytes=256, config=SMALL),
        2,
    )
    return [t for record in results for t in record["timelines"]]


def test_first_bucket_launches_before_backward_ends():
    for timeline in _many_small_timelines():
        order = timeline.order(EventKind.READY, EventKind.LAUNCH)
        first_launch = order.index((EventKind.LAUNCH, 0))
        last_ready = max(i for i, (k, _) in enumerate(order) if k == EventKind.READY)
        assert first_launch < last_ready, "no overlap: bucket 0 waited for the whole backward"
        assert len(timeline.bucket_indices) > 1


def test_events_are_consistent_and_buckets_launch_in_order():
    for timeline in _many_small_timelines():
        ready, bucket_ready = (
            timeline.times(EventKind.READY),
            timeline.times(EventKind.BUCKET_READY),
        )
        launch, complete = timeline.times(EventKind.LAUNCH), timeline.times(EventKind.COMPLETE)
        launches = [i for k, i in timeline.order(EventKind.LAUNCH)]
        assert launches == list(range(len(timeline.bucket_indices)))
        for b, members in enumerate(timeline.bucket_indices):
            assert max(ready[i] for i in members) <= bucket_ready[b] <= launch[b] <= complete[b]
        assert timeline.finish_ns >= timeline.backward_end_ns


def test_buckets_rebuilt_once_in_ready_order_identically_on_every_rank():
    batches = make_batches(STEPS, 2)
    results = run_threaded(
        lambda r, g: train_reducer(
            r, g, "many_small", batches, bucket_cap_bytes=2**30,
            config=ReducerConfig(rebuild_bucket_size_limits=(300, 600)),
        ),
        2,
    )
    first = results[0]["timelines"][0]
    assert len(first.bucket_indices) == 1  # started as one bucket
    order = first.ready_order()
    assert order == list(reversed(range(60)))  # backward visits the last layer first
    params = [p for p in seeded(lambda: __import__("models").ManySmall(), 0).parameters()]
    want, _ = gradsync.compute_bucket_assignment_by_size(
        [params[i] for i in order], [300, 600], tensor_indices=order
    )
    for record in results:
        assert record["layout"] == want
        assert record["timelines"][1].bucket_indices == want
        assert record["timelines"][2].bucket_indices == want


def test_buckets_are_rebuilt_in_ready_order_with_event_recording_off():
    # The rebuild reads the first iteration's ready order from its timeline; with recording
    # off that order must still be kept, or the first iteration's one bucket stays for good
    # (measured: 1.20x the step of the rebuilt layout on the emulated cluster, no overlap).
    batches = make_batches(STEPS, 2)
    limits = (300, 600)

    def body(rank, group):
        on = train_reducer(rank, group, "many_small", batches, bucket_cap_bytes=2**30,
                           config=ReducerConfig(rebuild_bucket_size_limits=limits))
        off = train_reducer(
            rank,
            group,
            "many_small",
            batches,
            bucket_cap_bytes=2**30,
            config=ReducerConfig(rebuild_bucket_size_limits=limits, record_events=False),
        )
        return on, off

    for on, off in run_threaded(body, 2):
        assert len(on["layout"]) > 1 and off["layout"] == on["layout"]
        assert_records_equal(off, on, exact=True, what="events off")
        assert off["timelines"][-1].events == []  # recorded only until the rebuild


def test_gradient_as_bucket_view_makes_grads_views_and_keeps_parity():
    batches = make_batches(STEPS, 2)
    keep: list = []

    def body(rank, group):
        ours = train_reducer(
            rank, group, "mlp", batches, bucket_cap_bytes=512,
            config=ReducerConfig(gradient_as_bucket_view=True), keep=keep,
        )
        return ours, train_torch_ddp(rank, group, "mlp", batches, gradient_as_bucket_view=True)

    results = run_threaded(body, 2)
    for ours, theirs in results:
        assert_records_equal(ours, theirs, exact=True, what="gradient_as_bucket_view")
    for reducer in keep:
        for bucket in reducer.buckets:
            lo = bucket.buffer.data_ptr()
            hi = lo + bucket.nbytes
            for p in bucket.params:
                assert lo <= p.grad.data_ptr() < hi, "grad is not a view into its bucket"


# ------------------------------------------------------------------------------- errors


def _reducer_for(model, group, **config):
    named = list(model.named_parameters())
    return gradsync.Reducer(
        [p for _, p in named], [list(range(len(named)))], group,
        param_names=[n for n, _ in named], config=ReducerConfig(**config),
    )


def test_parameter_used_outside_forward_is_marked_twice():
    def body(rank, group):
        model = seeded(lambda: torch.nn.ModuleDict(
            {"inner": torch.nn.Linear(4, 4), "extra": torch.nn.Linear(4, 4)}), 0)
        reducer = _reducer_for(model, group, find_unused_parameters=True)
        out = model["inner"](torch.ones(2, 4))
        reducer.prepare_for_backward(out)
        (out.sum() + model["extra"](torch.ones(2, 4)).sum()).backward()

    with pytest.raises(RankError, match=r"extra\.(weight|bias).*marked ready for reduction twice"):
        run_threaded(body, 1)


def test_shared_layer_in_two_reentrant_checkpoints_is_marked_twice():
    from torch.utils.checkpoint import checkpoint

    def body(rank, group):
        model = seeded(lambda: torch.nn.Linear(4, 4), 0)
        reducer = _reducer_for(model, group)
        x = torch.ones(2, 4, requires_grad=True)
        out = checkpoint(model, checkpoint(model, x, use_reentrant=True), use_reentrant=True)
        reducer.prepare_for_backward(out)
        out.sum().backward()

    # The iteration ends with the outermost backward, so the second reentrant pass is seen as
    # what it is: the same hook firing twice in one backward (torch's DDP leaves it out silently).
    with pytest.raises(
        RankError,
        match=r"(?s)'(weight|bias)'.*twice.*fired twice in one backward.*use_reentrant=False",
    ):
        run_threaded(body, 1)


def _backward_missing_spare(group, forward=lambda model, x: model(x)):
    """One iteration of UnusedBranch whose backward ends without spare.*'s gradients (raised
    there, not at the next forward); (model, reducer, the error's message)."""
    model = seeded(lambda: __import__("models").UnusedBranch(), 0)
    reducer = _reducer_for(model, group)
    out = forward(model, torch.ones(2, 8))
    reducer.prepare_for_backward(out)
    with pytest.raises(GradSyncError) as info:
        out.sum().backward()
    return model, reducer, str(info.value)


def test_a_finish_hook_runs_after_each_finished_synchronised_backward_and_only_then():
    def body(rank, group):
        model = seeded(lambda: torch.nn.Linear(4, 2), 0)
        reducer = _reducer_for(model, group)
        seen = []  # the weight's gradient as each call found it: written back already
        handle = reducer.register_finish_hook(lambda: seen.append(model.weight.grad.clone()))
        x = torch.full((2, 4), float(rank + 1))
        for _ in range(2):
            model.zero_grad()
            out = model(x)
            reducer.prepare_for_backward(out)
            out.sum().backward()
        branchy = seeded(lambda: __import__("models").UnusedBranch(), 0)
        failing = _reducer_for(branchy, group)
        failing.register_finish_hook(lambda: seen.append("after an error"))
        out = branchy(torch.ones(2, 8))
        failing.prepare_for_backward(out)
        with pytest.raises(GradSyncError, match="never came"):  # spare.* left out: finish raises
            out.sum().backward()
        handle.remove()
        out = model(x)
        reducer.prepare_for_backward(out)
        out.sum().backward()
        return seen

    for seen in run_threaded(body, 2):
        assert len(seen) == 2  # the two synchronised backwards; none after remove()
        assert all(torch.equal(g, seen[0]) for g in seen)  # the average of x = 1 and 2 per rank
        assert torch.equal(seen[0], torch.full((2, 4), 3.0))


def test_backward_that_leaves_a_bucket_unfilled_raises_at_its_end_on_every_rank():
    def body(rank, group):
        model, _, message = _backward_missing_spare(group)
        return message, model.used.weight.grad

    for message, grad in run_threaded(body, 2):
        assert "backward ended in iteration 1 with gradients that never came" in message
        assert "rank 0: bucket(s) 0: spare.weight, spare.bias" in message
        assert "rank 1: bucket(s) 0: spare.weight, spare.bias" in message
        assert "find_unused_parameters=True" in message
        assert grad is not None  # the local gradient, not written over by a partial average


def test_only_the_rank_missing_gradients_names_them_and_every_rank_raises():
    def body(rank, group):
        def forward(model, x):
            return model.out(torch.relu(model.used(x) + (model.spare(x) if rank != 1 else 0)))

        return _backward_missing_spare(group, forward)[2]

    for message in run_threaded(body, 3):
        assert "rank 1: bucket(s) 0: spare.weight, spare.bias" in message
        assert "rank 0:" not in message and "rank 2:" not in message


def test_reducer_is_usable_after_a_missing_gradient_error():
    def body(rank, group):
        model, reducer, _ = _backward_missing_spare(group)
        for p in model.parameters():
            p.grad = None
        out = model(torch.ones(2, 8)) + 0 * model.spare(torch.ones(2, 8)).sum()
        reducer.prepare_for_backward(out)
        out.sum().backward()
        return reducer.iteration, model.spare.weight.grad is not None

    assert run_threaded(body, 2) == [(2, True), (2, True)]


def test_without_outputs_missing_gradients_are_named_at_the_next_iteration():
    # prepare_for_backward(None): the end of backward cannot be seen, only the next start.
    def body(rank, group):
        model = seeded(lambda: __import__("models").UnusedBranch(), 0)
        reducer = _reducer_for(model, group)
        for _ in range(2):
            out = model(torch.ones(2, 8))
            reducer.prepare_for_backward(None)
            out.sum().backward()

    with pytest.raises(RankError) as info:
        run_threaded(body, 2)
    message = str(info.value)
    assert "previous one finished reducing" in message
    assert "spare.weight, spare.bias" in message
    assert "find_unused_parameters=True" in message


def test_reducer_is_usable_after_an_unfinished_iteration_error():
    def body(rank, group):
        model = seeded(lambda: __import__("models").UnusedBranch(), 0)
        reducer = _reducer_for(model, group)
        out = model(torch.ones(2, 8))
        reducer.prepare_for_backward(None)
        out.sum().backward()
        with pytest.raises(GradSyncError):
            reducer.prepare_for_backward(None)
        return reducer.iteration

    assert run_threaded(body, 1) == [1]


@pytest.mark.parametrize(
    "layout,match",
    [
        ([[0, 1], []], "bucket 1 is empty"),
        ([[0, 1], [1, 2, 3]], r"parameter 1 \('0.bias'\) is in bucket 0 and again in bucket 1"),
        ([[0, 1, 2, 3, 7]], "index 7, out of range for 4"),
        ([[0, 1, 2]], r"in no bucket: '1.bias'"),
    ],
)
def test_invalid_bucket_indices_are_refused(layout, match):
    def body(rank, group):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        params = list(model.parameters())
        names = [n for n, _ in model.named_parameters()]
        gradsync.Reducer(params, layout, group, param_names=names)

    with pytest.raises(RankError, match=match):
        run_threaded(body, 1)


def test_mixed_dtype_bucket_is_refused():
    def body(rank, group):
        a = torch.nn.Parameter(torch.zeros(3))
        b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        gradsync.Reducer([a, b], [[0, 1]], group, param_names=["a", "b"])

    with pytest.raises(RankError, match=r"bucket 0 mixes 'a' \(torch.float32, cpu\) with 'b'"):
        run_threaded(body, 1)


def test_parameters_that_do_not_require_grad_are_refused():
    def body(rank, group):
        model = torch.nn.Linear(2, 2)
        model.bias.requires_grad_(False)
        gradsync.Reducer(list(model.parameters()), [[0, 1]], group, param_names=["weight", "bias"])

    with pytest.raises(RankError, match="do not require grad.*bias"):
        run_threaded(body, 1)


def test_rank_that_skips_backward_makes_the_other_time_out_not_hang():
    def body(rank, group):
        model = seeded(lambda: torch.nn.Linear(4, 4), 0)
        reducer = _reducer_for(model, group, timeout=timedelta(seconds=1))
        out = model(torch.ones(2, 4))
        reducer.prepare_for_backward(out)
        if rank == 0:
            out.sum().backward()
        return "skipped"

    with pytest.raises(
        RankError, match=r"rank 0.*bucket 0.*(did not complete within|failed)"
    ) as info:
        run_threaded(body, 2, timeout=30)
    assert isinstance(info.value, RankError) and info.value.rank == 0
    assert "ReductionTimeoutError" in str(info.value)
    assert ReductionTimeoutError.__name__ in str(info.value)


def test_locator_and_flat_buffers_follow_the_layout():
    def body(rank, group):
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 5))
        params = list(model.parameters())
        reducer = gradsync.Reducer(params, [[3, 2], [1, 0]], group)
        assert [reducer.locate(i) for i in range(4)] == [(1, 1), (1, 0), (0, 1), (0, 0)]
        first = reducer.buckets[0]
        assert first.buffer.is_contiguous() and first.buffer.numel() == 5 + 10
        assert first.offsets == [0, 5] and first.lengths == [5, 10]
        assert first.views[1].shape == (5, 2)
        assert first.views[1].data_ptr() == first.buffer.data_ptr() + 5 * 4
        return True

    assert run_threaded(body, 1) == [True]


def test_a_failed_collective_is_told_from_a_timed_out_one_by_the_clock():
    from gradsync.engine.collectives import wait

    class Failing:
        def __init__(self, delay):
            self.delay = delay

        def wait(self, timeout):
            time.sleep(self.delay)
            raise RuntimeError("something went wrong")  # no word of a timeout either way

    class Group:
        def rank(self):
            return 0

        def size(self):
            return 2

    with pytest.raises(ReductionTimeoutError, match="probe failed: something"):
        wait(Failing(0.0), "probe", Group(), timedelta(seconds=1))
    with pytest.raises(ReductionTimeoutError, match="probe did not complete within 0:00:00.200000"):
        wait(Failing(0.2), "probe", Group(), timedelta(seconds=0.2))


def _poisoned_empty(original):
    """`torch.empty` as uninitialised memory may come: NaN everywhere (floating dtypes)."""
    def empty(*args, **kwargs):
        t = original(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return empty


class _UsedOnRankZero(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare, self.out = (
            torch.nn.Linear(8, 16),
            torch.nn.Linear(8, 16),
            torch.nn.Linear(16, 4),
        )

    def forward(self, x, rank):
        h = self.used(x) + self.spare(x) if rank == 0 else self.used(x)
        return self.out(torch.relu(h))


def _train_used_on_rank_zero(rank, group, wrapper_cls, **kwargs):
    model = seeded(_UsedOnRankZero, 0)
    ddp = wrapper_cls(model, process_group=group, bucket_cap_mb=0.0001, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        ddp(torch.ones(2, 8) * (step + rank + 1), rank).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [
    {"find_unused_parameters": True},
    {"find_unused_parameters": True, "gradient_as_bucket_view": True},
    {"static_graph": True},
], ids=["find_unused", "find_unused_as_view", "static_graph"])
def test_buckets_need_no_zeroed_memory(monkeypatch, kwargs):
    """Buckets are allocated with `empty`, as torch's are: with every new tensor made of NaNs,
    a parameter used on one rank only (its bucket view on the other must be zeroed by the
    fill) still gets exactly torch's average."""
    theirs = run_threaded(
        _train_used_on_rank_zero, 2, torch.nn.parallel.DistributedDataParallel, timeout=60, **kwargs
    )
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    ours = run_threaded(
        _train_used_on_rank_zero, 2, gradsync.DistributedDataParallel, timeout=60, **kwargs
    )
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
