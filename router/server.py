"""The router: the cluster's public gRPC front door (asyncio).

Generate: validate every field -> tokenize -> block keys -> ask the pool how much of the prefix is
cached -> admit (RESOURCE_EXHAUSTED past --max-inflight) -> least-loaded prefill worker (first token +
KV locations) -> least-loaded decode worker (pulls the KV, streams tokens) -> relay with incremental
detokenization and stop strings applied here. Whatever ends a request early (client cancel, deadline,
Abort, a stop string) is propagated: the in-flight worker call is cancelled, the decode worker is told
to abort, and the pool drops the request's private blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvferry.auth import server_interceptors
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
from kvferry.kvpool.metadata import MetadataStore
from kvferry.model.create import resolve_model
from kvferry.model.tokenizer import Tokenizer
from kvferry.proc import settle_heap
from kvferry.router.directory import Directory, Member
from kvferry.router.metrics import RequestTrack, RouterMetrics
from kvferry.rpc import CHANNEL_OPTIONS, aio_channel, hard_exit, service_names
from kvferry.settings import load_settings
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
    served_model_name: str | None = None  # the name the HTTP API answers to (default: `model`)


@dataclass
class Inflight:
    request_id: str
    deadline: float | None  # time.monotonic() by which the client wants it done
    ids: list[int]
    params: SamplingParams
    t0: float  # perf_counter() when it arrived
    track: RequestTrack
    aborted: bool = False
    decode: Member | None = None
    calls: list = field(default_factory=list)
    release_pool: bool = False  # the pool may still hold the request's private tail block

    def remaining(self) -> float | None:
        """Seconds left until the deadline (for worker calls), None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class RequestRejected(Exception):
    """A request the cluster cannot serve (overload, no workers, a worker failed); `code` says which."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def error_code(err: Exception) -> grpc.StatusCode:
    return err.code if isinstance(err, RequestRejected) else grpc.StatusCode.INVALID_ARGUMENT


def cached_of(prefill: worker_pb2.PrefillResponse) -> tuple[int, int]:
    """(prefix-cache hit tokens, of which pulled from the pool) of a prefill."""
    return prefill.cached_tokens, prefill.pool_cached_tokens


class Router(generate_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model, load_settings().models_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.served_model_name = cfg.served_model_name or cfg.model
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self.directory = Directory(self.meta, cfg.refresh_s, colocated=cfg.colocated)
        self.metrics = RouterMetrics(self.served_model_name, self.directory)
        self.inflight: dict[str, Inflight] = {}
        self.pool_channels: dict[str, grpc.aio.Channel] = {}

    # -- validation -----------------------------------------------------------------------------------
    def _prepare(self, request: generate_pb2.GenerateRequest) -> tuple[str, list[int], SamplingParams]:
        model = self.directory.model
        if model is None or not self.directory.ready:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "no prefill/decode workers are ready yet")
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequestError("prompt: set either text or token_ids")
        if which == "text":
            if not request.text:
                raise InvalidRequestError("prompt.text must not be empty")
            ids = self.tokenizer.encode(request.text)
            if not ids:
                raise InvalidRequestError("prompt.text encodes to no tokens")
        else:
            ids = list(request.token_ids.ids)
        params = sampling_from_proto(request.sampling)
        ids = validate_request(
            ids,
            params,
            model.vocab_size,
            model.max_model_len,
            prompt_field="prompt.token_ids",
            sampling_field="sampling.",
            max_tokens_fit=True,
        )
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self.inflight:
            raise InvalidRequestError(f"request_id {request_id!r} is already in flight")
        if len(self.inflight) >= self.cfg.max_inflight:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.inflight)} requests in flight (--max-inflight {self.cfg.max_inflight}); "
                "retry later",
            )
        return request_id, ids, params

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
        handle = self.admit(request, timeout, api)
        async with contextlib.aclosing(self.run(handle)) as stream:
            async for message in stream:
                yield message

    def admit(self, request: generate_pb2.GenerateRequest, timeout: float | None, api: str) -> Inflight:
        """Validate and admit a request (it counts as in flight from now on): then `run` it, or
        `withdraw` it. Raises InvalidRequestError (bad input) or RequestRejected (RESOURCE_EXHAUSTED past
        --max-inflight, UNAVAILABLE before the cluster is ready)."""
        t0 = time.perf_counter()
        try:
            request_id, ids, params = self._prepare(request)
        except (InvalidRequestError, RequestRejected) as err:
            self.metrics.rejected(api, error_code(err).name)
            raise
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = Inflight(request_id, deadline, ids, params, t0, self.metrics.track(api, t0))
        self.inflight[request_id] = handle
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
            try:
                if not completed or handle.aborted:
                    await self._cleanup(handle)
                elif handle.release_pool:
                    await self._release_pool(handle.request_id)
            finally:  # only now may the id be reused: cleanup must not hit its successor
                del self.inflight[handle.request_id]

    async def _generate(self, handle: Inflight):
        ids, params, t0 = handle.ids, handle.params, handle.t0
        model = self.directory.model
        rid = handle.request_id
        req = Request(rid, ids, params)
        state = OutputState(req, self.tokenizer, tuple(model.eos_token_ids), model.max_model_len)
        fingerprint = bytes.fromhex(model.fingerprint)
        keys = block_keys(ids, model.block_size, fingerprint)
        cached = len(await asyncio.to_thread(self.meta.lookup_prefix, keys)) * model.block_size

        if handle.aborted:
            yield self._final(handle, req, state, "abort", (cached, cached), {}, t0)
            return
        if self.cfg.colocated:
            async for message in self._colocated(handle, req, state, params, t0):
                yield message
            return
        prefill_worker = self.directory.pick("prefill")
        if prefill_worker is None:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available")
        t_prefill = time.perf_counter()
        sampling = sampling_to_proto(params)
        prefill = await self._call_prefill(handle, prefill_worker, ids, sampling)
        if prefill is None:
            yield self._final(handle, req, state, "abort", cached, {}, t0)
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
        async for message in self._relay(handle, decode_req, req, state, timings, cached_of(prefill), t0):
            yield message

    async def _colocated(self, handle: Inflight, req: Request, state: OutputState, params, t0: float):
        """The colocated baseline: one decode worker computes the prompt and streams every token."""
        decode_req = worker_pb2.DecodeRequest(
            request_id=handle.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_proto(replace(params, stop=())),
            prefill_here=True,
        )
        async for message in self._relay(handle, decode_req, req, state, {}, (0, 0), t0):
            yield message

    async def _relay(self, handle, decode_req, req, state, timings, cached, t0):
        """Pick a decode worker for `decode_req` and stream its tokens to the client, applying stop
        rules (first token time = TTFT when the worker also ran the prefill). `cached`: (prefix-cache
        hit tokens, of which from the pool)."""
        model = self.directory.model
        tokens = len(decode_req.prompt_token_ids) + decode_req.sampling.max_tokens
        decode_worker = self.directory.pick("decode", -(-tokens // model.block_size))  # blocks it will hold
        if decode_worker is None:
            raise RequestRejected(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")
        handle.decode = decode_worker
        timings = dict(timings)
        decode_worker.inflight += 1
        call = decode_worker.stub.Decode(decode_req, timeout=handle.remaining())
        handle.calls.append(call)
        try:
            async for msg in call:
                if decode_req.prefill_here and msg.cached_tokens:
                    cached = (msg.cached_tokens, 0)  # the worker's own prefix cache
                elif msg.kv_pull_ms or msg.first_decode_ms:
                    timings["kv_transfer_ms"] += msg.kv_pull_ms
                    timings["first_decode_ms"] = msg.first_decode_ms
                    handle.release_pool = msg.recomputed_tokens > 0
                if "ttft_ms" not in timings and msg.token_ids:
                    timings["ttft_ms"] = (time.perf_counter() - t0) * 1e3
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
                    yield self._final(handle, req, state, None, cached, timings, t0)
                    return
                out = state.emit()
                if out.new_token_ids:
                    yield generate_pb2.GenerateResponse(
                        request_id=handle.request_id, token_ids=out.new_token_ids, text=out.text
                    )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.directory.suspect(decode_worker, 2.0)
            raise RequestRejected(
                _relay_code(err), f"decode worker {decode_worker.member_id}: {err.details()}"
            ) from None
        finally:
            decode_worker.inflight -= 1
        raise RequestRejected(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    async def _call_prefill(self, handle, worker: Member, ids, sampling):
        worker.inflight += 1
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
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                self.directory.suspect(worker, 2.0)
            raise RequestRejected(
                _relay_code(err), f"prefill worker {worker.member_id}: {err.details()}"
            ) from None
        finally:
            worker.inflight -= 1
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
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request.request_id!r} is not in flight"
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
            model=model.model,
            dtype=model.dtype,
            block_size=model.block_size,
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
            max_tokens_limit=model.max_model_len - 1,
            fingerprint=model.fingerprint,
            num_prefill_workers=self.directory.count("prefill"),
            num_decode_workers=self.directory.count("decode"),
            num_pool_nodes=len(self.directory.pool_nodes),
        )


def _relay_code(err: grpc.aio.AioRpcError) -> grpc.StatusCode:
    code = err.code()
    return (
        code
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED)
        else (grpc.StatusCode.UNAVAILABLE)
    )


async def serve(cfg: RouterConfig, stop: asyncio.Event, on_started: Callable[[], None] | None = None) -> None:
    router = Router(cfg)
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=server_interceptors(aio=True))
    generate_pb2_grpc.add_GenerationServicer_to_server(router, server)
    names = service_names(generate_pb2.DESCRIPTOR)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise OSError(f"cannot bind the router to {cfg.host}:{cfg.port}")
    await server.start()
    await router.directory.start()
    log.info("router listening on %s:%d", cfg.host, port)

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
    http = await start_http(router, cfg.host, cfg.http_port) if cfg.http_port is not None else None
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


class HttpServer:
    """uvicorn serving the OpenAI API on the running loop (signals stay with the router's loop)."""

    def __init__(self, router: Router, host: str, port: int):
        import uvicorn

        from kvferry.router.openai_api import build_app

        class _Server(uvicorn.Server):
            def install_signal_handlers(self) -> None:  # uvicorn < 0.29
                pass

            @contextlib.contextmanager
            def capture_signals(self):  # the router's own handlers stop everything
                yield

        config = uvicorn.Config(
            build_app(router),
            host=host,
            port=port,
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.task.done():  # it could not bind (the error is in the task)
                self.task.result()
                raise OSError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


async def start_http(router: Router, host: str, port: int) -> HttpServer:
    http = HttpServer(router, host, port)
    bound = await http.start()
    log.info("OpenAI-compatible API on http://%s:%d/v1 (metrics: /metrics)", host, bound)
    return http


def main(argv: list[str] | None = None) -> int:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="python -m kvferry.router", description="run the kvferry router")
    p.add_argument("--model", default=d.model)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--namespace", default=d.namespace)
    p.add_argument("--max-inflight", type=int, default=d.max_inflight)
    p.add_argument(
        "--colocated", action="store_true", help="no prefill workers: decode workers do both phases"
    )
    p.add_argument(
        "--http-port", type=int, default=d.http_port, help="OpenAI API + /metrics port (0 = any free)"
    )
    p.add_argument("--no-http", action="store_true", help="serve gRPC only")
    p.add_argument("--served-model-name", default=None, help="the model name of the OpenAI API")
    args = p.parse_args(argv)
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
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop, on_started=settle_heap)

    asyncio.run(run())
    hard_exit(0)
