"""A parameter's `requires_grad` changed after wrapping, as fine-tuning schedules, progressive
unfreezing and GAN training do, against torch's DDP on the same gloo groups: where torch's DDP
trains, gradsync trains to the same parameters bit for bit; where torch's DDP raises, gradsync
raises at the same step or earlier, naming the parameter that was frozen."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import RankError, run_threaded, seeded

STEPS = 4
PHASES = ("forward", "backward", "step")


class _Net(nn.Module):
    """`spare` takes part only when `spare_used`: with find_unused_parameters there is always
    a trainable parameter unused besides the frozen one (the crash this file was written for)."""

    def __init__(self, spare_used: bool) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.spare = nn.Linear(4, 4)
        self.spare_used = spare_used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if self.spare_used:
            h = h + self.spare(h)
        return self.head(torch.tanh(self.mid(h)))


# When requires_grad changes (before the forward of the step given), and on what.
CHANGES = {
    "weight_off": [(1, "body.weight", False)],
    "weight_off_on": [(1, "body.weight", False), (3, "body.weight", True)],
    "layer_off": [(2, "mid", False)],
    "off_before_first_forward": [(0, "mid", False)],
}
CONFIGS = {
    "find_unused": dict(find_unused_parameters=True),
    "find_unused_view": dict(find_unused_parameters=True, gradient_as_bucket_view=True),
    "find_unused_static": dict(find_unused_parameters=True, static_graph=True),
    "static": dict(static_graph=True),
    "plain": dict(),
    "plain_view": dict(gradient_as_bucket_view=True),
    "find_unused_walk": dict(find_unused_parameters=True, mixed=True),  # the graph walk
    "find_unused_zero": dict(find_unused_parameters=True, zero=True),
    "plain_zero": dict(zero=True),
}


def _change(model: nn.Module, what: str, on: bool) -> None:
    target = model.get_parameter(what) if "." in what else model.get_submodule(what)
    target.requires_grad_(on)


def _train(rank: int, group, wrapper: type, changes: list, config: dict) -> list[torch.Tensor]:
    config = dict(config)
    mixed, zero = config.pop("mixed", False), config.pop("zero", False)
    model = seeded(lambda: _Net(spare_used=not config.get("find_unused_parameters")), 0).double()
    if mixed and wrapper is GradsyncDDP:
        # Mixed precision makes gradsync's search walk the graph. On a float64 model, float64 as
        # the "low" precision changes no value, so torch's DDP without it (its mixed precision
        # needs CUDA events) is the reference.
        from torch.nn.parallel.distributed import _MixedPrecision

        config["mixed_precision"] = _MixedPrecision(
            param_dtype=torch.float64, reduce_dtype=torch.float64
        )
    ddp = wrapper(model, process_group=group, **config)
    params = list(model.parameters())
    opt: torch.optim.Optimizer
    if zero and wrapper is GradsyncDDP:  # ZeRO-2 on gradsync's side, the plain optimizer on torch's
        opt = gradsync.ZeroRedundancyOptimizer(
            params, torch.optim.SGD, process_group=group, lr=0.1, momentum=0.9
        )
    else:
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for at, what, on in changes:
            if at == step:
                _change(model, what, on)
        x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4) * (rank + step + 1)
        phase = "forward"
        try:
            out = ddp(x)
            phase = "backward"
            out.pow(2).sum().backward()
            phase = "step"
            opt.step()
            opt.zero_grad()
        except Exception as error:
            raise RuntimeError(f"[step {step} {phase}] {error}") from error
    return [p.detach().clone() for p in model.parameters()]


def _outcome(wrapper: type, changes: list, config: dict):
    """(parameters by rank, None) if training went through, else (None, (step, phase, message))."""
    try:
        return run_threaded(_train, 2, wrapper, changes, config, timeout=30), None
    except RankError as error:
        found = re.search(r"\[step (\d+) (\w+)\]", str(error))
        assert found, f"an error outside the training loop: {error}"
        return None, (int(found[1]), PHASES.index(found[2]), str(error))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_requires_grad_changed_after_wrapping_trains_or_raises_as_torch_ddp(change, config):
    torch_config = {k: v for k, v in CONFIGS[config].items() if k != "zero"}
    theirs, torch_raised = _outcome(TorchDDP, CHANGES[change], torch_config)
    ours, we_raised = _outcome(GradsyncDDP, CHANGES[change], CONFIGS[config])
    if torch_raised is None:
        assert we_raised is None, f"torch's DDP trains, gradsync raised: {we_raised}"
        for rank, (a, b) in enumerate(zip(ours, theirs)):
            for i, (p, q) in enumerate(zip(a, b)):
                assert torch.equal(p, q), f"rank {rank} parameter {i} differs from torch's DDP"
        return
    assert we_raised is not None, f"torch's DDP raised, gradsync trained: {torch_raised[2][:300]}"
    assert we_raised[:2] <= torch_raised[:2], (
        f"gradsync raised later ({we_raised[:2]}) than torch ({torch_raised[:2]})"
    )
    frozen = "body.weight" if change.startswith("weight") else "mid.weight"
    assert f"{frozen}" in we_raised[2] and "requires_grad=False now" in we_raised[2], we_raised[2]


def test_the_matrix_has_both_outcomes():
    # Not a vacuous comparison: torch's DDP trains in some cells and raises in others.
    _, raised = _outcome(TorchDDP, CHANGES["weight_off"], CONFIGS["plain"])
    trained, _ = _outcome(TorchDDP, CHANGES["weight_off"], CONFIGS["find_unused"])
    assert raised is not None and trained is not None


def test_the_frozen_parameter_is_named_with_the_fix_before_and_after():
    # Without find_unused_parameters: torch's DDP raises at the next forward ("Expected to have
    # finished reduction..."); gradsync at the end of this backward, naming what was frozen.
    _, raised = _outcome(GradsyncDDP, CHANGES["weight_off"], CONFIGS["plain"])
    assert raised is not None and raised[:2] == (1, PHASES.index("backward"))
    message = raised[2]
    assert (
        "body.weight had requires_grad=True when the "
        "wrapper was built and has requires_grad=False now"
    ) in message
    assert "Pass find_unused_parameters=True" in message and "build the wrapper again" in message
    _, raised = _outcome(GradsyncDDP, CHANGES["weight_off"], CONFIGS["static"])
    assert raised is not None and "static_graph=True needs the same parameters trained" in raised[2]


def test_a_parameter_frozen_when_wrapped_and_unfrozen_later_warns_that_it_is_not_synchronised():
    # torch's DDP leaves it out at construction and then lets each rank train it apart, silently.
    def body(rank, group, unfreeze):
        model = seeded(lambda: _Net(spare_used=True), 0)
        model.body.weight.requires_grad_(False)
        ddp = GradsyncDDP(model, process_group=group)
        assert not model.body.weight.requires_grad  # the wrapper leaves the flag as it was
        model.body.weight.requires_grad_(unfreeze)
        for _ in range(3):
            ddp(torch.ones(3, 4) * (rank + 1)).sum().backward()
        return model.body.weight.grad

    def warned(unfreeze):
        # Warnings are caught for the whole process (not per thread): here, around both ranks.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads = run_threaded(body, 2, unfreeze, timeout=30)
        told = [
            str(w.message)
            for w in caught
            if "did not require grad when the wrapper was built" in str(w.message)
        ]
        return told, grads

    told, grads = warned(unfreeze=False)
    assert told == [] and grads == [None, None]
    told, grads = warned(unfreeze=True)
    assert len(told) == 2 and all("'body.weight'" in t for t in told)  # once per rank, not per step
    assert not torch.equal(grads[0], grads[1])  # rank-local, as in torch's DDP


def test_an_excluded_parameter_does_not_warn():
    def body(rank, group):
        model = seeded(lambda: _Net(spare_used=True), 0)
        model.body.weight.requires_grad_(False)
        gradsync.exclude_from_sync(model, ["body.weight"])
        ddp = GradsyncDDP(model, process_group=group)
        model.body.weight.requires_grad_(True)
        ddp(torch.ones(3, 4)).sum().backward()
        return model.body.weight.grad is not None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_threaded(body, 2, timeout=30) == [True, True]
    assert not [w for w in caught if "gradsync" in str(w.message)]
