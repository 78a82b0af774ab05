"""The engine's units on their own, without a process group: a bucket filling and writing back,
the static graph's counts, the reports' encoding (see also test_reliability), the phases."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from gradsync.engine.bucket import Bucket, ReduceBy, Sharding
from gradsync.engine.layout import priority_tail
from gradsync.engine.pool import BufferPool
from gradsync.engine.reducer import Phase
from gradsync.engine.static_graph import StaticGraph


def _params(*shapes):
    return [torch.nn.Parameter(torch.zeros(s)) for s in shapes]


def test_fill_divides_while_copying_and_zeros_what_has_no_gradient():
    params = _params((2, 3), (4,), (70_000,))  # the last one is scaled while copied
    params[0].grad = torch.full((2, 3), 6.0)
    params[2].grad = torch.full((70_000,), 3.0)
    bucket = Bucket(0, [0, 1, 2], params)
    bucket.fill(divisor=3, as_view=False)
    assert torch.equal(bucket.views[0], torch.full((2, 3), 2.0))
    assert torch.equal(bucket.views[1], torch.zeros(4))
    assert torch.equal(bucket.views[2], torch.ones(70_000))
    assert params[0].grad[0, 0] == 6.0  # the gradient itself is left alone


def test_fill_dividing_by_one_copies_for_a_hook_and_views_become_grads():
    params = _params((3,), (2,))
    params[0].grad = torch.tensor([1.0, 2.0, 3.0])
    bucket = Bucket(0, [0, 1], params)
    bucket.fill(divisor=1, as_view=True)  # 1: copied as they are
    assert torch.equal(bucket.buffer, torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0]))
    assert params[0].grad.data_ptr() == bucket.views[0].data_ptr()  # now a view of the bucket
    assert params[1].grad is None  # no gradient: not made one
    bucket.fill(divisor=2, as_view=True)  # a view already: divided in place
    assert torch.equal(params[0].grad, torch.tensor([0.5, 1.0, 1.5]))


def test_write_back_leaves_parameters_unused_everywhere_untouched():
    params = _params((2,), (2,), (2,))
    params[1].grad = torch.tensor([9.0, 9.0])
    bucket = Bucket(0, [0, 1, 2], params)
    bucket.buffer.copy_(torch.arange(6.0))
    bucket.write_back(used=[1, 1, 0], as_view=False)
    assert torch.equal(params[0].grad, torch.tensor([0.0, 1.0]))  # had none: a copy
    assert torch.equal(params[1].grad, torch.tensor([2.0, 3.0]))  # written into its own tensor
    assert params[2].grad is None  # unused on every rank: as torch leaves it
    bucket.write_back(used=None, as_view=True)
    assert params[2].grad.data_ptr() == bucket.views[2].data_ptr()


def test_write_back_casts_a_payload_of_another_dtype():
    params = _params((3,))
    bucket = Bucket(0, [0], params, dtype=torch.bfloat16)
    bucket.launch_payload(torch.float32, divisor=2)
    bucket.payload.copy_(torch.tensor([1.0, 2.0, 3.0]))
    bucket.write_back(used=None, as_view=False)
    assert params[0].grad.dtype == torch.float32 and torch.equal(
        params[0].grad, torch.tensor([1.0, 2.0, 3.0])
    )


def test_a_bucket_carries_a_tail_after_its_gradients():
    bucket = Bucket(0, [0, 1], _params((2,), (3,)), tail=4)
    assert bucket.buffer.numel() == 5 and bucket.tail.numel() == 4 and bucket.wire.numel() == 9
    assert bucket.tail.data_ptr() == bucket.wire.data_ptr() + 5 * 4


def test_static_graph_learns_counts_then_marks_on_the_last_firing():
    graph = StaticGraph(3)
    graph.start_iteration()
    assert graph.learning and not graph.learned
    for index in (0, 1, 0):  # parameter 0 fires twice (a reentrant checkpoint), 2 never
        assert not graph.fire(index)
    assert graph.learn() == [2]
    graph.start_iteration()
    assert not graph.learning
    assert graph.fire(0) is False and graph.fire(1) is True and graph.fire(0) is True
    assert graph.settle_used_map([2, 2, 0]) == [2, 2, 0]
    assert graph.settle_used_map([1, 1, 1]) == [2, 2, 0]  # the first iteration's holds


@pytest.mark.parametrize("phase", list(Phase))
def test_phases_have_names(phase):
    assert phase.value == phase.name.lower()


def test_a_pool_lends_the_smallest_fitting_buffer_and_keeps_no_more_than_asked():
    pool = BufferPool(keep=2)
    a, b = (
        pool.take(10, torch.float32, torch.device("cpu")),
        pool.take(100, torch.float32, torch.device("cpu")),
    )
    pool.give(b)
    pool.give(a)
    assert pool.take(5, torch.float32, torch.device("cpu")) is a  # smallest that fits
    assert pool.take(5, torch.float64, torch.device("cpu")) is not b  # never another dtype
    pool.give(a)
    pool.give(pool.take(1000, torch.float32, torch.device("cpu")))  # b was too small: a third
    assert pool.allocations == 4 and pool.held_bytes == (100 + 1000) * 4  # a, the smallest, dropped
    with pytest.raises(ValueError, match="keep=-1"):
        BufferPool(keep=-1)


def test_a_transient_bucket_on_a_stale_lent_buffer_zeros_its_padding_and_tail():
    pool = BufferPool(keep=1)
    pool.give(torch.full((16,), 7.0))  # what another bucket left behind
    params = _params((3,), (2,))
    for p in params:
        p.grad = torch.ones_like(p)
    sharding = Sharding(rank=0, transient=True, reduce_by=ReduceBy.ALL_REDUCE, pool=pool)
    bucket = Bucket(0, [0, 1], params, world_size=2, tail=2, sharding=sharding)
    assert bucket.wire.numel() == 0  # nothing held until the fill
    bucket.fill(divisor=2, as_view=False)
    assert bucket.wire.tolist() == [0.5] * 5 + [0.0] * 2  # gradients / 2, then the tail zeroed
    assert all(p.grad is None for p in params)  # the bucket holds them now
    bucket.release()
    assert bucket.wire.numel() == 0 and pool.allocations == 0 and pool.held_bytes == 16 * 4


@pytest.mark.parametrize("divisor", [1, 3])  # 1: copied as they are
def test_large_gradients_taken_at_their_hooks_fill_the_bucket_as_one_fill_would(divisor):
    def bucket_with_grads():
        params = _params((70_000,), (5,), (40_000,), (3,))  # two large (taken early), two small
        for i, p in enumerate(params):
            p.grad = torch.arange(p.numel(), dtype=torch.float32) * (i + 1) / 7
        return Bucket(0, [0, 1, 2, 3], params)

    whole = bucket_with_grads()
    whole.fill(divisor, as_view=False)
    early = bucket_with_grads()
    assert early.copies_early and early.early == [True, False, True, False]
    early.copy_early(2, divisor, as_view=False)  # arrived first
    early.copy_early(0, divisor, as_view=False)
    early.fill(divisor, as_view=False)  # the last one's arrival: only the rest copied now
    assert torch.equal(early.buffer, whole.buffer)
    early.reset()
    assert early._n_copied == 0 and not any(early._copied)  # a new iteration copies afresh


def test_a_large_gradient_missing_at_its_hook_is_zeroed_by_the_fill_and_the_rest_kept():
    params = _params((70_000,), (5,), (40_000,))
    params[1].grad, params[2].grad = torch.full((5,), 4.0), torch.full((40_000,), 8.0)
    bucket = Bucket(0, [0, 1, 2], params)
    # the buffer is never zeroed up front: the fill must write it all
    bucket.buffer.fill_(float("nan"))
    bucket.copy_early(0, 2, as_view=False)  # no gradient yet: left for the fill
    bucket.copy_early(2, 2, as_view=False)
    bucket.fill(2, as_view=False)
    assert torch.equal(bucket.views[0], torch.zeros(70_000))
    assert torch.equal(bucket.views[1], torch.full((5,), 2.0))
    assert torch.equal(bucket.views[2], torch.full((40_000,), 4.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_fill_divides_as_torchs_reducer_does_in_every_float_dtype(dtype):
    # torch's reducer writes at::mul_out(view, grad, 1 / world_size) for each gradient: the
    # batched multiply of the small ones must round as that does (in bfloat16 and float16 too,
    # which `_foreach_mul_` with a Python float does not on the CPU).
    shapes = [(7,), (70_000,), (192,), (3, 5), (40_000,), (1,)]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(dtype) * 3
    for early in (False, True):
        bucket = Bucket(0, list(range(len(params))), params)
        if early:
            bucket.copy_early(4, 3, as_view=False)
            bucket.copy_early(1, 3, as_view=False)
        bucket.fill(3, as_view=False)
        for p, view in zip(params, bucket.views):
            assert torch.equal(view, torch.mul(p.grad, 1.0 / 3)), (dtype, early, p.shape)


def test_flat_views_keep_each_parameters_values_and_strides():
    # A channels-last conv weight with one input channel is contiguous in both memory formats:
    # as a view of the flat buffer it must keep the strides it had (with `view_as` it lost them,
    # its convolution took another kernel, and ZeRO's parameters_as_bucket_view changed bits).
    from gradsync.wrapper.zero import _flat_views

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 1, 3, 3).to(memory_format=torch.channels_last))
    bias, skipped = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2, 3).t())
    before = [(p.detach().clone(), p.stride()) for p in (weight, bias, skipped)]
    [(buffer, members)] = _flat_views([weight, bias, skipped])
    # the transposed one is not contiguous
    assert members == [weight, bias] and buffer.numel() == 36 + 4
    for p, (values, stride) in zip((weight, bias, skipped), before):
        assert torch.equal(p, values) and p.stride() == stride
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert (
        weight.untyped_storage().data_ptr()
        == bias.untyped_storage().data_ptr()
        == buffer.data_ptr()
    )


def test_bucket_views_take_the_parameters_strides_wherever_its_memory_is_dense():
    # As torch's reducer (`as_strided` for every dense parameter): a channels-last weight with one
    # input channel is also standard-contiguous, and `view` would give its size-1 dimension
    # standard strides; a parameter with gaps in its memory gets a standard-contiguous view.
    from gradsync.engine.bucket import view_like

    buffer = torch.arange(100.0)
    one_channel = torch.empty(4, 1, 3, 3).to(memory_format=torch.channels_last)
    channels_last = torch.empty(2, 3, 2, 2).to(memory_format=torch.channels_last)
    gaps = torch.empty(4, 6)[:, ::2]
    plain = torch.empty(3, 5)
    for param in (one_channel, channels_last, gaps, plain):
        view = view_like(buffer[10:], 7, param)
        assert view.shape == param.shape
        assert view.stride() == (param.stride() if param is not gaps else (3, 1)), param.stride()
        # Memory order is the buffer's order: its slice, nothing before or after.
        assert sorted(view.flatten().tolist()) == list(range(17, 17 + param.numel()))


def test_the_unused_search_reaches_exactly_the_leaves_behind_the_outputs():
    # A shared subgraph (reached twice), a leaf returned as is, a parameter used only in an
    # output left out of the search, one not used at all, one behind a detached branch.
    from gradsync.engine.unused import reachable_parameters

    shared, head, returned, elsewhere, unused, detached = _params(3, 3, 3, 3, 3, 3)
    for p in (shared, head, returned, elsewhere, unused, detached):
        p.data.uniform_()
    trunk = shared.exp()
    outputs = [(trunk * head).sum() + trunk.sum() + (detached * 2).detach().sum(), returned]
    other = (elsewhere * 3).sum()
    reached = reachable_parameters(outputs)
    assert reached == {id(shared), id(head), id(returned)}
    assert reachable_parameters([other]) == {id(elsewhere)}
    assert reachable_parameters([torch.zeros(2)]) == set()  # nothing needing a gradient


def test_the_tail_trial_tries_a_credit_and_a_plan_saved_before_it_reads_as_no_credit():
    from gradsync.engine.config import ReducerConfig
    from gradsync.planning.autoplan import BucketPlan, _tail_candidates
    from gradsync.planning.planner import CostModel

    tried = _tail_candidates(ReducerConfig(priority_tail_bytes=4096, chunk_bytes=1024), 40960)
    assert tried["one chunk in flight"] == (4096, 1024, 1024)
    assert tried["no tail"] == (0, 1024, 0) and tried["chunks x4"] == (4096, 4096, 0)
    # a link slower than backward: what it cannot carry during backward held, nearest first
    assert tried["half the gradients"] == (20480, 1024, 0)
    assert tried["three quarters of the gradients"] == (30720, 1024, 0)
    held = _tail_candidates(ReducerConfig(priority_tail_bytes=4096, chunk_bytes=1024,
                                          credit_bytes=1024), 4096)
    assert held["no credit"] == (4096, 1024, 0) and held["chunks x4"] == (4096, 4096, 4096)
    plan = BucketPlan([[0]], CostModel(0.0, 1e-9), 1.0, 1.0, 0, [[0]], 1.0, kept=True)
    old = dataclasses.replace(plan, tail=(4096, 1024))  # a checkpoint from before the credit
    assert old.tail_settings == (4096, 1024, 0) and "in flight" not in str(old)
    new = dataclasses.replace(plan, tail=(4096, 1024, 1024))
    assert new.tail_settings == (4096, 1024, 1024) and "0.000977 MiB of them in flight" in str(new)


def test_a_trial_on_buckets_landing_later_times_forward_to_backwards_return_not_the_gap():
    from gradsync.engine.timeline import IterationTimeline
    from gradsync.planning.autoplan import _step_ms

    timeline = IterationTimeline(3, start_ns=5_000_000, bucket_indices=[[0]], bucket_bytes=[4],
                                 forward_start_ns=1_000_000, backward_returned_ns=9_000_000)
    # 8 ms of step; the 50 ms forward to forward held a data loader's wait, or other models'
    assert _step_ms(timeline, forward_to_forward_ms=50.0) == pytest.approx(8.0)
    unsaid = IterationTimeline(3, start_ns=5_000_000, bucket_indices=[[0]], bucket_bytes=[4])
    assert _step_ms(unsaid, forward_to_forward_ms=50.0) == 50.0


def _sent(ready_ns, landed_ns, backward_end_ns, nbytes=100):
    """A timeline whose buckets of `nbytes` filled (and launched) at `ready_ns` and landed at
    `landed_ns`, backward ending at `backward_end_ns`."""
    from gradsync.engine.timeline import EventKind, IterationTimeline

    events = [(t, kind, b) for b, t in enumerate(ready_ns)
              for kind in (EventKind.BUCKET_READY, EventKind.LAUNCH)]
    events += [(t, EventKind.COMPLETE, b) for b, t in enumerate(landed_ns)]
    return IterationTimeline(1, start_ns=0, bucket_indices=[[b] for b in range(len(ready_ns))],
                             bucket_bytes=[nbytes] * len(ready_ns), events=events,
                             backward_end_ns=backward_end_ns)


def test_the_backlog_is_what_a_link_at_its_measured_rate_had_not_sent_when_backward_ended():
    # Three buckets of 100 B fill at 0, 10 and 20 ns; the link, busy from 0 to 300 ns with
    # their 300 B, moves 1 B/ns. Sent as they filled, 150 B were still to go at 150 ns.
    assert _sent([0, 10, 20], [100, 200, 300], backward_end_ns=150).backlog_bytes() == 150
    # Backward ending after the link caught up: nothing held would have been waiting.
    assert _sent([0, 10, 20], [100, 200, 300], backward_end_ns=400).backlog_bytes() == 0
    # The link idle between two buckets: its rate is over the time it was busy only, and
    # what was sent before the gap does not count against the queue after it.
    gap = _sent([0, 500], [100, 600], backward_end_ns=520)
    assert gap.backlog_bytes() == 80
    # A collective not seen landing (or events not recorded): nothing to measure.
    assert _sent([0, 10], [100], backward_end_ns=150).backlog_bytes() is None
    assert _sent([], [], backward_end_ns=150).backlog_bytes() is None


def test_a_step_after_a_pause_longer_than_itself_is_not_a_trial_sample():
    # Its forward found the last step's buckets landed in the pause (another model trained in
    # turn, as in the bench): it waited for none, so a larger tail would look faster than it is.
    from gradsync.engine.timeline import IterationTimeline
    from gradsync.planning.autoplan import after_pause

    def step(i, forward_ms, returned_ms):
        return IterationTimeline(i, start_ns=0, bucket_indices=[[0]], bucket_bytes=[4],
                                 forward_start_ns=int(forward_ms * 1e6),
                                 backward_returned_ns=int(returned_ms * 1e6))

    steady = [step(1, 0.0, 10.0), step(2, 11.0, 21.0)]  # 1 ms between steps: counted
    paused = [step(1, 0.0, 10.0), step(2, 40.0, 50.0)]  # 30 ms idle before a 10 ms step
    assert not after_pause(steady, 10.0) and after_pause(paused, 10.0)
    assert not after_pause(paused[1:], 10.0)  # nothing before it: counted


class _Stuck:
    """A collective that never completes (a peer gone elsewhere)."""

    def is_completed(self):
        return False


class _Done:
    def is_completed(self):
        return True


def test_quiesce_waits_for_collectives_in_flight_within_its_bound_and_no_longer():
    # At exit or once the reducer is dropped (`reducer._quiesce_at_exit`): never forever.
    from gradsync.engine.reductions import Flight, quiesce

    stuck, done, idle = Flight(), Flight(), Flight()
    stuck.work, done.work = _Stuck(), _Done()
    start = time.monotonic()
    quiesce([done, idle, stuck, stuck], seconds=0.2)  # the bound is for all of them together
    assert 0.2 <= time.monotonic() - start < 1.0
    start = time.monotonic()
    quiesce([done, idle])
    assert time.monotonic() - start < 0.1


def test_the_tail_ends_at_the_parameter_boundary_nearest_its_size():
    # Ready order: a large layer (8 KiB), then 3.5 KiB nearest the input. A 4 KiB tail holds
    # those 3.5 KiB; the large layer stays in the head, sent as it is ready in backward (once
    # it was pulled into the tail, and the whole of it waited for the end of backward).
    sizes = [2048, 256, 128, 512]  # float32 elements: 8, 1, 0.5 and 2 KiB; in ready order
    params = [torch.empty(n) for n in sizes]
    layout, order = priority_tail([[0, 1, 2, 3]], params, [False] * 4, 4096, 2048)
    assert layout == [[0], [1, 2], [3]] and order == [0, 2, 1]
    # 15 KiB: the large layer as well, the tail's size nearer 15 KiB with it than without
    layout, order = priority_tail([[0, 1, 2, 3]], params, [False] * 4, 15 * 1024, 8192)
    assert layout == [[0], [1, 2, 3]] and order == [1, 0]
