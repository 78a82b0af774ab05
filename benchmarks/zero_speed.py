"""Step time with sharded optimizers, side by side: torch's DDP + AdamW (and its A/A copy),
torch's ZeroRedundancyOptimizer over torch's DDP, and gradsync's ZeroRedundancyOptimizer over
gradsync's wrapper as ZeRO-1, as ZeRO-2 (gradients reduce-scattered) and as ZeRO-2 with the
parameter all-gathers overlapped with the next forward.

    python benchmarks/zero_speed.py                          # loopback, 2 ranks, ~4 minutes
    python benchmarks/zero_speed.py --hosts 2 --link 2gbit   # the emulated cluster (root)
    python benchmarks/zero_speed.py --out docs/benchmarks/data/DATE-zero-speed-loopback

(a run kept goes to docs/benchmarks/data/DATE-NAME, with its page docs/benchmarks/DATE-NAME.md)

Variants interleaved round by round (`gradsync.tools.bench`), paired ratios to torch's DDP, and
every variant's parameters compared with torch DDP + AdamW's at the end (same seed, same data).
Denormals are flushed to zero (`torch.set_flush_denormal`) in every variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

VARIANTS = ("torch DDP + AdamW", "torch DDP + AdamW (again)", "torch ZeroRedundancyOptimizer",
            "gradsync ZeRO-1", "gradsync ZeRO-2", "gradsync ZeRO-2 overlapped")
# On request (--variants): the step inside backward (overlap_with_ddp), and smaller buckets,
# which let a slow link's gathers pipeline with the next forward ("N MiB buckets" in a name).
EXTRA = ("gradsync ZeRO-2 inside backward", "gradsync ZeRO-2 overlapped (4 MiB buckets)",
         "torch DDP + AdamW (4 MiB buckets)")
LOOPBACK_MODELS, CLUSTER_MODELS = ("tiny_gpt", "wide_mlp"), ("gpt_16mib",)


def _variant(name: str, model_name: str, rank: int, repeat: int, models: dict):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from gradsync import DistributedDataParallel, ZeroRedundancyOptimizer
    from gradsync.tools.bench import timed
    from gradsync.tools.benchsuite import MODELS

    torch.manual_seed(0)
    model, make_input = MODELS[model_name]()
    kwargs = {"lr": 1e-3, "weight_decay": 0.01}
    cap = re.search(r"(\d+) MiB buckets", name)
    wrap = {"bucket_cap_mb": int(cap.group(1))} if cap else {}
    if name.startswith("gradsync"):
        wrapped = DistributedDataParallel(model, **wrap)
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            shard_gradients="ZeRO-2" in name,
            overlap_param_gather="overlapped" in name,
            overlap_with_ddp="inside backward" in name,
            **kwargs,
        )
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model, **wrap)
        opt = (TorchZero(model.parameters(), torch.optim.AdamW, **kwargs) if "Zero" in name
               else torch.optim.AdamW(model.parameters(), **kwargs))
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [make_input(g) for _ in range(4)]
    counter = [0]

    def step() -> None:
        opt.zero_grad()
        wrapped(batches[counter[0] % len(batches)]).float().pow(2).mean().backward()
        opt.step()
        counter[0] += 1

    models[name] = (model, opt)
    return lambda: timed(step, repeat)


def worker(
    model_names: list[str], rounds: int, repeat: int, out: str | None, names: tuple[str, ...]
) -> None:
    from gradsync.tools.bench import interleave, markdown_table

    dist.init_process_group("gloo")
    # AdamW's second moments of these tiny gradients go denormal, and denormal arithmetic on a
    # CPU is slow enough to swamp everything else (GPT steps of 0.7-1.4 s, an A/A of 1.5 on the
    # cluster): flushed to zero, for every variant alike.
    torch.set_flush_denormal(True)
    # as `gradsync bench`: one core per rank (torchrun sets it only for several per host)
    torch.set_num_threads(1)
    rank, sections, data = dist.get_rank(), [], {}
    for model_name in model_names:
        models: dict = {}
        variants = {v: _variant(v, model_name, rank, repeat, models) for v in names}
        result = interleave(variants, rounds=rounds, warmup=max(1, math.ceil(6 / repeat)))
        for _, opt in models.values():
            if hasattr(opt, "wait_parameters"):
                opt.wait_parameters()
        ref = [p.detach() for p in models["torch DDP + AdamW"][0].parameters()]
        same = {v: max((a.detach() - b).abs().max().item() for a, b in zip(m.parameters(), ref))
                for v, (m, _) in models.items() if v != "torch DDP + AdamW"}
        nbytes = sum(p.numel() * p.element_size() for p in ref)
        sections.append(
            "\n".join(
                [
                    f"### {model_name}: {nbytes / 2**20:.2f} MiB of parameters, AdamW, "
                    f"world size {dist.get_world_size()}, {rounds} rounds x {repeat} steps",
                    "",
                    markdown_table(
                        result, "torch DDP + AdamW", "torch DDP + AdamW (again)", "ms", 1e3
                    ),
                    "",
                    "same parameters as torch DDP + AdamW (max |diff|): "
                    + ", ".join(f"{k} {v:.1e}" for k, v in same.items()),
                ]
            )
        )
        data[model_name] = {"samples": result.samples, "same": same}
    if rank == 0:
        text = "\n\n".join(sections) + "\n"
        print(text, flush=True)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            (Path(out) / "speed.md").write_text(text)
            (Path(out) / "speed.json").write_text(json.dumps(data, indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--models", default=None, help="comma-separated names from gradsync bench's models"
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--hosts", type=int, default=0, help="run on an emulated cluster of N hosts (root)"
    )
    parser.add_argument("--link", default="2gbit")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--variants", default="", help=f"comma-separated names to add: {', '.join(EXTRA)}"
    )
    args = parser.parse_args()
    extra = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in extra if v not in EXTRA]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(EXTRA)}")
    models = args.models or ",".join(CLUSTER_MODELS if args.hosts else LOOPBACK_MODELS)
    if args.worker:
        worker(models.split(","), args.rounds, args.repeat, args.out, VARIANTS + extra)
        return
    target = [
        os.path.abspath(__file__),
        "--worker",
        "--models",
        models,
        "--rounds",
        str(args.rounds),
        "--repeat",
        str(args.repeat),
        *(["--out", os.path.abspath(args.out)] if args.out else []),
        *(["--variants", ",".join(extra)] if extra else []),
    ]
    if not args.hosts:
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node=2", *target]))
    from gradsync.tools.cluster import EmulatedCluster

    with EmulatedCluster(args.hosts, args.link) as cluster:
        print(f"zero_speed: on {cluster}", flush=True)
        for i, done in enumerate(cluster.torchrun(target, timeout=3600)):
            print(done.stdout if i == 0 else "", end="")
            if done.returncode != 0:
                print(f"host {i} failed:\n{done.stdout[-3000:]}")
                sys.exit(1)


if __name__ == "__main__":
    main()
