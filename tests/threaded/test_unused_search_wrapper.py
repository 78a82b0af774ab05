"""The unused-parameter search through the wrapper, with torch's DDP side by side where it
answers: which search runs, a parameter used outside forward, a gradient penalty taken with
`torch.autograd.grad` before backward, and the two cases where gradsync trains and torch's DDP
raises (documented in the README's "When things go wrong")."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import RankError, run_threaded, seeded


class _Net(torch.nn.Module):
    """`extra` is a parameter forward never uses; `spare` a layer it never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)
        self.spare = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _x(rank: int, step: int = 0) -> torch.Tensor:
    return torch.linspace(-1, 1, 8).reshape(2, 4) * (rank + step + 1)


def test_the_wrapper_leaves_the_search_to_the_engine_and_mixed_precision_walks():
    # White box: which search runs is not visible in the results (they are the same).
    def body(rank, group):
        plain = GradsyncDDP(seeded(_Net, 0), process_group=group, find_unused_parameters=True)
        plain(_x(rank))
        mixed = GradsyncDDP(seeded(_Net, 0), process_group=group, find_unused_parameters=True,
                            mixed_precision=_bf16())
        mixed(_x(rank))
        return plain.reducer._it.search is not None, mixed.reducer._it.search is not None

    assert run_threaded(body, 1) == [(True, False)]


def _bf16():
    from torch.nn.parallel.distributed import _MixedPrecision

    return _MixedPrecision(param_dtype=torch.bfloat16)


@pytest.mark.parametrize("wrapper", [TorchDDP, GradsyncDDP])
def test_a_parameter_the_loss_uses_outside_forward_raises_at_its_gradient(wrapper):
    # Its gradient comes before backward reaches forward's outputs: both DDPs mark it unused,
    # then ready, and raise. One such parameter is enough (the walk once missed a single one).
    def body(rank, group):
        model = seeded(_Net, 0)
        ddp = wrapper(model, process_group=group, find_unused_parameters=True)
        (ddp(_x(rank)).sum() + model.extra.sum()).backward()

    with pytest.raises(Exception) as info:
        run_threaded(body, 2, timeout=60)
    expected = (
        "marked ready for reduction twice"
        if wrapper is GradsyncDDP
        else "mark a variable ready only once"
    )
    assert expected in str(info.value)
    if wrapper is GradsyncDDP:
        assert (
            "'extra'" in str(info.value)
            and "not reachable from forward's outputs" in str(info.value)
        )


def test_a_gradient_penalty_taken_before_backward_trains_as_one_process():
    # torch.autograd.grad runs through the outputs first (create_graph: its graph is part of
    # the loss); the search must answer for the backward that follows, not for that one.
    def body(rank, group):
        model = seeded(_Net, 0)
        ddp = GradsyncDDP(model, process_group=group, find_unused_parameters=True)
        for step in range(2):
            loss = _penalised(ddp, _x(rank, step))
            loss.backward()
            grads = {
                n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
            }
            for p in model.parameters():
                p.grad = None
        return grads

    results = run_threaded(body, 2, timeout=60)
    model = seeded(_Net, 0)
    for rank in range(2):
        _penalised(model, _x(rank, 1)).div(2).backward()
    for grads in results:
        assert grads["spare.weight"] is None and grads["extra"] is None  # unused on every rank
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[name], p.grad)


def _penalised(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.pow(2).sum() + dx.pow(2).sum()


def test_gradients_taken_for_the_parameters_before_backward_train_as_torch_ddp():
    # torch.autograd.grad over the parameters (MAML's inner step, a gradient-norm penalty)
    # accumulates no gradient, and the engine refuses to say whether it runs an accumulator
    # there: the search waits for the backward that follows (it once raised inside the grad).
    def body(rank, group, wrapper):
        model = seeded(_Net, 0)
        ddp = wrapper(model, process_group=group, find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            out = ddp(_x(rank, step)).pow(2).sum()
            used = [p for n, p in model.named_parameters() if n.startswith(("body", "head"))]
            grads = torch.autograd.grad(out, used, create_graph=True)
            (out + sum(g.pow(2).sum() for g in grads)).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ours = run_threaded(body, 2, GradsyncDDP, timeout=60)
    theirs = run_threaded(body, 2, TorchDDP, timeout=60)
    for got, want in zip(ours, theirs):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_parameter_used_before_forward_and_in_the_loss_is_reduced():
    # Its gradient comes after backward has reached the outputs: torch's DDP marks it unused
    # at the first gradient, then raises at its own (and trips an internal assert at the next
    # forward); gradsync asks the engine, which runs it, so it is reduced like any other.
    def body(rank, group):
        model = seeded(_Net, 0)
        ddp = GradsyncDDP(model, process_group=group, find_unused_parameters=True)
        grads = []
        for step in range(2):
            z = model.extra * (rank + 1)
            (ddp(_x(rank, step)).sum() + z.sum()).backward()
            grads.append(model.extra.grad.clone())
            model.extra.grad = None
        return grads

    for grads in run_threaded(body, 2, timeout=60):
        assert all(torch.equal(g, torch.full((2,), 1.5)) for g in grads)  # (1 + 2) / 2


def test_backward_with_inputs_reduces_those_and_leaves_the_rest_alone():
    # torch's DDP waits for the other parameters' gradients and raises at the next forward;
    # gradsync's search sees that this backward will not run their accumulators.
    def body(rank, group):
        model = seeded(_Net, 0)
        ddp = GradsyncDDP(model, process_group=group, find_unused_parameters=True)
        for step in range(3):
            ddp(_x(rank, step)).sum().backward(inputs=[model.head.weight, model.head.bias])
            if step < 2:
                model.zero_grad(set_to_none=True)
        return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}

    results = run_threaded(body, 2, timeout=60)
    model = seeded(_Net, 0)
    for rank in range(2):
        model(_x(rank, 2)).sum().div(2).backward(inputs=[model.head.weight, model.head.bias])
    for grads in results:
        assert [n for n, g in grads.items() if g is not None] == ["head.weight", "head.bias"]
        torch.testing.assert_close(grads["head.weight"], model.head.weight.grad)
        torch.testing.assert_close(grads["head.bias"], model.head.bias.grad)


def test_a_loss_that_does_not_come_from_the_outputs_still_raises_naming_what_is_missing():
    # No backward through the outputs' node: the search walks from it, as torch's answer is.
    def body(rank, group):
        model = seeded(_Net, 0)
        ddp = GradsyncDDP(model, process_group=group, find_unused_parameters=True)
        out = ddp(_x(rank))
        model.head.weight.sum().backward()
        del out
        ddp(_x(rank))

    with pytest.raises(RankError, match="previous one finished reducing") as info:
        run_threaded(body, 2, timeout=60)
    assert "body.weight" in str(info.value) and "head.bias" in str(info.value)
    assert "spare" not in str(info.value)  # unused: marked at the first gradient


class _TwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.spare = (
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 4),
            torch.nn.Linear(8, 8),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h), h


def test_compiled_wrapper_with_find_unused_matches_torch_ddp_compiled():
    # The sink and the search run outside the compiled graph; the accumulators the engine is
    # asked about are the ones aot_autograd's backward node feeds.
    def body(rank, group):
        results = []
        for wrapper in (TorchDDP, GradsyncDDP):
            torch._dynamo.reset()
            model = seeded(_TwoOut, 0)
            step = torch.compile(
                wrapper(model, process_group=group, find_unused_parameters=True),
                backend="aot_eager",
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(4):
                y, h = step(_x(rank, i).repeat(2, 2))
                (y.sum() if i % 2 else y.sum() + h.sum()).backward()
                opt.step()
                opt.zero_grad()
            results.append([p.detach().clone() for p in model.parameters()])
        return results

    # One rank: two rank threads compiling at once (dynamo's state is per process) once hung
    # here; tests/processes/test_compiled.py compiles with 2 ranks, in processes.
    ((torch_params, ours),) = run_threaded(body, 1, timeout=240)
    for a, b in zip(torch_params, ours):
        assert torch.equal(a, b)
