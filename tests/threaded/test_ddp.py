"""gradsync.DistributedDataParallel against torch's, side by side on the same gloo groups:
same parameters, gradients (None-ness included) and buffers, for each feature it supports."""

from __future__ import annotations

import copy
import dataclasses
import io
import sys

import pytest
import torch
import torch.distributed as dist
from models import MODELS, make_batches
from parity import assert_records_equal, train_single, train_wrapper
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import RankError, run_threaded, seeded

STEPS = 3


def _both(rank, group, model_name, batches, kwargs):
    ours = train_wrapper(GradsyncDDP, rank, group, model_name, batches, **kwargs)
    theirs = train_wrapper(TorchDDP, rank, group, model_name, batches, **kwargs)
    return ours, theirs


def _check(model_name, world_size, per_rank=4, **kwargs):
    batches = make_batches(STEPS, world_size, per_rank=per_rank)
    results = run_threaded(_both, world_size, model_name, batches, kwargs, timeout=60)
    for rank, (ours, theirs) in enumerate(results):
        assert_records_equal(ours, theirs, exact=world_size == 2, what=f"rank {rank}")
        for name, buf in ours["buffers"].items():
            torch.testing.assert_close(buf, theirs["buffers"][name], rtol=0, atol=0)
    return batches, results


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model_name", ["mlp", "many_small", "tied", "frozen", "conv", "batchnorm"])
def test_matches_torch_ddp(model_name, world_size):
    batches, results = _check(model_name, world_size, bucket_cap_mb=0.0005)
    if model_name != "batchnorm":  # batch statistics make the single-process run differ
        single = train_single(model_name, batches, world_size)
        assert_records_equal(results[0][0], single, exact=False, what="vs single process")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("config", [{}, {"find_unused_parameters": True},
                                    {"gradient_as_bucket_view": True}, {"static_graph": True}])
def test_complex_and_double_parameters_match_torch(config, world_size):
    # The ranks' reports ride in the last bucket, here the complex one (they crashed there).
    _check("complex", world_size, bucket_cap_mb=0.0005, **config)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("as_view", [False, True])
def test_find_unused_parameters_matches_torch(world_size, as_view):
    _check(
        "unused_branch", world_size, find_unused_parameters=True, gradient_as_bucket_view=as_view
    )


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("accumulate_with", ["no_sync", "flag"])
@pytest.mark.parametrize("find_unused", [False, True])
def test_gradient_accumulation_matches_torch(accumulate_with, find_unused, world_size):
    model = "unused_branch" if find_unused else "mlp"
    _check(model, world_size, per_rank=6, micro_steps=3, accumulate_with=accumulate_with,
           find_unused_parameters=find_unused)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_gradient_as_bucket_view_matches_torch_and_grads_are_views(set_to_none):
    for world_size in (2, 3):
        _check("mlp", world_size, gradient_as_bucket_view=True, set_to_none=set_to_none,
               bucket_cap_mb=0.001)

    def body(rank, group):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad(set_to_none=set_to_none)
            ddp(torch.randn(4, 8)).sum().backward()
            opt.step()
        storages = {b.buffer.untyped_storage().data_ptr() for b in ddp.reducer.buckets}
        return all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())

    assert run_threaded(body, 2) == [True, True]


class _Alternating(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(x) if use_b else self.a(x)


def test_parameter_used_only_in_an_earlier_micro_step_is_still_reduced():
    def body(rank, group, cls):
        model = seeded(_Alternating, 0)
        ddp = cls(model, process_group=group, find_unused_parameters=True)
        x = torch.full((2, 4), float(rank + 1))
        with ddp.no_sync():
            ddp(x, use_b=True).sum().backward()  # b used only here
        ddp(x, use_b=False).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = run_threaded(body, 2, GradsyncDDP)
    theirs = run_threaded(body, 2, TorchDDP)
    for name in ours[0]:
        torch.testing.assert_close(ours[0][name], ours[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ours[0][name], theirs[0][name], rtol=0, atol=0)
    # b's gradient is the average of the ranks' local gradients, not rank-local.
    model = seeded(_Alternating, 0)
    for r in range(2):
        model(torch.full((2, 4), float(r + 1)), use_b=True).sum().div(2).backward()
    torch.testing.assert_close(ours[0]["b.weight"], model.b.weight.grad)


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: dict


class _StructuredOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x, *, scale=1.0):
        y = self.fc(x) * scale
        return _Output(logits=y, extra={"pair": (y, "tag"), "n": 3})


@pytest.mark.parametrize("find_unused", [False, True])
def test_arbitrary_outputs_and_kwargs_pass_through(find_unused):
    def body(rank, group):
        model = seeded(_StructuredOutput, 0)
        ddp = GradsyncDDP(model, process_group=group, find_unused_parameters=find_unused)
        out = ddp(torch.ones(2, 4), scale=2.0)
        assert isinstance(out, _Output) and out.extra["pair"][1] == "tag" and out.extra["n"] == 3
        out.logits.sum().backward()
        return model.fc.weight.grad.clone()

    g = run_threaded(body, 2)
    torch.testing.assert_close(g[0], torch.full((2, 4), 4.0))  # scale 2 x batch 2


def test_init_broadcasts_rank0_parameters_and_buffers():
    def body(rank, group):
        torch.manual_seed(rank)  # deliberately different per rank
        model = __import__("models").WithBatchNorm()
        model.bn.running_mean.fill_(rank)
        GradsyncDDP(model, process_group=group)
        return model.fc.weight.clone(), model.bn.running_mean.clone()

    (w0, m0), (w1, m1) = run_threaded(body, 2)
    assert torch.equal(w0, w1) and torch.equal(m0, m1) and m1.eq(0).all()


def test_state_dict_has_torch_prefix_and_round_trips():
    def body(rank, group):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group)
        ref = TorchDDP(seeded(lambda: __import__("models").MLP(), 0), process_group=group)
        assert list(ddp.state_dict()) == list(ref.state_dict())
        assert all(k.startswith("module.") for k in ddp.state_dict())
        ddp.load_state_dict(ref.state_dict())
        return True

    assert run_threaded(body, 2) == [True, True]


def test_pickles_like_torch_ddp():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model)
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert isinstance(loaded, GradsyncDDP) and loaded.reducer is not ddp.reducer
        loaded(torch.randn(3, 8)).sum().backward()
        assert all(p.grad is not None for p in loaded.module.parameters())
        for a, b in zip(ddp.module.parameters(), loaded.module.parameters()):
            assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["plain", "overlapped", "zero-2", "zero-2 gathers late"])
def test_the_wrapped_module_pickles_and_copies_alone_and_the_copy_is_not_wrapped(optimizer):
    # torch.save(model) and copy.deepcopy(model) (an EMA) of the module inside the wrapper: the
    # hooks gradsync hangs on it hold the wrapper's parts weakly, which once did not pickle
    # (the overlapped optimizer's state-dict hooks, ZeRO-2's gathers before each module).
    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if optimizer == "overlapped":
            opt = ddp.overlap_optimizer(opt)
        elif optimizer.startswith("zero-2"):
            opt = gradsync.ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.AdamW, lr=0.01, process_group=group,
                overlap_param_gather=optimizer.endswith("late"))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        copies = []
        for _ in range(2):
            ddp(x).sum().backward()
            opt.step()
            opt.zero_grad()
            getattr(opt, "wait", lambda: None)()  # parameters read directly: landed first
            saved = io.BytesIO()
            torch.save(model, saved)
            saved.seek(0)
            copies += [torch.load(saved, weights_only=False), copy.deepcopy(model)]
        for c in copies:  # trains alone: no collective, nothing of the wrapper's runs
            c(x).sum().backward()
        ddp(x).sum().backward()  # and the wrapper goes on, apart from its copies
        opt.step()
        getattr(opt, "wait", lambda: None)()
        return [[p.detach() for p in c.parameters()] for c in copies[-2:]], [
            p.detach() for p in model.parameters()], [next(c.parameters()).grad for c in copies]

    for (last, now, grads), rank in zip(run_threaded(body, 2, timeout=60), range(2)):
        assert all(g is not None for g in grads), f"rank {rank}: a copy did not train"
        assert not any(torch.equal(a, b) for a, b in zip(last[0], now)), "a step missed"


# ------------------------------------------------------------------------------- errors


def test_mismatched_parameters_raise_on_every_rank_naming_the_parameter():
    def body(rank, group):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3 + rank))
        try:
            GradsyncDDP(model, process_group=group)
        except ValueError as error:
            return str(error)
        return "no error"

    messages = run_threaded(body, 3)
    for m in messages:
        assert "Parameter #2 differs" in m
        assert "rank 0: '1.weight' shape [3, 4]" in m and "rank 2: '1.weight' shape [5, 4]" in m


def test_parameter_count_mismatch_is_reported():
    def body(rank, group):
        layers = [torch.nn.Linear(4, 4) for _ in range(1 + rank)]
        try:
            GradsyncDDP(torch.nn.Sequential(*layers), process_group=group)
        except ValueError as error:
            return str(error)
        return "no error"

    for m in run_threaded(body, 2):
        assert "rank 0: (none)" in m and "counts per rank: [2, 4]" in m


def test_module_without_trainable_parameters_is_refused():
    def body(rank, group):
        GradsyncDDP(torch.nn.Linear(2, 2).requires_grad_(False), process_group=group)

    with pytest.raises(RankError, match="RuntimeError.*no parameter that requires a gradient"):
        run_threaded(body, 1)


@pytest.mark.parametrize("caps", [[0.0005, 0.001], [0.002]])
def test_bucket_cap_mb_list_matches_torch(caps):
    _check("many_small", 2, bucket_cap_mb_list=caps)


def test_skip_all_reduce_unused_params_matches_torch():
    _check("unused_branch", 2, find_unused_parameters=True, skip_all_reduce_unused_params=True)


def test_constructor_accepts_every_torch_keyword():
    import inspect

    ours = inspect.signature(GradsyncDDP.__init__).parameters
    theirs = inspect.signature(TorchDDP.__init__).parameters
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert ours[name].default == p.default, name


def test_unused_parameters_without_the_flag_name_them_next_iteration():
    def body(rank, group):
        model = seeded(lambda: __import__("models").UnusedBranch(), 0)
        ddp = GradsyncDDP(model, process_group=group)
        for _ in range(2):
            ddp(torch.ones(2, 8)).sum().backward()

    with pytest.raises(
        RankError, match=r"(?s)spare\.weight, spare\.bias.*find_unused_parameters=True"
    ):
        run_threaded(body, 2)


def test_public_api():
    assert set(gradsync.__all__) >= {
        "DistributedDataParallel",
        "Reducer",
        "compute_bucket_assignment_by_size",
    }


def test_dropped_wrapper_frees_its_reducer_and_stops_hooking():
    import gc
    import weakref

    def body(rank, group):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group)
        ref = weakref.ref(ddp.reducer)
        ddp(torch.ones(2, 8)).sum().backward()
        gc.disable()
        try:
            del ddp
            freed = ref() is None  # no reference cycle keeps it (or its group) alive
        finally:
            gc.enable()
        again = GradsyncDDP(model, process_group=group)  # re-wrapping the same module works
        again(torch.ones(2, 8)).sum().backward()
        return freed

    assert run_threaded(body, 2) == [True, True]


def test_backward_with_create_graph_averages_first_order_gradients():
    # torch 2.13's own DDP raises "a leaf Variable that requires grad is being used in an
    # in-place operation" here on CPU, so the reference is computed directly.
    def body(rank, group):
        model = seeded(lambda: __import__("models").MLP(), 0)
        ddp = GradsyncDDP(model, process_group=group)
        ddp(torch.full((2, 8), float(rank + 1))).pow(2).sum().backward(create_graph=True)
        return [p.grad.detach().clone() for p in model.parameters()]

    ours = run_threaded(body, 2)
    model = seeded(lambda: __import__("models").MLP(), 0)
    for r in range(2):
        model(torch.full((2, 8), float(r + 1))).pow(2).sum().div(2).backward()
    for got, p in zip(ours[0], model.parameters()):
        torch.testing.assert_close(got, p.grad)


class _CheckpointedShared(torch.nn.Module):
    """One layer applied twice, each time inside a reentrant checkpoint: its hooks fire twice."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.spare = torch.nn.Linear(8, 8)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.shared, self.inp(x), use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.head(h)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model_name", ["mlp", "many_small", "checkpointed"])
def test_static_graph_matches_torch(model_name, world_size):
    import models

    models.MODELS.setdefault("checkpointed", _CheckpointedShared)
    _check(model_name, world_size, static_graph=True)


def test_static_graph_with_unused_parameter_and_find_unused_matches_torch():
    import models

    models.MODELS.setdefault("checkpointed", _CheckpointedShared)
    _check("checkpointed", 2, static_graph=True, find_unused_parameters=True)
    _check("unused_branch", 2, static_graph=True)


def _penalised(module, x):
    x = x.clone().requires_grad_()
    out = module(x)
    (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.sum() + dx.pow(2).sum()


def _grads_first(module, x):
    out = module(x).sum()
    torch.autograd.grad(out, list(module.parameters()))  # a probe: accumulates nothing
    return module(x).sum()


@pytest.mark.parametrize("loss", ["penalty", "grads first", "module first"])
def test_static_graph_with_a_graph_run_before_backward_trains_as_one_process(loss):
    # A torch.autograd.grad before backward, or a backward of the module called directly
    # (zeroed before the synchronised one): the static graph's first iteration must not take
    # them for its own. torch 2.13's DDP does here, and its ranks' parameters drift apart.
    def run(module, x):
        if loss == "penalty":
            return _penalised(module, x)
        if loss == "grads first":
            return _grads_first(module, x)
        return module(x).sum()

    def body(rank, group):
        model = seeded(MODELS["mlp"], 0)
        ddp = GradsyncDDP(model, process_group=group, static_graph=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            if loss == "module first":
                model(x).sum().backward()
                opt.zero_grad()
            run(ddp, x).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ranks = run_threaded(body, 2, timeout=60)
    model = seeded(MODELS["mlp"], 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    for _ in range(3):
        sum(run(model, x) for x in xs).div(2).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(*ranks))
    for got, want in zip(ranks[0], model.parameters()):
        torch.testing.assert_close(got, want.detach())


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_gradients_match_torch(world_size):
    _check("sparse_embedding", world_size)


def test_sparse_gradient_parameter_gets_a_bucket_of_its_own():
    def body(rank, group):
        model = seeded(lambda: __import__("models").SparseEmbedding(), 0)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=25)
        for _ in range(2):
            ddp(torch.rand(4, 8)).sum().backward()
        return [(b.sparse, b.param_indices) for b in ddp.reducer.buckets]

    layout = run_threaded(body, 2)[0]
    assert (True, [0]) in layout and all(not s for s, idx in layout if 0 not in idx)


def test_excluded_parameters_and_buffers_are_not_synchronised():
    def body(rank, group):
        model = seeded(lambda: __import__("models").WithBatchNorm(), 0)
        with torch.no_grad():
            model.out.bias.fill_(rank)
        model.bn.running_mean.fill_(rank)
        gradsync.exclude_from_sync(model, ["out.bias", "bn.running_mean"])
        ddp = GradsyncDDP(model, process_group=group)
        ddp(torch.full((4, 8), float(rank))).mul(rank + 1).sum().backward()
        return model.out.bias.clone(), model.out.bias.grad.clone(), model.fc.weight.grad.clone()

    (b0, g0, w0), (b1, g1, w1) = run_threaded(body, 2)
    assert b0.eq(0).all() and b1.eq(1).all()  # not broadcast at construction
    assert torch.equal(w0, w1)  # synchronised
    assert g0.eq(4).all() and g1.eq(8).all()  # rank-local: 4 rows x (rank + 1), not averaged
    with pytest.raises(ValueError, match="not parameters or buffers"):
        gradsync.exclude_from_sync(torch.nn.Linear(2, 2), ["nope"])


def test_torch_spelling_of_exclusion_works():
    def body(rank, group):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        GradsyncDDP._set_params_and_buffers_to_ignore_for_model(model, ["1.weight", "1.bias"])
        ddp = GradsyncDDP(model, process_group=group)
        return [n for n in ddp.reducer.names]

    assert run_threaded(body, 1) == [["0.weight", "0.bias"]]


@pytest.mark.parametrize("all_delayed", [False, True])
def test_delayed_all_reduce_averages_the_named_parameters(all_delayed):
    def body(rank, group):
        model = seeded(lambda: __import__("models").MLP(), 0)
        names = (
            ["net.2.weight", "net.2.bias"]
            if not all_delayed
            else [n for n, _ in model.named_parameters()]
        )
        named = [(n, p) for n, p in model.named_parameters() if n in names]
        ddp = GradsyncDDP(
            model, process_group=group, delay_all_reduce_named_params=named,
            param_to_hook_all_reduce=model.net[0].weight,  # its gradient comes last
        )
        if not all_delayed:
            assert "net.2.weight" not in ddp.reducer.names
        else:
            assert ddp.reducer is None
        x = torch.full((2, 8), float(rank + 1))
        with ddp.no_sync():
            ddp(x).pow(2).sum().backward()  # accumulated locally first
        ddp(x).pow(2).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours = run_threaded(body, 2)
    model = seeded(lambda: __import__("models").MLP(), 0)
    for r in range(2):
        for _ in range(2):
            model(torch.full((2, 8), float(r + 1))).pow(2).sum().div(2).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[0][name], p.grad, msg=name)
        torch.testing.assert_close(ours[1][name], p.grad, msg=name)


def test_delayed_all_reduce_arguments_go_together():
    def body(rank, group):
        model = torch.nn.Linear(2, 2)
        GradsyncDDP(
            model, process_group=group, delay_all_reduce_named_params=[("weight", model.weight)]
        )

    with pytest.raises(RankError, match="go together"):
        run_threaded(body, 1)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("micro_steps", [1, 2])
def test_mixed_precision_computes_low_reduces_in_reduce_dtype_keeps_float32(
    reduce_dtype, micro_steps
):
    # torch's own DDP mixed precision, compared in tests/processes/test_mixed_precision_vs_torch.py,
    # cannot accumulate over no_sync steps (it raises), so the reference is computed directly.
    from torch.nn.parallel.distributed import _MixedPrecision

    config = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                             buffer_dtype=torch.bfloat16)

    def data(rank, j):
        return torch.linspace(-1, 1, 16).view(2, 8) * (rank + 1) + j

    def body(rank, group):
        model = seeded(lambda: __import__("models").WithBatchNorm(), 0)
        ddp = GradsyncDDP(model, process_group=group, mixed_precision=config)
        assert model.bn.running_mean.dtype == torch.bfloat16
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for j in range(micro_steps):
            ctx = ddp.no_sync() if j < micro_steps - 1 else contextlib.nullcontext()
            with ctx:
                ddp(data(rank, j)).float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(g.dtype == torch.float32 for g in grads.values())
        opt.step()
        return grads

    import contextlib

    ours = run_threaded(body, 2)
    # Reference: each rank's bf16 gradients, accumulated in float32 over the no_sync steps; the
    # synchronised step's backward adds its own in bf16 (autograd accumulates in the parameter's
    # dtype); then, as torch's mixed-precision hook: cast to the reduce dtype, summed, divided by 2.
    per_rank = []
    for rank in range(2):
        model = seeded(lambda: __import__("models").WithBatchNorm(), 0)
        model.bn.to(torch.bfloat16)
        acc = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        low = seeded(lambda: __import__("models").WithBatchNorm(), 0).to(torch.bfloat16)
        for j in range(micro_steps):
            low.zero_grad()
            low(data(rank, j).to(torch.bfloat16)).float().pow(2).mean().backward()
            for n, p in low.named_parameters():
                last = j == micro_steps - 1
                acc[n] = (
                    (acc[n].to(torch.bfloat16) + p.grad).float()
                    if last
                    else acc[n] + p.grad.float()
                )
        per_rank.append(acc)
    for name in ours[0]:
        want = (
            (per_rank[0][name].to(reduce_dtype) + per_rank[1][name].to(reduce_dtype))
            .div_(2)
            .float()
        )
        torch.testing.assert_close(ours[0][name], want, msg=name, rtol=0, atol=0)
        torch.testing.assert_close(ours[0][name], ours[1][name], rtol=0, atol=0)


def test_late_gradient_through_the_wrapper_is_still_an_error():
    def body(rank, group):
        ddp = GradsyncDDP(seeded(_CheckpointedShared, 0), process_group=group)
        ddp(torch.ones(2, 8)).sum().backward()

    with pytest.raises(
        RankError, match=r"(?s)'shared\.(weight|bias)'.*marked ready for reduction twice"
    ):
        run_threaded(body, 2)


def test_backward_through_the_unwrapped_module_after_a_step_is_local_as_under_torch():
    def body(rank, group, cls):
        model = seeded(MODELS["mlp"], 0)
        ddp = cls(model, process_group=group)
        ddp(torch.ones(2, 8)).sum().backward()
        model.zero_grad()
        model(torch.full((2, 8), float(rank + 1))).sum().backward()  # no wrapper: no sync
        return [p.grad.clone() for p in model.parameters()]

    ours, theirs = run_threaded(body, 2, GradsyncDDP), run_threaded(body, 2, TorchDDP)
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(ours[0][0], ours[1][0])  # each rank kept its own gradient


def test_mixed_precision_leaves_a_gradient_unused_everywhere_untouched_in_float32():
    # The full-precision .grad tensors are put back as they were and overwritten with the
    # averages (no float32 copy of each local gradient first); one unused on every rank keeps
    # its tensor and values, as torch leaves it.
    from torch.nn.parallel.distributed import _MixedPrecision

    def body(rank, group):
        model = seeded(lambda: __import__("models").UnusedBranch(), 0)
        ddp = GradsyncDDP(model, process_group=group, find_unused_parameters=True,
                          mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp(torch.ones(2, 8)).float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        # left from before
        spare = model.spare.weight.grad = torch.full_like(model.spare.weight, 3.0)
        ddp(torch.ones(2, 8) * (rank + 1)).float().sum().backward()
        return spare, model.spare.weight.grad, {n: p.grad for n, p in model.named_parameters()}

    for spare_before, spare_after, grads in run_threaded(body, 2):
        assert spare_after is spare_before and torch.equal(
            spare_after, torch.full_like(spare_after, 3.0)
        )
        assert all(g is None or g.dtype == torch.float32 for g in grads.values())
        assert grads["used.weight"].dtype == torch.float32 and grads["used.weight"].abs().sum() > 0


class _ChannelsLastConvs(torch.nn.Module):
    """A first convolution with one input channel (its weight is contiguous in both memory
    formats) and a second with several (channels-last only), in channels-last memory."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.second = torch.nn.Conv2d(4, 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


@pytest.mark.parametrize("as_view", [False, True])
def test_gradients_keep_the_strides_torch_ddp_gives_them_in_channels_last(as_view):
    # torch's reducer views each dense parameter's slice of its bucket with the parameter's own
    # strides (as_strided), so a weight contiguous in two memory formats at once keeps the
    # channels-last strides of its size-1 dimension; `view` would give it standard ones.
    def body(rank, group):
        x = seeded(lambda: torch.randn(2, 1, 6, 6), rank).to(memory_format=torch.channels_last)
        out = []
        for cls in (GradsyncDDP, TorchDDP):
            model = seeded(_ChannelsLastConvs, 0).to(memory_format=torch.channels_last)
            ddp = cls(
                model, process_group=group, gradient_as_bucket_view=as_view, bucket_cap_mb=0.0001
            )
            for _ in range(2):
                ddp(x).square().sum().backward()
            out.append(
                {
                    n: (p.grad.clone(), p.grad.stride(), p.stride())
                    for n, p in model.named_parameters()
                }
            )
        return out

    for ours, theirs in run_threaded(body, 2):
        assert ours.keys() == theirs.keys()
        for name, (grad, stride, param_stride) in ours.items():
            assert torch.equal(grad, theirs[name][0]), name
            assert (stride, param_stride) == theirs[name][1:], (name, stride, theirs[name][1])
        if as_view:  # the case that tells `as_strided` from `view` apart is there
            assert theirs["first.weight"][1] == (9, 1, 3, 1)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_world_of_one_copies_gradients_in_without_a_scaling_pass(world_size):
    # x * 1.0 is x bit for bit, so at world size 1 (one GPU) the fill skips the multiply every
    # bucket would otherwise get; the parameters are torch's DDP's all the same.
    from unittest import mock

    def body(rank, group):
        return train_wrapper(GradsyncDDP, rank, group, "many_small", batches), \
            train_wrapper(TorchDDP, rank, group, "many_small", batches)

    def counted(owner, name):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            # not the optimizer's
            if sys._getframe(1).f_globals.get("__name__", "").startswith("gradsync."):
                scaled.append(name)
            return original(*args, **kwargs)

        return mock.patch.object(owner, name, call)

    batches, scaled = make_batches(STEPS, world_size), []
    with counted(torch.Tensor, "mul_"), counted(torch, "_foreach_mul_"), counted(torch, "mul"):
        results = run_threaded(body, world_size, timeout=60)
    for ours, theirs in results:
        assert_records_equal(ours, theirs, exact=True, what=f"world size {world_size}")
    assert (len(scaled) == 0) == (world_size == 1), scaled
