"""Admission: the cheap checks in order of cost (ready, limits, a free --max-inflight slot, a new id),
then tokenizing (off the event loop) and validating every field. What a request holds while in flight
(`Inflight`) and the errors that end it (`RequestRejected`, `WorkerFailed`) live here too.

`Admission` is one of the five parts of `router.server.Router` (with `router.slo`, `router.dispatch`,
`router.relay` and `router.sequences`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace

import grpc

from kvferry.convert import sampling_from_proto
from kvferry.engine.block_hash import block_keys, salt_key
from kvferry.engine.request import InvalidRequestError, SamplingParams, validate_request
from kvferry.engine.structured import Grammars, StructuredOutputError
from kvferry.router.directory import Member
from kvferry.router.limits import check_limits
from kvferry.router.metrics import RequestTrack
from kvferry.v1 import generate_pb2, worker_pb2


@dataclass
class Inflight:
    request_id: str
    deadline: float  # time.monotonic() by which it must be done (the client's, else --request-timeout-s)
    t0: float  # perf_counter() when it arrived
    ids: list[int] = field(default_factory=list)  # set once tokenized and validated
    params: SamplingParams = field(default_factory=SamplingParams)
    track: RequestTrack | None = None  # set once admitted
    aborted: bool = False
    decode: Member | None = None
    calls: list = field(default_factory=list)
    release_pool: bool = False  # the pool may still hold the request's private tail block
    cache_salt: str = ""  # mixed into its block keys (engine.block_hash.salt_key)
    priority: int = 0  # GenerateRequest.priority: lower first, in each worker's queue
    # the prompt's block keys and the pool's hits on them (looked up at admission, unless colocated)
    prompt_keys: worker_pb2.PromptKeys | None = None
    pooled: list = field(default_factory=list)
    targets: object | None = None  # its SLO targets (router.slo.Targets)
    prediction: object | None = None  # its predicted TTFT / TPOT (router.slo.Prediction)
    # a request of n sequences (router.sequences): what they share, this one's index, the leader's others
    shared: object | None = None
    index: int = 0
    siblings: list = field(default_factory=list)

    def remaining(self) -> float:
        """Seconds left until the deadline (for worker calls)."""
        return max(0.0, self.deadline - time.monotonic())


class RequestRejected(Exception):
    """A request the cluster cannot serve (overload, no workers, a worker failed); `code` says which,
    `retry_after_s` when to try again (sent as HTTP Retry-After and a gRPC `retry-after-ms` trailer)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class WorkerFailed(RequestRejected):
    """A worker call failed; `retry`: another worker of its role may serve it (router.failover)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry: bool):
        super().__init__(code, message)
        self.retry = retry


def error_code(err: Exception) -> grpc.StatusCode:
    return err.code if isinstance(err, RequestRejected) else grpc.StatusCode.INVALID_ARGUMENT


class Admission:
    """Router methods: admitting a request (`admit`) or withdrawing one never run."""

    def _reserve(self, request: generate_pb2.GenerateRequest) -> str:
        """The cheap checks, in order of cost: ready, limits, a free slot, a new id. Nothing is
        tokenized or copied before they pass."""
        model = self.directory.model
        if model is None or not self.directory.ready:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "no prefill/decode workers are ready yet")
        check_limits(request, model.max_model_len)
        if len(self.inflight) >= self.cfg.max_inflight:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.inflight)} requests in flight (--max-inflight {self.cfg.max_inflight}); "
                "retry later",
            )
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self.inflight:
            raise RequestRejected(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in flight"
            )
        return request_id

    async def _prepare(
        self, request: generate_pb2.GenerateRequest, fill_max_tokens: bool
    ) -> tuple[list[int], SamplingParams]:
        """Tokenize (in a thread: a long prompt must not stall every other stream) and validate."""
        model = self.directory.model
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequestError("prompt: set either text or token_ids")
        if which == "text":
            if not request.text:
                raise InvalidRequestError("prompt.text must not be empty")
            ids = await asyncio.to_thread(self.tokenizer.encode, request.text)
            if not ids:
                raise InvalidRequestError("prompt.text encodes to no tokens")
        else:
            ids = list(request.token_ids.ids)
        params = sampling_from_proto(request.sampling, self.sampling_defaults)
        if fill_max_tokens and not request.sampling.HasField("max_tokens"):
            room = max(1, model.max_model_len - len(ids))  # as many as fit, or the generation config's
            params = replace(params, max_tokens=min(room, self.sampling_defaults.get("max_tokens", room)))
        ids = validate_request(
            ids,
            params,
            model.vocab_size,
            model.max_model_len,
            prompt_field="prompt.token_ids",
            sampling_field="sampling.",
            max_tokens_fit=True,
        )
        if params.structured is not None:  # compiled here (cached) to refuse a bad one before any work
            kind, value = params.structured
            try:
                await asyncio.to_thread(self.grammars().check, kind, value)
            except StructuredOutputError as err:
                raise InvalidRequestError(f"sampling.structured.{kind}: {err}") from None
        return ids, params

    def grammars(self) -> Grammars:
        """The structured-output compiler of the served model's tokenizer (made on first use)."""
        model = self.directory.model
        if self._grammars is None or self._grammars.vocab_size != model.vocab_size:
            self._grammars = Grammars(self.tokenizer.to_json(), model.vocab_size, model.eos_token_ids)
        return self._grammars

    async def admit(
        self,
        request: generate_pb2.GenerateRequest,
        timeout: float | None,
        api: str,
        fill_max_tokens: bool = False,
    ) -> Inflight:
        """Validate and admit a request (it counts as in flight from now on): then `run` it, or
        `withdraw` it. It takes its --max-inflight slot before it is tokenized, so a flood of huge prompts
        queues no more work than the slots allow. `fill_max_tokens`: an unset max_tokens means as many as
        fit (the chat API's default). Raises InvalidRequestError (bad input) or RequestRejected
        (RESOURCE_EXHAUSTED past --max-inflight, ALREADY_EXISTS for an id in flight, UNAVAILABLE before
        the cluster is ready)."""
        t0 = time.perf_counter()
        try:
            request_id = self._reserve(request)
        except (InvalidRequestError, RequestRejected) as err:
            self.metrics.rejected(api, error_code(err).name)
            raise
        timeout = self.cfg.request_timeout_s if timeout is None else timeout
        handle = self.inflight[request_id] = Inflight(request_id, time.monotonic() + timeout, t0)
        try:
            handle.ids, handle.params = await self._prepare(request, fill_max_tokens)
            self.metrics.traffic.arrived(len(handle.ids))  # the planner's demand: refused ones count
            handle.priority = request.priority
            if not self.cfg.colocated:
                await self._look_up(handle, request.cache_salt)
            self.admit_by_slo(handle, request.slo)
        except BaseException as err:
            del self.inflight[request_id]
            if isinstance(err, (InvalidRequestError, RequestRejected)):
                self.metrics.rejected(api, error_code(err).name)
            raise
        handle.cache_salt = request.cache_salt
        handle.track = self.metrics.track(api, t0)
        return handle

    async def _look_up(self, handle: Inflight, cache_salt: str) -> None:
        """The prompt's block keys (its one hash, sent on to the workers) and how much of them the pool
        holds (its one lookup): what predicting its TTFT and choosing its prefill worker take."""
        model = self.directory.model
        fingerprint = bytes.fromhex(model.fingerprint)
        salt = salt_key(cache_salt)
        keys = block_keys(handle.ids, model.block_size, fingerprint, salt)
        handle.prompt_keys = worker_pb2.PromptKeys(
            fingerprint=fingerprint, block_keys=keys, salt_key=salt or b""
        )
        handle.pooled = await asyncio.to_thread(self.meta.lookup_prefix, keys)
        self.metrics.pool_lookup()

    def withdraw(self, handle: Inflight) -> None:
        """Forget an admitted request that was never run (nothing was sent to a worker)."""
        handle.track.done(grpc.StatusCode.CANCELLED.name)
        del self.inflight[handle.request_id]
