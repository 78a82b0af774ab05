"""Outputs left out of the loss, and backward passes that end with a bucket unreduced.

The pattern of the first tests is the everyday one: forward returns `(y, aux)` (auxiliary heads,
hidden states, dicts of outputs) and the loss uses `y` alone. Torch's DDP routes every output
through one autograd node so that backward still visits what is behind `aux`; gradsync does the
same. Before that, the first iteration silently left a bucket unreduced (gradients differing
between ranks) and the next forward raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import pytest
import torch
from parity import assert_records_equal
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import GradSyncError
from gradsync.testing import run_threaded, seeded


class TwoHeads(torch.nn.Module):
    """`head` feeds the loss; `dead` only an output the loss may leave out. `body` feeds both,
    so `dead` shares a bucket with parameters that do get gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.dead = torch.nn.Linear(8, 3)
        self.branch = torch.nn.Linear(8, 8)

    def forward(self, x, rank=0, step=0, container="tuple", branch="always"):
        h = torch.tanh(self.body(x))
        if branch == "rank" and rank % 2 == 1 or branch == "iter" and step % 2 == 1:
            pass  # the branch takes no part on this rank / in this step
        else:
            h = torch.tanh(self.branch(h))
        y, aux = self.head(h), self.dead(h)
        if container == "dict":
            return {"logits": y, "aux": aux}
        if container == "dataclass":
            return _Out(y, aux)
        return y, aux


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    aux: torch.Tensor


def _logits(out):
    if isinstance(out, dict):
        return out["logits"]
    return out.logits if isinstance(out, _Out) else out[0]


def _train(cls, rank, group, *, steps=3, micro_steps=1, hook=None, aux_loss="never",
           container="tuple", branch="always", **kwargs):
    model = seeded(TwoHeads, 0)
    ddp = cls(model, process_group=group, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        x = seeded(lambda s=step: torch.randn(4 * micro_steps * group.size(), 8), 100 + step)
        for j, xm in enumerate(x.chunk(group.size())[rank].chunk(micro_steps)):
            with ddp.no_sync() if j < micro_steps - 1 else contextlib.nullcontext():
                out = ddp(xm, rank, step, container, branch)
                loss = _logits(out).pow(2).mean()
                uses_aux = aux_loss == "always" or aux_loss == "rank" and rank == 0
                if uses_aux:
                    aux = (
                        out["aux"]
                        if isinstance(out, dict)
                        else out.aux
                        if isinstance(out, _Out)
                        else out[1]
                    )
                    loss = loss + aux.pow(2).mean()
                loss.backward()
        grads.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        )
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    del ddp
    return {"grads": grads, "params": params}


def _compare(world_size, torch_overrides=None, **kwargs):
    theirs_kwargs = {**kwargs, **(torch_overrides or {})}

    def body(rank, group):
        return _train(GradsyncDDP, rank, group, **kwargs), _train(
            TorchDDP, rank, group, **theirs_kwargs
        )

    results = run_threaded(body, world_size, timeout=60)
    for rank, (ours, theirs) in enumerate(results):
        assert_records_equal(ours, theirs, exact=world_size == 2, what=f"rank {rank}")
        for name, p in ours["params"].items():  # identical across ranks
            assert torch.equal(p, results[0][0]["params"][name]), f"rank {rank} {name}"
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_output_left_out_of_the_loss_matches_torch_ddp(world_size):
    # The pattern: before the fix the first iteration silently skipped the all-reduce
    # of the bucket holding `dead` (and `body`, `head`), and the second forward raised.
    results = _compare(world_size, find_unused_parameters=True)
    for ours, _ in results:
        assert ours["grads"][0]["dead.weight"] is None  # as torch leaves it: untouched
        assert ours["grads"][0]["body.weight"] is not None


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(container="dict"),
        dict(aux_loss="rank"),  # used on rank 0 only: averaged with the others' zeros
        dict(branch="rank"),
        dict(branch="iter", aux_loss="rank"),
        dict(gradient_as_bucket_view=True),
        dict(bucket_cap_mb=1e-7),  # one parameter per bucket
        dict(micro_steps=3),
        dict(hook=default_hooks.allreduce_hook),
        dict(
            hook=default_hooks.fp16_compress_hook, bucket_cap_mb=1e-7, gradient_as_bucket_view=True
        ),
    ],
    ids=lambda k: ",".join(f"{a}={getattr(b, '__name__', b)}" for a, b in k.items()),
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_output_left_out_of_the_loss_in_combination_matches_torch_ddp(kwargs, world_size):
    _compare(world_size, find_unused_parameters=True, **kwargs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_dataclass_output_left_out_trains_as_torch_does_a_dict(world_size):
    # torch routes only what pytree can flatten through its sink, so a plain dataclass output
    # with a field left out of the loss fails there at the next forward; gradsync rebuilds the
    # dataclass around the routed tensors. Compared with torch on the same outputs in a dict.
    _compare(world_size, torch_overrides=dict(container="dict"), find_unused_parameters=True,
             container="dataclass")


def test_static_graph_with_a_parameter_free_output_left_out_matches_torch_ddp():
    class FreeAux(TwoHeads):
        def forward(self, x, *args):
            y, _ = super().forward(x)
            return y, torch.tanh(self.body(x)).sum(dim=1)  # left out; no parameters of its own

    def body(rank, group):
        out = []
        for cls in (GradsyncDDP, TorchDDP):
            model = seeded(FreeAux, 0)
            model.dead.requires_grad_(False)
            ddp = cls(model, process_group=group, static_graph=True)
            for step in range(3):
                ddp(torch.full((2, 8), float(step + rank)))[0].sum().backward()
            out.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
            del ddp
        return out

    for ours, theirs in run_threaded(body, 2):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)


def test_static_graph_with_an_output_left_out_trains_where_torch_refuses():
    # torch's static_graph counts `dead` as used (its first iteration routes every output
    # through backward) and then waits for its gradient in every later iteration; gradsync
    # learns from what backward really reached, so `dead` is unused for good.
    def body(rank, group):
        model = seeded(TwoHeads, 0)
        ddp = GradsyncDDP(model, process_group=group, static_graph=True)
        for step in range(3):
            ddp(torch.full((2, 8), float(step + rank)))[0].sum().backward()
        return model.dead.weight.grad, model.body.weight.grad.clone()

    (dead0, body0), (dead1, body1) = run_threaded(body, 2)
    assert dead0 is None and dead1 is None
    assert torch.equal(body0, body1)


# ----------------------------------------------------------- a bucket left unreduced: raised


def _missing(rank, group, how):
    model = seeded(TwoHeads, 0)
    kwargs = dict(static_graph=True) if how == "static graph changed" else {}
    ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=1e-7, **kwargs)
    messages = []
    for step in range(3):
        x = torch.full((2, 8), float(step + rank))
        try:
            if how == "output left out":  # without find_unused_parameters
                ddp(x)[0].sum().backward()
            elif how == "skipped on one rank":
                y, aux = ddp(x, rank, step, "tuple", "rank")  # branch: rank 0 only
                (y.sum() + aux.sum()).backward()
            elif how == "static graph changed":
                y, aux = ddp(x, rank, step, "tuple", "iter" if step else "always")
                (y.sum() + aux.sum()).backward()
            elif how == "backward(inputs=...)":
                y, aux = ddp(x)
                (y.sum() + aux.sum()).backward(inputs=[model.head.weight, model.head.bias])
            messages.append("no error")
        except GradSyncError as error:
            messages.append(str(error))
        for p in model.parameters():
            p.grad = None
    return messages


@pytest.mark.parametrize(
    "how,steps_with_error,names,per_rank",
    [
        ("output left out", [0, 1, 2], "dead.weight, dead.bias", {0, 1}),
        ("skipped on one rank", [0, 1, 2], "branch.weight, branch.bias", {1}),
        ("static graph changed", [1], "branch.weight, branch.bias", {0, 1}),
        ("backward(inputs=...)", [0, 1, 2], "body.weight", {0, 1}),
    ],
)
def test_backward_ending_with_gradients_missing_raises_at_its_end_on_every_rank(
    how, steps_with_error, names, per_rank
):
    results = run_threaded(_missing, 2, how, timeout=60)
    for rank, messages in enumerate(results):
        for step, message in enumerate(messages):
            if step not in steps_with_error:
                assert message == "no error", f"rank {rank} step {step}: {message}"
                continue
            assert f"backward ended in iteration {step + 1}" in message, message
            assert "bucket(s)" in message and names in message
            for r in (0, 1):
                assert (f"rank {r}: bucket(s)" in message) == (r in per_rank), message
            assert "Fixes:" in message
            if how == "static graph changed":
                assert "static_graph=True" in message
    same = [[re.sub(r"this is rank \d", "", m) for m in messages] for messages in results]
    assert same[0] == same[1]  # every rank says the same


def test_missing_gradients_with_a_comm_hook_raise_on_every_rank():
    def body(rank, group):
        model = seeded(TwoHeads, 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=1e-7)
        ddp.register_comm_hook(group, default_hooks.allreduce_hook)
        with pytest.raises(
            GradSyncError, match=r"rank 1: bucket\(s\) [\d, ]+: branch\.weight, branch\.bias"
        ):
            y, aux = ddp(torch.ones(2, 8), rank, 0, "tuple", "rank")
            (y.sum() + aux.sum()).backward()
        return "raised"

    assert run_threaded(body, 2, timeout=60) == ["raised", "raised"]


def test_autograd_grad_through_the_outputs_is_not_the_end_of_the_iteration():
    # A gradient penalty takes torch.autograd.grad through the outputs before backward: no
    # parameter gradient is accumulated there, so it must not end (or fail) the iteration.
    def body(rank, group):
        out = []
        for cls in (GradsyncDDP, TorchDDP):
            model = seeded(TwoHeads, 0)
            ddp = cls(model, process_group=group, find_unused_parameters=True)
            x = torch.full((2, 8), float(rank + 1), requires_grad=True)
            y, aux = ddp(x)
            (gx,) = torch.autograd.grad((y.sum() + aux.sum()), x, create_graph=True)
            (y.pow(2).mean() + aux.pow(2).mean() + gx.pow(2).sum()).backward()
            out.append([p.grad.clone() for p in model.parameters()])
            del ddp
        return out

    for ours, theirs in run_threaded(body, 2):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
