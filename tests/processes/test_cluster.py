"""The emulated cluster (`gradsync.tools.cluster`): hosts with their own names and shaped links
that build and tear down on every way out, and a short planned run on it, exact against torch's
DDP through every layout switch. Needs root, iproute2 and util-linux; skipped, saying which is
missing, elsewhere."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from gradsync.tools.cluster import (
    PREFIX,
    ClusterUnavailable,
    EmulatedCluster,
    parse_rate,
    remove_stale,
)

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "train_parity.py")


def _ours() -> list[str]:
    listing = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30
    ).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)]


@pytest.fixture
def cluster_or_skip():
    def build(*args, **kwargs) -> EmulatedCluster:
        cluster = EmulatedCluster(*args, **kwargs)
        try:
            cluster.build()
        except ClusterUnavailable as e:
            pytest.skip(str(e))
        return cluster

    return build


def test_link_rates_parse_as_tc_writes_them():
    assert (
        parse_rate("2gbit") == 2e9
        and parse_rate("500mbit") == 5e8
        and parse_rate("1.5gbit") == 1.5e9
    )
    with pytest.raises(ValueError, match="2gbit"):
        parse_rate("fast")
    with pytest.raises(ValueError, match="2 to 4 hosts"):
        EmulatedCluster(hosts=5)
    with pytest.raises(ValueError, match="one per host"):
        EmulatedCluster(hosts=3, link=["1gbit", "2gbit"])


SERVE = ("import socket; s = socket.create_server(('{}', 5555)); print('listening', flush=True); "
         "c, _ = s.accept(); c.sendall(socket.gethostname().encode()); c.close()")
ASK = "import socket; print(socket.create_connection(('{}', 5555), timeout=20).recv(100).decode())"


@pytest.mark.timeout(120)
def test_hosts_have_their_own_names_addresses_and_rates_and_are_removed_after(cluster_or_skip):
    cluster = cluster_or_skip(3, ["2gbit", "1gbit", "500mbit"])
    try:
        seen = []
        for i, host in enumerate(cluster.hosts):
            out = subprocess.run(
                cluster.command(
                    i, ["sh", "-c", "hostname; ip -4 -o addr show eth0; tc qdisc show dev eth0"]
                ),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            seen.append(out.stdout)
            assert out.stdout.splitlines()[0] == host.hostname
            assert f"{host.address}/24" in out.stdout
        assert re.search(r"tbf .*rate 2Gbit", seen[0]) and re.search(r"rate 1Gbit", seen[1])
        assert re.search(r"rate 500Mbit", seen[2])
        server = subprocess.Popen(
            cluster.command(0, [sys.executable, "-c", SERVE.format(cluster.hosts[0].address)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline().strip() == "listening"
        client = subprocess.run(
            cluster.command(2, [sys.executable, "-c", ASK.format(cluster.hosts[0].address)]),
            capture_output=True,
            text=True,
            timeout=30,
        )
        server.wait(timeout=30)
        assert client.stdout.strip() == "gradsync-host0", client.stderr  # across the switch
        # 3 hosts, switch
        assert len([n for n in _ours() if n.startswith(f"{PREFIX}{os.getpid()}-")]) == 4
    finally:
        cluster.remove()
    assert not [n for n in _ours() if n.startswith(f"{PREFIX}{os.getpid()}-")]


SINK = ("import socket; s = socket.create_server(('{}', 5556)); print('listening', flush=True); "
        "c, _ = s.accept()\nwhile c.recv(1 << 20): pass")
SEND = "import socket; socket.create_connection(('{}', 5556), timeout=20).sendall(bytes(16 << 20))"


@pytest.mark.timeout(120)
def test_tcp_crosses_the_cables_in_big_packets_that_tbf_passes_whole(cluster_or_skip):
    """256 KiB packets, not 64 KiB: a quarter of the per-packet CPU the emulation costs."""
    cluster = cluster_or_skip(2, "2gbit")
    try:
        if not cluster.big_tcp:
            pytest.skip("this kernel refused 256 KiB GSO sizes (IPv4 BIG TCP needs Linux 6.3+)")
        server = subprocess.Popen(
            cluster.command(1, [sys.executable, "-c", SINK.format(cluster.hosts[1].address)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline().strip() == "listening"
        sent = subprocess.run(
            cluster.command(0, [sys.executable, "-c", SEND.format(cluster.hosts[1].address)]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        server.wait(timeout=30)
        link = subprocess.run(cluster.command(0, ["ip", "-s", "link", "show", "eth0"]),
                              capture_output=True, text=True, timeout=30).stdout
        # veth counts a packet as one however many TCP segments it carries (tbf counts segments)
        nbytes, packets = map(int, re.search(r"TX:.*\n\s*(\d+)\s+(\d+)", link).groups())
        assert nbytes >= 16 << 20
        assert nbytes / packets > 64 * 1024, link  # at most 64 KiB each without BIG TCP
        qdisc = subprocess.run(cluster.command(0, ["tc", "qdisc", "show", "dev", "eth0"]),
                               capture_output=True, text=True, timeout=30).stdout
        burst = re.search(r"burst (\d+)b", qdisc)
        # a packet passes whole
        assert burst and int(burst.group(1)) >= 256 * 1024 + 64 * 1024 - 1024, qdisc
    finally:
        cluster.remove()


@pytest.mark.timeout(120)
def test_an_exception_inside_the_block_still_removes_everything(cluster_or_skip):
    cluster_or_skip(2).remove()  # skips where the cluster cannot be built
    with pytest.raises(RuntimeError, match="inside"):
        with EmulatedCluster(2):
            assert _ours()
            raise RuntimeError("inside")
    assert not [n for n in _ours() if n.startswith(f"{PREFIX}{os.getpid()}-")]


BUILD_AND_WAIT = (
    "import sys, time\n"
    "from gradsync.tools.cluster import EmulatedCluster\n"
    "EmulatedCluster(2).build()\n"
    "print('built', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stopped_owner_leaves_nothing_behind(cluster_or_skip, how):
    cluster_or_skip(2).remove()
    owner = subprocess.Popen(
        [sys.executable, "-c", BUILD_AND_WAIT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout.readline().strip() == "built"
        mine = [n for n in _ours() if n.startswith(f"{PREFIX}{owner.pid}-")]
        assert len(mine) == 3
        owner.send_signal(getattr(signal, how))
        owner.wait(timeout=30)
    finally:
        if owner.poll() is None:
            owner.kill()
    if how == "SIGKILL":  # no handler runs: the next cluster's build removes them
        time.sleep(0.2)
        assert set(mine) <= set(remove_stale())
    assert not [n for n in _ours() if n.startswith(f"{PREFIX}{owner.pid}-")]


@pytest.mark.timeout(300)
def test_a_planned_run_on_two_hosts_at_2gbit_matches_torch_ddp_step_for_step(cluster_or_skip):
    cluster = cluster_or_skip(2, "2gbit")
    try:
        done = cluster.torchrun(
            [SCRIPT, "40", "-", "auto"], timeout=240, env={"OMP_NUM_THREADS": "1"}
        )
    finally:
        cluster.remove()
    report = "\n".join(
        f"--- host {i} (exit {d.returncode}):\n{d.stdout[-3000:]}" for i, d in enumerate(done)
    )
    assert all(d.returncode == 0 for d in done), report
    for rank, d in enumerate(done):
        assert f"rank {rank}: 40 steps matched torch DDP exactly" in d.stdout, report
        assert re.search(rf"rank {rank}: planned \d+ buckets .*\((kept|reverted)", d.stdout), report


@pytest.mark.timeout(480)
def test_gradsync_bench_runs_on_the_cluster(cluster_or_skip, tmp_path):
    cluster_or_skip(2).remove()
    out = subprocess.run(
        [sys.executable, "-m", "gradsync.tools.cli", "bench", "--hosts", "2", "--link", "2gbit",
         "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=450,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "on EmulatedCluster(gradsync-host0 10.78.0.1 @ 2gbit" in out.stdout
    table = (tmp_path / "bench.md").read_text()
    assert "floor max(compute, communication)" in table and "| gradsync planned |" in table
    assert remove_stale() == []  # the bench removed its cluster itself


@pytest.mark.timeout(120)
def test_a_run_past_its_deadline_is_killed_on_every_host(cluster_or_skip, tmp_path):
    cluster = cluster_or_skip(2, "2gbit")
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    try:
        start = time.monotonic()
        done = cluster.torchrun([str(script)], timeout=8)
        took = time.monotonic() - start
    finally:
        cluster.remove()
    assert took < 60 and all(d.returncode != 0 for d in done)
    assert all("killed after 8 s" in d.stdout for d in done)
    cli = subprocess.run(
        [sys.executable, "-m", "gradsync.tools.cluster", "--timeout", "3", "--", "sleep", "600"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode != 0 and "killed after 3 s" in cli.stderr
