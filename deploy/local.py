"""`kvferry up`: the whole cluster as local processes.

Start order: redis-server (unless --redis-url) -> pool node(s) -> prefill and decode workers -> router.
Each child is its own process (`python -m kvferry.<component>`), logs to <log dir>/<name>.log and dies
with the launcher (PR_SET_PDEATHSIG), so even a killed launcher leaves nothing behind. `up` waits until
the router reports every worker and pool node, prints a line with `ready` and the router address,
serves `kvferry scale` requests (deploy.scaling), and on SIGINT/SIGTERM stops the children a tier at a
time in `kvferry.proc.STOP_ORDER` (workers drain while the router relays).

Security: only the router binds `router.host` (`--host`); workers, pool nodes, redis and the KV data
plane bind `cluster_host` (127.0.0.1 by default; the data plane `pool.data_interface` when set), and
groups meet in redis (kvpool.rendezvous), not in a store of their own. Every child gets the cluster secret in
`KVFERRY_CLUSTER_SECRET` (kvferry.auth; never on a command line), and so does this process, whose
probes and clients then carry it. The redis-server asks for a random password (deploy.redis_server).
The router gets its API keys in `KVFERRY_API_KEY`, and every pool node, worker and router the Redis
URL (with that password) in `KVFERRY_REDIS_URL`. With internal TLS on (`internal_tls`, see
deploy.config), this process makes the cluster CA (deploy.cluster_ca; its key stays here) and gives
every pool node, worker and router the CA certificate and a leaf of its own in `KVFERRY_TLS_*`
(kvferry.auth), a new leaf at each restart; it takes a leaf too. Secrets the operator needs
(`cluster-secret`, `redis-url`, and with TLS this process's leaf: `tls-ca.pem`, `tls-cert.pem`,
`tls-key.pem`) are written to the log dir, readable by the owner only, and removed at stop.

Failure: once the cluster is up, a watcher thread restarts a dead unit (redis on its port with its
password, a pool node, a worker group whole, the router) with the same command, after a backoff and
within a budget (deploy.restarts); a unit past its budget is reported and left down. Scaling and
stopping never count as deaths.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvferry.auth import SECRET_ENV, TLS_ENVS, cluster_secret, new_secret
from kvferry.deploy import scaling
from kvferry.deploy.cluster_ca import ClusterCA, launcher_ca
from kvferry.deploy.config import ClusterConfig, Placement, cluster_layout
from kvferry.deploy.planner import Autoscaler, start_autoscaler
from kvferry.deploy.readiness import reachable, wait_until_ready
from kvferry.deploy.redis_server import TLS_FILES as REDIS_TLS_FILES
from kvferry.deploy.redis_server import (
    LaunchError,
    new_password,
    redis_server_argv,
    wait_for_redis,
    write_private,
    write_redis_config,
)
from kvferry.deploy.restarts import RestartBudget
from kvferry.flags import SETTINGS, config_flags
from kvferry.kvpool.config import WORKER_SETTINGS
from kvferry.kvpool.metadata import REDIS_URL_ENV, mask_url
from kvferry.kvpool.shm import SHM_DIR
from kvferry.kvpool.transfer import BlockLayout
from kvferry.model.config import ModelConfig
from kvferry.model.create import resolve_model
from kvferry.model.parallel import ParallelConfigError, check_ep, check_tp
from kvferry.proc import STOP_ORDER, dying_with_parent, free_port, terminate
from kvferry.settings import API_KEY_ENV, load_settings
from kvferry.worker.config import WorkerConfig

# in the log dir, 0600, removed at stop; TLS_FILES: this process's leaf, for an operator's tools
TLS_FILES = ("tls-ca.pem", "tls-cert.pem", "tls-key.pem")
SECRET_FILES = ("cluster-secret", "redis-url", "redis.conf", *TLS_FILES, *REDIS_TLS_FILES)


def shm_dir() -> str | None:
    """Where a host's share directory goes: its tmpfs (the pool's SHM_DIR), else the temp directory."""
    return str(SHM_DIR) if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else None


def placement_env(placement: Placement, environ=os.environ) -> dict[str, str]:
    """A worker's environment additions for its placement; a variable the user set in the launcher's
    environment (KVFERRY_NUM_THREADS, OMP_WAIT_POLICY) wins over the placement's value."""
    return {k: v for k, v in placement.env().items() if not environ.get(k)}


DOWN = ("failed", "exited")  # the states of a unit left down (not restarted, not waited for)


@dataclass
class Child:
    """One unit `kvferry up` runs: redis, a pool node, a worker group (its rank 0, which starts the
    other ranks as its own children) or the router."""

    name: str
    proc: subprocess.Popen
    log: Path
    argv: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict, repr=False)
    size: int = 1  # worker groups: processes (ranks) the group runs
    # running | waiting (dead, restarts at restart_at) | failed (left down: past its restart budget) |
    # exited (left down: it exited 0, as a worker does after the drain a SIGTERM asked for) | retiring
    # (scaled away)
    state: str = "running"
    supervised: bool = False  # restarted when it dies: set once it has been ready
    restart_at: float = 0.0
    budget: RestartBudget = field(default_factory=RestartBudget)


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
    _share_dir: Path | None = None  # engine.host_share's directory (the placement shares cores)
    secret: str = field(default="", repr=False)  # the cluster secret every child gets
    ca: ClusterCA | None = field(default=None, repr=False)  # internal TLS: what signs every child's leaf
    events: list[str] = field(default_factory=list)  # restarts and units left down, as reported
    _lock: threading.RLock = field(default_factory=threading.RLock)  # children's states and procs
    _stopping: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None
    _scale_lock: threading.Lock = field(default_factory=threading.Lock)  # one scale at a time
    routers: list[Child] = field(default_factory=list)  # the router fleet (router.replicas)
    _router_names: itertools.count = field(default_factory=itertools.count)
    _router_spec: tuple = ()  # (argv, env) every router runs with
    autoscaler: Autoscaler | None = None  # the planner (cfg.autoscale.enabled)

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr, flush=True)

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> Child:
        env = {SECRET_ENV: self.secret, **redis_env(self.redis_url), **(env or {})}
        log = self.log_dir / f"{name}.log"
        child = Child(name, self._popen(log, argv, {**env, **self._leaf_env(name)}, "wb"), log, argv, env)
        child.budget = RestartBudget(self.cfg.restarts)
        with self._lock:
            self.children.append(child)
        return child

    @staticmethod
    def _popen(log: Path, argv: list[str], env: dict, mode: str) -> subprocess.Popen:
        mine = (SECRET_ENV, API_KEY_ENV, REDIS_URL_ENV, *TLS_ENVS)  # a child gets its own or none
        base = {k: v for k, v in os.environ.items() if k not in mine}
        env = {**base, **env}
        with log.open(mode) as out:
            return subprocess.Popen(
                dying_with_parent(argv, env=env),  # tied to the spawning thread: main, or the watcher
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which stops them in order
                env=env,
            )

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
        self._set_secret()
        self._set_tls()
        inner = cfg.cluster_host

        if cfg.redis_url:
            self.redis_url = cfg.redis_url
        else:
            self.redis_url = self._start_redis(inner, deadline)
            write_private(self.log_dir / "redis-url", self.redis_url + "\n")
        self.say(f"redis       {mask_url(self.redis_url)}")

        for i in range(0 if cfg.colocated else cfg.pool.nodes):
            self._spawn(f"pool-{i}", pool_argv(cfg, self._layout, f"pool-{i}", inner))
        self._placement = cfg.host_placement(os.cpu_count() or 1)
        if any(p.shares for p in self._placement.values()):  # prefill and decode share the cores
            self._share_dir = Path(tempfile.mkdtemp(prefix="kvferry-share-", dir=shm_dir()))
        for role in cfg.roles():
            for index, settings in enumerate(cfg.groups(role)):
                for _ in range(settings.replicas):
                    self.start_group(role, index)
        self._start_router(str(model_dir))
        wait_until_ready(
            self.router_addr,
            expected_members(cfg),
            deadline,
            self._check_alive,
            self.say,
            **self.probe_args(),
        )
        pids = {c.proc.pid for c in self.routers}  # every router of the fleet serves, not just one
        wait_routers(self.redis_url, cfg.namespace, pids, deadline, self._check_alive)
        with self._lock:
            for child in self.children:
                child.supervised = True
        self._watcher = threading.Thread(target=self._watch, name="kvferry-watcher", daemon=True)
        self._watcher.start()
        if cfg.autoscale.enabled:
            say = lambda line: self._report(f"kvferry: {line}")  # noqa: E731
            self.autoscaler = start_autoscaler(cfg, self.redis_url, self.counts, self.scale, say)
        return self.router_addr

    def _set_secret(self) -> None:
        """The cluster secret: the config's, else this process's (another cluster it runs), else a new
        one. This process takes it too: its probes, scale RPCs and test clients use kvferry.rpc."""
        self.secret = self.cfg.cluster_secret or cluster_secret() or new_secret()
        os.environ[SECRET_ENV] = self.secret
        write_private(self.log_dir / "cluster-secret", self.secret + "\n")

    def _set_tls(self) -> None:
        """Internal TLS (cfg.internal_tls_on): the CA is this process's (launcher_ca: every cluster it
        runs shares it, as they share the secret); this process takes a leaf in its environment (its
        test clients and tools use kvferry.rpc) and writes it to the log dir. Off: this process drops
        any TLS material it had, to speak plaintext to its children."""
        if not self.cfg.internal_tls_on():
            self.ca = None
            for name in TLS_ENVS:
                os.environ.pop(name, None)
            return
        self.ca = launcher_ca()
        mine = self.ca.issue()
        os.environ.update(mine.env())
        for name, pem in zip(TLS_FILES, (mine.ca, mine.cert, mine.key), strict=True):
            write_private(self.log_dir / name, pem.decode())
        self.say("internal    mutual TLS (cluster CA made by this launcher)")

    def _leaf_env(self, name: str) -> dict[str, str]:
        """A new leaf for child `name` in its environment: {} without TLS, and for redis (no gRPC)."""
        if self.ca is None or _kind(name) == "redis":
            return {}
        return self.ca.issue(self.cfg.cluster_host).env()

    def _start_router(self, model: str) -> None:
        """router.replicas router processes, all on the same gRPC and HTTP ports (SO_REUSEPORT: the
        kernel spreads new connections among them; clients see one address)."""
        router = self.cfg.router
        host = router.host
        port = router.port or free_port(host)
        http_port = free_port(host) if router.http_port == 0 else router.http_port
        env = {API_KEY_ENV: ",".join(router.api_keys)} if router.api_keys else {}
        self._router_spec = (router_argv(self.cfg, model, host, port, http_port), env)
        for _ in range(router.replicas):
            self._add_router()
        scheme = "https" if router.ssl_certfile else "http"
        self.router_addr = f"{reachable(host)}:{port}"
        self.http_url = "" if http_port is None else f"{scheme}://{reachable(host)}:{http_port}"

    def _add_router(self) -> Child:
        n = next(self._router_names)
        child = self._spawn("router" if n == 0 else f"router-{n}", *self._router_spec)
        with self._lock:
            self.routers.append(child)
        return child

    def live_routers(self) -> list[Child]:
        with self._lock:
            return [c for c in self.routers if c.state not in DOWN]

    def scale_routers(self, n: int, timeout_s: float = 60.0) -> None:
        """Run `n` routers: new ones start and register (their heartbeat) before the newest surplus
        ones leave; a leaving router stops taking connections and finishes its streams (its drain)."""
        if n < 1:
            raise scaling.ScaleRefused("a cluster needs at least one router")
        live = self.live_routers()
        if n > len(live):
            started = [self._add_router() for _ in range(n - len(live))]
            deadline = time.monotonic() + timeout_s
            try:
                pids = {c.proc.pid for c in started}
                check = lambda: self._check_alive(started)  # noqa: E731
                wait_routers(self.redis_url, self.cfg.namespace, pids, deadline, check)
            except BaseException:
                self.retire_routers(started)
                raise
            with self._lock:
                for child in started:
                    child.supervised = True
        elif n < len(live):
            self.retire_routers(live[n:][::-1])

    def retire_routers(self, routers: list[Child]) -> None:
        with self._lock:
            for child in routers:
                child.state = "retiring"
                self.routers.remove(child)
        _terminate(routers, self.cfg.router.drain_s + 10)
        with self._lock:
            for child in routers:
                self.children.remove(child)

    def probe_args(self) -> dict:
        """How this process reaches the router (wait_until_ready's keywords): the secret, and the
        router's certificate as the root when it serves TLS (self-signed, or its chain's root)."""
        certfile = self.cfg.router.ssl_certfile
        roots = Path(certfile).read_bytes() if certfile else None
        return {"secret": self.secret, "root_certificates": roots}

    def start_group(self, role: str, kind: int) -> Child:
        name = f"{role}-{next(self._names[role])}"
        cfg = self.cfg
        placement = self._placement[role]
        share = str(self._share_dir) if placement.shares and self._share_dir else ""
        argv = worker_argv(
            cfg,
            role,
            kind,
            name,
            str(self.model_dir),
            cfg.cluster_host,
            defaults=placement.engine_defaults(),
            host_share_dir=share,
        )
        child = self._spawn(name, placement.command(argv), placement_env(placement))
        child.size = cfg.group_size(role, kind)
        with self._lock:
            self.groups[role].append(child)
        return child

    def want(self) -> tuple[int, int, int]:
        """(prefill, decode, pool) registry members of the units meant to serve now (a unit waiting
        to restart counts; one left down does not)."""
        with self._lock:
            pool = sum(1 for c in self.children if _kind(c.name) == "pool" and c.state not in DOWN)
            live = {role: [c for c in groups if c.state not in DOWN] for role, groups in self.groups.items()}
        return len(live["prefill"]), sum(c.size for c in live["decode"]), pool

    def scale(
        self, prefill: int | None = None, decode: int | None = None, routers: int | None = None
    ) -> None:
        """Set the number of prefill / decode groups (deploy.scaling.scale: new groups register before the
        newest surplus ones drain and exit; a failed scale kills what it started and raises) and of
        routers (`scale_routers`)."""
        with self._scale_lock:
            if self._stopping.is_set():
                raise scaling.ScaleRefused("the cluster is stopping")
            if prefill is not None or decode is not None:
                scaling.scale(self, self.cfg, prefill, decode)
            if routers is not None:
                self.scale_routers(routers)

    def counts(self) -> tuple[int, int]:
        """(prefill, decode) groups that serve or will serve again."""
        return len(self.live_groups("prefill")), len(self.live_groups("decode"))

    # -- deploy.scaling.GroupLauncher ------------------------------------------------------------------
    def live_groups(self, role: str) -> list[Child]:
        """The role's groups that serve or will again (restarting), oldest first; one left down is
        dropped from the role's groups (it stays in `children`: reported, and reaped at stop)."""
        with self._lock:
            self.groups[role] = [c for c in self.groups[role] if c.state not in DOWN]
            return list(self.groups[role])

    def wait_ready(self, started: list[Child], deadline: float) -> None:
        def check() -> None:
            if self._stopping.is_set():
                raise LaunchError("the cluster is stopping")
            self._check_alive(started)

        wait_until_ready(self.router_addr, self.want, deadline, check, self.say, **self.probe_args())
        with self._lock:
            for child in started:
                child.supervised = True

    def discard(self, started: list[Child]) -> None:
        with self._lock:
            for child in started:
                child.state = "retiring"
        for child in started:
            child.proc.kill()
            child.proc.wait()
        with self._lock:
            for child in started:
                self.groups[_kind(child.name)].remove(child)
                self.children.remove(child)

    def retire(self, groups: list[Child]) -> None:
        with self._lock:
            for child in groups:
                child.state = "retiring"  # its exit is no death: not restarted
                self.groups[_kind(child.name)].remove(child)
        _terminate(groups, self.cfg.drain_timeout_s + 10)
        with self._lock:
            for child in groups:
                self.children.remove(child)

    def _start_redis(self, host: str, deadline: float) -> str:
        port = free_port(host)
        password = new_password()
        leaf = None if self.ca is None else self.ca.issue(host)
        config, tls = write_redis_config(self.log_dir / "redis.conf", password, leaf)
        self._spawn("redis", redis_server_argv(host, port, config=config, tls=tls))
        return wait_for_redis(host, port, deadline, self._check_alive, password, tls is not None)

    # -- restarts ---------------------------------------------------------------------------------------
    def _watch(self) -> None:
        """The watcher thread: every unit that died is restarted (or left down), until stop(). The
        restarted processes' death signal is tied to this thread, which lives until they are stopped."""
        while not self._stopping.wait(0.2):
            try:
                self.tend(time.monotonic())
            except Exception as err:  # e.g. a log dir gone: reported, the watcher goes on
                self._report(f"kvferry: restarting units failed: {err!r}")

    def tend(self, now: float) -> None:
        """One pass: a supervised unit that exited waits its backoff (or is left down, past its
        budget); one whose wait is over starts again with the same command and environment."""
        with self._lock:
            if self._stopping.is_set():
                return
            for child in self.children:
                if not child.supervised or child.state in (*DOWN, "retiring"):
                    continue
                if child.state == "running" and child.proc.poll() is not None:
                    self._died(child, now)
                elif child.state == "waiting" and now >= child.restart_at:
                    self._restart(child, now)

    def _died(self, child: Child, now: float) -> None:
        code = child.proc.returncode
        if code == 0:  # it left on purpose (drained on a SIGTERM sent to it): restarting would undo that
            child.state = "exited"
            self._report(f"kvferry: {child.name} exited with code 0 (drained); left down; see {child.log}")
            return
        delay = child.budget.delay(now)
        r = self.cfg.restarts
        if delay is None:
            child.state = "failed"
            self._report(
                f"kvferry: {child.name} exited with code {code}; restarted {r.max} times within "
                f"{r.window_s:.0f}s: left down; see {child.log}"
            )
            return
        child.state, child.restart_at = "waiting", now + delay
        self._report(
            f"kvferry: {child.name} exited with code {code}; restarting in {delay:.0f}s; see {child.log}"
        )

    def _restart(self, child: Child, now: float) -> None:
        with child.log.open("ab") as out:
            out.write(b"\n--- kvferry: restarting ---\n")
        child.proc = self._popen(child.log, child.argv, {**child.env, **self._leaf_env(child.name)}, "ab")
        child.state = "running"
        n = child.budget.record(now)
        self._report(f"kvferry: {child.name} restarted ({n} of {self.cfg.restarts.max} restarts allowed)")

    def _report(self, line: str) -> None:
        self.events.append(line)
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop a tier at a time: prefill workers, decode workers (each drains: what is in flight
        finishes, relayed by the router, which goes only after them), the router, pool nodes, redis.
        SIGTERM, then SIGKILL after `timeout_s` (for workers, after their drain timeout). Nothing is
        restarted from the moment stop() begins."""
        with self._lock:
            self._stopping.set()
        if self.autoscaler is not None:  # a scale in progress gives up (wait_ready sees the stop)
            self.autoscaler.stop(timeout_s=30)
        with self._lock:
            children = list(self.children)
        for kind in STOP_ORDER:
            tier = [c for c in children if _kind(c.name) == kind]
            _terminate(tier, self.cfg.drain_timeout_s + 5 if kind in ("prefill", "decode") else timeout_s)
        if self._watcher is not None:
            self._watcher.join()
        self.children = []
        if self.log_dir is not None:
            for name in SECRET_FILES:
                with contextlib.suppress(FileNotFoundError):
                    (self.log_dir / name).unlink()
        if self._share_dir is not None:
            shutil.rmtree(self._share_dir, ignore_errors=True)
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


def pool_argv(cfg: ClusterConfig, layout: BlockLayout, node_id: str, host: str) -> list[str]:
    """The command of a pool node holding blocks of `layout` (config.cluster_layout: the workers'): the
    cluster's pool settings with this node's own (`kvferry.flags.config_flags`). Like every member's, it
    gets the Redis URL from its environment (redis_env), not its arguments."""
    disk = f"{cfg.pool.disk_dir}/{node_id}" if cfg.pool.disk_dir else None  # each node locks its own
    node = replace(cfg.pool, node_id=node_id, host=host, namespace=cfg.namespace, disk_dir=disk)
    layout_flag = ("--layout", ",".join(map(str, layout.to_list())))
    return [sys.executable, "-m", "kvferry.kvpool", *config_flags(node), *layout_flag]


def worker_argv(
    cfg: ClusterConfig,
    role: str,
    kind: int,
    name: str,
    model: str,
    host: str,
    defaults: dict | None = None,
    host_share_dir: str = "",
) -> list[str]:
    """The command of a worker group of kind `kind` (its index in cfg.groups(role)); `model` is what
    the worker resolves (a built-in name is made on each node on first use). `defaults`: engine
    settings the launcher picks (the placement's pacing) for those the cluster file leaves unset."""
    engine = replace(cfg.engine_config(role, kind), model=model)
    engine = replace(engine, **{k: v for k, v in (defaults or {}).items() if getattr(engine, k) is None})
    own = WorkerConfig(
        worker_id=name,
        host=host,
        namespace=cfg.namespace,
        drain_timeout_s=cfg.drain_timeout_s,
        host_share_dir=host_share_dir,
    )
    return [
        *(sys.executable, "-m", f"kvferry.{role}_worker", *config_flags(own)),
        *config_flags(cfg.pool, only=WORKER_SETTINGS, prefix="pool", scope=SETTINGS),
        *config_flags(engine),
    ]


def router_argv(cfg: ClusterConfig, model: str, host: str, port: int, http_port: int | None) -> list[str]:
    """`host`: what the router binds (router.host: the one address clients reach); `http_port`: the
    OpenAI API's (None = off). The API keys go in the environment (KVFERRY_API_KEY), never here."""
    router = replace(
        cfg.router,
        model=model,
        namespace=cfg.namespace,
        colocated=cfg.colocated,
        host=host,
        port=port,
        http_port=http_port,
        served_model_name=cfg.router.served_model_name or (cfg.model,),
    )
    return [sys.executable, "-m", "kvferry.router", *config_flags(router)]


def wait_routers(redis_url: str, namespace: str, pids: set[int], deadline: float, check=lambda: None) -> None:
    """Wait until the routers of these processes hold a live heartbeat in the registry (each registers
    once it serves; its record names its pid)."""
    from kvferry.kvpool.metadata import MetadataStore

    meta = MetadataStore(redis_url, namespace)
    try:
        while True:
            check()
            have = {info.get("pid") for info in (meta.members("router") or {}).values()}
            if pids <= have:
                return
            if time.monotonic() > deadline:
                raise LaunchError(f"{len(pids - have)} of {len(pids)} routers did not register in time")
            time.sleep(0.1)
    finally:
        meta.client.close()


def redis_env(url: str) -> dict[str, str]:
    """The environment that gives a pool node, worker or router the cluster's Redis URL: an argument
    would show its password to every user of the host in `ps`; the environment is the owner's only."""
    return {REDIS_URL_ENV: url} if url else {}


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
