"""gradsync under torchft: per-step fault tolerance, with gradsync's buckets overlapping backward.

`gradsync.ft.DistributedDataParallel(manager, module, **kwargs)` has the signature of
`torchft.ddp.DistributedDataParallel`, so a torchft training script switches with one import:

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510
    python examples/ft_train.py --replica-id 0     # and 1, 2 ... in other shells

How it divides the work (torchft is the engine for quorum, heartbeats and live recovery):

* Gradients cross replica groups only through the Manager (`manager.allreduce`, its
  reconfigurable process group): each bucket's hook launches one all-reduce as soon as the bucket
  is full and returns its Future at once; the end of backward waits for them (torchft's own
  DDP waits inside the hook, so nothing overlaps backward). A collective that fails is
  swallowed by the Manager and reported to it, so backward finishes and `should_commit()`
  discards the step.
* gradsync's engine sees this replica alone (a group of one, `_ReplicaLocal`): nothing in it
  depends on how many replicas the current quorum holds, so a quorum change never leaves its
  state (timeline, iteration count) inconsistent. The one cross-replica exchange it makes
  besides the buckets, the unused-parameter map, goes through the Manager too; so does the
  wrapper's own, the micro-step counts (`ReplicaGroup.send_with_next`), compared at the end of
  each synchronised backward, since the engine's check sees one replica.
* The bucket layout is derived from the model alone (`replica_layout`: reverse definition order,
  the expected ready order), never rebuilt from a measured order: a replica that recovers or
  joins late builds exactly the buckets of the others, so their collectives always match.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from . import comm_hooks
from .engine.bucketing import (
    DEFAULT_BUCKET_CAP_BYTES,
    DEFAULT_FIRST_BUCKET_BYTES,
    MIB,
    compute_bucket_assignment_by_size,
)
from .engine.comm import CommHook
from .engine.errors import GradSyncError
from .engine.reducer import Phase, Reducer
from .observability.log import log
from .wrapper.ddp import DistributedDataParallel as _GradsyncDDP

if TYPE_CHECKING:
    from torchft.manager import Manager

__all__ = ["DistributedDataParallel", "ReplicaGroup", "replica_layout"]

_WRAPPERS: weakref.WeakKeyDictionary[Any, itertools.count] = weakref.WeakKeyDictionary()

# Keywords whose meaning cannot hold when the set of replicas changes every step.
_REFUSED = {
    "process_group": "the Manager's reconfigurable process group carries the gradients; pass it to "
                     "torchft.Manager(pg=...)",
    "device_mesh": "the Manager's reconfigurable process group carries the gradients",
    "delay_all_reduce_named_params": "the delayed all-reduce runs over a fixed process group",
    "param_to_hook_all_reduce": "the delayed all-reduce runs over a fixed process group",
    "mixed_precision": "gradsync runs no communication hook under mixed precision yet, and every "
                       "bucket goes through one here",
}

_SHARDED_REFUSAL = (
    "gradsync.ZeroRedundancyOptimizer under torchft: refused. It splits the optimizer state "
    "across a fixed set of ranks, but under torchft the replicas change from step to step: a "
    "replica that dies takes its shard with it, and torchft recovers a replica from one healthy "
    "peer's state_dict, which holds only that peer's shard.\nFixes:\n"
    "  1. wrap a whole optimizer: torchft.Optimizer(manager, torch.optim.AdamW(...));\n"
    "  2. to save memory, shard inside each replica group (torchft's HSDP), not across replicas."
)


def replica_layout(
    params: Sequence[torch.Tensor],
    limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Buckets (indices into `params`) derived from the model alone: parameters taken in reverse
    definition order, the order backward usually produces their gradients, cut at `limits`
    bytes (the first limit for the first bucket, so the first launch comes early; the last
    repeats). Every replica computes the same layout from the same model, a recovering one too."""
    order = list(reversed(range(len(params))))
    layout, _ = compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, expect_sparse_gradient, tensor_indices=order
    )
    return layout


class _Done(dist.Work):
    """A collective of a group of one: complete at once, with its tensors."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(tensors)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class _ManagedWork(dist.Work):
    """An all-reduce through the Manager, as a Work with a real Future, returned at once.

    `manager.allreduce` checks this step's quorum, zeroes the tensor of a replica still
    recovering, starts the collective on the Manager's process group and reports an error raised
    there. Its own Future is built lazily, when waited for (why torchft's DDP waits inside the
    hook); the collective's Future is chained instead through `manager.wrap_future`, which bounds
    it by the Manager's timeout and turns a failure into a report to the Manager and the (then
    meaningless) tensor: the step goes on, `should_commit()` discards it. So this never fails."""

    def __init__(self, manager: Manager, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        super().__init__()
        average = op == dist.ReduceOp.AVG
        divisor = manager.num_participants() if average else 1
        work = manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM if average else op)
        # the process group's own work, if one was started
        self._work = getattr(work, "_work", None)
        if self._work is None:  # the Manager has seen an error this step: nothing was sent
            self._future: torch.futures.Future = torch.futures.Future()
            self._future.set_result([tensor])
            return
        sent = manager.wrap_future(self._work.get_future(), [tensor])
        self._future = sent.then(lambda fut: [fut.value()[0].div_(divisor)]) if average else sent

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._future.value()

    def get_future(self) -> torch.futures.Future:
        return self._future


def _reduce_op(opts: object) -> dist.ReduceOp:
    if opts is None:
        return dist.ReduceOp.SUM  # type: ignore[return-value]
    if isinstance(opts, dist.AllreduceOptions):
        return opts.reduceOp  # type: ignore[return-value]
    return opts  # type: ignore[return-value]


class ReplicaGroup(dist.ProcessGroup):
    """The replica groups of the current quorum, as a process group for communication hooks:
    `size()` is the number of participants in this step's quorum, `allreduce` goes through
    `manager.allreduce` (sum unless told otherwise; a replica still recovering sends zeros) and
    returns at once with a Work whose Future completes when the sum has landed. gradsync's hooks
    (`gradsync.comm_hooks`, `group.allreduce`) and torch's (`ddp_comm_hooks.default_hooks`,
    `dist.all_reduce(group=...)`, which calls the same method) run on it unchanged."""

    def __init__(self, manager: Manager) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # (rank, size): the overload torchft uses too
        self.manager = manager
        self._report: torch.Tensor | None = None
        self.report_work: dist.Work | None = None  # the last report sent, summed across replicas

    def send_with_next(self, report: torch.Tensor) -> None:
        """Sum `report` across the quorum's replicas just before the next all-reduce (this step's
        first bucket): it takes the same place in every replica's sequence of collectives, and
        it is long landed when backward ends."""
        self._report, self.report_work = report, None

    def size(self) -> int:
        return max(1, self.manager.num_participants())  # waits for this step's quorum

    def rank(self) -> int:
        return self.manager.participating_rank() or 0

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        if len(tensors) != 1:
            raise ValueError(f"ReplicaGroup.allreduce: one tensor per call, got {len(tensors)}")
        if self._report is not None:
            report, self._report = self._report, None
            self.report_work = _ManagedWork(self.manager, report, dist.ReduceOp.SUM)  # type: ignore[arg-type]
        return _ManagedWork(self.manager, tensors[0], _reduce_op(opts))

    def getBackendName(self) -> str:
        return "torchft-managed"


class _ReplicaLocal(dist.ProcessGroup):
    """What gradsync's engine sees as its group: this replica alone, rank 0 of 1. Its buckets are
    reduced by the hook (through `replicas`); an all-reduce it makes itself (the unused-parameter
    map) is summed across replicas through the Manager; the rest is a group of one's."""

    def __init__(self, replicas: ReplicaGroup) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # (rank, size): the overload torchft uses too
        self.replicas = replicas

    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        return self.replicas.allreduce(tensors, opts)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object = None
    ) -> dist.Work:
        for out, tensor in zip(outputs, inputs):
            out[0].copy_(tensor)
        return _Done(inputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:  # type: ignore[override]
        return _Done(tensors)

    def barrier(self, opts: object = None) -> dist.Work:  # type: ignore[override]
        return _Done([])

    def getBackendName(self) -> str:
        return "torchft-replica-local"


def _limits(kwargs: dict[str, Any]) -> list[int]:
    caps = kwargs.get("bucket_cap_mb_list")
    if caps:
        return [int(c * MIB) for c in caps]
    cap = kwargs.get("bucket_cap_mb")  # as torch: a cap given is every bucket's, the first's too
    return (
        [DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES] if cap is None else [int(cap * MIB)]
    )


def _check_keywords(kwargs: dict[str, Any]) -> None:
    refused = [f"{k}: {why}" for k, why in _REFUSED.items() if kwargs.get(k) is not None]
    if kwargs.get("bucket_cap_mb") == "auto":
        refused.append(
            'bucket_cap_mb="auto": the planner would measure each replica on its own and '
            "change the layout mid-run; a recovering replica must build the same buckets"
        )
    if kwargs.get("init_sync"):
        refused.append(
            "init_sync=True: torchft's Manager syncs step 0 itself (Manager(init_sync=...))"
        )
    if refused:
        lines = "\n".join(f"  {i}. {why}" for i, why in enumerate(refused, 1))
        raise ValueError(
            "gradsync.ft.DistributedDataParallel: cannot take these "
            f"keywords under torchft:\n{lines}\nLeave them out; "
            "every other keyword of gradsync.DistributedDataParallel works."
        )


class DistributedDataParallel(_GradsyncDDP):
    """gradsync's DDP under a torchft `Manager`:
    `DistributedDataParallel(manager, module, **kwargs)`, torchft's signature; the keywords of
    `gradsync.DistributedDataParallel` (bucket caps, find_unused_parameters, static_graph,
    gradient_as_bucket_view, ...) apply, and no_sync(), communication hooks
    (`register_comm_hook(state, hook)`, state None: `self.replica_group`), stats() and the
    timeline work as there. Use it with `torchft.Optimizer(manager, optim)`."""

    def __init__(self, manager: Manager, module: nn.Module, **kwargs: Any) -> None:
        _check_keywords(kwargs)
        replicas = ReplicaGroup(manager)
        super().__init__(module, process_group=_ReplicaLocal(replicas),
                         **{**kwargs, "init_sync": False})
        self.manager, self.replica_group = manager, replicas
        self._hooked = False
        self._synced_at: int | None = None  # the Manager's step at the last synchronised forward
        # forwards with grad since the last synchronised one; its count
        self._forwards = self._reported = 0
        self._report_templates: dict[int, torch.Tensor] = {}
        reducer = self._require_reducer()
        reducer.install_layout(
            replica_layout(reducer.params, _limits(kwargs), reducer.expect_sparse_gradient)
        )
        reducer.register_finish_hook(self._check_micro_steps)
        # One key per wrapper of this Manager, in construction order: the same on every replica.
        key = f"gradsync.{_WRAPPERS.setdefault(manager, itertools.count()).__next__()}"
        manager.register_state_dict_fn(key, self._load_replica_state, self._replica_state)

    def _require_reducer(self) -> Reducer:
        if self.reducer is None:
            raise ValueError(
                "gradsync.ft.DistributedDataParallel: the module has no trainable parameter"
            )
        return self.reducer

    def overlap_optimizer(self, optimizer: torch.optim.Optimizer, tail_mb: float | None = None,
                          chunk_mb: float | None = None,
                          credit_mb: float | None = None) -> NoReturn:
        """Refused: torchft decides after backward whether the step commits
        (`Manager.should_commit`), so no bucket may be stepped before that answer."""
        raise RuntimeError(
            "gradsync.ft.DistributedDataParallel.overlap_optimizer: torchft decides after "
            "backward whether this step commits (manager.should_commit()), and a bucket stepped "
            "during backward could not be taken back if it does not. Step the optimizer "
            "torchft wraps (torchft.optim.OptimizerWrapper) after backward instead."
        )

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """As gradsync's (torch's protocol); a `state` of None becomes `self.replica_group`, so
        `register_comm_hook(None, gradsync.comm_hooks.fp16_compress_hook)` averages over the
        quorum's replicas in float16. The hook must send through `ReplicaGroup.allreduce` (or the
        Manager) for the step to be fault tolerant."""
        super().register_comm_hook(self.replica_group if state is None else state, hook)
        self._hooked = True

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._hooked:  # registered here, not in __init__, so a user's hook may come first
            self.register_comm_hook(None, comm_hooks.allreduce_hook)
        self._drop_discarded_step()
        self._report_micro_steps()
        return super().forward(*inputs, **kwargs)

    # ------------------------------------------------ micro-steps, compared across replicas

    def _report_micro_steps(self) -> None:
        """gradsync's engine sees this replica alone, so its own check of the micro-step counts
        (no_sync forwards) covers one replica. Across replicas: each sends [1, m, m*m] with its
        first bucket; the sums [n, S, Q] say whether every participant covered the same m
        (n * Q == S * S exactly when all are equal)."""
        if not torch.is_grad_enabled():
            return
        self._forwards += 1
        if self.require_backward_grad_sync:
            m, self._forwards = self._forwards, 0
            self._reported = m
            self.replica_group.send_with_next(self._report_of(m).clone())

    def _report_of(self, m: int) -> torch.Tensor:
        """[1, m, m*m] on the model's device, made once per count: a tensor built from a list
        on a GPU is a copy from the host that waits for the stream, every step."""
        template = self._report_templates.get(m)
        if template is None:
            if len(self._report_templates) > 64:  # counts that keep changing: stay bounded
                self._report_templates.clear()
            device = self._require_reducer().buckets[0].buffer.device
            template = self._report_templates[m] = torch.tensor(
                [1, m, m * m], dtype=torch.int64, device=device
            )
        return template

    def _check_micro_steps(self) -> None:
        """At the end of each synchronised backward, on every replica alike (the same sums):
        raise if the participants covered different numbers of micro-steps. The read waits for
        the device, which torchft's should_commit, called next, does anyway."""
        work, self.replica_group.report_work = self.replica_group.report_work, None
        if work is None or not self._require_reducer().config.check_accumulation:
            return
        work.wait()
        n, total, squares = (int(v) for v in work.result()[0].tolist())
        if n > 1 and n * squares != total * total:
            raise GradSyncError(
                f"gradsync.ft: the {n} replicas of step {self.manager.current_step()} covered "
                "different numbers of micro-steps (forwards with gradients since the last "
                f"synchronised one): {total} in all, {self._reported} on this replica. Their "
                "gradients are averaged with equal weight, so the step would weigh some replicas' "
                "batches more than others'.\nFix: run the same number of micro-steps (no_sync "
                "forwards + 1) per step on every replica; or turn the check off with "
                "set_accumulation_check(False)."
            )

    def _drop_discarded_step(self) -> None:
        """A backward that raised on this replica left its iteration half reduced. The script
        reports the error to the Manager (`manager.report_error(e)`, as under torchft's DDP), so
        no replica commits the step: drop it, as gradsync drops an iteration after reporting an
        error, so that the retried step starts clean instead of raising here. After any step that
        was not committed, the retry reduces in fresh buckets."""
        reducer = self._require_reducer()
        if reducer.phase in (Phase.BACKWARD, Phase.LAUNCHED):
            log.warning(
                "gradsync.ft: iteration %d never finished its backward on this replica; dropped",
                reducer.iteration,
            )
            reducer.abandon_iteration()
        if not (torch.is_grad_enabled() and self.require_backward_grad_sync):
            return
        step = self.manager.current_step()
        if step == self._synced_at:
            # The last synchronised step was not committed. A collective of it may outlive the
            # Manager's timeout and still write into its buckets' memory (a gloo receive that
            # times out a moment later, on a process group the new quorum has replaced): reduce
            # this step in fresh buckets, and leave the old ones to it.
            reducer.install_layout(reducer.bucket_indices)
        self._synced_at = step

    def shard_gradients(
        self, in_flight: int | None = None, reduce_by: str | None = None
    ) -> Reducer:
        raise ValueError(_SHARDED_REFUSAL)

    def check_sharded_optimizer(self, group: dist.ProcessGroup) -> None:
        if group.size() > 1:  # over a group of one (this replica's own ranks: 1) nothing is split
            raise ValueError(_SHARDED_REFUSAL)

    # ---------------------------------------------------------------- live recovery

    def _replica_state(self) -> dict[str, Any]:
        reducer = self._require_reducer()
        return {"layout": reducer.bucket_indices, "iteration": reducer.iteration}

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        """From the healthy peer this replica recovers from (applied by the Manager between
        steps)."""
        reducer = self._require_reducer()
        if state["layout"] != reducer.bucket_indices:
            raise ValueError(
                "gradsync.ft: the peer this replica recovers from reduces its "
                f"gradients in other buckets ({len(state['layout'])} buckets there, "
                f"{len(reducer.bucket_indices)} here). Every replica must build the "
                "same model and pass the same bucket_cap_mb / bucket_cap_mb_list."
            )
        reducer.iteration = state["iteration"]
