"""The `gradsync` command line: `gradsync demo` runs the demo job on local ranks.

Ranks are started by torch's own launcher (`torch.distributed.run`), exactly as users start
their training: nothing here manages processes.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    from torch.distributed import run as torchrun

    if args.nproc < 1:
        raise SystemExit(f"gradsync demo: --nproc must be at least 1, got {args.nproc}")
    launcher = ["--standalone", f"--nproc-per-node={args.nproc}", "-m", "gradsync.demo", *rest]
    torchrun.main(launcher)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync", description="gradsync command line")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a classifier on local ranks and prove it matches torch's DDP",
        description="Launch the demo job with torch.distributed.run. Extra options "
        "(--epochs, --samples, --batch-size, --lr, --seed, --bucket-cap-mb) go to the job.",
    )
    demo.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        return _demo(args, rest)
    return 1


if __name__ == "__main__":
    sys.exit(main())
