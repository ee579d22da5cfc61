"""What a prefill and a decode worker process share: the engine thread, the CLI, registration.

The engine is single-threaded: gRPC handler threads never touch it, they hand closures to the
`EngineLoop` inbox, and the loop runs them between steps. A worker registers itself in the Redis
registry (role prefill|decode) with a heartbeat so the router finds it and notices when it dies.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import queue
import signal
import threading
import uuid
from collections import Counter
from collections.abc import Callable

import grpc

from kvferry.decode_worker.engine import EngineConfig, LLMEngine
from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import BlockLayout, dtype_name
from kvferry.rpc import Heartbeat, hard_exit, service_names, set_serving, start_server
from kvferry.v1 import worker_pb2

log = logging.getLogger(__name__)


class EngineLoop(threading.Thread):
    """Runs `engine.step()` while there is work; runs submitted closures between steps."""

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable,
        idle_hook: Callable[[], bool] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ):
        super().__init__(name="engine", daemon=True)
        self.engine = engine
        self.on_outputs = on_outputs
        self.idle_hook = idle_hook  # extra work the loop polls (returns True when it did something)
        self.on_error = on_error  # a step failed: fail the requests in flight (the loop goes on)
        self.inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopped = threading.Event()

    def submit(self, fn: Callable[[], None]) -> None:
        self.inbox.put(fn)
        self.wake.set()

    def call(self, fn: Callable[[], object], timeout_s: float = 30.0) -> object:
        """Run `fn` on the engine thread between steps and return its result (for handler threads)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.submit(lambda: done.set_result(fn()))
        return done.result(timeout=timeout_s)

    def run(self) -> None:
        while not self.stopped.is_set():
            ran = self._drain()
            if self.idle_hook is not None:
                try:
                    ran = self.idle_hook() or ran
                except Exception:
                    log.exception("engine idle work failed")
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as err:
                    log.exception("engine step failed")
                    if self.on_error is not None:
                        self.on_error(err)
                    continue
                try:
                    self.on_outputs(outputs)
                except Exception:
                    log.exception("delivering engine outputs failed")
            elif not ran:
                self.wake.wait(0.05)
                self.wake.clear()

    def _drain(self) -> bool:
        ran = False
        while True:
            try:
                fn = self.inbox.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                fn()
            except Exception:
                log.exception("engine task failed")

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()


class EngineWorker:
    """What both worker services share: the engine thread, one KV transfer thread, counters, info/stats.

    Subclasses set `role`, create `self.loop` (an EngineLoop with their hooks) and list the requests
    they hold in `active_ids()`.
    """

    role = ""

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str):
        self.engine = engine
        self.pool = pool
        self.worker_id = worker_id
        self.counters: Counter[str] = Counter()
        self.transfers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-{self.role}")
        self.loop: EngineLoop

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self.loop.join(5)
        self.transfers.shutdown(wait=True)

    def active_ids(self) -> list[str]:
        raise NotImplementedError

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
            **extra,
        )


def kv_layout(engine: LLMEngine) -> BlockLayout:
    cfg = engine.model.cfg
    return BlockLayout(
        cfg.num_layers, cfg.num_kv_heads, engine.cfg.block_size, cfg.head_dim, dtype_name(engine.dtype)
    )


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
    p.add_argument("--worker-id", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--namespace", default="default")
    p.add_argument("--heartbeat-s", type=float, default=1.0)


def run_worker(role: str, make_servicer, add_to_server, descriptor, argv: list[str] | None) -> int:
    """Parse worker flags, build the engine + pool client, serve until SIGTERM/SIGINT."""
    from kvferry.cli import engine_config_from

    p = argparse.ArgumentParser(prog=f"python -m kvferry.{role}_worker")
    add_worker_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    worker_id = args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    cfg: EngineConfig = engine_config_from(args)
    engine = LLMEngine(cfg)
    meta = MetadataStore(args.redis_url, args.namespace)
    pool = PoolClient(meta, kv_layout(engine), peer_id=worker_id, host=args.host, device=str(engine.device))
    servicer = make_servicer(engine, pool, worker_id)
    names = service_names(descriptor)
    server, port, health = start_server(lambda s: add_to_server(servicer, s), names, args.host, args.port, 64)
    addr = f"{args.host}:{port}"

    def info() -> dict:
        return {"addr": addr, **servicer.load()}

    heartbeat = Heartbeat(meta, role, worker_id, info, args.heartbeat_s, 5 * args.heartbeat_s)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    servicer.start()
    heartbeat.beat()
    heartbeat.start()
    set_serving(health, names)
    log.info("%s worker %s serving on %s", role, worker_id, addr)
    stop.wait()
    set_serving(health, names, False)
    heartbeat.stop()
    server.stop(grace=3).wait()
    servicer.stop()
    pool.close()
    hard_exit(0)


def abort_invalid(context: grpc.ServicerContext, message: str) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
