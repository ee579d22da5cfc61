"""The router: the cluster's public gRPC front door (asyncio).

Generate: cheap limits (`router.limits`) -> admit (RESOURCE_EXHAUSTED past --max-inflight, counted
before any work) -> tokenize (off the event loop) and validate every field -> block keys -> ask the pool
how much of the prefix is cached -> the prefill worker whose own cache is expected to hold most of the
prompt's prefix, weighed against load (`router.prefix_routing`; first token + KV locations) ->
least-loaded decode worker (pulls the KV, streams tokens) -> relay with incremental detokenization and
stop strings applied here. A worker that dies or refuses is replaced by another (`router.failover`):
a prefill is sent again, a decode stream resumes where it broke. Whatever ends a request early (client
cancel, deadline, Abort, a stop string) is propagated: the in-flight worker call is cancelled, the
decode worker is told to abort, and the pool drops the request's private blocks. Every worker call has
a deadline: the client's, else --request-timeout-s.

The public API asks for a bearer API key when given some (--api-key; the cluster secret is accepted
too) and serves TLS when given a certificate (--ssl-certfile/--ssl-keyfile), on gRPC and HTTP alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvferry.auth import Credentials, cluster_secret, server_interceptors
from kvferry.convert import sampling_from_proto, sampling_to_proto
from kvferry.engine.output import OutputState
from kvferry.engine.request import (
    InvalidRequestError,
    Request,
    RequestStatus,
    SamplingParams,
    validate_request,
)
from kvferry.kvpool.keys import block_keys
from kvferry.kvpool.metadata import MetadataStore, add_redis_url_arg
from kvferry.model.create import resolve_model
from kvferry.model.tokenizer import Tokenizer
from kvferry.proc import settle_heap
from kvferry.router.directory import Directory, Member
from kvferry.router.failover import (
    MAX_RETRIES,
    SUSPECT_S,
    connection_lost,
    pick_excluding,
    relay_code,
    resume_request,
    retryable,
)
from kvferry.router.http_server import start_http
from kvferry.router.limits import check_limits
from kvferry.router.metrics import RequestTrack, RouterMetrics
from kvferry.router.prefix_routing import ROUTING_MODES, Choice, PrefillRouting, RoutingConfig
from kvferry.rpc import MAX_MESSAGE_BYTES, SERVER_KEEPALIVE, aio_channel, hard_exit, service_names
from kvferry.settings import API_KEY_ENV, load_settings
from kvferry.v1 import generate_pb2, generate_pb2_grpc, pool_pb2, pool_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)

_FINISH = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


@dataclass(frozen=True)
class RouterConfig:
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "default"
    max_inflight: int = 256
    refresh_s: float = 0.5
    colocated: bool = False  # no prefill workers: decode workers run both phases (the baseline)
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API and /metrics; None = off, 0 = any free
    served_model_name: str | None = None  # the name the APIs answer to (default: `model`'s name)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # bearer keys of the public APIs; () = open
    ssl_certfile: str | None = None  # TLS on the public gRPC and HTTP ports (PEM), with ssl_keyfile
    ssl_keyfile: str | None = None
    request_timeout_s: float = 600.0  # the deadline of a request whose client sets none
    max_request_bytes: int = 4 * 2**20  # the public gRPC server's receive limit (far above a valid request)
    routing: str = "kv-aware"  # how a prefill worker is chosen: kv-aware | least-load (router.prefix_routing)


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

    def remaining(self) -> float:
        """Seconds left until the deadline (for worker calls)."""
        return max(0.0, self.deadline - time.monotonic())


@dataclass
class Relay:
    """A request's output as the router streams it, kept across the decode workers that serve it."""

    req: Request
    state: OutputState
    timings: dict
    cached: tuple[int, int]  # (prefix-cache hit tokens, of which pulled from the pool)
    t0: float


class RequestRejected(Exception):
    """A request the cluster cannot serve (overload, no workers, a worker failed); `code` says which."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class WorkerFailed(RequestRejected):
    """A worker call failed; `retry`: another worker of its role may serve it (router.failover)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry: bool):
        super().__init__(code, message)
        self.retry = retry


def error_code(err: Exception) -> grpc.StatusCode:
    return err.code if isinstance(err, RequestRejected) else grpc.StatusCode.INVALID_ARGUMENT


def cached_of(prefill: worker_pb2.PrefillResponse) -> tuple[int, int]:
    """(prefix-cache hit tokens, of which pulled from the pool) of a prefill."""
    return prefill.cached_tokens, prefill.pool_cached_tokens


def public_model_name(name: str) -> str:
    """A model name fit to show clients: a checkpoint's path becomes its directory's name."""
    if os.path.isabs(name) or name.startswith(("./", "../", "~")):
        return os.path.basename(os.path.normpath(os.path.expanduser(name))) or name
    return name


class Router(generate_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model, load_settings().models_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.served_model_name = public_model_name(cfg.served_model_name or cfg.model)
        self.credentials = Credentials(cluster_secret(), cfg.api_keys)
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self.directory = Directory(self.meta, cfg.refresh_s, colocated=cfg.colocated)
        self.metrics = RouterMetrics(self.served_model_name, self.directory)
        self.routing = PrefillRouting(RoutingConfig(mode=cfg.routing), self.directory)
        self.inflight: dict[str, Inflight] = {}
        self.ending: set[asyncio.Future] = set()  # releases that outlive their request's stream (`_end`)
        self.pool_channels: dict[str, grpc.aio.Channel] = {}

    # -- admission ------------------------------------------------------------------------------------
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
        params = sampling_from_proto(request.sampling)
        if fill_max_tokens and not request.sampling.HasField("max_tokens"):
            params = replace(params, max_tokens=max(1, model.max_model_len - len(ids)))
        ids = validate_request(
            ids,
            params,
            model.vocab_size,
            model.max_model_len,
            prompt_field="prompt.token_ids",
            sampling_field="sampling.",
            max_tokens_fit=True,
        )
        return ids, params

    # -- Generate -------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        """The gRPC face of `generate`: typed errors become status codes."""
        try:
            async with contextlib.aclosing(self.generate(request, context.time_remaining())) as stream:
                async for message in stream:
                    yield message
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except RequestRejected as err:
            await context.abort(err.code, str(err))

    async def generate(
        self, request: generate_pb2.GenerateRequest, timeout: float | None = None, api: str = "grpc"
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Serve one request, whichever API it came by: `admit`, then `run`'s messages."""
        handle = await self.admit(request, timeout, api)
        async with contextlib.aclosing(self.run(handle)) as stream:
            async for message in stream:
                yield message

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
        except BaseException as err:
            del self.inflight[request_id]
            if isinstance(err, (InvalidRequestError, RequestRejected)):
                self.metrics.rejected(api, error_code(err).name)
            raise
        handle.track = self.metrics.track(api, t0)
        return handle

    def withdraw(self, handle: Inflight) -> None:
        """Forget an admitted request that was never run (nothing was sent to a worker)."""
        handle.track.done(grpc.StatusCode.CANCELLED.name)
        del self.inflight[handle.request_id]

    async def run(self, handle: Inflight) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The stream of an admitted request, the last message with `finished`. Raises RequestRejected
        when a worker fails it (its code says why). Closing the stream early (the client went away)
        releases everything the request holds in the workers and the pool."""
        code = grpc.StatusCode.CANCELLED
        completed = False
        try:
            async for message in self._generate(handle):
                handle.track.message(message)
                yield message
            completed = True
        except (InvalidRequestError, RequestRejected) as err:
            code = error_code(err)
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL
            raise
        finally:
            handle.track.done(code.name)
            everything = not completed or handle.aborted
            if everything or handle.release_pool:
                ending = asyncio.ensure_future(self._end(handle, everything))
                self.ending.add(ending)
                ending.add_done_callback(self.ending.discard)
                await asyncio.shield(ending)  # a client gone meanwhile cancels this wait, not the release
            else:
                del self.inflight[handle.request_id]

    async def _end(self, handle: Inflight, everything: bool) -> None:
        """Release what a request leaves behind (`everything`: in the workers and the pool; else the
        pool's private tail), then free its id: a release must not hit a successor with the same id.
        Its own task, so a cancel of the request's stream (the client went away just as its last
        message went out) cannot cut the release short and leave the tail to the pool's TTL."""
        try:
            if everything:
                await self._cleanup(handle)
            else:
                await self._release_pool(handle.request_id)
        finally:
            del self.inflight[handle.request_id]

    async def _generate(self, handle: Inflight):
        ids, params, t0 = handle.ids, handle.params, handle.t0
        model = self.directory.model
        rid = handle.request_id
        req = Request(rid, ids, params)
        state = OutputState(req, self.tokenizer, tuple(model.eos_token_ids), model.max_model_len)
        fingerprint = bytes.fromhex(model.fingerprint)
        keys = block_keys(ids, model.block_size, fingerprint)
        pooled = await asyncio.to_thread(self.meta.lookup_prefix, keys)
        cached = len(pooled) * model.block_size

        if handle.aborted:
            yield self._final(handle, req, state, "abort", (cached, cached), {}, t0)
            return
        if self.cfg.colocated:
            async for message in self._colocated(handle, req, state, params, t0):
                yield message
            return
        t_prefill = time.perf_counter()
        sampling = sampling_to_proto(params)
        prefill = await self._prefill(handle, ids, sampling, keys, pooled)
        if prefill is None:
            yield self._final(handle, req, state, "abort", (cached, cached), {}, t0)
            return
        ttft = time.perf_counter() - t0
        timings = {
            "queue_ms": (t_prefill - t0) * 1e3 + prefill.queue_ms,
            "prefill_ms": prefill.prefill_ms,
            "kv_transfer_ms": prefill.kv_put_ms,
            "ttft_ms": ttft * 1e3,
        }
        status = state.add_token(prefill.first_token_id)
        if status is not None:
            req.status = status
            handle.release_pool = True  # no decode will pull the private tail: release it
            yield self._final(handle, req, state, None, cached_of(prefill), timings, t0)
            return
        out = state.emit()
        yield generate_pb2.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, text=out.text)

        if handle.aborted:  # Abort() came while the first token was on its way
            yield self._final(handle, req, state, "abort", cached_of(prefill), timings, t0)
            return
        decode_req = worker_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=ids,
            first_token_id=prefill.first_token_id,
            sampling=sampling_to_proto(replace(params, stop=())),  # stop strings are applied here
            blocks=prefill.blocks,
            num_kv_tokens=prefill.num_kv_tokens,
        )
        relay = Relay(req, state, timings, cached_of(prefill), t0)
        async for message in self._relay(handle, decode_req, relay):
            yield message

    async def _colocated(self, handle: Inflight, req: Request, state: OutputState, params, t0: float):
        """The colocated baseline: one decode worker computes the prompt and streams every token."""
        decode_req = worker_pb2.DecodeRequest(
            request_id=handle.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_proto(replace(params, stop=())),
            prefill_here=True,
        )
        async for message in self._relay(handle, decode_req, Relay(req, state, {}, (0, 0), t0)):
            yield message

    async def _prefill(
        self, handle: Inflight, ids: list[int], sampling, keys: list[bytes], pooled
    ) -> worker_pb2.PrefillResponse | None:
        """The prefill on the worker `self.routing` chooses (`pooled`: where the pool holds the leading
        `keys`); one that dies or refuses is replaced by another (at most MAX_RETRIES times, never the
        same one twice). None: Abort() came meanwhile."""
        tried: set[str] = set()
        failed: WorkerFailed | None = None
        for tries in itertools.count(1):
            choice = self.routing.choose(keys, pooled, len(ids), tried)
            if choice is None:  # none left to try: the last failure is the answer
                raise failed or RequestRejected(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available")
            tried.add(choice.worker.member_id)
            self.metrics.routed(choice)
            try:
                prefill = await self._call_prefill(handle, choice, ids, sampling)
            except WorkerFailed as err:
                self.routing.failed(choice)
                if not self._retry(handle, err, "prefill", tries):
                    raise
                failed = err
                handle.release_pool = True  # the failed one may have put part of the prompt's KV
                continue
            if prefill is not None:
                self.metrics.prefilled(choice, cached_of(prefill))
            return prefill

    def _retry(self, handle: Inflight, err: WorkerFailed, role: str, tries: int) -> bool:
        """Whether a failed worker call is tried again on another worker of `role` (logged, counted)."""
        if not err.retry or tries > MAX_RETRIES or handle.aborted or handle.remaining() <= 0:
            return False
        log.warning("%s of %s failed, trying another worker: %s", role, handle.request_id, err)
        self.metrics.failover(role, err.code.name)
        return True

    async def _relay(self, handle: Inflight, first: worker_pb2.DecodeRequest, relay: Relay):
        """Stream `first` from the least-loaded decode worker, applying stop rules. A worker that dies
        mid-stream is replaced by another that resumes from the tokens streamed so far (at most
        MAX_RETRIES times, never the same one twice): the client sees one unbroken stream."""
        tried: set[str] = set()
        decode_req, failed = first, None
        for tries in itertools.count(1):
            worker = self._pick_decode(decode_req, tried, failed)
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

    def _pick_decode(self, decode_req, tried: set[str], failed: WorkerFailed | None) -> Member:
        """A decode worker not yet tried; none left: the last failure, if any, is the answer."""
        model = self.directory.model
        tokens = len(decode_req.prompt_token_ids) + decode_req.sampling.max_tokens
        worker = pick_excluding(self.directory, "decode", tried, -(-tokens // model.block_size))
        if worker is None:
            raise failed or RequestRejected(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")
        return worker

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
                status = None
                for token in msg.token_ids:
                    status = state.add_token(token)
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
                    yield generate_pb2.GenerateResponse(
                        request_id=handle.request_id, token_ids=out.new_token_ids, text=out.text
                    )
        except grpc.aio.AioRpcError as err:
            raise self._failed(worker, "decode", err) from None
        finally:
            worker.inflight -= 1
            call.cancel()  # (a no-op once it ended) the stream was closed early: end the call too
            handle.calls.remove(call)
        raise RequestRejected(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    def _failed(self, worker: Member, role: str, err: grpc.aio.AioRpcError) -> WorkerFailed:
        """The WorkerFailed of a failed call; a worker whose connection broke gets nothing new for a while."""
        if connection_lost(err):
            self.directory.suspect(worker, SUSPECT_S)
        return WorkerFailed(
            relay_code(err), f"{role} worker {worker.member_id}: {err.details()}", retryable(role, err)
        )

    async def _call_prefill(self, handle, choice: Choice, ids, sampling):
        worker = choice.worker
        worker.inflight += 1
        worker.inflight_tokens += choice.compute_tokens
        call = worker.stub.Prefill(
            worker_pb2.PrefillRequest(request_id=handle.request_id, prompt_token_ids=ids, sampling=sampling),
            timeout=handle.remaining(),
        )
        handle.calls.append(call)
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if handle.aborted and task is not None and not task.cancelling():
                return None  # Abort() cancelled the call: finish the stream with "abort"
            raise
        except grpc.aio.AioRpcError as err:
            raise self._failed(worker, "prefill", err) from None
        finally:
            worker.inflight -= 1
            worker.inflight_tokens -= choice.compute_tokens
            handle.calls.remove(call)

    def _final(self, handle, req: Request, state: OutputState, reason, cached: tuple[int, int], timings, t0):
        if reason == "abort":
            req.status = RequestStatus.FINISHED_ABORTED
        out = state.emit()
        timings = dict(timings)
        timings["e2e_ms"] = (time.perf_counter() - t0) * 1e3
        return generate_pb2.GenerateResponse(
            request_id=handle.request_id,
            token_ids=out.new_token_ids,
            text=out.text,
            finished=generate_pb2.Finished(
                finish_reason=req.status.finish_reason or "abort",
                prompt_tokens=req.num_prompt_tokens,
                output_tokens=len(req.output_token_ids),
                cached_tokens=cached[0],
                pool_cached_tokens=cached[1],
                timings=generate_pb2.Timings(**timings),
            ),
        )

    async def _cleanup(self, handle: Inflight) -> None:
        """Release everything a request that ended early holds in the workers and the pool."""
        for call in list(handle.calls):
            call.cancel()
        rid = handle.request_id
        if handle.decode is not None:
            try:
                await handle.decode.stub.Abort(worker_pb2.WorkerAbortRequest(request_id=rid), timeout=5)
            except grpc.aio.AioRpcError as err:
                log.warning("abort of %s on %s failed: %s", rid, handle.decode.member_id, err)
        await self._release_pool(rid)

    async def _release_pool(self, request_id: str) -> None:
        for node_id, node in list(self.directory.pool_nodes.items()):  # the registry, as last read
            addr = node.addr
            channel = self.pool_channels.get(addr)
            if channel is None:
                channel = self.pool_channels[addr] = aio_channel(addr)
            try:
                await pool_pb2_grpc.KVPoolStub(channel).Release(
                    pool_pb2.ReleaseRequest(request_id=request_id), timeout=5
                )
            except grpc.aio.AioRpcError as err:
                log.warning("release of %s on pool node %s failed: %s", request_id, node_id, err)

    # -- other RPCs -----------------------------------------------------------------------------------
    async def Abort(self, request, context):
        handle = self.inflight.get(request.request_id)
        if handle is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"request_id {request.request_id!r} is not in flight"
            )
        handle.aborted = True
        if handle.decode is not None:
            try:
                await handle.decode.stub.Abort(
                    worker_pb2.WorkerAbortRequest(request_id=request.request_id), timeout=5
                )
            except grpc.aio.AioRpcError as err:
                log.warning("abort of %s failed: %s", request.request_id, err)
        else:
            for call in list(handle.calls):
                call.cancel()
        return generate_pb2.AbortResponse()

    async def GetModelInfo(self, request, context):
        model = self.directory.model
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker has registered yet")
        return generate_pb2.ModelInfo(
            model=self.served_model_name,  # never the checkpoint's path on the workers' disks
            dtype=model.dtype,
            block_size=model.block_size,
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
            max_tokens_limit=model.max_model_len - 1,
            fingerprint=model.fingerprint,
            num_prefill_workers=self.directory.count("prefill"),
            num_decode_workers=self.directory.count("decode"),
            num_pool_nodes=len(self.directory.pool_nodes),
            kernels=self.directory.kernels(),
        )


def _bind(server: grpc.aio.Server, cfg: RouterConfig) -> int:
    """The public port: TLS when given a certificate and key, else plaintext."""
    addr = f"{cfg.host}:{cfg.port}"
    if cfg.ssl_certfile:
        with open(cfg.ssl_keyfile, "rb") as key, open(cfg.ssl_certfile, "rb") as cert:
            creds = grpc.ssl_server_credentials([(key.read(), cert.read())])
        port = server.add_secure_port(addr, creds)
    else:
        port = server.add_insecure_port(addr)
    if port == 0:
        raise OSError(f"cannot bind the router to {addr}")
    return port


async def serve(cfg: RouterConfig, stop: asyncio.Event, on_started: Callable[[], None] | None = None) -> None:
    router = Router(cfg)
    options = [  # a request is small (limits.py); only the receive side is bounded tighter
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        *SERVER_KEEPALIVE,  # clients' keepalive pings
    ]
    # API keys gate the public API (the cluster secret opens it too); without keys it is open, as HTTP is
    gate = server_interceptors(router.credentials, aio=True) if cfg.api_keys else []
    server = grpc.aio.server(options=options, interceptors=gate)
    generate_pb2_grpc.add_GenerationServicer_to_server(router, server)
    names = service_names(generate_pb2.DESCRIPTOR)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = _bind(server, cfg)
    await server.start()
    await router.directory.start()
    log.info("router listening on %s:%d%s", cfg.host, port, " (TLS)" if cfg.ssl_certfile else "")

    async def track_health() -> None:
        while True:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if router.directory.ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", *names):
                await health_servicer.set(name, status)
            await asyncio.sleep(cfg.refresh_s)

    tracker = asyncio.create_task(track_health())
    http = None
    if cfg.http_port is not None:
        http = await start_http(router, cfg.host, cfg.http_port, cfg.ssl_certfile, cfg.ssl_keyfile)
    if on_started is not None:
        on_started()
    await stop.wait()
    tracker.cancel()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if http is not None:
        await http.stop()
    await server.stop(grace=5)
    await router.directory.stop()


def main(argv: list[str] | None = None) -> int:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="python -m kvferry.router", description="run the kvferry router")
    p.add_argument("--model", default=d.model)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    add_redis_url_arg(p)
    p.add_argument("--namespace", default=d.namespace)
    p.add_argument("--max-inflight", type=int, default=d.max_inflight)
    p.add_argument(
        "--colocated", action="store_true", help="no prefill workers: decode workers do both phases"
    )
    p.add_argument(
        "--http-port", type=int, default=d.http_port, help="OpenAI API + /metrics port (0 = any free)"
    )
    p.add_argument("--no-http", action="store_true", help="serve gRPC only")
    p.add_argument("--served-model-name", default=None, help="the model name of the APIs")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"a bearer key clients must send (repeatable; also ${API_KEY_ENV}, comma-separated)",
    )
    p.add_argument("--ssl-certfile", default=None, help="serve gRPC and HTTP over TLS with this PEM cert")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's PEM private key")
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=d.request_timeout_s,
        help="the deadline of a request whose client sets none",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=d.max_request_bytes, help="largest request message accepted"
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default=d.routing,
        help="prefill worker choice: kv-aware (the one expected to hold most of the prompt's prefix, "
        "weighed against load) or least-load (default: %(default)s)",
    )
    args = p.parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        p.error("--ssl-certfile and --ssl-keyfile go together")
    if args.request_timeout_s <= 0:
        p.error("--request-timeout-s must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    cfg = RouterConfig(
        model=args.model,
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        namespace=args.namespace,
        max_inflight=args.max_inflight,
        colocated=args.colocated,
        http_port=None if args.no_http else args.http_port,
        served_model_name=args.served_model_name,
        api_keys=(*args.api_key, *load_settings().api_keys),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        request_timeout_s=args.request_timeout_s,
        max_request_bytes=args.max_request_bytes,
        routing=args.routing,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop, on_started=settle_heap)

    asyncio.run(run())
    hard_exit(0)
