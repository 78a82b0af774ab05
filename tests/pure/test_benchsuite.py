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
    assert cluster_bench_args(["--rounds", "3"]) == [
        "--models",
        ",".join(CLUSTER_MODELS),
        "--rounds",
        "3",
    ]
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
    same = {
        "a": {"gradsync": 0.0, "no overlap": 0.0},
        "b": {"gradsync": math.nan},
        "c": {"gradsync": 2e-3},
    }
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
    data = {
        "result": result,
        "nbytes": 2**20,
        "cost": CostModel(1.0, 50.0 / 2**20),
        "comm_cpu": None,
    }
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
    assert (
        use["torch DDP"] == pytest.approx((160.0, 0.75))
        and use["gradsync planned"] == pytest.approx((200.0, 0.97))
    )
    line = _cpu_use_lines(data)[0]
    assert "torch DDP 160.0 ms (75%)" in line and "gradsync planned 200.0 ms (97%)" in line
    assert len(_cpu_use_lines(data)) == 1  # the machine's not measured: no line for it


def test_the_machine_cpu_per_step_counts_every_rank_and_the_kernel():
    from gradsync.tools.benchsuite import _cpu_use_lines, _machine_busy, machine_cpu

    assert _machine_busy() > 0  # /proc/stat, in seconds since boot
    data = {"cpu": {"torch DDP": [(0.150, 0.70, 0.300), (0.160, 0.75, 0.320)],
                    "gradsync overlap": [(0.170, 0.90, 0.310), (0.180, 0.95, 0.330)]}}
    assert machine_cpu(data) == pytest.approx({"torch DDP": 310.0, "gradsync overlap": 320.0})
    assert "torch DDP 310.0 ms, gradsync overlap 320.0 ms" in _cpu_use_lines(data)[1]


def test_the_device_bench_is_chosen_by_device_or_model_with_its_own_defaults():
    from gradsync.tools.devicebench import DEVICE_MODELS

    args = parse_args(["--device", "cuda"])
    assert args.device_models == list(DEVICE_MODELS) and (args.rounds, args.repeat) == (15, 5)
    assert args.out == "out/bench-cuda"
    quick = parse_args(["--device", "cuda", "--quick", "--models", "gpt2_small"])
    assert quick.device_models == ["gpt2_small"] and (quick.rounds, quick.repeat) == (3, 2)
    own = parse_args(["--model", "mymodels:build"])  # a user's model: on CPU unless --device says
    assert own.device == "cpu" and own.device_models == []
    assert parse_args([]).device is None and parse_args([]).rounds == 25  # the CPU bench, as before
    for bad in (
        ["--device", "cuda", "--models", "tiny_gpt"],
        ["--device", "cpu", "--variants", "gradsync,nope"],
        ["--model", "no_function_named"],
        ["--device", "cpu", "--rounds", "1"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_overlap_tails_add_a_variant_each_with_that_share_of_the_gradients_or_size_held():
    from gradsync.tools.benchsuite import _tail_mb

    args = parse_args(["--only", "gradsync overlap", "--overlap-tails", "50,75,4MiB"])
    assert args.cpu_variants[-3:] == ("gradsync overlap, tail 50%", "gradsync overlap, tail 75%",
                                      "gradsync overlap, tail 4MiB")
    assert "gradsync overlap" in args.cpu_variants and "gradsync" not in args.cpu_variants
    model = torch.nn.Linear(1024, 256, bias=False)  # 1 MiB of gradients
    assert _tail_mb("gradsync overlap, tail 75%", model) == pytest.approx(0.75)
    assert _tail_mb("gradsync overlap, tail 4MiB", model) == 4.0
    assert _tail_mb("gradsync overlap", model) is None  # the default tail
    for bad in ("x", "120", "-5", "-1MiB", "xMiB"):
        with pytest.raises(SystemExit):
            parse_args(["--overlap-tails", bad])


def test_the_cpu_bench_needs_two_ranks_the_device_bench_one():
    from gradsync.tools.cli import main

    with pytest.raises(SystemExit, match="--nproc must be at least 2"):
        main(["bench", "--nproc", "1"])
    with pytest.raises(SystemExit, match="--nproc must be at least 1"):
        main(["bench", "--nproc", "0", "--device", "cpu"])


def test_a_users_function_gives_the_model_a_batch_and_optionally_the_loss(tmp_path):
    from gradsync.tools.devicebench import default_loss, load_user_workload

    (tmp_path / "models_here.py").write_text(
        "import torch\nfrom torch import nn\ndef plain():\n    return nn.Linear(3, 2), "
        "torch.ones(4, 3)\ndef with_loss():\n    return nn.Linear(3, 2), {'input': torch.ones(4, "
        "3)}, lambda out, batch: out.sum()\ndef wrong():\n    return nn.Linear(3, 2)\n"
    )
    work = load_user_workload(f"{tmp_path / 'models_here.py'}:plain")
    assert (
        work.loss is default_loss
        and work.batches[0].shape == (4, 3)
        and work.compile_backend is None
    )
    work = load_user_workload(
        f"{tmp_path / 'models_here.py'}:with_loss", torch.bfloat16, "aot_eager"
    )
    assert work.loss(torch.ones(2), None).item() == 2.0 and work.autocast is torch.bfloat16
    # compiled: not the find_unused pair by default
    assert "gradsync find_unused" not in work.variants
    for spec in (f"{tmp_path / 'models_here.py'}:wrong", f"{tmp_path / 'models_here.py'}:absent"):
        with pytest.raises(ValueError):
            load_user_workload(spec)
    out = torch.tensor([1.0, 3.0])
    assert default_loss(out) == default_loss((out, "x")) == default_loss({"logits": out}) == 5.0


def test_a_variants_peak_is_its_own_state_plus_what_its_steps_add_over_the_turns_start():
    from gradsync.tools.devicebench import variant_peak

    # 100 held by the others and 30 its own when the turn began; its steps reached 180
    assert variant_peak(own=30, start=130, peak=180) == 80
    assert variant_peak(own=30, start=130, peak=120) == 30  # peak below the start: its own state
    assert variant_peak(None, None, None) is None  # not measured (CPU)


def test_the_device_report_has_a_row_per_model_and_extra_columns():
    from gradsync.tools.bench import Comparison, markdown_table
    from gradsync.tools.devicebench import report, summary_json, summary_table

    c = Comparison(["no DDP", "torch DDP", "torch DDP (again)", "gradsync"])
    for t in (0.010, 0.011, 0.012):
        for v, k in (
            ("no DDP", 0.9),
            ("torch DDP", 1.0),
            ("torch DDP (again)", 1.0),
            ("gradsync", 1.1),
        ):
            c.add(v, t * k)
    data = {
        "result": c,
        "tensors": 148,
        "parameters": 124e6,
        "nbytes": 2**29,
        "peak_bytes": {"gradsync": 3 * 2**30},
        "build_s": {"gradsync": 1.0},
        "same": {"gradsync": 0.0},
        "describe": "GPT-2-small shape",
        "rounds": 3,
        "repeat": 5,
    }
    table = summary_table({"gpt2_small": data})
    head, _, row = table.splitlines()
    assert "| torch's DDP / no DDP | gradsync / torch's DDP |" in head and "find_unused" not in head
    assert (
        row.startswith("| GPT-2-small shape | 148 | 1.111 (") and "| 1.100 (1.100–1.100) |" in row
    )
    text = report("gpt2_small", data, "world size 1")
    assert "| peak MiB |" in text and "| 3,072 |" in text and "gradsync 0.0e+00" in text
    assert summary_json(data)["pairs"]["gradsync / torch DDP"]["ratio"] == pytest.approx(1.1)
    # no extra columns unless asked
    assert "| x |" not in markdown_table(c, "torch DDP", None, "ms")


def test_each_overlap_variant_is_compared_with_plain_gradsync_in_the_same_round():
    from gradsync.tools.bench import Comparison
    from gradsync.tools.benchsuite import _against_plain_lines, against_plain

    result = Comparison(["torch DDP", "gradsync", "gradsync overlap", "gradsync overlap 75%"])
    for shared in (1.0, 2.0, 3.0):  # each round's noise scales every variant alike
        for v, step in zip(result.variants, (1.0, 1.0, 0.9, 1.1)):
            result.add(v, shared * step)
    ratios = against_plain(result)
    assert set(ratios) == {"gradsync overlap", "gradsync overlap 75%"}
    assert ratios["gradsync overlap"] == pytest.approx((0.9, 0.9, 0.9))
    assert "gradsync overlap 75% 1.100 (1.100–1.100)" in _against_plain_lines(result)[0]
    without = Comparison(["torch DDP", "gradsync overlap"])
    without.add("torch DDP", 1.0)
    without.add("gradsync overlap", 1.0)
    assert against_plain(without) == {} and _against_plain_lines(without) == []
