"""A `LocalCluster` under attack and faults: the internal plane refuses callers without the cluster
secret, the launched redis refuses clients without its password, internal servers bind the cluster
host only, and a worker or redis killed with SIGKILL comes back and the cluster serves again."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
from pathlib import Path

import grpc
import pytest
import redis
from cluster_helpers import make_cluster_config, wait_for

from kvferry import rpc
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import build_request
from kvferry.v1 import generate_pb2, generate_pb2_grpc, pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

CLUSTER_HOST = "127.0.0.2"  # loopback too, but not the router's 127.0.0.1: shows who binds what


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    """A cluster whose redis the launcher starts (no redis_url), on a separate cluster host."""
    cfg = make_cluster_config(tiny_model_dir, None, "restarts", cluster_host=CLUSTER_HOST)
    with LocalCluster(cfg, log_dir=tmp_path_factory.mktemp("restart-logs"), quiet=True) as cluster:
        yield cluster


def generate(addr: str, max_tokens: int = 8) -> int:
    """Output tokens of one greedy request (on a kvferry channel: it carries the cluster secret)."""
    with rpc.channel(addr) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        request = build_request("def fibonacci(n):", max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        replies = list(stub.Generate(request, timeout=60))
    return replies[-1].finished.output_tokens


def serves(addr: str) -> bool:
    try:
        return generate(addr) == 8
    except grpc.RpcError:
        return False


def child(cluster: LocalCluster, name: str):
    return next(c for c in cluster.children if c.name == name)


def redis_port(cluster: LocalCluster) -> int:
    return int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])


def stats_call(addr: str, role: str, channel: grpc.Channel):
    if role == "pool":
        return pool_pb2_grpc.KVPoolStub(channel).GetStats(pool_pb2.PoolStatsRequest(), timeout=10)
    cls = worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
    return cls(channel).GetStats(worker_pb2.WorkerStatsRequest(), timeout=10)


def test_internal_plane_refuses_calls_without_the_cluster_secret(launched):
    assert os.environ["KVFERRY_CLUSTER_SECRET"] == launched.secret  # the launcher's own clients use it
    meta = MetadataStore(launched.redis_url, launched.cfg.namespace)
    for role in ("prefill", "decode", "pool"):
        members = wait_for(lambda r=role: meta.members(r), what=f"{role} registry")
        for info in members.values():
            assert info["addr"].startswith(f"{CLUSTER_HOST}:"), info  # bound to the cluster host
            with grpc.insecure_channel(info["addr"]) as bare, pytest.raises(grpc.RpcError) as refused:
                stats_call(info["addr"], role, bare)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with rpc.channel(info["addr"]) as ch:
                stats_call(info["addr"], role, ch)
    assert launched.router_addr.startswith("127.0.0.1:")
    with rpc.channel(launched.router_addr) as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(
            generate_pb2.GetModelInfoRequest(), timeout=10
        )
    assert (info.num_prefill_workers, info.num_decode_workers, info.num_pool_nodes) == (1, 1, 1)
    for c in launched.children:  # the secret travels in the environment only
        cmdline = Path(f"/proc/{c.proc.pid}/cmdline").read_bytes()
        assert launched.secret.encode() not in cmdline, c.name
    for name in ("cluster-secret", "redis-url", "redis.conf"):
        assert stat.S_IMODE((launched.log_dir / name).stat().st_mode) == 0o600


def test_launched_redis_asks_for_its_password(launched):
    password = launched.redis_url.split("://:", 1)[1].split("@", 1)[0]
    assert len(password) >= 32
    with pytest.raises(redis.AuthenticationError):  # NOAUTH
        redis.Redis(host=CLUSTER_HOST, port=redis_port(launched), socket_timeout=5).ping()
    assert redis.Redis.from_url(launched.redis_url, socket_timeout=5).ping()
    for unit in launched.children:  # what `ps` shows any user: no command line carries the password
        assert password.encode() not in Path(f"/proc/{unit.proc.pid}/cmdline").read_bytes(), unit.name
    assert len(launched.children) >= 5  # redis, a pool node, the workers and the router were all checked
    with pytest.raises(redis.ConnectionError):  # bound to the cluster host, not every address
        redis.Redis(host="127.0.0.1", port=redis_port(launched), socket_timeout=5).ping()
    assert serves(launched.router_addr)


def test_a_killed_decode_worker_comes_back_and_serves(launched):
    decode = child(launched, "decode-0")
    old = decode.proc.pid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: decode.proc.pid != old and decode.state == "running", 30, "decode-0 restarted")
    assert any("decode-0 restarted" in e for e in launched.events)
    wait_for(lambda: serves(launched.router_addr), 120, "the cluster to serve with the restarted worker")


def test_a_killed_redis_comes_back_with_its_password_and_the_cluster_serves(launched):
    server = child(launched, "redis")
    old = server.proc.pid
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: server.proc.pid != old and server.state == "running", 30, "redis restarted")
    client = redis.Redis.from_url(launched.redis_url, socket_timeout=5)
    wait_for(lambda: _pings(client), 30, "the restarted redis to answer with the same password")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=CLUSTER_HOST, port=redis_port(launched), socket_timeout=5).ping()
    meta = MetadataStore(launched.redis_url, launched.cfg.namespace)
    wait_for(lambda: meta.members("decode") and meta.members("prefill"), 30, "heartbeats to re-register")
    wait_for(lambda: serves(launched.router_addr), 120, "the cluster to serve after redis came back")


def _pings(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def listening(pids: dict[int, str]) -> set[str]:
    """`name host:port` of every TCP socket the processes `pids` (pid -> name) listen on (an IPv4-mapped
    IPv6 address shown as IPv4)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        for pid in {int(p) for p in re.findall(r"pid=(\d+)", line)} & set(pids):
            addr = re.sub(r"^\[::ffff:([\d.]+)\]", r"\1", line.split()[3])
            found.add(f"{pids[pid]} {addr}")
    return found


def test_only_the_router_listens_outside_the_cluster_host(launched):
    """Workers, pool nodes (gRPC, gloo) and redis listen on the cluster host; the router
    (gRPC and HTTP) on its own host. No process listens on a wildcard address."""
    pids = {c.proc.pid: c.name for c in launched.children}
    found = listening(pids)
    router = {a for a in found if a.startswith("router ")}
    inner = found - router
    assert len(router) == 2 and all(a.split()[1].startswith("127.0.0.1:") for a in router), router
    assert {a.split()[0] for a in inner} == {"redis", "pool-0", "prefill-0", "decode-0"}, inner
    assert all(a.split()[1].startswith(f"{CLUSTER_HOST}:") for a in inner), inner
