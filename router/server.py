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
import logging
import math
import signal
import time
import uuid
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvferry.convert import sampling_from_proto, sampling_to_proto
from kvferry.decode_worker.output import OutputState
from kvferry.decode_worker.request import InvalidRequestError, Request, RequestStatus, SamplingParams
from kvferry.kvpool.keys import block_keys
from kvferry.kvpool.metadata import MetadataStore
from kvferry.model.create import resolve_model
from kvferry.model.tokenizer import Tokenizer
from kvferry.router.directory import Directory, Member
from kvferry.rpc import CHANNEL_OPTIONS, hard_exit, service_names
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


@dataclass
class Inflight:
    request_id: str
    aborted: bool = False
    decode: Member | None = None
    calls: list = field(default_factory=list)
    release_pool: bool = False  # the pool may still hold the request's private tail block


class RequestRejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Router(generate_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.tokenizer = Tokenizer(resolve_model(cfg.model, load_settings().models_dir))
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self.directory = Directory(self.meta, cfg.refresh_s, colocated=cfg.colocated)
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
            if not ids:
                raise InvalidRequestError("prompt.token_ids must not be empty")
            bad = [t for t in ids if not 0 <= t < model.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt.token_ids must lie in [0, {model.vocab_size}); got {bad[0]}"
                )
        if len(ids) >= model.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; max_model_len is {model.max_model_len}, leaving no room to "
                "generate"
            )
        p = request.sampling
        if p.HasField("temperature") and not math.isfinite(p.temperature):
            raise InvalidRequestError(f"sampling.temperature must be finite, got {p.temperature}")
        params = sampling_from_proto(p)
        try:
            params.validate()
        except InvalidRequestError as err:
            raise InvalidRequestError(f"sampling.{err}") from None
        room = model.max_model_len - len(ids)
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"sampling.max_tokens {params.max_tokens} is over the limit: the prompt has {len(ids)} "
                f"tokens and max_model_len is {model.max_model_len}, so at most {room} can be generated"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < model.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"sampling.stop_token_ids must lie in [0, {model.vocab_size}); got {bad[0]}"
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
        t0 = time.perf_counter()
        try:
            request_id, ids, params = self._prepare(request)
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except RequestRejected as err:
            await context.abort(err.code, str(err))
        handle = Inflight(request_id)
        self.inflight[request_id] = handle
        completed = False
        try:
            async for message in self._generate(handle, ids, params, context, t0):
                yield message
            completed = True
        finally:
            try:
                if not completed or handle.aborted:
                    await self._cleanup(handle)
                elif handle.release_pool:
                    await self._release_pool(request_id)
            finally:  # only now may the id be reused: cleanup must not hit its successor
                del self.inflight[request_id]

    async def _generate(self, handle: Inflight, ids: list[int], params: SamplingParams, context, t0: float):
        model = self.directory.model
        rid = handle.request_id
        req = Request(rid, ids, params)
        state = OutputState(req, self.tokenizer, tuple(model.eos_token_ids), model.max_model_len)
        fingerprint = bytes.fromhex(model.fingerprint)
        keys = block_keys(ids, model.block_size, fingerprint)
        cached = len(await asyncio.to_thread(self.meta.lookup_prefix, keys)) * model.block_size
        timeout = context.time_remaining()

        if handle.aborted:
            yield self._final(handle, req, state, "abort", cached, {}, t0)
            return
        if self.cfg.colocated:
            async for message in self._colocated(handle, req, state, params, context, t0):
                yield message
            return
        prefill_worker = self.directory.pick("prefill")
        if prefill_worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no prefill worker is available")
        t_prefill = time.perf_counter()
        sampling = sampling_to_proto(params)
        prefill = await self._call_prefill(handle, prefill_worker, ids, sampling, timeout, context)
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
            yield self._final(handle, req, state, None, prefill.cached_tokens, timings, t0)
            return
        out = state.emit()
        yield generate_pb2.GenerateResponse(request_id=rid, token_ids=out.new_token_ids, text=out.text)

        if handle.aborted:  # Abort() came while the first token was on its way
            yield self._final(handle, req, state, "abort", prefill.cached_tokens, timings, t0)
            return
        decode_req = worker_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=ids,
            first_token_id=prefill.first_token_id,
            sampling=sampling_to_proto(replace(params, stop=())),  # stop strings are applied here
            blocks=prefill.blocks,
            num_kv_tokens=prefill.num_kv_tokens,
        )
        async for message in self._relay(
            handle, decode_req, req, state, timings, prefill.cached_tokens, t0, context
        ):
            yield message

    async def _colocated(
        self, handle: Inflight, req: Request, state: OutputState, params, context, t0: float
    ):
        """The colocated baseline: one decode worker computes the prompt and streams every token."""
        decode_req = worker_pb2.DecodeRequest(
            request_id=handle.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=sampling_to_proto(replace(params, stop=())),
            prefill_here=True,
        )
        async for message in self._relay(handle, decode_req, req, state, {}, 0, t0, context):
            yield message

    async def _relay(self, handle, decode_req, req, state, timings, cached, t0, context):
        """Pick a decode worker for `decode_req` and stream its tokens to the client, applying stop
        rules (first token time = TTFT when the worker also ran the prefill)."""
        model = self.directory.model
        tokens = len(decode_req.prompt_token_ids) + decode_req.sampling.max_tokens
        decode_worker = self.directory.pick("decode", -(-tokens // model.block_size))  # blocks it will hold
        if decode_worker is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is available")
        handle.decode = decode_worker
        timings = dict(timings)
        decode_worker.inflight += 1
        call = decode_worker.stub.Decode(decode_req, timeout=context.time_remaining())
        handle.calls.append(call)
        try:
            async for msg in call:
                if msg.kv_pull_ms or msg.first_decode_ms:
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
            await context.abort(_relay_code(err), f"decode worker {decode_worker.member_id}: {err.details()}")
        finally:
            decode_worker.inflight -= 1
        await context.abort(grpc.StatusCode.INTERNAL, "decode stream ended without a finish reason")

    async def _call_prefill(self, handle, worker: Member, ids, sampling, timeout, context):
        worker.inflight += 1
        call = worker.stub.Prefill(
            worker_pb2.PrefillRequest(request_id=handle.request_id, prompt_token_ids=ids, sampling=sampling),
            timeout=timeout,
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
            await context.abort(_relay_code(err), f"prefill worker {worker.member_id}: {err.details()}")
        finally:
            worker.inflight -= 1
            handle.calls.remove(call)

    def _final(self, handle, req: Request, state: OutputState, reason, cached, timings, t0):
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
                cached_tokens=cached,
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
        for node_id, (addr, _) in list(self.directory.pool_nodes.items()):  # the registry, as last read
            channel = self.pool_channels.get(addr)
            if channel is None:
                channel = self.pool_channels[addr] = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
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


async def serve(cfg: RouterConfig, stop: asyncio.Event) -> None:
    router = Router(cfg)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
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
    await stop.wait()
    tracker.cancel()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=5)
    await router.directory.stop()


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
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    asyncio.run(run())
    hard_exit(0)
