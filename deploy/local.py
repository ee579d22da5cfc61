"""`kvferry up`: the whole cluster as local processes.

Start order: redis-server (unless --redis-url) -> pool node(s) -> prefill and decode workers -> router.
Each child is its own process (`python -m kvferry.<component>`), logs to <log dir>/<name>.log, binds
127.0.0.1 by default and dies with the launcher (PR_SET_PDEATHSIG), so even a killed launcher leaves
nothing behind. `up` waits until the router reports every worker and pool node, prints a line with
`ready` and the router address, serves `kvferry scale` requests (deploy.scaling), and on SIGINT/SIGTERM
stops the children a tier at a time in `kvferry.proc.STOP_ORDER` (workers drain while the router relays).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from kvferry.deploy import scaling
from kvferry.deploy.config import ClusterConfig, cluster_layout
from kvferry.engine.args import engine_flags
from kvferry.kvpool.transfer import BlockLayout
from kvferry.model.config import ModelConfig
from kvferry.model.create import resolve_model
from kvferry.model.parallel import ParallelConfigError, check_ep, check_tp
from kvferry.proc import STOP_ORDER, die_with_parent, free_port, terminate
from kvferry.rpc import check_health
from kvferry.settings import load_settings


class LaunchError(RuntimeError):
    pass


def redis_server_argv(host: str, port: int, workdir: Path | None = None) -> list[str]:
    """A throwaway redis-server on host:port: no persistence (the metadata is a cache)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise LaunchError("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
    argv = [binary, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    argv += ["--protected-mode", "no"]
    return argv + (["--dir", str(workdir)] if workdir is not None else [])


def wait_for_redis(host: str, port: int, deadline: float, check=None) -> str:
    """Poll until the server answers PING (calling `check()` between tries); returns its URL."""
    import redis

    client = redis.Redis(host=host, port=port)
    while True:
        if check is not None:
            check()
        with contextlib.suppress(redis.RedisError):
            client.ping()
            return f"redis://{host}:{port}/0"
        if time.monotonic() > deadline:
            raise LaunchError(f"redis-server on {host}:{port} did not start in time")
        time.sleep(0.05)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    reported: bool = False
    size: int = 1  # worker groups: processes (ranks) the group runs


@dataclass
class LocalCluster:
    cfg: ClusterConfig
    log_dir: Path | None = None
    quiet: bool = False
    children: list[Child] = field(default_factory=list)
    redis_url: str = ""
    router_addr: str = ""
    http_url: str = ""  # the OpenAI-compatible API ("" when off)
    model_dir: Path | None = None
    groups: dict[str, list[Child]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    _names: dict = field(default_factory=lambda: {"prefill": itertools.count(), "decode": itertools.count()})
    _placement: dict = field(default_factory=dict)
    _layout: BlockLayout | None = None  # the pool's (None when colocated)
    _tmp: Path | None = None

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent(),
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which stops them in order
                env={**os.environ, **(env or {})},
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def _check_alive(self, children: list[Child] | None = None) -> None:
        for child in self.children if children is None else children:
            code = child.proc.poll()
            if code is not None:
                tail = child.log.read_text(errors="replace")[-3000:] if child.log.exists() else ""
                raise LaunchError(f"{child.name} exited with code {code} during startup; its log:\n{tail}")

    def start(self) -> str:
        """Bring everything up; returns the router address."""
        cfg = self.cfg
        cfg.validate()
        if self.log_dir is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="kvferry-"))
            self.log_dir = self._tmp
        self.log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + cfg.startup_timeout_s
        model_dir = self.model_dir = resolve_model(cfg.model, load_settings().models_dir)  # built-ins: once
        model_cfg = ModelConfig.from_dir(model_dir)
        check_degrees(cfg, model_cfg)
        self._layout = None if cfg.colocated else cluster_layout(cfg, model_cfg)
        host = cfg.router.host

        if cfg.redis_url:
            self.redis_url = cfg.redis_url
        else:
            self.redis_url = self._start_redis(host, deadline)
        self.say(f"redis       {self.redis_url}")

        for i in range(0 if cfg.colocated else cfg.pool.nodes):
            self._spawn(f"pool-{i}", pool_argv(cfg, self._layout, f"pool-{i}", host, self.redis_url))
        self._placement = cfg.host_placement(os.cpu_count() or 1)
        for role in cfg.roles():
            for index, settings in enumerate(cfg.groups(role)):
                for _ in range(settings.replicas):
                    self.start_group(role, index)
        port = cfg.router.port or free_port(host)
        http_port = cfg.router.http_port
        if http_port == 0:
            http_port = free_port(host)
        self._spawn("router", router_argv(cfg, str(model_dir), host, port, self.redis_url, http_port))
        self.router_addr = f"{host}:{port}"
        self.http_url = "" if http_port is None else f"http://{host}:{http_port}"
        wait_until_ready(self.router_addr, expected_members(cfg), deadline, self._check_alive, self.say)
        return self.router_addr

    def start_group(self, role: str, kind: int) -> Child:
        name = f"{role}-{next(self._names[role])}"
        cfg = self.cfg
        placement = self._placement[role]
        paced = {"decode_step_interval_ms": placement.step_interval_ms} if placement.step_interval_ms else {}
        argv = worker_argv(
            cfg, role, kind, name, str(self.model_dir), cfg.router.host, self.redis_url, defaults=paced
        )
        env = placement.env()
        if os.environ.get("KVFERRY_NUM_THREADS"):  # set by the user: it wins over the placement's count
            del env["KVFERRY_NUM_THREADS"]
        child = self._spawn(name, placement.command(argv), env)
        child.size = cfg.group_size(role, kind)
        self.groups[role].append(child)
        return child

    def want(self) -> tuple[int, int, int]:
        """(prefill, decode, pool) registry members of the groups meant to serve now."""
        pool = expected_members(self.cfg)[2]
        live = {role: [c for c in groups if c.proc.poll() is None] for role, groups in self.groups.items()}
        return len(live["prefill"]), sum(c.size for c in live["decode"]), pool

    def scale(self, prefill: int | None = None, decode: int | None = None) -> None:
        """Set the number of prefill / decode groups (deploy.scaling.scale: new groups register before the
        newest surplus ones drain and exit; a failed scale kills what it started and raises)."""
        scaling.scale(self, self.cfg, prefill, decode)

    # -- deploy.scaling.GroupLauncher ------------------------------------------------------------------
    def live_groups(self, role: str) -> list[Child]:
        """The role's running groups, oldest first; one that exited is dropped from the role's groups
        (it stays in `children`: reported, and reaped at stop)."""
        self.groups[role] = [c for c in self.groups[role] if c.proc.poll() is None]
        return list(self.groups[role])

    def wait_ready(self, started: list[Child], deadline: float) -> None:
        check = lambda: self._check_alive(started)  # noqa: E731
        wait_until_ready(self.router_addr, self.want, deadline, check, self.say)

    def discard(self, started: list[Child]) -> None:
        for child in started:
            child.proc.kill()
            child.proc.wait()
            self.groups[_kind(child.name)].remove(child)
            self.children.remove(child)

    def retire(self, groups: list[Child]) -> None:
        for child in groups:
            self.groups[_kind(child.name)].remove(child)
        _terminate(groups, self.cfg.drain_timeout_s + 10)
        for child in groups:
            self.children.remove(child)

    def _start_redis(self, host: str, deadline: float) -> str:
        port = free_port(host)
        self._spawn("redis", redis_server_argv(host, port))
        return wait_for_redis(host, port, deadline, self._check_alive)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop a tier at a time: prefill workers, decode workers (each drains: what is in flight
        finishes, relayed by the router, which goes only after them), the router, pool nodes, redis.
        SIGTERM, then SIGKILL after `timeout_s` (for workers, after their drain timeout)."""
        for kind in STOP_ORDER:
            tier = [c for c in self.children if _kind(c.name) == kind]
            _terminate(tier, self.cfg.drain_timeout_s + 5 if kind in ("prefill", "decode") else timeout_s)
        self.children = []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _terminate(children: list[Child], limit_s: float) -> None:
    terminate([child.proc for child in children], limit_s)


def _kind(name: str) -> str:
    """prefill-3 -> prefill, pool-0 -> pool, router -> router."""
    return name.rsplit("-", 1)[0]


def expected_members(cfg: ClusterConfig, pool_nodes: int | None = None) -> tuple[int, int, int]:
    """(prefill, decode, pool) registry members of a ready cluster: a prefill group registers once
    (rank 0 serves it), a decode group once per rank."""
    pool = 0 if cfg.colocated else cfg.pool.nodes if pool_nodes is None else pool_nodes
    return cfg.members("prefill"), cfg.members("decode"), pool


def wait_until_ready(router_addr: str, want, deadline: float, check=None, say=None) -> None:
    """Poll the router until it serves and reports `want` = (prefill, decode, pool) members (a
    callable: re-read each time); `check()` between tries raises when a component died."""
    from kvferry.router.client import Client

    last = None
    with Client(router_addr) as client:
        while True:
            if check is not None:
                check()
            target = want() if callable(want) else want
            if check_health(router_addr):
                try:
                    info = client.model_info(timeout=2)
                    have = (info.num_prefill_workers, info.num_decode_workers, info.num_pool_nodes)
                except grpc.RpcError:
                    have = None
                if have == target:
                    return
                if have != last and say is not None:
                    last = have
                    say(f"waiting: prefill/decode/pool {have} of {target}")
            if time.monotonic() > deadline:
                raise LaunchError(f"the cluster was not ready in time (router reports {last}, want {target})")
            time.sleep(0.2)


def pool_argv(cfg: ClusterConfig, layout: BlockLayout, node_id: str, host: str, redis_url: str) -> list[str]:
    """The command of a pool node holding blocks of `layout` (config.cluster_layout: the workers')."""
    slots = max(16, int(cfg.pool.memory_gib * 2**30 // layout.block_bytes))
    return [
        *(sys.executable, "-m", "kvferry.kvpool", "--node-id", node_id),
        *_common(cfg, host, redis_url),
        *("--layout", ",".join(map(str, layout.to_list())), "--num-slots", str(slots)),
    ]


def worker_argv(
    cfg: ClusterConfig,
    role: str,
    kind: int,
    name: str,
    model: str,
    host: str,
    redis_url: str,
    defaults: dict | None = None,
) -> list[str]:
    """The command of a worker group of kind `kind` (its index in cfg.groups(role)); `model` is what
    the worker resolves (a built-in name is made on each node on first use). `defaults`: engine
    settings the launcher picks (the placement's pacing) for those the cluster file leaves unset."""
    engine = replace(cfg.engine_config(role, kind), model=model)
    engine = replace(engine, **{k: v for k, v in (defaults or {}).items() if getattr(engine, k) is None})
    return [
        *(sys.executable, "-m", f"kvferry.{role}_worker", "--worker-id", name),
        *_common(cfg, host, redis_url),
        *("--drain-timeout-s", str(cfg.drain_timeout_s)),
        *engine_flags(engine),
    ]


def router_argv(
    cfg: ClusterConfig, model: str, host: str, port: int, redis_url: str, http_port: int | None
) -> list[str]:
    """`http_port`: the OpenAI API's (None = off)."""
    served = cfg.router.served_model_name or cfg.model
    return [
        *(sys.executable, "-m", "kvferry.router", "--model", model, "--served-model-name", served),
        *_common(cfg, host, redis_url),
        *("--port", str(port), "--max-inflight", str(cfg.router.max_inflight)),
        *(["--no-http"] if http_port is None else ["--http-port", str(http_port)]),
        *(["--colocated"] if cfg.colocated else []),
    ]


def _common(cfg: ClusterConfig, host: str, redis_url: str) -> list[str]:
    return ["--host", host, "--redis-url", redis_url, "--namespace", cfg.namespace]


def check_degrees(cfg: ClusterConfig, model_cfg: ModelConfig) -> None:
    """Refuse, before any process starts, a TP/EP degree the model cannot be split by."""
    for role in ("prefill", "decode"):
        for index in range(len(cfg.groups(role))):
            engine = cfg.engine_config(role, index)
            try:
                check_tp(model_cfg, engine.tensor_parallel_size)
                check_ep(model_cfg, engine.expert_parallel_size)
            except ParallelConfigError as err:
                raise LaunchError(f"{role} group {index}: {err}") from None


def _scale_key(namespace: str) -> str:
    return f"kvf:{namespace}:scale"


def _launcher_key(namespace: str) -> str:
    return f"kvf:{namespace}:launcher"  # a running `kvferry up` refreshes it every second


def request_scale(redis_url: str, namespace: str, prefill: int | None, decode: int | None, timeout_s=600.0):
    """`kvferry scale` for a local cluster: its `kvferry up` watches this Redis key and answers."""
    import json
    import uuid

    import redis

    ask = {"id": uuid.uuid4().hex, "prefill": prefill, "decode": decode}
    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    key = _scale_key(namespace)
    try:
        if not client.exists(_launcher_key(namespace)):
            print(
                f"kvferry: error: no kvferry up serves namespace {namespace!r} on {redis_url}",
                file=sys.stderr,
            )
            return 2
        client.set(key, json.dumps(ask))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            raw = client.get(key + ":done")
            if raw is not None and json.loads(raw).get("id") == ask["id"]:
                done = json.loads(raw)
                print(json.dumps(done, indent=2))
                return 0 if done.get("ok") else 1
            time.sleep(0.2)
        client.delete(key)  # nobody took it: it must not run later, unasked
    except redis.RedisError as err:
        print(f"kvferry: error: {redis_url}: {err}", file=sys.stderr)
        return 1
    print(f"kvferry: error: kvferry up did not answer within {timeout_s:.0f}s", file=sys.stderr)
    return 1


def _serve_scale_requests(cluster: LocalCluster) -> None:
    import json

    import redis

    client = redis.Redis.from_url(cluster.redis_url, socket_timeout=2)
    key = _scale_key(cluster.cfg.namespace)
    try:
        client.set(_launcher_key(cluster.cfg.namespace), str(os.getpid()), px=5000)
        raw = client.getdel(key)
        if raw is None:
            return
        answer = {"id": None, "ok": True}
        try:
            ask = json.loads(raw)
            answer["id"] = ask.get("id")
            cluster.scale(ask.get("prefill"), ask.get("decode"))
        except Exception as err:  # a bad request or a failed scale: answered, the cluster serves on
            answer.update(ok=False, error=str(err))
        answer["groups"] = {role: [c.name for c in cluster.groups[role]] for role in cluster.groups}
        client.set(key + ":done", json.dumps(answer), ex=600)
    except redis.RedisError as err:
        print(f"kvferry: scale requests: redis: {err}", file=sys.stderr, flush=True)


def run_until_signal(cluster: LocalCluster) -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        _serve_scale_requests(cluster)
        for child in cluster.children:
            if child.proc.poll() is not None and not child.reported:
                child.reported = True
                print(
                    f"kvferry: {child.name} exited with code {child.proc.returncode}; see {child.log}",
                    file=sys.stderr,
                    flush=True,
                )
