"""`gradsync.ZeroRedundancyOptimizer` as ZeRO-1 (optimizer state sharded, parameters broadcast by
their owners; `shard_gradients=False` beside a gradsync wrapper, and beside torch's) against torch's
DDP with the same unsharded optimizer, on real gloo groups in threads: the same parameters bit for
bit, state of about 1/N per rank, whole state dicts that load at another world size, and bad input
refused on every rank alike."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
from models import make_batches
from parity import _build, _loss, _shard
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync import ZeroRedundancyOptimizer
from gradsync.testing import RankError, run_threaded, seeded

STEPS = 4
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def _train(rank, group, model_name, optimizer, sharded, wrapper, batches, world, inside=False):
    cls, kwargs = OPTIMIZERS[optimizer]
    model = _build(model_name)
    ddp = (GradsyncDDP if wrapper == "gradsync" else TorchDDP)(model, process_group=group)
    opt = (
        ZeroRedundancyOptimizer(
            model.parameters(),
            cls,
            process_group=group,
            shard_gradients=False,
            overlap_with_ddp=inside,
            **kwargs,
        )
        if sharded
        else cls(model.parameters(), **kwargs)
    )
    # writes into param_groups
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for batch in batches:
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        _loss(ddp(_shard(batch, rank, world))).backward()
        if inside:  # stepped and broadcast before backward returned
            assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        opt.step()
        schedule.step()
    state = sum(
        t.numel()
        for s in (opt.optim.state.values() if sharded and opt.optim else opt.state.values())
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_state_gives_the_unsharded_optimizers_parameters_bit_for_bit(optimizer, world):
    batches = make_batches(STEPS, world)
    # Against the same wrapper with the plain optimizer. (gradsync's wrapper and torch's differ by
    # an ulp in one gradient of the first iteration at 3 ranks, their first buckets summed in
    # another order, which Adam's normalised step carries on; SGD's results are equal.)
    for wrapper in ("torch", "gradsync"):
        plain = run_threaded(_train, world, "mlp", optimizer, False, wrapper, batches, world)
        sharded = run_threaded(_train, world, "mlp", optimizer, True, wrapper, batches, world)
        for (params, _), (ref, _) in zip(sharded, plain):
            for name in ref:
                assert torch.equal(params[name], ref[name]), (wrapper, name)
    # All the state between them, none of it twice, and per rank at most 1/N of it plus the
    # largest parameter's (torch's partition: whole parameters, largest first to the emptiest rank).
    states = [state for _, state in sharded]
    full, sizes = plain[0][1], [p.numel() for p in _build("mlp").parameters()]
    per_element = full // sum(sizes)  # state tensors per parameter element: 1 for SGD, 2 for Adam
    assert sum(states) == full and max(states) <= full / world + per_element * max(sizes)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [2, 3])
def test_overlap_with_ddp_steps_zero_1_inside_backward_bit_for_bit(optimizer, world):
    # Each owner steps and broadcasts inside the gradsync wrapper's backward, the LR schedule
    # read from the groups at each step: the plain optimizer's parameters, bit for bit.
    batches = make_batches(STEPS, world)
    plain = run_threaded(_train, world, "mlp", optimizer, False, "gradsync", batches, world)
    inside = run_threaded(
        _train, world, "mlp", optimizer, True, "gradsync", batches, world, inside=True
    )
    for (params, _), (ref, _) in zip(inside, plain):
        for name in ref:
            assert torch.equal(params[name], ref[name]), name


@pytest.mark.parametrize("world", [2, 3])
def test_parameters_as_bucket_view_broadcasts_flat_buffers_in_place_bit_for_bit(world):
    # torch's keyword: each owner's contiguous parameters view one flat buffer, broadcast where
    # it lies; channels-last weights (another layout) travel as before; a group added later
    # gets buffers of its own. The plain optimizer's parameters, bit for bit.
    batches = make_batches(STEPS, world)

    def body(rank, group, view):
        model = _build("conv").to(memory_format=torch.channels_last)
        head = seeded(lambda: torch.nn.Linear(4, 2), 1)
        ddp = GradsyncDDP(torch.nn.Sequential(model, head), process_group=group)
        first = list(model.parameters())
        opt = (
            ZeroRedundancyOptimizer(
                first,
                torch.optim.AdamW,
                process_group=group,
                shard_gradients=False,
                parameters_as_bucket_view=True,
                lr=0.01,
            )
            if view
            else torch.optim.AdamW(first, lr=0.01)
        )
        for i, batch in enumerate(batches):
            if i == 1:
                opt.add_param_group({"params": list(head.parameters()), "lr": 0.02})
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, world))).backward()
            opt.step()
        storages = {id(p): p.untyped_storage().data_ptr() for p in ddp.parameters()}
        viewed = [(p.is_contiguous(), storages[id(p)]) for p in ddp.parameters()] if view else []
        return (
            [p.detach().clone() for p in ddp.parameters()],
            viewed,
            len(opt._flats) if view else 0,
        )

    plain = run_threaded(body, world, False)[0][0]
    for params, viewed, flats in run_threaded(body, world, True):
        assert all(torch.equal(a, b) for a, b in zip(params, plain))
        # a channels-last weight, left as it was
        assert any(not contiguous for contiguous, _ in viewed)
        shared = [ptr for contiguous, ptr in viewed if contiguous]
        assert len(set(shared)) == flats < len(shared)  # the contiguous ones share a few buffers


def test_an_in_place_broadcast_a_peer_never_joins_raises_within_the_timeout():
    # parameters_as_bucket_view: the owners' flat buffers are broadcast where they lie, through
    # the same timed waits. With the agreement off (as on a device group) the first collective
    # rank 0 waits in is that broadcast, which rank 1 never joins.
    from datetime import timedelta

    done = threading.Event()

    def body(rank, group):
        model = _build("mlp")
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            process_group=group,
            parameters_as_bucket_view=True,
            timeout=timedelta(seconds=2),
            lr=0.1,
        )
        opt._agree_each_step = False
        if rank == 1:  # alive, its group too, but never stepping
            done.wait(20)
            return "no step"
        _loss(model(torch.ones(2, 8))).backward()
        try:
            opt.step()
        except Exception as error:  # noqa: BLE001 - the error is the result
            return str(error)
        finally:
            done.set()
        return "no error"

    first, _ = run_threaded(body, 2, timeout=30)
    assert (
        "rank 0/2: broadcast of the parameters rank" in first and "did not complete within" in first
    ), first


def test_a_consolidated_state_dict_is_the_unsharded_one_and_loads_at_another_world_size():
    batches = make_batches(2 * STEPS, 6)

    def first_half(rank, group, world):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.Adam,
            process_group=group,
            shard_gradients=False,
            lr=0.01,
        )
        for batch in batches[:STEPS]:
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, world))).backward()
            opt.step()
        with pytest.raises(RuntimeError, match="call consolidate_state_dict"):
            opt.state_dict()
        opt.consolidate_state_dict(to=1)
        saved = opt.state_dict() if rank == 1 else None
        return saved, {n: p.detach().clone() for n, p in model.named_parameters()}

    def second_half(rank, group, world, saved, params, sharded):
        model = _build("mlp")
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        ddp = GradsyncDDP(model, process_group=group)
        opt = (
            ZeroRedundancyOptimizer(
                model.parameters(),
                torch.optim.Adam,
                process_group=group,
                shard_gradients=False,
                lr=0.01,
            )
            if sharded
            else torch.optim.Adam(model.parameters(), lr=0.01)
        )
        opt.load_state_dict(copy.deepcopy(saved))  # torch's loading aliases the dict's tensors
        for batch in batches[STEPS:]:
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, world))).backward()
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    saved, params = run_threaded(first_half, 2, 2)[1]
    plain_opt = torch.optim.Adam(_build("mlp").parameters(), lr=0.01)
    assert set(saved) == set(plain_opt.state_dict())  # the unsharded format: state, param_groups
    assert sorted(saved["state"]) == list(range(len(list(_build("mlp").parameters()))))
    resumed_plain = run_threaded(second_half, 3, 3, saved, params, False)[0]
    # saved at 2, loaded at 3
    resumed_sharded = run_threaded(second_half, 3, 3, saved, params, True)
    for out in resumed_sharded:
        assert all(torch.equal(out[n], resumed_plain[n]) for n in out)


def test_a_group_added_on_one_rank_only_is_refused_on_every_rank_naming_them():
    def body(rank, group):
        model = _build("mlp")
        extra = torch.nn.Linear(3, 3)
        ddp = GradsyncDDP(model, process_group=group)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=group, shard_gradients=False, lr=0.1
        )
        if rank == 1:
            opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
        _loss(ddp(torch.ones(2, 8))).backward()
        with pytest.raises(ValueError) as info:
            opt.step()
        return str(info.value)

    messages = run_threaded(body, 2)
    assert messages[0] == messages[1]
    assert "rank 0: 1 groups" in messages[0] and "rank 1: 2 groups" in messages[0]
    assert "add_param_group with the same group on every rank" in messages[0]


def test_a_group_added_on_every_rank_keeps_parity():
    batches = make_batches(STEPS, 2)

    def body(rank, group, sharded):
        model = _build("mlp")
        # the global generator is shared by the threads
        head = seeded(lambda: torch.nn.Linear(4, 2), 1)
        ddp = GradsyncDDP(torch.nn.Sequential(model, head), process_group=group)
        first = list(model.parameters())
        opt = (
            ZeroRedundancyOptimizer(
                first, torch.optim.Adam, process_group=group, shard_gradients=False, lr=0.01
            )
            if sharded
            else torch.optim.Adam(first, lr=0.01)
        )
        for i, batch in enumerate(batches):
            if i == 1:
                opt.add_param_group({"params": list(head.parameters()), "lr": 0.02})
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, 2))).backward()
            opt.step()
        return [p.detach().clone() for p in ddp.parameters()]

    plain = run_threaded(body, 2, False)[0]
    for out in run_threaded(body, 2, True):
        assert all(torch.equal(a, b) for a, b in zip(out, plain))


def test_a_step_without_backward_is_refused_on_every_rank():
    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, process_group=group, shard_gradients=False, lr=0.1
        )
        _loss(ddp(torch.ones(2, 8))).backward()
        opt.step()
        with pytest.raises(RuntimeError) as info:
            opt.step()  # no backward since the last step
        return str(info.value)

    first, second = run_threaded(body, 2)
    assert first == second and "no backward since the last step on rank(s) [0, 1]" in first


def test_bad_arguments_are_refused_before_any_collective():
    def body(rank, group):
        params = list(_build("mlp").parameters())
        with pytest.raises(ValueError, match="overlap_with_ddp"):
            ZeroRedundancyOptimizer(
                params, torch.optim.SGD, process_group=group, overlap_with_ddp=True, lr=0.1
            )
        with pytest.raises(TypeError, match="optimizer_class"):
            ZeroRedundancyOptimizer(params, "sgd", process_group=group, lr=0.1)
        opt = ZeroRedundancyOptimizer(params, torch.optim.SGD, process_group=group, lr=0.1)
        with pytest.raises(ValueError, match="consolidate_state_dict"):
            opt.consolidate_state_dict(to=5)
        with pytest.raises(ValueError, match="parameter groups hold"):
            opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
        return repr(opt)

    reprs = run_threaded(body, 2)
    assert all("ZeroRedundancyOptimizer(SGD, rank" in r for r in reprs)


def test_a_rank_that_never_steps_makes_the_others_raise_not_hang():
    from datetime import timedelta

    def body(rank, group):
        model = _build("mlp")
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, process_group=group,
                                      timeout=timedelta(seconds=2), lr=0.1)
        if rank == 0:
            _loss(model(torch.ones(2, 8))).backward()
            opt.step()
        return "done"

    with pytest.raises(RankError, match="rank 0"):
        run_threaded(body, 2, timeout=30)


def test_without_the_per_step_agreement_the_step_reads_nothing_on_the_host(monkeypatch):
    """On a device group (NCCL: `host_runs_collectives` is False there) ZeRO-1's step runs no
    agreement collective, whose result the host would have to read every step: the same
    parameters, no tensor read on the host by gradsync, and a rank with no backward raises
    at once while the other, waiting in a broadcast it never joins, raises too."""
    from datetime import timedelta

    reads: list[str] = []
    counting = [False]
    for name in ("item", "tolist", "__bool__"):
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if (counting[0] and threading.current_thread().name == "rank0" and "gradsync" in caller
                    and not caller.endswith("engine/device.py")):  # HostRead: pinned, once landed
                reads.append(f"{_name} from {caller}:{sys._getframe(1).f_lineno}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    batches = make_batches(STEPS, 2)

    def body(rank, group, agree):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group)
        ddp.reducer.configure(read_back="deferred")  # the wrapper as on a device group too
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=group,
                                      shard_gradients=False, timeout=timedelta(seconds=2), lr=0.01)
        assert opt._agree_each_step  # gloo; as on NCCL below
        opt._agree_each_step = agree
        for i, batch in enumerate(batches):
            if rank == 0:  # from the third step: after the one-time bucket rebuild
                counting[0] = i > 1
            opt.zero_grad()
            _loss(ddp(_shard(batch, rank, 2))).backward()
            opt.step()
        if rank == 0:
            counting[0] = False
        params = [p.detach().clone() for p in model.parameters()]
        try:
            if rank == 0:
                with ddp.no_sync():  # a backward, and no collective for rank 1 to miss
                    _loss(ddp(torch.ones(2, 8))).backward()
            opt.step()  # rank 1 ran no backward since its last step
        except RuntimeError as error:
            return params, str(error)
        return params, "no error"

    agreed = run_threaded(body, 2, True, timeout=60)
    assert any("collectives.py" in r for r in reads), reads  # the agreement does read: a real count
    reads.clear()
    local = run_threaded(body, 2, False, timeout=60)
    assert reads == []
    for (a, _), (b, _) in zip(agreed, local):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert "no backward since the last step on rank(s) [1]" in agreed[0][1] == agreed[1][1]
    assert "no backward since the last step on rank 1 (of 2)" in local[1][1]
    # Rank 0 raises in the broadcast rank 1 never joins: within its 2 s timeout, or sooner when
    # rank 1's thread has returned and its group (freed with everything else) closed the link.
    assert "rank 0/2: broadcast of the parameters rank 0 stepped" in local[0][1], local[0][1]
    assert any(
        s in local[0][1] for s in ("2 s", "0:00:02", "Connection reset", "Connection closed")
    ), local[0][1]


@pytest.mark.parametrize("shard_gradients", [None, False], ids=["zero2", "zero1"])
def test_the_optimizer_and_its_wrapper_are_freed_with_the_model(shard_gradients):
    """No reference cycle through a parameter's hooks (held on its C++ side, out of the garbage
    collector's sight): dropping model, wrapper and optimizer frees them, buckets and shards with
    them. It kept them, and the process group, until exit, where a gloo thread still holding a
    tensor could then abort the process."""
    import gc
    import weakref

    def body(rank, group):
        model = _build("mlp")
        ddp = GradsyncDDP(model, process_group=group, bucket_cap_mb=0.001)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=group,
                                      shard_gradients=shard_gradients, lr=0.01)
        for _ in range(2):
            opt.zero_grad()
            _loss(ddp(torch.ones(2, 8) * (rank + 1))).backward()
            opt.step()
        held = [weakref.ref(o) for o in (model, ddp, ddp.reducer, opt)]
        assert opt.shards_gradients == (shard_gradients is None)
        # ZeRO-2: no hook per parameter per step
        assert bool(opt._hooks) == (shard_gradients is False)
        del model, ddp, opt
        gc.collect()
        return [ref() is None for ref in held]

    assert run_threaded(body, 2, timeout=60) == [[True] * 4] * 2
