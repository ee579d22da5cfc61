"""The delay line (kvferry.deploy.linkdelay) on a real link: two network namespaces joined by a veth
pair, A's egress (or B's ingress) sent to the daemon's queue by iptables. The test holds sockets of both
namespaces in this process (created there by a short `ip netns exec` child, handed back over SCM_RIGHTS:
a socket keeps its namespace), so every measurement is plain socket calls. No mocks; root, `ip` and
iptables are needed, and each test deletes its namespaces and kills only the daemons it started."""

from __future__ import annotations

import itertools
import os
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvferry.deploy.linkdelay import SO_RCVBUFFORCE, daemon_argv, iptables_binary, iptables_rules


def _missing() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces, iptables)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    if shutil.which("iptables-legacy") is None and shutil.which("iptables") is None:
        return "needs iptables (apt-get install iptables)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")

A_ADDR, B_ADDR = "198.18.250.1", "198.18.250.2"
QUEUE = 7
_TAGS = itertools.count()
_MAKE_SOCKETS = (
    "import socket, sys\n"
    "chan = socket.socket(fileno=int(sys.argv[1]))\n"
    "socks = [socket.socket(socket.AF_INET, int(t)) for t in sys.argv[2:]]\n"
    "socket.send_fds(chan, [b'ok'], [s.fileno() for s in socks])\n"
)


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr.strip()}"
    return done.stdout


class Link:
    """Namespaces A (198.18.250.1) and B (.2) joined by a veth pair; delay lines on what A sends: on A's
    egress, or (`ingress`) on B's ingress."""

    def __init__(self, workdir: Path):
        tag = f"{os.getpid()}x{next(_TAGS)}"
        self.ns_a, self.ns_b = f"kvf-ld-{tag}-a", f"kvf-ld-{tag}-b"
        self.if_a, self.if_b = f"ld{tag}a", f"ld{tag}b"  # at most 15 characters
        self.workdir = workdir
        self.daemons: list[subprocess.Popen] = []
        self.ingress: dict[int, bool] = {}  # a daemon's pid: is it on B's ingress

    def up(self) -> None:
        added = subprocess.run(["ip", "netns", "add", self.ns_a], capture_output=True, text=True, timeout=30)
        if added.returncode != 0:  # root in a container without CAP_NET_ADMIN / CAP_SYS_ADMIN
            pytest.skip(f"cannot create a network namespace: {added.stderr.strip()}")
        _run("ip", "netns", "add", self.ns_b)
        peer = ("peer", "name", self.if_b, "netns", self.ns_b)
        _run("ip", "link", "add", self.if_a, "netns", self.ns_a, "type", "veth", *peer)
        for ns, iface, addr in ((self.ns_a, self.if_a, A_ADDR), (self.ns_b, self.if_b, B_ADDR)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", iface)
            _run("ip", "-n", ns, "link", "set", iface, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        for proc in self.daemons:
            if proc.poll() is None:
                proc.kill()  # by its pid (`ip netns exec` execs the daemon: same process)
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        for ns in (self.ns_a, self.ns_b):  # takes the veth pair and the namespace's iptables rules along
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def sockets(self, ns: str, *types: int) -> list[socket.socket]:
        """New AF_INET sockets of `types`, created in namespace `ns`."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        with parent, child:
            argv = [sys.executable, "-S", "-c", _MAKE_SOCKETS, str(child.fileno()), *map(str, types)]
            subprocess.run(
                ["ip", "netns", "exec", ns, *argv], pass_fds=[child.fileno()], check=True, timeout=30
            )
            _, fds, _, _ = socket.recv_fds(parent, 16, len(types))
        return [socket.socket(fileno=fd) for fd in fds]

    def connection(self) -> tuple[socket.socket, socket.socket]:
        """A TCP connection from A to B: (A's end, B's end), Nagle off, 10 s timeouts."""
        (listener,) = self.sockets(self.ns_b, socket.SOCK_STREAM)
        (client,) = self.sockets(self.ns_a, socket.SOCK_STREAM)
        with listener:
            listener.bind((B_ADDR, 0))
            listener.listen()
            client.connect(listener.getsockname())
            server, _ = listener.accept()
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(10)
        return client, server

    def iptables(self, ingress: bool, delete: bool = False) -> None:
        ns, iface = (self.ns_b, self.if_b) if ingress else (self.ns_a, self.if_a)
        for argv in iptables_rules(iface, QUEUE, delete=delete, ingress=ingress):
            _run("ip", "netns", "exec", ns, *argv)

    def start_delay(
        self, delay_ms: float, loss: float = 0.0, seed: int = 0, ingress: bool = False
    ) -> subprocess.Popen:
        """Rules in, then the daemon in A (`ingress`: in B), waited for until its ready line (10 s)."""
        self.iptables(ingress)
        stderr = (self.workdir / f"linkdelay-{len(self.daemons)}.err").open("w")
        with stderr:
            ns = self.ns_b if ingress else self.ns_a
            argv = ["ip", "netns", "exec", ns, *daemon_argv(QUEUE, delay_ms, loss, seed)]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
        self.daemons.append(proc)
        self.ingress[proc.pid] = ingress
        assert proc.stdout is not None
        deadline, line = time.monotonic() + 10, ""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline and sel.select(deadline - time.monotonic()):
                line = proc.stdout.readline()
                if line.strip() == f"linkdelay ready queue={QUEUE}" or not line:
                    break
        assert proc.poll() is None and line.startswith("linkdelay ready"), self.stderr_of(proc)
        return proc

    def stderr_of(self, proc: subprocess.Popen) -> str:
        return (self.workdir / f"linkdelay-{self.daemons.index(proc)}.err").read_text()

    def stop_delay(self, proc: subprocess.Popen, remove_rules: bool = True) -> str:
        """SIGTERM: the daemon must exit 0 within 2 s; its last stderr line (the counts)."""
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(2) == 0, self.stderr_of(proc)
        print(f"daemon stopped in {(time.monotonic() - start) * 1e3:.0f} ms")
        if remove_rules:
            self.iptables(self.ingress[proc.pid], delete=True)
        return self.stderr_of(proc).strip().splitlines()[-1]


@pytest.fixture
def link(tmp_path) -> Iterator[Link]:
    net = Link(tmp_path)
    try:
        net.up()
        yield net
    finally:
        net.down()


def _stats(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in (f.split("=") for f in line.split() if "=" in f)}


def _rtt(client: socket.socket, server: socket.socket, rounds: int) -> float:
    """Median seconds of a one-byte request/response from A to B."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        client.sendall(b"?")
        assert server.recv(1) == b"?"
        server.sendall(b"!")
        assert client.recv(1) == b"!"
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@pytest.mark.parametrize("ingress", [False, True], ids=["egress", "ingress"])
def test_delay_adds_to_the_round_trip(link, ingress):
    client, server = link.connection()
    with client, server:
        base = _rtt(client, server, 20)
        daemon = link.start_delay(20, ingress=ingress)
        delayed = _rtt(client, server, 10)
        counts = _stats(link.stop_delay(daemon))
    print(f"RTT {base * 1e3:.3f} ms without the delay line, {delayed * 1e3:.3f} ms with 20 ms; {counts}")
    assert 0.018 <= delayed - base < 0.060
    assert counts["packets"] >= 10 and counts["dropped"] == 0


def test_loss_drops_the_given_share(link):
    n = 2000
    client, server = link.connection()  # before the loss: a marker that TCP delivers in any case
    (receiver,) = link.sockets(link.ns_b, socket.SOCK_DGRAM)
    (sender,) = link.sockets(link.ns_a, socket.SOCK_DGRAM)
    with client, server, receiver, sender:
        receiver.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)
        receiver.bind((B_ADDR, 0))
        daemon = link.start_delay(1, loss=0.2, seed=1234)
        for i in range(n):
            sender.sendto(i.to_bytes(4, "big"), receiver.getsockname())
        client.sendall(b"m")  # the delay line is FIFO: once it is through, so is every datagram
        assert server.recv(1) == b"m"
        received = set()
        receiver.setblocking(False)
        while True:
            try:
                received.add(int.from_bytes(receiver.recv(16), "big"))
            except BlockingIOError:
                break
        counts = _stats(link.stop_delay(daemon))
    print(f"{len(received)} of {n} datagrams arrived with --loss 0.2; {counts}")
    assert 0.7 * n <= len(received) <= 0.9 * n
    assert 0.1 * n <= counts["dropped"] <= 0.3 * n


@pytest.mark.parametrize(
    ("delay_ms", "ingress", "floor"), [(1, False, 50), (20, True, 25)], ids=["egress-1ms", "ingress-20ms"]
)
def test_bulk_transfer_keeps_up(link, delay_ms, ingress, floor):
    """50 MiB of TCP across the delay line, in GSO packets that pass whole. (Not on egress at 20 ms:
    there TCP Small Queues starves the sender; see the module's docstring.)"""
    total, chunk = 50 << 20, memoryview(bytes(1 << 20))
    # the delay first: a connection opened without it would keep its µs min RTT (BBR: for 10 s) and
    # a congestion window sized to it
    daemon = link.start_delay(delay_ms, ingress=ingress)
    client, server = link.connection()
    got = [0]

    def drain() -> None:
        buf = bytearray(1 << 20)
        while n := server.recv_into(buf):
            got[0] += n

    with client, server:
        reader = threading.Thread(target=drain)
        start = time.perf_counter()
        reader.start()
        for _ in range(total // len(chunk)):
            client.sendall(chunk)
        client.shutdown(socket.SHUT_WR)
        reader.join(60)
        elapsed = time.perf_counter() - start
        counts = _stats(link.stop_delay(daemon))
    rate = total / elapsed / 1e6
    side = "B's ingress" if ingress else "A's egress"
    print(f"{total >> 20} MiB in {elapsed:.2f} s, {delay_ms} ms on {side}: {rate:.0f} MB/s, {counts}")
    assert got[0] == total
    assert rate > floor
    assert counts["gso"] > 0, "no GSO packet came whole: NFQA_CFG_F_GSO did not take"


def test_stop_bypass_and_cleanup(link):
    client, server = link.connection()
    with client, server:
        daemon = link.start_delay(20)
        assert _rtt(client, server, 3) >= 0.018
        link.stop_delay(daemon, remove_rules=False)
        assert _rtt(client, server, 3) < 0.010  # the daemon is gone, its rules not: --queue-bypass
        link.iptables(ingress=False, delete=True)
        assert _rtt(client, server, 3) < 0.010
    rules = _run("ip", "netns", "exec", link.ns_a, iptables_binary(), "-w", "-S", "OUTPUT")
    assert "NFQUEUE" not in rules, rules
