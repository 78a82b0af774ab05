"""The engine's units that talk to other ranks, each on its own: the used map, the reports,
a joined rank's shadow iteration, and the Reducer's phases through one iteration."""

from __future__ import annotations

import pytest
import torch

import gradsync
from gradsync.engine.reducer import Phase
from gradsync.engine.reports import Reports, uneven
from gradsync.engine.used_map import UsedMap
from gradsync.testing import run_threaded, seeded


def _wait(work, _what):
    work.wait()


def test_used_map_sums_across_ranks_or_says_who_left_what_unused():
    def body(rank, group):
        used = UsedMap(["a", "b", "c"], group)
        used.local[0] = 1
        used.local[1] = rank  # rank 0 leaves b unused
        used.start(torch.device("cpu"), report=False)
        summed = used.finish(_wait)
        used.start(torch.device("cpu"), report=True)
        reported = used.finish(_wait)
        return summed, reported, used.last_report, used.finish(_wait)

    for summed, reported, report, nothing in run_threaded(body, 2):
        assert summed == [2, 1, 0] and reported == [2, 1, 0]
        assert report == {"b": [0], "c": [0, 1]}
        assert nothing is None  # no reduction started since


@pytest.mark.parametrize("dtype", [torch.float32, torch.cfloat, torch.bfloat16])
def test_reports_ride_in_a_tail_or_go_on_their_own(dtype):
    # A complex tail (the last bucket a complex parameter's) carries them in its real part.
    def body(rank, group):
        reports = Reports(group)
        tail = torch.empty(3, dtype=dtype)
        reports.attach(tail, micro_steps=2 + (rank == 2), missing=rank == 1)
        group.allreduce([tail]).wait()
        ridden = reports.finish(_wait, 2)
        reports.start(torch.device("cpu"), micro_steps=4, missing=False)
        alone = reports.finish(_wait, 4)
        return ridden, alone

    for ridden, alone in run_threaded(body, 3):
        assert [r.micro_steps for r in ridden] == [2, 2, 3] and (
            [r.missing for r in ridden] == [False, True, False]
        )
        assert uneven(ridden) == [2, 2, 3] and uneven(alone) is None


def test_shadow_iteration_answers_every_collective_of_an_active_iteration():
    # Rank 1 has joined: it contributes zeros to each bucket, the used map and the reports,
    # and takes the sums into its own .grad, as an active rank does.
    def body(rank, group):
        model = seeded(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), 0)
        named = list(model.named_parameters())
        reducer = gradsync.Reducer(
            [p for _, p in named], [[3, 2], [1, 0]], group, param_names=[n for n, _ in named],
            config=gradsync.ReducerConfig(find_unused_parameters=True),
        )
        if rank == 1:
            reducer.shadow_iteration()
            return [p.grad.clone() for p in model.parameters()]
        out = model(torch.ones(2, 4))
        reducer.prepare_for_backward(out, divisor=1)
        out.sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    grads, joined = run_threaded(body, 2)
    model = seeded(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), 0)
    model(torch.ones(2, 4)).sum().backward()
    for got, theirs, want in zip(grads, joined, model.parameters()):
        assert torch.equal(got, want.grad)  # averaged over the one active rank
        assert torch.equal(theirs, got)


def test_the_reducer_walks_its_phases_in_order():
    def body(rank, group):
        model = seeded(lambda: torch.nn.Linear(4, 4), 0)
        reducer = gradsync.Reducer(list(model.parameters()), [[1, 0]], group)
        seen = [reducer.phase]
        out = model(torch.ones(2, 4))
        reducer.prepare_for_backward(out)
        seen.append(reducer.phase)
        during: list = []
        for p in model.parameters():  # after the reducer's own hook on each
            p.register_post_accumulate_grad_hook(lambda _p: during.append(reducer.phase))
        out.sum().backward()
        seen.append(reducer.phase)
        reducer.prepare_for_forward()
        seen.append(reducer.phase)
        return seen, during

    for seen, during in run_threaded(body, 2):
        assert seen == [Phase.IDLE, Phase.PREPARED, Phase.REDUCED, Phase.IDLE]
        assert during == [Phase.BACKWARD, Phase.LAUNCHED]  # the second gradient fills the bucket


def test_a_reduce_scatter_bucket_leaves_each_rank_its_shard_of_the_sum():
    # The seam for sharded optimizers: same filling, another collective.
    from gradsync.engine.bucket import Bucket, ReduceBy, Sharding

    def body(rank, group):
        params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
        for i, p in enumerate(params):
            p.grad = torch.arange(p.numel(), dtype=torch.float32) + 10 * i + rank
        sharding = Sharding(rank=rank, transient=False, reduce_by=ReduceBy.REDUCE_SCATTER)
        bucket = Bucket(0, [0, 1], params, world_size=2, sharding=sharding)
        bucket.fill(divisor=2, as_view=False)
        bucket.start(group, bucket.wire).wait()
        return bucket.shard.tolist(), bucket.shard_offset, bucket.wire.numel()

    (s0, o0, n), (s1, o1, _) = run_threaded(body, 2)
    # rank r's buffer: [r, 1+r, 2+r, 10+r, 11+r] (+ one element of padding); averaged: +0.5
    assert n == 6 and (o0, o1) == (0, 3)
    assert s0 == [0.5, 1.5, 2.5] and s1 == [10.5, 11.5, 0.0]


def test_bucket_collectives_are_checked():
    import pytest

    from gradsync.engine.bucket import Bucket, ReduceBy, Sharding

    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="reduce_by='broadcast'"):
        Bucket(0, [0], params, sharding=Sharding(0, False, "broadcast"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tail"):
        Bucket(0, [0], params, tail=2, world_size=2,
               sharding=Sharding(0, False, ReduceBy.REDUCE_SCATTER))
