"""Failures made visible: diverged replicas, NaN gradients, and ranks that die or raise."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from models import MODELS

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.guards import ParameterDivergenceError
from gradsync.testing import RankError, run_processes, run_threaded, seeded


def test_divergence_check_names_the_parameter_the_ranks_and_the_amount():
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["mlp"], 0), process_group=group)
        ddp.check_parameters_in_sync()  # in sync after construction
        if rank == 2:
            with torch.no_grad():
                ddp.module.net[2].weight[0, 0] += 0.5
        try:
            ddp.check_parameters_in_sync()
        except ParameterDivergenceError as error:
            return str(error)
        return "no error"

    for message in run_threaded(body, 3):
        assert "'net.2.weight'" in message and "ranks [2]" in message and "up to 0.5" in message


def test_periodic_divergence_check_catches_a_rank_that_skipped_an_update():
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group)
        ddp.enable_divergence_check(every=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            opt.zero_grad()
            try:
                ddp(torch.ones(2, 8)).sum().backward()
            except ParameterDivergenceError:
                return step
            if not (rank == 1 and step == 0):  # rank 1 forgets one optimizer step
                opt.step()
        return "no error"

    assert run_threaded(body, 2) == [2, 2]


def test_nan_gradient_is_named_before_it_is_averaged():
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["mlp"], 0), process_group=group)
        ddp.enable_nan_check()
        ddp.enable_stall_watchdog(warn_after=1, timeout=3)
        x = torch.ones(2, 8)
        if rank == 1:
            x[0, 0] = float("nan")
        ddp(x).sum().backward()

    with pytest.raises(RankError, match=r"(?s)gradient of 'net\.\d\.(weight|bias)' on rank 1 holds NaN") as info:
        run_threaded(body, 2, timeout=30)
    assert info.value.rank == 1


def _dies_mid_backward(rank, group, how):
    model = seeded(MODELS["mlp"], 0)
    ddp = GradsyncDDP(model, process_group=group)
    ddp.enable_stall_watchdog(warn_after=0.5, timeout=15)

    def die(_param):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("simulated failure on rank 1")

    for step in range(5):
        if rank == 1 and step == 3:
            model.net[4].weight.register_post_accumulate_grad_hook(die)  # the first gradient
        try:
            ddp(torch.ones(2, 8)).sum().backward()
        except RuntimeError:
            if rank == 1:
                os._exit(1)  # the failing rank's process ends, as under torchrun
            raise
    return "survived"


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_rank_dying_mid_backward_stops_the_others_with_a_clear_error(how):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_processes(_dies_mid_backward, 2, how, timeout=90, default_group=True)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.rank == 0, message
    assert "iteration 4" in message and "bucket 0" in message, message
    assert elapsed < 60


def test_backward_twice_without_a_forward_is_an_error():
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["mlp"], 0), process_group=group)
        loss = ddp(torch.ones(2, 8)).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    with pytest.raises(RankError, match=r"(?s)marked ready for reduction twice.*already been reduced"):
        run_threaded(body, 2)


def test_forward_without_tensors_is_refused_when_the_graph_must_be_walked():
    class NoTensors(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            return {"loss_value": self.fc(x).sum().item()}

    def body(rank, group):
        GradsyncDDP(NoTensors(), process_group=group, find_unused_parameters=True)(torch.ones(1, 2))

    with pytest.raises(RankError, match="forward returned dict with no tensor in it"):
        run_threaded(body, 1)


def test_world_size_one_trains_like_a_plain_module():
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["mlp"], 0), process_group=group)
        ddp(torch.ones(2, 8)).pow(2).sum().backward()
        return [p.grad.clone() for p in ddp.module.parameters()]

    (grads,) = run_threaded(body, 1)
    plain = seeded(MODELS["mlp"], 0)
    plain(torch.ones(2, 8)).pow(2).sum().backward()
    for g, p in zip(grads, plain.parameters()):
        assert torch.equal(g, p.grad)
