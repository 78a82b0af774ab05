"""Sharded gradients (ZeRO-2): `gradsync.ZeroRedundancyOptimizer` over a gradsync wrapper's
reduce-scattered buckets, against torch's DDP with the same unsharded optimizer, on real gloo
groups in threads. Two ranks sum in one order whatever the collective, so the parameters are
equal bit for bit there (clipping aside: its norm is summed from the shards', in another order);
memory per rank is the shards, not the gradients; bad input is refused before any collective."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from models import make_batches
from parity import _build, _loss, _shard
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import ZeroRedundancyOptimizer
from gradsync import comm_hooks as gradsync_hooks
from gradsync.testing import RankError, run_threaded

STEPS = 4
HOOKS = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "gradsync fp16": gradsync_hooks.fp16_compress_hook,
}
ADAM = (torch.optim.Adam, {"lr": 0.01})
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), "adam": ADAM,
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}


def _train(rank, group, world, batches, *, sharded, model_name="mlp", optimizer=ADAM, wrap=None,
           micro=1, clip=None, overlap=False, channels_last=False, native=False, wrapper=None,
           hook=None, hook_late=False, reduce_by=None, inside=False, call_step=True):
    cls, kwargs = optimizer
    model = _build(model_name)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    wrapper = wrapper or (GradsyncDDP if sharded else TorchDDP)
    ddp = wrapper(model, process_group=group, **(wrap or {}))
    if hook is not None and not hook_late:
        ddp.register_comm_hook(group, HOOKS[hook])
    if native:  # the device backends' way: reduce-scatter and all-gather themselves
        ddp.shard_gradients(reduce_by="reduce_scatter")
    elif reduce_by is not None:
        ddp.shard_gradients(reduce_by=reduce_by)
    opt = (
        ZeroRedundancyOptimizer(
            model.parameters(),
            cls,
            process_group=group,
            overlap_param_gather=overlap,
            overlap_with_ddp=inside,
            **kwargs,
        )
        if sharded
        else cls(model.parameters(), **kwargs)
    )
    if hook is not None and hook_late:  # registered once the gradients are sharded
        ddp.register_comm_hook(group, HOOKS[hook])
    if sharded:
        assert opt.shards_gradients
    norms = []
    for batch in batches:
        opt.zero_grad()
        parts = _shard(batch, rank, world).chunk(micro)
        for i, part in enumerate(parts):
            with ddp.no_sync() if i < len(parts) - 1 else _nothing():
                _loss(ddp(part)).backward()
        # each lives in its bucket's shard now
        if sharded and not (wrap or {}).get("gradient_as_bucket_view"):
            assert all(p.grad is None for p in model.parameters())
        if clip is not None:
            norm = (opt.clip_grad_norm_(clip) if sharded
                    else torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            norms.append(float(norm))
        if inside and not overlap:  # stepped, and gathered, before backward returned
            assert not opt._gathers.pending and opt._syncs == ddp.reducer.reductions
        if call_step:
            opt.step()
        if overlap:  # the other ranks' parts arrive during the next forward
            assert opt._gathers.pending
    if sharded:
        opt.wait_parameters()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _assert_same(got, want, exact=True, what="", atol=1e-6):
    for name in want:
        if exact:
            assert torch.equal(got[name], want[name]), (
                what,
                name,
                (got[name] - want[name]).abs().max(),
            )
        else:
            worst = (got[name] - want[name]).abs().max()
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-5, atol=atol, msg=f"{what} {name}: {worst}"
            )


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sharded_gradients_give_torch_ddps_parameters_bit_for_bit(optimizer):
    batches = make_batches(STEPS, 2)
    for wrap in (
        {},
        {"bucket_cap_mb": 0.001},
        {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
    ):
        want = run_threaded(
            _train, 2, 2, batches, sharded=False, optimizer=OPTIMIZERS[optimizer]
        )[0][0]
        for got, _ in run_threaded(
            _train, 2, 2, batches, sharded=True, optimizer=OPTIMIZERS[optimizer], wrap=wrap
        ):
            _assert_same(got, want, what=str(wrap))


@pytest.mark.parametrize(
    "case", ["no_sync", "find_unused", "static_graph", "channels_last", "overlap", "native",
             "complex", "complex_native"]
)
def test_sharded_gradients_keep_parity_through_the_wrappers_features(case):
    batches = make_batches(STEPS, 2, per_rank=8)
    options = {
        "no_sync": dict(micro=2),
        "find_unused": dict(model_name="unused_branch", wrap={"find_unused_parameters": True}),
        "static_graph": dict(model_name="unused_branch", wrap={"static_graph": True}),
        "channels_last": dict(
            model_name="conv", channels_last=True, wrap={"bucket_cap_mb": 0.0005}
        ),
        "overlap": dict(wrap={"bucket_cap_mb": 0.001}),
        "native": dict(wrap={"bucket_cap_mb": 0.001}),
        # gloo's all-to-all and all-gather refuse complex tensors: sent as their real views
        "complex": dict(model_name="complex", wrap={"bucket_cap_mb": 0.0005}),
        "complex_native": dict(model_name="complex", wrap={"bucket_cap_mb": 0.0005}),
    }[case]
    reference = {k: v for k, v in options.items() if k != "wrap"}
    if case in ("find_unused", "static_graph"):
        reference["wrap"] = options["wrap"]
    want = run_threaded(_train, 2, 2, batches, sharded=False, **reference)[0][0]
    for got, _ in run_threaded(
        _train,
        2,
        2,
        batches,
        sharded=True,
        overlap=case in ("overlap", "native", "complex_native"),
        native=case.endswith("native"),
        **options,
    ):
        _assert_same(got, want, what=case)


@pytest.mark.parametrize("hook", list(HOOKS))
def test_averaging_and_compression_hooks_shard_with_torch_ddps_results(hook):
    # The hook's own arithmetic (cast, divide there, sum), reduce-scattered: the parameters are
    # torch's DDP with that hook bit for bit at 2 ranks; at 3, gloo's ring sums an element in an
    # order that depends on where it lies in its bucket (the layouts differ): within rounding.
    for world in (2, 3):
        batches = make_batches(STEPS, world)
        # torch's DDP takes the bf16 hook on CUDA only; gradsync's unsharded wrapper runs it here.
        reference = GradsyncDDP if hook == "bf16" else TorchDDP
        want = run_threaded(
            _train, world, world, batches, sharded=False, hook=hook, wrapper=reference
        )[0][0]
        for native, late in ((False, False), (True, False), (False, True)):
            wrap = {"bucket_cap_mb": 0.001}
            for got, _ in run_threaded(
                _train,
                world,
                world,
                batches,
                sharded=True,
                hook=hook,
                hook_late=late,
                native=native,
                wrap=wrap,
            ):
                _assert_same(
                    got,
                    want,
                    exact=world == 2,
                    atol=1e-6 if hook == "allreduce" else 1e-2,
                    what=f"{hook} world {world} native {native} late {late}",
                )


def test_sharded_gradients_at_world_size_one_are_the_plain_optimizer():
    # One rank owns every part: nothing to write back after a gather (a single-device run of a
    # multi-device script), with and without a compression hook.
    batches = make_batches(STEPS, 1)
    want = run_threaded(_train, 1, 1, batches, sharded=False)[0][0]
    got = run_threaded(_train, 1, 1, batches, sharded=True, wrap={"bucket_cap_mb": 0.001})[0][0]
    _assert_same(got, want, what="world 1")
    want = run_threaded(_train, 1, 1, batches, sharded=False, hook="fp16")[0][0]
    got = run_threaded(_train, 1, 1, batches, sharded=True, hook="fp16", native=True)[0][0]
    _assert_same(got, want, what="world 1, fp16 hook, reduce-scatter")


def test_hooks_that_return_whole_buckets_are_refused_with_sharded_gradients():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=1)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        with pytest.raises(
            ValueError, match="cannot shard the gradients.*powerSGD_hook.*shard_gradients=False"
        ):
            ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.SGD, process_group=group, lr=0.1
            )
        other = GradsyncDDP(_build("mlp"), process_group=group)
        ZeroRedundancyOptimizer(other.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
        with pytest.raises(ValueError, match="state must be None or the wrapper's process group"):
            other.register_comm_hook(object(), default_hooks.fp16_compress_hook)
        return "refused"

    assert run_threaded(body, 2) == ["refused"] * 2


@pytest.mark.parametrize("world", [2, 3])
def test_clipping_by_the_global_norm_reduces_the_shards_norms(world):
    batches = make_batches(STEPS, world)
    want = run_threaded(_train, world, world, batches, sharded=False, clip=0.05)[0]
    for got, norms in run_threaded(_train, world, world, batches, sharded=True, clip=0.05):
        assert norms == pytest.approx(want[1], rel=1e-5) and min(norms) > 0.05  # every step clipped
        _assert_same(got, want[0], exact=False, what="clipped")


@pytest.mark.parametrize("native", [False, True])
def test_three_ranks_agree_with_torch(native):
    # A real reduce-scatter (the device backends') adds the three contributions in another
    # order than all-reduce, and gloo's all-reduce picks its order by length (so DDP's rebuilt
    # buckets differ too): the last bit differs, which Adam carries on. Close, not equal.
    batches = make_batches(STEPS, 3)
    want = run_threaded(_train, 3, 3, batches, sharded=False)[0][0]
    outs = run_threaded(
        _train, 3, 3, batches, sharded=True, native=native, wrap={"bucket_cap_mb": 0.001}
    )
    for got, _ in outs:
        _assert_same(got, want, exact=False, what="3 ranks")
    # the ranks agree exactly
    assert all(torch.equal(outs[0][0][n], o[0][n]) for o in outs for n in want)


@pytest.mark.parametrize("reduce_by,world,exact", [("all_reduce", 3, True), ("all_to_all", 2, True),
                                                   ("all_to_all", 3, False), (None, 2, True)])
def test_on_gloo_each_shard_is_the_unsharded_wrappers_gradient(reduce_by, world, exact):
    """Reduced by all-reduce (reports riding in the last bucket as unsharded): the same sums
    at any world size. By all-to-all (gloo's default, None), each shard the ranks' parts added
    in rank order: the same sums at 2 ranks (one addition), within rounding beyond."""
    batch = make_batches(1, world)[0]

    def body(rank, group, sharded):
        model = _build("mlp")
        # these buckets from the start
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb_list=[0.001])
        if sharded:
            ddp.shard_gradients(reduce_by=reduce_by)
            assert ddp.reducer.shards_reduced_by == (reduce_by or "all_to_all")
        opt = (
            ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.SGD, process_group=group, lr=0.1
            )
            if sharded
            else None
        )
        _loss(ddp(_shard(batch, rank, world))).backward()
        if not sharded:
            return [p.grad.clone() for p in model.parameters()]
        opt.clip_grad_norm_(float("inf"))  # takes the shards; clips nothing
        return [(p.index, p.start, p.tensor.grad.clone()) for p in opt._pieces]

    whole = run_threaded(body, world, False)
    for rank, pieces in enumerate(run_threaded(body, world, True)):
        assert pieces
        for index, start, grad in pieces:
            want = whole[rank][index].reshape(-1)[start:start + grad.numel()]
            if exact:
                assert torch.equal(grad.reshape(-1), want)
            else:
                torch.testing.assert_close(grad.reshape(-1), want, rtol=1e-6, atol=1e-7)


def test_memory_per_rank_is_the_shards_and_state_of_one_nth():
    model_name, world = "mlp", 2

    def body(rank, group):
        model = _build(model_name)
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.002)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, process_group=group, lr=0.01
        )
        live = []  # buckets holding a buffer, seen from every gradient's hook (after the reducer's)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda _: live.append(sum(b.wire.numel() > 0 for b in ddp.reducer.buckets)))
        _loss(ddp(torch.ones(4, 8))).backward()
        opt.step()
        # buckets_in_flight=2: the others dropped once reduced. No lower bound: a bucket's
        # reduce-scatter may complete on gloo's thread before the hook looks, and then its
        # buffer is already gone (seen at 0 on every hook once in CI).
        assert len(live) == len(list(model.parameters())) and max(live) <= 2
        pool, made = ddp.reducer.buffer_pool, ddp.reducer.buffer_pool.allocations
        for _ in range(2):
            opt.zero_grad()
            _loss(ddp(torch.ones(4, 8))).backward()
            opt.step()
        # Buffers (reductions and gathers alike) are lent again, not made anew, and no more
        # are kept than can be in flight at once: 2 reducing (each with the buffer its
        # all-to-all lands in) and one filling.
        assert ddp.reducer.shards_reduced_by == "all_to_all"
        assert pool.allocations == made and made <= 5
        widest = max(b.shard.numel() * world for b in ddp.reducer.buckets)
        assert pool.held_bytes <= 5 * widest * 4
        buffers = sum(b.wire.numel() for b in ddp.reducer.buckets)
        shards = sum(b.shard.numel() for b in ddp.reducer.buckets)
        state = sum(t.numel() for s in opt.optim.state.values() for t in s.values() if t.dim() > 0)
        grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
        return buffers, shards, state, grads, len(ddp.reducer.buckets)

    numel = sum(p.numel() for p in _build(model_name).parameters())
    results = run_threaded(body, world)
    for buffers, shards, state, grads, buckets in results:
        assert buffers == 0 and grads == 0  # no bucket buffer kept, no whole gradient left
        assert shards <= numel / world + buckets  # a shard per bucket, padded to the world size
        assert state <= 2 * (numel / world + buckets)  # Adam: exp_avg and exp_avg_sq of the shard
    assert sum(r[2] for r in results) == 2 * numel  # all of the state, none of it twice


def test_a_consolidated_sharded_state_is_the_plain_optimizers_and_loads_anywhere():
    batches = make_batches(2 * STEPS, 6)

    def first_half(rank, group, world, sharded):
        model = _build("mlp")
        ddp = (GradsyncDDP if sharded else TorchDDP)(
            model, process_group=group, bucket_cap_mb=0.001
        )
        opt = (
            ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.Adam, process_group=group, lr=0.01
            )
            if sharded
            else torch.optim.Adam(model.parameters(), lr=0.01)
        )
        for batch in batches[:STEPS]:
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, world))).backward()
            opt.step()
        if sharded:
            opt.consolidate_state_dict(to=0)
        return (copy.deepcopy(opt.state_dict()) if rank == 0 else None,
                {n: p.detach().clone() for n, p in model.named_parameters()})

    def second_half(rank, group, world, saved, params, sharded):
        model = _build("mlp")
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        # other buckets, other shards
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.0007)
        opt = (
            ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.Adam, process_group=group, lr=0.01
            )
            if sharded
            else torch.optim.Adam(model.parameters(), lr=0.01)
        )
        opt.load_state_dict(copy.deepcopy(saved))
        for batch in batches[STEPS:]:
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, world))).backward()
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    saved, params = run_threaded(first_half, 2, 2, True)[0]
    plain_saved, plain_params = run_threaded(first_half, 2, 2, False)[0]
    _assert_same(params, plain_params)
    assert sorted(saved["state"]) == sorted(plain_saved["state"])
    for i, state in plain_saved["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(saved["state"][i][key]), torch.as_tensor(value)), (
                i,
                key,
            )
    resumed_plain = run_threaded(second_half, 2, 2, saved, params, False)[0]
    for world in (2, 3):  # saved at 2 with one layout, loaded at 2 and 3 with another
        for out in run_threaded(second_half, world, world, saved, params, True):
            _assert_same(out, resumed_plain, exact=world == 2, what=f"resumed at {world}")


def test_a_rank_without_a_synchronised_backward_raises_and_the_other_times_out():
    from datetime import timedelta

    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        ddp.reducer.configure(timeout=timedelta(seconds=2))
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=group, lr=0.1
        )
        try:
            with ddp.no_sync() if rank == 1 else contextlib.nullcontext():
                _loss(ddp(torch.ones(2, 8))).backward()  # rank 0 waits here for rank 1's reduction
            opt.step()
        except Exception as error:  # noqa: BLE001 - each rank's error is the result
            return f"{type(error).__name__}: {error}"
        return "no error"

    first, second = run_threaded(body, 2, timeout=30)
    assert "no synchronised backward since the last step on rank 1 (of 2)" in second
    assert "ReductionTimeoutError" in first and "rank 0/2" in first, first


def test_a_step_after_only_unsynchronised_backwards_is_refused_on_every_rank():
    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=group, lr=0.1
        )
        _loss(ddp(torch.ones(2, 8))).backward()
        opt.step()
        with ddp.no_sync():
            _loss(ddp(torch.ones(2, 8))).backward()
        with pytest.raises(RuntimeError) as info:
            opt.step()
        return str(info.value)

    # Each rank knows it had no synchronised backward: refused there, with no collective.
    first, second = run_threaded(body, 2)
    assert "no synchronised backward since the last step on rank 0 (of 2)" in first
    assert "no synchronised backward since the last step on rank 1 (of 2)" in second


def test_bad_input_is_refused_before_any_collective():
    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        params = list(model.parameters())
        with pytest.raises(
            ValueError, match=r"must hold every trainable parameter.*missing: \['net.2.weight'"
        ):
            # split in two
            ZeroRedundancyOptimizer(params[:2], torch.optim.SGD, process_group=group, lr=0.1)
        outsider = torch.nn.Parameter(torch.ones(3))
        with pytest.raises(ValueError, match="not synchronised by that wrapper"):
            ZeroRedundancyOptimizer(
                params + [outsider], torch.optim.SGD, process_group=group, lr=0.1
            )
        opt = ZeroRedundancyOptimizer(params, torch.optim.SGD, process_group=group, lr=0.1)
        with pytest.raises(ValueError, match="another sharded optimizer"):
            ZeroRedundancyOptimizer(params, torch.optim.SGD, process_group=group, lr=0.1)
        with pytest.raises(ValueError, match="give every group at construction"):
            opt.add_param_group({"params": [outsider]})
        with pytest.raises(ValueError, match="communication hook"):
            ddp.register_comm_hook(None, lambda state, bucket: None)
        auto = GradsyncDDP(_build("mlp"), process_group=group, bucket_cap_mb="auto")
        with pytest.raises(ValueError, match='bucket_cap_mb="auto"'):
            ZeroRedundancyOptimizer(auto.parameters(), torch.optim.SGD, process_group=group, lr=0.1)
        with pytest.raises(ValueError, match="must belong to a gradsync"):
            ZeroRedundancyOptimizer(
                [outsider], torch.optim.SGD, process_group=group, shard_gradients=True, lr=0.1
            )
        return repr(opt)

    assert all("gradients sharded" in r for r in run_threaded(body, 2))


@pytest.mark.parametrize(
    "case",
    [
        "defaults",
        "without step()",
        "overlapped gathers",
        "no_sync",
        "find_unused",
        "static_graph",
        "bf16 hook",
        "bucket views",
    ],
)
def test_overlap_with_ddp_steps_inside_backward_with_torch_ddps_results(case):
    # The step runs at the end of the synchronised backward: the same parameters as torch's
    # DDP with the plain optimizer, bit for bit, whether the loop calls step() or not.
    batches = make_batches(STEPS, 2, per_rank=8)
    options = {
        "defaults": {},
        "without step()": dict(call_step=False),
        "overlapped gathers": dict(overlap=True),
        "no_sync": dict(micro=2),
        "find_unused": dict(model_name="unused_branch", wrap={"find_unused_parameters": True}),
        "static_graph": dict(model_name="unused_branch", wrap={"static_graph": True}),
        "bf16 hook": dict(hook="bf16", wrapper=GradsyncDDP),
        "bucket views": dict(wrap={"gradient_as_bucket_view": True}),
    }[case]
    reference = {
        k: v for k, v in options.items() if k in ("micro", "model_name", "hook", "wrapper")
    }
    if case in ("find_unused", "static_graph"):
        reference["wrap"] = options["wrap"]
    want = run_threaded(_train, 2, 2, batches, sharded=False, **reference)[0][0]
    options.setdefault("wrap", {}).setdefault("bucket_cap_mb", 0.001)
    options.pop("wrapper", None)
    for got, _ in run_threaded(_train, 2, 2, batches, sharded=True, inside=True, **options):
        _assert_same(got, want, what=case)


def test_torch_style_overlap_with_ddp_registers_the_hook_and_never_calls_step():
    # Code ported from torch: hook_with_zero_step(...) registered, no step() in the loop.
    from gradsync import hook_with_zero_step, hook_with_zero_step_interleaved

    def body(rank, group, batches, style):
        model = _build("mlp")
        if style == "torch":
            ddp, opt = (
                TorchDDP(model, process_group=group),
                torch.optim.Adam(model.parameters(), lr=0.01),
            )
        else:
            ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=group,
                                          overlap_with_ddp=True, lr=0.01)
            wrap = hook_with_zero_step if style == "hook" else hook_with_zero_step_interleaved
            ddp.register_comm_hook(
                group, wrap(default_hooks.allreduce_hook, ddp, opt, shard_buckets=True)
            )
        for batch in batches:
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, 2))).backward()
            if style == "torch":
                opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    batches = make_batches(STEPS, 2)
    want = run_threaded(body, 2, batches, "torch")[0]
    for style in ("hook", "interleaved"):
        for got in run_threaded(body, 2, batches, style):
            _assert_same(got, want, what=style)


def test_overlap_with_ddp_refuses_what_needs_a_moment_between_backward_and_step():
    from gradsync import hook_with_zero_step

    def body(rank, group):
        model = _build("mlp")
        with pytest.raises(ValueError, match=r"overlap_with_ddp=True\) steps inside the backward"):
            ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group,
                                    overlap_with_ddp=True, lr=0.1)  # no gradsync wrapper
        torch_ddp = TorchDDP(_build("mlp"), process_group=group)
        with pytest.raises(ValueError, match="use torch's class"):
            ZeroRedundancyOptimizer(torch_ddp.parameters(), torch.optim.SGD, process_group=group,
                                    overlap_with_ddp=True, lr=0.1)
        ddp = GradsyncDDP(model, process_group=group)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group,
                                      overlap_with_ddp=True, lr=0.1)
        other = GradsyncDDP(_build("mlp"), process_group=group)
        plain = ZeroRedundancyOptimizer(
            other.parameters(), torch.optim.SGD, process_group=group, lr=0.1
        )
        with pytest.raises(ValueError, match="overlap_with_ddp=False"):
            hook_with_zero_step(default_hooks.allreduce_hook, other, plain)
        with pytest.raises(ValueError, match="not this wrapper's"):
            hook_with_zero_step(default_hooks.allreduce_hook, other, opt)
        _loss(ddp(torch.ones(2, 8))).backward()
        with pytest.raises(RuntimeError, match="no moment to clip in"):
            opt.clip_grad_norm_(1.0)
        with pytest.raises(ValueError, match="closure"):
            opt.step(lambda: 0.0)
        return opt.step()

    assert run_threaded(body, 2) == [None, None]


def test_overlapped_gathers_start_with_the_bucket_the_next_forward_needs_first():
    # Buckets follow the gradients' ready order, the reverse of forward's: the last bucket
    # holds the first layers, so its gather starts first and forward's first module waits
    # for it alone.
    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group,
                                      overlap_param_gather=True, lr=0.1)
        seen = []
        first = next(m for m in model.modules() if m._parameters)
        first.register_forward_pre_hook(
            lambda *_: seen.append(list(opt._gathers._pending)), prepend=False
        )
        batch = _shard(make_batches(1, 2)[0], rank, 2)
        _loss(ddp(batch)).backward()
        opt.step()
        started = list(opt._gathers._pending)  # a dict: in the order they started
        ddp(batch)
        return len(opt._gathers.buckets), started, seen

    for buckets, started, seen in run_threaded(body, 2):
        assert buckets > 1
        assert started == list(reversed(range(buckets)))
        # waited for the first layers' bucket only
        assert buckets - 1 not in seen[-1] and 0 in seen[-1]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_gather_a_peer_never_joins_raises_within_the_timeout(overlap):
    # Rank 1 stops after backward: rank 0's parameter gathers (waited at the end of step(), or
    # by the next forward's pre-hooks when overlapped) fail after the optimizer's timeout.
    import time
    from datetime import timedelta

    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            process_group=group,
            overlap_param_gather=overlap,
            timeout=timedelta(seconds=2),
            lr=0.1,
        )
        _loss(ddp(torch.ones(2, 8))).backward()
        if rank == 1:
            return "stopped"
        start = time.monotonic()
        try:
            opt.step()
            ddp(torch.ones(2, 8))  # overlapped: the first module's pre-hook waits for its bucket
        except Exception as error:  # noqa: BLE001 - the error and when it came are the result
            return f"{type(error).__name__} after {time.monotonic() - start:.1f} s: {error}"
        return "no error"

    first, second = run_threaded(body, 2, timeout=30)
    assert second == "stopped"
    assert (
        first.startswith("ReductionTimeoutError")
        and "all-gather of the parameters of bucket" in first
    ), first
    assert float(first.split(" after ")[1].split(" s")[0]) < 10, first


def test_a_rank_that_skips_the_step_makes_the_other_raise_not_hang():
    from datetime import timedelta

    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group,
                                      timeout=timedelta(seconds=2), lr=0.1)
        _loss(ddp(torch.ones(2, 8))).backward()
        if rank == 0:
            opt.step()
        return "done"

    with pytest.raises(RankError, match="rank 0"):
        run_threaded(body, 2, timeout=30)


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce_fp32", "reduce_bf16"])
@pytest.mark.parametrize("case", ["plain", "no_sync", "overlap", "native"])
def test_mixed_precision_shards_as_the_unsharded_wrapper_reduces(reduce_dtype, case):
    """Mixed precision (torch's `_MixedPrecision`: bf16 compute, float32 parameters) with
    sharded gradients: each bucket filled in bfloat16, cast to the reduce dtype, reduce-scattered
    and its sum divided there (as torch's mixed-precision hook), (all-reduced on gloo; `native`:
    reduce-scattered), kept as a float32 shard the optimizer steps the float32 parameters with. The
    parameters equal the unsharded wrapper's with the plain optimizer, bit for bit at 2 ranks;
    `.grad` is None."""
    from torch.nn.parallel.distributed import _MixedPrecision

    mixed = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    batches = make_batches(STEPS, 2, per_rank=8)
    options = dict(
        wrapper=GradsyncDDP,
        optimizer=OPTIMIZERS["adamw"],
        wrap={"mixed_precision": mixed, "bucket_cap_mb": 0.001},
        micro=2 if case == "no_sync" else 1,
    )
    want = run_threaded(_train, 2, 2, batches, sharded=False, **options)[0][0]
    assert all(p.dtype == torch.float32 for p in want.values())
    for got, _ in run_threaded(
        _train,
        2,
        2,
        batches,
        sharded=True,
        overlap=case in ("overlap", "native", "complex_native"),
        native=case.endswith("native"),
        **options,
    ):
        _assert_same(got, want, what=case)


@pytest.mark.parametrize("reduce_by", ["all_reduce", "all_to_all", "reduce_scatter"])
def test_mixed_precision_shards_at_three_ranks(reduce_by):
    """Mixed precision with sharded gradients at 3 ranks, where a bucket's length is not a
    multiple of the world size (padded shards) and the ranks' bf16 gradients are summed in
    float32 in whichever order the collective takes: the unsharded wrapper's parameters with
    the plain optimizer, to float32 rounding (bit for bit where the same all-reduce sums)."""
    from torch.nn.parallel.distributed import _MixedPrecision

    mixed = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    batches = make_batches(STEPS, 3, per_rank=4)
    options = dict(
        wrapper=GradsyncDDP,
        optimizer=OPTIMIZERS["sgd"],
        wrap={"mixed_precision": mixed, "bucket_cap_mb": 0.001},
    )
    want = run_threaded(_train, 3, 3, batches, sharded=False, **options)[0][0]
    results = run_threaded(_train, 3, 3, batches, sharded=True, reduce_by=reduce_by, **options)
    for got, _ in results:
        _assert_same(got, want, exact=reduce_by == "all_reduce", what=f"3 ranks, {reduce_by}")
    # ranks agree
    assert all(torch.equal(results[0][0][n], r[0][n]) for r in results[1:] for n in want)
