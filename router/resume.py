"""Resuming a stream whose router died: the piece of the router fleet that lets a client carry on.

A router sends each decode worker its requests with `DecodeRequest.detach_grace_s` (RouterConfig) and
what another router needs to relay them (`ResumeInfo`: the owner's key digest, the resolved sampling,
stop strings included). When the router dies, its Decode calls break, and each decode worker holds
their sequences for the grace, decoding on and keeping their tokens (`decode_worker.worker`).

A client that reconnects (to any router: on one host they share the port) sends the same request id with
`resume.tokens`, the number of tokens it has. The router asks each decode worker to `Attach` the stream
(`attach`): the one holding it answers with the request as first sent and every token made so far, and
goes on streaming. `Replay` rebuilds the request's output state from them (the same detokenizer and stop
strings as the first router's), skips what the client has, and the relay goes on as for any request
(`router.relay`; a decode worker that dies after the resume is replaced as usual). Nothing is
recomputed: the sequence's KV never left its worker.

`Resumes` is the router's side of it: `admit` (the cheap checks, then `attach`) and `stream` (`Replay`'s
pending tokens, then the relay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc

from kvferry.convert import logprob_from_proto, sampling_from_proto, sampling_to_proto
from kvferry.engine.output import OutputState
from kvferry.engine.request import InvalidRequestError, Request, RequestStatus
from kvferry.router.directory import Directory, Member
from kvferry.router.inflight import Inflight, RequestRejected
from kvferry.router.relay import FINISH, Relay, response
from kvferry.v1 import generate_pb2, worker_pb2

if TYPE_CHECKING:
    from kvferry.model.tokenizer import Tokenizer
    from kvferry.router.admission import Admission
    from kvferry.router.metrics import RouterMetrics
    from kvferry.router.relay import DecodeRelay

log = logging.getLogger(__name__)


async def attach(
    directory: Directory, request_id: str, owner: str, timeout: float
) -> tuple[Member, object, worker_pb2.DecodeResponse] | None:
    """The decode worker holding `request_id` for `owner`, its Attach call and the call's first message
    (None: no worker holds it). Every decode worker is asked at once; the first that holds it wins (at
    most one does: a request id is in one sequence at a time), and the other asks are called off."""
    members = [m for m in directory.members["decode"].values() if m.stub is not None]

    async def ask(member: Member):
        call = member.stub.Attach(
            worker_pb2.AttachRequest(request_id=request_id, owner=owner), timeout=timeout
        )
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("attach of %s on %s failed: %s", request_id, member.member_id, err.code().name)
            return None
        except asyncio.CancelledError:  # another worker answered first
            call.cancel()
            raise
        if first is grpc.aio.EOF:
            return None
        return member, call, first

    # the first worker that holds it answers for all: a slow or hung one does not hold the others up
    asks = [asyncio.ensure_future(ask(m)) for m in members]
    try:
        for done in asyncio.as_completed(asks):
            found = await done
            if found is not None:
                return found
        return None
    finally:
        for task in asks:
            task.cancel()


@dataclass
class Replay:
    """A resumed request rebuilt from its decode worker's first Attach message."""

    req: Request
    state: OutputState
    first: worker_pb2.DecodeRequest  # the request as its first dispatch sent it (failover resumes from it)
    pending: list  # [(token, logprob)] the client has not seen yet
    finish_reason: str  # set when the sequence finished while detached
    cached: tuple[int, int]

    @classmethod
    def of(
        cls,
        request_id: str,
        message: worker_pb2.DecodeResponse,
        have: int,
        tokenizer,
        eos_token_ids,
        max_model_len: int,
    ) -> Replay:
        """The output state after the `have` tokens the client has (their text is not sent again)."""
        sent = message.attached
        made = sent.output_offset
        prompt_len = len(sent.prompt_token_ids) - made
        outputs = list(sent.prompt_token_ids[prompt_len:])
        if not sent.prefill_here:
            outputs.append(sent.first_token_id)
        outputs += message.token_ids
        logprobs = [None] * (len(outputs) - len(message.logprobs))
        logprobs += [logprob_from_proto(x) for x in message.logprobs]
        params = sampling_from_proto(sent.resume.client_sampling)
        req = Request(request_id, list(sent.prompt_token_ids[:prompt_len]), params)
        state = OutputState(req, tokenizer, tuple(eos_token_ids), max_model_len)
        have = max(0, min(have, len(outputs)))
        for token, logprob in zip(outputs[:have], logprobs[:have], strict=True):
            status = state.add_token(token, logprob)
            if status is not None:  # (the client had its last token already)
                req.status = status
                break
        state.emit()  # the client has these
        first = worker_pb2.DecodeRequest()
        first.CopyFrom(sent)
        del first.prompt_token_ids[:]
        first.prompt_token_ids.extend(req.prompt_token_ids)
        first.output_offset = 0
        first.sampling.CopyFrom(sampling_to_proto(replace(params, stop=(), prompt_logprobs=None, n=1)))
        if not sent.prefill_here and made:
            first.first_token_id = outputs[0]
        info = sent.resume
        return cls(
            req,
            state,
            first,
            list(zip(outputs[have:], logprobs[have:], strict=True)),
            message.finish_reason,
            (info.cached_tokens, info.pool_cached_tokens),
        )


class Resumes:
    """Resumes streams whose router went away: `admit` finds the decode worker holding one, `stream`
    carries it on from what the client has."""

    def __init__(
        self,
        admission: Admission,
        directory: Directory,
        metrics: RouterMetrics,
        tokenizer: Tokenizer,
        relay: DecodeRelay,
    ):
        self.admission = admission
        self.directory = directory
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.relay = relay

    async def admit(
        self, request: generate_pb2.GenerateRequest, timeout: float | None, api: str, owner: str
    ) -> Inflight:
        """Admit the resume of a stream whose router went away: the cheap checks, then the decode worker
        that holds it for this owner. Raises InvalidRequestError, or RequestRejected (NOT_FOUND when no
        decode worker holds it, else as `Admission.enter`)."""
        try:
            if not request.request_id:
                raise InvalidRequestError("request_id: a resume names the request it continues")
            if request.resume.tokens < 0:
                raise InvalidRequestError(f"resume.tokens must be >= 0, got {request.resume.tokens}")
        except InvalidRequestError:
            self.metrics.rejected(api, grpc.StatusCode.INVALID_ARGUMENT.name)
            raise
        handle = self.admission.enter(request, timeout, api, owner, check_prompt=False)
        request_id = handle.request_id
        try:
            handle.attached = await attach(self.directory, request_id, owner, handle.remaining())
        except BaseException:
            self.admission.forget(request_id)
            raise
        if handle.attached is None:
            log.info(
                "resume of %s: held by none of the decode workers %s",
                request_id,
                sorted(self.directory.members["decode"]),
            )
            self.admission.forget(request_id)
            self.metrics.rejected(api, grpc.StatusCode.NOT_FOUND.name)
            raise RequestRejected(
                grpc.StatusCode.NOT_FOUND,
                f"request_id {request_id!r}: no decode worker holds a stream of it to resume (it finished, "
                "was aborted, its grace passed, or it was never made with this key)",
            )
        self.metrics.resumed()
        handle.track = self.metrics.track(api, handle.t0)
        return handle

    async def stream(self, handle: Inflight, have: int) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """A resumed request's stream (the client has `have` tokens of it): what its decode worker made
        that the client has not seen, then the rest as it comes (relayed as any request's, failover
        included)."""
        worker, call, message = handle.attached
        handle.attached = None
        model = self.directory.model
        replay = Replay.of(
            handle.request_id, message, have, self.tokenizer, model.eos_token_ids, model.max_model_len
        )
        req, state = replay.req, replay.state
        handle.ids, handle.params, handle.priority = req.prompt_token_ids, req.params, replay.first.priority
        relay = Relay(req, state, {}, replay.cached, handle.t0, handle.client_id)
        try:
            status = req.status if req.status.is_finished else None
            for token, logprob in replay.pending:
                if status is not None:
                    break
                status = state.add_token(token, logprob)
            if status is None and replay.finish_reason:
                status = FINISH.get(replay.finish_reason, RequestStatus.FINISHED_ABORTED)
            if status is not None:
                req.status = status
                if not replay.finish_reason:  # a stop string here: the request's end stops the worker too
                    handle.aborted, handle.decode, handle.linked = True, worker, False
                    handle.calls.append(call)
                yield relay.final()
                return
            out = state.emit()
            if out.new_token_ids:
                yield response(handle.client_id, out)
        except BaseException:
            call.cancel()
            raise
        async for message in self.relay.relay(handle, replay.first, relay, attached=(worker, call)):
            yield message
