"""Every Python block in the README and under docs/ runs as a test (Sybil), top to bottom per page,
in one namespace per page, as a reader would paste them.

Each page runs as rank 0 of a world of one: RANK, WORLD_SIZE and a free MASTER_PORT are set, so a
block that calls `torch.distributed.init_process_group("gloo")` as a torchrun script would gets a
real group; it is destroyed when the page ends. A block that cannot run alone (it needs several
ranks, a GPU, a framework's trainer or a network) says so just above it:

    <!-- skip: next "needs two ranks: examples/train.py runs it under torchrun" -->

and is reported as skipped with that reason (pytest's summary counts them). Multi-rank examples
live as files in examples/ and run under torchrun in tests/processes/test_multiprocess.py (train.py,
resume.py) and tests/processes/test_ft.py (ft_train.py).
"""

from __future__ import annotations

import os

import pytest
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser


def _setup(namespace: dict) -> None:
    from gradsync.testing import free_port

    namespace["_saved_env"] = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def _teardown(namespace: dict) -> None:
    import gc

    import torch.distributed as dist

    saved = namespace["_saved_env"]
    namespace.clear()  # wrappers hold the group: release them before it is destroyed
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md", "docs/**/*.md"],
    excludes=["docs/_build/**"],
    setup=_setup,
    teardown=_teardown,
).pytest()


_DOC_BLOCKS: dict[str, str] = {}  # node id of each Python block run -> its outcome


def pytest_collection_modifyitems(items):
    from sybil.evaluators.skip import Skipper

    for item in items:
        if item.path.suffix == ".md":
            item.add_marker(pytest.mark.docs)
            if not isinstance(item.example.region.evaluator, Skipper):  # a block, not a directive
                _DOC_BLOCKS[item.nodeid] = "not run"


def pytest_runtest_logreport(report):
    if report.nodeid in _DOC_BLOCKS and (report.when == "call" or report.skipped):
        _DOC_BLOCKS[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter):
    if _DOC_BLOCKS:
        outcomes = list(_DOC_BLOCKS.values())
        terminalreporter.write_line(
            f"doc blocks (README.md, docs/): {len(outcomes)} Python blocks, "
            f"{outcomes.count('passed')} run and passed, {outcomes.count('skipped')} skipped "
            f"(marked as unable to run alone), {outcomes.count('failed')} failed"
        )
