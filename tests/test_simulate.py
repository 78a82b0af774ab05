"""The simulator: network cost formulas, layouts compared, profiles from real runs, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from models import MODELS

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.cli import main as cli
from gradsync.simulate import Network, Profile, default_layout, simulate
from gradsync.testing import run_threaded, seeded

PROFILE = Profile(forward_ms=2.0, ready_ms=tuple(0.5 * i for i in range(1, 41)),
                  nbytes=tuple([256 * 1024] * 40))


def test_ring_and_tree_costs():
    net = Network(bandwidth_gbps=10.0, latency_us=5.0)
    ring = net.cost(4)
    assert ring.alpha_ms == pytest.approx(2 * 3 * 5e-3)
    assert ring.beta_ms_per_byte == pytest.approx(2 * 3 / 4 * 1e-7)
    tree = Network(10.0, 5.0, "tree").cost(1024)
    assert tree.alpha_ms == pytest.approx(2 * 10 * 5e-3)
    assert Network(10.0, 5.0).cost(1).time_ms(1e9) == 0.0
    with pytest.raises(ValueError, match="algorithm"):
        Network(1.0, 1.0, "mesh")


def test_default_layout_follows_torchs_limits():
    layout = default_layout([512 * 1024] * 3 + [10 * 2**20] * 4)
    assert layout[0] == [0, 1]  # 1 MiB first bucket
    assert layout[1] == [2, 3, 4, 5]  # then up to 25 MiB


def test_planned_is_never_worse_and_no_overlap_is_worst():
    for algorithm in ("ring", "tree"):
        for p in simulate(PROFILE, Network(5.0, 20.0, algorithm), [2, 8, 64, 1024]):
            assert p.planned_ms <= p.default_ms + 1e-9
            assert p.planned_ms <= p.no_overlap_ms + 1e-9
            assert p.planned_ms >= PROFILE.forward_ms + PROFILE.backward_ms
            assert 0 < p.efficiency(p.planned_ms) <= 1


def test_profile_round_trip_and_bad_file(tmp_path):
    path = PROFILE.save(tmp_path / "p.json")
    assert Profile.load(path) == PROFILE
    (tmp_path / "bad.json").write_text(json.dumps({"ready_ms": []}))
    with pytest.raises(ValueError, match="not a gradsync timing profile"):
        Profile.load(tmp_path / "bad.json")


def test_profile_from_a_real_run_feeds_the_cli(tmp_path, capsys):
    def body(rank, group):
        ddp = GradsyncDDP(seeded(MODELS["many_small"], 0), process_group=group)
        for _ in range(4):
            ddp(torch.ones(4, 8)).sum().backward()
        return ddp.save_timing_profile(str(tmp_path / f"profile{rank}.json"))

    path = run_threaded(body, 2)[0]
    profile = Profile.load(path)
    assert len(profile.nbytes) == 60 and list(profile.ready_ms) == sorted(profile.ready_ms)
    assert profile.forward_ms > 0
    assert cli(["simulate", "--profile", path, "--ranks", "2,4,1024", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 1024 |" in out and (tmp_path / "simulate.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_refuses_bad_values(tmp_path):
    with pytest.raises(SystemExit, match="--ranks must be positive"):
        cli(["simulate", "--profile", "x.json", "--ranks", "2,zero"])
    with pytest.raises(SystemExit, match="x.json"):
        cli(["simulate", "--profile", str(tmp_path / "x.json")])


def test_network_from_a_probed_cost_gives_that_cost_back():
    from gradsync.planner import CostModel

    measured = CostModel(0.2, 3e-7)
    for algorithm in ("ring", "tree"):
        back = Network.from_cost(measured, 4, algorithm).cost(4)
        assert back.alpha_ms == pytest.approx(measured.alpha_ms)
        assert back.beta_ms_per_byte == pytest.approx(measured.beta_ms_per_byte)


def test_a_shared_host_stretches_compute_relative_to_the_recorded_run():
    from dataclasses import replace

    from gradsync.simulate import Host

    host = Host(ranks=4, cores=2)
    assert [host.stretch(n) for n in (1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 2.0]
    recorded_at_2 = replace(PROFILE, world_size=2)
    net = Network(1000.0, 0.0)  # communication nearly free: the step is compute
    (two, four) = simulate(recorded_at_2, net, [2, 4], host)
    assert four.compute_ms == pytest.approx(2 * two.compute_ms)
    assert simulate(recorded_at_2, net, [4])[0].compute_ms == pytest.approx(two.compute_ms)  # no host
    with pytest.raises(ValueError, match="at least one rank and one core"):
        Host(ranks=2, cores=0)


def test_on_a_saturated_host_cpu_collectives_add_to_compute():
    from gradsync.simulate import Host

    net = Network(1.0, 50.0)
    overlapped = simulate(PROFILE, net, [4], Host(ranks=4, cores=8, cpu_collectives=True))[0]
    serial = simulate(PROFILE, net, [4], Host(ranks=4, cores=4, cpu_collectives=True))[0]
    compute = PROFILE.forward_ms + PROFILE.backward_ms
    comm = net.cost(4).time_ms(sum(PROFILE.nbytes))
    assert serial.no_overlap_ms == pytest.approx(compute + comm)
    # Without free cores nothing hides behind backward: every bucket's cost adds up.
    assert serial.default_ms >= compute + comm - 1e-9
    assert overlapped.default_ms < serial.default_ms
    assert not Host(ranks=4, cores=4).saturated(4)  # collectives off the CPU (NCCL): overlap
