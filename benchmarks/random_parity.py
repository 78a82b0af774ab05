"""The long randomized parity run: many generated models and configurations (tests/fuzz.py),
each trained under gradsync's DistributedDataParallel and torch's, side by side on the same gloo
groups (threads of this process), compared gradient by gradient and parameter by parameter.

    python benchmarks/random_parity.py --cases 2000          # seeds 0..1999
    python benchmarks/random_parity.py --seed 1234           # rerun one case, printing it

Writes out/random_parity.json (cases, mismatches, failing seeds, what the cases covered).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # as tests/conftest.py: no AMX

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from fuzz import Case, run_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=1000, help="how many seeds to run")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, default=None, help="run this one case and print it")
    parser.add_argument("--out", default="out/random_parity.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = (
        [args.seed] if args.seed is not None else list(range(args.first, args.first + args.cases))
    )
    failing: dict[int, list[str]] = {}
    covered: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for n, seed in enumerate(seeds, 1):
        case = Case.from_seed(seed)
        covered.update(_features(case))
        problems = run_case(case)
        gc.collect()  # free each case's wrappers while their groups are whole
        if args.seed is not None:
            print(case)
        if problems:
            failing[seed] = problems
            print(f"seed {seed}: {len(problems)} differences (rerun: {case.rerun()})\n  "
                  + "\n  ".join(problems[:5]), flush=True)
        if n % 100 == 0:
            print(
                f"  {n} cases, {len(failing)} mismatches, {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    summary = {
        "cases": len(seeds),
        "mismatches": len(failing),
        "failing_seeds": sorted(failing),
        "seconds": round(elapsed, 1),
        "covered": dict(sorted(covered.items())),
        "torch": torch.__version__,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{len(seeds)} cases, {len(failing)} mismatches ({elapsed:.0f} s); {args.out}")
    return 1 if failing else 0


def _features(case: Case) -> list[str]:
    out = [f"world_size={case.world_size}", f"hook={case.hook}", f"optimizer={case.optimizer}",
           f"micro_steps={case.micro_steps}", f"bucket_cap_mb={case.bucket_cap_mb}"]
    out += [flag for flag in ("find_unused", "static_graph", "as_view") if getattr(case, flag)]
    out += sorted({f"block={b.kind}" for b in case.blocks})
    out += sorted({"sparse embedding" for b in case.blocks if b.sparse})
    out += sorted({f"branch used {b.use}" for b in case.blocks if b.kind == "branch"})
    out += sorted({f"output in loss {b.aux}" for b in case.blocks if b.aux != "none"})
    out += [f"requires_grad changed: {case.refreeze}"] if case.refreeze != "none" else []
    tail = "" if case.tail is None else " (tail, chunk, credit MiB: {:g}, {:g}, {:g})".format(
        *case.tail)
    out += ["overlap_optimizer" + tail] if case.overlap else []
    out += ["every micro-step synchronised"] if case.sync_every else []
    out += ["clipped by the global norm"] if case.clip else []
    out += ["tail measured mid-run"] if case.measure_at else []
    return out


if __name__ == "__main__":
    sys.exit(main())
