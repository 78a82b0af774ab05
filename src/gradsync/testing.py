"""Run code on several ranks at once, for tests and benchmarks, and never hang doing it.

Two tiers:

* `run_threaded(fn, world_size)`: one real gloo process group per rank, each in a thread of this
  process, over a shared `HashStore`. Collectives are truly asynchronous; a run takes a fraction of
  a second. The group is a `dist.ProcessGroup` with gloo registered as its CPU backend (and its
  CUDA one where a GPU is visible), the form torch's own DistributedDataParallel accepts, so both
  can run side by side. (gloo on CUDA tensors can deadlock between rank threads of one process,
  torch's DDP too: on a GPU, run ranks as processes.)
* `run_processes(fn, world_size)`: real processes (spawn), gloo over a `FileStore`, for what only
  processes show (signals, killed ranks, process-global state). `run_torchrun(script, ...)` runs a
  script under torch's launcher on 127.0.0.1.

Each waits with a deadline: a deadlock fails with `RankTimeoutError` instead of hanging, and the
first rank to raise is re-raised as `RankError` naming its rank.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import functools
import gc
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "LateLandingGroup",
    "RankError",
    "RankTimeoutError",
    "free_port",
    "gloo_device_types",
    "kill_process_tree",
    "make_gloo_group",
    "run_processes",
    "run_threaded",
    "run_torchrun",
    "seeded",
]


_RNG_LOCK = threading.Lock()


def seeded(factory: Callable[[], Any], seed: int) -> Any:
    """`factory()` under `torch.manual_seed(seed)`, safe to call from several rank threads.

    Threads share torch's global generator; without the lock two ranks building "the same" model
    would interleave their draws and get different weights.
    """
    with _RNG_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


class RankError(RuntimeError):
    """A rank raised; `rank` says which, the message carries its traceback."""

    def __init__(self, rank: int, error: str, trace: str = "") -> None:
        super().__init__(f"rank {rank} raised {error}" + (f"\n\n{trace}" if trace else ""))
        self.rank = rank
        self.error = error


def _describe_failure(error: BaseException) -> tuple[str, str]:
    return f"{type(error).__name__}: {error}", traceback.format_exc()


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish in time: a deadlock or a stall."""


def gloo_device_types() -> tuple[str, ...]:
    """The device types a gloo group made here carries: the CPU, and CUDA where torch sees a GPU
    (gloo reduces CUDA tensors too, staging them through host memory)."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def make_gloo_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: float = 30.0,
    devices: Sequence[str] | None = None,
) -> dist.ProcessGroup:
    """A gloo process group over `store` on 127.0.0.1, in the wrapper form torch DDP accepts.

    gloo is registered as the group's backend for each device type in `devices` (default
    `gloo_device_types()`: the CPU, and CUDA when available), so collectives on CUDA tensors
    find a backend too; a device type gloo cannot carry is refused with `ValueError`.
    """
    from torch.distributed import ProcessGroupGloo  # type: ignore[attr-defined]

    types = tuple(gloo_device_types() if devices is None else devices)
    unsupported = sorted(set(types) - {"cpu", "cuda"})
    if unsupported or not types:
        raise ValueError(f"gloo carries 'cpu' and 'cuda' tensors, not {unsupported or 'no device'}")
    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = datetime.timedelta(seconds=timeout)
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    gloo = ProcessGroupGloo(store, rank, world_size, opts)
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    for device_type in dict.fromkeys(types):
        group._register_backend(torch.device(device_type), dist.ProcessGroup.BackendType.GLOO, gloo)
    return group


def _first_linear_here() -> None:
    """Run the process's first float32 matrix product here, before any rank thread starts.

    The first one (oneDNN's set-up; it also asks the kernel for AMX tile state, which
    `arch_prctl(ARCH_GET_XCOMP_PERM)` shows appear) made by one rank thread while another
    computes could leave that other thread's `torch.tanh` off by up to 1e-4 in every element,
    on this project's machine (a nested virtual machine): the first training of a fresh process
    then differed from all later ones, in about one process in six for seed 1200 of
    `tests/fuzz.py` with gradsync's bf16 hook (3 of 17) and never once the first product had
    run in the main thread (0 of 40, same code). Below both reducers: the gradients agree bit
    for bit in every later training of the same process.
    """
    # no random init: the global generator is the user's
    weight = torch.ones(4, 8, requires_grad=True)
    torch.nn.functional.linear(torch.ones(2, 8), weight).sum().backward()


def run_threaded(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 30.0,
    with_store: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, group, *args, **kwargs)` on `world_size` threads; return results by rank.

    Collectives in the groups time out after `timeout` seconds too, so a rank blocked in one is
    released rather than left waiting forever. With `with_store`, `fn` gets the group's store
    as a third argument: `fn(rank, group, store, *args, **kwargs)`.
    """
    if not 1 <= world_size <= 64:
        raise ValueError(f"world_size={world_size}: expected 1..64")
    _first_linear_here()
    _collect_cycles_before_exit()
    store = dist.HashStore()
    prefix = f"run_threaded/{time.monotonic_ns()}"
    outcomes: queue.Queue[tuple[int, bool, Any]] = queue.Queue()

    groups: list[dist.ProcessGroup] = []

    def body(rank: int) -> None:
        try:
            group_store = dist.PrefixStore(prefix, store)
            group = make_gloo_group(group_store, rank, world_size, timeout)
            groups.append(group)
            extra = (group_store,) if with_store else ()
            outcomes.put((rank, True, fn(rank, group, *extra, *args, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - everything goes back to the caller
            outcomes.put((rank, False, _describe_failure(error)))

    try:
        return _run_rank_threads(body, outcomes, world_size, timeout)
    finally:
        _LINGERING_GROUPS.extend(groups)


# The last runs' groups, kept a while and then dropped here, on the main thread. A hook's `then`
# callback runs on gloo's own thread and may hold a group (its closure) after the rank thread
# is gone; freed there, the group would be destroyed on its own thread, which cannot join itself
# ("Resource deadlock avoided": the process aborts; 1 to 3 runs in 12 of
# tests/threaded/test_late_landing.py before this). By the time a group leaves this queue its
# callbacks have long run.
_LINGERING_GROUPS: collections.deque[dist.ProcessGroup] = collections.deque(maxlen=16)


def _run_rank_threads(
    body: Callable[[int], None],
    outcomes: queue.Queue[tuple[int, bool, Any]],
    world_size: int,
    timeout: float,
) -> list[Any]:
    """Run `body(rank)` on a daemon thread per rank and collect what each put on `outcomes`."""
    threads = [
        threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    results = _collect(outcomes, world_size, timeout, "thread")
    for t in threads:  # each has reported: let it drop its frame (and its group) before we return
        t.join(timeout)
    return results


@functools.cache
def _collect_cycles_before_exit() -> None:
    """Once per process: run the cycle collector at interpreter exit, before finalization.

    The rank threads' models and wrappers (torch's DDP as much as gradsync's) sit in reference
    cycles that hold the threads' gloo groups until the collector runs. Left to interpreter
    finalization, freeing them there aborted a script ("terminate called without an active
    exception"; 3 runs of 3 with torch's DDP alone). This collection alone left 2 aborts in 20:
    a rank thread that had reported but not yet returned still held its group, hence also the
    join in `run_threaded` (0 aborts in 50 with both). The lingering groups go then too."""
    atexit.register(_free_at_exit)


def _free_at_exit() -> None:
    gc.collect()
    _LINGERING_GROUPS.clear()


def _collect(outcomes: Any, world_size: int, timeout: float, what: str) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        left = deadline - time.monotonic()
        try:
            rank, ok, value = outcomes.get(timeout=max(left, 0.0))
        except queue.Empty:
            missing = sorted(set(range(world_size)) - set(results))
            raise RankTimeoutError(
                f"ranks {missing} of {world_size} ({what}s) did not finish within {timeout:.1f}s: "
                "a deadlock or a stalled collective"
            ) from None
        if not ok:
            raise RankError(rank, *value)
        results[rank] = value
    return [results[r] for r in range(world_size)]


# ------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _process_main(
    rank: int,
    world_size: int,
    store_path: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    outcomes: Any,
    default_group: bool,
) -> None:
    try:
        store = dist.FileStore(store_path, world_size)
        if default_group:
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            group = dist.group.WORLD
        else:
            group = make_gloo_group(store, rank, world_size, timeout)
        # Plain pickle bytes: torch's queue would pass tensors as shared-memory handles, which
        # die with this process before the parent reads them.
        outcomes.put((rank, True, pickle.dumps(fn(rank, group, *args))))
    except BaseException as error:  # noqa: BLE001
        outcomes.put((rank, False, _describe_failure(error)))


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    default_group: bool = False,
) -> list[Any]:
    """Call `fn(rank, group, *args)` in `world_size` spawned processes; return results by rank.

    With `default_group`, the group is torch's default one (`init_process_group`), for code
    that calls `torch.distributed` functions directly. `fn` and its results must be picklable. On an
    error or the deadline every process is killed and reaped before this returns, so nothing is left
    behind.
    """
    ctx = mp.get_context("spawn")
    outcomes = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradsync-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_process_main,
                args=(r, world_size, store_path, timeout, fn, args, outcomes, default_group),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return [pickle.loads(r) for r in _collect(outcomes, world_size, timeout, "process")]
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (the launcher may start workers in new sessions)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_process_tree(pid: int) -> None:
    """SIGKILL `pid` and everything it started."""
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_torchrun(
    script: str,
    nproc: int,
    script_args: Sequence[str] = (),
    *,
    module: bool = False,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    launcher_args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run `script` (a path, or a module name with `module=True`) under torch's launcher on
    this host and return its combined output.

    The launcher runs in its own session; past `timeout` the whole session is killed, so no
    worker survives, and `RankTimeoutError` carries what it printed. Interrupted any other
    way (a test's own timeout, ^C), it is killed too before the exception goes on.
    """
    cmd = _torchrun_command(script, nproc, script_args, module, launcher_args)
    return _run_launcher(cmd, script, timeout, env)


def _torchrun_command(
    script: str, nproc: int, script_args: Sequence[str], module: bool, launcher_args: Sequence[str]
) -> list[str]:
    """The launcher's command line, run by this interpreter."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        # --standalone binds its rendezvous to a free port itself: no window in which another
        # process can take a port we picked (unless launcher_args set up a rendezvous).
        *(launcher_args or ["--standalone"]),
        *(["-m"] if module else []),
        script,
        *script_args,
    ]


def _run_launcher(
    cmd: list[str], script: str, timeout: float, env: dict[str, str] | None
) -> subprocess.CompletedProcess[str]:
    """Start the launcher in a session of its own and wait for it; on any way out but its own
    exit, kill that whole session first."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        out, _ = proc.communicate(timeout=30)
        raise RankTimeoutError(
            f"torchrun {script} did not finish within {timeout}s:\n{out}"
        ) from None
    except BaseException:  # the test's own timeout (pytest-timeout) or ^C: no worker outlives it
        kill_process_tree(proc.pid)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


class LateLandingGroup:
    """A host process group with NCCL's contract: a collective's Work and Future complete
    before its data has landed, and the data lands only at `wait()` (or in a `then` callback).

    On a GPU, NCCL's Future is complete once the collective is enqueued; its `value()` returns
    the tensors without waiting, so a read that did not go through `wait()` sees whatever was
    there before (stale gradients, not an error). Here each collective runs on a staged copy
    of its outputs, copied into them at the first `wait()`, `result()` or `then` callback:
    code that reads any other way reads the pre-collective values, on CPU, every time. Every
    other attribute is the wrapped group's.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    def allreduce(self, tensors: list[torch.Tensor], *args: Any) -> _LateWork:
        staged = [t.clone() for t in tensors]
        return _LateWork(self._group.allreduce(staged, *args), tensors, staged, tensors)

    def broadcast(self, tensors: list[torch.Tensor], *args: Any) -> _LateWork:
        staged = [t.clone() for t in tensors]
        return _LateWork(self._group.broadcast(staged, *args), tensors, staged, tensors)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], *args: Any
    ) -> _LateWork:
        staged = [[t.clone() for t in row] for row in outputs]
        work = self._group.allgather(staged, inputs, *args)
        return _LateWork(
            work, [t for row in outputs for t in row], [t for row in staged for t in row], outputs
        )

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, *args: Any) -> _LateWork:
        staged = output.clone()
        return _LateWork(
            self._group._allgather_base(staged, input, *args), [output], [staged], [output]
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, *args: Any
    ) -> _LateWork:
        staged = output.clone()
        return _LateWork(
            self._group._reduce_scatter_base(staged, input, *args), [output], [staged], [output]
        )


class _LateWork:
    def __init__(
        self, work: dist.Work, targets: list[torch.Tensor], staged: list[torch.Tensor], value: Any
    ) -> None:
        self._work, self._targets, self._staged, self._value = work, targets, staged, value
        self._landed = False

    def _land(self) -> None:
        if not self._landed:
            self._work.wait()
            for target, staged in zip(self._targets, self._staged):
                target.copy_(staged)
            self._landed = True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        done = self._work.wait(timeout) if timeout is not None else self._work.wait()
        self._land()
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        self._land()
        return self._value

    def get_future(self) -> torch.futures.Future:
        future = _LateFuture(self._land)
        future.set_result(self._value)  # complete at once, as NCCL's at enqueue
        return future


class _LateFuture(torch.futures.Future):
    """Complete from the start; its value's data lands at `wait()` or before a callback."""

    def __init__(self, land: Callable[[], None]) -> None:
        super().__init__()
        self._land = land

    def wait(self) -> Any:
        self._land()
        return super().wait()

    def then(self, callback: Callable[[Any], Any]) -> torch.futures.Future:
        land = self._land

        def landed_first(future: Any) -> Any:
            land()
            return callback(future)

        return super().then(landed_first)
