"""The bench's model sets and its parity check, without a process group."""

from __future__ import annotations

import math

import pytest
import torch

from gradsync.tools.benchsuite import (
    CLUSTER_MODELS,
    LOOPBACK_MODELS,
    MODELS,
    mismatched,
    parse_args,
)
from gradsync.tools.cli import cluster_bench_args


def test_the_loopback_set_is_the_default_and_a_cluster_gets_the_models_sized_for_it():
    assert parse_args([]).models == ",".join(LOOPBACK_MODELS)
    assert cluster_bench_args(["--rounds", "3"]) == ["--models", ",".join(CLUSTER_MODELS), "--rounds", "3"]
    assert cluster_bench_args(["--models", "convnet"]) == ["--models", "convnet"]
    assert cluster_bench_args(["--models=convnet"]) == ["--models=convnet"]
    assert parse_args(cluster_bench_args([])).models.split(",") == list(CLUSTER_MODELS)


@pytest.mark.parametrize("name", CLUSTER_MODELS)
def test_the_cluster_models_have_the_gradients_they_are_named_for_and_stay_finite(name):
    torch.manual_seed(0)
    model, make_input = MODELS[name]()
    mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert 11 <= mib <= 65, (name, mib)  # of the order a 2 Gbit/s link moves in one step's compute
    x = make_input(torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):  # the bench trains them: a diverging model would compare as NaN
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_variant_that_diverged_is_a_mismatch_not_a_match():
    same = {"a": {"gradsync": 0.0, "no overlap": 0.0}, "b": {"gradsync": math.nan}, "c": {"gradsync": 2e-3}}
    assert sorted(mismatched(same)) == ["b", "c"]  # NaN compares false both ways: counted as bad


def test_a_paired_ratio_comes_with_a_bootstrap_interval_that_tells_noise_from_a_difference():
    from gradsync.tools.bench import Comparison, markdown_table

    rounds = [100.0 + 7.0 * math.sin(3.1 * r) for r in range(40)]  # the rounds' shared noise
    c = Comparison(["base", "again", "slower"])
    for r, t in enumerate(rounds):
        c.add("base", t)
        c.add("again", t * (1.0 + 0.01 * math.sin(1.7 * r)))  # +-1 %, no difference
        c.add("slower", t * (1.03 + 0.01 * math.sin(2.3 * r)))  # 3 % slower, +-1 %
    assert c.ratio_interval("base", "base") == (1.0, 1.0)
    lo, hi = c.ratio_interval("again", "base")
    assert lo < c.paired_ratio("again", "base") < hi and lo < 1.0 < hi
    lo, hi = c.ratio_interval("slower", "base")
    assert 1.0 < lo <= c.paired_ratio("slower", "base") <= hi < 1.05
    assert c.ratio_interval("slower", "base") == (lo, hi)  # deterministic
    table = markdown_table(c, "base", "again", "ms")
    assert "95 % interval" in table.splitlines()[0] and f"{lo:.3f}–{hi:.3f}" in table


def test_the_floor_with_the_links_cpu_adds_each_cores_share_of_an_all_reduces_cpu_to_compute():
    from gradsync.planning.planner import CommCpu, CostModel
    from gradsync.tools.bench import Comparison
    from gradsync.tools.benchsuite import VARIANTS, _cpu_floor_lines, _cpu_floor_ms

    result = Comparison(list(VARIANTS))
    for t in (0.200, 0.210, 0.190):
        for v in VARIANTS:
            result.add(v, t / 2 if v == "compute only" else t)
    data = {"result": result, "nbytes": 2**20, "cost": CostModel(1.0, 50.0 / 2**20), "comm_cpu": None}
    assert _cpu_floor_ms(data) is None and _cpu_floor_lines(data) == []  # not measured: no line
    data["comm_cpu"] = CommCpu(allreduce_ms=51.0, busy_ms=30.0, cores=2)
    assert _cpu_floor_ms(data) == pytest.approx(100.0 + 15.0)  # compute 100 ms + 15 ms per core
    data["comm_cpu"] = CommCpu(allreduce_ms=51.0, busy_ms=2.0, cores=2)
    assert _cpu_floor_ms(data) == pytest.approx(101.0)  # communication (1 + 50 ms) is the floor
    assert "max(compute + 1.0, communication) = 101.00 ms" in _cpu_floor_lines(data)[0]


def test_cpu_use_is_each_variants_median_cpu_per_step_and_its_share_of_the_step():
    from gradsync.tools.benchsuite import _cpu_use_lines, cpu_use

    assert cpu_use({}) == {} and _cpu_use_lines({}) == []  # not measured: no line
    data = {"cpu": {"torch DDP": [(0.150, 0.70), (0.160, 0.75), (0.170, 0.80)],
                    "gradsync planned": [(0.200, 0.97), (0.190, 0.95), (0.210, 0.99)]}}
    use = cpu_use(data)
    assert use["torch DDP"] == pytest.approx((160.0, 0.75)) and use["gradsync planned"] == pytest.approx((200.0, 0.97))
    line = _cpu_use_lines(data)[0]
    assert "torch DDP 160.0 ms (75%)" in line and "gradsync planned 200.0 ms (97%)" in line
