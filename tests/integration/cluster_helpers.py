"""What several integration test modules use: waiting on a condition, the cluster's members, one leak
check, the router's /metrics, HTTP posts, greedy requests and random prompts, a `kvferry up` run as a user
runs it, and the cache of running clusters that test modules share (SharedClusters, conftest's
`cluster_for`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvferry import rpc
from kvferry.deploy.config import ClusterConfig, PoolConfig, RouterConfig, WorkerGroupSettings
from kvferry.deploy.fault_harness import wait_for  # the fault harness's: one condition wait for both
from kvferry.deploy.local import LocalCluster, expected_members
from kvferry.kvpool.metadata import MetadataStore
from kvferry.proc import free_port, terminate
from kvferry.router.client import build_request
from kvferry.v1 import pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

__all__ = [
    "ENGINE",
    "Members",
    "SharedClusters",
    "UpCluster",
    "assert_released",
    "greedy",
    "kvferry_up",
    "make_cluster_config",
    "metric",
    "metrics_text",
    "post",
    "random_prompt",
    "wait_for",
]


# the engine settings of the test clusters' workers
ENGINE = {"max_model_len": 1024, "num_kv_blocks": 512, "max_num_batched_tokens": 512}


def make_cluster_config(model_dir: Path, redis_url: str, namespace: str, **settings) -> ClusterConfig:
    """A test cluster on the session's redis: float32, router (gRPC and HTTP) on any free ports, one
    small pool node, one prefill and one decode worker unless `settings` say otherwise."""
    defaults = {
        "pool": PoolConfig(nodes=1, memory_gib=0.25),
        "prefill": WorkerGroupSettings(replicas=1, engine=ENGINE),
        "decode": WorkerGroupSettings(replicas=1, engine=ENGINE),
        "router": RouterConfig(port=0, http_port=0),
    }
    return ClusterConfig(
        model=str(model_dir),
        dtype="float32",
        namespace=namespace,
        redis_url=redis_url,
        **{**defaults, **settings},
    )


def random_prompt(seed: int, n: int) -> list[int]:
    """`n` token ids of the tiny model's vocabulary, the same for the same seed (a shorter one is a prefix
    of a longer one: modules sharing a cluster use different seeds where they count cache hits)."""
    return torch.randint(3, 8192, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(ids, max_tokens: int = 16, **kw):
    """A greedy GenerateRequest for `ids` that runs to `max_tokens` (no EOS stop)."""
    return build_request(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


class Members:
    """gRPC stubs of the cluster's workers and pool nodes, found in its Redis registry (a role the cluster
    has none of, e.g. prefill and pool of a colocated one, has no stubs)."""

    def __init__(self, cluster):
        meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
        if isinstance(cluster.cfg, ClusterConfig):
            want = dict(zip(("prefill", "decode", "pool"), expected_members(cluster.cfg), strict=True))
        else:  # no ClusterConfig (just a namespace): every role has members
            want = {"prefill": 1, "decode": 1, "pool": 1}
        self.channels = []
        self.prefill = self._stubs(meta, "prefill", worker_pb2_grpc.PrefillWorkerStub, want["prefill"])
        self.decode = self._stubs(meta, "decode", worker_pb2_grpc.DecodeWorkerStub, want["decode"])
        self.pool = self._stubs(meta, "pool", pool_pb2_grpc.KVPoolStub, want["pool"])

    def _stubs(self, meta, role, cls, want: int):
        if want == 0:
            return {}
        members = wait_for(lambda: meta.members(role), what=f"{role} registry")
        out = {}
        for member_id, info in sorted(members.items()):
            channel = rpc.channel(info["addr"])
            self.channels.append(channel)
            out[member_id] = cls(channel)
        return out

    def stats(self, role):
        stubs = getattr(self, role)
        request = pool_pb2.PoolStatsRequest() if role == "pool" else worker_pb2.WorkerStatsRequest()
        return {k: s.GetStats(request, timeout=10) for k, s in stubs.items()}

    def close(self):
        for channel in self.channels:
            channel.close()


def assert_released(members: Members, request_ids=None, timeout: float = 30):
    """The leak check: no worker or pool node holds anything for these requests (None: for any request;
    then nothing may be running or waiting either), and no KV block is leaked (every decode worker's
    blocks free, no private pool block)."""

    def clean():
        for s in members.stats("decode").values():
            if s.free_blocks != s.total_blocks:
                return False
            if request_ids is None and (s.active_request_ids or s.running or s.waiting):
                return False
            if request_ids is not None and set(s.active_request_ids) & set(request_ids):
                return False
        for p in members.stats("pool").values():
            if p.private_blocks or (set(p.leases) & set(request_ids or ())):
                return False
        return True

    wait_for(clean, timeout, "workers and pool to release the requests")


def _url(target) -> str:
    """A router's HTTP base URL: `target` itself (a str) or its `http_url` (a cluster)."""
    return target if isinstance(target, str) else target.http_url


def metrics_text(target) -> str:
    """The router's /metrics page (`target`: a cluster or the router's HTTP base URL)."""
    with urllib.request.urlopen(_url(target) + "/metrics", timeout=10) as reply:
        return reply.read().decode()


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(target, name: str, **labels) -> float:
    """A series of the router's /metrics summed over the label sets that have `labels` (0 when none has;
    `target`: a cluster or the router's HTTP base URL)."""
    total = 0.0
    for line in metrics_text(target).splitlines():
        if line.startswith(name + "{"):
            have = dict(_LABEL.findall(line[len(name) + 1 : line.rindex("}")]))
        elif line.startswith(name + " "):
            have = {}
        else:
            continue
        if all(have.get(k) == str(v) for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def post(
    url: str, body: dict | bytes, *, timeout: float = 60, with_headers: bool = False, key: str | None = None
):
    """POST `body` (JSON, or bytes as they are) to `url` (with API key `key`): (status, the JSON reply),
    an error status included; (status, headers lower-cased, reply) `with_headers`."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, data, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            status, headers, text = reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as err:
        status, headers, text = err.code, err.headers, err.read()
    out = json.loads(text)
    return (status, {k.lower(): v for k, v in headers.items()}, out) if with_headers else (status, out)


@dataclass
class Started:
    """One cluster SharedClusters started: what for, how long its start took, how often it was handed out."""

    key: str
    namespace: str
    first_user: str
    start_s: float
    uses: int = 1
    taken: bool = False  # handed to a test that consumes it (SharedClusters.take)
    stopped_after: str = ""


@dataclass
class SharedClusters:
    """Running LocalClusters, one per distinct settings, shared by the tests that only read from them.

    `start(settings, namespace)` makes one (a started LocalCluster); `key(settings)` names the settings
    (equal keys: the same cluster). At most `capacity` run at once (the least recently used is stopped
    first); `release(needed)` stops every one whose key is not in `needed` (the hooks in conftest call it
    when the last test declaring a key is done); `close()` stops them all, whatever happened."""

    start: Callable[[dict, str], LocalCluster]
    key: Callable[[dict], str]
    capacity: int = 2
    say: Callable[[str], None] = print
    running: OrderedDict = field(default_factory=OrderedDict)  # key -> (LocalCluster, Started)
    started: list[Started] = field(default_factory=list)
    user: str = ""  # the test being set up (named in the log lines)

    def get(self, **settings) -> LocalCluster:
        """The running cluster for `settings`, started now if none is (or the one there is unwell)."""
        key = self.key(settings)
        if key in self.running:
            cluster, record = self.running[key]
            if self._healthy(cluster, record):
                self.running.move_to_end(key)
                record.uses += 1
                return cluster
        return self._start(key, settings)

    __call__ = get

    @contextlib.contextmanager
    def take(self, **settings) -> Iterator[LocalCluster]:
        """The cluster for `settings` for a test that kills, scales or drains it: the running one (no other
        test gets it afterwards) or a new one; stopped when the block ends."""
        key = self.key(settings)
        cluster = self.get(**settings)
        _, record = self.running.pop(key)
        record.taken = True
        try:
            yield cluster
        finally:
            self._stop(cluster, record, "taken")

    def release(self, needed: set[str]) -> None:
        for key in [k for k in self.running if k not in needed]:
            self._stop(*self.running.pop(key), "no later test declares it")

    def close(self) -> None:
        while self.running:
            _, (cluster, record) = self.running.popitem(last=False)
            self._stop(cluster, record, "session end")

    def _start(self, key: str, settings: dict) -> LocalCluster:
        if key in self.running:
            self._stop(*self.running.pop(key), "unwell")
        while len(self.running) >= self.capacity:
            _, (cluster, record) = self.running.popitem(last=False)
            self._stop(cluster, record, f"least recently used of {self.capacity}")
        namespace = f"shared-{len(self.started) + 1}"
        self.say(f"[cluster_for] starting cluster {namespace} for {self.user}: {_describe(settings)}")
        t0 = time.monotonic()
        cluster = self.start(settings, namespace)
        record = Started(key, namespace, self.user, time.monotonic() - t0)
        self.started.append(record)
        self.running[key] = (cluster, record)
        self.say(f"[cluster_for] {namespace} ready in {record.start_s:.0f}s")
        return cluster

    def _healthy(self, cluster: LocalCluster, record: Started) -> bool:
        """Every process running and the router seeing every member (a test before may have stopped,
        paused or restarted something, or Redis: it re-registers within a heartbeat or two)."""
        try:
            assert all(c.state == "running" and c.proc.poll() is None for c in cluster.children)
            cluster.wait_ready([], time.monotonic() + 60)
            return True
        except Exception as err:
            self.say(f"[cluster_for] {record.namespace} is unwell ({err!r:.200}): starting it again")
            return False

    def _stop(self, cluster: LocalCluster, record: Started, why: str) -> None:
        record.stopped_after = self.user
        self.say(f"[cluster_for] stopping {record.namespace} ({why}; used by {record.uses} test fixtures)")
        cluster.stop()

    def summary(self) -> list[str]:
        lines = [
            f"{r.namespace}: started for {r.first_user} in {r.start_s:.0f}s, handed out {r.uses}x"
            + (", then taken" if r.taken else "")
            for r in self.started
        ]
        total = sum(r.start_s for r in self.started)
        return [f"{len(self.started)} shared clusters started ({total:.0f}s of starts)", *lines]


def _describe(settings: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(settings.items())) or "the defaults"


@dataclass
class UpCluster:
    """A running `kvferry up`: its process, the router's gRPC address and the OpenAI API's base URL."""

    proc: subprocess.Popen
    router_addr: str
    api_url: str  # http://HOST:PORT/v1
    lines: list[str]

    @property
    def http_url(self) -> str:
        return self.api_url.removesuffix("/v1")


@contextlib.contextmanager
def kvferry_up(model_dir, log_dir, *flags: str, timeout_s: float = 240) -> Iterator[UpCluster]:
    """`kvferry up --model model_dir ... flags` as a user runs it, on free ports; stopped with SIGTERM
    (killed if it does not stop) however the test ends."""
    argv = [sys.executable, "-m", "kvferry.cli", "up", "--model", str(model_dir), "--port", "0"]
    argv += ["--http-port", "0", "--log-dir", str(log_dir), *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:

        def ready() -> str | None:
            assert proc.poll() is None, "kvferry up exited:\n" + "".join(lines)
            return next((line for line in list(lines) if "ready" in line and "router at " in line), None)

        line = wait_for(ready, timeout_s, what="kvferry up's ready line")
        addr = line.split("router at ")[1].split()[0]
        api = line.split("OpenAI API at ")[1].split(",")[0].split()[0]
        yield UpCluster(proc, addr, api, lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class ExtraRouter:
    """A router process (`python -m kvferry.router`) on the cluster's registry, with extra flags."""

    def __init__(self, cluster, log_path, *flags: str, env: dict | None = None):
        self.port, self.http_port = free_port(), free_port()
        argv = [
            *(sys.executable, "-m", "kvferry.router", "--model", str(cluster.model_dir)),
            *("--redis-url", cluster.redis_url, "--namespace", cluster.cfg.namespace),
            *("--port", str(self.port), "--http-port", str(self.http_port), *flags),
        ]
        self.log = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        self.addr = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        terminate([self.proc], 10)
