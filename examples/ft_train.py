"""Train under torchft with gradsync: one replica group per process, surviving a replica killed by hand.

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 --heartbeat_timeout_ms 1000 &
    for r in 0 1 2; do python examples/ft_train.py --replica-id $r --min-replicas 2 --step-seconds 0.2 & done
    # kill -9 one replica's python: the others go on at two; start it again: it recovers live.
    # (where the host name does not resolve to a local address, export GLOO_SOCKET_IFNAME=lo)

Each line it prints is a change: a new quorum (who takes part), a step that was not committed,
a recovery from a peer. The switch from torchft's DDP is the one import of
`gradsync.ft.DistributedDataParallel`. The test-only flags (`--stall-at`, `--raise-at`,
`--slow-at`, `--log`, `--save`, `--go`) inject faults and record every committed step for
tests/processes/test_ft.py; `--accumulate`, `--find-unused` and `--hook` exercise no_sync, an
unused branch and a compression hook.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torchft import Manager, Optimizer, ProcessGroupGloo

from gradsync import comm_hooks
from gradsync.ft import DistributedDataParallel

WIDTH, CLASSES = 64, 8


class Net(nn.Module):
    """Four layers; with `side`, a branch that only some forwards use (find_unused_parameters)."""

    def __init__(self, side: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.Tanh(), Fault(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
            nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES),
        )
        self.side = nn.Linear(WIDTH, CLASSES) if side else None

    def forward(self, x: torch.Tensor, use_side: bool = False) -> torch.Tensor:
        out = self.body(x)
        return out + self.side(x) if use_side and self.side is not None else out


def build_model(side: bool = False) -> Net:
    torch.manual_seed(0)  # every replica starts alike (the Manager also syncs step 0 from a peer)
    return Net(side)


def batch(replica: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s batch of committed step `step` (a retried step sees the same one)."""
    g = torch.Generator().manual_seed(100_000 * micro + 1000 * step + replica)
    return torch.randn(16, WIDTH, generator=g), torch.randint(0, CLASSES, (16,), generator=g)


def uses_side(replica: int, step: int, micro: int) -> bool:
    return (replica + step + micro) % 3 == 0


class _Hold(torch.autograd.Function):
    """Identity whose backward runs `Fault.action`: after the later layers' buckets have been
    launched, before the first layer's gradients exist (mid-backward)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if Fault.action is not None:
            action, Fault.action = Fault.action, None
            action()
        return grad


class Fault(nn.Module):
    action = None  # set for one step by the fault flags

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Hold.apply(x) if Fault.action is not None else x


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510"))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a collective may take")
    p.add_argument("--bucket-cap-mb", type=float, default=0.02)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to watch it)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per step (all but the last under no_sync)")
    p.add_argument("--hook", choices=("none", "fp16", "bf16", "torch-fp16"), default="none",
                   help="gradsync.comm_hooks' compression, or torch's own fp16 hook")
    p.add_argument("--find-unused", action="store_true", help="a side branch some micro-steps leave out")
    p.add_argument("--stall-at", type=int, help="test: at this step, stall in backward (to be killed)")
    p.add_argument("--raise-at", type=int, help="test: at this step, raise in backward (once)")
    p.add_argument("--slow-at", type=int, help="test: at this step, be --slow-seconds late in backward")
    p.add_argument("--slow-seconds", type=float, default=2.0)
    p.add_argument("--marker", type=Path, help="test: file touched when the fault fires")
    p.add_argument("--go", type=Path, help="test: join once this file exists")
    p.add_argument("--log", type=Path, help="test: JSON lines, one per committed step")
    p.add_argument("--save", type=Path, help="test: final model and optimizer state")
    return p.parse_args()


def arm_fault(args: argparse.Namespace, step: int) -> None:
    def touch() -> None:
        if args.marker is not None:
            args.marker.write_text(str(time.time()))

    def stall() -> None:
        touch()
        time.sleep(600)  # killed here

    def fail() -> None:
        touch()
        raise RuntimeError(f"injected failure in backward at step {step}")

    def slow() -> None:
        touch()
        time.sleep(args.slow_seconds)

    faults = {args.stall_at: stall, args.raise_at: fail, args.slow_at: slow}
    if step in faults:
        Fault.action = faults.pop(step)
        args.stall_at = None if Fault.action is stall else args.stall_at
        args.raise_at = None if Fault.action is fail else args.raise_at
        args.slow_at = None if Fault.action is slow else args.slow_at


def main() -> None:
    args = parse()
    torch.set_num_threads(1)  # replicas share the machine's cores
    me = f"replica_{args.replica_id}"
    say = lambda text: print(f"[{me} {time.strftime('%H:%M:%S')}] {text}", flush=True)  # noqa: E731
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model, optim = build_model(side=args.find_unused), None

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optim.state_dict()}  # type: ignore[union-attr]

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])  # type: ignore[union-attr]

    say("ready to join")
    while args.go is not None and not args.go.exists():  # imports done, model built: quick to join
        time.sleep(0.02)
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=args.min_replicas, replica_id=me, store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1", timeout=timeout,
        quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=args.bucket_cap_mb,
                                  find_unused_parameters=args.find_unused)
    if args.hook == "torch-fp16":  # torch's hook calls dist.all_reduce(group=state): the replica group's
        ddp.register_comm_hook(ddp.replica_group, default_hooks.fp16_compress_hook)
    elif args.hook != "none":  # state None: the quorum's replicas (ddp.replica_group)
        ddp.register_comm_hook(None, getattr(comm_hooks, f"{args.hook}_compress_hook"))
    optim = Optimizer(manager, torch.optim.Adam(ddp.parameters(), lr=1e-3))
    started, seen, log = time.time(), None, args.log.open("a") if args.log else None
    say(f"started; {len(ddp.reducer.buckets)} buckets derived from the model")  # type: ignore[union-attr]
    while manager.current_step() < args.steps:
        step = manager.current_step()
        arm_fault(args, step)
        optim.zero_grad()  # starts this step's quorum (in the background)
        error = None
        try:
            for micro in range(args.accumulate):
                x, y = batch(args.replica_id, step, micro)
                side = args.find_unused and uses_side(args.replica_id, step, micro)
                with ddp.no_sync() if micro < args.accumulate - 1 else contextlib.nullcontext():
                    nn.functional.cross_entropy(ddp(x, side), y).backward()
        except Exception as e:  # this replica's step is lost; the others' are not
            error = e
            manager.report_error(e)
        quorum = (manager.num_participants(), manager.participating_rank())
        participating = manager.is_participating()
        if quorum != seen:
            say(f"step {step}: quorum of {quorum[0]} replicas, this one "
                + (f"is number {quorum[1]}" if participating else "is recovering"))
            seen = quorum
        optim.step()  # commits only if every collective of the step succeeded (should_commit)
        after = manager.current_step()
        if after == step:
            say(f"step {step}: not committed ({error or manager.errored() or 'too few replicas'}); retrying")
            continue
        if after > step + 1:
            say(f"recovered live from a peer: step {step} -> {after - 1}, {time.time() - started:.2f} s after start")
        if log is not None:
            log.write(json.dumps({"replica": args.replica_id, "step": after - 1, "participating": participating,
                                  "participants": quorum[0], "time": time.time()}) + "\n")
            log.flush()
        if args.step_seconds:
            time.sleep(args.step_seconds)
    say(f"done: {manager.current_step()} steps committed")
    if args.save is not None:
        torch.save(state_dict(), args.save)
    manager.shutdown(wait=False)
    sys.exit(0)


if __name__ == "__main__":
    main()
