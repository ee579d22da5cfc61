"""The decode worker: continuous batching behind the DecodeWorker gRPC service.

A request arrives with its prompt, the first token (sampled by the prefill worker) and where its KV
lies in the pool, and moves through the stages of `decode_worker.handoff` (prealloc -> transfer ->
the engine) before it streams tokens; the engine loop polls them between steps. A call that ends
before its stream finished (the client cancelled, or its deadline passed) aborts its request; an
Abort call may also come before the Decode call it aborts (`EarlyAborts`). Every rank of an
expert-parallel group serves its own requests and steps in lock-step with the others
(`kvferry.decode_worker.lockstep.LockStep`).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import time
from collections import OrderedDict, deque
from dataclasses import replace

import grpc

from kvferry.auth import may_act_for
from kvferry.convert import logprobs_to_proto, sampling_from_proto, structured_from_proto
from kvferry.decode_worker.handoff import (
    DISCARD,
    TAKEN_OVER,
    EarlyAborts,
    HandoffReport,
    KVPull,
    LinkOut,
    LinkSink,
    LoopQueue,
    Stream,
)
from kvferry.decode_worker.lockstep import LockStep
from kvferry.engine.engine import LLMEngine
from kvferry.engine.loop import EngineLoop
from kvferry.engine.request import InvalidRequestError
from kvferry.kvpool.client import PoolClient, from_proto
from kvferry.model.parallel import Comm, Parallel
from kvferry.rpc import hard_exit
from kvferry.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from kvferry.worker.group import Group
from kvferry.worker.runtime import WorkerRole, run_worker
from kvferry.worker.service import EngineWorker
from kvferry.worker.stages import Done, TransferStage

log = logging.getLogger(__name__)

MAX_DETACH_GRACE_S = 300.0  # the longest a detached stream is held, whatever its router asked
MAX_FINISHED_KEPT = 4096  # finished detachable streams kept for a resume (their tokens only), at most


class DecodeWorker(EngineWorker, worker_pb2_grpc.DecodeWorkerServicer):
    role = "decode"

    def __init__(self, engine: LLMEngine, pool: PoolClient, worker_id: str, group: Group | None = None):
        super().__init__(engine, pool, worker_id, group)
        self.streams: dict[str, Stream] = {}
        self.detached_any = False  # some stream is detached (its grace is checked in _poll)
        self.link_tasks: set[asyncio.Task] = set()  # Relay links' starts in progress
        # detachable streams that finished, kept (tokens only) for their grace: a resume finds them
        self.finished_streams: OrderedDict[str, Stream] = OrderedDict()
        self.early_aborts = EarlyAborts()  # aborted before their Decode call arrived
        # an expert-parallel rank steps in lock-step with the rest of its group
        self.lockstep = LockStep(engine, self.group.comm) if self.group.size > 1 else None
        self.loop = EngineLoop(
            engine,
            self._on_outputs,
            idle_hook=self._poll,
            on_error=self.fail_in_engine,
            sync=self.lockstep,
            step_interval_ms=engine.cfg.decode_step_interval_ms,
            on_sync_lost=lambda: hard_exit(1),
        )
        # the hand-off stages (decode_worker.handoff): waiting for blocks, then pulling into them
        self.prealloc: deque[Stream] = deque()
        self.transfer: TransferStage[KVPull] = TransferStage("KV pull", self.transfers, self.loop.wake.set)
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

    def holds(self, request_id: str) -> bool:
        return request_id in self.streams

    def queued(self) -> int:
        return len(self.prealloc)

    # -- gRPC -----------------------------------------------------------------------------------------
    async def Decode(self, request, context):
        async with self.stream_slot(context):
            stream = Stream(request, LoopQueue())
            spec = structured_from_proto(request.sampling.structured)
            stream.matcher = await self.compile_structured(request, spec, context)
            self.loop.submit(lambda: self._admit(stream))
            async for item in self._pump(stream, stream.out, context):
                yield item

    async def Relay(self, requests, context):
        """A router's one link for all its streams here: starts and cancels come in, and every wake-up
        of the loop sends one batch with every message the engine made since (one per step)."""
        link = LinkOut()
        reader = asyncio.create_task(self._read_link(requests, link))
        try:
            while True:
                batch = worker_pb2.RelayBatch()
                for rid, item in await link.take():
                    if isinstance(item, worker_pb2.DecodeResponse):
                        batch.items.add(request_id=rid, response=item)
                    else:
                        code, details = _refusal(rid, item)
                        batch.items.add(request_id=rid, error_code=code.value[0], error=details)
                if batch.items:
                    yield batch
        finally:  # the router went away (or this worker stops): its streams are held, or aborted
            link.closed = True
            reader.cancel()
            self.loop.submit(lambda: self._link_ended(link))

    async def _read_link(self, requests, link: LinkOut) -> None:
        async for request in requests:
            kind = request.WhichOneof("kind")
            if kind == "start":  # (its own task: a grammar to compile holds up no other start)
                task = asyncio.create_task(self._start_linked(request.start, link))
                self.link_tasks.add(task)
                task.add_done_callback(self.link_tasks.discard)
            elif kind == "cancel":
                rid = request.cancel
                self.loop.submit(lambda rid=rid: self._cancel_linked(rid, link))

    async def _start_linked(self, request, link: LinkOut) -> None:
        stream = Stream(request, LinkSink(link, request.request_id))
        try:
            spec = structured_from_proto(request.sampling.structured)
            stream.matcher = await self.compile_structured(request, spec, _Refuse())
        except Exception as err:  # refused (its status), or failed (INTERNAL): the router hears at once
            link.put(request.request_id, err)
            return
        self.loop.submit(lambda: self._admit(stream))

    async def Attach(self, request, context):
        """Take over a detached stream (its router died) for the caller's router: its request and every
        token so far first, then the rest as it comes."""
        async with self.stream_slot(context):
            out = LoopQueue()
            found = await self.call(context, lambda: self._attach(request.request_id, request.owner, out))
            if found is None:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"request_id {request.request_id!r} is not held here"
                )
            stream, first = found
            pumping = False
            try:
                yield first
                if first.finish_reason:
                    return
                pumping = True
                async for item in self._pump(stream, out, context):
                    yield item
            finally:
                if not pumping and not first.finish_reason:  # cut before it streamed: held again, or gone
                    self.loop.submit(lambda: self._call_ended(stream, out, _expired(context)))

    async def _pump(self, stream: Stream, out: LoopQueue, context):
        """Relay the engine thread's messages of `stream` (through `out`, its call's queue) to the call.
        A call that ends before the stream (cancelled, its deadline passed, its router gone) detaches a
        detachable stream, else aborts its request; a stream moved to another call (Attach) ends here."""
        finished = False
        try:
            while not finished:
                item = await out.get()
                if item is TAKEN_OVER:
                    finished = True
                    return
                if isinstance(item, Exception):  # the engine side has dropped the stream already
                    finished = True
                    if isinstance(item, InvalidRequestError):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(item))
                    await context.abort(
                        grpc.StatusCode.INTERNAL, f"decode of {stream.request.request_id} failed: {item}"
                    )
                finished = bool(item.finish_reason)
                yield item
        finally:
            if not finished:  # the call ended first: its request goes too, or waits for a resume
                expired = _expired(context)
                self.loop.submit(lambda: self._call_ended(stream, out, expired))

    async def Abort(self, request, context):
        owner = request.owner if request.check_owner else None
        found = await self.call(context, lambda: self._abort(request.request_id, owner))
        return worker_pb2.WorkerAbortResponse(found=found)

    def request_status(self, request_id: str, owner: str) -> generate_pb2.RequestStatus | None:
        stream = self.streams.get(request_id) or self.finished_streams.get(request_id)
        if stream is None or not may_act_for(owner, stream.request.resume.owner):
            return None
        r = stream.request  # a resumed stream's earlier tokens end its prompt (output_offset)
        status = generate_pb2.RequestStatus(prompt_tokens=len(r.prompt_token_ids) - r.output_offset)
        if stream.req is None:  # finished, kept for a resume: its tokens alone (the first is the prefill's)
            status.output_tokens = r.output_offset + (not r.prefill_here) + len(stream.emitted)
            status.finish_reason = stream.finish_reason
        else:
            status.output_tokens = stream.req.output_offset + len(stream.req.output_token_ids)
        waiting = stream in self.prealloc or request_id in self.transfer
        status.state = "finished" if stream.finish_reason else "waiting_for_kv" if waiting else "decoding"
        if stream.detached_until is not None:
            status.detached_left_s = max(0.0, stream.detached_until - time.monotonic())
            if not stream.finish_reason:
                status.state = "detached"
        return status

    def _stats(self) -> worker_pb2.WorkerStats:
        c = self.counters
        return super()._stats(
            expert_load=self.lockstep.expert_load() if self.lockstep is not None else None,
            prompt_tokens_computed=c["recomputed_tokens"],
            waiting_for_kv=len(self.prealloc) + len(self.transfer),
            detached=sum(s.detached_until is not None for s in self.streams.values()),
            detached_total=c["detached"],
            resumed=c["resumed"],
            detach_expired=c["detach_expired"],
        )

    # -- engine thread: admission and the hand-off stages -----------------------------------------------
    def _admit(self, stream: Stream) -> None:
        r = stream.request
        params = replace(sampling_from_proto(r.sampling), stop=())  # stop strings are the router's
        if self.early_aborts.take(r.request_id, owner=r.resume.owner):  # aborted before it got here
            self._release_unpulled(stream)
            stream.out.put(worker_pb2.DecodeResponse(finish_reason="abort"))
            return
        try:
            stream.req = self.new_request(r, params, "decoding here", stream.matcher)
        except InvalidRequestError as err:
            stream.out.put(err)
            return
        stream.req.output_offset = max(0, min(r.output_offset, stream.req.num_prompt_tokens - 1))
        self.streams[r.request_id] = stream
        self.counters["requests"] += 1
        if r.prefill_here:  # colocated: the ordinary engine path, prefill and decode in this batch
            self.engine.submit(stream.req)  # (its first message reports prefix-cache hits, no hand-off)
        else:
            self.engine.kv.await_kv(stream.req)  # the engine's from now on; scheduled once its KV is here
            self.prealloc.append(stream)
        # its router went away meanwhile: held for a resume, or aborted (the engine has it by now)
        if isinstance(stream.out, LinkSink) and stream.out.link.closed:
            self._call_ended(stream, stream.out, expired=False)
        if not r.prefill_here:
            self._start_pulls()

    def _poll(self) -> bool:
        """The engine loop's idle hook: finished pulls join the engine; the prealloc queue moves on;
        detached streams past their grace go."""
        if self.detached_any:
            self._expire_detached()
        now = time.monotonic()
        while self.finished_streams and next(iter(self.finished_streams.values())).detached_until <= now:
            self.finished_streams.popitem(last=False)
        finished, abandoned = self.transfer.poll()
        for done in finished:
            self._kv_ready(done)
        for done in abandoned:  # aborted while its KV was on the way (the engine has finished it)
            pull = done.item
            self.engine.kv.release(pull.local + pull.reserved)
        return self._start_pulls() or bool(finished or abandoned)

    def _start_pulls(self) -> bool:
        """Prealloc -> transfer, in arrival order, while blocks are free."""
        started = False
        while self.prealloc:
            pull = self._reserve(self.prealloc[0])
            if pull is None:
                break
            self.prealloc.popleft()
            self.transfer.start(pull.stream.req.request_id, pull, lambda p=pull: self._pull(p))
            started = True
        return started

    def _reserve(self, stream: Stream) -> KVPull | None:
        """Take local hits and reserve blocks for the rest (None: not enough free blocks yet)."""
        req, kv = stream.req, self.engine.kv
        locations = [from_proto(x) for x in stream.request.blocks]
        keys = kv.prompt_keys(req)
        usable = 0  # leading locations whose keys match ours (a different model's KV is never used)
        for i, loc in enumerate(locations[: kv.blocks_needed(req.num_prompt_tokens)]):
            if i < len(keys) and loc.key != keys[i]:
                break
            usable += 1
        locations = locations[:usable]
        local = kv.hold_cached(keys[: min(usable, len(keys))])
        reserved = kv.reserve(len(locations) - len(local))
        if reserved is None:
            kv.release(local)
            if kv.blocks_in_use() > 0:
                return None  # blocks free up as running requests finish
            local, reserved, locations = [], [], []  # could never fit: recompute instead
        return KVPull(stream, local, reserved, locations[len(local) :])

    def _pull(self, pull: KVPull) -> tuple[int, float]:
        """Transfer thread: pool -> reserved blocks of the paged cache; (blocks served, ms)."""
        started, n, request_id = time.perf_counter(), 0, pull.stream.request.request_id
        if pull.remote:
            try:  # any failure means: recompute what did not arrive (the request itself goes on)
                n = self.pool.pull_into_cache(request_id, pull.remote, self.engine.kv.cache, pull.reserved)
            except Exception as err:
                log.warning("pulling KV of %s failed, recomputing: %s", request_id, err)
                n = 0  # a partial landing is not trusted
        return n, (time.perf_counter() - started) * 1e3

    def _kv_ready(self, done: Done[KVPull]) -> None:
        pull, kv = done.item, self.engine.kv
        stream, req = pull.stream, pull.stream.req
        served, pull_ms = done.value if done.error is None else (0, 0.0)
        kv.release(pull.reserved[served:])
        blocks = pull.local + pull.reserved[:served]
        bs = kv.block_size
        covered = min(stream.request.num_kv_tokens, len(blocks) * bs, req.num_prompt_tokens)
        # (None: its first message went out already, with the call that first streamed it: a resume)
        report = stream.report if stream.report is not None else HandoffReport()
        report.kv_pull_ms = pull_ms
        report.pulled_tokens = min(served * bs, covered)
        report.recomputed_tokens = req.num_prompt_tokens - covered
        self.counters["blocks_pulled"] += served
        self.counters["pool_hit_tokens"] += report.pulled_tokens
        self.counters["local_hit_tokens"] += min(len(pull.local) * bs, covered)
        self.counters["recomputed_tokens"] += report.recomputed_tokens
        if covered == 0:
            kv.release(blocks)
            blocks = []
        report.kv_ready = time.perf_counter()
        kv.kv_arrived(req, stream.request.first_token_id, blocks, covered)

    # -- engine thread: outputs, failures, aborts -------------------------------------------------------
    def _on_outputs(self, outputs) -> None:
        links: set[LinkOut] = set()  # the Relay links this step's messages go to: one batch each
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            stream.held += out.new_token_ids
            stream.held_logprobs += out.logprobs
            if stream.detached_until is not None:  # nobody streams it: keep it all for the resume
                if out.finished:
                    stream.finish_reason = out.finish_reason or "abort"
                continue
            first = stream.report is not None
            if not (first or out.finished or len(stream.held) >= self.engine.cfg.stream_interval):
                continue  # held for the next message (the first and the last go at once)
            # a request that failed (its structured output did) ends in error, its tokens so far first:
            # never a finish that reads as a success
            failed = out.finished and out.finish_reason == "error"
            msg = worker_pb2.DecodeResponse(
                token_ids=stream.held,
                finish_reason="" if failed else out.finish_reason or "",
                logprobs=logprobs_to_proto(stream.held_logprobs),
            )
            if out.prompt_logprobs is not None:  # colocated: this worker computed the prompt
                msg.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs))
            if stream.request.detach_grace_s > 0:
                stream.emitted += stream.held
                stream.emitted_logprobs += stream.held_logprobs
            stream.held, stream.held_logprobs = [], []
            report, stream.report = stream.report, None
            if report is not None:  # the first message
                msg.kv_pull_ms = report.kv_pull_ms
                msg.first_decode_ms = (
                    (time.perf_counter() - report.kv_ready) * 1e3 if report.kv_ready else 0.0
                )
                msg.pulled_tokens = report.pulled_tokens
                msg.recomputed_tokens = report.recomputed_tokens
                if stream.request.prefill_here:
                    msg.cached_tokens = stream.req.num_cached_tokens
            if out.finished:
                stream.finish_reason = out.finish_reason or "abort"
            if failed and not msg.token_ids and report is None:
                pass  # nothing came before the failure: the error alone
            elif isinstance(stream.out, LinkSink):
                stream.out.link.put(out.request_id, msg, wake=False)
                links.add(stream.out.link)
            else:
                stream.out.put(msg)
            if failed:
                self.failed(out.request_id, RuntimeError(out.error or "the request failed"))
            elif out.finished:
                self._forget(out.request_id)
        for link in links:
            link.wake()

    def failed(self, request_id: str, err: Exception) -> None:
        stream = self.streams[request_id]
        self._forget(request_id)
        stream.out.put(err)

    def _forget(self, request_id: str, keep: bool = True) -> None:
        """The request's stream is over: the id is free, and an Abort that comes late leaves nothing.
        A detachable one that finished (stop, length) is kept a while, its tokens only: its router may
        die before the client has them all, and a resume then finds them (`_attach`)."""
        stream = self.streams.pop(request_id)
        self.early_aborts.stream_finished(request_id)
        if keep and stream.request.detach_grace_s > 0 and stream.finish_reason in ("stop", "length"):
            grace = min(stream.request.detach_grace_s, MAX_DETACH_GRACE_S)
            stream.detached_until = time.monotonic() + grace
            stream.req = stream.matcher = None  # its tokens and its request are all a resume needs
            stream.out = DISCARD
            self.finished_streams.pop(request_id, None)
            self.finished_streams[request_id] = stream
            while len(self.finished_streams) > MAX_FINISHED_KEPT:
                self.finished_streams.popitem(last=False)

    def _call_ended(self, stream: Stream, out: LoopQueue, expired: bool) -> None:
        """The call streaming `stream` (through `out`) ended before the stream did. Unless Attach moved
        the stream to another call meanwhile: a detachable one whose deadline has not passed is held for
        a resume (its router died: it decodes on; an Abort, or the grace passing, ends it), any other is
        aborted (it never leaves an early abort behind)."""
        rid = stream.request.request_id
        if self.streams.get(rid) is not stream or stream.out is not out:
            return
        grace = min(stream.request.detach_grace_s, MAX_DETACH_GRACE_S)
        if grace <= 0 or expired:
            self._abort(rid)
            return
        stream.detached_until = time.monotonic() + grace
        self.detached_any = True
        self.counters["detached"] += 1
        log.info("%s: its call broke; held %.0fs for a resume", rid, grace)

    def _link_ended(self, link: LinkOut) -> None:
        """A Relay link ended (its router died, or this worker stops): each of its streams is held for
        a resume (detachable) or aborted, as when a Decode call breaks."""
        for stream in list(self.streams.values()):
            if isinstance(stream.out, LinkSink) and stream.out.link is link:
                self._call_ended(stream, stream.out, expired=False)

    def _cancel_linked(self, request_id: str, link: LinkOut) -> None:
        """The router stopped reading a stream of its link: abort it (one not here yet: when it comes)."""
        stream = self.streams.get(request_id)
        if stream is None:
            self.early_aborts.add(request_id)
        elif isinstance(stream.out, LinkSink) and stream.out.link is link:
            self._abort(request_id)

    def _attach(self, request_id: str, owner: str, out: LoopQueue):
        """Attach: move the stream of `request_id` to a new call (its queue `out`), if it is detachable
        and `owner` made it; (stream, its first message: the request and every token so far) or None.
        A stream still on a call (its router's death not noticed yet) is taken from that call."""
        stream = self.streams.get(request_id)
        live = stream is not None
        if not live:  # finished here (kept until its grace): its router may have died before relaying it all
            stream = self.finished_streams.get(request_id)
        if stream is None or stream.request.detach_grace_s <= 0 or not _owned(stream, owner):
            return None
        if live:
            if stream.detached_until is None:
                stream.out.put(TAKEN_OVER)
            stream.out, stream.detached_until = out, None
            stream.emitted += stream.held
            stream.emitted_logprobs += stream.held_logprobs
            stream.held, stream.held_logprobs = [], []
            stream.report = None  # the first message went with the request's first call
        first = worker_pb2.DecodeResponse(
            token_ids=stream.emitted,
            finish_reason=stream.finish_reason,
            logprobs=logprobs_to_proto(stream.emitted_logprobs),
            attached=stream.request,
        )
        self.counters["resumed"] += 1
        if live and stream.finish_reason:  # it finished while detached: this message is its last (its
            self._forget(request_id)  # tokens are kept for the rest of its grace: this router may die too)
        return stream, first

    def _expire_detached(self) -> None:
        """Abort the detached streams nobody resumed within their grace (their blocks are freed)."""
        now, left = time.monotonic(), False
        for rid, stream in list(self.streams.items()):
            if stream.detached_until is None:
                continue
            if stream.detached_until > now:
                left = True
                continue
            self.counters["detach_expired"] += 1
            log.info("%s: not resumed within its grace; aborted", rid)
            self._abort(rid)
        self.detached_any = left

    def _release_unpulled(self, stream: Stream) -> None:
        """A request aborted before its pull: free its private tail in the pool now (a pull would have
        freed it; the router that would release it may be gone), off the engine thread."""
        if stream.request.blocks and not stream.request.prefill_here:
            self.transfers.submit(self.pool.release, stream.request.request_id)

    def _abort(self, request_id: str, owner: str | None = None) -> bool:
        """Abort a request (`owner`: only if that owner's, ResumeInfo.owner). One not here yet is
        remembered a while: its Decode call may still be on its way."""
        stream = self.streams.get(request_id)
        if stream is None:
            kept = self.finished_streams.get(request_id)  # finished: nothing to resume any more
            if kept is not None and (owner is None or may_act_for(owner, kept.request.resume.owner)):
                del self.finished_streams[request_id]
            self.early_aborts.add(request_id, owner=owner)
            return False
        if owner is not None and not may_act_for(owner, stream.request.resume.owner):
            return False
        if stream.detached_until is not None:  # no call streams it: its last message goes nowhere
            stream.detached_until, stream.out = None, DISCARD
            if stream.finish_reason:  # it finished while detached: only its tokens were kept
                self._forget(request_id, keep=False)
                return True
        if stream in self.prealloc:
            self.prealloc.remove(stream)
            self._release_unpulled(stream)
        else:  # in a transfer: _poll frees its blocks when it ends
            self.transfer.discard(request_id)
        self.engine.abort(request_id)  # its last message ("abort") goes out with the engine's outputs
        return True


def _expired(context) -> bool:
    """Whether a call ended because its deadline passed (a call without one never does)."""
    left = context.time_remaining()
    return left is not None and left <= 0.05


def _owned(stream: Stream, owner: str) -> bool:
    """Whether `owner` (kvferry.auth.owner_of of a caller's key) made the stream's request."""
    return hmac.compare_digest(stream.request.resume.owner.encode(), owner.encode())


class StreamRefused(Exception):
    """A stream started on a Relay link that is refused before it runs (its status code, its reason)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _Refuse:
    """What a linked stream's checks abort through (as a call's context): a refusal of that stream."""

    async def abort(self, code: grpc.StatusCode, details: str, *args, **kw):
        raise StreamRefused(code, details)


def _refusal(request_id: str, item) -> tuple[grpc.StatusCode, str]:
    """The status of a linked stream that ended with `item` instead of a message."""
    if item is TAKEN_OVER:
        return grpc.StatusCode.ABORTED, f"{request_id} was taken over by another router (a resume)"
    if isinstance(item, StreamRefused):
        return item.code, item.details
    if isinstance(item, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(item)
    return grpc.StatusCode.INTERNAL, f"decode of {request_id} failed: {item}"


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-parallel-size", type=int, default=None, help="with --enable-expert-parallel")
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM spelling: --data-parallel-size M --enable-expert-parallel = --expert-parallel-size M",
    )


def decode_engine_config(args: argparse.Namespace, cfg):
    if args.enable_expert_parallel:
        cfg = replace(cfg, expert_parallel_size=args.data_parallel_size or cfg.expert_parallel_size)
    elif args.data_parallel_size not in (None, 1):
        raise SystemExit("--data-parallel-size > 1 needs --enable-expert-parallel (decode groups are DP+EP)")
    if cfg.tensor_parallel_size > 1:
        raise SystemExit(
            "decode groups are expert-parallel: use --expert-parallel-size, not tensor parallelism"
        )
    return cfg


ROLE = WorkerRole(
    name="decode",
    servicer=DecodeWorker,
    add_to_server=worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
    descriptor=worker_pb2.DESCRIPTOR,
    parallel=lambda comm: Parallel(Comm.single(), comm),  # expert-parallel; attention data-parallel
    add_args=add_decode_args,
    engine_config=decode_engine_config,
)


def main(argv: list[str] | None = None) -> int:
    return run_worker(ROLE, argv)
