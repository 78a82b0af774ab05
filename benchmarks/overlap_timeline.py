"""One step of `overlap_optimizer` on the emulated cluster, drawn: the next forward running over
the communication tail.

Two hosts (network namespaces, links shaped with tc tbf), one rank each, gloo, AdamW, the
bench's gpt_16mib model. After warm-up, rank 0's timelines of two consecutive iterations are
drawn on one time axis: the forward and backward of iteration k, each bucket's all-reduce
(launch to completion), each bucket's write-back and optimizer step (at the end of backward,
or in the next forward where its parameters are first used), and the forward of iteration
k+1 starting before the last bucket of k has landed.

    python benchmarks/overlap_timeline.py   # writes out/overlap-timeline.png (--out to change)
    python benchmarks/overlap_timeline.py --model wide_mlp_64mib --tail-share 0.75

`--model` takes any of the bench's models, `--tail-share` holds that share of the gradients
as the tail (`tail_mb`; default: the default tail) and `--credit-mb` sets the credit. The
timelines drawn are written beside the picture as JSON (`.json`), the raw data of a page.

Needs root (the cluster) and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def child(out: str, steps: int, model_name: str, tail_share: float | None,
          credit_mb: float | None) -> None:
    """On each emulated host: train, then rank 0 writes its last timelines as JSON."""
    import torch
    import torch.distributed as dist

    import gradsync
    from gradsync.tools.benchsuite import MODELS

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, make_input = MODELS[model_name]()
    ddp = gradsync.DistributedDataParallel(model)
    total_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    opt = ddp.overlap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4),
                                tail_mb=None if tail_share is None else tail_share * total_mb,
                                credit_mb=credit_mb)
    batch = make_input(torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        ddp(batch).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.wait()
    if dist.get_rank() == 0:
        last = list(ddp.reducer.history)[-3:]
        Path(out).write_text(json.dumps([
            {"iteration": t.iteration, "start_ns": t.start_ns, "finish_ns": t.finish_ns,
             "backward_end_ns": t.backward_end_ns, "forward_start_ns": t.forward_start_ns,
             "events": t.events, "bytes": t.bucket_bytes}
            for t in last
        ]))
    dist.barrier()
    dist.destroy_process_group()


def draw(timelines: list[dict], path: Path, title: str) -> Path:
    from gradsync.engine.timeline import EventKind
    from gradsync.observability.plot import figure, save_figure

    this, following = timelines[-2], timelines[-1]
    zero = this["forward_start_ns"]

    def ms(t: int) -> float:
        return (t - zero) * 1e-6

    fig, ax = figure(11, 3.6)
    rows = {"forward": 0, "backward": 1, "all-reduce": 2, "write-back + step": 3}
    ax.broken_barh([(ms(this["forward_start_ns"]), ms(this["start_ns"]) - ms(zero))],
                   (rows["forward"] - 0.35, 0.7), facecolors="tab:green",
                   label=f"forward {this['iteration']}")
    ax.broken_barh([(ms(following["forward_start_ns"]),
                     ms(following["start_ns"]) - ms(following["forward_start_ns"]))],
                   (rows["forward"] - 0.35, 0.7), facecolors="tab:olive",
                   label=f"next forward ({following['iteration']})")
    ax.broken_barh([(ms(this["start_ns"]), ms(this["backward_end_ns"]) - ms(this["start_ns"]))],
                   (rows["backward"] - 0.35, 0.7), facecolors="tab:blue", label="backward")
    at = {kind: {i: t for t, k, i in this["events"] if k == kind}
          for kind in (EventKind.LAUNCH, EventKind.COMPLETE, EventKind.STEP, EventKind.STEPPED)}
    for i, start in at[EventKind.LAUNCH].items():
        end = at[EventKind.COMPLETE].get(i, this["finish_ns"])
        ax.broken_barh([(ms(start), max(ms(end) - ms(start), 0.2))],
                       (rows["all-reduce"] - 0.35 + 0.35 * (i % 2), 0.35),
                       facecolors="tab:orange", edgecolors="black", linewidth=0.4)
    for i, start in at[EventKind.STEP].items():
        end = at[EventKind.STEPPED].get(i, start)
        ax.broken_barh([(ms(start), max(ms(end) - ms(start), 0.2))],
                       (rows["write-back + step"] - 0.35, 0.7), facecolors="tab:purple",
                       edgecolors="black", linewidth=0.4)
    ax.axvline(ms(this["backward_end_ns"]), color="gray", linestyle=":", linewidth=1)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.invert_yaxis()
    ax.set_xlabel(f"ms since the forward of iteration {this['iteration']} began")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")
    return save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/overlap-timeline.png")
    p.add_argument("--link", default="2gbit")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--model", default="gpt_16mib", help="one of the bench's models")
    p.add_argument("--tail-share", type=float, default=None,
                   help="hold this share of the gradients as the tail (default: the default tail)")
    p.add_argument("--credit-mb", type=float, default=None, help="the tail's credit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.model, args.tail_share, args.credit_mb)
        return
    from gradsync.tools.cluster import EmulatedCluster

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "timelines.json")
        os.chmod(tmp, 0o777)
        with EmulatedCluster(hosts=2, link=args.link) as cluster:
            cluster.torchrun([__file__, "--child", data, "--steps", str(args.steps),
                              "--model", args.model]
                             + ([] if args.tail_share is None else ["--tail-share",
                                                                    str(args.tail_share)])
                             + ([] if args.credit_mb is None else ["--credit-mb",
                                                                   str(args.credit_mb)]))
        timelines = json.loads(Path(data).read_text())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(timelines))
    tail = "the default tail" if args.tail_share is None else f"{args.tail_share:g} held"
    print(draw(timelines, out, f"overlap_optimizer, 2 emulated hosts at {args.link}: "
                               f"{args.model}, AdamW, {tail}"))


if __name__ == "__main__":
    sys.exit(main())
