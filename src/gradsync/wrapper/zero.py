"""`gradsync.ZeroRedundancyOptimizer`: optimizer state sharded across ranks (ZeRO stage 1).

A drop-in for torch's class of that name. Every rank holds every parameter and, after data
parallel's all-reduce, every averaged gradient; each rank *owns* a partition of the parameters
and keeps optimizer state for those only, about 1/N of it. `step()` steps the owned parameters
with a local optimizer of the given class, then each owner broadcasts its updated parameters to
the others (flat, one broadcast per dtype and device; with `parameters_as_bucket_view=True`,
as torch's keyword, the parameters view those flat buffers and are broadcast where they lie,
with no copy in or out). The partition is torch's: per parameter
group, largest first, each parameter to the rank holding the fewest elements so far; so the
same parameters end on the same ranks as under torch's class.

For an elementwise optimizer (SGD, Adam, AdamW, ...) a parameter's update depends only on its
own gradient and state, so the results are the unsharded optimizer's, bit for bit.

State dicts are the unsharded optimizer's format: `consolidate_state_dict(to=r)` gathers every
rank's share onto rank r, whose `state_dict()` then indexes state by the parameter's position
over all groups, as `torch.optim.Optimizer.state_dict()` does. Such a dict is independent of the
world size: it loads into a sharded optimizer of any world size, or into the plain optimizer.

When the parameters belong to a `gradsync.DistributedDataParallel` (all of its trainable
parameters, and no others) the gradients are sharded too (ZeRO-2, `shard_gradients`, on by
default there): the wrapper's buckets are reduce-scattered as they fill, overlapped with
backward; each rank keeps only its slice of each bucket's averaged gradients (`.grad` is None
after backward) and optimizer state for that slice, steps it, and the slices are all-gathered
back into the parameters bucket by bucket: all started at once at the end of `step()`, and
waited for there, or with `overlap_param_gather=True` each just before the first module of the
next forward that uses it (`zero_shards`; until then the other ranks' parts of the parameters
hold their old values: call `wait_parameters()` before reading them any other way). On gloo the
reduce-scatter is an all-to-all and a local sum (`engine.bucket.REDUCE_BY`).
Gradient clipping must then go through `clip_grad_norm_` of this class: torch's function would
see no gradients.

Without sharded gradients, on a host group (gloo), every `step()` agrees, in one small
all-gather in flight while each rank steps its own share, that each rank has the same parameter
groups and has run a backward since its last step; a rank that differs makes every rank raise
the same error before any parameter is sent, naming the ranks and their values, instead of
leaving the others waiting in a collective. On a device group (NCCL) that
would read the all-gather on the host every step, a sync that stops the host running ahead, so
there, as with sharded gradients (whose groups are fixed), no such collective runs: a rank with
no backward raises at once, and the others within the process group's timeout. The averaging and
compression hooks (`allreduce_hook`, `fp16_compress_hook`, `bf16_compress_hook`) shard with the
gradients (`engine.comm.sharded_hook_dtype`); other hooks are refused.

`overlap_with_ddp=True` (over a gradsync wrapper, ZeRO-1 or ZeRO-2) runs the step inside
backward, as torch's keyword does: as soon as the wrapper has finished the synchronised
backward (every bucket landed and checked: `Reducer.register_finish_hook`), so
`loss.backward()` returns with the parameters stepped (with `overlap_param_gather`, their other
ranks' parts still arriving) and `step()` does nothing; a loop that calls it anyway is the
same loop. Unlike torch's form it steps from the first iteration (torch's skips its first
two or three while it learns DDP's buckets), it runs on gloo too, and it needs no comm hook;
`hook_with_zero_step` returns the hook it is given, for code ported from torch. There is no
moment between backward and the step, so no clipping and no `GradScaler`.

It is a `Joinable`, as torch's class, for uneven inputs: `Join([model, optimizer])` (under
ZeRO-2 `model.join()` brings it in) keeps a rank that has run out of data stepping its share
after each synchronised iteration of the others (`join_hook`).
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from ..engine.bucket import view_like
from ..engine.collectives import (
    DEFAULT_TIMEOUT,
    Broadcasts,
    GatheringInts,
    all_gather_objects,
    finish_all_gather_ints,
    start_all_gather_ints,
)
from ..engine.device import host_runs_collectives
from ..engine.reducer import Reducer
from .zero_shards import Gathers, Piece, check_dense, clip_sharded, flat, pieces_of, set_piece_grads

__all__ = ["ZeroRedundancyOptimizer", "hook_with_zero_step", "hook_with_zero_step_interleaved"]


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wraps `optimizer_class(**defaults)`; each rank keeps the state of its own parameters.

    Beyond torch's keywords: `shard_gradients` (None: when the parameters are a gradsync
    wrapper's; False: ZeRO-1 always), `overlap_param_gather` (ZeRO-2: leave the parameter
    all-gathers to the next forward), `buckets_in_flight` (ZeRO-2: at most this many buckets
    reducing at once during backward, None for no limit), `timeout` (every collective's).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        timeout: timedelta = DEFAULT_TIMEOUT,
        shard_gradients: bool | None = None,
        overlap_param_gather: bool = False,
        buckets_in_flight: int | None = 2,
        **defaults: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        self._ready = False
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("ZeroRedundancyOptimizer: torch.distributed is not initialised; "
                               "call init_process_group first or pass process_group")
        self.process_group: dist.ProcessGroup = group
        self.world_size, self.rank = self.process_group.size(), self.process_group.rank()
        # ZeRO-1's per-step agreement is read on the host: on a device group (NCCL) a sync every
        # step, which stops the host running ahead. There each rank checks what it knows itself,
        # as torch's class (which checks nothing), and a rank that differs leaves the others to
        # the process group's timeout.
        self._agree_each_step = host_runs_collectives(group)
        self.optimizer_class, self.timeout = optimizer_class, timeout
        self.parameters_as_bucket_view = parameters_as_bucket_view  # ZeRO-1: `_view_partition`
        self._flats: list[tuple[int, torch.Tensor]] = []  # (owner, a flat buffer its parameters view)
        self._viewed: set[int] = set()  # ids of the parameters that view one
        self._optim_defaults = defaults
        # The class's whole defaults (Adam's betas, eps, ...), so that our groups, the state
        # dicts' and an LR scheduler's view hold every hyperparameter, as the plain optimizer's do.
        full = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults).defaults
        super().__init__(params, full)
        params_all = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params_all}) != len(params_all):
            raise ValueError("ZeroRedundancyOptimizer: a parameter appears twice in the parameter groups")
        self.overlap_with_ddp = overlap_with_ddp
        if overlap_with_ddp and _reducer_of(params_all) is None:
            raise ValueError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside the backward of the "
                "gradsync.DistributedDataParallel whose parameters it holds: its trainable parameters must "
                "all be one live gradsync wrapper's (wrap the model with gradsync.DistributedDataParallel "
                "first; over torch's DDP use torch's class and its ddp_zero_hook), or leave overlap_with_ddp out"
            )
        self._backward_seen = False
        # Each hook holds the optimizer weakly: a parameter's hooks live on its C++ side, out of
        # the garbage collector's sight, so a strong reference there would keep the optimizer,
        # its wrapper's reducer and the process group alive for as long as the parameters.
        self._saw_backward = _SawBackward(weakref.ref(self))
        self._hooks: list[Any] = []
        weakref.finalize(self, _remove_all, self._hooks)
        self._partition: list[list[list[torch.Tensor]]] = []  # [group][rank] -> parameters (ZeRO-1)
        self._loads = [0] * self.world_size
        self.overlap_param_gather = overlap_param_gather
        self.reducer: Reducer | None = None  # the wrapper's, when the gradients are sharded
        self._gathers: Gathers | None = None
        wrapper = _wrapper_of(params_all) if shard_gradients is not False else None
        if wrapper is not None:
            self._shard_over(wrapper, params_all, buckets_in_flight)
        elif shard_gradients:
            raise ValueError("ZeroRedundancyOptimizer(shard_gradients=True): the parameters must belong to a "
                             "gradsync.DistributedDataParallel (wrap the model first, then build the optimizer)")
        else:
            for g in self.param_groups:
                self._partition.append(self._split(g["params"]))
                self._view_partition(self._partition[-1])
            # ZeRO-1 notes each backward with a hook per parameter; ZeRO-2 counts the
            # reducer's synchronised backwards instead, and needs none on its hot path.
            self._hooks += [p.register_post_accumulate_grad_hook(self._saw_backward) for p in params_all if p.requires_grad]
        # The reducer whose count of synchronised backwards a joined rank steps by (`_joined_step`).
        self._synced_by = self.reducer or _reducer_of(params_all)
        self._syncs = self._synced_by.reductions if self._synced_by is not None else 0
        if overlap_with_ddp:
            assert self._synced_by is not None
            self._hooks.append(self._synced_by.register_finish_hook(_StepInBackward(weakref.ref(self))))
        self.optim: Optimizer | None = None
        self._build_local_optimizer()
        Joinable.__init__(self)
        self._consolidated: dict[str, Any] | None = None
        self._ready = True

    # ------------------------------------------------------------------ sharded gradients

    def _shard_over(self, wrapper: Any, params_all: list[torch.Tensor], in_flight: int | None) -> None:
        """ZeRO-2: this optimizer must hold exactly the wrapper's trainable parameters."""
        reducer: Reducer = wrapper.reducer
        ours = {id(p) for p in params_all if p.requires_grad}
        theirs = {id(p): n for n, p in zip(reducer.names, reducer.params)}
        missing = [n for i, n in theirs.items() if i not in ours]
        extra = [i for i in ours if i not in theirs]
        if missing or extra:
            named = {id(p): n for n, p in wrapper.module.named_parameters()}
            raise ValueError(
                "ZeroRedundancyOptimizer: to shard the gradients it must hold every trainable parameter of "
                f"its gradsync.DistributedDataParallel and no others; missing: {missing[:8] or 'none'}"
                f"{' ...' if len(missing) > 8 else ''}; not synchronised by that wrapper: "
                f"{[named.get(i, '?') for i in extra][:8] or 'none'}. Give all of the wrapper's parameters to "
                "one sharded optimizer (parameter groups may differ), or pass shard_gradients=False (ZeRO-1)."
            )
        if reducer.shard_owner is not None and reducer.shard_owner() is not None:
            raise ValueError("ZeroRedundancyOptimizer: another sharded optimizer already holds this wrapper's "
                             "gradients; build one per wrapper")
        check_dense(reducer)
        self.reducer = wrapper.shard_gradients(in_flight)
        reducer.shard_owner = weakref.ref(self)
        position = {id(p): i for i, p in enumerate(params_all)}
        self._pieces = pieces_of(reducer, position)
        self._had_grad: set[int] = set()  # reducer indices with a gradient since zero_grad(set_to_none=True)
        self._gathers = Gathers(reducer, self._pieces, wrapper.module, self.process_group, self.timeout)
        weakref.finalize(self, self._gathers.remove_hooks)

    @property
    def shards_gradients(self) -> bool:
        """Whether gradients are sharded too (ZeRO-2), not only the optimizer state."""
        return self.reducer is not None

    def wait_parameters(self) -> None:
        """Finish the all-gathers of the last step now (forward and state_dict do it by
        themselves): call before reading parameters' values any other way."""
        if self._gathers is not None:
            self._gathers.finish_all()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for this optimizer's parameters, on every rank
        (call it between backward and `step()`): with sharded gradients the norm is reduced
        from the shards' norms. Returns the total norm."""
        if self.overlap_with_ddp:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.clip_grad_norm_ with overlap_with_ddp=True: the step has already run, "
                "inside backward, so there is no moment to clip in; build the optimizer without "
                "overlap_with_ddp to clip by the global norm"
            )
        if self.reducer is None:
            params = [p for g in self.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        self._take_shards()
        return clip_sharded(self._pieces, max_norm, norm_type, self.process_group, self.timeout, error_if_nonfinite)

    def _take_shards(self) -> None:
        assert self.reducer is not None
        set_piece_grads(self._pieces, self.reducer.last_used, self._had_grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's. Under ZeRO-2 it also decides what a parameter unused on every rank
        steps with, as under DDP: nothing after `set_to_none=True`, zeros after `False` once it
        has had a gradient."""
        super().zero_grad(set_to_none)
        if set_to_none and getattr(self, "reducer", None) is not None:
            self._had_grad.clear()

    # ------------------------------------------------------------------ partition

    def _split(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """torch's greedy partition of one group, continuing from the groups before it."""
        per_rank: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        for p in sorted(params, key=lambda t: t.numel(), reverse=True):
            rank = self._loads.index(min(self._loads))
            per_rank[rank].append(p)
            self._loads[rank] += p.numel()
        return per_rank

    def _view_partition(self, part: list[list[torch.Tensor]]) -> None:
        """`parameters_as_bucket_view` (ZeRO-1, as torch's keyword): each owner's contiguous
        parameters of one group become views of a flat buffer per dtype and device, which its
        broadcast sends and receives where it lies, with no copy in or out. Parameters whose
        memory has another layout travel as before (`Broadcasts`). As under torch's class,
        replacing a parameter's `.data` afterwards (`model.to(...)`) cuts it off its buffer."""
        if not self.parameters_as_bucket_view:
            return
        for rank, params in enumerate(part):
            for buffer, members in _flat_views(params):
                self._flats.append((rank, buffer))
                self._viewed.update(id(p) for p in members)

    def _pieces_by_group(self) -> list[list[Piece]]:
        """This rank's pieces, per parameter group (the local optimizer's groups), in order."""
        if self.reducer is not None:
            by_group: list[list[Piece]] = [[] for _ in self.param_groups]
            ends = list(itertools.accumulate(len(g["params"]) for g in self.param_groups))
            for piece in self._pieces:
                by_group[bisect.bisect_right(ends, piece.index)].append(piece)
            return by_group
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return [[Piece(index[id(p)], 0, p.numel(), True, p, None) for p in part[self.rank]] for part in self._partition]

    def _local_groups(self) -> list[dict[str, Any]]:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [p.tensor for p in mine]}
                for g, mine in zip(self.param_groups, self._pieces_by_group())]

    def _local_pieces(self) -> list[Piece]:
        """What the local optimizer steps, in its own order (the order of its state)."""
        return [p for group in self._pieces_by_group() for p in group]

    def _build_local_optimizer(self) -> None:
        groups = self._local_groups()
        owned = [g for g in groups if g["params"]]
        # A rank that owns nothing (more ranks than parameters) steps nothing.
        self.optim = self.optimizer_class(groups, **self._optim_defaults) if owned else None

    def owner(self, param: torch.Tensor) -> int:
        """The rank that steps `param` and holds its optimizer state."""
        for part in self._partition:
            for rank, params in enumerate(part):
                if any(p is param for p in params):
                    return rank
        raise KeyError("ZeroRedundancyOptimizer.owner: not one of this optimizer's parameters")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (the next `step()` checks that all did): it is partitioned
        after the existing ones, which keep their owners and state."""
        if getattr(self, "reducer", None) is not None:
            raise ValueError(
                "ZeroRedundancyOptimizer.add_param_group: the gradients are sharded over the wrapper's "
                "buckets, which this optimizer already holds whole; give every group at construction "
                "(or pass shard_gradients=False to add groups later)"
            )
        super().add_param_group(param_group)
        if not getattr(self, "_ready", False):
            return  # the constructor partitions the initial groups itself
        group = self.param_groups[-1]
        self._hooks += [p.register_post_accumulate_grad_hook(self._saw_backward) for p in group["params"] if p.requires_grad]
        self._partition.append(self._split(group["params"]))
        self._view_partition(self._partition[-1])
        mine = self._local_groups()[-1]
        if self.optim is None:
            self._build_local_optimizer()
        elif mine["params"]:
            self.optim.add_param_group(mine)
        else:  # keep the local groups aligned with the global ones
            self.optim.param_groups.append({**mine, "params": []})

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the owned parameters, then broadcast every owner's parameters to the others.
        With `overlap_with_ddp` the step has run inside backward already: nothing to do."""
        Join.notify_join_context(self)  # as torch's class: when it is the first joinable
        if self.overlap_with_ddp:
            if closure is not None:
                raise ValueError(
                    "ZeroRedundancyOptimizer.step(closure) with overlap_with_ddp=True: the step runs inside "
                    "backward, where a closure cannot re-evaluate the model; build it without overlap_with_ddp"
                )
            return None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_now()
        return loss

    @torch.no_grad()
    def _step_now(self) -> None:
        if self._gathers is not None:
            self._gathers.finish_all()  # a step without a forward since the last one
        agreement = self._start_agreement()
        ready, self._backward_seen = self._backward_seen, False
        if self._synced_by is not None:
            self._syncs = self._synced_by.reductions
        if self.reducer is not None:
            self._take_shards()
        if self.optim is not None:
            for local, group in zip(self.optim.param_groups, self.param_groups):
                for key, value in group.items():  # an LR scheduler writes into our groups
                    if key != "params":
                        local[key] = value
        if self._gathers is not None:
            self._step_and_gather(self._gathers)
            return
        if self.optim is not None and ready:
            self.optim.step()
        if agreement is not None:  # in flight during the local step, which it refuses before any broadcast
            self._finish_agreement(agreement)
        self._broadcast_parameters()

    def _step_and_gather(self, gathers: Gathers) -> None:
        """Step the slices, then gather them back in the order the next forward needs them.
        (Stepping a few buckets at a time, each group's gathers started while the next one
        steps, measured slower on loopback: 6.4 against 5.5 ms a step on tiny_gpt, the
        gathers' copies competing with the step for the same cores.)"""
        if self.optim is not None:
            self.optim.step()
        if self.overlap_param_gather:
            gathers.start(gathers.order)
        else:  # two in flight: one arriving while the last is written into the parameters
            gathers.start(gathers.order, window=2)
            gathers.finish_all()

    def _broadcast_parameters(self) -> None:
        """Every owner's broadcasts in flight at once (as torch's class), then waited for."""
        broadcasts = Broadcasts(self.process_group, self.timeout)
        for rank, buffer in self._flats:
            broadcasts.start_in_place(buffer, rank, f"broadcast of the parameters rank {rank} stepped")
        for rank in range(self.world_size):
            owned = [p for part in self._partition for p in part[rank] if id(p) not in self._viewed]
            if owned:
                broadcasts.start(owned, rank, f"broadcast of the parameters rank {rank} stepped")
        broadcasts.finish()

    def _start_agreement(self) -> GatheringInts | None:
        """ZeRO-1 on a host group: start agreeing that every rank is ready for this step (the
        same parameter groups, a backward since its last step), finished after this rank's
        local step (`_finish_agreement`): the round trip hides behind the step. Otherwise each
        rank checks itself (`_check_own_backward`) and None."""
        if self.reducer is not None or not self._agree_each_step:
            self._check_own_backward()
            return None
        mine = [len(self.param_groups), sum(p.numel() for g in self.param_groups for p in g["params"]),
                int(self._backward_seen)]
        return start_all_gather_ints(self.process_group, mine)

    def _finish_agreement(self, agreement: GatheringInts) -> None:
        """Refuse, on every rank alike, a step some rank was not ready for, before any parameter
        is sent: the ranks that were have stepped their own share (a rank with no backward has
        not), so the error leaves the ranks' parameters apart; it is an error to stop on."""
        every = finish_all_gather_ints(agreement, self.process_group, self.timeout)
        if len({tuple(v[:2]) for v in every}) > 1:
            seen = ", ".join(f"rank {r}: {v[0]} groups, {v[1]} elements" for r, v in enumerate(every))
            raise ValueError(
                f"ZeroRedundancyOptimizer.step: the ranks hold different parameter groups ({seen}). "
                "Call add_param_group with the same group on every rank."
            )
        idle = [r for r, v in enumerate(every) if not v[2]]
        if idle:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.step: no backward since the last step on rank(s) {idle} "
                f"(of {self.world_size}): run loss.backward() before every step(), on every rank."
            )

    def _check_own_backward(self) -> None:
        """Without the agreement collective (sharded gradients: a per-step round trip, 2-3 % of
        a small model's step on loopback, and the groups cannot change since `add_param_group`
        is refused; a device group: no host read per step) a rank without a backward knows it.
        It raises here; a rank that did run one is then waiting in a collective this rank never
        joins, and raises within its timeout (the process group's, on a device group)."""
        if self.reducer is not None:
            if self.reducer.reductions > self._syncs:
                return
            what = ("synchronised backward", "the gradients are sharded only by a backward outside no_sync(); ")
        elif self._backward_seen:
            return
        else:
            what = ("backward", "")
        raise RuntimeError(
            f"ZeroRedundancyOptimizer.step: no {what[0]} since the last step on rank {self.rank} "
            f"(of {self.world_size}): {what[1]}run one before every step(), on every rank."
        )

    # ------------------------------------------------------------------ uneven inputs

    def join_hook(self, **_kwargs: Any) -> JoinHook:
        """For `torch.distributed.algorithms.join.Join([model, optimizer])` (the model first:
        a joined rank answers its collectives in the order the joinables are listed): a rank
        that has run out of data still steps its share after each synchronised iteration of
        the others and sends it, as torch's class does. Over a gradsync wrapper its share is
        stepped with that iteration's averages (the wrapper's joined rank takes the sums in:
        `engine.shadow`); torch's DDP leaves a joined rank its last gradients, which torch's
        class then steps with again."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _joined_step(self) -> None:
        """The step of a rank that has joined, once per iteration of the ranks still training.
        Over a gradsync wrapper only after a synchronised one (the others step then; inside
        no_sync they accumulate), on every iteration otherwise (torch's class)."""
        if self._synced_by is not None and self._synced_by.reductions == self._syncs:
            return
        self._backward_seen = True  # its backward was the shadow iteration
        self._step_now()
        if self._gathers is not None:
            self._gathers.finish_all()  # no forward of its own will

    # ------------------------------------------------------------------ state dicts

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state onto rank `to` (call on every rank)."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict(to={to}): expected a rank in 0..{self.world_size - 1}")
        local = self.optim.state_dict()["state"] if self.optim is not None else {}
        # Local state keys run over the local pieces in order (`_local_pieces`).
        mine = [(p.index, p.start, p.numel, p.whole, local[i]) for i, p in enumerate(self._local_pieces()) if i in local]
        gathered = all_gather_objects(self.process_group, mine, self.timeout)
        if self.rank != to:
            self._consolidated = None
            return
        params = [p for g in self.param_groups for p in g["params"]]
        by_param: dict[int, list[tuple[int, int, bool, dict[str, Any]]]] = {}
        for part in gathered:
            for index, start, numel, whole, state in part:  # type: ignore[attr-defined]
                by_param.setdefault(index, []).append((start, numel, whole, state))
        merged = {i: _join_pieces(params[i], sorted(pieces, key=lambda t: t[0])) for i, pieces in by_param.items()}
        self._consolidated = {"state": dict(sorted(merged.items())), "param_groups": self._global_groups()}

    def _global_groups(self) -> list[dict[str, Any]]:
        start, groups = 0, []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return groups

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, on the rank `consolidate_state_dict(to=...)` named."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict on rank {self.rank}: call consolidate_state_dict(to=r) "
                "on every rank first; then rank r holds the whole state"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (consolidated or unsharded) state dict; each rank keeps its share."""
        groups, total = state_dict.get("param_groups"), sum(len(g["params"]) for g in self.param_groups)
        if not isinstance(groups, list) or [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            sizes = [len(g["params"]) for g in groups] if isinstance(groups, list) else groups
            raise ValueError(
                f"ZeroRedundancyOptimizer.load_state_dict: the dict's parameter groups hold {sizes} parameters, "
                f"this optimizer's {[len(g['params']) for g in self.param_groups]} ({total} in all)"
            )
        for ours, theirs in zip(self.param_groups, groups):
            ours.update({k: v for k, v in theirs.items() if k != "params"})
        state = {int(k): v for k, v in state_dict.get("state", {}).items()}
        params = [p for g in self.param_groups for p in g["params"]]
        if self.optim is not None:
            local = self.optim.state_dict()
            local["state"] = {i: _cut_piece(params[p.index], p, state[p.index])
                              for i, p in enumerate(self._local_pieces()) if p.index in state}
            local["param_groups"] = [{**{k: v for k, v in g.items() if k != "params"}, "params": lg["params"]}
                                     for g, lg in zip(self.param_groups, local["param_groups"])]
            self.optim.load_state_dict(local)
        self._consolidated = None

    def __repr__(self) -> str:
        total = sum(len(g["params"]) for g in self.param_groups)
        if self.reducer is not None:
            numel = sum(p.numel for p in self._pieces)
            return (f"gradsync.ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank} of "
                    f"{self.world_size}, gradients sharded: steps {numel} elements of {total} parameters)")
        owned = sum(len(part[self.rank]) for part in self._partition)
        return (f"gradsync.ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank} of "
                f"{self.world_size}, owns {owned} of {total} parameters)")


def hook_with_zero_step(hook: Callable[..., Any], ddp: Any, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> Callable[..., Any]:
    """torch's `ddp_zero_hook.hook_with_zero_step`, for code ported from torch: checks that
    `zero` steps inside `ddp`'s backward (`overlap_with_ddp=True` over that gradsync wrapper)
    and returns `hook` itself, to register as usual. gradsync's optimizer steps inside backward
    without any hook's help; `shard_buckets` is accepted (ZeRO-2 shards every bucket anyway)."""
    del shard_buckets
    if not isinstance(zero, ZeroRedundancyOptimizer) or not zero.overlap_with_ddp:
        raise ValueError(
            "hook_with_zero_step: the optimizer must be a gradsync.ZeroRedundancyOptimizer constructed with "
            f"overlap_with_ddp=True, got {type(zero).__name__}"
            f"{'' if not isinstance(zero, ZeroRedundancyOptimizer) else ' with overlap_with_ddp=False'}"
        )
    if zero._synced_by is not getattr(ddp, "reducer", None):
        raise ValueError(
            "hook_with_zero_step: the optimizer's parameters are not this wrapper's; pass the "
            "gradsync.DistributedDataParallel that holds them"
        )
    return hook


def hook_with_zero_step_interleaved(hook: Callable[..., Any], ddp: Any, zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False) -> Callable[..., Any]:
    """torch's interleaved variant; gradsync's step is the same either way (`hook_with_zero_step`)."""
    return hook_with_zero_step(hook, ddp, zero, shard_buckets)


class _StepInBackward:
    """The reducer's finish hook under `overlap_with_ddp`: the step, inside backward, as soon as
    the synchronised iteration is finished (torch's hook steps there too, in the last bucket's
    hook). The wrapper's mixed-precision restore has run by then: it is queued first."""

    def __init__(self, owner: weakref.ref[ZeroRedundancyOptimizer]) -> None:
        self.owner = owner

    def __call__(self) -> None:
        owner = self.owner()
        if owner is not None:
            owner._step_now()


class _SawBackward:
    """A parameter's post-accumulate-grad hook: notes that backward ran since the last step."""

    def __init__(self, owner: weakref.ref[ZeroRedundancyOptimizer]) -> None:
        self.owner = owner

    def __call__(self, _param: torch.Tensor) -> None:
        owner = self.owner()
        if owner is not None:
            owner._backward_seen = True


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


class _ZeroJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        self.zero._joined_step()


def _reducer_of(params: list[torch.Tensor]) -> Reducer | None:
    """The reducer of the one live gradsync wrapper all these trainable parameters belong to."""
    trainable = [p for p in params if p.requires_grad]
    wrappers = _wrappers(trainable)
    if len(wrappers) != 1 or any(getattr(p, "_gradsync_wrapper", _none)() is None for p in trainable):
        return None
    return next(iter(wrappers.values())).reducer


def _wrapper_of(params: list[torch.Tensor]) -> Any:
    """The live gradsync wrapper these parameters belong to, if any (one is required)."""
    found = _wrappers(params)
    if len(found) > 1:
        raise ValueError(
            f"ZeroRedundancyOptimizer: the parameters belong to {len(found)} gradsync.DistributedDataParallel "
            "wrappers; to shard gradients give each wrapper's parameters to an optimizer of their own, "
            "or pass shard_gradients=False"
        )
    return next(iter(found.values()), None)


def _wrappers(params: list[torch.Tensor]) -> dict[int, Any]:
    return {id(w): w for p in params if (w := getattr(p, "_gradsync_wrapper", _none)()) is not None}


def _none() -> None:
    return None


def _flat_views(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """One flat buffer per dtype and device holding these contiguous parameters' values, each
    parameter's `.data` now a view of it with the parameter's own strides; with the parameters
    that view each."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        if p.is_contiguous():
            kinds.setdefault((p.dtype, p.device), []).append(p)
    buffers = []
    with torch.no_grad():
        for (dtype, device), members in kinds.items():
            buffer = torch.empty(sum(p.numel() for p in members), dtype=dtype, device=device)
            starts = itertools.accumulate((p.numel() for p in members), initial=0)
            for start, p in zip(starts, members):
                # With its own strides (`view_like`, not `view_as`): a weight contiguous in two
                # memory formats at once (a channels-last conv weight with one input channel)
                # keeps the one it had, and so do the kernels its convolution picks, and its bits.
                view = view_like(buffer, start, p)
                view.copy_(p.detach())
                p.data = view
            buffers.append((buffer, members))
    return buffers


def _per_element(value: Any, numel: int) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel


def _join_pieces(param: torch.Tensor, pieces: list[tuple[int, int, bool, dict[str, Any]]]) -> dict[str, Any]:
    """One parameter's state from its pieces' (in order): per-element tensors concatenated into
    the parameter's shape and layout, everything else (a step count) from the first piece."""
    if len(pieces) == 1 and pieces[0][2]:
        return pieces[0][3]
    first = pieces[0][3]
    joined: dict[str, Any] = {}
    for key, value in first.items():
        if _per_element(value, pieces[0][1]):
            whole = torch.empty_strided(param.size(), param.stride(), dtype=value.dtype)
            flat(whole).copy_(torch.cat([state[key] for _, _, _, state in pieces]))
            joined[key] = whole
        else:
            joined[key] = value
    return joined


def _cut_piece(param: torch.Tensor, piece: Piece, state: dict[str, Any]) -> dict[str, Any]:
    """A piece's share of one parameter's whole state (the inverse of `_join_pieces`)."""
    if piece.whole:
        return state
    cut: dict[str, Any] = {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == param.shape:
            laid = torch.empty_strided(param.size(), param.stride(), dtype=value.dtype, device=value.device)
            laid.copy_(value)
            cut[key] = flat(laid)[piece.start:piece.start + piece.numel].clone()
        else:
            cut[key] = value
    return cut

