"""The base of both worker services: the engine thread, the transfer thread, counters, info and stats.

The engine is single-threaded: the gRPC handlers (coroutines on the server's event loop,
`kvferry.rpc.AioServer`) never touch it, they hand closures to the `EngineLoop` inbox, and the loop
runs them between steps; results come back to the event loop (`call`, or a stream's queue). So an open
call holds no thread: how many a worker holds is bounded only by `max_streams` (RESOURCE_EXHAUSTED
beyond it). KV transfers (pool lookups, pulls, writes) run on one transfer thread per worker; their
hand-off stages (`kvferry.worker.stages`) are polled by the engine loop.

A prefill worker keeps a `BacklogTracker` (`kvferry.worker.backlog`): every request it admits is noted
(engine thread, one dict entry), and the work they still need is read off them by the backlog publisher's
thread and by the heartbeat (the record's `prefill_backlog`), for the routers' SLO admission.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc

from kvferry.engine.engine import LLMEngine
from kvferry.engine.loop import EngineLoop, EngineStopped
from kvferry.engine.request import InvalidRequestError, Request
from kvferry.engine.structured import CompilerBusy, compile_off_loop, replay
from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.transfer import BlockLayout, dtype_name
from kvferry.rpc import hard_exit
from kvferry.v1 import generate_pb2, worker_pb2
from kvferry.worker.backlog import BacklogTracker
from kvferry.worker.group import Group

log = logging.getLogger(__name__)


def default_max_streams(max_num_seqs: int) -> int:
    """Calls a worker holds open at most, unless told otherwise: a generous multiple of its batch (the
    rest wait in its queues; far beyond that, another worker serves them sooner)."""
    return max(1024, 4 * max_num_seqs)


class EngineWorker:
    """What both worker services share: the engine thread, one KV transfer thread, counters, info/stats.

    Subclasses set `role`, create `self.loop` (an EngineLoop whose `idle_hook` polls their hand-off
    stages), list the requests they hold in `active_ids()` and say when nothing is held (`idle`).
    """

    role = ""

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str, group: Group | None = None):
        self.engine = engine
        self.pool = pool
        self.worker_id = worker_id
        self.group = group or Group.single(worker_id)
        self.counters: Counter[str] = Counter()
        self.transfers = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kv-{self.role}")
        self.loop: EngineLoop
        self.draining = False  # takes no new requests (the registry says so); finishes the ones it has
        self.drain_requested = threading.Event()  # set by SIGTERM/SIGINT, or by a draining group mate
        self.max_streams = default_max_streams(engine.cfg.max_num_seqs)  # open Decode/Prefill calls
        self.open_streams = 0  # (event-loop thread only)
        self.grammars = engine.grammars  # structured outputs compile in the gRPC handlers, off the engine
        # a prefill worker's backlog, for the routers' SLO admission (kvferry.worker.backlog)
        self.backlog: BacklogTracker | None = None
        if self.role == "prefill":
            budget = engine.cfg.max_num_batched_tokens
            self.backlog = BacklogTracker(budget, self.holds, lambda: engine.num_steps)

    async def compile_structured(self, request, spec: tuple[str, str] | None, context):
        """The matcher of a call's structured output `spec` (None without one), compiled off the engine
        thread and brought to where the output stands (`request.output_offset` tokens made elsewhere).
        A constraint the library refuses ends the call with INVALID_ARGUMENT."""
        if spec is None:
            return None
        offset = getattr(request, "output_offset", 0)  # (a PrefillRequest has none)
        ids = request.prompt_token_ids
        made = list(ids[len(ids) - offset :]) if offset else []

        def replayed(matcher):
            replay(matcher, made)
            return matcher

        try:
            return await compile_off_loop(self.grammars, *spec, then=replayed)
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.structured: {err}")
        except CompilerBusy as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self.loop.join(5)
        self.transfers.shutdown(wait=True)

    def active_ids(self) -> list[str]:
        raise NotImplementedError

    def holds(self, request_id: str) -> bool:
        """Whether a call of this id is being served here."""
        raise NotImplementedError

    def queued(self) -> int:
        """Requests held here that the engine has not taken yet (reported as waiting)."""
        return 0

    def load(self) -> dict:
        """What the registry record says of the worker's load (the router's view of it)."""
        kv = self.engine.kv.load()
        return {
            "inflight": len(self.active_ids()),
            "waiting": kv["waiting"] + self.queued(),
            "running": kv["running"],
            "free_blocks": kv["free_blocks"],
            "total_blocks": kv["total_blocks"],
            # speculative decoding since start: draft tokens verified, and those accepted
            "spec_draft_tokens": self.engine.spec_proposed,
            "spec_accepted_tokens": self.engine.spec_accepted,
            "preemptions": kv["preemptions"],
            "priority_preemptions": kv["priority_preemptions"],
            # the fitted step-time model and the token budget a step (the router's SLO admission)
            "step_cost": self.engine.kv.step_cost(),
            "token_budget": self.engine.cfg.max_num_batched_tokens,
            "max_num_seqs": self.engine.cfg.max_num_seqs,  # the seats of a batch (the planner's decode)
            "pace_ms": self.loop.step_interval_s * 1e3,  # a paced decode's step interval (engine.loop)
            "step_interval_ms": round(self.loop.step_interval_ms, 3),  # observed between busy steps
            # a prefill worker's tokens still to compute, per priority (kvferry.worker.backlog)
            **({} if self.backlog is None else {"prefill_backlog": self.backlog.snapshot()}),
        }

    def new_request(self, request, params, what: str, matcher=None) -> Request:
        """The engine request of a call (`request`: its PrefillRequest / DecodeRequest), with the block
        keys the router hashed when they were hashed for this model. Raises InvalidRequestError (an id
        already served here: `what` says where; or the engine's validation)."""
        rid = request.request_id
        if self.holds(rid):
            raise InvalidRequestError(f"request_id {rid!r} is already {what}")
        req = self.engine.make_request(
            None, params, list(request.prompt_token_ids), rid, matcher, priority=request.priority
        )
        req.salt_key = request.keys.salt_key or None  # a salted request's keys are its own
        if request.keys.fingerprint == self.engine.fingerprint:  # hashed by the router: not again here
            self.engine.kv.adopt_keys(req, request.keys.block_keys)
        if self.backlog is not None:  # a prefill: the prefix the pool holds is pulled, not computed
            self.backlog.admitted(req, len(request.pooled) * self.engine.cfg.block_size)
        return req

    def fail_in_engine(self, err: Exception) -> None:
        """A step failed: the requests the engine holds fail (those whose KV is still on the way are
        not in any step, and go on); the worker keeps serving new ones."""
        for request_id in self.active_ids():
            engine = self.engine
            if not engine.has_request(request_id) or engine.kv.awaiting(request_id):
                continue
            engine.abort(request_id)
            self.failed(request_id, RuntimeError(f"engine step failed: {err}"))
        self.leave_group_if_broken(err)

    def failed(self, request_id: str, err: Exception) -> None:
        """Forget a request and fail its call with `err` (engine thread)."""
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
        time.sleep(0.5)  # let the server's event loop send the failed requests their errors
        self.group.stop_children(timeout_s=2)
        hard_exit(1)

    @contextlib.asynccontextmanager
    async def stream_slot(self, context):
        """Hold one of the worker's `max_streams` call slots for a Decode/Prefill call (refused with
        RESOURCE_EXHAUSTED when all are taken). Event-loop thread."""
        if self.open_streams >= self.max_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.role} worker {self.worker_id} holds {self.open_streams} calls, its limit "
                f"(--max-concurrent-streams {self.max_streams}): retry later or on another worker",
            )
        self.open_streams += 1
        try:
            yield
        finally:
            self.open_streams -= 1

    async def call(self, context, fn: Callable[[], object], timeout_s: float = 30.0):
        """Run `fn` on the engine thread and return its result, from a handler on the event loop."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.loop.call_future(fn)), timeout_s)
        except EngineStopped:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id} is stopping")
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {self.worker_id}'s engine did not answer in {timeout_s}s",
            )

    def GetWorkerInfo(self, request, context):
        return worker_info(self.engine, self.role, self.worker_id)

    async def GetStats(self, request, context):
        return await self.call(context, self._stats)

    async def GetRequestStatus(self, request, context):
        rid, owner = request.request_id, request.owner
        status = await self.call(context, lambda: self.request_status(rid, owner))
        if status is None:
            return worker_pb2.WorkerRequestStatus(found=False)
        status.request_id, status.worker = rid, self.worker_id
        return worker_pb2.WorkerRequestStatus(found=True, status=status)

    def request_status(self, request_id: str, owner: str) -> generate_pb2.RequestStatus | None:
        """Engine thread: where `owner`'s request `request_id` stands here (state and token counts);
        None when it is not here, or is another owner's (kvferry.auth.may_act_for)."""
        raise NotImplementedError

    def _stats(self, **extra) -> worker_pb2.WorkerStats:
        """The counters and engine figures every worker reports (runs on the engine thread)."""
        e, c = self.engine, self.counters
        kv = e.kv.load()
        return worker_pb2.WorkerStats(
            requests=c["requests"],
            pool_hit_tokens=c["pool_hit_tokens"],
            local_hit_tokens=c["local_hit_tokens"],
            blocks_put=c["blocks_put"],
            blocks_pulled=c["blocks_pulled"],
            recomputed_tokens=c["recomputed_tokens"],
            running=kv["running"],
            waiting=kv["waiting"],
            free_blocks=kv["free_blocks"],
            total_blocks=kv["total_blocks"],
            active_request_ids=sorted(self.active_ids()),
            steps=e.num_steps,
            group=self.group.group_id,
            rank=self.group.rank,
            tensor_parallel_size=e.cfg.tensor_parallel_size,
            expert_parallel_size=e.cfg.expert_parallel_size,
            preemptions=kv["preemptions"],
            priority_preemptions=kv["priority_preemptions"],
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
        kernels=engine.kernel_backend,
    )
