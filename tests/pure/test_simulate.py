"""The simulator: network cost formulas, layouts compared, profiles from real runs, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from models import MODELS

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.planning.simulate import Network, Profile, default_layout, simulate
from gradsync.testing import run_threaded, seeded
from gradsync.tools.cli import main as cli

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
    from gradsync.planning.planner import CostModel

    measured = CostModel(0.2, 3e-7)
    for algorithm in ("ring", "tree"):
        back = Network.from_cost(measured, 4, algorithm).cost(4)
        assert back.alpha_ms == pytest.approx(measured.alpha_ms)
        assert back.beta_ms_per_byte == pytest.approx(measured.beta_ms_per_byte)


def test_a_shared_host_stretches_compute_relative_to_the_recorded_run():
    from dataclasses import replace

    from gradsync.planning.simulate import Host

    host = Host(ranks=4, cores=2)
    assert [host.stretch(n) for n in (1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 2.0]
    recorded_at_2 = replace(PROFILE, world_size=2)
    net = Network(1000.0, 0.0)  # communication nearly free: the step is compute
    (two, four) = simulate(recorded_at_2, net, [2, 4], host)
    assert four.compute_ms == pytest.approx(2 * two.compute_ms)
    # no host
    assert simulate(recorded_at_2, net, [4])[0].compute_ms == pytest.approx(two.compute_ms)
    with pytest.raises(ValueError, match="at least one rank and one core"):
        Host(ranks=2, cores=0)


def test_on_a_saturated_host_cpu_collectives_add_to_compute():
    from gradsync.planning.simulate import Host

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


def test_the_slowest_ranks_profile_takes_each_gradients_latest_time():
    a = Profile(2.0, (1.0, 2.0, 3.0), (4, 8, 16), ("w", "b", "c"), 2)
    b = Profile(2.5, (1.5, 1.6, 4.0), (8, 4, 16), ("b", "w", "c"), 2)  # another rank's order
    slowest = Profile.slowest([a, b])
    assert slowest.forward_ms == 2.5
    assert slowest.names == ("w", "b", "c") and slowest.ready_ms == (1.6, 2.0, 4.0)
    assert slowest.nbytes == (4, 8, 16) and slowest.world_size == 2
    with pytest.raises(ValueError, match="different parameters"):
        Profile.slowest([a, Profile(2.0, (1.0,), (4,), ("w",), 2)])
    with pytest.raises(ValueError, match="names"):
        Profile.slowest([Profile(1.0, (1.0,), (4,))])


def _probe(ranks, alpha, beta, compute, step):
    from gradsync.planning.planner import CostModel, LoadProbe

    return LoadProbe(ranks, CostModel(alpha, beta), compute, step)


def test_load_probes_price_a_saturated_host():
    from dataclasses import replace

    from gradsync.planning.simulate import Host

    recorded = replace(PROFILE, world_size=2)  # 2 ms forward + 20 ms backward, 10 MiB in 40
    loads = {2: _probe(2, 1.0, 1e-6, 8.0, 9.0), 4: _probe(4, 4.0, 2e-6, 11.0, 20.0)}
    host = Host(ranks=4, cores=2, cpu_collectives=True)
    two, four = simulate(recorded, Network(1.0, 5.0), [2, 4], host, loads)
    compute, total = 22.0, sum(PROFILE.nbytes)
    # The compute stretches as the probe's synchronised step does, relative to the probe's
    # compute at the profile's rank count; each bucket then adds its cost under load.
    assert two.no_overlap_ms == pytest.approx(compute * 9 / 8 + 1.0 + 1e-6 * total)
    assert four.no_overlap_ms == pytest.approx(compute * 20 / 8 + 4.0 + 2e-6 * total)
    buckets = len(default_layout(list(PROFILE.nbytes)))
    assert four.default_ms == pytest.approx(four.no_overlap_ms + (buckets - 1) * 4.0)
    # Nothing overlaps there, so the plan is one bucket.
    assert four.planned_buckets == 1 and four.planned_ms == four.no_overlap_ms
    assert four.planned_layout == (tuple(range(40)),)
    # Without a probe for a rank count (or with free cores) the network model prices it.
    eight = simulate(recorded, Network(1.0, 5.0), [8], host, loads)[0]
    assert eight == simulate(recorded, Network(1.0, 5.0), [8], host)[0]
    free = Host(ranks=4, cores=8, cpu_collectives=True)
    assert simulate(recorded, Network(1.0, 5.0), [4], free, loads) == simulate(
        recorded, Network(1.0, 5.0), [4], free
    )


def test_probe_under_load_on_a_real_group_agrees_across_ranks(tmp_path):
    from gradsync.planning.planner import LoadProbe, probe_under_load

    def body(rank, group):
        return probe_under_load(group, sizes=(4 << 10, 256 << 10), repeats=2, busy_ms=2.0)

    probes = run_threaded(body, 2)
    assert probes[0] == probes[1]  # the slowest rank's medians, everywhere
    probe = probes[0]
    assert probe.ranks == 2 and probe.step_ms >= probe.compute_ms > 0
    assert probe.cost.alpha_ms >= 0 and probe.cost.beta_ms_per_byte >= 0
    assert LoadProbe.load(probe.save(tmp_path / "load.json")) == probe
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a gradsync load probe"):
        LoadProbe.load(tmp_path / "bad.json")


def test_cli_prices_a_saturated_host_from_load_probes(tmp_path, capsys):
    from dataclasses import replace

    profile = replace(PROFILE, world_size=2).save(tmp_path / "p.json")
    two = _probe(2, 1.0, 1e-6, 8.0, 9.0).save(tmp_path / "l2.json")
    four = _probe(4, 4.0, 2e-6, 11.0, 20.0).save(tmp_path / "l4.json")
    base = ["simulate", "--profile", str(profile), "--ranks", "2,4,8", "--out", str(tmp_path)]
    assert cli([*base, "--cores-per-host", "2", "--ranks-per-host", "8", "--cpu-collectives",
                "--load-probes", str(two), str(four)]) == 0
    assert "priced from load probes at ranks [2, 4]" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="add --cpu-collectives and --cores-per-host"):
        cli([*base, "--load-probes", str(two)])
    with pytest.raises(SystemExit, match="no load probe at the profile's 2 ranks"):
        cli([*base, "--cores-per-host", "2", "--cpu-collectives", "--load-probes", str(four)])


def test_probe_under_load_raises_when_a_rank_does_not_take_part():
    from datetime import timedelta

    from gradsync.planning.planner import probe_under_load
    from gradsync.testing import RankError

    def body(rank, group):
        if rank == 0:  # rank 1 never probes: rank 0 must give up, not wait forever
            probe_under_load(
                group, sizes=(4 << 10,), repeats=1, busy_ms=1.0, timeout=timedelta(seconds=1)
            )
        return "absent"

    with pytest.raises(
        RankError, match=r"rank 0.*loaded cost-model calibration.*(did not complete within|failed)"
    ):
        run_threaded(body, 2, timeout=30)


# ------------------------------------------------------------------ contention and the reducer's
# work


def test_a_measured_contention_share_round_trips_through_the_hosts_cores():
    from gradsync.planning.simulate import Host

    machine = Host(ranks=2, cores=2)  # the emulated cluster: two hosts' ranks on two cores
    for share in (0.1, 0.35, 0.7):
        fitted = machine.with_contention(share, ranks=2, bandwidth_gbps=0.25)
        assert fitted.comm_cores_per_gbps > 0
        assert fitted.contention(2, 0.25) == pytest.approx(share)
        # Twice the link rate moves twice the bytes a second: more of the cores it takes.
        assert fitted.contention(2, 0.5) > share
    assert machine.with_contention(0.0, 2, 0.25).comm_cores_per_gbps == 0.0
    assert machine.contention(2, 0.25) == 0.0  # nothing measured: collectives take no compute
    with pytest.raises(ValueError, match="with_contention"):
        machine.with_contention(1.5, 2, 0.25)


def test_without_contention_or_reducer_costs_predictions_are_the_planners_own():
    from dataclasses import replace

    from gradsync.planning.planner import predict_finish_ms
    from gradsync.planning.simulate import Host

    network = Network(bandwidth_gbps=0.25, latency_us=100.0)
    (plain,) = simulate(PROFILE, network, [2])
    (hosted,) = simulate(PROFILE, network, [2], Host(ranks=2, cores=2))  # share 0: unchanged
    assert plain == hosted
    cost = network.cost(2)
    ready, nbytes = list(PROFILE.ready_ms), list(PROFILE.nbytes)
    finish = predict_finish_ms(ready, nbytes, [list(b) for b in plain.planned_layout], cost)
    assert plain.planned_ms == pytest.approx(PROFILE.forward_ms + max(finish, ready[-1]))
    # The reducer's fill (per byte) and tail add to no overlap exactly, and never make a layout
    # faster.
    costly = replace(PROFILE, fill_ms_per_byte=1e-7, tail_ms=2.0)
    (charged,) = simulate(costly, network, [2])
    assert charged.no_overlap_ms == pytest.approx(
        plain.no_overlap_ms + 1e-7 * sum(PROFILE.nbytes) + 2.0
    )
    assert (
        charged.default_ms >= plain.default_ms + 2.0
        and charged.planned_ms >= plain.planned_ms + 2.0
    )


def test_under_contention_backward_slows_while_collectives_fly_and_the_plan_takes_fewer():
    from gradsync.planning.simulate import Host

    network = Network(bandwidth_gbps=0.25, latency_us=100.0)
    free = Host(ranks=2, cores=2)
    contended = free.with_contention(0.5, ranks=2, bandwidth_gbps=network.bandwidth_gbps)
    (calm,) = simulate(PROFILE, network, [2], free)
    (busy,) = simulate(PROFILE, network, [2], contended)
    assert busy.default_ms > calm.default_ms and busy.planned_ms > calm.planned_ms
    assert busy.planned_buckets <= calm.planned_buckets  # each collective now costs compute too
    assert busy.planned_ms <= busy.default_ms + 1e-9  # the best of the plans it priced
