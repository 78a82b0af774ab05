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
reduce-scatter is an all-to-all and a local sum (`engine.bucket_shard.ReduceBy`).
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

The class keeps the lifecycle (construction, step, join); its collaborators hold the rest:
`zero_setup` (the constructor's checks, finding the wrapper), `zero_partition` (ZeRO-1's
owners, bucket views and broadcasts), `zero_shards` (ZeRO-2's pieces, gathers and clipping),
`zero_readiness` (whether every rank is ready to step), `zero_state` (state dicts) and
`zero_hooks` (the step inside backward, the `Join` hook).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from ..engine.collectives import DEFAULT_TIMEOUT, GatheringInts
from ..engine.device import host_runs_collectives
from ..engine.reducer import Reducer
from . import zero_state
from .zero_hooks import StepInBackward, ZeroJoinHook, remove_all
from .zero_partition import Partition, flat_views
from .zero_readiness import BackwardSeen, check_own_backward, finish_agreement, start_agreement
from .zero_setup import (
    check_optimizer_class,
    check_overlap_target,
    check_partition_allowed,
    check_shardable,
    check_unique,
    full_defaults,
    reducer_of,
    resolve_group,
    sharding_wrapper,
)
from .zero_shards import Gathers, Piece, clip_sharded, group_pieces, pieces_of, set_piece_grads

__all__ = ["ZeroRedundancyOptimizer", "hook_with_zero_step", "hook_with_zero_step_interleaved"]

_flat_views = flat_views  # its old name here, which tests import


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
        check_optimizer_class(optimizer_class)
        self._ready = False  # until the end: `add_param_group` leaves the first groups to us
        self._join_group(resolve_group(process_group))
        self.optimizer_class, self.timeout, self._optim_defaults = (
            optimizer_class,
            timeout,
            defaults,
        )
        self.parameters_as_bucket_view = parameters_as_bucket_view  # ZeRO-1: `Partition`
        self.overlap_with_ddp, self.overlap_param_gather = overlap_with_ddp, overlap_param_gather
        super().__init__(params, full_defaults(optimizer_class, defaults))
        params_all = self._params()
        check_unique(params_all)
        if overlap_with_ddp:
            check_overlap_target(params_all)
        self._start_noting_backwards()
        self._place(params_all, shard_gradients, buckets_in_flight)
        self._follow_synchronised_backwards(params_all)
        self.optim: Optimizer | None = None
        self._build_local_optimizer()
        Joinable.__init__(self)
        self._consolidated: dict[str, Any] | None = None
        self._ready = True

    # ------------------------------------------------------------------ construction steps

    def _join_group(self, group: dist.ProcessGroup) -> None:
        self.process_group: dist.ProcessGroup = group
        self.world_size, self.rank = group.size(), group.rank()
        # ZeRO-1's per-step agreement is read on the host: on a device group (NCCL) a sync every
        # step, which stops the host running ahead. There each rank checks what it knows itself,
        # as torch's class (which checks nothing), and a rank that differs leaves the others to
        # the process group's timeout.
        self._agree_each_step = host_runs_collectives(group)

    def _start_noting_backwards(self) -> None:
        self._seen = BackwardSeen()  # what the parameters' hooks hold: not the optimizer
        self._hooks: list[Any] = []
        weakref.finalize(self, remove_all, self._hooks)

    def _note_backwards_of(self, params: list[torch.Tensor]) -> None:
        self._hooks += [
            p.register_post_accumulate_grad_hook(self._seen) for p in params if p.requires_grad
        ]

    def _place(
        self, params_all: list[torch.Tensor], shard_gradients: bool | None, in_flight: int | None
    ) -> None:
        """Who steps what: this rank's slices of the wrapper's buckets (ZeRO-2), or the
        partition of the parameters (ZeRO-1)."""
        # empty under ZeRO-2
        self._partition = Partition(self.world_size, self.parameters_as_bucket_view)
        self.reducer: Reducer | None = None  # the wrapper's, when the gradients are sharded
        self._gathers: Gathers | None = None
        self._pieces: list[Piece] = []  # ZeRO-2: this rank's pieces, in bucket order
        # reducer indices with a gradient since zero_grad(set_to_none=True)
        self._had_grad: set[int] = set()
        wrapper = sharding_wrapper(params_all, shard_gradients)
        if wrapper is not None:
            self._shard_over(wrapper, params_all, in_flight)
            return
        check_partition_allowed(params_all, self.process_group)
        for g in self.param_groups:
            self._partition.add_group(g["params"])
        # ZeRO-1 notes each backward with a hook per parameter; ZeRO-2 counts the
        # reducer's synchronised backwards instead, and needs none on its hot path.
        self._note_backwards_of(params_all)

    def _shard_over(
        self, wrapper: Any, params_all: list[torch.Tensor], in_flight: int | None
    ) -> None:
        """ZeRO-2: this optimizer must hold exactly the wrapper's trainable parameters."""
        check_shardable(wrapper, params_all)
        reducer: Reducer = wrapper.reducer
        self.reducer = wrapper.shard_gradients(in_flight)
        reducer.shard_owner = weakref.ref(self)
        self._pieces = pieces_of(reducer, {id(p): i for i, p in enumerate(params_all)})
        self._gathers = Gathers(
            reducer, self._pieces, wrapper.module, self.process_group, self.timeout
        )
        weakref.finalize(self, self._gathers.remove_hooks)

    def _follow_synchronised_backwards(self, params_all: list[torch.Tensor]) -> None:
        """The reducer whose count of synchronised backwards a joined rank steps by
        (`_joined_step`), and in whose backward `overlap_with_ddp` steps."""
        self._synced_by = self.reducer or reducer_of(params_all)
        self._syncs = self._synced_by.reductions if self._synced_by is not None else 0
        if self.overlap_with_ddp:
            assert self._synced_by is not None
            step = StepInBackward(weakref.WeakMethod(self._step_now))
            self._hooks.append(self._synced_by.register_finish_hook(step))

    def _build_local_optimizer(self) -> None:
        groups = self._local_groups()
        owned = [g for g in groups if g["params"]]
        # A rank that owns nothing (more ranks than parameters) steps nothing.
        self.optim = self.optimizer_class(groups, **self._optim_defaults) if owned else None

    # ------------------------------------------------------------------ sharded gradients

    @property
    def shards_gradients(self) -> bool:
        """Whether gradients are sharded too (ZeRO-2), not only the optimizer state."""
        return self.reducer is not None

    @property
    def synced_by(self) -> Reducer | None:
        """The reducer of the gradsync wrapper whose parameters this optimizer holds (its
        synchronised backwards are what a joined rank and `overlap_with_ddp` step after);
        None when they are not one gradsync wrapper's."""
        return self._synced_by

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
                "ZeroRedundancyOptimizer.clip_grad_norm_ with overlap_with_ddp=True: "
                "the step has already run, inside backward, so there is no moment to clip in; "
                "build the optimizer without overlap_with_ddp to clip by the global norm"
            )
        if self.reducer is None:
            return torch.nn.utils.clip_grad_norm_(
                self._params(), max_norm, norm_type, error_if_nonfinite
            )
        self._take_shards()
        return clip_sharded(
            self._pieces, max_norm, norm_type, self.process_group, self.timeout, error_if_nonfinite
        )

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

    def _params(self) -> list[torch.Tensor]:
        """Every parameter, in order over all groups (the state dicts' indices)."""
        return [p for g in self.param_groups for p in g["params"]]

    @property
    def _flats(self) -> list[tuple[int, torch.Tensor]]:
        """ZeRO-1's flat buffers, as (owner, buffer) (`parameters_as_bucket_view`)."""
        return self._partition.flats

    def _pieces_by_group(self) -> list[list[Piece]]:
        """This rank's pieces, per parameter group (the local optimizer's groups), in order."""
        if self.reducer is not None:
            return group_pieces(self._pieces, [len(g["params"]) for g in self.param_groups])
        return self._partition.pieces(self.rank, {id(p): i for i, p in enumerate(self._params())})

    def _local_groups(self) -> list[dict[str, Any]]:
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [p.tensor for p in mine]}
            for g, mine in zip(self.param_groups, self._pieces_by_group())
        ]

    def _local_pieces(self) -> list[Piece]:
        """What the local optimizer steps, in its own order (the order of its state)."""
        return [p for group in self._pieces_by_group() for p in group]

    def owner(self, param: torch.Tensor) -> int:
        """The rank that steps `param` and holds its optimizer state."""
        return self._partition.owner(param)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (the next `step()` checks that all did): it is partitioned
        after the existing ones, which keep their owners and state."""
        if getattr(self, "reducer", None) is not None:
            raise ValueError(
                "ZeroRedundancyOptimizer.add_param_group: the gradients are sharded over the "
                "wrapper's buckets, which this optimizer already holds whole; give every group at "
                "construction (or pass shard_gradients=False to add groups later)"
            )
        super().add_param_group(param_group)
        if not getattr(self, "_ready", False):
            return  # the constructor partitions the initial groups itself
        group = self.param_groups[-1]
        self._note_backwards_of(group["params"])
        self._partition.add_group(group["params"])
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
                    "ZeroRedundancyOptimizer.step(closure) with overlap_with_ddp=True: "
                    "the step runs inside backward, where a closure cannot "
                    "re-evaluate the model; build it without overlap_with_ddp"
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
        ready = self._seen.take()
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
        # in flight during the local step, which it refuses before any broadcast
        if agreement is not None:
            finish_agreement(agreement, self.process_group, self.timeout)
        self._partition.broadcast(self.process_group, self.timeout)

    def _step_and_gather(self, gathers: Gathers) -> None:
        """Step the slices, then gather them back in the order the next forward needs them.
        (Stepping a few buckets at a time, each group's gathers started while the next one
        steps, was slower on loopback: the gathers' copies compete with the step for the same
        cores; figures: docs/benchmarks/design-figures.md#zero-grouped-steps-and-gathers.)"""
        if self.optim is not None:
            self.optim.step()
        if self.overlap_param_gather:
            gathers.start(gathers.order)
        else:  # two in flight: one arriving while the last is written into the parameters
            gathers.start(gathers.order, window=2)
            gathers.finish_all()

    def _start_agreement(self) -> GatheringInts | None:
        """ZeRO-1 on a host group: start agreeing that every rank is ready for this step,
        finished after this rank's local step (`zero_readiness`). Otherwise each rank checks
        itself, and None."""
        if self.reducer is not None or not self._agree_each_step:
            check_own_backward(self.reducer, self._syncs, self._seen.seen, self.process_group)
            return None
        return start_agreement(self.process_group, self.param_groups, self._seen.seen)

    # ------------------------------------------------------------------ uneven inputs

    def join_hook(self, **_kwargs: Any) -> JoinHook:
        """For `torch.distributed.algorithms.join.Join([model, optimizer])` (the model first:
        a joined rank answers its collectives in the order the joinables are listed): a rank
        that has run out of data still steps its share after each synchronised iteration of
        the others and sends it, as torch's class does. Over a gradsync wrapper its share is
        stepped with that iteration's averages (the wrapper's joined rank takes the sums in:
        `engine.shadow`); torch's DDP leaves a joined rank its last gradients, which torch's
        class then steps with again."""
        return ZeroJoinHook(self._joined_step)

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
        self._seen()  # its backward was the shadow iteration
        self._step_now()
        if self._gathers is not None:
            self._gathers.finish_all()  # no forward of its own will

    # ------------------------------------------------------------------ state dicts

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state onto rank `to` (call on every rank)."""
        if not 0 <= to < self.world_size:
            raise ValueError(
                f"consolidate_state_dict(to={to}): expected a rank in 0..{self.world_size - 1}"
            )
        self._consolidated = zero_state.consolidate(
            self.optim,
            self._local_pieces(),
            self.param_groups,
            self.process_group,
            self.timeout,
            to,
        )

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, on the rank `consolidate_state_dict(to=...)` named."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict on rank {self.rank}: "
                "call consolidate_state_dict(to=r) "
                "on every rank first; then rank r holds the whole state"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole (consolidated or unsharded) state dict; each rank keeps its share."""
        zero_state.load(self.optim, self._local_pieces(), self.param_groups, state_dict)
        self._consolidated = None

    def __repr__(self) -> str:
        total = sum(len(g["params"]) for g in self.param_groups)
        if self.reducer is not None:
            numel = sum(p.numel for p in self._pieces)
            return (
                f"gradsync.ZeroRedundancyOptimizer({self.optimizer_class.__name__}, "
                f"rank {self.rank} of {self.world_size}, gradients sharded: "
                f"steps {numel} elements of {total} parameters)"
            )
        return (
            f"gradsync.ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self.rank} "
            f"of {self.world_size}, owns {self._partition.owned(self.rank)} of {total} parameters)"
        )


def hook_with_zero_step(hook: Callable[..., Any], ddp: Any, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> Callable[..., Any]:
    """torch's `ddp_zero_hook.hook_with_zero_step`, for code ported from torch: checks that
    `zero` steps inside `ddp`'s backward (`overlap_with_ddp=True` over that gradsync wrapper)
    and returns `hook` itself, to register as usual. gradsync's optimizer steps inside backward
    without any hook's help; `shard_buckets` is accepted (ZeRO-2 shards every bucket anyway)."""
    del shard_buckets
    if not isinstance(zero, ZeroRedundancyOptimizer) or not zero.overlap_with_ddp:
        raise ValueError(
            "hook_with_zero_step: the optimizer must be a "
            "gradsync.ZeroRedundancyOptimizer constructed with "
            f"overlap_with_ddp=True, got {type(zero).__name__}"
            f"""{'' if not isinstance(zero, ZeroRedundancyOptimizer)
                 else ' with overlap_with_ddp=False'}"""
        )
    if zero.synced_by is not getattr(ddp, "reducer", None):
        raise ValueError(
            "hook_with_zero_step: the optimizer's parameters are not this wrapper's; pass the "
            "gradsync.DistributedDataParallel that holds them"
        )
    return hook


def hook_with_zero_step_interleaved(
    hook: Callable[..., Any], ddp: Any, zero: ZeroRedundancyOptimizer, shard_buckets: bool = False
) -> Callable[..., Any]:
    """torch's interleaved variant; gradsync's step is the same either way
    (`hook_with_zero_step`)."""
    return hook_with_zero_step(hook, ddp, zero, shard_buckets)
