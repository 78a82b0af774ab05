"""Run a training script with torch's DistributedDataParallel replaced by gradsync's.

    torchrun --nproc-per-node 2 -m gradsync.patch train.py --its --own --arguments

The script runs unchanged, as `__main__`, after `gradsync.patch_torch_ddp()`: whatever
framework it uses (HF Trainer, Accelerate, Lightning, Fabric) builds gradsync's wrapper.
"""

from __future__ import annotations

import runpy
import sys

from .wrapper.replace import patch_torch_ddp


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    patch_torch_ddp()
    sys.argv = argv  # the script sees its own name and arguments
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
