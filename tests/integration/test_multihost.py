"""kvferry across emulated hosts (`kvferry.deploy.testhosts`): Ray on three hosts, `kvferry up --ray`.

Host A (head, both cores) runs Ray's head, the controller, the router, redis-server and a prefill
group; host B (core 0) a prefill group; host C (core 1) the decode group; each host a pool node. Every
host has its own address in 198.18.6.0/24, its own /dev/shm and /tmp, and Ray's token authentication is
on. Groups are pinned to hosts by custom Ray resources (`prefill_host`, `decode_host`), so every prefill
runs on another host than the decode: each request's KV must cross a link, and the links' byte counters
show it did. Host D joins later as a standby node (the host-loss test).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import tempfile
import threading
import time
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from cluster_helpers import Members, assert_released, wait_for
from test_cluster import greedy, random_prompt

from kvferry.auth import TLS_ENVS
from kvferry.deploy import testhosts
from kvferry.deploy.testhosts import LinkShape
from kvferry.deploy.testray import RayNode, RayOnHosts
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import BlockLayout
from kvferry.model.config import ModelConfig
from kvferry.model.create import create_model
from kvferry.router.client import Client

pytestmark = [
    pytest.mark.slow,
    # the module's cluster (Ray on three hosts, ~95 s) starts in whichever test runs first; the longest
    # test, the soak, takes ~130 s on 2 busy cores
    pytest.mark.timeout(600),
    pytest.mark.skipif(testhosts.unavailable() is not None, reason=str(testhosts.unavailable())),
]

needs_iptables = pytest.mark.skipif(
    shutil.which("iptables-legacy") is None and shutil.which("iptables") is None,
    reason="partitions, delay and loss need iptables (apt-get install iptables)",
)
NAMESPACE = "mh"
NEW_TOKENS = 12
SECRET = "multihost-test-secret"
A, B, C, D = 1, 2, 3, 4


@pytest.fixture(scope="module")
def shared():
    """A directory every host sees (each has its own /tmp): the model, the kvferry cache, logs."""
    path = Path(tempfile.mkdtemp(prefix="kvferry-mh-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def hosts():
    with testhosts.TestHosts(4, ["0-1", "0", "1", "0-1"], prefix="kvmh", subnet=6) as made:
        yield made


@pytest.fixture(scope="module")
def mh(hosts, shared):
    """The cluster: Ray on A, B, C; `kvferry up --ray --detach` from A; torn down after the module. This
    process gets the cluster secret and an operator's certificate for the module only."""
    model = create_model("tiny", shared / "models" / "tiny")
    config = {
        "model": str(model),
        "dtype": "float32",
        "namespace": NAMESPACE,
        "cluster_secret": SECRET,
        "router": {"host": "0.0.0.0", "port": 50051, "http_port": 0, "routing": "least-load"},
        # a pull from a host that went silent gives up after 4 s (the partition test lasts 10 s)
        "pool": {"per_ray_node": True, "memory_gib": 0.1, "transfer_timeout_s": 4.0},
        "prefill": {
            "replicas": 2,
            "max_model_len": 1024,
            "num_kv_blocks": 512,
            "resources": {"CPU": 1, "prefill_host": 1},
        },
        "decode": {
            "replicas": 1,
            "max_model_len": 1024,
            "num_kv_blocks": 512,
            "resources": {"CPU": 1, "decode_host": 1},
        },
        "ray": {"max_restarts": 3, "log_dir": str(shared / "logs")},
        "drain_timeout_s": 30,
    }
    (shared / "cluster.yaml").write_text(yaml.safe_dump(config))
    ray = RayOnHosts(hosts, shared, head=A)
    env = pytest.MonkeyPatch()
    env.setenv("KVFERRY_CLUSTER_SECRET", SECRET)  # this process's stubs of the workers
    try:
        ray.start(
            {
                A: RayNode(2, {"prefill_host": 1}),
                B: RayNode(2, {"prefill_host": 1}),
                C: RayNode(2, {"decode_host": 1}),
            }
        )
        router = ray.kvferry_up(shared / "cluster.yaml")
        redis_url = ray.controller(NAMESPACE, "full_redis_url")
        tls = ray.controller(NAMESPACE, "operator_tls")  # internal TLS is on under Ray
        assert set(tls) == set(TLS_ENVS)
        for name, value in tls.items():
            env.setenv(name, value)
        members = registered_members(redis_url)
        with Client(router) as client:
            yield types.SimpleNamespace(
                ray=ray, router=router, redis_url=redis_url, client=client, members=members, model=model
            )
        members.close()
        ray.kvferry("down", "--ray", "--namespace", NAMESPACE, check=False)
    finally:
        ray.stop()
        env.undo()


@pytest.fixture(scope="module")
def cases(mh, hf_greedy):
    """Prompts (40-160 tokens) and their transformers greedy continuations."""
    prompts = [random_prompt(500 + i, 40 + 15 * i) for i in range(8)]
    return list(zip(prompts, hf_greedy(mh.model, prompts, NEW_TOKENS), strict=True))


@dataclass
class Tally:
    """Outcomes of a run of requests: correct, failed cleanly (by status code), wrong tokens, hung."""

    correct: int = 0
    failed: Counter = field(default_factory=Counter)
    wrong: int = 0
    hung: int = 0
    ids: list = field(default_factory=list, repr=False)

    @property
    def sent(self) -> int:
        return self.correct + sum(self.failed.values()) + self.wrong + self.hung


def drive(
    client,
    cases,
    seconds: float,
    tally: Tally | None = None,
    concurrency=3,
    timeout=60.0,
    pace_s=0.0,
    tokens=NEW_TOKENS,
):
    """Send the cases round robin from `concurrency` threads for `seconds` (or until each was sent once,
    with `pace_s` > 0: a thread then sends one request per `pace_s`), counting into `tally`; every
    request asks for `tokens` new tokens and has a deadline of `timeout` (one that passes it hung)."""
    import threading

    import grpc

    tally, lock, end = tally or Tally(), threading.Lock(), time.monotonic() + seconds

    def loop(worker: int) -> None:
        for n in itertools.count(worker, concurrency):
            if time.monotonic() > end or (pace_s and n >= len(cases)):
                return
            sent = time.monotonic()
            prompt, expected = cases[n % len(cases)]
            try:
                got = client.generate(greedy(prompt, tokens), timeout=timeout)
            except grpc.RpcError as err:
                with lock:
                    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        tally.hung += 1
                    else:
                        tally.failed[err.code().name] += 1
                continue
            with lock:
                tally.ids.append(got.request_id)
                if got.token_ids == expected:
                    tally.correct += 1
                else:
                    tally.wrong += 1
            time.sleep(max(0.0, sent + pace_s - time.monotonic()))  # the load's pace, not a wait

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(loop, range(concurrency)))
    return tally


def registered_members(redis_url: str) -> Members:
    """Stubs of the members registered now in the cluster's Redis (every role has some here)."""
    return Members(types.SimpleNamespace(redis_url=redis_url, cfg=types.SimpleNamespace(namespace=NAMESPACE)))


def fresh_members(mh) -> Members:
    """Stubs of the members registered now (after a fault: the dead ones have left the registry)."""
    return registered_members(mh.redis_url)


def all_correct(mh, cases) -> list[str]:
    got = [mh.client.generate(greedy(p, NEW_TOKENS), timeout=60) for p, _ in cases]
    assert [g.token_ids for g in got] == [e for _, e in cases]
    return [g.request_id for g in got]


def kv_bytes(model: Path, prompt_tokens: int) -> int:
    """Bytes of the KV of a prompt's blocks (full ones and the private tail), float32."""
    cfg = ModelConfig.from_dir(model)
    layout = BlockLayout(cfg.num_layers, cfg.num_kv_heads, 16, cfg.head_dim, "float32")
    return -(-prompt_tokens // 16) * layout.block_bytes


def listening(hosts, indexes) -> list[tuple[str, str]]:
    """(local address, owner's command line) of every listening TCP socket of a kvferry process (or its
    redis-server) on the hosts: sockets matched to their processes by inode."""
    import socket
    import struct

    out = []
    for i in indexes:
        owners = {}
        for pid in hosts[i].netns_pids():
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if "kvferry" not in cmd and "redis-server" not in cmd:
                    continue
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        owners[link[8:-1]] = cmd
        pid = hosts[i].netns_pids()[0]
        for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] != "0A" or fields[9] not in owners:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(fields[1].split(":")[0])
                words = struct.unpack(f"<{len(raw) // 4}I", raw)  # /proc prints each 32-bit word host-endian
                address = ipaddress.ip_address(
                    socket.inet_ntop(family, struct.pack(f">{len(words)}I", *words))
                )
                address = getattr(address, "ipv4_mapped", None) or address  # ::ffff:a.b.c.d is a.b.c.d
                out.append((str(address), owners[fields[9]]))
    return out


def test_groups_land_on_their_hosts_and_nothing_advertises_loopback(mh, hosts):
    status = mh.ray.controller(NAMESPACE, "status")
    ips = {u["name"]: {r["ip"] for r in u["ranks"]} for u in status["units"]}
    roles = {u["name"]: u["role"] for u in status["units"]}
    on = lambda role: set().union(*(ips[n] for n in ips if roles[n] == role))  # noqa: E731
    assert on("prefill") == {hosts[A].address, hosts[B].address}
    assert on("decode") == {hosts[C].address}
    assert on("pool") == {hosts[A].address, hosts[B].address, hosts[C].address}  # one per Ray node
    assert on("router") == on("redis") == {hosts[A].address}
    sockets = listening(hosts, (A, B, C))
    assert len(sockets) >= 8, sockets  # router, redis, 2 prefill + 1 decode worker, 3 pool nodes at least
    for address, owner in sockets:
        if "router" in owner:
            assert address in ("0.0.0.0", "::", hosts[A].address), (address, owner)  # 0.0.0.0 in the file
        else:
            assert address in {h.address for h in hosts.hosts}, f"{owner} listens on {address}"
    meta = MetadataStore(mh.redis_url, NAMESPACE)
    for role in ("prefill", "decode", "pool"):
        for member, info in meta.members(role).items():
            host = info["addr"].rsplit(":", 1)[0]
            assert not ipaddress.ip_address(host).is_loopback, f"{role} {member} advertises {info['addr']}"
            assert host in {h.address for h in hosts.hosts}, f"{role} {member} advertises {info['addr']}"


def test_greedy_equals_transformers_and_the_kv_crosses_the_links(mh, hosts, hf_greedy):
    prompts = [random_prompt(100 + i, n) for i, n in enumerate((40, 97, 160, 250, 64, 129))]
    expected = hf_greedy(mh.model, prompts, NEW_TOKENS)
    before = {i: hosts[i].counters() for i in (A, B, C)}
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: mh.client.generate(greedy(p, NEW_TOKENS), timeout=120), prompts))
    after = {i: hosts[i].counters() for i in (A, B, C)}
    assert [g.token_ids for g in got] == expected
    kv = sum(kv_bytes(mh.model, len(p)) for p in prompts)
    received_c = after[C][1] - before[C][1]
    assert received_c >= kv, f"the decode host received {received_c} B over its link, the KV is {kv} B"
    put_in = sum(after[i][1] - before[i][1] for i in (A, B))
    # the prefill hosts wrote their KV into their own host's pool node through its shared slab
    assert put_in < kv / 2, f"{put_in} B went into the prefill hosts for {kv} B of KV"
    assert_released(mh.members, [g.request_id for g in got])


def test_a_prefix_prefilled_on_one_host_is_reused_on_another_through_the_pool(mh, hf_greedy):
    prompt = random_prompt(7, 96)
    expected = hf_greedy(mh.model, [prompt], NEW_TOKENS)[0]
    first = mh.client.generate(greedy(prompt, NEW_TOKENS), timeout=60)
    assert first.token_ids == expected
    # least-load routing: two at once go one to each prefill host, so one of them is on the host
    # that did not prefill it and must pull the prefix from the other host's pool node
    with ThreadPoolExecutor(2) as pool:
        again = list(pool.map(lambda _: mh.client.generate(greedy(prompt, NEW_TOKENS), timeout=60), range(2)))
    assert [a.token_ids for a in again] == [expected, expected]
    assert max(a.finished.pool_cached_tokens for a in again) >= 80, [a.finished for a in again]
    assert_released(mh.members, [a.request_id for a in (first, *again)])


def capture(stop) -> bytes:
    """Every frame on every interface of this (the observer's) namespace until `stop` is set: each
    host's link ends here (a bridge device itself sees only what is addressed to it)."""
    import socket

    frames = []
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)) as sniffer:  # ETH_P_ALL
        sniffer.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                frames.append(sniffer.recv(1 << 16))
    return frames


def flow(frame: bytes) -> str:
    """ "src:port -> dst:port" of an Ethernet/IPv4/TCP frame."""
    import socket
    import struct

    ip = frame[14:]
    ports = struct.unpack("!HH", ip[(ip[0] & 15) * 4 :][:4])
    return f"{socket.inet_ntoa(ip[12:16])}:{ports[0]} -> {socket.inet_ntoa(ip[16:20])}:{ports[1]}"


def test_the_internal_plane_is_mutual_tls_and_the_secret_never_crosses_in_clear(mh, hosts):
    import threading

    import grpc

    from kvferry.deploy.cluster_ca import ClusterCA
    from kvferry.v1 import worker_pb2, worker_pb2_grpc

    stop = threading.Event()
    with ThreadPoolExecutor(1) as sniffing:
        wire = sniffing.submit(capture, stop)
        for seed in range(3):
            assert mh.client.generate(greedy(random_prompt(300 + seed, 48), NEW_TOKENS), timeout=60).token_ids
        stop.set()
        frames = wire.result(timeout=10)
    redis_port, password = urlparse(mh.redis_url).port, urlparse(mh.redis_url).password
    assert mh.redis_url.startswith("rediss://")
    to_redis = [f for f in frames if f[12:14] == b"\x08\x00" and f[23] == 6 and f":{redis_port}" in flow(f)]
    assert to_redis  # the capture works: it saw the registry's traffic with Redis...
    assert not any(f"kvf:{NAMESPACE}:".encode() in f for f in frames)  # ...and no key of it in clear
    clear = sorted({flow(f) for f in frames if SECRET.encode() in f or password.encode() in f})
    assert not clear, f"the cluster secret or Redis's password crossed a link in clear: {clear}"

    decode = next(iter(MetadataStore(mh.redis_url, NAMESPACE).members("decode").values()))["addr"]
    secret = (("x-kvferry-secret", SECRET),)
    other = ClusterCA.create().issue()  # a certificate, but not from this cluster's CA
    for name, creds in (
        ("plaintext", None),
        ("TLS, no certificate", grpc.ssl_channel_credentials(root_certificates=other.ca)),
        ("another CA", grpc.ssl_channel_credentials(other.ca, other.key, other.cert)),
    ):
        options = [("grpc.ssl_target_name_override", "kvferry-cluster")]
        with (
            grpc.insecure_channel(decode) if creds is None else grpc.secure_channel(decode, creds, options)
        ) as ch:
            with pytest.raises(grpc.RpcError) as refused:
                worker_pb2_grpc.DecodeWorkerStub(ch).GetStats(
                    worker_pb2.WorkerStatsRequest(), timeout=5, metadata=secret
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, name
    assert mh.members.stats("decode")  # with the cluster's certificate (the operator's): served


@needs_iptables
def test_a_partition_between_the_decode_host_and_a_pool_host_heals(mh, hosts, cases, hf_greedy):
    """10 s with no packet between C (decode) and B (a prefill worker and the pool node it writes to):
    the decode worker cannot pull that KV, so it waits for the heal or recomputes it (or the request
    fails cleanly); nothing is wrong, nothing waits past its deadline, and after the heal every request
    is served again. Every prompt is new (a repeated one hits caches and hot copies, not B's node)."""
    prompts = [random_prompt(10_000 + i, 33 + i % 48) for i in range(200)]
    fresh = list(zip(prompts, hf_greedy(mh.model, prompts, NEW_TOKENS), strict=True))

    def recomputed() -> int:
        return sum(s.recomputed_tokens for s in mh.members.stats("decode").values())

    with ThreadPoolExecutor(1) as load:
        tally = Tally()
        running = load.submit(drive, mh.client, fresh, 30.0, tally, 4, 60.0, 0.3)
        wait_for(lambda: tally.correct >= 3, 30, "the load to be under way")
        before = recomputed()
        hosts.partition(hosts[C], hosts[B])
        try:
            time.sleep(10.0)  # the partition lasts 10 s
        finally:
            hosts.partition(hosts[C], hosts[B], on=False)
        during = recomputed() - before
        tally = running.result(timeout=120)
    print("partition:", tally, "tokens the decode worker recomputed:", during)
    assert tally.wrong == 0 and tally.hung == 0, tally
    assert tally.correct >= tally.sent // 2, tally
    # the decode worker's pulls from B's node timed out (4 s) and it recomputed those prompts
    assert during > 0, "the partition never kept the decode worker from a pool node"
    ids = all_correct(mh, cases)
    members = fresh_members(mh)
    try:
        assert_released(members, tally.ids + ids)
    finally:
        members.close()


@needs_iptables
def test_one_percent_loss_and_5ms_delay_on_every_link(mh, hosts, cases):
    for i in (A, B, C):
        hosts.shape(hosts[i], LinkShape(delay_ms=5, loss=0.01))
    try:
        tally = drive(mh.client, cases, 40.0)
    finally:
        for i in (A, B, C):
            hosts.shape(hosts[i], LinkShape())
    print("loss and delay:", tally)
    assert tally.sent >= 20 and tally.correct == tally.sent, tally
    assert_released(mh.members, tally.ids)


def processes(hosts, indexes) -> dict[int, dict]:
    """pid -> its open descriptors, sockets, threads and RSS, for every kvferry process on the hosts."""
    out = {}
    for i in indexes:
        for pid in hosts[i].netns_pids():
            with contextlib.suppress(OSError):
                if b"kvferry" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
                out[pid] = {
                    "host": hosts[i].name,
                    "fds": len(fds),
                    "sockets": sum(f.startswith("socket:") for f in fds),
                    "threads": len(os.listdir(f"/proc/{pid}/task")),
                    "rss_mb": int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096 >> 20,
                }
    return out


def time_wait(hosts, indexes) -> dict[str, int]:
    """TCP sockets in TIME_WAIT in each host's network namespace (ephemeral ports held)."""
    out = {}
    for i in indexes:
        pids = hosts[i].netns_pids()
        rows = Path(f"/proc/{pids[0]}/net/tcp").read_text().splitlines()[1:] if pids else []
        out[hosts[i].name] = sum(row.split()[3] == "06" for row in rows)
    return out


def poisson(
    client,
    cases,
    rate: float,
    seconds: float,
    tally: Tally,
    threads: int = 48,
    seed: int = 26,
    tokens=NEW_TOKENS,
) -> None:
    """Open-loop Poisson arrivals at `rate` per second for `seconds` (seeded), each of `tokens` new tokens
    and checked; returns when every request has its answer."""
    import random

    import grpc

    rng, lock = random.Random(seed), threading.Lock()

    def one(n: int) -> None:
        prompt, expected = cases[n % len(cases)]
        try:
            got = client.generate(greedy(prompt, tokens), timeout=60)
        except grpc.RpcError as err:
            with lock:
                key = "hung" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else None
                if key:
                    tally.hung += 1
                else:
                    tally.failed[err.code().name] += 1
            return
        with lock:
            tally.correct += got.token_ids == expected
            tally.wrong += got.token_ids != expected

    start = time.monotonic()
    at = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for n in itertools.count():
            at += rng.expovariate(rate)
            if at > seconds:
                break
            time.sleep(max(0.0, start + at - time.monotonic()))  # the next arrival (open loop)
            pool.submit(one, n)


SOAK_NEW_TOKENS = 4  # short requests: the most requests (connections, streams, KV hand-offs) a second
SOAK_ROUND_S = 15.0  # counts are sampled after each round of the soak
SOAK_SLACK = 8  # descriptors, sockets or threads a process may add over its count after the warm-up
SOAK_PLATEAU = 2  # ... and over its first half's highest count by the end


def test_a_long_run_at_80_percent_of_capacity_grows_no_sockets_threads_or_descriptors(mh, hosts, hf_greedy):
    """The ephemeral-port class of failure: a connection, stream, descriptor or thread per request that is
    never released (descriptors and TIME_WAIT sockets pile up until a host runs out of ports or files).

    Poisson arrivals at 80% of the rate the cluster sustains closed-loop, of short requests
    (SOAK_NEW_TOKENS new tokens: the most requests, each a full prefill, KV hand-off across hosts and
    decode, a second) for KVFERRY_SOAK_S (60) seconds, in rounds of SOAK_ROUND_S. After the warm-up and
    after every round (each request of it answered, the decode drained) every kvferry process's
    descriptors, sockets and threads and each host's TIME_WAIT sockets are sampled, so the counts are a
    trend over the run, not two points: at no sample more than SOAK_SLACK over the count after the
    warm-up (TIME_WAIT: 64), at the end no more than SOAK_PLATEAU over the highest of the first half (a
    pool that grows to its size has stopped by then; a leak keeps rising), and no count that rose
    round after round; no process gone or new; every request correct. TIME_WAIT sockets last 60 s, so
    a run of 60 s or more after the warm-up holds a per-request connection's full pile-up. (Before:
    one 600 s run at 12 new tokens, compared at its two ends.)"""
    seconds = float(os.environ.get("KVFERRY_SOAK_S", "60"))
    prompts = [random_prompt(20_000 + i, 24 + i % 64) for i in range(64)]
    soak_cases = list(zip(prompts, hf_greedy(mh.model, prompts, SOAK_NEW_TOKENS), strict=True))
    closed = drive(mh.client, soak_cases, 10.0, concurrency=8, tokens=SOAK_NEW_TOKENS)
    assert closed.correct == closed.sent, closed
    rate = 0.8 * closed.sent / 10.0
    warm = Tally()
    poisson(mh.client, soak_cases, rate, 20.0, warm, tokens=SOAK_NEW_TOKENS)

    def drained() -> None:
        wait_for(
            lambda: all(s.running == 0 for s in mh.members.stats("decode").values()),
            30,
            "the decode to drain",
        )

    drained()
    samples = [(processes(hosts, (A, B, C)), time_wait(hosts, (A, B, C)))]
    tally = Tally()
    rounds = max(2, round(seconds / SOAK_ROUND_S))
    for r in range(rounds):
        poisson(mh.client, soak_cases, rate, seconds / rounds, tally, seed=26 + r, tokens=SOAK_NEW_TOKENS)
        drained()
        samples.append((processes(hosts, (A, B, C)), time_wait(hosts, (A, B, C))))
    before, waits_before = samples[0]
    waits_after = samples[-1][1]
    print(f"soak: {rate:.1f} req/s for {seconds:.0f} s in {rounds} rounds: {tally}")
    print("  TIME_WAIT:", " -> ".join(str(w) for _, w in samples))
    for pid, b in sorted(before.items()):
        print(
            f"  {b['host']} pid {pid}: "
            + ", ".join(
                f"{k} " + " -> ".join(str(p[pid][k]) if pid in p else "gone" for p, _ in samples)
                for k in b
                if k != "host"
            )
        )
    assert tally.wrong == 0 and tally.hung == 0 and not tally.failed and warm.correct == warm.sent, tally
    assert tally.sent >= rate * seconds / 2, (tally, rate)
    for procs, _ in samples:
        assert set(procs) == set(before), "a kvferry process died or appeared during the soak"
    half = len(samples) // 2
    for pid in before:
        for key in ("fds", "sockets", "threads"):
            trend = [p[pid][key] for p, _ in samples]
            assert max(trend) <= trend[0] + SOAK_SLACK, (before[pid]["host"], pid, key, trend)
            assert trend[-1] <= max(trend[: half + 1]) + SOAK_PLATEAU, (before[pid]["host"], pid, key, trend)
            rises = [b > a for a, b in itertools.pairwise(trend)]
            assert not all(rises), (before[pid]["host"], pid, key, trend)
    for host in waits_before:
        trend = [w[host] for _, w in samples]
        assert max(trend) <= trend[0] + 64, (host, trend)
    assert all(waits_after[h] <= waits_before[h] + 64 for h in waits_after), (waits_before, waits_after)


def test_a_lost_host_is_replaced_by_ray_and_requests_fail_over(mh, hosts, cases):
    """Host B (a prefill group, a pool node) is lost whole while serving: its processes die and its
    link goes down. Requests fail over to the prefill on A (none wrong, none hung); Ray restarts B's
    group on host D, a standby node; afterwards every request is correct and nothing is leaked."""
    mh.ray.start({D: RayNode(2, {"prefill_host": 1, "decode_host": 1})})

    def prefill_on(address: str) -> bool:
        status = mh.ray.controller(NAMESPACE, "status")
        return any(
            u["role"] == "prefill" and u["state"] == "running" and {r["ip"] for r in u["ranks"]} == {address}
            for u in status["units"]
        )

    with ThreadPoolExecutor(1) as load:
        tally = Tally()
        running = load.submit(drive, mh.client, cases, 20.0, tally)
        wait_for(lambda: tally.correct >= 3, 30, "the load to be under way")
        hosts.kill_host(hosts[B])
        tally = running.result(timeout=120)
    print("host lost:", tally)
    assert tally.wrong == 0 and tally.hung == 0, tally
    wait_for(lambda: prefill_on(hosts[D].address), 240, "Ray to restart B's prefill group on host D")
    meta = MetadataStore(mh.redis_url, NAMESPACE)

    def registered() -> set[str]:  # the hosts of the registered prefill workers and pool nodes
        members = {**meta.members("prefill"), **meta.members("pool")}
        return {info["addr"].rsplit(":", 1)[0] for info in members.values()}

    survivors = {hosts[i].address for i in (A, C, D)}
    wait_for(lambda: registered() == survivors, 60, "B's members to leave and D's to register")
    members = fresh_members(mh)
    try:
        ids = all_correct(mh, cases)
        assert_released(members, tally.ids + ids)
    finally:
        members.close()
