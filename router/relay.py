"""The decode relay: a decode worker's stream to the client, with detokenization and stop strings
applied here (`Relay`: the request's output state, kept across the workers that serve it), a decode
worker that breaks mid-stream replaced by another that resumes where it stopped
(`router.failover.resume_request`), and the colocated baseline (one worker runs both phases).
`DecodeRelay` picks the decode worker and reads its stream on that worker's link (`router.decode_link`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc

from kvferry.convert import logprob_from_proto, logprobs_to_proto, sampling_to_proto
from kvferry.engine.output import OutputState, RequestOutput
from kvferry.engine.request import Request, RequestStatus
from kvferry.router.failover import pick_excluding, resume_request
from kvferry.router.inflight import Inflight, RequestRejected, WorkerFailed
from kvferry.v1 import generate_pb2, worker_pb2

if TYPE_CHECKING:
    from kvferry.router.decode_link import DecodeLinks, LinkStream
    from kvferry.router.directory import Directory, Member
    from kvferry.router.failover import Failover


def response(request_id: str, out: RequestOutput) -> generate_pb2.GenerateResponse:
    """The client's message of one increment of a request's output."""
    message = generate_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=out.new_token_ids,
        text=out.text,
        logprobs=logprobs_to_proto(out.logprobs),
    )
    if out.prompt_logprobs is not None:
        message.prompt_logprobs.extend(logprobs_to_proto(out.prompt_logprobs))
    return message


FINISH = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


@dataclass
class Relay:
    """A request's output as the router streams it, kept across the decode workers that serve it."""

    req: Request
    state: OutputState
    timings: dict
    cached: tuple[int, int]  # (prefix-cache hit tokens, of which pulled from the pool)
    t0: float
    client_id: str  # the id the client knows (req.request_id is the cluster's: kvferry.auth.scoped_id)

    def final(self, reason: str | None = None) -> generate_pb2.GenerateResponse:
        """The request's last message: what output is left, and `Finished` (`reason` "abort": aborted;
        None: as `req.status` says)."""
        req = self.req
        if reason == "abort":
            req.status = RequestStatus.FINISHED_ABORTED
        out = self.state.emit()
        timings = dict(self.timings)
        timings["e2e_ms"] = (time.perf_counter() - self.t0) * 1e3
        message = response(self.client_id, out)
        message.finished.CopyFrom(
            generate_pb2.Finished(
                finish_reason=req.status.finish_reason or "abort",
                prompt_tokens=req.num_prompt_tokens,
                output_tokens=len(req.output_token_ids),
                cached_tokens=self.cached[0],
                pool_cached_tokens=self.cached[1],
                timings=generate_pb2.Timings(**timings),
            )
        )
        return message


class DecodeRelay:
    """Relays a request's decode (`relay`) from the decode worker it picks, over `links`; makes the
    DecodeRequest of a disaggregated request (`decode_request`) and of a colocated one (`colocated`).
    `detach_grace_s`: how long a decode worker holds a stream whose router went away (router.resume)."""

    def __init__(self, directory: Directory, links: DecodeLinks, failover: Failover, detach_grace_s: float):
        self.directory = directory
        self.links = links
        self.failover = failover
        self.detach_grace_s = detach_grace_s

    def decode_request(
        self, handle: Inflight, prefill: worker_pb2.PrefillResponse, cached: tuple[int, int]
    ) -> worker_pb2.DecodeRequest:
        """The decode of a prefilled request: its first token, and the KV its prefill left in the pool."""
        decode_req = worker_pb2.DecodeRequest(
            request_id=handle.request_id,
            prompt_token_ids=handle.ids,
            first_token_id=prefill.first_token_id,
            # stop strings are applied here; the prompt's logprobs came with the prefill
            sampling=sampling_to_proto(replace(handle.params, stop=(), prompt_logprobs=None, n=1)),
            blocks=prefill.blocks,
            num_kv_tokens=prefill.num_kv_tokens,
            keys=handle.prompt_keys,
            priority=handle.priority,
        )
        self.detachable(decode_req, handle, cached)
        return decode_req

    def detachable(self, decode_req: worker_pb2.DecodeRequest, handle: Inflight, cached=(0, 0)) -> None:
        """Let the decode worker hold the stream a while if this router dies (--detach-grace-s), with
        what another router needs to resume it (router.resume). Not for one of n sequences: a resume
        names one request id, and siblings share theirs."""
        decode_req.resume.owner = handle.owner  # (an abort through another router checks it)
        if self.detach_grace_s <= 0 or handle.shared is not None:
            return
        decode_req.detach_grace_s = self.detach_grace_s
        handle.detachable = True
        decode_req.resume.MergeFrom(
            worker_pb2.ResumeInfo(
                client_sampling=sampling_to_proto(replace(handle.params, n=1)),
                cached_tokens=cached[0],
                pool_cached_tokens=cached[1],
                api=handle.api,
            )
        )

    def colocated(self, handle: Inflight, relay: Relay) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The colocated baseline: one decode worker computes the prompt and streams every token."""
        decode_req = worker_pb2.DecodeRequest(
            request_id=handle.request_id,
            prompt_token_ids=relay.req.prompt_token_ids,
            sampling=sampling_to_proto(replace(handle.params, stop=(), n=1)),
            prefill_here=True,
            keys=handle.prompt_keys,
            priority=handle.priority,
        )
        self.detachable(decode_req, handle)
        return self.relay(handle, decode_req, relay)

    async def relay(
        self,
        handle: Inflight,
        first: worker_pb2.DecodeRequest,
        relay: Relay,
        attached: tuple[Member, grpc.aio.UnaryStreamCall] | None = None,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Stream `first` from the least-loaded decode worker, applying stop rules. A worker that dies
        mid-stream is replaced by another that resumes from the tokens streamed so far (at most
        MAX_RETRIES times, never the same one twice): the client sees one unbroken stream. `attached`:
        (worker, call) already streaming it (a resumed request: router.resume)."""
        tried: set[str] = set()
        decode_req, failed = first, None
        shared = handle.shared
        prefer = shared.leader.decode if shared is not None and handle.index and first.prefill_here else None
        for tries in itertools.count(1):
            call = None
            if attached is not None:
                (worker, call), attached = attached, None
            else:
                worker = self.pick_decode(decode_req, tried, failed, prefer if tries == 1 else None)
            tried.update((worker.member_id, worker.group))
            try:
                async for message in self._stream(handle, worker, decode_req, relay, call):
                    yield message
                return
            except WorkerFailed as err:
                if handle.aborted:  # Abort() came as the worker failed: nothing to resume
                    yield relay.final("abort")
                    return
                if not self.failover.retry(handle, err, "decode", tries):
                    raise
                failed = err
            req = relay.req
            decode_req = resume_request(
                first, req.prompt_token_ids, req.output_token_ids, req.params.max_tokens
            )
            handle.release_pool = True  # the failed worker may not have released what it pulled

    def pick_decode(
        self,
        decode_req: worker_pb2.DecodeRequest,
        tried: set[str],
        failed: WorkerFailed | None,
        prefer: Member | None = None,
    ) -> Member:
        """A decode worker not yet tried (`prefer` while it is up: a colocated sibling goes where its
        prompt is cached); none left: the last failure, if any, is the answer."""
        model = self.directory.model
        tokens = len(decode_req.prompt_token_ids) + decode_req.sampling.max_tokens
        blocks = -(-tokens // model.block_size)
        if prefer is not None and self._still_usable(prefer, tried):
            prefer.free_blocks -= blocks
            return prefer
        worker = pick_excluding(self.directory, "decode", tried, blocks)
        if worker is None:
            raise failed or RequestRejected(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")
        return worker

    def _still_usable(self, member: Member, tried: set[str]) -> bool:
        """Whether a decode member is still in the registry, untried, not draining nor suspect."""
        live = self.directory.members["decode"].get(member.member_id) is member
        return (
            live
            and member.member_id not in tried
            and not member.draining
            and member.suspect_until <= time.monotonic()
        )

    async def _stream(
        self,
        handle: Inflight,
        worker: Member,
        decode_req: worker_pb2.DecodeRequest,
        relay: Relay,
        call: grpc.aio.UnaryStreamCall | LinkStream | None = None,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """One decode worker's stream of `decode_req`, relayed as the client's messages (first token
        time = TTFT when the worker also ran the prefill). Raises WorkerFailed when the call fails.
        `call`: the stream's call already open (an Attach whose first message was taken)."""
        req, state, timings = relay.req, relay.state, relay.timings
        handle.decode = worker
        worker.inflight += 1
        first_message = call is None
        handle.linked = call is None
        if call is None:  # on the worker's relay link: one message per step for all our streams
            try:
                call = self.links.open(worker, decode_req, handle.remaining())
            except grpc.aio.AioRpcError as err:
                worker.inflight -= 1
                raise self.failover.failed(worker, "decode", err) from None
        handle.calls.append(call)
        try:
            async for msg in call:
                if first_message and decode_req.prefill_here and msg.cached_tokens:
                    relay.cached = (msg.cached_tokens, 0)  # the worker's own prefix cache
                elif msg.kv_pull_ms or msg.first_decode_ms:
                    timings["kv_transfer_ms"] = timings.get("kv_transfer_ms", 0.0) + msg.kv_pull_ms
                    timings["first_decode_ms"] = msg.first_decode_ms
                    handle.release_pool |= msg.recomputed_tokens > 0
                first_message = False
                if "ttft_ms" not in timings and msg.token_ids:
                    timings["ttft_ms"] = (time.perf_counter() - relay.t0) * 1e3
                if msg.prompt_logprobs:  # colocated: the worker scored the prompt
                    req.prompt_logprobs = [logprob_from_proto(x) for x in msg.prompt_logprobs]
                status = None
                logprobs = [logprob_from_proto(x) for x in msg.logprobs] or [None] * len(msg.token_ids)
                for token, logprob in zip(msg.token_ids, logprobs, strict=True):
                    status = state.add_token(token, logprob)
                    if status is not None:
                        break
                if status is None and msg.finish_reason:
                    status = FINISH.get(msg.finish_reason, RequestStatus.FINISHED_ABORTED)
                if status is not None:
                    req.status = status
                    if not msg.finish_reason:  # we stopped first (stop string): stop the worker too
                        handle.aborted = True
                    yield relay.final()
                    return
                out = state.emit()
                if out.new_token_ids:
                    yield response(handle.client_id, out)
        except grpc.aio.AioRpcError as err:
            raise self.failover.failed(worker, "decode", err) from None
        finally:
            worker.inflight -= 1
            call.cancel()  # (a no-op once it ended) the stream was closed early: end the call too
            handle.calls.remove(call)
        raise RequestRejected(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")
