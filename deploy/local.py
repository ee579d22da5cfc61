"""`kvferry up`: the whole cluster as local processes.

Start order: redis-server (unless --redis-url) -> pool node(s) -> prefill and decode workers -> router.
Each child is its own process (`python -m kvferry.<component>`), logs to <log dir>/<name>.log, binds
127.0.0.1 by default and dies with the launcher (PR_SET_PDEATHSIG), so even a killed launcher leaves
nothing behind. `up` waits until the router reports every worker and pool node, prints a line with
`ready` and the router address, and on SIGINT/SIGTERM stops the children in reverse order.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from kvferry.deploy.config import ClusterConfig
from kvferry.kvpool.transfer import BlockLayout, dtype_name
from kvferry.model.config import ModelConfig, resolve_dtype
from kvferry.model.create import resolve_model
from kvferry.model.parallel import ParallelConfigError, check_ep, check_tp
from kvferry.rpc import check_health
from kvferry.settings import load_settings

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the launcher dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


@dataclass
class LocalCluster:
    cfg: ClusterConfig
    log_dir: Path | None = None
    quiet: bool = False
    children: list[Child] = field(default_factory=list)
    redis_url: str = ""
    router_addr: str = ""
    _tmp: Path | None = None

    def _say(self, text: str) -> None:
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
                preexec_fn=die_with_parent,
                env={**os.environ, **(env or {})},
            )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def _check_alive(self) -> None:
        for child in self.children:
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
        model_dir = resolve_model(cfg.model, load_settings().models_dir)  # creates built-ins once
        check_degrees(cfg, ModelConfig.from_dir(model_dir))
        host = cfg.router.host
        py = [sys.executable, "-m"]

        if cfg.redis_url:
            self.redis_url = cfg.redis_url
        else:
            self.redis_url = self._start_redis(host, deadline)
        self._say(f"redis       {self.redis_url}")

        layout = cluster_layout(cfg, model_dir)
        slots = max(16, int(cfg.pool.memory_gib * 2**30 // layout.block_bytes))
        common = ["--host", host, "--redis-url", self.redis_url, "--namespace", cfg.namespace]
        for i in range(0 if cfg.colocated else cfg.pool.nodes):
            self._spawn(
                f"pool-{i}",
                [
                    *py,
                    "kvferry.kvpool",
                    "--node-id",
                    f"pool-{i}",
                    *common,
                    "--layout",
                    ",".join(map(str, layout.to_list())),
                    "--num-slots",
                    str(slots),
                ],
            )
        threads = str(max(1, (os.cpu_count() or 1) // cfg.processes()))
        env = {} if os.environ.get("KVFERRY_NUM_THREADS") else {"KVFERRY_NUM_THREADS": threads}
        for group in cfg.roles():
            names = itertools.count()
            for index, settings in enumerate(cfg.groups(group)):
                engine_args = engine_flags(replace(cfg.engine_config(group, index), model=str(model_dir)))
                for _ in range(settings.replicas):
                    name = f"{group}-{next(names)}"
                    argv = [*py, f"kvferry.{group}_worker", "--worker-id", name, *common, *engine_args]
                    self._spawn(name, argv, env)
        port = cfg.router.port or free_port(host)
        self._spawn(
            "router",
            [
                *py,
                "kvferry.router",
                "--model",
                str(model_dir),
                *common,
                "--port",
                str(port),
                "--max-inflight",
                str(cfg.router.max_inflight),
                *(["--colocated"] if cfg.colocated else []),
            ],
        )
        self.router_addr = f"{host}:{port}"
        self._wait_ready(deadline)
        return self.router_addr

    def _start_redis(self, host: str, deadline: float) -> str:
        port = free_port(host)
        self._spawn("redis", redis_server_argv(host, port))
        return wait_for_redis(host, port, deadline, self._check_alive)

    def _wait_ready(self, deadline: float) -> None:
        from kvferry.router.client import Client

        cfg = self.cfg
        # a prefill group registers once (rank 0 serves it), a decode group once per rank
        want = (cfg.members("prefill"), cfg.members("decode"), 0 if cfg.colocated else cfg.pool.nodes)
        last = None
        with Client(self.router_addr) as client:
            while True:
                self._check_alive()
                if check_health(self.router_addr):
                    try:
                        info = client.model_info(timeout=2)
                        have = (info.num_prefill_workers, info.num_decode_workers, info.num_pool_nodes)
                    except grpc.RpcError:
                        have = None
                    if have == want:
                        return
                    if have != last:
                        last = have
                        self._say(f"waiting: prefill/decode/pool {have} of {want}")
                if time.monotonic() > deadline:
                    raise LaunchError(f"the cluster was not ready within {cfg.startup_timeout_s:.0f}s")
                time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop children in reverse start order: SIGTERM, then SIGKILL after `timeout_s`."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while child.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
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


def cluster_layout(cfg: ClusterConfig, model_dir: Path) -> BlockLayout:
    """The pool's block layout: what the workers will compute (same dtype resolution as the engine)."""
    import torch

    model_cfg = ModelConfig.from_dir(model_dir)
    engine = cfg.engine_config("decode")
    device = (
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if engine.device == "auto"
        else (torch.device(engine.device))
    )
    dtype = resolve_dtype(cfg.dtype, model_cfg, device)
    return BlockLayout(
        model_cfg.num_layers, model_cfg.num_kv_heads, engine.block_size, model_cfg.head_dim, dtype_name(dtype)
    )


def engine_flags(engine) -> list[str]:
    """EngineConfig -> the worker's command-line flags."""
    from dataclasses import fields

    out = []
    for f in fields(engine):
        value = getattr(engine, f.name)
        if value is None:
            continue
        flag = "--" + ("engine-seed" if f.name == "seed" else f.name.replace("_", "-"))
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def run_until_signal(cluster: LocalCluster) -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        for child in cluster.children:
            if child.proc.poll() is not None and not child.reported:
                child.reported = True
                print(
                    f"kvferry: {child.name} exited with code {child.proc.returncode}; see {child.log}",
                    file=sys.stderr,
                    flush=True,
                )
