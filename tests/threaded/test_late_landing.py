"""NCCL's contract on CPU groups: a collective's Work and Future complete before its data has
landed, and the data lands at `wait()` (`gradsync.testing.LateLandingGroup`). gradsync must read
every reduced value through a wait: buckets, hook results, the used map, the reports, the
construction and buffer broadcasts, sharded gradients and the sharded optimizer's gathers. A
read that skipped the wait would see the rank's own, unreduced values, and the parameters would
differ from those trained over the same group without the delay."""

from __future__ import annotations

import time

import pytest
import torch
from models import MODELS

import gradsync
from gradsync.testing import LateLandingGroup, run_threaded, seeded

STEPS = 4


def test_the_late_group_completes_before_the_data_lands():
    """The stand-in itself: value() before wait() is the local tensor; wait() lands the sum,
    and so does a `then` callback."""
    def body(rank, group):
        late = LateLandingGroup(group)
        mine = torch.ones(4) * (rank + 1)
        future = late.allreduce([mine]).get_future()
        time.sleep(0.1)  # the collective itself has long finished on gloo's threads
        stale = future.value()[0].clone()
        chained = late.allreduce([torch.ones(2)]).get_future().then(lambda f: f.value()[0] * 10)
        return future.done(), stale, future.wait()[0].clone(), chained.wait()

    for rank, (done, stale, landed, chained) in enumerate(run_threaded(body, 2, timeout=30)):
        assert done
        assert torch.equal(stale, torch.full((4,), float(rank + 1)))
        assert torch.equal(landed, torch.full((4,), 3.0)) and torch.equal(
            chained, torch.full((2,), 20.0)
        )


def _raw_future_hook(group, bucket):
    """Returns the collective's own Future: its value is only right through wait()."""
    buffer = bucket.buffer().div_(group.size())
    return group.allreduce([buffer]).get_future()


def _then_hook(group, bucket):
    return (
        group.allreduce([bucket.buffer()])
        .get_future()
        .then(lambda f: f.value()[0].div_(group.size()))
    )


def _train(rank, group, late, model_name, hook, zero, read_back, kwargs):
    group = LateLandingGroup(group) if late else group
    model = seeded(MODELS[model_name], 0)
    ddp = gradsync.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=0.0005, **kwargs
    )
    ddp.reducer.configure(read_back=read_back)
    if zero is not None:
        opt = gradsync.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, process_group=group, **zero
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    for step in range(STEPS):
        opt.zero_grad()
        ddp(
            torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        ).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("model_name,hook,zero,read_back,kwargs", [
    ("mlp", None, None, "now", {}),
    ("mlp", None, None, "deferred", {}),
    ("mlp", None, None, "now", {"gradient_as_bucket_view": True}),
    ("unused_branch", None, None, "now", {"find_unused_parameters": True}),
    ("unused_branch", None, None, "deferred", {"find_unused_parameters": True}),
    ("mlp", _raw_future_hook, None, "now", {}),
    ("mlp", _then_hook, None, "deferred", {}),
    ("mlp", None, {}, "now", {}),
    ("mlp", None, {"overlap_param_gather": True}, "deferred", {}),
], ids=["defaults", "deferred", "as_view", "find_unused", "find_unused_deferred", "hook_raw_future",
        "hook_then", "sharded", "sharded_overlapped_gathers"])
def test_every_reduced_value_is_read_through_a_wait(model_name, hook, zero, read_back, kwargs):
    args = (model_name, hook, zero, read_back, kwargs)
    plain = run_threaded(_train, 2, False, *args, timeout=60)
    late = run_threaded(_train, 2, True, *args, timeout=60)
    for a, b in zip(late, plain):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(
        torch.equal(x, y)
        for x, y in zip(plain[0], [p.detach() for p in seeded(MODELS[model_name], 0).parameters()])
    )
