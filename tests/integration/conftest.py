"""Integration fixtures: a real redis-server on a free port, and real local clusters of processes, shared.

A test module that only reads from its cluster declares its settings (make_cluster_config's keywords) with
`pytestmark = pytest.mark.shared_cluster(**settings)` (no keywords: SHARED_DEFAULT) and uses the `cluster`
fixture; a test can do the same with its own marker and `cluster_for(**settings)`. Every test declaring the
same settings gets the same running cluster (`cluster_for`, session-scoped): it starts for the first of
them and stops after the last (modules declaring the same settings run one after the other), or at the
session's end, however it ends. A test that kills, scales or drains its cluster takes its own:
`cluster_for.take(**settings)` or a LocalCluster of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import ENGINE, Members, SharedClusters, make_cluster_config  # by `from conftest import`

from kvferry.deploy.config import WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.deploy.redis_server import (
    new_password,
    redis_server_argv,
    redis_url,
    wait_for_redis,
    write_redis_config,
)
from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.proc import free_port
from kvferry.router.client import Client


class RedisServer:
    """One redis-server process on a fixed port, with a password as `kvferry up` starts one; restartable
    (same port, same password) to simulate an outage."""

    def __init__(self, port: int, workdir: Path):
        self.port = port
        self.workdir = workdir
        self.password = new_password()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return redis_url("127.0.0.1", self.port, self.password)

    def start(self) -> None:
        config, _ = write_redis_config(self.workdir / "redis.conf", self.password)
        self.proc = subprocess.Popen(
            redis_server_argv("127.0.0.1", self.port, self.workdir, config=config),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_redis("127.0.0.1", self.port, time.monotonic() + 20, password=self.password)

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


# the settings of `pytest.mark.shared_cluster()`: two prefill workers (KV-aware routing has a choice)
SHARED_DEFAULT = {"prefill": WorkerGroupSettings(replicas=2, engine=ENGINE)}
# clusters running at once at most (each is 4-5 processes of ~0.3-1.3 GB)
SHARED_CAPACITY = int(os.environ.get("KVFERRY_TEST_SHARED_CLUSTERS", "2"))
_SHARED = pytest.StashKey[SharedClusters]()
_CURRENT = pytest.StashKey[str]()
# (item nodeid -> the shared keys declared by it or a later test, every key declared)
_NEEDED = pytest.StashKey[tuple]()


def settings_key(settings: dict) -> str:
    """Equal for settings that make the same cluster (whatever the namespace, model path or Redis)."""
    cfg = make_cluster_config(Path("MODEL"), "REDIS", "NAMESPACE", **settings)
    try:
        return json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=repr)
    except TypeError:
        return repr(cfg)


def declared_settings(node) -> dict | None:
    """The settings `node` (a test, or a module) declares with pytest.mark.shared_cluster, if it does."""
    marker = node.get_closest_marker("shared_cluster")
    if marker is None:
        return None
    return dict(marker.kwargs) if marker.kwargs else dict(SHARED_DEFAULT)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "shared_cluster(**settings): the test (or module) reads from the shared cluster of these "
        "make_cluster_config settings (none: SHARED_DEFAULT); see tests/integration/conftest.py",
    )


def _module_key(item) -> str | None:
    module = item.getparent(pytest.Module)
    settings = declared_settings(module) if module is not None else None
    return None if settings is None else settings_key(settings)


def pytest_collection_modifyitems(config, items):
    """Modules declaring the same shared cluster run one after another (at the first one's place), so a
    cluster is started once and stopped before the next starts; other tests keep their order."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if item.path.is_relative_to(here)]
    modules: dict = {}  # module path -> its items, in collection order
    for i in slots:
        modules.setdefault(items[i].path, []).append(items[i])
    keys = {path: _module_key(group[0]) for path, group in modules.items()}
    first: dict = {}
    for position, path in enumerate(modules):
        if keys[path] is not None:
            first.setdefault(keys[path], position)
    order = sorted(
        enumerate(modules),
        key=lambda p: (first[keys[p[1]]] if keys[p[1]] is not None else p[0], p[0]),
    )
    ordered = [item for _, path in order for item in modules[path]]
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


def pytest_collection_finish(session):
    """For each test, the shared clusters it or a later test declares: the ones to keep running."""
    needed, later = {}, set()
    for item in reversed(session.items):
        settings = declared_settings(item)
        if settings is not None:
            later = later | {settings_key(settings)}
        needed[item.nodeid] = later
    session.config.stash[_NEEDED] = (needed, later)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.config.stash[_CURRENT] = item.nodeid  # named in cluster_for's log lines
    shared = item.config.stash.get(_SHARED, None)
    if shared is not None:
        shared.user = item.nodeid
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test: stop each shared cluster no later test declares; one that no test declares (asked
    for by a test with no marker) at the end of its module."""
    yield
    shared = item.config.stash.get(_SHARED, None)
    if shared is None:
        return
    needed, declared = item.config.stash.get(_NEEDED, ({}, set()))
    keep = needed.get(nextitem.nodeid, set()) if nextitem is not None else set()
    module_ends = nextitem is None or nextitem.path != item.path
    shared.release(keep if module_ends else keep | (shared.running.keys() - declared))


def pytest_terminal_summary(terminalreporter, config):
    shared = config.stash.get(_SHARED, None)
    if shared is not None and shared.started:
        terminalreporter.section("shared clusters (cluster_for)")
        for line in shared.summary():
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def cluster_for(redis_server, tiny_model_dir, tmp_path_factory, pytestconfig):
    """cluster_for(**settings): the running LocalCluster of these make_cluster_config settings, shared by
    every test that asks for the same (see the module's doc); cluster_for.take(**settings): one of them
    for a test that kills, scales or drains it (a context manager: stopped at its end)."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        if reporter is None:
            return
        with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
            reporter.write_line(line)

    def start(settings: dict, namespace: str) -> LocalCluster:
        cfg = make_cluster_config(tiny_model_dir, redis_server.url, namespace, **settings)
        cluster = LocalCluster(cfg, log_dir=tmp_path_factory.mktemp(f"logs-{namespace}"), quiet=True)
        return cluster.__enter__()  # stops what it started if the start fails

    shared = SharedClusters(start, settings_key, capacity=SHARED_CAPACITY, say=say)
    shared.user = pytestconfig.stash.get(_CURRENT, "")
    pytestconfig.stash[_SHARED] = shared
    try:
        yield shared  # called as shared.get
    finally:
        shared.close()


@pytest.fixture(scope="module")
def cluster(cluster_for, request):
    """The module's shared cluster: the settings of its pytest.mark.shared_cluster (none: SHARED_DEFAULT,
    redis (the session's) + 1 pool node + 2 prefill workers + 1 decode worker + router, float32)."""
    return cluster_for(**(declared_settings(request.node) or SHARED_DEFAULT))


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir) -> LLMEngine:
    """The offline engine in this process on the tiny model with the clusters' engine settings, float32:
    the reference a cluster's greedy tokens must equal."""
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", **ENGINE))


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
