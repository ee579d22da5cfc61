"""The stream relay: the decode worker's tokens to the client, with detokenization and stop strings
applied here, a decode worker that breaks mid-stream replaced by another that resumes where it stopped
(`router.failover.resume_request`), and the colocated baseline (one worker runs both phases).

`StreamRelay` is one of the five parts of `router.server.Router` (with `router.admission`, `router.slo`,
`router.dispatch` and `router.sequences`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import grpc

from kvferry.convert import logprob_from_proto, logprobs_to_proto, sampling_to_proto
from kvferry.engine.output import OutputState, RequestOutput
from kvferry.engine.request import Request, RequestStatus
from kvferry.router.admission import Inflight, RequestRejected, WorkerFailed
from kvferry.router.directory import Member
from kvferry.router.failover import pick_excluding, resume_request
from kvferry.v1 import generate_pb2, worker_pb2


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


_FINISH = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


@dataclass
class Relay:
    """A request's output as the router streams it, kept across the decode workers that serve it."""

    req: Request
    state: OutputState
    timings: dict
    cached: tuple[int, int]  # (prefix-cache hit tokens, of which pulled from the pool)
    t0: float


class StreamRelay:
    """Router methods: relaying a decode worker's stream as the client's messages."""

    async def _colocated(
        self, handle: Inflight, req: Request, state: OutputState, params, keys: worker_pb2.PromptKeys, t0
    ):
        """The colocated baseline: one decode worker computes the prompt and streams every token."""
        decode_req = worker_pb2.DecodeRequest(
            request_id=handle.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_proto(replace(params, stop=(), n=1)),
            prefill_here=True,
            keys=keys,
            priority=handle.priority,
        )
        async for message in self._relay(handle, decode_req, Relay(req, state, {}, (0, 0), t0)):
            yield message

    async def _relay(self, handle: Inflight, first: worker_pb2.DecodeRequest, relay: Relay):
        """Stream `first` from the least-loaded decode worker, applying stop rules. A worker that dies
        mid-stream is replaced by another that resumes from the tokens streamed so far (at most
        MAX_RETRIES times, never the same one twice): the client sees one unbroken stream."""
        tried: set[str] = set()
        decode_req, failed = first, None
        shared = handle.shared
        prefer = shared.leader.decode if shared is not None and handle.index and first.prefill_here else None
        for tries in itertools.count(1):
            worker = self._pick_decode(decode_req, tried, failed, prefer if tries == 1 else None)
            tried.update((worker.member_id, worker.group))
            try:
                async for message in self._stream_decode(handle, worker, decode_req, relay):
                    yield message
                return
            except WorkerFailed as err:
                if handle.aborted:  # Abort() came as the worker failed: nothing to resume
                    yield self._final(
                        handle, relay.req, relay.state, "abort", relay.cached, relay.timings, relay.t0
                    )
                    return
                if not self._retry(handle, err, "decode", tries):
                    raise
                failed = err
            req = relay.req
            decode_req = resume_request(
                first, req.prompt_token_ids, req.output_token_ids, req.params.max_tokens
            )
            handle.release_pool = True  # the failed worker may not have released what it pulled

    def _pick_decode(
        self, decode_req, tried: set[str], failed: WorkerFailed | None, prefer: Member | None = None
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

    async def _stream_decode(self, handle: Inflight, worker: Member, decode_req, relay: Relay):
        """One decode worker's stream of `decode_req`, relayed as the client's messages (first token
        time = TTFT when the worker also ran the prefill). Raises WorkerFailed when the call fails."""
        req, state, timings = relay.req, relay.state, relay.timings
        handle.decode = worker
        worker.inflight += 1
        call = worker.stub.Decode(decode_req, timeout=handle.remaining())
        handle.calls.append(call)
        first_message = True
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
                    status = _FINISH.get(msg.finish_reason, RequestStatus.FINISHED_ABORTED)
                if status is not None:
                    req.status = status
                    if not msg.finish_reason:  # we stopped first (stop string): stop the worker too
                        handle.aborted = True
                    yield self._final(handle, req, state, None, relay.cached, timings, relay.t0)
                    return
                out = state.emit()
                if out.new_token_ids:
                    yield response(handle.request_id, out)
        except grpc.aio.AioRpcError as err:
            raise self._failed(worker, "decode", err) from None
        finally:
            worker.inflight -= 1
            call.cancel()  # (a no-op once it ended) the stream was closed early: end the call too
            handle.calls.remove(call)
        raise RequestRejected(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    def _final(self, handle, req: Request, state: OutputState, reason, cached: tuple[int, int], timings, t0):
        if reason == "abort":
            req.status = RequestStatus.FINISHED_ABORTED
        out = state.emit()
        timings = dict(timings)
        timings["e2e_ms"] = (time.perf_counter() - t0) * 1e3
        message = response(handle.request_id, out)
        message.finished.CopyFrom(
            generate_pb2.Finished(
                finish_reason=req.status.finish_reason or "abort",
                prompt_tokens=req.num_prompt_tokens,
                output_tokens=len(req.output_token_ids),
                cached_tokens=cached[0],
                pool_cached_tokens=cached[1],
                timings=generate_pb2.Timings(**timings),
            )
        )
        return message
