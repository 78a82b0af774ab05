"""The overlap of backward and communication as a picture (needs matplotlib: `pip install
gradsync[plot]`). One band per rank: ticks where gradients became ready, bars where buckets were
being reduced, and the stretch after the last gradient where communication was exposed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..engine.timeline import EventKind, IterationTimeline
from .stats import IterationStats

__all__ = ["figure", "render_overlap_png", "save_figure"]


def figure(width: float, height: float):
    """A new matplotlib figure and axes, drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write as PNG (creating the folder) and release `fig`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_overlap_png(timelines_by_rank: Sequence[IterationTimeline], path: str | Path) -> Path:
    """Draw one iteration per rank (`timelines_by_rank[r]` is rank r's) into a PNG file."""
    ranks = len(timelines_by_rank)
    fig, ax = figure(10, 1.2 + 1.1 * ranks)
    for rank, tl in enumerate(timelines_by_rank):
        _draw_rank(ax, rank, tl)
    ax.set_yticks([r * 3 + 1 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
    ax.set_xlabel("ms since the end of forward")
    ax.set_ylim(-0.5, ranks * 3 - 0.5)
    ax.invert_yaxis()
    first = IterationStats.from_timeline(timelines_by_rank[0])
    ax.set_title(
        f"iteration {first.iteration}: backward {first.backward_ms:.2f} ms, communication "
        f"{first.comm_ms:.2f} ms, exposed {first.exposed_comm_ms:.2f} ms "
        f"({first.overlap_ratio:.0%} hidden)"
    )
    ax.legend(loc="lower right", fontsize="small")
    return save_figure(fig, path)


def _draw_rank(ax, rank: int, tl: IterationTimeline) -> None:
    stats = IterationStats.from_timeline(tl)
    base = rank * 3
    ready = [(t - tl.start_ns) * 1e-6 for t, k, _ in tl.events if k == EventKind.READY]
    label = rank == 0
    ax.vlines(ready, base, base + 0.9, color="tab:blue", linewidth=0.8,
              label="gradient ready" if label else None)
    for b in stats.buckets:  # alternate heights so neighbouring buckets stay apart
        ax.broken_barh(
            [(b.launch_ms, max(b.comm_ms, 1e-3))],
            (base + 1.1 + 0.45 * (b.index % 2), 0.45),
            facecolors="tab:orange",
            edgecolors="black",
            linewidth=0.5,
            label="bucket all-reduce" if label and b.index == 0 else None,
        )
    if stats.exposed_comm_ms > 0:
        ax.broken_barh([(stats.backward_ms, stats.exposed_comm_ms)], (base + 2.05, 0.3),
                       facecolors="tab:red", label="exposed communication" if label else None)
