"""gradsync's mixed precision against torch's own `_MixedPrecision` DDP, running on CPU
(tests/torch_mp_on_cpu.py), in real processes on torch's default gloo group, bit for bit.

Each case trains the same model (Linear layers, a BatchNorm or a LayerNorm) on the same data with
SGD and momentum, and compares every step's `.grad` (dtype and value) and parameter dtype after
backward, the outputs, and the final parameters and buffers by name, with their dtypes. torch
runs twice first: two runs must agree bit for bit, or it is no reference.

torch's first iteration reduces garbage (two with static_graph; see `torch_mp_on_cpu._warm_up`),
so torch's runs discard them. gradsync's runs keep theirs at 2 ranks, where the layout of the
buckets cannot change a sum (a + b == b + a). At 3 ranks gloo sums each element in an order
that depends on where it lies in its bucket; both sides then discard a first iteration, so that
both reduce in their rebuilt layouts (which must then agree).

Where torch's own raises (no_sync, find_unused_parameters, a communication hook on top, a
forward without grad), one test asserts that it still does, another what gradsync does instead,
against torch's own results or a reference that follows torch's arithmetic.

A spawn costs seconds on this machine: one spawn per world size runs every case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _MixedPrecision
from torch_mp_on_cpu import Net, batches, differences, loss, on_cpu, train

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import run_processes

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# name: (_MixedPrecision arguments, train() options for both sides, torch's discarded iterations)
CASES = {
    "reduce fp32, buffers bf16": ({"reduce_dtype": FP32, "buffer_dtype": BF16}, {}, 1),
    "reduce bf16, buffers bf16": ({"reduce_dtype": BF16, "buffer_dtype": BF16}, {}, 1),
    "reduce fp16, buffers unset": ({"reduce_dtype": FP16}, {"batchnorm": False}, 1),
    "reduce unset, buffers unset": ({}, {"batchnorm": False}, 1),
    "reduce fp32, grads kept as zeros": (
        {"reduce_dtype": FP32, "buffer_dtype": BF16},
        {"set_to_none": False},
        1,
    ),
    "reduce fp32, static_graph": (
        {"reduce_dtype": FP32, "buffer_dtype": BF16},
        {"static_graph": True},
        2,
    ),
}
AT_THREE = ("reduce fp32, buffers bf16", "reduce bf16, buffers bf16", "reduce fp16, buffers unset")


def _config(**kwargs: torch.dtype) -> _MixedPrecision:
    return _MixedPrecision(param_dtype=BF16, **kwargs)


def _parity(
    rank: int, names: tuple[str, ...], ours_warm_up: bool
) -> dict[str, dict[str, list[str]]]:
    found = {}
    for name in names:
        kwargs, options, discard = CASES[name]
        first = train(TorchDDP, rank, _config(**kwargs), warm_up=discard, **options)
        again = train(TorchDDP, rank, _config(**kwargs), warm_up=discard, **options)
        ours = train(
            GradsyncDDP, rank, _config(**kwargs), warm_up=discard if ours_warm_up else 0, **options
        )
        found[name] = {
            "torch vs torch": differences(again, first),
            "gradsync vs torch": differences(ours, first),
            "buffer dtypes": {
                k: v.dtype
                for k, v in first["state"].items()
                if k.startswith(("norm.r", "norm.n", "scale"))
            },
        }
    return found


def _raised(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


def _torch_no_sync(rank: int) -> None:
    with on_cpu():
        torch.manual_seed(0)
        ddp = TorchDDP(Net(), mixed_precision=_config(reduce_dtype=FP32, buffer_dtype=BF16))
        for j, (x, y) in enumerate(batches(rank, 2)):
            if j == 0:
                with ddp.no_sync():
                    loss(ddp(x), y).backward()
            else:
                loss(ddp(x), y).backward()


def _what_torch_raises(rank: int) -> dict[str, str]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    config = _config(reduce_dtype=FP32, buffer_dtype=BF16)
    return {
        "no_sync": _raised(_torch_no_sync, rank),
        "find_unused_parameters": _raised(
            train, TorchDDP, rank, config, steps=2, warm_up=1, find_unused_parameters=True
        ),
        "comm hook": _raised(train, TorchDDP, rank, config, steps=1, hook=allreduce_hook),
        "eval forward": _raised(
            train, TorchDDP, rank, config, steps=1, warm_up=1, eval_forwards=True
        ),
        # param_dtype=None reaches the C++ reducer as a dtype read from None (uint8 here).
        "reduce_dtype alone": _raised(
            train,
            TorchDDP,
            rank,
            _MixedPrecision(reduce_dtype=FP16),
            steps=1,
            warm_up=1,
            batchnorm=False,
        ),
    }


def _instead_of_torch(rank: int) -> dict[str, list[str]]:
    """gradsync where torch's own raises. Against torch's own where the arithmetic is torch's
    (at 2 ranks a communication hook that divides before summing sums what torch's divides
    after); against `_no_sync_reference` for gradient accumulation, which torch cannot do."""
    from gradsync.comm_hooks import allreduce_hook

    config = _config(reduce_dtype=BF16, buffer_dtype=BF16)
    torchs = train(TorchDDP, rank, config, warm_up=1)
    return {
        "find_unused_parameters": differences(
            train(GradsyncDDP, rank, config, spare=True, find_unused_parameters=True),
            torchs,
            skip=("spare",),
        ),
        "comm hook": differences(train(GradsyncDDP, rank, config, hook=allreduce_hook), torchs),
        "eval forward": differences(train(GradsyncDDP, rank, config, eval_forwards=True), torchs),
        "no_sync, reduce fp32": _no_sync_differences(rank, FP32),
        "no_sync, reduce bf16": _no_sync_differences(rank, BF16),
        "reduce_dtype alone": _reduce_only_differences(rank),
    }


def _reduce_only_differences(rank: int) -> list[str]:
    """`_MixedPrecision(reduce_dtype=fp16)` alone (torch's documented meaning: parameters and
    buffers stay float32): each rank's float32 gradients cast to fp16, summed, divided there."""
    torch.manual_seed(0)
    model = Net(batchnorm=False)
    ddp = GradsyncDDP(model, mixed_precision=_MixedPrecision(reduce_dtype=FP16))
    x, y = batches(rank, 1)[0]
    loss(ddp(x), y).backward()
    torch.manual_seed(0)
    plain = Net(batchnorm=False)
    loss(plain(x), y).backward()
    everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, {n: p.grad for n, p in plain.named_parameters()})
    want = {
        n: sum(r[n].to(FP16) for r in everyone).div_(len(everyone)).float() for n in everyone[0]
    }
    return differences({n: p.grad for n, p in model.named_parameters()}, want)


def _no_sync_differences(rank: int, reduce_dtype: torch.dtype, micro_steps: int = 3) -> list[str]:
    config = _config(reduce_dtype=reduce_dtype, buffer_dtype=BF16)
    torch.manual_seed(0)
    model = Net()
    ddp = GradsyncDDP(model, mixed_precision=config)
    data = batches(rank, micro_steps)
    for j, (x, y) in enumerate(data):
        if j < micro_steps - 1:
            with ddp.no_sync():
                loss(ddp(x), y).backward()
        else:
            loss(ddp(x), y).backward()
    ours = {n: p.grad for n, p in model.named_parameters()}
    want = _no_sync_reference(data, reduce_dtype)
    return differences({"grads": ours, "dtypes": [p.dtype for p in model.parameters()]},
                       {"grads": want, "dtypes": [FP32] * len(want)})


def _no_sync_reference(
    data: list[tuple[torch.Tensor, torch.Tensor]], reduce_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Each rank's bf16 gradients, summed in float32 over the no_sync steps (gradsync's
    choice); then torch's arithmetic for the synchronised step: the accumulated gradient cast
    down to bf16 before forward (`_root_copy_hook`), the step's own added by autograd in bf16,
    cast to the reduce dtype, summed over the ranks, divided by 2 there, cast up."""
    torch.manual_seed(0)
    low = Net().to(BF16)  # the cast copy the wrapper computes with (running statistics aside)
    accumulated: dict[str, torch.Tensor] = {}
    for j, (x, y) in enumerate(data):
        low.zero_grad()
        loss(low(x.to(BF16)), y).backward()
        for n, p in low.named_parameters():
            if j < len(data) - 1:
                accumulated[n] = (
                    accumulated[n] + p.grad.float() if n in accumulated else p.grad.float()
                )
            else:
                accumulated[n] = accumulated[n].to(BF16) + p.grad
    everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, accumulated)
    return {
        n: sum(r[n].to(reduce_dtype) for r in everyone).div_(len(everyone)).float()
        for n in accumulated
    }


def _at_two(rank: int, group: object) -> dict[str, object]:
    return {
        "parity": _parity(rank, tuple(CASES), ours_warm_up=False),
        "torch raises": _what_torch_raises(rank),
        "gradsync instead": _instead_of_torch(rank),
    }


def _at_three(rank: int, group: object) -> dict[str, object]:
    return {"parity": _parity(rank, AT_THREE, ours_warm_up=True)}


@pytest.fixture(scope="module")
def at_two() -> list[dict[str, object]]:
    return run_processes(_at_two, 2, timeout=150, default_group=True)


@pytest.fixture(scope="module")
def at_three() -> list[dict[str, object]]:
    return run_processes(_at_three, 3, timeout=150, default_group=True)


def _assert_parity(results: list[dict[str, object]], names: tuple[str, ...]) -> None:
    for rank, result in enumerate(results):
        for name in names:
            found = result["parity"][name]
            assert found["torch vs torch"] == [], (
                f"rank {rank}, {name}: torch's own is no reference"
            )
            assert found["gradsync vs torch"] == [], (
                f"rank {rank}, {name}: {found['gradsync vs torch'][:8]}"
            )


@pytest.mark.timeout(170)
def test_gradsync_equals_torchs_own_mixed_precision_at_two_ranks(at_two):
    _assert_parity(at_two, tuple(CASES))
    # The buffers compared include an integer one, cast as torch casts every buffer.
    dtypes = at_two[0]["parity"]["reduce fp32, buffers bf16"]["buffer dtypes"]
    assert (
        dtypes["norm.num_batches_tracked"] == BF16 and dtypes["norm.running_mean"] == BF16
    ), dtypes
    assert at_two[0]["parity"]["reduce fp16, buffers unset"]["buffer dtypes"]["scale"] == FP32


@pytest.mark.timeout(170)
def test_gradsync_equals_torchs_own_mixed_precision_at_three_ranks(at_three):
    # At 3 ranks dividing before the sum would round differently: torch divides after it.
    _assert_parity(at_three, AT_THREE)


@pytest.mark.timeout(170)
def test_torchs_own_mixed_precision_still_raises_where_gradsync_goes_on(at_two):
    # If one of these starts working in a new torch, compare gradsync against it instead.
    for result in at_two:
        raised = result["torch raises"]
        assert raised["no_sync"].startswith(
            "RuntimeError: Expected to mark a variable ready only once"
        ), raised
        assert raised["find_unused_parameters"].startswith("AttributeError"), raised
        assert raised["comm hook"].startswith(
            "RuntimeError: register_comm_hook or register_builtin_comm_hook can only be called once"
        ), raised
        assert raised["eval forward"].startswith("AttributeError"), raised
        assert raised["reduce_dtype alone"] != "no error", raised


@pytest.mark.timeout(170)
def test_where_torchs_own_raises_gradsync_follows_torchs_arithmetic(at_two):
    for rank, result in enumerate(at_two):
        for case, found in result["gradsync instead"].items():
            assert found == [], f"rank {rank}, {case}: {found[:8]}"
