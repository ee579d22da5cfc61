"""The decode worker: continuous batching behind the DecodeWorker gRPC service.

A request arrives with its prompt, the first token (sampled by the prefill worker) and where its KV
lies in the pool. It waits in WAITING_FOR_KV while a transfer thread pulls the blocks straight into
its reserved slots of the paged cache (the running batch keeps stepping meanwhile), then joins the
batch and streams tokens. Blocks the worker already caches locally are not pulled again; blocks the
pool no longer holds are recomputed here, so a pool miss costs time, never correctness.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import grpc
import torch

from kvferry.convert import sampling_from_proto
from kvferry.decode_worker.serving import EngineLoop, EngineWorker, Group, run_worker
from kvferry.engine.engine import LLMEngine
from kvferry.engine.request import InvalidRequestError, Request, RequestStatus
from kvferry.kvpool.client import PoolClient, from_proto
from kvferry.model.moe import ExpertParallelMoe
from kvferry.model.parallel import Comm
from kvferry.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class Stream:
    request: worker_pb2.DecodeRequest
    arrived: float
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    req: Request | None = None
    local: list[int] = field(default_factory=list)  # blocks found in the local prefix cache
    reserved: list[int] = field(default_factory=list)  # blocks the pulled KV lands in
    pulling: bool = False
    aborted: bool = False
    kv_ready: float = 0.0
    kv_pull_ms: float = 0.0
    pulled_tokens: int = 0
    recomputed_tokens: int = 0
    sent_first: bool = False


class DecodeWorker(EngineWorker, worker_pb2_grpc.DecodeWorkerServicer):
    role = "decode"

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str, group: Group | None = None):
        super().__init__(engine, pool, worker_id, group)
        self.streams: dict[str, Stream] = {}
        self.kv_waiting: deque[Stream] = deque()  # admitted, waiting for free blocks to pull into
        self.tombstones: dict[str, float] = {}  # aborted before their Decode call arrived
        # an expert-parallel rank steps in lock-step with the rest of its group
        self.lockstep = LockStep(engine, self.group.comm) if self.group.size > 1 else None
        self.loop = EngineLoop(
            engine,
            self._on_outputs,
            idle_hook=self._admit_waiting,
            on_error=self._fail_all,
            sync=self.lockstep,
            step_interval_ms=engine.cfg.decode_step_interval_ms,
        )
        if self.lockstep is not None:
            self.lockstep.on_group_stop = self._group_stopped
            self.lockstep.busy = lambda: bool(self.streams)
            self.lockstep.on_group_drain = self.drain_requested.set

    def start_drain(self) -> None:
        super().start_drain()
        if self.lockstep is not None:
            self.lockstep.draining = True  # the next sync tells the other ranks

    def idle(self) -> bool:
        """Nothing in flight here, or in the whole group for an expert-parallel rank (it can only stop
        with the others: every rank steps every MoE layer)."""
        if self.lockstep is not None:
            return self.lockstep.group_idle() or self.loop.stopped.is_set()
        return not self.streams

    def stop(self) -> None:
        if self.lockstep is not None:  # stop together: the next sync tells every rank
            self.lockstep.stopping = True
            self.loop.wake.set()
            self.loop.join(10)
        super().stop()

    def _group_stopped(self) -> None:
        """Engine thread: a rank announced it is stopping, so the whole group stops stepping now."""
        self.loop.stopped.set()
        self.drain_requested.set()  # another rank started it: this process shuts down too

    def active_ids(self) -> list[str]:
        return list(self.streams)

    def load(self) -> dict:
        bm, sched = self.engine.block_manager, self.engine.scheduler
        return {
            "inflight": len(self.streams),
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(self.kv_waiting),
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
        }

    # -- gRPC -----------------------------------------------------------------------------------------
    def Decode(self, request, context):
        stream = Stream(request, time.perf_counter())
        rid = request.request_id
        context.add_callback(lambda: self.loop.submit(lambda: self._abort(rid)))
        self.loop.submit(lambda: self._admit(stream))
        while True:
            item = stream.out.get()
            if isinstance(item, InvalidRequestError):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
            if isinstance(item, Exception):
                context.abort(grpc.StatusCode.INTERNAL, f"decode of {rid} failed: {item}")
            yield item
            if item.finish_reason:
                return

    def Abort(self, request, context):
        return worker_pb2.WorkerAbortResponse(found=self.loop.call(lambda: self._abort(request.request_id)))

    def _stats(self) -> worker_pb2.WorkerStats:
        return super()._stats(
            expert_load=self.lockstep.expert_load() if self.lockstep is not None else None,
            prompt_tokens_computed=self.counters["recomputed_tokens"],
            waiting_for_kv=sum(
                1 for s in self.streams.values() if s.req.status == RequestStatus.WAITING_FOR_KV
            ),
        )

    # -- engine thread --------------------------------------------------------------------------------
    def _admit(self, stream: Stream) -> None:
        r = stream.request
        params = replace(sampling_from_proto(r.sampling), stop=())  # stop strings are the router's
        if self.tombstones.pop(r.request_id, None) is not None:  # aborted before it got here
            stream.out.put(worker_pb2.DecodeResponse(finish_reason="abort"))
            return
        try:
            if r.request_id in self.streams:
                raise InvalidRequestError(f"request_id {r.request_id!r} is already decoding here")
            stream.req = self.engine.make_request(None, params, list(r.prompt_token_ids), r.request_id)
        except InvalidRequestError as err:
            stream.out.put(err)
            return
        self.streams[r.request_id] = stream
        self.counters["requests"] += 1
        if r.prefill_here:  # colocated: the ordinary engine path, prefill and decode in this batch
            self.engine.submit(stream.req)  # (its first message reports prefix-cache hits, no hand-off)
            return
        stream.req.status = RequestStatus.WAITING_FOR_KV
        if not self._start_pull(stream):
            self.kv_waiting.append(stream)

    def _start_pull(self, stream: Stream) -> bool:
        """Take local hits, reserve blocks for the rest and start the pull; False if blocks are short."""
        req, bm = stream.req, self.engine.block_manager
        locations = [from_proto(x) for x in stream.request.blocks]
        bm.update_keys(req)
        usable = 0  # leading locations whose keys match ours (a different model's KV is never used)
        for i, loc in enumerate(locations[: bm.blocks_needed(req.num_prompt_tokens)]):
            if i < len(req.block_keys) and loc.key != req.block_keys[i]:
                break
            usable += 1
        locations = locations[:usable]
        local = bm.take_cached(req.block_keys[: min(usable, len(req.block_keys))])
        reserved = bm.reserve(len(locations) - len(local))
        if reserved is None:
            bm.release(local)
            if bm.num_blocks - bm.num_free_blocks == 0:  # could never fit: recompute instead
                local, reserved, locations = [], [], []
            else:
                return False
        stream.local, stream.reserved, stream.pulling = local, reserved, True
        remote = locations[len(local) :]
        self.transfers.submit(self._pull, stream, remote)
        return True

    def _admit_waiting(self) -> bool:
        started = False
        while self.kv_waiting and self._start_pull(self.kv_waiting[0]):
            self.kv_waiting.popleft()
            started = True
        return started

    def _pull(self, stream: Stream, remote: list) -> None:
        """Transfer thread: pool -> reserved blocks of the paged cache."""
        started, n = time.perf_counter(), 0
        if remote:
            try:  # any failure means: recompute what did not arrive (the request itself goes on)
                cache = self.engine.runner.kv_cache
                n = self.pool.pull_into_cache(stream.req.request_id, remote, cache, stream.reserved)
            except Exception as err:
                log.warning("pulling KV of %s failed, recomputing: %s", stream.req.request_id, err)
                n = 0  # a partial landing is not trusted
        stream.kv_pull_ms = (time.perf_counter() - started) * 1e3
        self.loop.submit(lambda: self._kv_ready(stream, n))

    def _kv_ready(self, stream: Stream, served: int) -> None:
        bm, req = self.engine.block_manager, stream.req
        stream.pulling = False
        bm.release(stream.reserved[served:])
        blocks = stream.local + stream.reserved[:served]
        if stream.aborted:
            bm.release(blocks)
            self._finish(stream, "abort")
            return
        bs = bm.block_size
        covered = min(stream.request.num_kv_tokens, len(blocks) * bs, req.num_prompt_tokens)
        stream.pulled_tokens = min(served * bs, covered)
        stream.recomputed_tokens = req.num_prompt_tokens - covered
        self.counters["blocks_pulled"] += served
        self.counters["pool_hit_tokens"] += stream.pulled_tokens
        self.counters["local_hit_tokens"] += min(len(stream.local) * bs, covered)
        self.counters["recomputed_tokens"] += stream.recomputed_tokens
        if covered == 0:
            bm.release(blocks)
            blocks = []
        stream.kv_ready = time.perf_counter()
        self.engine.add_with_kv(req, stream.request.first_token_id, blocks, covered)

    def _on_outputs(self, outputs) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            msg = worker_pb2.DecodeResponse(
                token_ids=out.new_token_ids, finish_reason=out.finish_reason or ""
            )
            if not stream.sent_first:
                stream.sent_first = True
                msg.kv_pull_ms = stream.kv_pull_ms
                msg.first_decode_ms = (
                    (time.perf_counter() - stream.kv_ready) * 1e3 if stream.kv_ready else 0.0
                )
                msg.pulled_tokens = stream.pulled_tokens
                msg.recomputed_tokens = stream.recomputed_tokens
                if stream.request.prefill_here:
                    msg.cached_tokens = stream.req.num_cached_tokens
            stream.out.put(msg)
            if out.finished:
                del self.streams[out.request_id]

    def _fail_all(self, err: Exception) -> None:
        """A step failed: the requests in the batch fail (the worker keeps serving new ones)."""
        for request_id, stream in list(self.streams.items()):
            if stream.pulling or stream in self.kv_waiting:
                continue  # not in the failed step
            self.engine.abort(request_id)
            self.streams.pop(request_id, None)
            stream.out.put(RuntimeError(f"engine step failed: {err}"))
        self.leave_group_if_broken(err)

    def _finish(self, stream: Stream, reason: str) -> None:
        self.streams.pop(stream.request.request_id, None)
        stream.out.put(worker_pb2.DecodeResponse(finish_reason=reason))

    def _abort(self, request_id: str) -> bool:
        stream = self.streams.get(request_id)
        if stream is None:
            # the Decode call may still be on its way: remember the abort for a while
            now = time.monotonic()
            self.tombstones[request_id] = now
            for rid, at in list(self.tombstones.items()):
                if now - at > 60:
                    del self.tombstones[rid]
            return False
        if stream in self.kv_waiting:
            self.kv_waiting.remove(stream)
            self._finish(stream, "abort")
        elif stream.pulling:
            stream.aborted = True  # the transfer cannot be interrupted; _kv_ready frees its blocks
        else:
            self.engine.abort(request_id)
        return True


class LockStep:
    """The per-iteration sync of an expert-parallel group, and the group's expert-load figures.

    Every engine-loop iteration each rank all-gathers [has work, stopping, seconds in its experts,
    draining, requests held, token assignments per local expert per MoE layer]; if any rank has
    work, all of them step (an idle rank with an empty batch, so every MoE layer's all_to_all has all
    ranks). The same exchange gives every rank the whole group's expert load, so any rank's GetStats
    can report it, and drains the group as one: once any rank drains, every rank does, and the group
    stops only when no rank holds a request.
    """

    HEADER = 5  # has work, stopping, expert seconds, draining, holds requests

    def __init__(self, engine: LLMEngine, comm: Comm):
        self.comm = comm
        self.moe = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, ExpertParallelMoe)]
        self.num_local = self.moe[0].w13.shape[0] if self.moe else 0
        self.view = torch.zeros(comm.size, self.HEADER + len(self.moe) * self.num_local, dtype=torch.float64)
        self.stopping = False  # this rank is shutting down (it tells the others in the next sync)
        self.draining = False  # this rank takes no new requests (the others follow)
        self.busy: Callable[[], bool] = lambda: False  # this rank holds requests
        self.on_group_stop: Callable[[], None] | None = None
        self.on_group_drain: Callable[[], None] | None = None

    def __call__(self, has_work: bool) -> bool:
        mine = [float(has_work), float(self.stopping), sum(m.load.seconds for m in self.moe)]
        mine += [float(self.draining), float(self.busy())]
        for m in self.moe:
            mine += m.load.token_counts()
        self.view = torch.stack(self.comm.all_gather(torch.tensor(mine, dtype=torch.float64), cpu=True))
        if self.view[:, 1].any():  # a rank is stopping: no rank steps again
            if self.on_group_stop is not None:
                self.on_group_stop()
            return False
        if self.view[:, 3].any() and not self.draining and self.on_group_drain is not None:
            self.on_group_drain()  # another rank drains: so does this one
        return bool(self.view[:, 0].any())

    def group_idle(self) -> bool:
        """As of the last sync: every rank drains and none holds a request."""
        return bool(self.view[:, 3].all()) and not self.view[:, 4].any()

    def expert_load(self) -> worker_pb2.ExpertLoad:
        view, n = self.view, self.num_local
        tokens = view[:, self.HEADER :].view(self.comm.size, len(self.moe), n)  # [rank, layer, expert]
        moe_ms = (view[:, 2] * 1e3).tolist()
        peak = max(moe_ms)
        return worker_pb2.ExpertLoad(
            layers=[
                worker_pb2.LayerExpertTokens(tokens=[int(t) for t in tokens[:, layer].flatten().tolist()])
                for layer in range(len(self.moe))
            ],
            rank_tokens=[int(t) for t in tokens.sum(dim=(1, 2)).tolist()],
            rank_moe_ms=moe_ms,
            balance=sum(moe_ms) / len(moe_ms) / peak if peak > 0 else 1.0,
        )


def main(argv: list[str] | None = None) -> int:
    return run_worker(
        "decode",
        DecodeWorker,
        lambda servicer, server: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server),
        worker_pb2.DESCRIPTOR,
        argv,
    )
