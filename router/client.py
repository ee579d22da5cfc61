"""A small synchronous client for the public API (used by `kvferry generate --server`, tests, load tests).

Its streams survive the death of the router serving them (a fleet of routers: one host's share a port,
so a reconnect reaches another): a stream that breaks with UNAVAILABLE is resumed through the channel's
next connection with the request's id and the number of tokens already received
(`GenerateRequest.resume`; `router.resume`), so the caller sees one unbroken stream. A request that broke
before its decode began (nothing to resume: NOT_FOUND with no tokens received) is sent again whole.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvferry.auth import client_interceptors
from kvferry.rpc import CHANNEL_OPTIONS
from kvferry.v1 import generate_pb2, generate_pb2_grpc

MAX_RESUMES = 3  # a stream is resumed at most this many times (each time its router went away)
RESUME_WAIT_S = 30.0  # how long a resume waits for a router to be reachable (within the deadline)
# ... when the call never reached one: shorter (maybe there is no router at all), but long enough to
# ride through a lone router's restart (the launcher's 1 s backoff, then its start: 2-5 s on 2 busy
# cores; at 2 s a request sent during the restart failed now and then)
UNREACHABLE_WAIT_S = 10.0


@dataclass
class StreamResult:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: generate_pb2.Finished | None = None
    messages: int = 0


def build_request(
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    request_id: str = "",
    **sampling,
) -> generate_pb2.GenerateRequest:
    """sampling: temperature, top_k, top_p, seed, max_tokens, stop, stop_token_ids, ignore_eos."""
    sampling = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sampling.items() if v is not None}
    req = generate_pb2.GenerateRequest(
        request_id=request_id, sampling=generate_pb2.SamplingParams(**sampling)
    )
    if prompt_token_ids is not None:
        req.token_ids.ids.extend(prompt_token_ids)
    elif prompt is not None:
        req.text = prompt
    return req


def _unreachable(err: grpc.RpcError) -> bool:
    """The call never reached a router (no connection could be made), as opposed to a stream broken."""
    details = (err.details() or "").lower()
    return err.code() == grpc.StatusCode.UNAVAILABLE and (
        "failed to connect" in details or "handshake" in details
    )


class ResumingStream:
    """One request's stream, resumed across routers (the module doc). Iterate it for the messages;
    `cancel()` ends it as a call's cancel does (the iteration then raises CANCELLED)."""

    def __init__(
        self, stub, channel, request: generate_pb2.GenerateRequest, timeout: float | None, resume: int
    ):
        self.stub, self.channel = stub, channel
        self.resume = resume if request.sampling.n <= 1 else 0  # (n > 1: not resumable)
        if resume > 0 and not request.request_id:  # the id a resume names: chosen here
            named = generate_pb2.GenerateRequest()
            named.CopyFrom(request)
            named.request_id = f"req-{uuid.uuid4().hex}"
            request = named
        self.request = request
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.call = None
        self.cancelled = False
        self.resumes = 0  # times it was resumed (or, broken before its decode began, sent again)
        self.messages = self._messages()

    def __iter__(self) -> ResumingStream:
        return self

    def __next__(self) -> generate_pb2.GenerateResponse:
        return next(self.messages)

    def cancel(self) -> None:
        self.cancelled = True
        if self.call is not None:
            self.call.cancel()

    def _messages(self) -> Iterator[generate_pb2.GenerateResponse]:
        request = self.request
        received, attempt, broke, bound = 0, request, None, RESUME_WAIT_S
        while True:
            left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            if self.resumes:  # a router to be reachable again (the next connection may be a moment away)
                wait = bound if left is None else min(left, bound)
                # a small call that waits for a connection (not channel_ready_future: its connectivity
                # poller thread outlives the wait and raises once the caller closes the channel)
                probe = generate_pb2.GetModelInfoRequest()
                try:
                    self.stub.GetModelInfo(probe, timeout=wait, wait_for_ready=True)
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # none reachable in time
                        raise broke from None
                    # any other answer came from a router: the stream's own call tells what it means
                if self.deadline is not None:  # (what the wait left of the caller's deadline)
                    left = max(0.0, self.deadline - time.monotonic())
            self.call = call = self.stub.Generate(attempt, timeout=left)
            if self.cancelled:
                call.cancel()
            try:
                for msg in call:
                    received += len(msg.token_ids)
                    yield msg
                return
            except grpc.RpcError as err:
                code = err.code()
                if self.cancelled or self.resumes >= self.resume:
                    raise
                if code == grpc.StatusCode.NOT_FOUND and self.resumes:
                    if received:  # nothing held it any more: the break is the caller's error
                        raise broke from None
                    attempt = request  # it broke before its decode began: nothing to resume, send it again
                elif code == grpc.StatusCode.UNAVAILABLE:
                    broke = broke or err
                    if received == 0 and _unreachable(err):  # no connection was made: maybe no router
                        bound = min(bound, UNREACHABLE_WAIT_S)  # is reachable at all; do not wait long
                    attempt = generate_pb2.GenerateRequest(
                        request_id=request.request_id, resume=generate_pb2.Resume(tokens=received)
                    )
                else:
                    raise
                self.resumes += 1
                time.sleep(min(0.05 * self.resumes, 0.5))  # the listener's socket may be a moment away
            finally:
                call.cancel()  # (a no-op once it ended) the caller stopped reading: end the call


class Client:
    """The router's public gRPC API. `api_key`: sent as `authorization: Bearer <key>` on every call;
    `root_certificates`: PEM bytes of the CA (or the self-signed certificate) to trust, which makes the
    channel TLS."""

    def __init__(self, target: str, api_key: str | None = None, root_certificates: bytes | None = None):
        self.target = target
        # a connection of its own (gRPC shares one among a process's channels to the same target): each
        # client reaches whichever router of the fleet the kernel gives its connection
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        if api_key:
            interceptors = client_interceptors([("authorization", f"Bearer {api_key}")])
            self.channel = grpc.intercept_channel(self.channel, *interceptors)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def stream(
        self, request: generate_pb2.GenerateRequest, timeout: float | None = None, resume: int = MAX_RESUMES
    ) -> ResumingStream:
        """The request's messages (iterate it; `cancel()` ends it, as a call's cancel does). Up to
        `resume` times, a stream that breaks (UNAVAILABLE: its router went away) is resumed through
        another connection (`resume=0`: the error is raised)."""
        return ResumingStream(self.stub, self.channel, request, timeout, resume)

    def generate(self, request: generate_pb2.GenerateRequest, timeout: float | None = None) -> StreamResult:
        result = StreamResult()
        for msg in self.stream(request, timeout=timeout):
            result.request_id = msg.request_id
            result.token_ids += msg.token_ids
            result.text += msg.text
            result.messages += 1
            if msg.HasField("finished"):
                result.finished = msg.finished
        return result

    def abort(self, request_id: str, timeout: float = 10) -> None:
        self.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=timeout)

    def status(self, request_id: str, timeout: float = 10) -> generate_pb2.RequestStatus:
        """Where a request of this client's key stands, through any router (NOT_FOUND: none holds it)."""
        return self.stub.GetRequestStatus(
            generate_pb2.RequestStatusRequest(request_id=request_id), timeout=timeout
        )

    def model_info(self, timeout: float = 10) -> generate_pb2.ModelInfo:
        return self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
