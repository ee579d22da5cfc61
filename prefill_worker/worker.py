"""The prefill worker: the engine in prefill-only mode behind the PrefillWorker gRPC service.

A Prefill call moves through the stages of `prefill_worker.handoff` (prefix lookup -> prefix pull ->
prefilling -> KV write -> answered); the engine loop polls them between steps, and the call's handler
(a coroutine on the server's event loop) awaits the job's answer. A call that ends before it is
answered (cancelled, deadline) cancels its job. Rank 0 of a
tensor-parallel group runs all of it and has the other ranks follow (`kvferry.prefill_worker.tp`).

Every change of the engine's own prefix cache (a full block findable under its key, or no longer) is
published as a KV event for the routers (`kvpool.kv_events`, `publish_kv_events`), by rank 0 alone:
the block manager queues them in its step, a publisher thread sends them in batches.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import time
from dataclasses import replace

import grpc

from kvferry.auth import may_act_for
from kvferry.convert import logprob_to_proto, logprobs_to_proto, sampling_from_proto, structured_from_proto
from kvferry.engine.engine import LLMEngine
from kvferry.engine.loop import EngineLoop
from kvferry.engine.request import InvalidRequestError, Request, RequestStatus
from kvferry.kvpool.client import PoolClient, PoolError, from_proto, gather, to_proto
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.kv_events import KVEventPublisher
from kvferry.kvpool.metadata import Location, MetadataStore
from kvferry.kvpool.transfer import pack_blocks
from kvferry.model.parallel import Comm, Parallel
from kvferry.prefill_worker.handoff import KVWrite, PrefillJob, PrefixLookup, PrefixPull
from kvferry.prefill_worker.streaming import LayerStreamer, missing_on_failure
from kvferry.prefill_worker.tp import TPLeader, follow
from kvferry.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from kvferry.worker.group import Group
from kvferry.worker.runtime import WorkerRole, run_worker
from kvferry.worker.service import EngineWorker
from kvferry.worker.stages import Done, TransferStage

log = logging.getLogger(__name__)


class PrefillWorker(EngineWorker, worker_pb2_grpc.PrefillWorkerServicer):
    role = "prefill"

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str, group: Group | None = None):
        super().__init__(engine, pool, worker_id, group)
        self.jobs: dict[str, PrefillJob] = {}  # admitted, not yet answered
        self.loop = EngineLoop(engine, self._on_outputs, idle_hook=self._poll, on_error=self.fail_in_engine)
        wake = self.loop.wake.set
        # Redis lookups on their own thread: a pull or a write on the transfer thread never delays one
        self.lookup_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-lookup")
        self.lookups: TransferStage[PrefixLookup] = TransferStage("prefix lookup", self.lookup_thread, wake)
        self.pulls: TransferStage[PrefixPull] = TransferStage("prefix pull", self.transfers, wake)
        self.writes: TransferStage[KVWrite] = TransferStage("KV write", self.transfers, wake, self._answer)
        self.leader = TPLeader(self.group, engine)
        engine.kv.on_finished(self._capture)
        kv = engine.model.shard.kv_heads  # this rank's KV heads: its slice of every pool block
        self.heads = (kv.start, kv.stop)
        self.streamer: LayerStreamer | None = None
        self.stream_layers("auto")
        self.kv_events: KVEventPublisher | None = None

    def stream_layers(self, mode: str) -> None:
        """Stream each step's finished blocks to the pool layer by layer (`streaming.py`): mode on, off,
        or auto (on when the engine computes on a GPU: on CPU the transfer takes cores from the prefill,
        and the write after it costs less, `bench/kv_streaming.py`). Not in a tensor-parallel group
        (its other ranks write their slices after the prefill)."""
        on = mode == "on" or (mode == "auto" and self.engine.device.type == "cuda")
        self.streamer = None
        if on and not self.leader.active:
            self.streamer = LayerStreamer(self.engine, self.pool, self.heads, self.jobs.__contains__)
        self.engine.kv.on_layers(None if self.streamer is None else self.streamer.hook)

    def publish_kv_events(self, meta: MetadataStore) -> None:
        """Publish the changes of the engine's prefix cache in `meta`'s Redis from `start` on. Before
        `start`: the block manager's queue starts with what the cache holds now."""
        changes = self.engine.kv.watch_cache()
        self.kv_events = KVEventPublisher(meta, self.worker_id, self.group.group_id, changes)

    def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        super().start()

    def stop(self) -> None:
        super().stop()
        if self.kv_events is not None:
            self.kv_events.stop()  # after the engine: its last changes go out too
        self.lookup_thread.shutdown(wait=False)  # a lookup only reads Redis: nothing to finish
        # only once the engine thread is gone: two threads must never broadcast at once (if it is
        # stuck in a step, the followers end with this process instead, by PR_SET_PDEATHSIG)
        if not self.loop.is_alive():
            self.leader.stop()

    def active_ids(self) -> list[str]:
        return list(self.jobs)

    def holds(self, request_id: str) -> bool:
        return request_id in self.jobs

    def idle(self) -> bool:
        return not self.jobs and not (self.lookups.items or self.pulls.items or self.writes.items)

    # -- gRPC -----------------------------------------------------------------------------------------
    async def Prefill(self, request, context):
        async with self.stream_slot(context):
            job = PrefillJob(request, time.perf_counter())
            rid = request.request_id
            spec = structured_from_proto(request.sampling.structured)
            job.matcher = await self.compile_structured(request, spec, context)
            self.loop.submit(lambda: self._admit(job))
            try:
                # shielded: a cancelled call cancels its job on the engine thread (_cancel), not here
                return await asyncio.shield(asyncio.wrap_future(job.future))
            except asyncio.CancelledError:
                self.loop.submit(lambda: self._cancel(rid, job))
                raise
            except InvalidRequestError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            except PoolError as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
            except Exception as err:
                await context.abort(grpc.StatusCode.INTERNAL, f"prefill of {rid} failed: {err}")

    def request_status(self, request_id: str, owner: str) -> generate_pb2.RequestStatus | None:
        job = self.jobs.get(request_id)
        if job is None or not may_act_for(owner, job.request.owner):
            return None
        req = job.req
        started = req is not None and req.num_computed_tokens > 0
        return generate_pb2.RequestStatus(
            state="prefilling" if started else "queued",
            prompt_tokens=len(job.request.prompt_token_ids),
        )

    def _stats(self) -> worker_pb2.WorkerStats:
        c = self.counters
        return super()._stats(
            prompt_tokens_computed=c["prompt_tokens_computed"],
            blocks_streamed=c["blocks_streamed"],
            pool_lookups=c["pool_lookups"],
        )

    # -- engine thread: admission and the prefix stages -------------------------------------------------
    def _admit(self, job: PrefillJob) -> None:
        request, e = job.request, self.engine
        # one token here, whatever the request asks: stop rules are applied by the router
        # (stop ids and EOS stay: min_tokens bans them from the first token too)
        asked = sampling_from_proto(request.sampling)
        params = replace(asked, max_tokens=1, min_tokens=min(asked.min_tokens, 1), stop=())
        try:
            req = self.new_request(request, params, "in prefill", job.matcher)
        except InvalidRequestError as err:
            job.future.set_exception(err)
            return
        job.req, job.started = req, time.perf_counter()
        self.jobs[req.request_id] = job
        kv = e.kv
        if request.looked_up:  # the router's lookup (a location gone since is a miss: recomputed)
            job.pooled = self.pool.nearest([from_proto(x) for x in request.pooled])
        # all full blocks (a full hit computes the last token)
        # (prompt logprobs score every prompt token: nothing is taken from a cache)
        if req.num_prompt_tokens < kv.block_size or not kv.caching or params.prompt_logprobs is not None:
            e.submit(req)
            return
        keys = kv.prompt_keys(req)
        job.holder = kv.hold_cached(keys)
        if request.looked_up:
            self._pull_prefix(job, keys)
            return
        self.lookups.start(req.request_id, PrefixLookup(job, keys), lambda: self._lookup(keys))

    def _lookup(self, keys: list[bytes]):
        """Lookup thread: where the pool holds the leading keys."""
        self.counters["pool_lookups"] += 1
        return self.pool.lookup_prefix(keys)

    def _poll(self) -> bool:
        """The engine loop's idle hook: move the requests whose transfers finished to their next stage
        (pulls first: a tensor-parallel group ends a pull before a newer one of the same id starts)."""
        self.leader.keepalive()
        pulled, abandoned = self.pulls.poll()
        for done in abandoned:  # aborted while pulling: the group still ends the pull together
            self.leader.pull_done(done.request_id, 0)
            self.engine.kv.release(done.item.reserved)
        for done in pulled:
            self._guarded(done.item.job, self._pulled, done)
        looked_up, _ = self.lookups.poll()
        for done in looked_up:
            self._guarded(done.item.job, self._looked_up, done)
        written, _ = self.writes.poll()  # answered already (on the finishing thread)
        for done in written:
            self._drop(done.request_id, done.item.job)
        return bool(pulled or abandoned or looked_up or written)

    def _guarded(self, job: PrefillJob, step, done: Done) -> None:
        """Move one request on; if that fails, it fails alone (the others in this poll go on)."""
        try:
            step(done)
        except Exception as err:
            log.exception("prefill of %s failed in its hand-off", done.request_id)
            self._drop(done.request_id, job)
            if not job.future.done():
                job.future.set_exception(err)

    def _looked_up(self, done: Done[PrefixLookup]) -> None:
        job = done.item.job
        if done.error is not None:
            if not self._pool_failure(job, done.error, "prefix lookup"):
                return
        else:
            job.pooled = done.value
        self._pull_prefix(job, done.item.keys)

    def _pull_prefix(self, job: PrefillJob, keys: list[bytes]) -> None:
        """Pull the pooled blocks past the local prefix-cache hits (none: to the engine at once)."""
        kv, start = self.engine.kv, len(job.holder)
        locations = job.pooled[start:]
        reserved = kv.reserve(len(locations)) if locations else None
        if reserved is None:  # nothing more pooled, or no room to pull it into: compute the rest
            self.engine.submit(job.req)
            return
        rid = job.req.request_id
        keys = keys[start : start + len(locations)]
        self.leader.pull(rid, locations, reserved)
        cache = kv.cache
        self.pulls.start(
            rid,
            PrefixPull(job, keys, locations, reserved),
            lambda: self.pool.pull_into_cache(rid, locations, cache, reserved, *self.heads),
        )

    def _pulled(self, done: Done[PrefixPull]) -> None:
        pull, kv = done.item, self.engine.kv
        job = pull.job
        n = self.leader.pull_done(done.request_id, done.value if done.error is None else 0)
        kv.arrived(pull.reserved[:n], pull.keys)
        kv.release(pull.reserved[n:])
        del job.pooled[len(job.holder) + n :]  # what was not served may be gone: written at the end
        job.holder += pull.reserved[:n]
        if done.error is not None and not self._pool_failure(job, done.error, "prefix pull"):
            return
        job.pool_hit_blocks = n
        self.counters["blocks_pulled"] += n
        self.engine.submit(job.req)

    def _pool_failure(self, job: PrefillJob, err: BaseException, what: str) -> bool:
        """A pool outage costs recompute, never the request (True: go on); anything else fails it."""
        rid = job.req.request_id
        if isinstance(err, PoolError):
            log.warning("%s for %s failed, computing it: %s", what, rid, err)
            return True
        log.error("%s for %s failed: %s", what, rid, err)
        self._drop(rid, job)
        job.future.set_exception(err)
        return False

    # -- engine thread: the engine's outputs and the KV write -------------------------------------------
    def _on_outputs(self, outputs) -> None:
        kv = self.engine.kv
        for job in self.jobs.values():
            if job.holder and job.req.status != RequestStatus.WAITING:
                kv.release(job.holder)  # admitted: the engine holds its own references now
                job.holder = []
        for out in outputs:
            if out.finished and out.finish_reason == "abort":
                self._drop(out.request_id)

    def _capture(self, req: Request) -> None:
        """The engine's finish hook (in its step): copy the prompt's KV out before the blocks are freed,
        and start writing what the pool lacks."""
        job = self.jobs.get(req.request_id)
        if job is None:
            return
        if req.error:  # its first token failed its structured output: an error, and nothing to write
            self._drop(req.request_id, job)
            job.future.set_exception(RuntimeError(req.error))
            return
        kv_api = self.engine.kv
        bs = kv_api.block_size
        num_full = req.num_prompt_tokens // bs
        full_keys = kv_api.prompt_keys(req)
        streamed = None if self.streamer is None else self.streamer.take(req.request_id)
        done = set() if streamed is None else set(streamed.blocks)
        # blocks the lookup found in the pool are not re-sent (no second lookup here, on the engine
        # thread: one the pool completed since is sent again, and the node drops the copy)
        locations: list[Location | None] = list(job.pooled[:num_full])
        locations += [None] * (num_full - len(locations))
        write = [i for i in range(num_full) if locations[i] is None and i not in done]
        tail = req.num_prompt_tokens % bs > 0
        if tail:
            write.append(num_full)
        keys = [full_keys[i] if i < num_full else os.urandom(16) for i in write]
        private = [i == num_full for i in write]
        block_ids = kv_api.block_ids(req, write)
        data = pack_blocks(kv_api.cache, block_ids) if write else None
        nodes = None
        if write and self.leader.active:  # every rank sends its slice of the blocks to the same nodes
            try:
                nodes = self.pool.pick_nodes(wait=False)
            except PoolError as err:
                log.warning("no pool node for %s: %s", req.request_id, err)
                write, keys, private, block_ids, data = [], [], [], [], None
            else:
                self.leader.put(req.request_id, nodes, keys, private, block_ids)
        cached = req.num_cached_tokens
        pool_hits = min(job.pool_hit_blocks * bs, cached)
        self.counters["requests"] += 1
        self.counters["prompt_tokens_computed"] += req.num_prompt_tokens - cached
        self.counters["pool_hit_tokens"] += pool_hits
        self.counters["local_hit_tokens"] += cached - pool_hits
        kv = KVWrite(
            job=job,
            first_token=req.output_token_ids[-1],
            first_logprob=req.output_logprobs[-1] if req.output_logprobs else None,
            siblings=req.sibling_samples,
            prompt_logprobs=req.prompt_logprobs,
            locations=locations + [None] * tail,
            write=write,
            keys=keys,
            private=private,
            block_ids=block_ids,
            data=data,
            nodes=nodes,
            streamed=[] if streamed is None else streamed.futures,
            cached_tokens=cached,
            pool_cached_tokens=pool_hits,
            computed_tokens=req.num_prompt_tokens - cached,
            prefill_done=time.perf_counter(),
        )
        self.writes.start(req.request_id, kv, lambda: self._put(kv))

    def _put(self, kv: KVWrite):
        """Transfer thread: send the blocks; returns the future of the pool's reply (or the reply)."""
        kv.put_started = time.perf_counter()
        parts = []
        if kv.write:
            data, kv.data = kv.data, None  # sent once the call returns: the copy can go
            parts.append(
                self.pool.put_async(kv.job.req.request_id, kv.keys, data, kv.private, kv.nodes, *self.heads)
            )
        for indices, future in kv.streamed:  # the blocks streamed during the prefill: answered with these
            kv.write += indices
            self.counters["blocks_streamed"] += len(indices)
            parts.append(missing_on_failure(future, len(indices), kv.job.req.request_id))
        return gather(parts)

    def _answer(self, done: Done[KVWrite]) -> None:
        """The KV write finished (on the transfer or the pool client's thread): answer the call now."""
        try:
            reply = self._reply(done)
        except Exception as err:  # never leave the call waiting
            log.exception("answering %s failed", done.request_id)
            reply = err
        job = done.item.job
        try:
            if isinstance(reply, Exception):
                job.future.set_exception(reply)
            else:
                job.future.set_result(reply)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile: free its private tail
            self.pool.release(done.request_id)

    def _reply(self, done: Done[KVWrite]) -> worker_pb2.PrefillResponse:
        kv = done.item
        req, locations = kv.job.req, kv.locations
        stored = done.value
        if done.error is not None:  # whatever went wrong, the request is answered (decode recomputes)
            log.warning("writing KV of %s to the pool failed: %s", req.request_id, done.error)
            stored = [None] * len(kv.write)
        for i, loc in zip(kv.write, stored, strict=True):
            locations[i] = loc
        self.counters["blocks_put"] += sum(loc is not None for loc in stored)
        prefix = []
        for loc in locations:
            if loc is None:
                break
            prefix.append(loc)
        bs = self.engine.cfg.block_size
        reply = worker_pb2.PrefillResponse(
            first_token_id=kv.first_token,
            blocks=[to_proto(loc) for loc in prefix],
            num_kv_tokens=min(len(prefix) * bs, req.num_prompt_tokens),
            cached_tokens=kv.cached_tokens,
            pool_cached_tokens=kv.pool_cached_tokens,
            computed_tokens=kv.computed_tokens,
            queue_ms=(kv.job.started - kv.job.arrived) * 1e3,
            prefill_ms=(kv.prefill_done - kv.job.started) * 1e3,
            kv_put_ms=(time.perf_counter() - (kv.put_started or kv.prefill_done)) * 1e3,
            prompt_logprobs=logprobs_to_proto(kv.prompt_logprobs),
        )
        if kv.first_logprob is not None:
            reply.first_logprob.CopyFrom(logprob_to_proto(kv.first_logprob))
        reply.sibling_first_token_ids.extend(x.token for x in kv.siblings)
        reply.sibling_first_logprobs.extend(logprob_to_proto(x.logprob) for x in kv.siblings if x.logprob)
        return reply

    # -- engine thread: failures and cancellation -------------------------------------------------------
    def failed(self, request_id: str, err: Exception) -> None:
        job = self.jobs.get(request_id)
        self._drop(request_id)
        if job is not None and not job.future.done():
            job.future.set_exception(err)

    def _cancel(self, request_id: str, job: PrefillJob) -> None:
        """The call ended before its answer: drop its job (if that is still the request under this id).
        Answered already (the reply raced the cancel): the router never got it, so the private tail the
        write left in the pool has no reader: free it."""
        if job.future.done():
            if not job.future.cancelled() and job.future.exception() is None:
                self.transfers.submit(self.pool.release, request_id)
            return
        if self.jobs.get(request_id) is not job:
            return
        self.lookups.discard(request_id)
        self.pulls.discard(request_id)  # its reserved blocks are freed when the pull ends (_poll)
        self.engine.abort(request_id)
        self._drop(request_id)
        job.future.cancel()

    def _drop(self, request_id: str, job: PrefillJob | None = None) -> None:
        """Forget a request (given `job`: only if that is still the request under this id) and free the
        blocks it pinned."""
        if job is not None and self.jobs.get(request_id) is not job:
            return
        job = self.jobs.pop(request_id, None)
        if self.streamer is not None:
            self.streamer.take(request_id)
        if job is not None and job.holder:
            self.engine.kv.release(job.holder)
            job.holder = []


def configure(servicer: PrefillWorker, pool_cfg: PoolConfig) -> None:
    """The serving process's settings: layer streaming, and KV events in the pool's Redis."""
    servicer.stream_layers(pool_cfg.stream_layers)
    servicer.publish_kv_events(servicer.pool.meta)


def prefill_engine_config(args: argparse.Namespace, cfg):
    if cfg.expert_parallel_size > 1:
        raise SystemExit(
            "prefill groups are tensor-parallel: use --tensor-parallel-size, not expert parallelism"
        )
    return cfg


ROLE = WorkerRole(
    name="prefill",
    servicer=PrefillWorker,
    add_to_server=worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
    descriptor=worker_pb2.DESCRIPTOR,
    parallel=lambda comm: Parallel(comm, Comm.single()),  # tensor-parallel: every rank a head slice
    engine_config=prefill_engine_config,
    configure=configure,
    follow=follow,  # ranks > 0 run rank 0's commands
)


def main(argv: list[str] | None = None) -> int:
    return run_worker(ROLE, argv)
