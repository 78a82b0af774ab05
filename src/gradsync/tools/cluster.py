"""An emulated cluster on this machine: 2 to 4 hosts on a switch, each with its own network.

    with EmulatedCluster(hosts=2, link="2gbit") as cluster:
        outputs = cluster.torchrun(["-m", "gradsync.tools.benchsuite", "--quick"])

Each host is a Linux network namespace whose processes also get their own UTS namespace (their
own host name, `gradsync-host0`, ...). The hosts hang off a bridge in a namespace of its own
(the switch) through veth pairs; the egress of both ends of each host's cable is shaped with
`tc ... tbf` to the host's link rate, so each direction runs at that rate. gloo then waits on
the link, not on the CPU (what CPU it takes goes to both hosts' network stacks, the switch and
tbf), and overlaps computation, as on a cluster with a slow network. TCP's packets on the cables
are 256 KiB ("BIG TCP"), not 64, which cuts that CPU (`_allow_big_packets`); figures:
docs/benchmarks/design-figures.md#emulated-link-cost.

Propagation latency needs `netem`, which this kernel lacks; `latency=` is refused with that
reason where netem is missing. Needs root and iproute2 (`ip`, `tc`) and `unshare`; otherwise
`ClusterUnavailable` says which is missing. Everything is removed on every way out: leaving the
`with` block (also by an exception), interpreter exit, SIGTERM; and namespaces a killed run left
behind are removed by the next one (their names carry the owner's pid).

    python -m gradsync.tools.cluster --hosts 3 --link 1gbit -- \
        python -c "import socket; print(socket.gethostname())"
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType

__all__ = ["ClusterUnavailable", "EmulatedCluster", "Host", "parse_rate"]

PREFIX = "gradsync-cl-"
IFNAME = "eth0"  # every host's end of its cable: the same name in each namespace
RDZV_PORT = 29400  # fresh namespaces: nothing else can hold it
# TCP's largest packet on the cables, and without BIG TCP
BIG_PACKET, LEGACY_PACKET = 256 * 1024, 64 * 1024
CLONE_NEWNET = 0x40000000
RTM_NEWLINK, NLM_F_REQUEST, NLM_F_ACK = 16, 1, 4
# linux/if_link.h
IFLA_GSO_MAX_SIZE, IFLA_GRO_MAX_SIZE, IFLA_GSO_IPV4_MAX_SIZE, IFLA_GRO_IPV4_MAX_SIZE = (
    41,
    58,
    63,
    64,
)


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the cluster (not root, a tool missing, a kernel refusal)."""


@dataclasses.dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    hostname: str
    address: str


def parse_rate(rate: str) -> float:
    """'2gbit', '500mbit', '1.5gbit' -> bits per second (tc's units)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(k|m|g)?bit\s*", rate.lower())
    if not match:
        raise ValueError(
            f"link rate {rate!r}: give a number and a unit, e.g. 2gbit, 500mbit, 100kbit"
        )
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, None: 1.0}[match.group(2)]
    return float(match.group(1)) * scale


class EmulatedCluster:
    """`hosts` namespaces with their own host names on a bridge, each link shaped to its rate.

    `link` is one rate for every host or one per host ("2gbit", "1gbit", ...); None leaves the
    links unshaped (as fast as the machine moves bytes between namespaces)."""

    def __init__(self, hosts: int = 2, link: str | Sequence[str] | None = "2gbit",
                 latency: str | None = None, subnet: str = "10.78.0") -> None:
        if not 2 <= hosts <= 4:
            raise ValueError(f"hosts={hosts}: the emulated cluster has 2 to 4 hosts")
        links: list[str | None] = (
            [link] * hosts if link is None or isinstance(link, str) else list(link)
        )
        if len(links) != hosts:
            raise ValueError(
                f"{len(links)} link rates for {hosts} hosts: give one, or one per host"
            )
        self.rates = [parse_rate(r) if r is not None else None for r in links]
        self.links = links
        self.latency = latency
        tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.hosts = [
            Host(i, f"{tag}-h{i}", f"gradsync-host{i}", f"{subnet}.{i + 1}") for i in range(hosts)
        ]
        self.big_tcp = True
        """Whether every cable takes TCP packets of `BIG_PACKET` bytes (False where the kernel
        refused: 64 KiB packets, more CPU per byte); known once built."""
        self._made: list[str] = []
        self._previous_sigterm: object = None

    # ---------------------------------------------------------------------- build, remove

    def __enter__(self) -> EmulatedCluster:
        self.build()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()

    def build(self) -> None:
        _require_tools()
        remove_stale()
        atexit.register(self.remove)
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host, rate in zip(self.hosts, self.links):
                self._wire(host, rate)
        except BaseException:
            self.remove()
            raise

    def _namespace(self, name: str) -> None:
        made = _ip("netns", "add", name, check=False)
        if made.returncode != 0:
            raise ClusterUnavailable(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _wire(self, host: Host, rate: str | None) -> None:
        self._namespace(host.namespace)
        port = f"port{host.index}"
        _ip("link", "add", IFNAME, "netns", host.namespace, "type", "veth", "peer", "name", port,
            "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", IFNAME)
        _ip("-n", host.namespace, "link", "set", IFNAME, "up")
        for namespace, device in ((host.namespace, IFNAME), (self.switch, port)):  # both directions
            self.big_tcp = _allow_big_packets(namespace, device) and self.big_tcp
            if rate is not None or self.latency is not None:
                _shape(
                    namespace,
                    device,
                    rate,
                    self.latency,
                    BIG_PACKET if self.big_tcp else LEGACY_PACKET,
                )

    def remove(self) -> None:
        """Delete every namespace this cluster made (their interfaces go with them)."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
            self._previous_sigterm = None
        atexit.unregister(self.remove)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.remove()
        raise SystemExit(128 + signum)

    # ------------------------------------------------------------------------- running

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """`argv` as run on `host`: inside its network namespace, under its own host name."""
        h = self.hosts[host]
        return ["ip", "netns", "exec", h.namespace, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', h.hostname, *argv]

    def env(self, host: int) -> dict[str, str]:
        """What a rank on `host` needs: gloo talks over the cable, not over the loopback that
        the machine's own name resolves to."""
        return {"GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME}

    def torchrun_command(self, host: int, target: Sequence[str], nproc_per_host: int = 1,
                         run_id: str = "gradsync-cluster") -> list[str]:
        """One host's `torchrun --nnodes N` for `target` (a script and its arguments, or
        `-m module ...`), meeting at host 0 through a c10d rendezvous over the links."""
        h = self.hosts[host]
        launcher = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(len(self.hosts)), "--nproc-per-node", str(nproc_per_host),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0].address}:{RDZV_PORT}",
            "--rdzv-id", f"{run_id}-{os.getpid()}",
            # is_host: the endpoint's address is not what this host's name resolves to;
            # --local-addr: otherwise rank 0 advertises its name ("localhost") as MASTER_ADDR.
            "--rdzv-conf", f"is_host={int(host == 0)},join_timeout=90,read_timeout=60",
            "--local-addr", h.address,
            *target,
        ]  # fmt: skip
        return self.command(host, launcher)

    def torchrun(self, target: Sequence[str], nproc_per_host: int = 1, timeout: float = 600.0,
                 env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
        """Run `target` on every host at once under torchrun; wait for all (killing all past
        `timeout`, or when interrupted); return each host's exit status and output."""
        from ..testing import kill_process_tree

        procs = []
        for i in range(len(self.hosts)):
            procs.append(subprocess.Popen(
                self.torchrun_command(i, target, nproc_per_host),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                env={**os.environ, **(env or {}), **self.env(i)},
            ))
        deadline, killed = time.monotonic() + timeout, False
        results = []
        for i, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for p in procs:  # past the deadline on one host: on every host
                    kill_process_tree(p.pid)
                killed = True
                out, _ = proc.communicate(timeout=30)
            except BaseException:  # the caller's own timeout or ^C: no host's run outlives it
                for p in procs:
                    kill_process_tree(p.pid)
                raise
            if killed:
                out += f"\n[gradsync cluster: host {i} killed after {timeout:.0f} s]"
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out))
        return results

    def __repr__(self) -> str:
        hosts = ", ".join(
            f"{h.hostname} {h.address} @ {rate or 'unshaped'}"
            for h, rate in zip(self.hosts, self.links)
        )
        return f"EmulatedCluster({hosts})"


# ------------------------------------------------------------------------------ helpers


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ClusterUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _allow_big_packets(namespace: str, device: str) -> bool:
    """Let TCP hand `device` packets of up to `BIG_PACKET` bytes (IPv4 "BIG TCP", Linux 6.3+),
    not 64 KiB: a quarter of the packets, so a quarter of the per-packet work (tbf's dequeues,
    the bridge, the receiver's wake-ups), all of it on the cores that compute: an all-reduce
    takes less of the machine's CPU, its wall time the same (the link's); figures:
    docs/benchmarks/design-figures.md#big-tcp-cpu. A real NIC does this work itself (TSO, GRO, DMA).

    iproute2 before 6.3 cannot set these sizes, so rtnetlink is spoken directly, from a thread
    that enters the namespace. False (packets stay at 64 KiB) where the kernel refuses."""
    result: list[bool] = []
    thread = threading.Thread(
        target=lambda: result.append(_set_packet_sizes(namespace, device, BIG_PACKET))
    )
    thread.start()
    thread.join(timeout=30)
    return bool(result and result[0])


def _set_packet_sizes(namespace: str, device: str, size: int) -> bool:
    """In this thread only (setns is per thread): enter `namespace`, set `device`'s GSO and GRO
    sizes (the generic and the IPv4 ones) to `size` with one RTM_NEWLINK."""
    import ctypes
    import socket
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{namespace}") as ns:
        if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
            return False
    try:
        index = socket.if_nametoindex(device)
    except OSError:
        return False
    attrs = b"".join(struct.pack("HHI", 8, kind, size) for kind in (
        IFLA_GSO_MAX_SIZE, IFLA_GRO_MAX_SIZE, IFLA_GSO_IPV4_MAX_SIZE, IFLA_GRO_IPV4_MAX_SIZE))
    body = struct.pack("BxHiII", socket.AF_UNSPEC, 0, index, 0, 0) + attrs  # struct ifinfomsg
    header = struct.pack("IHHII", 16 + len(body), RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(10)
        sock.send(header + body)
        reply = sock.recv(4096)
    # struct nlmsgerr: 0 is success
    return len(reply) >= 20 and struct.unpack_from("i", reply, 16)[0] == 0


def _shape(namespace: str, device: str, rate: str | None, latency: str | None, packet: int) -> None:
    cmd = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root"]
    if latency is not None:
        netem = subprocess.run([*cmd, "handle", "1:", "netem", "delay", latency],
                               capture_output=True, text=True, timeout=30)
        if netem.returncode != 0:
            raise ClusterUnavailable(
                f"latency={latency!r} needs tc's netem, which this kernel refuses "
                f"({netem.stderr.strip()}); leave latency out to shape the rate only"
            )
        cmd = [
            "ip",
            "netns",
            "exec",
            namespace,
            "tc",
            "qdisc",
            "add",
            "dev",
            device,
            "parent",
            "1:",
        ]
    if rate is None:
        return
    # The bucket: a millisecond's worth of bytes at the rate, and at least the largest packet
    # and its headers (tbf splits a packet larger than its bucket, at a cost per segment).
    # Larger lets a small collective through at the machine's own speed (2.5 MB would at
    # 2 Gbit/s); tbf runs on hrtimers, so it need not hold a whole timer tick's worth.
    burst = max(int(parse_rate(rate) / 8 / 1000), packet + 64 * 1024)
    shaped = subprocess.run([*cmd, "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"],
                            capture_output=True, text=True, timeout=30)
    if shaped.returncode != 0:
        raise ClusterUnavailable(f"tc tbf on {device} in {namespace}: {shaped.stderr.strip()}")


def _require_tools() -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise ClusterUnavailable("needs root to create network namespaces (ip netns add)")
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        raise ClusterUnavailable(f"needs {', '.join(missing)} (iproute2, util-linux)")


def remove_stale() -> list[str]:
    """Remove namespaces left by clusters whose process is gone (killed before cleaning up)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    removed = []
    for line in listing.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):].split("-")[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradsync.tools.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument(
        "--link", default="2gbit", help="rate per host, or comma-separated, one per host"
    )
    parser.add_argument("--latency", default=None)
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds before every host's command is killed",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- COMMAND: run on every host at once"
    )
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    links = args.link.split(",") if "," in args.link else args.link
    with EmulatedCluster(args.hosts, links, args.latency) as cluster:
        print(cluster, flush=True)
        procs = (
            [
                subprocess.Popen(
                    cluster.command(i, command),
                    env={**os.environ, **cluster.env(i)},
                    start_new_session=True,
                )
                for i in range(args.hosts)
            ]
            if command
            else []
        )
        return max([_wait_or_kill(p, args.timeout) for p in procs], default=0)


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> int:
    from ..testing import kill_process_tree

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        print(f"[gradsync cluster: killed after {timeout:.0f} s]", file=sys.stderr, flush=True)
        return proc.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
