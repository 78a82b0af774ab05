"""Two hosts on one machine: Linux network namespaces joined by a veth pair, one rank per "host",
each launched by its own `torchrun --nnodes 2` and meeting through a c10d rendezvous over the
link. The run must match torch's DDP step for step, and end with exactly the parameters of the
same script run on one host (`torchrun --standalone --nproc-per-node 2`).

Needs root and iproute2; skipped (saying which is missing) elsewhere.

What a two-host launch needs beyond the torchrun line, when the hosts' own names do not resolve
to the addresses they talk over (here each host has its own name, which resolves to nothing;
a real multi-homed host is in the same position; `EmulatedCluster.torchrun_command` adds them):

* `--rdzv-conf is_host=1` on the endpoint's host (0 on the other). Without it the rendezvous
  decides who hosts its TCP store by matching the endpoint address against what the hostname
  resolves to; nothing matches 10.77.0.1, so neither host serves and both wait as clients for a
  store nobody started. (The "hostname of the client socket cannot be retrieved. err=-3"
  warning is unrelated and harmless: a reverse lookup of a peer address, with no DNS reachable.)
* `--local-addr <own address>`: otherwise rank 0's agent advertises `socket.getfqdn()`
  ("localhost" here) as MASTER_ADDR, and host 2's worker waits on its own loopback.
* `GLOO_SOCKET_IFNAME=<veth>`: otherwise gloo binds to the address the hostname resolves to,
  127.0.0.1, and the peer cannot reach it.
"""

from __future__ import annotations

import os

import pytest
import torch

from gradsync.testing import run_torchrun
from gradsync.tools.cluster import ClusterUnavailable, EmulatedCluster

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "train_parity.py")
STEPS = 15
RUN_TIMEOUT = 150.0
ENV = {"OMP_NUM_THREADS": "1"}  # what torchrun sets for the single-host run (nproc > 1)


@pytest.fixture
def two_hosts():
    """Two hosts of the emulated cluster (`gradsync.tools.cluster`), links unshaped."""
    cluster = EmulatedCluster(2, link=None)
    try:
        cluster.build()
    except ClusterUnavailable as e:
        pytest.skip(str(e))
    yield cluster
    cluster.remove()


def _run_two_hosts(cluster: EmulatedCluster, out: str) -> list[str]:
    """Launch both hosts, wait for both within the deadline, return each host's output."""
    done = cluster.torchrun([SCRIPT, str(STEPS), out], timeout=RUN_TIMEOUT, env=ENV)
    report = "\n".join(
        f"--- host {i} (exit {d.returncode}):\n{d.stdout}" for i, d in enumerate(done)
    )
    assert all(d.returncode == 0 for d in done), report
    return [d.stdout for d in done]


@pytest.mark.timeout(420)
def test_two_hosts_over_a_link_match_torch_ddp_and_the_single_host_run(two_hosts, tmp_path):
    two_host_params = str(tmp_path / "two_hosts.pt")
    single_host_params = str(tmp_path / "single_host.pt")

    texts = _run_two_hosts(two_hosts, two_host_params)
    for rank, text in enumerate(texts):  # rank r on host r: ranks follow the sorted addresses
        assert f"rank {rank}: {STEPS} steps matched torch DDP exactly" in text, text

    single = run_torchrun(SCRIPT, 2, [str(STEPS), single_host_params], timeout=RUN_TIMEOUT, env=ENV)
    assert single.returncode == 0, single.stdout
    for rank in range(2):
        assert f"rank {rank}: {STEPS} steps matched torch DDP exactly" in single.stdout

    ours = torch.load(two_host_params)
    theirs = torch.load(single_host_params)
    assert list(ours) == list(theirs)
    differing = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not differing, f"two-host parameters differ from the single-host run's: {differing}"
