"""The worker process runtime both workers run: flags, group forming, the process main, drain.

`python -m kvferry.prefill_worker` / `kvferry.decode_worker` call `run_worker` with their `WorkerRole`:
their servicer, and what only that role has (its own flags, its group's parallel layout, what a rank
that serves nothing runs). Nothing here branches on the role. It forms the worker group
(`kvferry.worker.group`), builds the engine and the pool client, serves the gRPC service (a grpc.aio
server on its own thread, `kvferry.rpc.AioServer`), registers the worker in the Redis registry (role
prefill|decode) with a heartbeat so the router finds it and notices when it dies or hangs (no
re-registration while the engine loop is stalled), and on SIGTERM/SIGINT drains: the registry says it
is draining, it finishes what it holds, then exits. A prefill worker also publishes its backlog (the
prompt tokens it still has to compute, per priority) on a faster channel than its heartbeat, for the
routers' SLO admission (`kvferry.worker.backlog`: a thread of its own, from start to shutdown).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.flags import SETTINGS, ConfigError, add_config_args, config_from
from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.config import WORKER_SETTINGS, PoolConfig
from kvferry.kvpool.metadata import MetadataStore, add_redis_url_arg
from kvferry.model.parallel import Comm, Parallel
from kvferry.proc import confine_openmp, on_passing_thread, run_torch_serially, settle_heap
from kvferry.rpc import AioServer, Heartbeat, hard_exit, service_names
from kvferry.worker.backlog import BacklogPublisher
from kvferry.worker.config import WorkerConfig
from kvferry.worker.group import Group, form_group
from kvferry.worker.service import EngineWorker, default_max_streams, kv_layout

log = logging.getLogger(__name__)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)
    add_config_args(p, WorkerConfig)
    add_redis_url_arg(p)
    add_config_args(p, PoolConfig, only=WORKER_SETTINGS, prefix="pool", scope=SETTINGS)


@dataclass(frozen=True)
class WorkerRole:
    """What a role's entry gives the runtime: its service, and what only that role has."""

    name: str  # prefill | decode: the process is `python -m kvferry.<name>_worker`
    servicer: Callable[..., EngineWorker]  # (engine, pool, worker_id, group)
    add_to_server: Callable[[EngineWorker, object], None]
    descriptor: object  # the service's protobuf file descriptor
    parallel: Callable[[Comm], Parallel]  # this rank's TP/EP groups, from its worker group's comm
    add_args: Callable[[argparse.ArgumentParser], None] = lambda p: None  # the role's own flags
    # check the role's flags against the engine config and apply them (SystemExit with a message)
    engine_config: Callable[[argparse.Namespace, EngineConfig], EngineConfig] = lambda args, cfg: cfg
    # applied to the servicer before it serves (with the pool's settings the workers take)
    configure: Callable[[EngineWorker, PoolConfig], None] = lambda servicer, pool: None
    # a rank > 0 of a group whose rank 0 alone serves (tensor-parallel prefill) runs this instead
    follow: Callable[[LLMEngine, PoolClient, Group], None] | None = None


def worker_parser(role: WorkerRole) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m kvferry.{role.name}_worker")
    add_worker_args(p)
    role.add_args(p)
    return p


def run_worker(role: WorkerRole, argv: list[str] | None) -> int:
    """The worker process: parse its flags, form the group, build the engine and the pool client,
    serve until SIGTERM/SIGINT, drain, stop. A rank > 0 of a group whose rank 0 alone serves (a
    tensor-parallel prefill) serves nothing: it runs `role.follow` until rank 0 stops it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = worker_parser(role).parse_args(argv)
    # torch's parallel regions run on the engine thread alone (and the thread that builds the engine,
    # then ends): a second OpenMP team anywhere in the process slows every step (kvferry.proc)
    confine_openmp(("engine", "build"))
    cfg: EngineConfig = role.engine_config(args, config_from(args, EngineConfig))
    try:
        pool_cfg = config_from(args, PoolConfig, prefix="pool")
    except ConfigError as err:
        raise SystemExit(str(err)) from None
    group_id = args.worker_id or f"{role.name}-{uuid.uuid4().hex[:8]}"
    meta = MetadataStore(args.redis_url, args.namespace)
    group, cfg = form_group(args, cfg, role.name, group_id, argv, meta)
    worker_id = group.member_id()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role.name} {worker_id} %(levelname)s %(message)s"
    )
    # built on a passing thread, so that the engine thread's OpenMP team is the process's only one
    # (kvferry.proc); the router makes the text
    engine = on_passing_thread(lambda: LLMEngine(cfg, role.parallel(group.comm), detokenize=False))
    pool = PoolClient(
        meta,
        kv_layout(engine),
        peer_id=worker_id,
        host=args.host,
        device=str(engine.device),
        replicas=pool_cfg.replicas,
        transfer_timeout_s=pool_cfg.transfer_timeout_s,
        data_interface=pool_cfg.data_interface,
    )
    serving_timeouts(group, args.group_timeout_s)
    if group.rank > 0 and role.follow is not None:
        # rank 0 tells this rank when to stop (after its drain); a signal here would break the group
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            role.follow(engine, pool, group)
        finally:
            pool.close()
        hard_exit(0)
    servicer = role.servicer(engine, pool, worker_id, group)
    servicer.max_streams = args.max_concurrent_streams or default_max_streams(cfg.max_num_seqs)
    role.configure(servicer, pool_cfg)
    if args.host_share_dir:
        servicer.loop.share_host(args.host_share_dir, role.name, cfg.decode_yield_ms)
    server = AioServer(
        lambda s: role.add_to_server(servicer, s), service_names(role.descriptor), args.host, args.port
    )
    addr = f"{args.host}:{server.port}"

    def info() -> dict:
        record = {"addr": addr, "group": group.group_id, "rank": group.rank, **servicer.load()}
        return {**record, "draining": servicer.draining}

    def stalled() -> str | None:
        return stall_reason(servicer, args.stall_timeout_s)

    heartbeat = Heartbeat(meta, role.name, worker_id, info, args.heartbeat_s, 5 * args.heartbeat_s, stalled)
    stop = servicer.drain_requested
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    servicer.start()
    heartbeat.beat()
    heartbeat.start()
    backlog = None
    if servicer.backlog is not None:
        backlog = BacklogPublisher(meta, worker_id, servicer.backlog)
        backlog.start()
    settle_heap()
    server.set_serving()
    log.info(
        "%s worker %s serving on %s (open calls <= %d)", role.name, worker_id, addr, servicer.max_streams
    )
    run_torch_serially()  # this thread only waits from now on; the engine thread computes
    stop.wait()
    drain(servicer, heartbeat, args.drain_timeout_s)
    watchdog = threading.Timer(SHUTDOWN_S, _shutdown_stuck)  # whatever hangs, the process ends
    watchdog.daemon = True
    watchdog.start()
    server.set_serving(False)
    heartbeat.stop()
    if backlog is not None:
        backlog.stop()
    server.stop(grace_s=3)
    log.info("shutdown: gRPC server stopped")
    servicer.stop()
    log.info("shutdown: engine stopped")
    group.stop_children()
    pool.close()
    log.info("shutdown: done")
    hard_exit(0)


SHUTDOWN_S = 30.0  # after the drain: server grace 3 s + engine 5 s + group ranks 10 s, with margin


def serving_timeouts(group: Group, timeout_s: float) -> None:
    """Every rank has joined and loaded its weights (under the group's setup timeout, however long one
    rank took): meet once more, then let every later collective fail after `timeout_s` (a serving
    group must not wait minutes on a rank that hangs)."""
    if group.size > 1:
        group.comm.barrier()
        group.comm.set_timeout(timeout_s)


def stall_reason(servicer: EngineWorker, limit_s: float) -> str | None:
    """Why the worker should not count as alive (None: it makes progress)."""
    loop = servicer.loop
    if loop.progress.stalled(limit_s):
        return f"the engine loop has been in one iteration for {loop.progress.stalled_for():.0f}s"
    return None


def _shutdown_stuck() -> None:
    """The orderly shutdown hung: log every thread's stack (to find out where) and exit anyway."""
    log.error("shutdown did not finish within %.0f s; every thread's stack follows", SHUTDOWN_S)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    hard_exit(1)


DRAIN_QUIET_S = 1.0  # idle this long before stopping: twice the router's registry refresh


def drain(servicer: EngineWorker, heartbeat: Heartbeat, timeout_s: float) -> None:
    """Stop taking requests (the router skips a draining worker within one registry refresh) and
    wait until the ones in flight are done, or `timeout_s`; a request that still arrives in the
    meantime is served too."""
    servicer.start_drain()
    heartbeat.beat()
    log.info("draining: no new requests; waiting for %d in flight", len(servicer.active_ids()))
    deadline = time.monotonic() + timeout_s
    quiet_since = None
    while time.monotonic() < deadline:
        if not servicer.loop.is_alive():
            return
        if servicer.idle():
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= DRAIN_QUIET_S:
                log.info("drained")
                return
        else:
            quiet_since = None
        time.sleep(0.05)
    log.warning(
        "drain timed out after %.0fs with %d request(s) in flight", timeout_s, len(servicer.active_ids())
    )
