"""`DistributedDataParallel.overlap_optimizer`: each bucket stepped as its averages land, against
torch's DDP with the same optimizer stepped after backward, side by side on the same gloo
groups: parameters and optimizer state equal bit for bit at 2 ranks; and what it refuses."""

from __future__ import annotations

import contextlib
import datetime
import io
import time

import pytest
import torch
from held import Held as _Held
from held import layers as _layers
from models import MODELS, make_batches
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import RankError, run_threaded, seeded

STEPS = 4

OPTIMIZERS = {
    "sgd": lambda ps, **impl: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01,
                                               **impl),
    "adam": lambda ps, **impl: torch.optim.Adam(ps, lr=0.01, **impl),
    "adamw": lambda ps, **impl: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, **impl),
    "rmsprop": lambda ps, **impl: torch.optim.RMSprop(ps, lr=0.01, **impl),
    "adagrad": lambda ps, **impl: torch.optim.Adagrad(ps, lr=0.05, **impl),
}
# The rest of torch's optimizers that step each parameter from its own gradient and state,
# and variants of the ones above (fused: `test_fused_optimizers_...`).
OTHER_OPTIMIZERS = {
    "adadelta": lambda ps, **impl: torch.optim.Adadelta(ps, lr=0.5, **impl),
    "adafactor": lambda ps, **impl: torch.optim.Adafactor(ps, lr=0.01, **impl),
    "adamax": lambda ps, **impl: torch.optim.Adamax(ps, lr=0.01, **impl),
    "asgd": lambda ps, **impl: torch.optim.ASGD(ps, lr=0.01, **impl),
    "nadam": lambda ps, **impl: torch.optim.NAdam(ps, lr=0.01, **impl),
    "radam": lambda ps, **impl: torch.optim.RAdam(ps, lr=0.01, **impl),
    "rprop": lambda ps, **impl: torch.optim.Rprop(ps, lr=0.01, **impl),
    "adam amsgrad": lambda ps, **impl: torch.optim.Adam(ps, lr=0.01, amsgrad=True,
                                                         **impl),
    "sgd nesterov": lambda ps, **impl: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                        nesterov=True, **impl),
}
EVERY_OPTIMIZER = {**OPTIMIZERS, **OTHER_OPTIMIZERS}


def _impl(foreach):
    """The implementation keyword: foreach on, off or torch's choice (None), or "fused"."""
    return {"fused": True} if foreach == "fused" else {"foreach": foreach}


def _train(wrapper, rank, group, model_name, batches, optimizer, foreach=None, micro_steps=1,
           schedule=False, checkpoint=None, tail_mb=None, chunk_mb=None, credit_mb=None,
           **kwargs):
    """Train; return the parameters and the optimizer's state dict."""
    model = seeded(MODELS[model_name], 0)
    ddp = wrapper(model, process_group=group, **kwargs)
    opt = EVERY_OPTIMIZER[optimizer](model.parameters(), **_impl(foreach))
    if wrapper is GradsyncDDP:
        opt = ddp.overlap_optimizer(opt, tail_mb=tail_mb, chunk_mb=chunk_mb,
                                        credit_mb=credit_mb)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
    for i, batch in enumerate(batches):
        if checkpoint is not None and i == checkpoint:  # a new optimizer, from the state dict
            saved = io.BytesIO()
            torch.save(opt.state_dict(), saved)
            del opt  # the wrapper's buckets are stepped by one optimizer at a time
            opt = EVERY_OPTIMIZER[optimizer](model.parameters(), **_impl(foreach))
            if wrapper is GradsyncDDP:
                opt = ddp.overlap_optimizer(opt, tail_mb=tail_mb, chunk_mb=chunk_mb,
                                        credit_mb=credit_mb)
            saved.seek(0)
            opt.load_state_dict(torch.load(saved))
        shard = batch.chunk(group.size())[rank]
        for m, x in enumerate(shard.chunk(micro_steps)):
            last = m == micro_steps - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    if wrapper is GradsyncDDP:
        opt.wait()  # the last buckets land in the next forward, or here
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, opt.state_dict()


def _both(rank, group, *args, **kwargs):
    return (_train(GradsyncDDP, rank, group, *args, **kwargs),
            _train(TorchDDP, rank, group, *args, **kwargs))


def _assert_same(ours, theirs, what):
    (params, state), (want_params, want_state) = ours, theirs
    for name, p in params.items():
        assert torch.equal(p, want_params[name]), f"{what}: parameter {name} differs"
    assert state["param_groups"] == want_state["param_groups"], f"{what}: param_groups differ"
    assert state["state"].keys() == want_state["state"].keys(), f"{what}: stepped sets differ"
    for index, entries in state["state"].items():
        for key, value in entries.items():
            other = want_state["state"][index][key]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            assert same, f"{what}: state[{index}][{key!r}] differs"


def _check(model_name, optimizer, per_rank=4, **kwargs):
    batches = make_batches(STEPS, 2, per_rank=per_rank)
    results = run_threaded(_both, 2, model_name, batches, optimizer, timeout=120, **kwargs)
    for rank, (ours, theirs) in enumerate(results):
        _assert_same(ours, theirs, f"rank {rank}")
    return results


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_each_bucket_stepped_as_it_lands_equals_torch_ddp_and_the_same_optimizer(optimizer,
                                                                               foreach):
    _check("mlp", optimizer, foreach=foreach, bucket_cap_mb=0.0005)


# torch's fused kernels (one kernel over a group, on the CPU too: AdamW about five times
# faster than the per-tensor loop on one core), for the four of the above that have them
@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "adamw", "sgd"])
def test_fused_optimizers_equal_torch_ddp_and_the_same_optimizer(optimizer):
    _check("mlp", optimizer, foreach="fused", bucket_cap_mb=0.0005)


@pytest.mark.parametrize("optimizer", sorted(OTHER_OPTIMIZERS))
def test_every_other_torch_optimizer_that_steps_per_parameter_equals_torch_ddp(optimizer):
    _check("mlp", optimizer, foreach=None, bucket_cap_mb=0.0005)


@pytest.mark.parametrize("config", [
    {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005},
    {"static_graph": True, "bucket_cap_mb": 0.0005},
    {"micro_steps": 2},  # no_sync accumulation: stepped on synchronised iterations only
    {"schedule": True},  # an LR scheduler on the overlapped optimizer
    {"checkpoint": 2},  # state dict saved, loaded into a new optimizer
])
def test_configurations_equal_torch_ddp(config):
    _check("many_small", "adamw", per_rank=4, foreach=True, **config)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_complex_and_double_parameters_equal_torch_ddp(optimizer):
    _check("complex", optimizer, foreach=None, bucket_cap_mb=0.0005)


@pytest.mark.parametrize("as_view", [False, True])
def test_a_parameter_unused_on_every_rank_is_skipped_as_the_plain_optimizer_skips_it(as_view):
    results = _check("unused_branch", "adam", find_unused_parameters=True,
                     gradient_as_bucket_view=as_view)
    (params, state), _ = results[0]
    assert len(state["state"]) < len(params)  # the unused branch was never stepped


def test_a_checkpoint_of_the_overlapped_optimizer_loads_into_the_plain_one_and_back():
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.0005)
        opt = ddp.overlap_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        plain = torch.optim.Adam(model.parameters(), lr=0.01)
        plain.load_state_dict(opt.state_dict())
        return plain.state_dict(), opt.state_dict()

    for plain, overlapped in run_threaded(body, 2, timeout=60):
        assert plain["param_groups"] == overlapped["param_groups"]
        for index, entries in overlapped["state"].items():
            for key, value in entries.items():
                assert torch.equal(plain["state"][index][key], value)


def test_add_param_group_steps_the_new_group():
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        extra = torch.nn.Parameter(torch.ones(3))
        ddp = GradsyncDDP(model, process_group=group)
        params = list(model.parameters())
        opt = ddp.overlap_optimizer(torch.optim.SGD(params[:2], lr=0.1))
        opt.add_param_group({"params": params[2:], "lr": 0.2})
        opt.add_param_group({"params": [extra], "lr": 1.0})  # outside the wrapper
        before = [p.detach().clone() for p in params]
        ddp(torch.randn(4, 8)).sum().backward()
        extra.grad = torch.ones(3)
        opt.step()
        opt.wait()
        return [not torch.equal(a, p) for a, p in zip(before, params)], extra.tolist()

    for moved, extra in run_threaded(body, 2, timeout=60):
        assert all(moved) and extra == [0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------- refusals


def _overlapped_mlp(group):
    model = seeded(MODELS["mlp"], 0)
    ddp = GradsyncDDP(model, process_group=group)
    return model, ddp, ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def _mlp_side(wrapper, group, optimizer, **kwargs):
    """The mlp wrapped by `wrapper`, and `optimizer` over it: overlapped under gradsync's,
    stepped after backward under torch's DDP (the side to compare with)."""
    model = seeded(MODELS["mlp"], 0)
    ddp = wrapper(model, process_group=group, **kwargs)
    opt = optimizer(model.parameters())
    return model, ddp, ddp.overlap_optimizer(opt) if wrapper is GradsyncDDP else opt


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


def _side_by_side(body):
    """(gradsync's, torch's) results of `body(rank, group, wrapper)`, rank by rank."""
    return zip(run_threaded(body, 2, GradsyncDDP, timeout=60),
               run_threaded(body, 2, TorchDDP, timeout=60))


def _refused(body, match):
    with pytest.raises(RankError, match=match):
        run_threaded(body, 2, timeout=60)


def _params(model, opt):
    """`model`'s parameters once every bucket has landed (gradsync's) or as they are (torch's)."""
    getattr(opt, "wait", lambda: None)()
    return [p.detach().clone() for p in model.parameters()]


def _late(group, wrapper):
    """gradsync's buckets all landing late (`_Held`); torch's DDP on the group itself."""
    return _Held(group) if wrapper is GradsyncDDP else group


def _assert_equal_sides(body):
    for got, want in _side_by_side(body):
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def _equal_sides_between(between, late=True, **kwargs):
    """The mlp trained three steps under gradsync's (AdamW overlapped, its buckets all landing
    late if `late`) and under torch's DDP, `between(ddp, opt, i, batch)` called between each
    backward and its step: the same parameters, bit for bit."""
    def body(rank, group, wrapper):
        model, ddp, opt = _mlp_side(wrapper, _late(group, wrapper) if late else group, _adamw,
                                    bucket_cap_mb=1e-7, **kwargs)
        g = torch.Generator().manual_seed(rank)
        for i in range(3):
            ddp(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
            between(ddp, opt, i, lambda: torch.randn(4, 8, generator=g))
            opt.step()
            opt.zero_grad()
        return _params(model, opt)

    _assert_equal_sides(body)


@pytest.mark.parametrize("late", [True, False], ids=["landing late", "landing as it can"])
@pytest.mark.parametrize("second", ["synchronised", "no_sync"])
def test_backwards_accumulated_after_a_synchronised_one_before_one_step_equal_torch_ddp(
        second, late):
    # Two backwards, then one step. Both synchronised (a loss over two views, each its own
    # forward; accumulation without no_sync): .grad holds the sum of the two averages. The
    # second under no_sync: the first's averages plus this rank's own. step() steps it once,
    # as torch's DDP and the plain optimizer do.
    def another_backward(ddp, opt, i, batch):
        with ddp.no_sync() if second == "no_sync" else contextlib.nullcontext():
            ddp(batch()).pow(2).sum().backward()

    _equal_sides_between(another_backward, late)


def test_a_gan_whose_generator_backward_reduces_the_discriminator_again_equals_torch_ddp():
    # pytorch/examples' DCGAN loop, both nets wrapped and both optimizers overlapped: D's
    # backwards on real and on fake data, then one D step; G's backward runs through D, so
    # D's gradients are reduced once more, never stepped, and cleared by D's zero_grad.
    def body(rank, group, wrapper):
        nets = [seeded(lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                                   torch.nn.Linear(8, 8)), 0),
                seeded(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LeakyReLU(0.2),
                                                   torch.nn.Linear(8, 1)), 1)]
        gen, dis = (wrapper(net, process_group=group, bucket_cap_mb=1e-7) for net in nets)
        opt_g, opt_d = (torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.5, 0.999))
                        for net in nets)
        if wrapper is GradsyncDDP:
            opt_g, opt_d = gen.overlap_optimizer(opt_g), dis.overlap_optimizer(opt_d)
        bce, g = torch.nn.BCEWithLogitsLoss(), torch.Generator().manual_seed(rank)
        real_label, fake_label = torch.ones(6, 1), torch.zeros(6, 1)
        for _ in range(3):
            real, noise = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            opt_d.zero_grad()
            bce(dis(real), real_label).backward()
            fake = gen(noise)
            bce(dis(fake.detach()), fake_label).backward()
            opt_d.step()
            opt_g.zero_grad()
            bce(dis(fake), real_label).backward()
            opt_g.step()
        return _params(nets[0], opt_g) + _params(nets[1], opt_d)

    _assert_equal_sides(body)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_backward_and_step_drops_the_gradients_as_torch_ddp(set_to_none):
    # A step skipped by clearing its gradients (a loss that was not finite): every bucket
    # lands first and is cleared. With set_to_none=False the plain optimizer then steps
    # zeros (AdamW's momentum and weight decay still move the parameters), as here.
    def skip_the_second(ddp, opt, i, batch):
        if i == 1:
            opt.zero_grad(set_to_none)

    _equal_sides_between(skip_the_second)


def test_a_second_step_after_one_backward_steps_the_same_gradients_again_as_torch():
    def body(rank, group, wrapper):
        model, ddp, opt = _mlp_side(wrapper, group, _adamw)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            ddp(x).pow(2).sum().backward()
            opt.step()
            opt.step()  # every parameter again, from the same gradients
            opt.zero_grad()
        getattr(opt, "wait", lambda: None)()
        return [p.detach().clone() for p in model.parameters()]

    for got, want in _side_by_side(body):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("how", ["landing late", "landing as it can", "wait, landing late",
                                 "find_unused_parameters"])
def test_clipping_by_the_global_norm_equals_torch_ddp(how):
    # The norm reads every gradient: each bucket still landing lands first (`_LandsOnRead`),
    # with or without opt.wait(), so the norm is the averages' and step() steps the clipped
    # gradients. With find_unused_parameters (or static_graph, a comm hook) buckets never
    # land after backward.
    def clip(ddp, opt, i, batch):
        if how.startswith("wait"):
            getattr(opt, "wait", lambda: None)()
        torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), 0.5)

    _equal_sides_between(clip, late=how != "landing as it can",
                         find_unused_parameters=how == "find_unused_parameters")


@pytest.mark.parametrize("how", ["a gradient scaled in place", "a gradient replaced",
                                 "a gradient set to None"])
def test_a_gradient_changed_between_backward_and_step_is_stepped_from_as_torch(how):
    # One gradient of a bucket still landing: changed in place (its bucket lands first), or
    # replaced without reading it (stepped by step() from the replacement, its bucket's
    # average landing beside it), on every rank alike, landed or not.
    def change(ddp, opt, i, batch):
        weight = ddp.module.net[2].weight
        if how == "a gradient scaled in place":
            weight.grad.mul_(0.25)
        else:
            weight.grad = None if how.endswith("None") else torch.full_like(weight, 0.01 * i)

    _equal_sides_between(change)


@pytest.mark.parametrize("wait", [False, True], ids=["without wait", "after wait"])
def test_a_grad_scaler_skips_a_step_with_an_inf_anywhere_as_torch_ddp(wait):
    # Rank 0's second loss is infinite: its average is too, on both ranks, so GradScaler
    # skips that step everywhere and lowers its scale, as with torch's DDP. Its unscaling
    # reads every gradient, so every bucket lands first, wait() or not.
    def body(rank, group, wrapper):
        model, ddp, opt = _mlp_side(wrapper, _late(group, wrapper), _adamw, bucket_cap_mb=1e-7)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        g = torch.Generator().manual_seed(rank)
        for i in range(4):
            loss = ddp(torch.randn(4, 8, generator=g)).pow(2).sum()
            if i == 1 and rank == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if wait:
                getattr(opt, "wait", lambda: None)()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return _params(model, opt) + [torch.tensor(scaler.get_scale())]

    _assert_equal_sides(body)


def test_a_gradient_written_around_torch_is_refused_at_step_before_any_parameter_moved():
    # Through a view taken before backward ended, out of torch's function dispatch, while
    # the bucket is still landing: its average would land over the write, so step() refuses
    # before it steps anything (buckets landed before step() are stepped by it).
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=_Held(group), bucket_cap_mb=1e-7)
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.wait()
        kept = model[1].weight.grad.view(-1)  # the next backward accumulates into its tensor
        loss = ddp(torch.randn(4, 8)).sum()
        before = [p.detach().clone() for p in model.parameters()]
        steps, plain_step = [], opt.optimizer.step
        opt.optimizer.step = lambda *a, **k: steps.append(1) or plain_step(*a, **k)
        loss.backward()
        kept.mul_(0.5)
        with pytest.raises(RuntimeError, match=r"1.weight were written in place through a view"):
            opt.step()
        ddp.reducer.abandon_iteration()  # no held all-reduce left for the exit to wait on
        return steps, all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    for steps, unmoved in run_threaded(body, 2, timeout=60):
        assert steps == [] and unmoved


@pytest.mark.parametrize("make, match", [
    (lambda ps: torch.optim.LBFGS(ps), "LBFGS"),
    (lambda ps: [torch.optim.SGD(ps, lr=0.1)], "expected a torch.optim.Optimizer, got list"),
])
def test_optimizers_that_cannot_step_per_bucket_are_refused(make, match):
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        GradsyncDDP(model, process_group=group).overlap_optimizer(make(model.parameters()))

    with pytest.raises(RankError, match=match):
        run_threaded(body, 2, timeout=60)


def test_a_closure_is_called_once_before_the_step_as_lightning_passes_one():
    # Lightning's automatic optimization: opt.step(closure), the closure running zero_grad,
    # forward and backward. Called once, as AdamW calls it; the same parameters and losses.
    def train(rank, group, wrapper):
        model, ddp, opt = _mlp_side(wrapper, group, _adamw)
        g, losses, calls = torch.Generator().manual_seed(rank), [], []

        def closure():
            calls.append(1)
            opt.zero_grad()
            loss = ddp(torch.randn(4, 8, generator=g)).pow(2).mean()
            loss.backward()
            return loss

        for _ in range(4):
            with torch.no_grad():  # as Lightning's loop: the step enables gradients itself
                losses.append(opt.step(closure).item())
        if wrapper is GradsyncDDP:
            opt.wait()
        assert len(calls) == 4
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

    for ours, theirs in _side_by_side(train):
        assert ours[0] == theirs[0]
        for name, p in theirs[1].items():
            assert torch.equal(ours[1][name], p), name


def test_sharded_gradients_are_refused():
    def body(rank, group):
        model, ddp, opt = _overlapped_mlp(group)
        with pytest.raises(RuntimeError, match="overlap_optimizer"):
            gradsync.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1,
                                             process_group=group)
        return True

    assert run_threaded(body, 2, timeout=60) == [True, True]


def test_a_second_overlapped_optimizer_is_refused_naming_the_first_and_the_fix():
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group)
        first = ddp.overlap_optimizer(torch.optim.AdamW(model.net[0].parameters(), lr=0.1))
        with pytest.raises(RuntimeError) as refused:
            ddp.overlap_optimizer(torch.optim.SGD(model.net[4].parameters(), lr=0.1))
        del first  # dropped: another may step the buckets now
        ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        return str(refused.value)

    for message in run_threaded(body, 2, timeout=60):
        assert message == (
            "overlap_optimizer: this wrapper's buckets are already stepped by an overlapped "
            "AdamW (over 2 of its 6 parameters), and one optimizer at a time steps them. Step "
            "other parameters with a plain optimizer after backward (their buckets land as "
            "backward ends), or drop the first (del opt) before overlapping SGD")


# ------------------------------------------------------------------ the next forward's waits


def test_the_next_forward_waits_only_for_the_buckets_of_each_module_in_turn():
    def body(rank, group):
        held = _Held(group)
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=held, bucket_cap_mb=1e-7)  # a bucket a tensor
        # sent in ready order: the first layer's buckets last
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), tail_mb=0)
        for _ in range(3):  # past the rebuild in ready order
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        waits_before = []
        for layer in model:
            layer.register_forward_pre_hook(lambda *_: waits_before.append(len(held.waited)))
        ddp(torch.randn(4, 8)).sum()  # lands the last iteration's buckets
        ddp.reducer.abandon_iteration()  # (its backward never comes)
        held.waited.clear()
        ddp(torch.randn(4, 8)).sum().backward()
        after_backward = len(held.waited)
        opt.step()
        phase = ddp.reducer.phase.value
        ddp(torch.randn(4, 8))  # the next forward (it lands the rest at its end)
        return after_backward, phase, waits_before[-4:]

    for after_backward, phase, waits in run_threaded(body, 2, timeout=60):
        # Nothing had landed when backward ended, nor when step() returned; each layer starts
        # having waited for the buckets of the layers before it only: its own two (weight and
        # bias) land at their first use, inside it. Not all eight before the first.
        assert (after_backward, phase) == (0, "landing")
        assert waits == [0, 2, 4, 6]


@pytest.mark.parametrize("what", ["state_dict", "module_state_dict", "module_load_state_dict",
                                  "no_sync", "eval", "wait", "opt_state_dict"])
def test_what_needs_every_parameter_lands_every_bucket_first(what):
    # module_*: the wrapped module's own or a submodule's, as a checkpoint taken without the
    # wrapper reads it (Lightning's, Accelerate's unwrap_model(model).state_dict()).
    def body(rank, group):
        held = _Held(group)
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=held, bucket_cap_mb=1e-7)
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        assert ddp.reducer.phase.value == "landing"
        if what == "state_dict":
            ddp.state_dict()
        elif what == "module_state_dict":
            model[1].state_dict()  # a submodule's
        elif what == "module_load_state_dict":
            model.load_state_dict(saved)
        elif what == "no_sync":
            with ddp.no_sync():
                pass
        elif what == "eval":
            with torch.no_grad():
                ddp(torch.randn(4, 8))
        elif what == "wait":
            opt.wait()
        else:
            opt.state_dict()
        return ddp.reducer.phase.value

    assert "landing" not in run_threaded(body, 2, timeout=60)


def test_a_forward_of_the_module_itself_lands_first_and_its_backward_stays_local():
    # The wrapped module called directly (an auxiliary loss, a probe) between steps, its
    # gradients zeroed before the synchronised step: as with torch's DDP, that backward is not
    # synchronised. Its forward once found the buckets landed but the iteration not closed,
    # and its gradients raised as late arrivals ("marked ready twice").
    def body(rank, group, wrapper):
        model, ddp, opt = _mlp_side(wrapper, group, _adamw)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            model(x).sum().backward()  # the module's own forward: every bucket landed first
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        getattr(opt, "wait", lambda: None)()
        return [p.detach().clone() for p in model.parameters()]

    for got, want in _side_by_side(body):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("cleared_by", ["module", "optimizer"])
def test_gradients_cleared_after_step_are_none_at_once_and_once_their_bucket_lands(cleared_by):
    def body(rank, group):
        held = _Held(group)
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=held, bucket_cap_mb=1e-7)
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        (model if cleared_by == "module" else opt).zero_grad()  # every bucket still landing
        at_once = [p.grad is None for p in model.parameters()]
        opt.wait()
        return at_once, [p.grad is None for p in model.parameters()]

    assert run_threaded(body, 2, timeout=60) == [([True] * 8, [True] * 8)] * 2


def _set_ones(model):
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # a gradient of the user's own, accumulated into


@pytest.mark.parametrize("between", [
    ["zero_grad", "assign"], ["assign", "zero_grad"], ["zero_grad keep", "assign"],
    ["assign", "zero_grad keep"], ["module zero_grad keep", "assign"]])
@pytest.mark.parametrize("as_view", [False, True])
def test_gradients_set_between_step_and_the_next_forward_are_kept_as_torch_ddp_keeps_them(
        between, as_view):
    # What the user does to .grad after step() is done after the buckets still landing are
    # stepped, in the order done. A gradient assigned there (`p.grad = ...`) was once written
    # into by the landing bucket and then cleared by the zero_grad that came before it. The
    # module's zero_grad(set_to_none=False) zeroes `.grad` in place: its bucket lands first.
    def body(rank, group, wrapper):
        model, ddp, opt = _mlp_side(
            wrapper, group, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            gradient_as_bucket_view=as_view)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        act = {"zero_grad": opt.zero_grad, "zero_grad keep": lambda: opt.zero_grad(False),
               "module zero_grad keep": lambda: model.zero_grad(False),
               "assign": lambda: _set_ones(model)}
        for _ in range(3):
            ddp(x).pow(2).sum().backward()
            opt.step()
            for what in between:
                act[what]()
        getattr(opt, "wait", lambda: None)()
        return ([p.detach().clone() for p in model.parameters()],
                [None if p.grad is None else p.grad.clone() for p in model.parameters()])

    for (params, grads), (want_params, want_grads) in _side_by_side(body):
        assert all(torch.equal(a, b) for a, b in zip(params, want_params))
        assert all((a is None and b is None) or torch.equal(a, b)
                   for a, b in zip(grads, want_grads))


def test_a_bucket_view_written_while_it_reduces_is_refused_where_it_lands():
    # gradient_as_bucket_view: `.grad` is the bucket. Written after step() through a view
    # taken before backward ended, while the bucket still reduces: refused as it lands.
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=_Held(group), bucket_cap_mb=1e-7,
                          gradient_as_bucket_view=True)
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(2):  # the buckets rebuilt in ready order after the first
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.wait()
        kept = model[1].weight.grad.view(-1)
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        kept.zero_()
        opt.wait()

    _refused(body, r"1.weight, 1.bias.* were changed in place after step\(\) through a view")


def test_the_tail_is_sent_nearest_the_input_first_in_chunks():
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=group)  # torch's buckets: one, after the rebuild
        size = 8 * 8 * 4 + 8 * 4  # one layer's bytes: the chunks hold a layer each
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    tail_mb=3 * size / 2**20, chunk_mb=size / 2**20)
        for _ in range(3):
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        reducer, names = ddp.reducer, dict(enumerate(ddp.reducer.names))
        launched = [i for _, kind, i in reducer.history[-1].events
                    if kind == gradsync.EventKind.LAUNCH]
        return [sorted(names[p] for p in reducer.bucket_indices[b]) for b in launched]

    for launched in run_threaded(body, 2, timeout=60):
        # The head (the last layer, ready first) as it fills; then the tail, once all of it is
        # ready, nearest the input first, a chunk (a layer) at a time.
        assert launched == [["3.bias", "3.weight"], ["0.bias", "0.weight"],
                            ["1.bias", "1.weight"], ["2.bias", "2.weight"]]


def test_ranks_asking_for_different_tails_are_refused_naming_them():
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=group)
        ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), tail_mb=rank)

    with pytest.raises(RankError, match=r"different tails \(rank 0: tail 0 B.*rank 1: tail 1048"):
        run_threaded(body, 2, timeout=60)


def test_ranks_whose_optimizers_step_different_parameters_are_refused_naming_them():
    # A bucket rank 1's optimizer does not hold whole would land as its backward ends and in
    # the next forward on rank 0: with a credit, chunks would start at different points.
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=group)
        params = list(model.parameters()) if rank == 0 else list(model[0].parameters())
        ddp.overlap_optimizer(torch.optim.SGD(params, lr=0.1), credit_mb=0.0001)

    with pytest.raises(RankError, match=r"step different parameters of the wrapper \(rank 0: 8 "
                       r"of 8, rank 1: 2 of 8; 1.weight on ranks \[0\]; 1.bias on ranks \[0\]"):
        run_threaded(body, 2, timeout=60)


def test_add_param_group_on_one_rank_only_is_refused_naming_the_parameters():
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=group)
        opt = ddp.overlap_optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))
        added = model[1] if rank == 0 else model[2]
        opt.add_param_group({"params": list(added.parameters())})

    with pytest.raises(RankError, match=r"rank 0: 4 of 8, rank 1: 4 of 8; 1.weight on ranks "
                       r"\[0\]; 1.bias on ranks \[0\]; 2.weight on ranks \[1\]"):
        run_threaded(body, 2, timeout=60)


@pytest.mark.parametrize("credit_mb", [None, 0.00005, 0.0001])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_tail_sent_first_in_chunks_equals_torch_ddp(optimizer, credit_mb):
    _check("many_small", optimizer, foreach=True, tail_mb=0.0004, chunk_mb=0.00005,
           credit_mb=credit_mb)


def test_a_gradient_read_on_one_rank_only_under_a_credit_waits_for_the_others_forward():
    # Rank 0 alone reads the gradient nearest the input (a logged norm): its chunk is held by
    # the credit, started on rank 1 only once rank 1's next forward lands the chunks before
    # it. Rank 0's read waits for that forward, never for good, and both ranks step as
    # torch's DDP; the norm is the average's on rank 0.
    def body(rank, group, wrapper):
        model = seeded(_layers, 0)
        ddp = wrapper(model, process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if wrapper is GradsyncDDP:
            size = 8 * 8 * 4 + 8 * 4  # a layer's bytes: the tail is three chunks, one flying
            opt = ddp.overlap_optimizer(opt, tail_mb=3 * size / 2**20, chunk_mb=size / 2**20,
                                        credit_mb=size / 2**20)
        g, norms = torch.Generator().manual_seed(rank), []
        for _ in range(3):
            ddp(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
            if rank == 0:
                held = wrapper is GradsyncDDP and ddp.reducer._reductions.holding()
                assert held or wrapper is TorchDDP  # the read's chunk not yet started
                norms.append(model[0].weight.grad.norm())
            opt.step()
            opt.zero_grad()
        return _params(model, opt) + norms

    _assert_equal_sides(body)


@pytest.mark.parametrize("credit", [1, 2])
def test_a_credit_holds_the_tails_chunks_until_the_next_forward_lands_those_before(credit):
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=group)
        size = 8 * 8 * 4 + 8 * 4  # a layer's bytes: the tail is three chunks of a layer each
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    tail_mb=3 * size / 2**20, chunk_mb=size / 2**20,
                                    credit_mb=credit * size / 2**20)
        reductions, started = ddp.reducer._reductions, []
        for _ in range(3):
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()  # the tail's chunks beyond the credit are not started yet
            started.append([f.stage.name for f in reductions.flights])
            opt.zero_grad()
        launched = [i for _, kind, i in ddp.reducer.history[-1].events
                    if kind == gradsync.EventKind.LAUNCH]
        opt.wait()
        return started[-1], launched, ddp.reducer.phase.name

    for after_step, launched, after_wait in run_threaded(body, 2, timeout=60):
        # Buckets: the head (layer 3), then the chunks of layers 2, 1, 0, sent in the order
        # 0, 3, 2, 1 (layer 0 first) credit or not; after step() only `credit` chunks are.
        assert after_step[0] != "FILLING" and after_step[3] != "FILLING", after_step
        assert after_step[1:3] == ["FILLING"] * (3 - credit) + ["STARTED"] * (credit - 1), (
            after_step)
        assert launched == [0, 3, 2, 1]
        assert after_wait == "REDUCED"  # every chunk landed and written back


def test_a_parameter_written_while_its_bucket_is_landing_is_refused_and_a_load_waits():
    def body(rank, group):
        held = _Held(group)
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=held, bucket_cap_mb=1e-7)
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        saved = {k: v.clone() for k, v in ddp.state_dict().items()}
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        ddp.load_state_dict(saved)  # lands (and steps) first, then loads: the saved values win
        loaded = all(torch.equal(v, ddp.state_dict()[k]) for k, v in saved.items())
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # behind the optimizer's back, before the bucket lands
        with pytest.raises(RuntimeError, match=r"parameters 0.weight were written in place"):
            opt.wait()
        ddp.reducer.abandon_iteration()  # no held all-reduce left for the exit to wait on
        return loaded

    assert run_threaded(body, 2, timeout=60) == [True, True]


class _Reduced:
    """A group whose all-reduces have completed when issued: every bucket lands at the end of
    backward, before step() returns, none after."""

    def __init__(self, group):
        self._group = group

    def __getattr__(self, name):
        return getattr(self._group, name)

    def allreduce(self, tensors, *args):
        work = self._group.allreduce(tensors, *args)
        work.wait()
        return work


@pytest.mark.parametrize("then", ["forward", "module forward", "eval forward", "wait",
                                  "state_dict"])
def test_a_parameter_written_after_step_is_refused_on_every_rank_landed_or_not(then):
    # Rank 0's buckets are all still landing after step(), rank 1's have all landed: both
    # raise at the next point a bucket could land. Once only rank 0 raised, and rank 1 went on
    # to the next backward's all-reduce alone (a hang until the timeout).
    def body(rank, group):
        model = seeded(_layers, 0)
        wrapped = (_Held if rank == 0 else _Reduced)(group)
        ddp = GradsyncDDP(model, process_group=wrapped, bucket_cap_mb=1e-7)
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        landing = ddp.reducer.phase.name
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.1, 0.1)  # weight clipping, before opt.wait()
        with pytest.raises(RuntimeError, match=r"parameters 0.weight, 0.bias, 1.weight, 1.bias, "
                                               r"2.weight and 3 more were written in place"):
            {"forward": lambda: ddp(torch.randn(4, 8)),
             "module forward": lambda: model(torch.randn(4, 8)),
             "eval forward": lambda: ddp.eval()(torch.randn(4, 8)),
             "wait": opt.wait, "state_dict": model.state_dict}[then]()
        ddp.reducer.abandon_iteration()  # no held all-reduce left for the exit to wait on
        return landing

    assert run_threaded(body, 2, timeout=60) == ["LANDING", "REDUCED"]


@pytest.mark.parametrize("find_unused", [False, True], ids=["lands late", "lands as backward ends"])
def test_a_parameter_written_between_backward_and_step_is_stepped_from_the_write_as_torch(
        find_unused):
    # A projection between backward and step(): rank 0's buckets still landing, rank 1's all
    # landed (with find_unused_parameters, every bucket lands as backward ends, on both). Each
    # is stepped after the write, by step() or as it lands, as torch's DDP steps it.
    def body(rank, group, wrapper):
        if wrapper is GradsyncDDP:
            group = (_Held if rank == 0 else _Reduced)(group)
        model = seeded(_layers, 0)
        ddp = wrapper(model, process_group=group, bucket_cap_mb=1e-7,
                      find_unused_parameters=find_unused)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if wrapper is GradsyncDDP:
            opt = ddp.overlap_optimizer(opt)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
            with torch.no_grad():
                model[1].weight.clamp_(-0.2, 0.2)
            opt.step()
            opt.zero_grad()
        return _params(model, opt)

    _assert_equal_sides(body)


class _Embedded(torch.nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16, sparse=sparse)
        self.lin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 16))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(idx)).pow(2).mean()


@pytest.mark.parametrize("sparse", [False, True])
def test_a_second_optimizer_steps_the_averages_of_its_own_parameters_right_after_backward(
        sparse):
    # The overlapped optimizer steps the linear layers; another (SparseAdam for a sparse
    # embedding, Adam for a dense one) steps the embedding right after backward, as with
    # torch's DDP. Its bucket lands as backward ends, not in the next forward.
    def train(wrapper, rank, group):
        model = seeded(lambda: _Embedded(sparse), 0)
        ddp = wrapper(model, process_group=group, bucket_cap_mb=0.001)  # a bucket a parameter
        dense = torch.optim.Adam(model.lin.parameters(), lr=0.01)
        other = (torch.optim.SparseAdam if sparse else torch.optim.Adam)(
            model.emb.parameters(), lr=0.01)
        if wrapper is GradsyncDDP:
            dense = ddp.overlap_optimizer(dense, tail_mb=0)
        g, landing = torch.Generator().manual_seed(rank), []
        for _ in range(4):
            ddp(torch.randint(0, 50, (8, 3), generator=g)).backward()
            if wrapper is GradsyncDDP and ddp.reducer.phase.name == "LANDING":
                landing += [p for b in ddp.reducer._reductions.pending() for p in b.params]
            other.step()
            dense.step()
            other.zero_grad()
            dense.zero_grad()
        if wrapper is GradsyncDDP:
            dense.wait()
        assert not any(p is model.emb.weight for p in landing)  # the linear layers' may be
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    results = run_threaded(lambda rank, group: (train(GradsyncDDP, rank, group),
                                                train(TorchDDP, rank, group)), 2, timeout=60)
    for ours, theirs in results:
        for name, p in theirs.items():
            assert torch.equal(ours[name], p), name


def test_a_parameter_used_outside_its_own_module_lands_before_that_use():
    """nn.MultiheadAttention uses its out_proj's weight itself, never calling out_proj: the
    parameter still lands (and is stepped) before the forward saves it for backward."""
    def body(rank, group):
        held = _Held(group)
        model = seeded(lambda: torch.nn.MultiheadAttention(8, 2), 0)
        ddp = GradsyncDDP(model, process_group=held, bucket_cap_mb=1e-7)
        opt = ddp.overlap_optimizer(torch.optim.Adam(model.parameters(), lr=0.1), tail_mb=0)
        for _ in range(4):
            x = torch.randn(3, 2, 8)
            ddp(x, x, x)[0].sum().backward()  # an in-place step after the save would raise here
            opt.step()
            opt.zero_grad()
        opt.wait()
        return [p.detach().clone() for p in model.parameters()]

    ours = run_threaded(body, 2, timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(*ours))


def test_an_evaluation_under_inference_mode_between_steps_lands_and_training_goes_on():
    """Validation under torch.inference_mode() lands the buckets first: their write-back and
    the first step's optimizer state (AdamW's, made lazily) stay ordinary tensors, which the
    next step updates in place (made under inference mode, that step raised)."""
    def train(rank, group, wrapper):
        model = seeded(MODELS["mlp"], 0)
        ddp = wrapper(model, process_group=group, bucket_cap_mb=1e-7)  # one per tensor
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if wrapper is GradsyncDDP:
            opt = ddp.overlap_optimizer(opt, tail_mb=0)
        g = torch.Generator().manual_seed(rank)
        for i in range(3):
            ddp(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 0:  # the first step's buckets, and their optimizer state, land here
                with torch.inference_mode():
                    ddp.eval()
                    ddp(torch.randn(4, 8, generator=g))
                    ddp.train()
        if wrapper is GradsyncDDP:
            opt.wait()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def body(rank, group):  # every bucket lands late: `_Held`
        return train(rank, _Held(group), GradsyncDDP), train(rank, group, TorchDDP)

    for ours, theirs in run_threaded(body, 2, timeout=60):
        assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


def test_the_trace_shows_each_buckets_step_and_the_forward_on_tracks_of_their_own():
    def body(rank, group):
        model = seeded(_layers, 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=1e-7)  # 8 buckets
        opt = ddp.overlap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), tail_mb=0)
        for _ in range(3):
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.wait()
        trace = gradsync.chrome_trace(ddp.reducer.history, rank, ddp.reducer.names)
        tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "M"
                  and e["name"] == "thread_name"}
        return tracks, [(e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]

    for tracks, spans in run_threaded(body, 2, timeout=60):
        steps = [n for tid, n in spans if tid == tracks["write-back and step"]]
        forwards = [n for tid, n in spans if tid == tracks["forward"]]
        # one bucket in the first iteration, eight after the rebuild in ready order
        assert len(steps) == 1 + 8 + 8 and all(n.startswith("step bucket") for n in steps)
        assert forwards == ["forward 1", "forward 2", "forward 3"]


def test_a_bucket_that_never_lands_raises_within_the_timeout_instead_of_waiting_forever():
    """Rank 1 never runs the second backward: rank 0's buckets wait for it while landing (in
    opt.wait(), as in the next forward) and raise after the configured timeout."""
    def body(rank, group):
        model, ddp, opt = _overlapped_mlp(group)
        for _ in range(3):  # past the rebuild in ready order, a collective of its own
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
        opt.wait()
        ddp.reducer.configure(timeout=datetime.timedelta(seconds=2))
        if rank == 1:
            return None
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
        start = time.monotonic()
        with pytest.raises(gradsync.ReductionTimeoutError, match="did not complete within"):
            opt.wait()
        return time.monotonic() - start

    # The group's own timeout short too: rank 0's all-reduce, never joined, then fails within
    # it, instead of holding the group's teardown (a later test's) until it ran out.
    took, _ = run_threaded(body, 2, timeout=10)
    assert took < 10


PLANNED_STEPS = 48  # the layout decided by iteration 26, the tail by 43 (short trials)


def _planned_tail(rank, group):
    from gradsync.planning.planner import CostModel

    model = seeded(MODELS["many_small"], 0)
    ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb="auto")
    auto = ddp._auto
    auto.rounds, auto.per_slot, auto.confirm_rounds = 2, 1, 2
    auto.saturated, auto.cost = False, CostModel(0.0, 1e-9)  # overlap allowed; not probed
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = ddp.overlap_optimizer(OPTIMIZERS["adamw"](model.parameters()),
                                tail_mb=total / 2 / 2**20, chunk_mb=total / 8 / 2**20)
    tails = []
    for batch in make_batches(PLANNED_STEPS, 2, per_rank=4):
        ddp(batch.chunk(2)[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        tails.append(ddp.reducer.config.priority_tail_bytes)
    opt.wait()
    last = ddp.reducer.history[-1]  # what the trials timed: forward to backward's return
    assert last.forward_start_ns < last.backward_end_ns <= last.backward_returned_ns
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return (params, opt.state_dict()), ddp.bucket_plan(), tails, total


def test_the_planner_tries_tails_once_the_layout_is_decided_alike_on_every_rank():
    # bucket_cap_mb="auto" with the overlapped optimizer: after the layout's trial, a trial of
    # tails (the one set, none, three quarters of the gradients, larger chunks, a credit; half
    # the gradients is the one set here), timed forward to its backward's return; the
    # winner installed on every rank alike, and the parameters still torch's DDP's.
    batches = make_batches(PLANNED_STEPS, 2, per_rank=4)
    ours = run_threaded(_planned_tail, 2, timeout=120)
    theirs = run_threaded(lambda rank, group: _train(TorchDDP, rank, group, "many_small",
                                                     batches, "adamw"), 2, timeout=120)
    (_, plan0, tails0, total), (_, plan1, tails1, _) = ours
    assert plan0.kept is not None and plan0.tail is not None, str(plan0)
    assert plan0.tail == plan1.tail and tails0 == tails1
    assert set(plan0.tail_trial_ratio) == {"no tail", "three quarters of the gradients",
                                           "chunks x4", "one chunk in flight"}, (
        plan0.tail_trial_ratio)
    assert len(set(tails0)) >= 3  # the tails tried in turn: half, none, three quarters...
    assert tails0[-1] == plan0.tail[0] and "tail" in str(plan0)
    for rank, (mine, want) in enumerate(zip(ours, theirs)):
        _assert_same(mine[0], want, f"rank {rank}")


def test_called_mid_run_with_powersgd_keeps_the_hooks_buckets_and_trains_on():
    # A hook runs over the buckets by index, so the tail is not cut: PowerSGD's error feedback,
    # kept per bucket, stays valid when overlap_optimizer comes after its start iteration.
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def train(rank, group, overlap_at):
        model = seeded(MODELS["many_small"], 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.0005)
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, min_compression_rate=0.1,
                                   random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        layouts = []
        for i, batch in enumerate(make_batches(6, 2, per_rank=4)):
            if i == overlap_at:
                opt = ddp.overlap_optimizer(opt, tail_mb=0.0004, chunk_mb=0.00005)
            ddp(batch.chunk(2)[rank]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            layouts.append(ddp.reducer.bucket_indices)
        getattr(opt, "wait", lambda: None)()
        return [p.detach().clone() for p in model.parameters()], layouts

    # (PowerSGD seeds torch's global generator, which the rank threads share: its results
    # vary from run to run here, so they are not compared with a plain run's.)
    for params, layouts in run_threaded(train, 2, 4, timeout=120):
        assert layouts[3] == layouts[4] == layouts[-1]  # not cut again for the tail
        assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("after_rebuild", [False, True])
def test_buckets_left_at_torchs_cap_are_capped_at_4_mib_for_the_overlap_and_a_cap_given_is_kept(
        after_rebuild):
    def sizes(rank, group, cap):
        model = seeded(lambda: torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False)
                                                     for _ in range(8)]), 0)  # 1 MiB each
        ddp = GradsyncDDP(model, process_group=group, **cap)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if not after_rebuild:
            opt = ddp.overlap_optimizer(opt, tail_mb=0)
        for i in range(3):
            if after_rebuild and i == 1:
                opt = ddp.overlap_optimizer(opt, tail_mb=0)
            ddp(torch.randn(2, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.wait()
        return [len(b) for b in ddp.reducer.bucket_indices], ddp.bucket_bytes_cap

    def body(rank, group):
        return (sizes(rank, group, {}), sizes(rank, group, {"bucket_cap_mb": 25}),
                sizes(rank, group, {"bucket_cap_mb": "auto"}))

    for (default, default_cap), (given, given_cap), (auto, _) in run_threaded(body, 2,
                                                                              timeout=60):
        assert default == [1, 4, 3]  # torch's first bucket of 1 MiB, then 4 MiB at most
        assert auto == default  # what the planner's candidates are tried against, once it plans
        assert given == [8]  # the 25 MiB asked for (torch's 1 MiB first bucket is its default's)
        # what dynamo's DDPOptimizer splits a compiled graph at: the cap the buckets have
        assert (default_cap, given_cap) == (4 * 2**20, 25 * 2**20)


MEASURED_STEPS = 16  # measured at the 6th synchronised forward, decided at the 14th (short)
CHUNK_MB = 1 / 1024  # 1 KiB: the test model's 8.4 KiB cut into several chunks


def _measured_tail(rank, group, steps=MEASURED_STEPS):
    """Train many_small (8.4 KiB) with the tail left out, in chunks of 1 KiB, its trial
    shortened to two rounds of two; the decided tail and the configured one after each step,
    the trial's outcome, the parameters and the optimizer's state."""
    model = seeded(MODELS["many_small"], 0)
    ddp = GradsyncDDP(model, process_group=group)
    opt = ddp.overlap_optimizer(OPTIMIZERS["adamw"](model.parameters()), chunk_mb=CHUNK_MB)
    measured = ddp.measured_tail
    measured.rounds, measured.per_slot = 2, 2
    seen = []
    for batch in make_batches(steps, 2, per_rank=4):
        ddp(batch.chunk(2)[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append((measured.tail, ddp.reducer.config.priority_tail_bytes))
    opt.wait()
    return (seen, (measured.backlog, measured.score),
            ({n: p.detach().clone() for n, p in model.named_parameters()}, opt.state_dict()))


def test_the_tail_left_out_is_measured_tried_and_decided_alike_on_every_rank_as_torchs_steps():
    # The default tail for five synchronised iterations; then the backlog measured, the two
    # tails in turn, and the faster kept, on every rank alike; the parameters torch's DDP's.
    batches = make_batches(MEASURED_STEPS, 2, per_rank=4)
    ours = run_threaded(_measured_tail, 2, timeout=120)
    theirs = run_threaded(lambda rank, group: _train(TorchDDP, rank, group, "many_small",
                                                     batches, "adamw"), 2, timeout=120)
    (seen0, tried0, _), (seen1, tried1, _) = ours
    assert seen0 == seen1 and tried0 == tried1
    default = int(gradsync.wrapper.overlap.DEFAULT_TAIL_MB * 2**20)
    decided = seen0[-1][0]
    assert seen0[:13] == [(None, t) for _, t in seen0[:13]] and seen0[13:] == [
        (decided, decided)] * (MEASURED_STEPS - 13)
    backlog, score = tried0
    if score is not None:  # tried: the two tails in turn, then the faster
        assert {t for _, t in seen0[5:13]} == {default, backlog}, seen0
        assert decided == (backlog if score < 0.98 else default)
    else:  # the backlog cuts the same buckets as the default: nothing to try
        assert decided == default
    for rank, (mine, want) in enumerate(zip(ours, theirs)):
        _assert_same(mine[2], want, f"rank {rank}")


def test_the_backlog_tried_is_the_least_ranks_and_kept_only_if_faster_on_every_rank(monkeypatch):
    # Each rank's collectives count the time they wait for the others as time on the link:
    # the least backlog is the likeliest. Kept only where every rank's steps were faster with
    # it; a rank with no timings (record_events=False) keeps the default everywhere, after
    # the same agreement; never less than a chunk; not tried where it cuts the same buckets.
    import threading

    kib = 1024
    cases = {"faster": ([3 * kib, 5 * kib], [0.9, 0.95]),
             "slower on one": ([3 * kib, 5 * kib], [0.9, 1.0]),
             "one unmeasured": ([3 * kib, None], [0.9, 0.9]),
             "nearly none": ([100, 200], [0.9, 0.9]),
             "the same buckets": ([20 * kib, 30 * kib], [0.9, 0.9])}  # all 8.4 KiB
    local = threading.local()

    def run(case):
        backlogs, speed = cases[case]
        monkeypatch.setattr(gradsync.engine.timeline.IterationTimeline, "backlog_bytes",
                            lambda self: backlogs[local.rank])

        def timed(self, reducer):  # each rank's backlog slots this much faster
            for slot in range(2 * self.rounds):
                self.trial["steps"][slot] = [10.0 * (speed[local.rank] if slot % 2 else 1.0)]

        monkeypatch.setattr(gradsync.wrapper.overlap.MeasuredTail, "_time_last", timed)

        def body(rank, group):
            local.rank = rank
            return _measured_tail(rank, group)[0][-1]

        return run_threaded(body, 2, timeout=60)

    default = int(gradsync.wrapper.overlap.DEFAULT_TAIL_MB * kib**2)
    chunk = int(CHUNK_MB * kib**2)
    assert run("faster") == [(3 * kib, 3 * kib)] * 2
    assert run("slower on one") == [(default, default)] * 2
    assert run("one unmeasured") == [(default, default)] * 2
    assert run("nearly none") == [(chunk, chunk)] * 2
    assert run("the same buckets") == [(default, default)] * 2
