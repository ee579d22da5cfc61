"""Integration fixtures: a real redis-server on a free port, and a real local cluster of processes."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import Members

from kvferry.deploy.config import ClusterConfig, PoolSettings, RouterSettings, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster, redis_server_argv, wait_for_redis
from kvferry.proc import free_port
from kvferry.router.client import Client

ENGINE = {"max_model_len": 1024, "num_kv_blocks": 512, "max_num_batched_tokens": 512}


class RedisServer:
    """One redis-server process on a fixed port; restartable (same port) to simulate an outage."""

    def __init__(self, port: int, workdir: Path):
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            redis_server_argv("127.0.0.1", self.port, self.workdir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_redis("127.0.0.1", self.port, time.monotonic() + 20)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def make_cluster_config(model_dir: Path, redis_url: str, namespace: str, **settings) -> ClusterConfig:
    """A test cluster on the session's redis: float32, router (gRPC and HTTP) on any free ports, one
    small pool node, one prefill and one decode worker unless `settings` say otherwise."""
    defaults = {
        "pool": PoolSettings(nodes=1, memory_gib=0.25),
        "prefill": WorkerGroupSettings(replicas=1, engine=ENGINE),
        "decode": WorkerGroupSettings(replicas=1, engine=ENGINE),
        "router": RouterSettings(port=0, http_port=0),
    }
    return ClusterConfig(
        model=str(model_dir),
        dtype="float32",
        namespace=namespace,
        redis_url=redis_url,
        **{**defaults, **settings},
    )


@pytest.fixture(scope="module")
def cluster(redis_server, tiny_model_dir, tmp_path_factory, request):
    """redis (the session's) + 1 pool node + 2 prefill workers + 1 decode worker + router, float32."""
    namespace = f"test-{request.module.__name__.rsplit('.', 1)[-1]}"
    cfg = make_cluster_config(
        tiny_model_dir, redis_server.url, namespace, prefill=WorkerGroupSettings(replicas=2, engine=ENGINE)
    )
    with LocalCluster(cfg, log_dir=tmp_path_factory.mktemp("cluster-logs"), quiet=True) as c:
        yield c


@pytest.fixture(scope="module")
def members(cluster):
    """Stubs of `cluster`'s registry members (cluster_helpers.Members)."""
    m = Members(cluster)
    yield m
    m.close()


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_addr) as c:
        yield c
