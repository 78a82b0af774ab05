"""Failures made visible: diverged replicas, NaN gradients, and ranks that die or raise."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch
from models import MODELS
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.engine.errors import GradSyncError
from gradsync.testing import RankError, run_processes, run_threaded, seeded
from gradsync.wrapper.guards import ParameterDivergenceError


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

    with pytest.raises(
        RankError, match=r"(?s)gradient of 'net\.\d\.(weight|bias)' on rank 1 holds NaN"
    ) as info:
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


@pytest.mark.processes
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

    with pytest.raises(
        RankError, match=r"(?s)marked ready for reduction twice.*already been reduced"
    ):
        run_threaded(body, 2)


@pytest.mark.parametrize("where", ["before step", "after step"])
def test_a_backward_of_a_loss_over_the_parameters_alone_stays_local_as_with_torch_ddp(where):
    # No forward through the wrapper leads to it: its gradients are each rank's own (alike on
    # every rank here), accumulated into .grad, as torch's DDP leaves them. Once it raised
    # "marked ready for reduction twice"; a retained graph's second backward still does (above).
    def train(rank, group, wrapper):
        model = seeded(MODELS["mlp"], 0)
        ddp = wrapper(model, process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            if where == "before step":
                (1e-2 * sum(p.pow(2).sum() for p in model.parameters())).backward()
            opt.step()
            opt.zero_grad()
            if where == "after step":  # into the next step's gradients
                (1e-2 * sum(p.pow(2).sum() for p in model.parameters())).backward()
        return [p.detach().clone() for p in model.parameters()]

    for ours, theirs in zip(run_threaded(train, 2, GradsyncDDP, timeout=60),
                            run_threaded(train, 2, TorchDDP, timeout=60)):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


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


def _uneven_no_sync(rank, group, hooked, read_back="now", steps=4):
    model = seeded(MODELS["mlp"], 0)
    ddp = GradsyncDDP(model, process_group=group)
    if hooked:  # the counts then travel in an all-reduce of their own, not in the last bucket
        ddp.register_comm_hook(group, torch_hooks.allreduce_hook)
    ddp.enable_stall_watchdog(warn_after=1, timeout=5)
    ddp.reducer.configure(read_back=read_back)
    for step in range(steps):
        skip = rank == 1 and step == 1  # rank 1 alone accumulates step 1 locally
        try:
            with ddp.no_sync() if skip else contextlib.nullcontext():
                ddp(torch.ones(2, 8) * (step + 1)).sum().backward()
        except GradSyncError as error:
            return step, str(error)
    return "no error"


@pytest.mark.parametrize("hooked", [False, True])
def test_no_sync_on_some_ranks_only_is_detected_at_the_next_sync_on_every_rank(hooked):
    (step0, message0), (step1, message1) = run_threaded(_uneven_no_sync, 2, hooked, timeout=30)
    # Rank 0's sync at step 1 meets rank 1's at step 2 (its first after the no_sync step).
    assert (step0, step1) == (1, 2)
    assert message0 == message1
    assert (
        "rank 0: 1, rank 1: 2" in message0
        and "no_sync() was entered on some ranks only" in message0
    )


def test_after_an_uneven_accumulation_error_every_rank_holds_the_same_earlier_averages():
    # Without a used map each bucket is written back as it lands; the reports are checked when
    # the last one has landed, before its write-back. So the error leaves the earlier buckets'
    # averages in .grad, the same on every rank, and the last bucket's parameters their local
    # gradients.
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        ddp(torch.ones(2, 8)).sum().backward()  # the buckets' layout settles
        model.zero_grad()
        if rank == 1:
            with ddp.no_sync():
                ddp(torch.ones(2, 8)).sum().backward()
        with pytest.raises(GradSyncError, match="no_sync"):
            ddp(torch.ones(2, 8) * (rank + 2)).sum().backward()
        last = set(ddp.reducer.buckets[-1].param_indices)
        return ({i: p.grad.clone() for i, p in enumerate(model.parameters()) if i not in last},
                len(ddp.reducer.buckets), len(last))

    (early0, buckets, in_last), (early1, _, _) = run_threaded(body, 2, timeout=30)
    assert (
        buckets > 1 and early0 and len(early0) + in_last == len(list(MODELS["mlp"]().parameters()))
    )
    for i, grad in early0.items():
        assert torch.equal(grad, early1[i]), i


def test_deferred_uneven_accumulation_is_raised_on_every_rank_an_iteration_or_two_later():
    # read_back="deferred" (the default on a device group): the report is read once landed.
    outcomes = run_threaded(_uneven_no_sync, 2, False, "deferred", 5, timeout=30)
    for _step, message in outcomes:
        # The uneven sync is iteration 2 (rank 0's step 1 with rank 1's step 2); its report is
        # read at the start of a later one: one iteration later, or two when not yet landed.
        assert "in iteration 2" in message and "rank 0: 1, rank 1: 2" in message
    assert outcomes[0][0] in (2, 3) and outcomes[1][0] in (3, 4)


def test_uneven_accumulation_can_be_allowed_and_then_matches_torch_ddp():
    def body(rank, group, cls):
        model = seeded(MODELS["mlp"], 0)
        ddp = cls(model, process_group=group)
        if cls is GradsyncDDP:
            ddp.set_accumulation_check(False)
        micro = 2 if rank == 0 else 1  # rank 0 accumulates two micro-batches per step
        for step in range(3):
            for j in range(micro):
                with ddp.no_sync() if j < micro - 1 else contextlib.nullcontext():
                    ddp(torch.ones(2, 8) * (step + j + rank)).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    ours = run_threaded(body, 2, GradsyncDDP)
    theirs = run_threaded(body, 2, TorchDDP)
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize(
    "move", ["cast module", "cast wrapper", "module to meta", "wrapper to meta"]
)
def test_a_module_moved_or_cast_after_wrapping_is_refused_with_the_parameter_named(move):
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group)
        ddp(torch.ones(2, 8)).sum().backward()
        try:
            target, to = (
                (model if "module" in move else ddp),
                ("meta" if "meta" in move else torch.float64),
            )
            target.to(to)
            ddp(
                torch.ones(2, 8, dtype=model.net[0].weight.dtype, device=model.net[0].weight.device)
            )
        except GradSyncError as error:
            return str(error)
        return "no error"

    for message in run_threaded(body, 2, timeout=30):
        assert (
            "parameter 'net.0.weight' was on cpu as torch.float32 when the module was wrapped"
            in message
        )
        assert "move or cast the module first, then wrap it" in message


def _powersgd_run(rank, group, steps, stop_at, path):
    """Train with PowerSGD; with `stop_at`, checkpoint there, rebuild everything, resume."""

    def build():
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        state = psgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=0.5, use_error_feedback=True, warm_start=True, random_seed=0,
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return model, ddp, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, ddp, opt = build()
    for step in range(steps):
        if step == stop_at:
            saved = {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "gradsync": ddp.gradsync_state(),
            }
            torch.save(saved, f"{path}.rank{rank}")
            del model, ddp, opt
            model, ddp, opt = build()
            saved = torch.load(f"{path}.rank{rank}", weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            ddp.load_gradsync_state(saved["gradsync"])
        opt.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        ddp(x).pow(2).mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.processes
def test_powersgd_error_feedback_is_checkpointed_and_resumes_exactly(tmp_path):
    straight = run_processes(_powersgd_run, 2, 8, -1, str(tmp_path / "a"), timeout=120)
    resumed = run_processes(_powersgd_run, 2, 8, 5, str(tmp_path / "b"), timeout=120)
    for a, b in zip(straight, resumed):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    # Without the hook's state the resumed run differs: the test can tell.
    state = torch.load(str(tmp_path / "b") + ".rank0", weights_only=False)["gradsync"]["hook_state"]
    assert state["type"] == "PowerSGDState" and state["fields"]["error_dict"]
    assert "process_group" not in state["fields"]


def test_loading_a_hook_state_without_the_hook_is_refused():
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["mlp"], 0), process_group=group)
        state = {
            "version": 2,
            "bucket_indices": [],
            "rebuilt": False,
            "iterations": 0,
            "plan": None,
            "syncs": 0,
            "hook_state": {"type": "PowerSGDState", "fields": {}},
        }
        ddp.load_gradsync_state(state)

    with pytest.raises(
        RankError, match="holds the state of a PowerSGDState hook, but no hook is registered"
    ):
        run_threaded(body, 2)


@pytest.mark.pure
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64]
)
def test_reports_are_exact_or_ask_for_the_exact_count(dtype):
    from gradsync.engine import reports as codes

    top = codes.saturation(dtype)
    for steps in [0, 1, 126, 127, 255, 256, 300, top - 1, top, top + 1, 2**40]:
        summed = torch.zeros(3, dtype=dtype)  # summed in the dtype, as the all-reduce does
        for rank, (n, missing) in enumerate([(steps, False), (steps, True), (0, False)]):
            summed += codes.encode(torch.empty(3, dtype=dtype), rank, n, missing)
        reports = codes.decode(summed.tolist(), dtype)
        expected = steps if steps < top else None  # None: every rank runs the exact all-reduce
        assert reports == [
            codes.RankReport(expected, False),
            codes.RankReport(expected, True),
            codes.RankReport(0, False),
        ], (steps, reports)
    assert (
        codes.saturation(torch.bfloat16) == 127
        and codes.saturation(torch.float32) == 2**23 - 1
    )


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_micro_step_counts_are_compared_exactly_above_255(hooked, dtype):
    # 300 against 301 forwards: the counts used to be clamped at 255, where these look equal.
    # In a bfloat16 bucket 300 does not ride exactly: every rank then asks for the exact counts.
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0).to(dtype)
        ddp = GradsyncDDP(model, process_group=group)
        if hooked:
            ddp.register_comm_hook(group, torch_hooks.allreduce_hook)
        x = torch.ones(1, 8, dtype=dtype)
        with ddp.no_sync():
            for _ in range(299):
                ddp(x).sum().backward()
        ddp(x).sum().backward()  # 300 on both: no error
        with ddp.no_sync():
            for _ in range(299 + rank):
                ddp(x).sum().backward()
        with pytest.raises(GradSyncError, match=r"rank 0: 300, rank 1: 301"):
            ddp(x).sum().backward()
        return "raised"

    assert run_threaded(body, 2, timeout=90) == ["raised", "raised"]
