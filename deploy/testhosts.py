"""Emulated hosts: several "machines" on one Linux box, for multi-host tests and benchmarks.

Each host is
- a **network namespace** with one interface (`eth0`) and its own address in 198.18.N.0/24 (the
  benchmarking range), joined to the others by a veth pair on a bridge; no default route, so nothing it
  sends leaves the machine. The bridge holds 198.18.N.254 (the *observer*: the process that made the
  hosts reaches every host there, as an operator's machine on the same LAN would);
- a **mount and UTS namespace** held by a small holder process: private `/dev/shm` and `/tmp` (tmpfs,
  so no same-host shortcut between hosts: a shared slab or a Unix socket of one host is not visible on
  another), its own hostname and `/etc/hosts` (every host's name -> its address, as a cluster's DNS);
- a **CPU set**: everything started on it runs under `taskset` with the host's cores;
- a **shaped link** (`shape`): rate with `tbf` on both ends of its veth (both directions); delay and loss
  on what the host receives, with the NFQUEUE delay line of `linkdelay.py` (this kernel family often
  lacks netem; a delay on egress would starve the sender's TCP: TCP small queues charge a held packet
  to its socket). One-way delay A -> B is B's `delay_ms`, a round trip A <-> B the sum of both.
  Hosts keep the kernel's congestion control: under BBR a connection opened before a delay was added
  runs slowly for up to 10 s (it keeps the RTT it saw that long).

Processes start on a host with `Host.popen` / `Host.run` (`nsenter` into the holder's namespaces).
Teardown (`TestHosts.down`, also on `with` exit and from the CLI) ends every process by the pids it
recorded and by `ip netns pids`, never by name, then removes the namespaces, veths and bridge. A state
file under /run/kvferry-testhosts/ names what was made, so `python -m kvferry.deploy.testhosts down
--prefix P` cleans up after a run that crashed.

    python -m kvferry.deploy.testhosts up --hosts 3 --cpus 0,1,0-1 --prefix kvh
    python -m kvferry.deploy.testhosts exec --prefix kvh --host 1 -- ray start --head ...
    python -m kvferry.deploy.testhosts shape --prefix kvh --host 1 --rate-mbit 10000 --delay-ms 0.1
    python -m kvferry.deploy.testhosts down --prefix kvh
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_DIR = Path("/run/kvferry-testhosts")
BASE = "198.18"


class HostsError(RuntimeError):
    """The hosts cannot be made here (not root, a tool missing) or a step failed."""


def unavailable() -> str | None:
    """Why emulated hosts cannot run on this machine (None: they can)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network and mount namespaces)"
    for tool in ("ip", "tc", "nsenter", "unshare", "taskset"):
        if shutil.which(tool) is None:
            return f"emulated hosts need {tool!r} (iproute2 / util-linux)"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass(frozen=True)
class LinkShape:
    """One host's link: `rate_mbit` (0: unlimited) both ways, `delay_ms` and `loss` (0..1) on what it
    receives."""

    rate_mbit: float = 0.0
    delay_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self):
        if self.rate_mbit < 0 or self.delay_ms < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"bad link shape {self}")


@dataclass
class Host:
    """One emulated host (see the module docstring); made by TestHosts."""

    name: str
    index: int
    address: str
    netns: str
    veth: str  # the bridge-side end (in the root namespace)
    cpus: str  # taskset list ("0", "0-1"); "" = every core
    holder: int = 0  # pid of the namespace holder
    pids: list[int] = field(default_factory=list)  # processes started here (besides the holder)
    delay_pid: int = 0  # the link's delay line, when shaped with delay or loss

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` as a command that runs on this host."""
        pin = ["taskset", "-c", self.cpus] if self.cpus else []
        return ["nsenter", "-t", str(self.holder), "-m", "-u", "-n", "--", *pin, *argv]

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start `argv` on this host (its pid is recorded for teardown); Popen's keywords pass through."""
        proc = subprocess.Popen(self.wrap(argv), **kw)
        self.pids.append(proc.pid)
        return proc

    def run(
        self, argv: list[str], timeout: float = 60, check: bool = True, **kw
    ) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        done = subprocess.run(self.wrap(argv), timeout=timeout, **kw)
        if check and done.returncode != 0:
            raise HostsError(f"on {self.name}: {' '.join(argv)} exited {done.returncode}: {done.stderr}")
        return done

    def netns_pids(self) -> list[int]:
        out = _sh("ip", "netns", "pids", self.netns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def counters(self) -> tuple[int, int]:
        """(bytes this host sent, bytes it received) on its link since it was made."""
        stats = Path(f"/sys/class/net/{self.veth}/statistics")
        # the bridge-side end receives what the host sends and transmits what it receives
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


class TestHosts:
    """`n` emulated hosts named `<prefix>-1..n` in 198.18.`subnet`.0/24 (host i at .i).

    `cpus`: one taskset list per host ("0", "1", "0-1"; "" = not pinned). Use as a context manager, or
    call `up()` and then `down()` in a `finally`."""

    __test__ = False  # not a pytest class

    def __init__(self, n: int, cpus: list[str] | None = None, prefix: str = "kvh", subnet: int = 0):
        if not 1 <= n <= 250 or not 0 <= subnet <= 255:
            raise ValueError("1..250 hosts in a subnet 0..255")
        if len(prefix) > 8 or not prefix.replace("-", "").isalnum():
            raise ValueError("prefix: <= 8 letters, digits or '-' (interface names are 15 bytes)")
        cpus = cpus or [""] * n
        if len(cpus) != n:
            raise ValueError(f"{n} hosts but {len(cpus)} CPU sets")
        self.prefix, self.subnet = prefix, subnet
        self.bridge = f"{prefix}-br"
        self.observer = f"{BASE}.{subnet}.254"
        self.hosts = [
            Host(
                name=f"{prefix}-{i}",
                index=i,
                address=f"{BASE}.{subnet}.{i}",
                netns=f"{prefix}-{i}",
                veth=f"{prefix}-{i}b",
                cpus=cpus[i - 1],
            )
            for i in range(1, n + 1)
        ]

    # -- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> TestHosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def __getitem__(self, i: int) -> Host:
        """Host i (1-based, as its name and address)."""
        return self.hosts[i - 1]

    def up(self) -> TestHosts:
        why = unavailable()
        if why:
            raise HostsError(why)
        teardown(self.prefix)  # what a crashed run with this prefix left
        self._save()  # before anything exists: a failure below still leaves what to tear down
        try:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "addr", "add", f"{self.observer}/24", "dev", self.bridge)
            _sh("ip", "link", "set", self.bridge, "up")
            for host in self.hosts:
                self._make(host)
                self._save()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self, host: Host) -> None:
        inner = f"{host.veth[:-1]}h"
        _sh("ip", "netns", "add", host.netns)
        _sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", inner)
        _sh("ip", "link", "set", inner, "netns", host.netns)
        _sh("ip", "link", "set", host.veth, "master", self.bridge)
        _sh("ip", "link", "set", host.veth, "up")
        ns = ("ip", "-n", host.netns)
        _sh(*ns, "link", "set", inner, "name", "eth0")
        _sh(*ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _sh(*ns, "link", "set", "eth0", "up")
        _sh(*ns, "link", "set", "lo", "up")
        etc_hosts = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        # what lives under /tmp but every host must see (this checkout, the Python environment: a CI
        # clone may sit there) is bound again over the private /tmp, by way of the private /dev/shm
        keep = [shlex.quote(str(k)) for k in _kept_under_tmp()]
        hide = "".join(
            f"mkdir /dev/shm/.keep{i}; mount --bind {k} /dev/shm/.keep{i};" for i, k in enumerate(keep)
        )
        show = "".join(f"mkdir -p {k}; mount --bind /dev/shm/.keep{i} {k};" for i, k in enumerate(keep))
        tmpfs = "mount -t tmpfs -o mode=1777 tmpfs"
        script = (
            f"set -e; {tmpfs} /dev/shm; {hide} {tmpfs} /tmp; {show}"
            f"printf '{etc_hosts}' > /tmp/.hosts; mount --bind /tmp/.hosts /etc/hosts; hostname {host.name};"
            "echo ready; exec sleep infinity"
        )
        holder = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        host.holder = holder.pid
        if holder.stdout.readline().strip() != "ready":
            raise HostsError(f"host {host.name}: namespace holder failed: {holder.stderr.read()}")
        holder.stdout.close()

    def down(self) -> None:
        teardown(self.prefix)

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"bridge": self.bridge, "hosts": [asdict(h) for h in self.hosts]}
        (STATE_DIR / f"{self.prefix}.json").write_text(json.dumps(state))

    # -- links and faults --------------------------------------------------------------------------------
    def shape(self, host: Host, link: LinkShape) -> None:
        """Shape `host`'s link (replacing any earlier shape; LinkShape() clears it)."""
        from kvferry.deploy import linkdelay

        _stop_delay(host)
        inner = ("ip", "netns", "exec", host.netns)
        pin = ("taskset", "-c", host.cpus) if host.cpus else ()
        for dev, where in ((host.veth, ()), ("eth0", inner)):
            _sh(*where, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if link.rate_mbit:
                rate = link.rate_mbit * 1e6 / 8  # bytes/s
                burst = int(max(256 * 1024, rate / 500))  # >= a GSO packet, ~2 ms of the rate
                _sh(
                    *where,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{int(link.rate_mbit)}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "20ms",
                )
        if link.delay_ms or link.loss:
            proc = subprocess.Popen(
                # on the host's cores: a NIC's packet work (softirq) runs on its host too
                [*inner, *pin, *linkdelay.daemon_argv(host.index, link.delay_ms, link.loss, seed=host.index)],
                stdout=subprocess.PIPE,
                text=True,
            )
            host.delay_pid = proc.pid
            if "ready" not in (proc.stdout.readline() or ""):
                raise HostsError(f"host {host.name}: the delay line did not start")
            for argv in linkdelay.iptables_rules("eth0", host.index, ingress=True):
                _sh(*inner, *argv)
        self._save()

    def partition(self, a: Host, b: Host, on: bool = True) -> None:
        """Drop every packet between `a` and `b` (both ways, silently: as a cut link), or heal it."""
        from kvferry.deploy.linkdelay import iptables_binary

        op = "-I" if on else "-D"
        for src, dst in ((a, b), (b, a)):
            for chain, flag in (("OUTPUT", "-d"), ("INPUT", "-s")):
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    src.netns,
                    iptables_binary(),
                    "-w",
                    op,
                    chain,
                    flag,
                    dst.address,
                    "-j",
                    "DROP",
                    check=on,
                )

    def link(self, host: Host, up: bool) -> None:
        """Take `host`'s link down (it vanishes from the network; its processes live on) or up."""
        _sh("ip", "link", "set", host.veth, "up" if up else "down")

    def kill_host(self, host: Host) -> None:
        """Lose `host` whole: SIGKILL to everything in its namespace (the holder too), link down."""
        self.link(host, False)
        for pid in {*host.pids, *host.netns_pids()}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _kept_under_tmp() -> list[Path]:
    """This checkout and the Python environment, where they sit under /tmp (hosts' /tmp is private)."""
    checkout = Path(__file__).resolve().parents[1]
    found = []
    for path in (checkout, Path(sys.prefix).resolve()):
        if path.is_relative_to("/tmp") and not any(path.is_relative_to(f) for f in found):
            found.append(path)
    return found


def _stop_delay(host: Host) -> None:
    """Stop `host`'s delay line and remove the rules that feed it (packets flow unqueued again)."""
    if host.delay_pid:
        from kvferry.deploy import linkdelay

        for argv in linkdelay.iptables_rules("eth0", host.index, delete=True, ingress=True):
            _sh("ip", "netns", "exec", host.netns, *argv, check=False)
        with contextlib.suppress(ProcessLookupError):
            os.kill(host.delay_pid, signal.SIGTERM)
        _wait_gone([host.delay_pid], 3.0)
        host.delay_pid = 0


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Reap/wait until `pids` are gone; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        for pid in list(alive):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    alive.remove(pid)
                    continue
            if not Path(f"/proc/{pid}").exists():
                alive.remove(pid)
        if alive:
            time.sleep(0.05)
    return alive


def teardown(prefix: str) -> None:
    """Remove everything a TestHosts with `prefix` made (by its state file), even half-made."""
    path = STATE_DIR / f"{prefix}.json"
    if not path.exists():
        return
    state = json.loads(path.read_text())
    pids: set[int] = set()
    for h in state["hosts"]:
        out = _sh("ip", "netns", "pids", h["netns"], check=False).stdout.split()
        pids |= {int(p) for p in out if p.isdigit()}
        pids |= {p for p in (h["holder"], h.get("delay_pid", 0), *h["pids"]) if p}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        pids = set(_wait_gone(sorted(pids), 5.0))
    for h in state["hosts"]:
        _sh("ip", "link", "del", h["veth"], check=False)
        _sh("ip", "netns", "del", h["netns"], check=False)
    _sh("ip", "link", "del", state["bridge"], check=False)
    path.unlink(missing_ok=True)


def load(prefix: str) -> TestHosts:
    """The TestHosts a `up` (this process or the CLI) made with `prefix`."""
    path = STATE_DIR / f"{prefix}.json"
    if not path.exists():
        raise HostsError(f"no emulated hosts with prefix {prefix!r} (no {path})")
    state = json.loads(path.read_text())
    hosts = TestHosts(
        len(state["hosts"]),
        [h["cpus"] for h in state["hosts"]],
        prefix,
        int(state["hosts"][0]["address"].split(".")[2]),
    )
    hosts.hosts = [Host(**h) for h in state["hosts"]]
    return hosts


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m kvferry.deploy.testhosts", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--prefix", default="kvh")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="make the hosts (they stay until `down`)")
    u.add_argument("--hosts", type=int, default=2)
    u.add_argument("--cpus", default="", help="comma-separated taskset list per host, e.g. 0,1")
    u.add_argument("--subnet", type=int, default=0)
    sub.add_parser("down", help="remove every process, namespace, veth and the bridge")
    sub.add_parser("status")
    e = sub.add_parser("exec", help="run a command on a host (foreground)")
    e.add_argument("--host", type=int, required=True)
    e.add_argument("argv", nargs=argparse.REMAINDER)
    s = sub.add_parser("shape", help="shape a host's link")
    s.add_argument("--host", type=int, required=True)
    s.add_argument("--rate-mbit", type=float, default=0.0)
    s.add_argument("--delay-ms", type=float, default=0.0)
    s.add_argument("--loss", type=float, default=0.0)
    args = p.parse_args(argv)
    if args.cmd == "up":
        cpus = args.cpus.split(",") if args.cpus else None
        hosts = TestHosts(args.hosts, cpus, args.prefix, args.subnet).up()
        for h in hosts.hosts:
            print(f"{h.name} {h.address} cpus={h.cpus or 'all'} netns={h.netns}")
        return 0
    if args.cmd == "down":
        teardown(args.prefix)
        return 0
    hosts = load(args.prefix)
    if args.cmd == "status":
        for h in hosts.hosts:
            tx, rx = h.counters()
            print(
                f"{h.name} {h.address} cpus={h.cpus or 'all'} processes={len(h.netns_pids())} tx={tx} rx={rx}"
            )
        return 0
    host = hosts[args.host]
    if args.cmd == "exec":
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return subprocess.call(host.wrap(cmd))
    hosts.shape(host, LinkShape(args.rate_mbit, args.delay_ms, args.loss))
    return 0


if __name__ == "__main__":
    sys.exit(main())
