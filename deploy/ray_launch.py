"""`kvferry up --ray`: the same cluster on a Ray cluster (the only module that imports ray).

- A **controller** actor (named `kvferry-<namespace>` in the Ray namespace `kvferry`, on the head
  node) owns the cluster: it places every component, watches it, relaunches what dies, and scales
  worker groups (`kvferry scale`). `kvferry up --ray` creates it; `--detach` leaves it running after
  the command ends (`kvferry down --ray` stops it).
- Every process runs under a **supervisor** actor: a small actor that starts the component as its
  child (`python -m kvferry.<component>`: the very command `kvferry up` runs locally), with
  PR_SET_PDEATHSIG=SIGKILL so the process never outlives its actor. Output goes to
  `<log dir>/<name>.log` on the actor's node.
- A worker **group** (a TP prefill group, an EP decode group) is one placement group: one bundle per
  rank with its CPU/GPU (`resources` in the group's config), STRICT_PACK, so the ranks share a host.
  The ranks meet in the cluster's Redis (kvpool.rendezvous) under a name picked at each (re)launch:
  `--rank r --dist-init NAME`. Ray gives a GPU bundle's actor its device (CUDA_VISIBLE_DEVICES),
  which the process inherits.
- One **pool node** per Ray node (hard node affinity; nodes that join later get one, nodes that leave
  take theirs), or `pool.nodes` of them spread (`pool.per_ray_node: false`).
- The **router** and **redis-server** (unless `redis_url` is given) run on the head node; redis asks
  for a password made at start (kept across relaunches), written to a file only its actor can read.
- **Secrets**: the controller runs with the cluster secret in its environment (Ray's runtime env; the
  driver makes one unless the config has `cluster_secret`) and hands it to every process it launches
  in `KVFERRY_CLUSTER_SECRET`, the router its API keys in `KVFERRY_API_KEY`, every pool node, worker
  and router the Redis URL (with its password) in `KVFERRY_REDIS_URL`: never on a command line.
- **Internal TLS** (`internal_tls`; `auto` is on under Ray, whose nodes may be other hosts): the
  controller makes the cluster CA (deploy.cluster_ca; its key never leaves the controller) and gives
  each process it launches the CA certificate and a new leaf for its node's IP in `KVFERRY_TLS_*`
  (kvferry.auth), at every (re)launch; redis-server gets a leaf of its own and speaks TLS only
  (deploy.redis_server; the URL is `rediss://`).
- **Failure**: Ray restarts a dead supervisor (`ray.max_restarts`); the controller's watcher checks
  every unit every second and relaunches one with a dead actor or an exited process whole (every
  rank of a group: a group cannot take one rank back mid-collective) on the same resources. The
  router stops
  routing to the dead members (their streams end with UNAVAILABLE, their heartbeats stop) and picks
  the relaunched ones up when they register again.
- **Scaling** (deploy.scaling, the algorithm `kvferry up` shares) adds groups (new placement groups)
  and retires the newest ones: a retired group drains (SIGTERM: it leaves the router's rotation and
  finishes what it holds) before its actors go. A scale whose new groups do not become ready frees them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from kvferry.auth import SECRET_ENV, cluster_secret, new_secret
from kvferry.deploy import scaling
from kvferry.deploy.cluster_ca import ClusterCA
from kvferry.deploy.redis_server import TLS_FILES as REDIS_TLS_FILES
from kvferry.deploy.redis_server import new_password, redis_url, tls_files, write_private
from kvferry.kvpool.metadata import mask_url
from kvferry.kvpool.rendezvous import fresh_name
from kvferry.proc import STOP_ORDER, dying_with_parent
from kvferry.settings import API_KEY_ENV

if TYPE_CHECKING:
    from kvferry.deploy.config import ClusterConfig
    from kvferry.kvpool.transfer import BlockLayout

log = logging.getLogger("kvferry.ray")

RAY_NAMESPACE = "kvferry"
HEAD = {"node:__internal_head__": 0.001}  # the head node's built-in resource
NOT_LAUNCHED = -1000  # Supervisor.poll() of an actor that has no process (e.g. Ray just restarted it)
RPC_TIMEOUT_S = 30.0


def controller_name(namespace: str) -> str:
    return f"kvferry-{namespace}"


class Supervisor:
    """Runs one component process on this actor's node (see the module doc). Synchronous: every
    call runs on the actor's main thread, the thread PR_SET_PDEATHSIG is tied to."""

    def __init__(self, name: str, log_dir: str):
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.launches = 0
        self.private: Path | None = None  # an owner-only dir for the files a launch needs (redis.conf)

    def where(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def launch(self, argv: list[str], env: dict[str, str], files: dict[str, str] | None = None) -> int:
        """Start the component ({host}: this node's IP, {python}: this interpreter, {file:NAME}: the
        path of `files[NAME]`, written readable by this user only); returns its pid."""
        self.kill()
        ip = ray.util.get_node_ip_address()
        argv = [a.replace("{host}", ip).replace("{python}", sys.executable) for a in argv]
        if files:
            if self.private is None:
                self.private = Path(tempfile.mkdtemp(prefix=f"kvferry-{self.name}-"))  # 0700
            for name, text in files.items():
                path = write_private(self.private / name, text)
                argv = [a.replace(f"{{file:{name}}}", str(path)) for a in argv]
        with self.log_path.open("ab") as out:
            shown = " ".join(mask_url(a) for a in argv)  # a --redis-url in the config's flags: masked
            out.write(f"--- kvferry launch {self.launches}: {shown}\n".encode())
            out.flush()
            env = {**os.environ, **env}
            self.proc = subprocess.Popen(
                dying_with_parent(argv, signal.SIGKILL, env),  # Ray kills actors with SIGKILL too
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.launches += 1
        return self.proc.pid

    def pid(self) -> int | None:
        """The process's pid (None before its launch)."""
        return None if self.proc is None else self.proc.pid

    def poll(self) -> int | None:
        """None while the process runs, its exit code once it ended, NOT_LAUNCHED without one."""
        return NOT_LAUNCHED if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        """SIGTERM: a worker drains (finishes its requests) and exits; others just exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


@dataclass
class Unit:
    """What the controller launches and relaunches as one: a worker group (all its ranks), a pool
    node, the router or redis-server."""

    name: str
    role: str  # redis | pool | router | prefill | decode
    kind: int = 0  # worker groups: the index of the group's settings in cfg.groups(role)
    size: int = 1
    sups: list = field(default_factory=list)  # one supervisor per rank
    pg: object = None  # worker groups: the placement group
    node_id: str = ""  # per-node pool nodes: the Ray node it lives on
    port: int = 0  # redis / router: kept across relaunches (the others know it)
    http_port: int | None = None  # router: its OpenAI API's, likewise
    state: str = "new"  # new | running | draining | failed
    restarts: int = 0
    where: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a relaunch and a retire never overlap


class LaunchError(RuntimeError):
    pass


class Controller:
    """The cluster's owner on Ray (a threaded actor: status() answers while start/scale run)."""

    def __init__(self, cfg_json: str):
        from kvferry.deploy.config import cluster_config_from_dict

        self.cfg: ClusterConfig = cluster_config_from_dict(json.loads(cfg_json))
        self.cfg.validate()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s kvferry-controller %(message)s")
        ns = self.cfg.namespace
        self.log_dir = self.cfg.ray.log_dir or str(Path(tempfile.gettempdir()) / "kvferry" / ns)
        self.units: dict[str, Unit] = {}
        self.lock = threading.RLock()  # units and their states
        self.scaling = threading.Lock()  # one scale() at a time
        self.names = {role: itertools.count() for role in ("prefill", "decode", "pool")}
        self.redis_url = self.cfg.redis_url or ""
        self.redis_password = ""  # of the redis-server started here: made once, kept across relaunches
        self.secret = cluster_secret()  # from the runtime env `up` gives this actor (None: an open cluster)
        # internal TLS: the cluster CA, made here (its key never leaves this actor); None: plaintext
        self.ca = ClusterCA.create() if self.cfg.internal_tls_on(ray=True) else None
        if self.ca is not None:  # this actor's own leaf: its Redis client checks redis-server's against it
            os.environ.update(self.ca.issue().env())
        self.router_addr = ""
        self.http_url = ""
        self.model_dir: Path | None = None
        self.layout: BlockLayout | None = None  # the pool's (None when colocated)
        self.events: list[str] = []
        self.event_count = 0
        self.phase = "starting"
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.autoscaler = None  # the planner (cfg.autoscale.enabled: deploy.planner)

    # -- start / stop ---------------------------------------------------------------------------------
    def start(self) -> dict:
        from kvferry.deploy.config import cluster_layout
        from kvferry.deploy.local import check_degrees, wait_for_redis
        from kvferry.deploy.readiness import wait_until_ready
        from kvferry.model.config import ModelConfig
        from kvferry.model.create import resolve_model
        from kvferry.settings import load_settings

        cfg = self.cfg
        deadline = time.monotonic() + cfg.startup_timeout_s
        self.model_dir = resolve_model(cfg.model, load_settings().models_dir)
        model_cfg = ModelConfig.from_dir(self.model_dir)
        check_degrees(cfg, model_cfg)
        if not cfg.colocated:  # the workers' layout, on the devices their bundles give them
            self.layout = cluster_layout(cfg, model_cfg, ray_gpus=self._ray_gpus())
        if not cfg.redis_url:
            self.redis_password = new_password()
            redis = self._start(self._new_unit("redis", "redis"))
            host, port = redis.where[0]["ip"], redis.port
            check = lambda: self._check_started([redis])  # noqa: E731
            wait_for_redis(host, port, deadline, check, self.redis_password, self.ca is not None)
        self._event(f"redis {mask_url(self.redis_url)}")
        if not cfg.colocated:
            self._reconcile_pool()
        for role in cfg.roles():
            for kind, settings in enumerate(cfg.groups(role)):
                for _ in range(settings.replicas):
                    self._start(self._new_group(role, kind))
        for i in range(cfg.router.replicas):  # the fleet: on the head node, sharing its ports
            self._start(self._new_unit("router" if i == 0 else f"router-{i}", "router"))
        wait_until_ready(
            self.router_addr,
            self._want,
            deadline,
            lambda: self._check_started(),
            self._event,
            root_certificates=self._router_roots(),
        )
        self.phase = "ready"
        http = f", OpenAI API at {self.http_url}/v1" if self.http_url else ""
        self._event(f"ready: router at {self.router_addr}{http}")
        self._watcher = threading.Thread(target=self._watch, name="watcher", daemon=True)
        self._watcher.start()
        if cfg.autoscale.enabled:  # the planner (deploy.planner), through scale() as `kvferry scale`
            from kvferry.deploy.planner import start_autoscaler

            counts = lambda: (len(self.live_groups("prefill")), len(self.live_groups("decode")))  # noqa: E731
            self.autoscaler = start_autoscaler(cfg, self.redis_url, counts, self._planned_scale, self._event)
        return self.status()

    def _planned_scale(self, prefill: int, decode: int) -> None:
        if self._stop.is_set():
            raise scaling.ScaleRefused("the cluster is stopping")
        self.scale(prefill, decode)

    def shutdown(self) -> None:
        """Stop everything a tier at a time: prefill groups, decode groups (each drains: what is in
        flight finishes, relayed by the router, which goes only after them), router, pool, redis."""
        self._stop.set()
        self.phase = "stopping"
        if self.autoscaler is not None:
            self.autoscaler.stop(timeout_s=30)
        if self._watcher is not None:
            self._watcher.join(5)
        with self.lock:
            units = list(self.units.values())
        for role in STOP_ORDER:
            self._retire([u for u in units if u.role == role], self.cfg.drain_timeout_s + 10)
        self.phase = "stopped"

    # -- scaling --------------------------------------------------------------------------------------
    def scale(
        self, prefill: int | None = None, decode: int | None = None, routers: int | None = None
    ) -> dict:
        """Set the number of prefill / decode groups (deploy.scaling.scale: new groups register before
        the newest surplus ones drain and go; a failed scale frees what it started and raises) and of
        routers (new ones register before the newest surplus ones drain and go)."""
        scaling.check_targets(self.cfg, prefill, decode)  # refused at once, not after a running scale
        if routers is not None and routers < 1:
            raise ValueError("a cluster needs at least one router")
        with self.scaling:
            if prefill is not None or decode is not None:
                scaling.scale(self, self.cfg, prefill, decode)
            if routers is not None:
                self._scale_routers(routers)
        return self.status()

    def _scale_routers(self, n: int) -> None:
        from kvferry.deploy.local import wait_routers

        live = self.live_groups("router")
        if n > len(live):
            taken = {u.name for u in self.units.values()}
            names = (f"router-{i}" for i in itertools.count(1) if f"router-{i}" not in taken)
            started: list[Unit] = []
            try:
                for _ in range(n - len(live)):
                    started.append(self._start(self._new_unit(next(names), "router")))
                sups = [s for unit in started for s in unit.sups]
                pids = set(ray.get([s.pid.remote() for s in sups], timeout=RPC_TIMEOUT_S))
                deadline = time.monotonic() + self.cfg.startup_timeout_s
                check = lambda: self._check_started(started)  # noqa: E731
                wait_routers(self.redis_url, self.cfg.namespace, pids, deadline, check)
            except BaseException:
                self._retire(started, 10)  # a scale that fails leaves nothing it started
                raise
        elif n < len(live):
            self._retire(live[n:][::-1], self.cfg.router.drain_s + 10)

    # deploy.scaling.GroupLauncher
    def live_groups(self, role: str) -> list[Unit]:
        """The role's groups, oldest first, but those given up on (a dead one is relaunched by the
        watcher, so it counts)."""
        with self.lock:
            return [u for u in self.units.values() if u.role == role and u.state in ("new", "running")]

    def start_group(self, role: str, kind: int) -> Unit:
        return self._start(self._new_group(role, kind))

    def wait_ready(self, started: list[Unit], deadline: float) -> None:
        from kvferry.deploy.readiness import wait_until_ready

        wait_until_ready(
            self.router_addr, self._want, deadline, None, self._event, root_certificates=self._router_roots()
        )

    def _router_roots(self) -> bytes | None:
        """The router's certificate, the probe's root, when it serves TLS (read on the head node)."""
        certfile = self.cfg.router.ssl_certfile
        return Path(certfile).read_bytes() if certfile else None

    def discard(self, started: list[Unit]) -> None:
        for unit in started:
            with unit.lock:  # waits for a relaunch in progress
                unit.state = "draining"  # the watcher leaves it alone
            self._free(unit)
            with self.lock:
                self.units.pop(unit.name, None)
            self._event(f"{unit.name} discarded (the scale failed)")

    def retire(self, units: list[Unit]) -> None:
        self._retire(units, self.cfg.drain_timeout_s + 10)

    def say(self, text: str) -> None:
        self._event(text)

    def _retire(self, units: list[Unit], timeout_s: float) -> None:
        """SIGTERM every rank of `units` (workers drain), wait for them to exit, then free the actors
        and placement groups."""
        for unit in units:
            with unit.lock:  # waits for a relaunch in progress
                unit.state = "draining"
        for unit in units:
            for sup in unit.sups:
                with contextlib.suppress(RayActorError, GetTimeoutError):
                    ray.get(sup.terminate.remote(), timeout=RPC_TIMEOUT_S)
        deadline = time.monotonic() + timeout_s
        for unit in units:
            for sup in unit.sups:
                while time.monotonic() < deadline:
                    try:
                        if ray.get(sup.poll.remote(), timeout=RPC_TIMEOUT_S) is not None:
                            break
                    except (RayActorError, GetTimeoutError):
                        break
                    time.sleep(0.2)
            self._free(unit)
            with self.lock:
                self.units.pop(unit.name, None)
            self._event(f"{unit.name} stopped")

    def _free(self, unit: Unit) -> None:
        for sup in unit.sups:
            with contextlib.suppress(Exception):
                ray.get(sup.kill.remote(), timeout=RPC_TIMEOUT_S)
            with contextlib.suppress(Exception):
                ray.kill(sup, no_restart=True)
        unit.sups = []
        if unit.pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(unit.pg)
            unit.pg = None

    # -- units ----------------------------------------------------------------------------------------
    def _event(self, text: str) -> None:
        log.info("%s", text)
        self.events = [*self.events[-199:], f"{time.strftime('%H:%M:%S')} {text}"]
        self.event_count += 1

    def _new_unit(self, name: str, role: str, **kw) -> Unit:
        unit = Unit(name, role, **kw)
        with self.lock:
            self.units[name] = unit
        return unit

    def _new_group(self, role: str, kind: int) -> Unit:
        return self._new_unit(
            f"{role}-{next(self.names[role])}", role, kind=kind, size=self.cfg.group_size(role, kind)
        )

    def _bundle(self, unit: Unit) -> dict:
        return self.cfg.bundle(unit.role, unit.kind, self._ray_gpus())

    @staticmethod
    def _ray_gpus() -> bool:
        return ray.cluster_resources().get("GPU", 0) > 0

    def _actor_options(self, resources: dict) -> dict:
        resources = dict(resources)
        return {
            "num_cpus": resources.pop("CPU", 0),
            "num_gpus": resources.pop("GPU", 0),
            "resources": resources,
            "max_restarts": self.cfg.ray.max_restarts,
            "max_task_retries": 0,
        }

    def _create_actors(self, unit: Unit) -> None:
        cls = ray.remote(Supervisor)
        if unit.role in ("prefill", "decode"):
            bundle = self._bundle(unit)
            if unit.pg is None:
                unit.pg = placement_group(
                    [bundle] * unit.size,
                    strategy="STRICT_PACK",
                    name=f"kvferry-{self.cfg.namespace}-{unit.name}",
                )
                try:
                    ray.get(unit.pg.ready(), timeout=self.cfg.startup_timeout_s)
                except GetTimeoutError:
                    raise LaunchError(
                        f"cannot place {unit.name}: {unit.size} bundle(s) of {bundle} on one node "
                        f"(the cluster has {ray.available_resources()} available)"
                    ) from None
            unit.sups = [
                cls.options(
                    **self._actor_options(bundle),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        unit.pg, placement_group_bundle_index=rank
                    ),
                ).remote(self._rank_name(unit, rank), self.log_dir)
                for rank in range(unit.size)
            ]
        elif unit.role == "pool":
            strategy = NodeAffinitySchedulingStrategy(unit.node_id, soft=False) if unit.node_id else "SPREAD"
            unit.sups = [
                cls.options(
                    **self._actor_options(self.cfg.pool.resources), scheduling_strategy=strategy
                ).remote(unit.name, self.log_dir)
            ]
        else:  # router, redis: on the head node
            unit.sups = [cls.options(**self._actor_options(HEAD)).remote(unit.name, self.log_dir)]

    @staticmethod
    def _rank_name(unit: Unit, rank: int) -> str:
        return unit.name if unit.size == 1 else f"{unit.name}.r{rank}"

    def _start(self, unit: Unit) -> Unit:
        """The first launch of a new unit; one that cannot start leaves nothing behind (no actors, no
        placement group holding resources, no entry the readiness checks would wait for)."""
        try:
            return self._launch(unit)
        except BaseException:
            self._free(unit)
            with self.lock:
                self.units.pop(unit.name, None)
            raise

    def _launch(self, unit: Unit) -> Unit:
        """(Re)start every process of `unit` (creating its actors first if it has none)."""
        from kvferry.deploy.local import pool_argv, redis_env, redis_server_argv, router_argv, worker_argv

        cfg = self.cfg
        if not unit.sups:
            self._create_actors(unit)
        unit.where = ray.get([s.where.remote() for s in unit.sups], timeout=self.cfg.startup_timeout_s)
        ip = unit.where[0]["ip"]
        check_node_address(ip, alive_nodes())
        env = {SECRET_ENV: self.secret} if self.secret else {}
        files = None
        if unit.role == "redis":
            unit.port = unit.port or ray.get(unit.sups[0].free_port.remote(), timeout=RPC_TIMEOUT_S)
            files = {"redis.conf": f"requirepass {self.redis_password}\n"}
            tls = None
            if self.ca is not None:  # TLS only, with a leaf of the cluster CA (deploy.redis_server)
                files.update(tls_files(self.ca.issue(ip)))
                tls = [f"{{file:{name}}}" for name in REDIS_TLS_FILES]
            argvs = [redis_server_argv("{host}", unit.port, config=Path("{file:redis.conf}"), tls=tls)]
            self.redis_url = redis_url(ip, unit.port, self.redis_password, tls is not None)
        elif unit.role == "pool":
            argvs = [pool_argv(cfg, self.layout, unit.name, "{host}")]
        elif unit.role == "router":
            host = cfg.router.host
            first = self.units.get("router")  # the fleet's ports are the first router's (SO_REUSEPORT)
            shared = first if first is not None and first is not unit else None
            unit.port = (
                unit.port
                or (shared.port if shared else 0)
                or cfg.router.port
                or ray.get(unit.sups[0].free_port.remote())
            )
            if cfg.router.http_port is not None:
                unit.http_port = (
                    unit.http_port
                    or (shared.http_port if shared else None)
                    or cfg.router.http_port
                    or ray.get(unit.sups[0].free_port.remote())
                )
            argvs = [router_argv(cfg, cfg.model, host, unit.port, unit.http_port)]
            if cfg.router.api_keys:
                env[API_KEY_ENV] = ",".join(cfg.router.api_keys)
            reach = ip if host in ("0.0.0.0", "::", "") else host
            self.router_addr = f"{reach}:{unit.port}"
            self.http_url = "" if unit.http_port is None else f"http://{reach}:{unit.http_port}"
        else:
            base = worker_argv(cfg, unit.role, unit.kind, unit.name, cfg.model, "{host}")
            argvs = [base]
            if unit.size > 1:  # the ranks meet in the cluster's Redis under a name new at each launch
                init = fresh_name(unit.name)
                argvs = [[*base, "--rank", str(r), "--dist-init", init] for r in range(unit.size)]
        if unit.role != "redis":
            env.update(redis_env(self.redis_url))
        argvs = [["{python}" if a == sys.executable else a for a in argv] for argv in argvs]
        threads = max(1, int(self._bundle(unit).get("CPU", 1))) if unit.role in ("prefill", "decode") else 1
        env["KVFERRY_NUM_THREADS"] = str(threads)
        envs = [{**env, **self._leaf_env(unit, where["ip"])} for where in unit.where]
        ray.get(
            [s.launch.remote(a, e, files) for s, a, e in zip(unit.sups, argvs, envs, strict=True)],
            timeout=RPC_TIMEOUT_S,
        )
        unit.state = "running"
        return unit

    def _leaf_env(self, unit: Unit, ip: str) -> dict[str, str]:
        """A new leaf for one rank of `unit` on the node at `ip`: {} without TLS, and for redis."""
        if self.ca is None or unit.role == "redis":
            return {}
        return self.ca.issue(ip).env()

    def _check_started(self, units: list[Unit] | None = None) -> None:
        """During start: a component that exited is a launch error (with its log), not a restart."""
        for unit in units if units is not None else list(self.units.values()):
            problem = self._problem(unit)
            if problem is not None:
                rank, why = problem
                tail = ""
                with contextlib.suppress(Exception):
                    tail = ray.get(unit.sups[rank].log_tail.remote(), timeout=RPC_TIMEOUT_S)
                raise LaunchError(f"{self._rank_name(unit, rank)} {why} during startup; its log:\n{tail}")

    def _problem(self, unit: Unit) -> tuple[int, str] | None:
        """(rank, what is wrong) with the first rank of `unit` that is not running, or None."""
        try:
            codes = ray.get([s.poll.remote() for s in unit.sups], timeout=RPC_TIMEOUT_S)
        except RayActorError:
            return 0, "lost its actor"
        except GetTimeoutError:
            return 0, "did not answer"
        for rank, code in enumerate(codes):
            if code == NOT_LAUNCHED:
                return rank, "was restarted by Ray"
            if code is not None:
                return rank, f"exited with code {code}"
        return None

    def _want(self) -> tuple[int, int, int]:
        """(prefill, decode, pool) registry members of the units meant to serve now."""
        with self.lock:
            live = [u for u in self.units.values() if u.state in ("new", "running")]
        return (
            sum(1 for u in live if u.role == "prefill"),
            sum(u.size for u in live if u.role == "decode"),
            sum(1 for u in live if u.role == "pool"),
        )

    # -- the watcher ----------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if not self.cfg.colocated:
                try:
                    self._reconcile_pool()
                except Exception:
                    log.exception("reconciling pool nodes failed (retrying)")
            with self.lock:
                units = [u for u in self.units.values() if u.state == "running"]
            for unit in units:  # one unit's trouble must not keep the others unwatched
                if self._stop.is_set():
                    return
                try:
                    problem = self._problem(unit)
                    if problem is not None:
                        with unit.lock:
                            self._recover(unit, problem)
                except Exception:
                    log.exception("recovering %s failed (retrying)", unit.name)

    def _recover(self, unit: Unit, problem: tuple[int, str]) -> None:
        """Relaunch `unit` whole (called with unit.lock held)."""
        rank, why = problem
        with self.lock:
            current = self.units.get(unit.name) is unit
        if unit.state != "running" or not current or self._stop.is_set():
            return  # retired, or shutting down, meanwhile
        unit.restarts += 1
        if unit.restarts > self.cfg.ray.max_restarts:
            unit.state = "failed"
            self._event(
                f"{self._rank_name(unit, rank)} {why}; {unit.name} failed {unit.restarts} times: given up"
            )
            self._free(unit)
            return
        self._event(f"{self._rank_name(unit, rank)} {why}: relaunching {unit.name} (restart {unit.restarts})")
        for sup in unit.sups:  # every rank: a group is rebuilt whole
            try:
                ray.get(sup.kill.remote(), timeout=RPC_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):  # gone for good or stuck: new actors, same bundles
                self._free_actors_only(unit)
                break
        self._launch(unit)

    def _free_actors_only(self, unit: Unit) -> None:
        for sup in unit.sups:
            with contextlib.suppress(Exception):
                ray.kill(sup, no_restart=True)
        unit.sups = []

    def _reconcile_pool(self) -> None:
        """One pool node per live Ray node (per_ray_node), or pool.nodes spread."""
        if not self.cfg.pool.per_ray_node:
            with self.lock:
                missing = self.cfg.pool.nodes - sum(1 for u in self.units.values() if u.role == "pool")
            for _ in range(missing):
                self._start(self._new_unit(f"pool-{next(self.names['pool'])}", "pool"))
            return
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        with self.lock:
            have = {u.node_id: u for u in self.units.values() if u.role == "pool"}
        for node_id in alive:
            if node_id not in have:
                self._start(self._new_unit(f"pool-{node_id[:8]}", "pool", node_id=node_id))
        for node_id, unit in have.items():
            if node_id not in alive and unit.state == "running":
                self._event(f"Ray node {node_id[:8]} left: dropping {unit.name}")
                unit.state = "draining"
                self._free_actors_only(unit)
                with self.lock:
                    self.units.pop(unit.name, None)

    # -- introspection --------------------------------------------------------------------------------
    def status(self) -> dict:
        with self.lock:
            units = list(self.units.values())
        return {
            "phase": self.phase,
            "router": self.router_addr,
            "http": self.http_url,
            "redis_url": mask_url(self.redis_url),
            "log_dir": self.log_dir,
            "units": [
                {
                    "name": u.name,
                    "role": u.role,
                    "state": u.state,
                    "restarts": u.restarts,
                    "ranks": [{k: w[k] for k in ("node_id", "ip", "gpus")} for w in u.where],
                }
                for u in sorted(units, key=lambda u: (u.role, u.name))
            ],
            "events": self.events[-50:],
            "event_count": self.event_count,
        }

    def operator_tls(self, hours: float = 24.0) -> dict[str, str]:
        """A client certificate for an operator's tool (tests, `grpcurl`) to call the internal ports:
        the KVFERRY_TLS_* environment of a new leaf valid for `hours` ({}: the cluster is plaintext).
        Only a Ray driver holding the Ray cluster's token can ask."""
        import datetime

        return {} if self.ca is None else self.ca.issue(validity=datetime.timedelta(hours=hours)).env()

    def full_redis_url(self) -> str:
        """The Redis URL with its password (status() shows it masked): tests, operators' tools."""
        return self.redis_url

    def actors(self, name: str) -> list:
        """The supervisor actors of a unit (tests, operators: e.g. ray.kill one to see recovery)."""
        with self.lock:
            return list(self.units[name].sups)


# -- driver side: what the CLI calls ----------------------------------------------------------------------
def connect(address: str | None, **kwargs) -> None:
    """Join the Ray cluster at `address` (None: RAY_ADDRESS, a cluster started on this machine with
    `ray start`, or else a new local one). Raises LaunchError when it cannot, saying what to check: a
    multi-node Ray cluster asks every driver for its token."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, namespace=RAY_NAMESPACE, **kwargs)
    except ConnectionError as err:
        token = "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ
        token = token or (Path.home() / ".ray" / "auth_token").exists()
        hint = (
            "the cluster's token: RAY_AUTH_MODE=token with RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or "
            "~/.ray/auth_token) holding the token its head was started with"
        )
        if os.environ.get("RAY_AUTH_MODE") != "token" or not token:
            hint = f"this process has no Ray token; a cluster with token authentication needs {hint}"
        else:
            hint = f"is the token this process has {hint}?"
        raise LaunchError(
            f"cannot join the Ray cluster at {address or 'auto'} ({err}): is it up and reachable from "
            f"here (a driver runs on one of its nodes)? {hint} (docs/multihost.md)"
        ) from None


def alive_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"])


def check_node_address(ip: str, nodes: int) -> None:
    """Refuse a component on a Ray node with a loopback address when the cluster has other nodes: they
    could not reach it (its hostname resolves to loopback, e.g. Debian's 127.0.1.1 line in /etc/hosts,
    and the node was started without --node-ip-address)."""
    from kvferry.deploy.config import is_loopback

    if nodes > 1 and is_loopback(ip):
        raise LaunchError(
            f"a Ray node has the loopback address {ip} in a cluster of {nodes} nodes, so the others "
            "cannot reach what kvferry starts there: start that node with `ray start "
            "--node-ip-address <its address on the cluster network>`"
        )


def get_controller(namespace: str):
    try:
        return ray.get_actor(controller_name(namespace), namespace=RAY_NAMESPACE)
    except ValueError:
        raise LaunchError(
            f"no kvferry cluster with namespace {namespace!r} runs on this Ray cluster "
            f"(no actor {controller_name(namespace)!r} in Ray namespace {RAY_NAMESPACE!r})"
        ) from None


def up(cfg: ClusterConfig, detach: bool = False, say=print):
    """Create the controller and start the cluster; returns (controller, status). Prints progress.
    The cluster secret (the config's, this process's, or a new one) reaches the controller by its
    runtime env, not by its arguments."""
    from dataclasses import replace

    from kvferry.deploy.config import cluster_config_to_dict

    cfg.validate()
    nodes = alive_nodes()
    if nodes > 1 and os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true"):
        say(
            f"warning: this Ray cluster has {nodes} nodes and Ray's TLS is off: the controller hands each "
            "process the cluster secret and its TLS key through Ray's RPC, in clear on the network "
            "(RAY_USE_TLS=1 on every node; docs/multihost.md)"
        )
    secret = cfg.cluster_secret or cluster_secret() or new_secret()
    cfg = replace(cfg, cluster_secret=None)
    try:
        get_controller(cfg.namespace)
    except LaunchError:
        pass  # none yet: good
    else:
        raise LaunchError(
            f"a kvferry cluster with namespace {cfg.namespace!r} already runs on this Ray cluster "
            "(kvferry down --ray, or pick another namespace)"
        )
    ctrl = (
        ray.remote(Controller)
        .options(
            name=controller_name(cfg.namespace),
            namespace=RAY_NAMESPACE,
            lifetime="detached" if detach else None,
            num_cpus=0,
            resources=HEAD,
            max_concurrency=8,
            runtime_env={"env_vars": {SECRET_ENV: secret}},
        )
        .remote(json.dumps(cluster_config_to_dict(cfg)))
    )
    started = ctrl.start.remote()
    seen = 0
    try:
        while True:
            ready, _ = ray.wait([started], timeout=1.0)
            with contextlib.suppress(Exception):
                seen = _report(ray.get(ctrl.status.remote(), timeout=10), seen, say)
            if ready:
                return ctrl, ray.get(started)
    except RayTaskError as err:
        down(ctrl)
        cause = err.cause if isinstance(getattr(err, "cause", None), Exception) else err
        raise LaunchError(str(cause)) from None
    except BaseException:
        down(ctrl)
        raise


def down(ctrl) -> None:
    with contextlib.suppress(Exception):
        ray.get(ctrl.shutdown.remote(), timeout=600)
    with contextlib.suppress(Exception):
        ray.kill(ctrl, no_restart=True)


def run_until_signal(ctrl, say=print) -> None:
    """Foreground `up`: report the controller's events until SIGINT/SIGTERM (then the caller stops it)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    seen = ray.get(ctrl.status.remote())["event_count"]
    while not stop.wait(2.0):
        try:
            seen = _report(ray.get(ctrl.status.remote(), timeout=10), seen, say)
        except (RayActorError, GetTimeoutError) as err:
            say(f"kvferry: the controller is unreachable: {err}")
            return


def _report(status: dict, seen: int, say) -> int:
    """Print the controller's events after the first `seen`; returns how many there are now."""
    new = min(status["event_count"] - seen, len(status["events"]))
    for line in status["events"][len(status["events"]) - new :] if new > 0 else []:
        say(line)
    return status["event_count"]
