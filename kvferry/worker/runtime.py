"""What a prefill and a decode worker process share: the engine thread, the CLI, registration.

The engine is single-threaded: gRPC handler threads never touch it, they hand closures to the
`EngineLoop` inbox, and the loop runs them between steps. A worker registers itself in the Redis
registry (role prefill|decode) with a heartbeat so the router finds it and notices when it dies.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace

import grpc
import torch
import torch.distributed as dist

from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import BlockLayout, dtype_name
from kvferry.model.parallel import Comm, Parallel, init_group
from kvferry.proc import die_with_parent, free_port, settle_heap, terminate
from kvferry.rpc import Heartbeat, hard_exit, service_names, set_serving, start_server
from kvferry.v1 import worker_pb2

log = logging.getLogger(__name__)


class EngineWorker:
    """What both worker services share: the engine thread, one KV transfer thread, counters, info/stats.

    Subclasses set `role`, create `self.loop` (an EngineLoop with their hooks) and list the requests
    they hold in `active_ids()`.
    """

    role = ""

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str, group: Group | None = None):
        self.engine = engine
        self.pool = pool
        self.worker_id = worker_id
        self.group = group or Group(worker_id, 0, 1, Comm.single())
        self.counters: Counter[str] = Counter()
        self.transfers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-{self.role}")
        self.loop: EngineLoop
        self.draining = False  # takes no new requests (the registry says so); finishes the ones it has
        self.drain_requested = threading.Event()  # set by SIGTERM/SIGINT, or by a draining group mate

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self.loop.join(5)
        self.transfers.shutdown(wait=True)

    def active_ids(self) -> list[str]:
        raise NotImplementedError

    def start_drain(self) -> None:
        self.draining = True

    def idle(self) -> bool:
        """No request is held here any more (a drain can end)."""
        raise NotImplementedError

    def leave_group_if_broken(self, err: Exception) -> None:
        """After a failed step, a rank of a multi-rank group cannot know where the other ranks stand
        in their collectives: it exits (the others then fail fast and exit too; the router stops
        routing to the group when its heartbeats stop). A lone worker just goes on."""
        if self.group.size == 1:
            return
        log.error(
            "step failed in group %s (rank %d): leaving the group: %s",
            self.group.group_id,
            self.group.rank,
            err,
        )
        time.sleep(0.5)  # let the handler threads send the failed requests their errors
        self.group.stop_children(timeout_s=2)
        hard_exit(1)

    def GetWorkerInfo(self, request, context):
        return worker_info(self.engine, self.role, self.worker_id)

    def GetStats(self, request, context):
        return self.loop.call(self._stats)

    def _stats(self, **extra) -> worker_pb2.WorkerStats:
        """The counters and engine figures every worker reports (runs on the engine thread)."""
        e, c = self.engine, self.counters
        return worker_pb2.WorkerStats(
            requests=c["requests"],
            pool_hit_tokens=c["pool_hit_tokens"],
            local_hit_tokens=c["local_hit_tokens"],
            blocks_put=c["blocks_put"],
            blocks_pulled=c["blocks_pulled"],
            recomputed_tokens=c["recomputed_tokens"],
            running=len(e.scheduler.running),
            waiting=len(e.scheduler.waiting),
            free_blocks=e.block_manager.num_free_blocks,
            total_blocks=e.block_manager.num_blocks,
            active_request_ids=sorted(self.active_ids()),
            steps=e.num_steps,
            group=self.group.group_id,
            rank=self.group.rank,
            tensor_parallel_size=e.cfg.tensor_parallel_size,
            expert_parallel_size=e.cfg.expert_parallel_size,
            **extra,
        )


def kv_layout(engine: LLMEngine) -> BlockLayout:
    return BlockLayout.for_model(engine.model.cfg, engine.cfg.block_size, engine.kv_dtype)


def worker_info(engine: LLMEngine, role: str, worker_id: str) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        role=role,
        worker_id=worker_id,
        model=str(engine.model_dir),
        dtype=dtype_name(engine.dtype),
        fingerprint=engine.fingerprint.hex(),
        block_size=engine.cfg.block_size,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model.cfg.vocab_size,
        eos_token_ids=list(engine.eos_ids),
    )


def add_worker_args(p: argparse.ArgumentParser) -> None:
    from kvferry.cli import add_engine_args

    add_engine_args(p)
    p.add_argument("--worker-id", default="", help="the group's id (its ranks register as <id>.r<rank>)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--namespace", default="default")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=60.0,
        help="on SIGTERM: stop taking requests and wait up to this long for the ones in flight",
    )
    p.add_argument("--data-parallel-size", type=int, default=None, help="with --enable-expert-parallel")
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM spelling: --data-parallel-size M --enable-expert-parallel = --expert-parallel-size M",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        help="this process's rank in its group (given by an external launcher such as Ray; without it, "
        "rank 0 starts the other ranks itself)",
    )
    p.add_argument("--dist-init", default="", help="HOST:PORT of the group's TCPStore (hosted by rank 0)")


@dataclass
class Group:
    """This process's place in its worker group (a lone worker is a group of one)."""

    group_id: str
    rank: int
    size: int
    comm: Comm
    children: list[subprocess.Popen] = field(default_factory=list)
    store: object = None  # the group's TCPStore (hosted by rank 0: kept alive with the group)

    def member_id(self) -> str:
        return self.group_id if self.size == 1 else f"{self.group_id}.r{self.rank}"

    def stop_children(self, timeout_s: float = 10.0) -> None:
        terminate(self.children, timeout_s)


def form_group(
    args, cfg: EngineConfig, role: str, group_id: str, argv: list[str]
) -> tuple[Group, EngineConfig]:
    """Join (rank 0: host, and start the other ranks of) the group; returns it and this rank's config."""
    size = cfg.tensor_parallel_size * cfg.expert_parallel_size
    if size == 1:
        return Group(group_id, 0, 1, Comm.single()), cfg
    rank = args.rank or 0
    if not 0 <= rank < size:
        raise SystemExit(f"--rank {rank} is outside a group of {size}")
    if cfg.device in ("auto", "cuda") and torch.cuda.is_available():  # one GPU per rank
        cfg = replace(cfg, device=f"cuda:{rank % torch.cuda.device_count()}")
    children = []
    if args.dist_init:
        host, _, port = args.dist_init.rpartition(":")
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, wait_for_workers=False)
    else:
        if args.rank:
            raise SystemExit("--rank > 0 needs --dist-init HOST:PORT (rank 0's group store)")
        store = dist.TCPStore(args.host, free_port(args.host), size, is_master=True, wait_for_workers=False)
        init = f"{args.host}:{store.port}"
        for r in range(1, size):  # the other ranks: this command again, with their rank
            cmd = [
                sys.executable,
                "-m",
                f"kvferry.{role}_worker",
                *argv,
                "--worker-id",
                group_id,
                "--port",
                "0",
                "--rank",
                str(r),
                "--dist-init",
                init,
            ]
            # SIGKILL: a rank is of no use without rank 0 (and TP followers ignore SIGTERM)
            children.append(
                subprocess.Popen(cmd, preexec_fn=die_with_parent(signal.SIGKILL), stdin=subprocess.DEVNULL)
            )
    device = torch.device(cfg.device if cfg.device != "auto" else "cpu")
    log.info("joining group %s as rank %d of %d", group_id, rank, size)
    comm = init_group(store, group_id, rank, size, device, args.host)
    return Group(group_id, rank, size, comm, children, store), cfg


def run_worker(
    role: str, make_servicer, add_to_server, descriptor, argv: list[str] | None, follow=None
) -> int:
    """Parse worker flags, form the group, build the engine + pool client, serve until SIGTERM/SIGINT.

    `follow(engine, pool, group)`: what a rank > 0 of a tensor-parallel group runs instead of a
    service (it executes rank 0's commands until told to stop).
    """
    from kvferry.cli import engine_config_from

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=f"python -m kvferry.{role}_worker")
    add_worker_args(p)
    args = p.parse_args(argv)
    cfg: EngineConfig = engine_config_from(args)
    if args.enable_expert_parallel:
        cfg = replace(cfg, expert_parallel_size=args.data_parallel_size or cfg.expert_parallel_size)
    elif args.data_parallel_size not in (None, 1):
        raise SystemExit("--data-parallel-size > 1 needs --enable-expert-parallel (decode groups are DP+EP)")
    if role == "prefill" and cfg.expert_parallel_size > 1:
        raise SystemExit(
            "prefill groups are tensor-parallel: use --tensor-parallel-size, not expert parallelism"
        )
    if role == "decode" and cfg.tensor_parallel_size > 1:
        raise SystemExit(
            "decode groups are expert-parallel: use --expert-parallel-size, not tensor parallelism"
        )
    group_id = args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    group, cfg = form_group(args, cfg, role, group_id, argv)
    worker_id = group.member_id()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role} {worker_id} %(levelname)s %(message)s"
    )
    comm = group.comm
    parallel = (
        Parallel(comm, Comm.single()) if cfg.tensor_parallel_size > 1 else Parallel(Comm.single(), comm)
    )
    engine = LLMEngine(cfg, parallel)
    meta = MetadataStore(args.redis_url, args.namespace)
    pool = PoolClient(meta, kv_layout(engine), peer_id=worker_id, host=args.host, device=str(engine.device))
    if cfg.tensor_parallel_size > 1 and group.rank > 0:
        # rank 0 tells this rank when to stop (after its drain); a signal here would break the group
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            follow(engine, pool, group)
        finally:
            pool.close()
        hard_exit(0)
    servicer = make_servicer(engine, pool, worker_id, group)
    names = service_names(descriptor)
    server, port, health = start_server(lambda s: add_to_server(servicer, s), names, args.host, args.port, 64)
    addr = f"{args.host}:{port}"

    def info() -> dict:
        record = {"addr": addr, "group": group.group_id, "rank": group.rank, **servicer.load()}
        return {**record, "draining": servicer.draining}

    heartbeat = Heartbeat(meta, role, worker_id, info, args.heartbeat_s, 5 * args.heartbeat_s)
    stop = servicer.drain_requested
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    servicer.start()
    heartbeat.beat()
    heartbeat.start()
    settle_heap()
    set_serving(health, names)
    log.info("%s worker %s serving on %s", role, worker_id, addr)
    stop.wait()
    drain(servicer, heartbeat, args.drain_timeout_s)
    set_serving(health, names, False)
    heartbeat.stop()
    server.stop(grace=3).wait()
    servicer.stop()
    group.stop_children()
    pool.close()
    hard_exit(0)


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


def abort_invalid(context: grpc.ServicerContext, message: str) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
