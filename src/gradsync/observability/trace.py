"""Timelines as a Chrome-trace / Perfetto JSON file, one process per rank, with tracks:

* "forward": a span per iteration, the forward it synchronised;
* "backward": an instant event per parameter when its gradient became ready, and a span per
  iteration from the end of forward until the gradients were written back;
* "communication": a complete event per bucket per iteration, from launch to completion;
* "write-back and step" (with `overlap_optimizer`): a span per bucket, its write-back and its
  optimizer step, at the end of backward or in the next forward, over the tail still landing.

Open the file in https://ui.perfetto.dev or chrome://tracing. Traces of several ranks can be
merged with `merge_traces` (their events are keyed by pid = rank).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..engine.timeline import EventKind, IterationTimeline
from .stats import IterationStats

__all__ = ["chrome_trace", "merge_traces", "write_chrome_trace"]

BACKWARD_TID, COMM_TID, STEP_TID, FORWARD_TID = 1, 2, 3, 4
_US = 1e-3  # trace timestamps are microseconds


def chrome_trace(
    timelines: Iterable[IterationTimeline], rank: int, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """The trace of one rank's timelines, as a JSON-ready dict (Trace Event Format)."""
    events: list[dict[str, Any]] = [
        _meta("process_name", rank, 0, {"name": f"rank {rank}"}),
        _meta("thread_name", rank, BACKWARD_TID, {"name": "backward"}),
        _meta("thread_name", rank, COMM_TID, {"name": "communication"}),
        _meta("thread_name", rank, STEP_TID, {"name": "write-back and step"}),
        _meta("thread_name", rank, FORWARD_TID, {"name": "forward"}),
    ]
    for tl in timelines:
        if tl.finish_ns:
            events.extend(_iteration_events(tl, rank, names))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _iteration_events(tl: IterationTimeline, rank: int, names: Sequence[str] | None) -> list[dict]:
    stats = IterationStats.from_timeline(tl)
    out: list[dict[str, Any]] = [
        {
            "name": f"iteration {tl.iteration}", "cat": "gradsync", "ph": "X", "pid": rank,
            "tid": BACKWARD_TID, "ts": tl.start_ns * _US, "dur": (tl.finish_ns - tl.start_ns) * _US,
            "args": {"exposed_comm_ms": stats.exposed_comm_ms, "overlap": stats.overlap_ratio},
        }
    ]
    if tl.forward_start_ns and tl.forward_start_ns < tl.start_ns:
        out.append({
            "name": f"forward {tl.iteration}", "cat": "forward", "ph": "X", "pid": rank,
            "tid": FORWARD_TID, "ts": tl.forward_start_ns * _US,
            "dur": (tl.start_ns - tl.forward_start_ns) * _US,
        })
    steps = tl.times(EventKind.STEP)
    for i, end in tl.times(EventKind.STEPPED).items():
        if i in steps:
            out.append({
                "name": f"step bucket {i}", "cat": "step", "ph": "X", "pid": rank,
                "tid": STEP_TID, "ts": (tl.start_ns + steps[i]) * _US,
                "dur": (end - steps[i]) * _US,
                "args": {"iteration": tl.iteration},
            })
    for t, kind, i in tl.events:
        if kind in (EventKind.READY, EventKind.UNUSED):
            label = names[i] if names else f"param {i}"
            out.append({
                "name": f"{'unused ' if kind == EventKind.UNUSED else ''}{label}", "cat": "ready",
                "ph": "i", "s": "t", "pid": rank, "tid": BACKWARD_TID, "ts": t * _US,
            })
    for b in stats.buckets:
        out.append({
            "name": f"bucket {b.index}", "cat": "allreduce", "ph": "X", "pid": rank,
            "tid": COMM_TID, "ts": (tl.start_ns * 1e-6 + b.launch_ms) * 1e3,
            "dur": max(b.comm_ms, 0.0) * 1e3,
            "args": {"iteration": tl.iteration, "bytes": b.nbytes, "params": b.num_params},
        })
    return out


def _meta(name: str, pid: int, tid: int, args: dict) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def write_chrome_trace(path: str | Path, trace: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return path


def merge_traces(traces: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One trace holding several ranks' events (each rank is its own process)."""
    return {"traceEvents": [e for t in traces for e in t["traceEvents"]], "displayTimeUnit": "ms"}
