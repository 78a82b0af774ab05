"""The fast slice of the randomized parity run (`fuzz.py`): generated models and configurations,
gradsync's wrapper against torch's on the same gloo groups. A failure names the seed and the
command that reruns that one case; `benchmarks/random_parity.py` runs many more."""

from __future__ import annotations

import os

import pytest
from fuzz import Case, run_case

FIRST = int(os.environ.get("GRADSYNC_FUZZ_FIRST", "0"))
CASES = int(os.environ.get("GRADSYNC_FUZZ_CASES", "120"))


@pytest.mark.parametrize("seed", range(FIRST, FIRST + CASES))
def test_generated_case_matches_torch_ddp(seed):
    case = Case.from_seed(seed)
    problems = run_case(case)
    assert not problems, (
        f"seed {seed} differs from torch's DDP ({len(problems)} differences; rerun: "
        f"{case.rerun()}):\n{case}\n" + "\n".join(problems[:20])
    )


def test_the_generator_covers_what_it_promises():
    cases = [Case.from_seed(s) for s in range(FIRST, FIRST + CASES)]
    kinds = {b.kind for c in cases for b in c.blocks}
    assert kinds >= {"linear", "branch", "frozen", "tied", "double", "embed", "bn", "conv",
                     "complex"}
    assert any(c.zero and any(b.kind == "complex" for b in c.blocks) for c in cases)
    assert any(c.overlap and any(b.kind == "complex" for b in c.blocks) for c in cases)
    # layouts differ there
    assert any(c.as_view and any(b.kind == "conv" for b in c.blocks) for c in cases)
    assert any(c.zero and any(b.kind == "conv" for b in c.blocks) for c in cases)
    assert {b.use for c in cases for b in c.blocks} >= {"always", "rank", "iter", "rank_iter"}
    assert {b.aux for c in cases for b in c.blocks} >= {"never", "rank", "iter", "always"}
    assert any(b.sparse for c in cases for b in c.blocks)
    assert {c.world_size for c in cases} == {2, 3}
    assert {c.hook for c in cases} >= {
        "none",
        "torch_allreduce",
        "torch_fp16",
        "gradsync_fp16",
        "gradsync_bf16",
    }
    assert {c.optimizer for c in cases} == {"sgd", "adam"}
    assert {c.micro_steps for c in cases} >= {1, 2, 3}
    assert any(c.zero and c.world_size == 3 for c in cases) and any(
        c.zero and c.find_unused for c in cases
    )
    assert {c.bucket_cap_mb for c in cases} >= {None, 1e-7}
    for flag in ("find_unused", "static_graph", "as_view", "set_to_none", "broadcast_buffers"):
        assert {getattr(c, flag) for c in cases} == {False, True}, flag
    assert any(c.static_graph and c.micro_steps > 1 for c in cases)
    assert any(c.static_graph and any(b.use == "rank" for b in c.blocks) for c in cases)
    assert any(c.static_graph and any(b.aux == "never" for b in c.blocks) for c in cases)
    assert any(c.find_unused and any(b.aux == "never" for b in c.blocks) for c in cases)
    assert {c.refreeze for c in cases} == {"none", "off", "off_on", "off_first"}
    assert any(c.refreeze == "off_first" and c.static_graph for c in cases)
    assert any(c.refreeze != "none" and c.zero for c in cases)
    assert any(c.refreeze != "none" and c.freeze.startswith("heads") for c in cases)
    overlapped = [c for c in cases if c.overlap]
    assert {c.optimizer for c in overlapped} == {"sgd", "adam"}
    assert not any(c.zero for c in overlapped)
    for flag in ("find_unused", "static_graph", "as_view"):
        assert any(getattr(c, flag) for c in overlapped), flag
    assert {c.micro_steps for c in overlapped} >= {1, 2} and {c.hook for c in overlapped} > {"none"}
    clipped = [c for c in overlapped if c.clip]
    assert any(c.tail is not None and c.tail[2] > 0 for c in clipped)  # chunks held by a credit
    assert any(c.micro_steps > 1 for c in clipped) and any(c.as_view for c in clipped)
    measured = [c for c in overlapped if c.measure_at]  # where buckets land lazily: rare
    assert measured and all(c.tail is None and c.hook == "none" and not c.find_unused
                            and not c.static_graph for c in measured)
