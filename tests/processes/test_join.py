"""Uneven inputs with `join()`: real processes on torch's default group (Join's own collectives
use `torch.distributed` functions), gradsync side by side with torch's DDP."""

from __future__ import annotations

import pytest
import torch
from models import MODELS
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import RankError, run_processes, run_threaded, seeded


def _train_uneven(
    rank, cls, model_name, batches, divide, throw, find_unused, report=False, mixed=False
):
    from torch.nn.parallel.distributed import _MixedPrecision

    model = seeded(MODELS[model_name], 0)
    precision = (
        {"mixed_precision": _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if mixed
        else {}
    )
    ddp = cls(model, find_unused_parameters=find_unused, **precision)
    if report:  # the used map all-gathered instead of all-reduced
        ddp.report_unused_parameters()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(4, 8, generator=g) for _ in range(batches[rank])]
    try:
        with ddp.join(divide_by_initial_world_size=divide, throw_on_early_termination=throw):
            for x in data:
                opt.zero_grad()
                ddp(x).pow(2).mean().backward()
                opt.step()
    except RuntimeError as error:
        return "raised: " + str(error)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return state


def _both(rank, group, model_name, batches, divide, throw, find_unused):
    args = (model_name, batches, divide, throw, find_unused)
    return _train_uneven(rank, GradsyncDDP, *args), _train_uneven(rank, TorchDDP, *args)


@pytest.mark.parametrize(
    "batches,divide,model_name,find_unused",
    [
        ((5, 3), True, "mlp", False),
        ((2, 6), False, "mlp", False),
        ((5, 3), True, "batchnorm", False),
        ((4, 6, 2), True, "mlp", False),
        ((3, 5), True, "unused_branch", True),
    ],
)
def test_uneven_inputs_finish_and_match_torch(batches, divide, model_name, find_unused):
    results = run_processes(
        _both, len(batches), model_name, batches, divide, False, find_unused,
        timeout=120, default_group=True,
    )
    exact = len(batches) == 2
    reference = results[0][0]
    for rank, (ours, theirs) in enumerate(results):
        for name, value in ours.items():
            tol = {"rtol": 0, "atol": 0} if exact else {}
            torch.testing.assert_close(value, theirs[name], msg=f"rank {rank} {name}", **tol)
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0)


def _options(rank, group, report, mixed):
    plain = _train_uneven(
        rank, GradsyncDDP, "unused_branch", (5, 3), True, False, True, mixed=mixed
    )
    return plain, _train_uneven(
        rank, GradsyncDDP, "unused_branch", (5, 3), True, False, True, report, mixed
    )


@pytest.mark.parametrize("report,mixed", [(True, False), (False, True), (True, True)])
def test_a_joined_rank_answers_the_reported_used_map_and_mixed_precision(report, mixed):
    # Its shadow sends what an active rank sends: the used map all-gathered when reported, the
    # buckets in the reduce dtype under mixed precision; every rank ends with the same model.
    results = run_processes(_options, 2, report, mixed, timeout=120, default_group=True)
    for name, value in results[0][1].items():
        assert torch.equal(value, results[1][1][name]), name
        if report:  # reporting changes nothing but what is recorded
            assert torch.equal(value, results[0][0][name]), name


def test_throw_on_early_termination_raises_on_every_rank():
    results = run_processes(
        _both, 2, "mlp", (2, 5), True, True, False, timeout=120, default_group=True
    )
    for ours, theirs in results:
        assert isinstance(ours, str) and ours.startswith("raised"), ours
        assert isinstance(theirs, str) and theirs.startswith("raised"), theirs
    assert "exhausted all inputs" in results[0][0]
    assert "Detected at least one rank that exhausted inputs" in results[1][0]


def _train_zero_uneven(
    rank,
    wrapper,
    optimizer,
    batches,
    divide,
    overlap=False,
    find_unused=False,
    hook=False,
    mixed=False,
    inside=False,
):
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel.distributed import _MixedPrecision

    from gradsync import ZeroRedundancyOptimizer

    model = seeded(MODELS["unused_branch" if find_unused else "mlp"], 0)
    options = {"bucket_cap_mb": 0.001} if wrapper is GradsyncDDP else {}
    if mixed:
        options["mixed_precision"] = _MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    ddp = wrapper(model, find_unused_parameters=find_unused, **options)
    if hook:
        from gradsync.comm_hooks import fp16_compress_hook

        ddp.register_comm_hook(None, fp16_compress_hook)
    kwargs = {"lr": 0.01}
    if optimizer == "plain":
        opt = torch.optim.Adam(model.parameters(), **kwargs)
    elif optimizer == "torch zero":
        opt = TorchZero(model.parameters(), torch.optim.Adam, **kwargs)
    else:
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.Adam,
            shard_gradients=optimizer == "zero-2",
            overlap_param_gather=overlap,
            overlap_with_ddp=inside,
            **kwargs,
        )
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(4, 8, generator=g) for _ in range(batches[rank])]
    # ZeRO-2 joins with it
    joined = (ddp.join(divide_by_initial_world_size=divide) if optimizer in ("plain", "zero-2")
              else Join([ddp, opt], divide_by_initial_world_size=divide))
    with joined:
        for x in data:
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
    if hasattr(opt, "wait_parameters"):
        opt.wait_parameters()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _zero_variants(rank, group, batches, divide, overlap, find_unused):
    args = (batches, divide, overlap, find_unused)
    return {
        "torch DDP + torch ZeRO": _train_zero_uneven(rank, TorchDDP, "torch zero", *args),
        "torch DDP + gradsync ZeRO-1": _train_zero_uneven(rank, TorchDDP, "zero-1", *args),
        "gradsync DDP + Adam": _train_zero_uneven(rank, GradsyncDDP, "plain", *args),
        "gradsync DDP + gradsync ZeRO-1": _train_zero_uneven(rank, GradsyncDDP, "zero-1", *args),
        "gradsync DDP + gradsync ZeRO-2": _train_zero_uneven(rank, GradsyncDDP, "zero-2", *args),
    }


def _hooked_variants(rank, group, batches):
    return {
        v: _train_zero_uneven(rank, GradsyncDDP, v, batches, True, hook=True)
        for v in ("plain", "zero-1", "zero-2")
    }


def _mixed_variants(rank, group, batches, overlap):
    return {v: _train_zero_uneven(rank, GradsyncDDP, v, batches, True, overlap=overlap, mixed=True)
            for v in ("plain", "zero-2")}


def _inside_variants(rank, group, batches):
    return {
        f"{v} {mixed}": _train_zero_uneven(
            rank,
            GradsyncDDP,
            v,
            batches,
            True,
            mixed=mixed == "mixed",
            inside=v != "plain",
            overlap=v == "zero-2",
        )
        for v in ("plain", "zero-1", "zero-2")
        for mixed in ("fp32", "mixed")
    }


def test_optimizers_stepping_inside_backward_join_uneven_inputs():
    # overlap_with_ddp: the ranks still training step inside backward (after the wrapper's
    # mixed-precision restore), a joined rank through its join hook, in the same order of
    # collectives: the plain optimizer's parameters, ZeRO-1 and ZeRO-2, float32 and bf16.
    for rank, got in enumerate(
        run_processes(_inside_variants, 2, (5, 3), timeout=180, default_group=True)
    ):
        for mixed in ("fp32", "mixed"):
            for variant in ("zero-1", "zero-2"):
                for name, value in got[f"plain {mixed}"].items():
                    torch.testing.assert_close(
                        got[f"{variant} {mixed}"][name],
                        value,
                        rtol=0,
                        atol=0,
                        msg=f"rank {rank} {variant} {mixed} {name}",
                    )


@pytest.mark.parametrize("overlap", [False, True])
def test_sharded_gradients_join_uneven_inputs_under_mixed_precision(overlap):
    # A joined rank's shadow casts its zeroed bf16 buckets to the reduce dtype as the active
    # ranks do and keeps its float32 shard: ZeRO-2 ends with the plain optimizer's parameters.
    for rank, got in enumerate(
        run_processes(_mixed_variants, 2, (5, 3), overlap, timeout=180, default_group=True)
    ):
        for name, value in got["plain"].items():
            torch.testing.assert_close(
                got["zero-2"][name], value, rtol=0, atol=0, msg=f"rank {rank} {name}"
            )


def test_sharded_optimizers_join_with_a_compression_hook():
    # The fp16 hook shards with the gradients (ZeRO-2) or runs whole (ZeRO-1, plain): a
    # joined rank answers it either way and steps its share with the averages.
    for rank, got in enumerate(
        run_processes(_hooked_variants, 2, (5, 3), timeout=180, default_group=True)
    ):
        for variant in ("zero-1", "zero-2"):
            for name, value in got["plain"].items():
                torch.testing.assert_close(
                    got[variant][name], value, rtol=0, atol=0, msg=f"rank {rank} {variant} {name}"
                )


@pytest.mark.parametrize("batches,divide,overlap,find_unused", [
    ((5, 3), True, False, False),
    ((2, 5), False, True, False),
    ((3, 5), True, False, True),
    ((4, 6, 2), True, True, False),
])
def test_sharded_optimizers_join_uneven_inputs(batches, divide, overlap, find_unused):
    # Over torch's DDP, gradsync's class does what torch's does (a joined rank steps its share
    # with its last gradients again). Over gradsync's wrapper the joined rank steps its share
    # with each iteration's averages, so ZeRO-1 and ZeRO-2 end with the parameters of the
    # plain optimizer, whose joined rank does not step at all.
    results = run_processes(_zero_variants, len(batches), batches, divide, overlap, find_unused,
                            timeout=180, default_group=True)
    exact = {"rtol": 0, "atol": 0} if len(batches) == 2 else {"rtol": 1e-5, "atol": 1e-6}
    for rank, got in enumerate(results):
        for name, value in got["torch DDP + torch ZeRO"].items():
            torch.testing.assert_close(
                got["torch DDP + gradsync ZeRO-1"][name],
                value,
                rtol=0,
                atol=0,
                msg=f"rank {rank} {name}: over torch's DDP",
            )
        for variant in ("gradsync DDP + gradsync ZeRO-1", "gradsync DDP + gradsync ZeRO-2"):
            for name, value in got["gradsync DDP + Adam"].items():
                torch.testing.assert_close(
                    got[variant][name], value, msg=f"rank {rank} {variant} {name}", **exact
                )
                torch.testing.assert_close(
                    got[variant][name], results[0][variant][name], rtol=0, atol=0
                )


def _mesh_body(rank, group):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    model = seeded(MODELS["mlp"], 0)
    ddp = GradsyncDDP(model, device_mesh=mesh)
    ddp(torch.full((2, 8), float(rank))).sum().backward()
    try:
        GradsyncDDP(seeded(MODELS["mlp"], 0), device_mesh=mesh, process_group=group)
    except RuntimeError as error:
        both = str(error)
    return model.net[0].weight.grad.clone(), both


def test_device_mesh_selects_the_group():
    (g0, m0), (g1, _) = run_processes(_mesh_body, 2, timeout=120, default_group=True)
    assert torch.equal(g0, g1)
    assert "either process_group or device_mesh" in m0


def test_join_with_planned_buckets_is_refused_before_any_collective():
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["mlp"], 0), process_group=group, bucket_cap_mb="auto")
        with ddp.join():
            pass

    with pytest.raises(RankError, match='does not support bucket_cap_mb="auto"'):
        run_threaded(body, 2, timeout=30)


def _overlapped_uneven(rank, group, batches):
    """overlap_optimizer inside join(), against torch's DDP with SGD stepped after backward;
    gradsync's side also says whether it measured its tail."""
    out = []
    for cls in (GradsyncDDP, TorchDDP):
        model = seeded(MODELS["mlp"], 0)
        ddp = cls(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if cls is GradsyncDDP:
            opt = ddp.overlap_optimizer(opt)
        g = torch.Generator().manual_seed(rank)
        with ddp.join():
            for x in [torch.randn(4, 8, generator=g) for _ in range(batches[rank])]:
                ddp(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        getattr(opt, "wait", lambda: None)()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if cls is GradsyncDDP:
            out.append(ddp.measured_tail)
    return out


def test_overlapped_optimizer_joins_uneven_inputs_without_measuring_its_tail():
    # The tail is measured at the 6th synchronised forward by a collective of the ranks still
    # training, which a joined rank would not mirror: inside join() it is not measured, and
    # the ranks finish with torch's parameters.
    for rank, (ours, measured, theirs) in enumerate(
        run_processes(_overlapped_uneven, 2, (8, 5), timeout=180, default_group=True)
    ):
        assert measured is None
        for name, value in theirs.items():
            torch.testing.assert_close(ours[name], value, rtol=0, atol=0,
                                       msg=f"rank {rank} {name}")
