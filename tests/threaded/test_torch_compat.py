"""gradsync's wrapper as frameworks see it: an instance of torch's DDP class without torch's
reducer, torch's names for what frameworks call (`_get_ddp_logging_data`, `_set_static_graph`,
`reducer.prepare_for_backward` after a forward that did not prepare, ...), each against torch's
DDP side by side on the same gloo groups; and `patch_torch_ddp`, which needs no group."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.parallel
import torch.nn.parallel.distributed
from models import make_batches
from parity import _build, _loss, _run, _shard, assert_records_equal
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

import gradsync
from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import run_threaded, seeded

STEPS = 3


# ----------------------------------------------------------------------------- the class


def test_is_an_instance_of_torchs_class_without_torchs_reducer_or_hooks():
    def body(rank, group):
        model = seeded(lambda: __import__("models").MODELS["mlp"](), 0)
        ddp = GradsyncDDP(model, process_group=group)
        hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
        return (isinstance(ddp, torch.nn.parallel.DistributedDataParallel),
                isinstance(ddp.reducer, gradsync.Reducer), hasattr(ddp, "logger"), hooks)

    is_ddp, ours, has_logger, hooks = run_threaded(body, 2)[0]
    assert is_ddp and ours and not has_logger
    assert set(hooks) == {1}  # gradsync's one hook per parameter; torch's reducer adds none
    assert issubclass(GradsyncDDP, TorchDDP)


def test_torchs_internals_raise_an_error_naming_them():
    def body(rank, group):
        ddp = GradsyncDDP(_build("mlp"), process_group=group)
        errors = []
        for call in (
            lambda: ddp._sync_buffers(),
            lambda: ddp._register_fused_optim(torch.optim.SGD),
            lambda: ddp.reducer._push_all_rebuilt_params(),
        ):
            with pytest.raises((NotImplementedError, AttributeError)) as info:
                call()
            errors.append(str(info.value))
        return errors

    sync, fused, pushed = run_threaded(body, 2)[0]
    assert "DistributedDataParallel._sync_buffers" in sync and "gradsync" in sync
    assert "_register_fused_optim" in fused
    assert "reducer._push_all_rebuilt_params" in pushed and "C++-reducer" in pushed


def test_to_kwargs_moves_inputs_as_torchs_does():
    def body(rank, group):
        got = []
        for cls in (GradsyncDDP, TorchDDP):
            ddp = cls(seeded(Switch, 0), process_group=group)
            got.append(ddp.to_kwargs((torch.ones(2), [torch.zeros(1)]), {"x": torch.ones(3)}, 0))
        return got

    for ours, theirs in run_threaded(body, 2, timeout=60):
        assert repr(ours) == repr(theirs) and repr(ours).startswith("(((tensor([1., 1.]")


@pytest.mark.parametrize("kwargs", [
    {"broadcast_buffers": False},
    {"broadcast_buffers": True, "forward_sync_buffers": True},
    {"check_reduction": True},
])
def test_deprecated_arguments_warn_as_torchs_do(kwargs):
    import warnings

    def body(rank, group):
        for cls in (GradsyncDDP, TorchDDP):
            cls(seeded(Switch, 0), process_group=group, **kwargs)

    # Recorded here: catch_warnings swaps a global, so not inside the rank threads.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_threaded(body, 2, timeout=60)
    name = next(iter(kwargs))
    future = [str(w.message) for w in caught
              if w.category is FutureWarning and name in str(w.message)]
    ours = [m for m in future if m.startswith(f"DistributedDataParallel({name}=")]
    assert len(ours) == 2 and len(future) == 4, future  # each rank: ours, and torch's


# --------------------------------------------------------------------- torch's names


class Switch(__import__("models").UnusedBranch):
    """`spare` takes part only while `use_spare` is set."""

    use_spare = False

    def forward(self, x):
        h = torch.relu(self.used(x))
        return self.out(h + torch.relu(self.spare(x)) if self.use_spare else h)


def _same_keys_as_torch(rank, group, kwargs, steps_fn):
    out = {}
    for cls in (GradsyncDDP, TorchDDP):
        model = seeded(Switch, 0)
        ddp = cls(model, process_group=group, **kwargs)
        for i, x in enumerate(make_batches(4, group.size())):
            steps_fn(ddp, _shard(x, rank, group.size()), i)
        out[cls.__module__.split(".")[0]] = (ddp._get_ddp_logging_data(), ddp.bucket_bytes_cap,
                                             ddp.will_sync_module_buffers())
    return out


SHARED_KEYS = ("world_size", "rank", "module_name", "backend_name", "bucket_cap_bytes",
               "find_unused_parameters", "gradient_as_bucket_view", "broadcast_buffers",
               "num_parameter_tensors", "total_parameter_size_bytes", "device_ids", "output_device",
               "is_multi_device_module", "has_sync_bn", "comm_hook", "static_graph")


@pytest.mark.parametrize("kwargs", [
    {"find_unused_parameters": True, "bucket_cap_mb": 1},
    {"static_graph": True, "broadcast_buffers": False, "gradient_as_bucket_view": True},
])
def test_logging_data_has_torchs_keys_with_torchs_values(kwargs):
    def step(ddp, x, _i):
        _loss(ddp(x)).backward()

    result = run_threaded(_same_keys_as_torch, 2, kwargs, step)[1]
    (ours, our_cap, our_sync), (theirs, their_cap, their_sync) = result["gradsync"], result["torch"]
    assert {k: ours.get(k) for k in SHARED_KEYS} == {k: theirs.get(k) for k in SHARED_KEYS}
    assert (our_cap, our_sync) == (their_cap, their_sync)
    assert ours["gradsync"] == 1 and ours["iteration"] == 4 and "avg_backward_comm_time" in ours


def test_can_set_static_graph_is_zero_once_the_unused_parameters_change():
    def flip(ddp, x, i):  # the branch is used in odd steps only: the graph is not static
        ddp.module.use_spare = i % 2 == 1
        _loss(ddp(x)).backward()

    def steady(ddp, x, _i):
        _loss(ddp(x)).backward()

    def body(rank, group):
        return [
            _same_keys_as_torch(rank, group, {"find_unused_parameters": True}, fn)
            for fn in (flip, steady)
        ]

    flipped, constant = run_threaded(body, 2)[0]
    assert flipped["gradsync"][0]["can_set_static_graph"] == 0
    # torch writes it once per process (absent here if an earlier test's DDP did), 0 once the
    # graph changed and 1 only when the wrapper is destroyed; gradsync says 1 while it lives.
    assert flipped["torch"][0].get("can_set_static_graph", 0) == 0
    assert constant["gradsync"][0]["can_set_static_graph"] == 1


def _train(cls, rank, group, model_name, batches, step_kind, **kwargs):
    model = _build(model_name)
    ddp = cls(model, process_group=group, **kwargs)
    ws = group.size()
    if step_kind == "set_static_graph":
        ddp._set_static_graph()
    if step_kind == "builtin_hook":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)

    def plain(_i, batch):
        _loss(ddp(_shard(batch, rank, ws))).backward()

    def trigger_sync(_i, batch):  # Accelerate's trigger_sync_in_backward
        a, b = _shard(batch, rank, ws).chunk(2)
        with ddp.no_sync():
            loss_a, loss_b = _loss(ddp(a)), _loss(ddp(b))
        loss_a.backward()
        ddp.require_backward_grad_sync = ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        loss_b.backward()

    def manual(i, batch):
        # Lightning's manual optimisation: training_step runs inside the wrapper's forward and
        # calls backward there, after preparing the reducer itself; then the flag goes off for
        # the rest of that forward and on again after it.
        def inner_step(_module, _inputs, out):
            ddp.require_forward_param_sync = True
            ddp.reducer._rebuild_buckets()
            ddp.reducer.prepare_for_backward([out] if ddp.find_unused_parameters else [])
            _loss(out).backward()
            if ddp.static_graph and i == 0:  # Lightning: after the first backward only
                ddp.reducer._delay_all_reduce()
            ddp.require_backward_grad_sync = False

        handle = model.register_forward_hook(inner_step)
        ddp(_shard(batch, rank, ws))
        handle.remove()
        ddp.require_backward_grad_sync = True

    steps = {"trigger_sync": trigger_sync, "manual": manual}
    return _run(model, steps.get(step_kind, plain), batches)


def _both(rank, group, model_name, batches, step_kind, kwargs):
    return [
        _train(cls, rank, group, model_name, batches, step_kind, **kwargs)
        for cls in (GradsyncDDP, TorchDDP)
    ]


@pytest.mark.parametrize("model_name, step_kind, kwargs", [
    ("mlp", "trigger_sync", {}),
    ("mlp", "manual", {}),
    ("unused_branch", "manual", {"find_unused_parameters": True}),
    ("unused_branch", "manual", {"static_graph": True}),
    ("unused_branch", "set_static_graph", {}),
    ("mlp", "builtin_hook", {}),
])
def test_what_frameworks_call_gives_torchs_gradients(model_name, step_kind, kwargs):
    batches = make_batches(STEPS, 2, per_rank=4)
    for rank, (ours, theirs) in enumerate(
        run_threaded(_both, 2, model_name, batches, step_kind, kwargs, timeout=60)
    ):
        assert_records_equal(ours, theirs, exact=True, what=f"rank {rank} {step_kind}")


def test_set_static_graph_after_the_first_iteration_is_refused():
    def body(rank, group):
        ddp = GradsyncDDP(_build("mlp"), process_group=group)
        _loss(ddp(torch.ones(2, 8))).backward()
        with pytest.raises(RuntimeError, match="static_graph=True when wrapping"):
            ddp._set_static_graph()
        return True

    assert run_threaded(body, 2) == [True, True]


# ------------------------------------------------------------------ patch_torch_ddp


def _module_holding_the_name(name: str) -> types.ModuleType:
    """A module as a framework writes it: the class bound at import."""
    module = types.ModuleType(name)
    exec("from torch.nn.parallel.distributed import DistributedDataParallel", module.__dict__)
    sys.modules[name] = module
    return module


def test_patch_covers_both_places_and_modules_imported_before_and_after_then_undoes():
    TorchDDP = torch.nn.parallel.distributed.DistributedDataParallel  # noqa: N806  (this module's own is replaced too)
    before = _module_holding_the_name("framework_imported_before")
    try:
        with gradsync.patch_torch_ddp() as patch:
            after = _module_holding_the_name("framework_imported_after")
            assert torch.nn.parallel.DistributedDataParallel is GradsyncDDP
            assert torch.nn.parallel.distributed.DistributedDataParallel is GradsyncDDP
            assert before.DistributedDataParallel is GradsyncDDP
            assert after.DistributedDataParallel is GradsyncDDP
            # torch's own
            assert sys.modules["torch._dynamo.convert_frame"].DistributedDataParallel is TorchDDP
            assert gradsync.wrapper.torch_compat.TorchDDP is TorchDDP
            assert "framework_imported_before.DistributedDataParallel" in repr(patch)
        assert torch.nn.parallel.DistributedDataParallel is TorchDDP
        assert torch.nn.parallel.distributed.DistributedDataParallel is TorchDDP
        assert before.DistributedDataParallel is TorchDDP
        assert after.DistributedDataParallel is GradsyncDDP  # imported while patched: documented
    finally:
        sys.modules.pop("framework_imported_before", None)
        sys.modules.pop("framework_imported_after", None)


def test_patch_then_undo_leaves_torch_as_it_was():
    assert TorchDDP is gradsync.wrapper.torch_compat.TorchDDP
    patch = gradsync.patch_torch_ddp()
    assert "test_torch_compat.TorchDDP" in repr(patch)  # a test module is a framework too
    patch.undo()
    patch.undo()  # twice is harmless
    assert torch.nn.parallel.DistributedDataParallel is TorchDDP
    assert repr(patch) == "TorchDDPReplacement(undone)"


def test_forwards_that_overlap_across_threads_leave_no_wrapper_active():
    from gradsync.wrapper.ddp import ActiveForwards

    active, a, b = ActiveForwards(), object(), object()
    active.enter(a)
    active.enter(b)  # rank thread B starts its forward while A's runs
    assert TorchDDP._active_ddp_module is b
    active.leave(a)  # A ends first: B is still inside
    assert TorchDDP._active_ddp_module is b
    active.leave(b)  # saving and restoring "the one before" would leave A here, held for good
    assert TorchDDP._active_ddp_module is None
    active.enter(a)
    active.enter(a)  # nested: the inner leaves, the outer is still inside
    active.leave(a)
    assert TorchDDP._active_ddp_module is a
    active.leave(a)
    assert TorchDDP._active_ddp_module is None


def test_wrappers_of_rank_threads_are_freed_after_their_forwards():
    import gc
    import weakref

    def body(rank, group):
        ddp = GradsyncDDP(_build("mlp"), process_group=group)
        for _ in range(20):
            _loss(ddp(torch.ones(2, 8))).backward()
        return weakref.ref(ddp)

    refs = run_threaded(body, 2)
    gc.collect()
    assert TorchDDP._active_ddp_module is None and all(r() is None for r in refs)
