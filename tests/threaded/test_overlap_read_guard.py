"""GRADSYNC_DEBUG=DETAIL with `overlap_optimizer`: a torch function given a parameter whose
bucket is still landing between `step()` and the next forward raises, naming it
(`overlap._ReadGuard`); `opt.wait()` fixes it; gradsync's own reads pass; the guard never
stays on torch's function-mode stack, and without DETAIL nothing is pushed at all.

The buckets are made to land late deterministically by a group whose all-reduces complete only
when waited for (`_Held`): after backward every bucket is still landing."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from held import Held as _Held
from held import layers as _layers
from torch.overrides import BaseTorchFunctionMode

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import run_threaded, seeded

TIMEOUT = 60


@contextlib.contextmanager
def _detail(on):
    """DETAIL logging on or off through the `gradsync` logger's level (as GRADSYNC_DEBUG sets
    it), restored after: the logger is shared by the rank threads."""
    logger = logging.getLogger("gradsync")
    level = logger.level
    logger.setLevel(logging.DEBUG if on else logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _overlapped(group, optimizer=torch.optim.SGD, **kwargs):
    model = seeded(_layers, 0)
    ddp = GradsyncDDP(model, process_group=_Held(group), bucket_cap_mb=1e-7)  # one per tensor
    return model, ddp, ddp.overlap_optimizer(optimizer(model.parameters(), lr=0.1), **kwargs)


def _run(body, detail):
    with _detail(detail):
        return run_threaded(body, 2, timeout=TIMEOUT)


def _depth():
    return torch._C._len_torch_function_stack()


def _stack():
    return [torch._C._get_function_stack_at(i) for i in range(_depth())]


def _step(ddp, opt, generator=None):
    ddp(torch.randn(4, 8, generator=generator)).sum().backward()
    opt.step()


def test_a_read_of_a_parameter_still_landing_raises_naming_it():
    def body(rank, group):
        model, ddp, opt = _overlapped(group)
        ema = {n: p.detach().clone() for n, p in model.named_parameters()}
        _step(ddp, opt)
        assert ddp.reducer.phase.value == "landing"  # every bucket still landing
        errors = []
        for read in (lambda: model[0].weight.norm(),  # a logged norm
                     lambda: ema["3.bias"].mul_(0.9).add_(model[3].bias, alpha=0.1),  # an EMA
                     lambda: torch.stack([model[1].bias, model[2].bias])):  # inside a list
            with pytest.raises(RuntimeError) as caught:
                read()
            errors.append(str(caught.value))
        return errors

    for errors in _run(body, detail=True):
        norm, ema, stacked = errors
        assert "torch.Tensor.norm was given the parameters 0.weight, still being updated by " \
               "the overlapped step" in norm
        assert "Call opt.wait() before reading parameters or gradients" in norm
        assert "wrapper's own forward, its state_dict() and opt.wait() wait" in norm
        assert "torch.Tensor.add_ was given the parameters 3.bias," in ema
        assert "the parameters 1.bias, 2.bias," in stacked


@pytest.mark.parametrize("detail", [False, True], ids=["off", "DETAIL"])
def test_a_read_of_a_gradient_still_landing_lands_its_bucket_first(detail):
    # `.grad` of a bucket still landing lands it when a torch function is given it (not for
    # its shape or dtype): a logged norm reads the average (and the bucket is stepped, after
    # step()), not this rank's own gradient; the other buckets go on landing.
    def body(rank, group):
        model, ddp, opt = _overlapped(group, chunk_mb=1e-7)  # a chunk a tensor
        g = torch.Generator().manual_seed(rank)
        _step(ddp, opt, g)
        opt.wait()  # the buckets rebuilt in ready order
        _step(ddp, opt, g)
        grad = model[1].weight.grad
        assert (grad.shape, grad.dtype, grad.is_sparse) == ((8, 8), torch.float32, False)
        assert len(opt._pending) == len(ddp.reducer.buckets)  # metadata: nothing landed
        norm = grad.norm()
        landed = sorted(set(range(len(ddp.reducer.buckets))) - set(opt._pending))
        weight = model[1].weight.detach().clone()
        opt.wait()
        return norm, landed, len(ddp.reducer.buckets), weight, model[1].weight.detach().clone()

    (norm0, landed, buckets, w0, after0), (norm1, _, _, w1, _) = _run(body, detail)
    assert torch.equal(norm0, norm1)  # the average's norm, alike on both ranks
    assert len(landed) == 1 and buckets > 1  # only the bucket read
    assert torch.equal(w0, w1) and torch.equal(w0, after0)  # already stepped as it landed


def test_after_wait_the_read_works_and_the_mode_stack_is_as_it_was():
    def body(rank, group):
        model, ddp, opt = _overlapped(group)
        before, unstepped = _depth(), model[0].weight.norm().item()
        _step(ddp, opt)
        pushed = _depth()
        with pytest.raises(RuntimeError, match="parameters 0.weight, still being updated"):
            model[0].weight.norm()
        opt.wait()
        return before, pushed, _depth(), unstepped, model[0].weight.norm().item()

    for before, pushed, after, unstepped, stepped in _run(body, detail=True):
        assert (pushed, after) == (before + 1, before)
        assert stepped != unstepped  # the read after opt.wait() sees the stepped value


@pytest.mark.parametrize("lands", ["forward", "state_dict", "no_sync", "zero_grad",
                                   "zero_in_place"])
def test_what_gradsync_reads_itself_passes_and_takes_the_guard_off(lands):
    """The wrapper's forward lands each bucket where it uses it; its state_dict() and no_sync()
    land them all; zero_grad() (the optimizer's and the module's, also zeroing in place)
    passes and leaves the guard on, until the buckets land, which zero them again."""
    def body(rank, group):
        model, ddp, opt = _overlapped(group)
        before = _depth()
        _step(ddp, opt)
        if lands == "forward":
            ddp(torch.randn(4, 8))
        elif lands == "state_dict":
            ddp.state_dict()
        elif lands == "no_sync":
            with ddp.no_sync():
                pass
        else:
            if lands == "zero_in_place":
                model.zero_grad(set_to_none=False)
            else:
                opt.zero_grad()
                model.zero_grad()
            still = _depth()
            opt.wait()
            assert all(p.grad is None or not p.grad.any() for p in model.parameters())
            return before, still, _depth()
        return before, before, _depth()

    for before, still, after in _run(body, detail=True):
        assert (still, after) == (before + lands.startswith("zero"), before)


def test_under_a_mode_of_the_users_the_guard_waits_inert_and_is_never_pushed_twice():
    def body(rank, group):
        model, ddp, opt = _overlapped(group)
        _step(ddp, opt)
        depths = []
        with BaseTorchFunctionMode():  # the user's own mode, above the guard
            opt.wait()  # landed: the guard is inert but not on top, so it stays
            depths.append(_depth())
            model[0].weight.norm()  # passes: nothing is landing
            _step(ddp, opt)  # armed again, not pushed again
            depths.append(_depth())
            with pytest.raises(RuntimeError, match="parameters 0.weight, still being updated"):
                model[0].weight.norm()  # through the user's mode down to the guard
        depths.append(_depth())
        opt.wait()  # on top again: popped
        depths.append(_depth())
        return depths

    assert _run(body, detail=True) == [[2, 2, 1, 0]] * 2


def test_a_step_inside_a_block_of_the_users_mode_leaves_that_block_its_own_exit():
    """A mode exits by popping the top of the stack: the guard, pushed by a step() inside the
    user's `with` block, goes under the user's mode, so the block's exit pops the user's mode."""
    def body(rank, group):
        model, ddp, opt = _overlapped(group)
        mode = BaseTorchFunctionMode()
        with mode:
            _step(ddp, opt)
            inside = [type(m).__name__ for m in _stack()]
        after_block = _stack()
        with pytest.raises(RuntimeError, match="parameters 0.weight, still being updated"):
            model[0].weight.norm()  # the guard stayed, armed
        opt.wait()
        return inside, mode not in after_block, len(after_block), _depth()

    for inside, user_gone, after_block, after_wait in _run(body, detail=True):
        assert inside == ["_ReadGuard", "BaseTorchFunctionMode"]
        assert (user_gone, after_block, after_wait) == (True, 1, 0)


def test_without_detail_nothing_is_pushed_and_a_read_is_not_checked():
    def body(rank, group):
        model, ddp, opt = _overlapped(group)
        before = _depth()
        ddp(torch.randn(4, 8)).sum().backward()
        after_backward = _depth()
        opt.step()
        landing = ddp.reducer.phase.value
        model[0].weight.norm()  # the value from before the step: not caught without DETAIL
        after_step = _depth()
        opt.wait()
        return before, after_backward, after_step, landing, opt._guard is None

    for before, after_backward, after_step, landing, none in _run(body, detail=False):
        assert (after_backward, after_step) == (before, before)
        assert landing == "landing" and none


def _train(rank, group, held, steps=4):
    model = seeded(_layers, 0)
    ddp = GradsyncDDP(model, process_group=_Held(group) if held else group, bucket_cap_mb=1e-7)
    opt = ddp.overlap_optimizer(torch.optim.Adam(model.parameters(), lr=0.1), tail_mb=0)
    inputs = torch.Generator().manual_seed(rank)  # the same batches either way
    depths, stepped = [], []
    for _ in range(steps):
        loss = ddp(torch.randn(4, 8, generator=inputs)).sum()
        depths.append(_depth())  # the forward landed every bucket: the guard came off
        loss.backward()
        opt.step()
        opt.zero_grad()
        stepped.append(_depth())
    opt.wait()
    depths.append(_depth())
    return [p.detach().clone() for p in model.parameters()], depths, stepped


@pytest.mark.parametrize("held", [True, False], ids=["held", "gloo"])
def test_training_under_detail_without_reads_is_unchanged_and_leaves_the_stack_empty(held):
    plain = _run(lambda rank, group: _train(rank, group, held), detail=False)
    detail = _run(lambda rank, group: _train(rank, group, held), detail=True)
    for (want, plain_depths, plain_stepped), (params, depths, stepped) in zip(plain, detail):
        assert all(torch.equal(a, b) for a, b in zip(params, want))
        assert plain_depths == depths == [0] * 5
        assert plain_stepped == [0] * 4
        if held:  # every bucket still landing after each step(): the guard on until the forward
            assert stepped == [1] * 4
