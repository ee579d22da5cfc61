"""What several integration test modules use: waiting on a condition, the cluster's members, leak checks,
the router's /metrics, a `kvferry up` run as a user runs it."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from kvferry import rpc
from kvferry.deploy.fault_harness import wait_for  # the fault harness's: one condition wait for both
from kvferry.kvpool.metadata import MetadataStore
from kvferry.v1 import pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc


class Members:
    """gRPC stubs of the cluster's workers and pool nodes, found in its Redis registry."""

    def __init__(self, cluster):
        meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
        self.channels = []
        self.prefill = self._stubs(meta, "prefill", worker_pb2_grpc.PrefillWorkerStub)
        self.decode = self._stubs(meta, "decode", worker_pb2_grpc.DecodeWorkerStub)
        self.pool = self._stubs(meta, "pool", pool_pb2_grpc.KVPoolStub)

    def _stubs(self, meta, role, cls):
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


def assert_released(members, request_ids):
    """No worker or pool node holds anything for these requests, and no KV block is leaked."""

    def clean():
        decode = members.stats("decode")
        pool = members.stats("pool")
        for s in decode.values():
            if set(s.active_request_ids) & set(request_ids) or s.free_blocks != s.total_blocks:
                return False
        return all(not (set(p.leases) & set(request_ids)) and p.private_blocks == 0 for p in pool.values())

    wait_for(clean, 30, "workers and pool to release the requests")


def metric(cluster, name: str, **labels) -> float:
    """A series of the router's /metrics summed over the label sets that match `labels`."""
    with urllib.request.urlopen(cluster.http_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(w in line for w in want)
    )


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
