"""The router: the cluster's public gRPC front door (asyncio).

Generate: cheap limits (`router.limits`) -> admit (RESOURCE_EXHAUSTED past --max-inflight, counted
before any work) -> tokenize (off the event loop) and validate every field (`router.admission`) ->
block keys -> ask the pool how much of the prefix is cached (the request's one hash and one lookup,
both sent on to the workers) -> the prefill worker whose own cache is expected to hold most of the
prompt's prefix, weighed against load (`router.dispatch`, `router.prefix_routing`; first token + KV
locations) -> least-loaded decode worker (pulls the KV, streams tokens) -> relay with incremental
detokenization and stop strings applied here (`router.relay`). A worker that dies or refuses is
replaced by another (`router.failover`): a prefill is sent again, a decode stream resumes where it
broke. Whatever ends a request early (client cancel, deadline, Abort, a stop string) is propagated: the
in-flight worker call is cancelled, the decode worker is told to abort, and the pool drops the
request's private blocks. Every worker call has a deadline: the client's, else --request-timeout-s.

The public API asks for a bearer API key when given some (--api-key; the cluster secret is accepted
too) and serves TLS when given a certificate (--ssl-certfile/--ssl-keyfile), on gRPC and HTTP alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvferry.auth import Credentials, cluster_secret, server_interceptors
from kvferry.convert import logprob_from_proto, sampling_to_proto
from kvferry.engine.output import OutputState
from kvferry.engine.request import (
    InvalidRequestError,
    Request,
)
from kvferry.flags import add_config_args, config_from
from kvferry.kvpool.metadata import MetadataStore, add_redis_url_arg
from kvferry.model.config import generation_defaults
from kvferry.model.create import resolve_model
from kvferry.model.tokenizer import Tokenizer
from kvferry.proc import settle_heap
from kvferry.router.admission import Admission, Inflight, RequestRejected, error_code
from kvferry.router.config import RouterConfig
from kvferry.router.directory import Directory
from kvferry.router.dispatch import PrefillDispatch, cached_of
from kvferry.router.http_server import start_http
from kvferry.router.metrics import RouterMetrics
from kvferry.router.prefix_routing import PrefillRouting, RoutingConfig
from kvferry.router.relay import Relay, StreamRelay, response
from kvferry.router.sequences import LeaderGone, Sequences
from kvferry.router.slo import SloAdmission, check_default_target
from kvferry.rpc import (
    MAX_MESSAGE_BYTES,
    SERVER_KEEPALIVE,
    Heartbeat,
    aio_channel,
    hard_exit,
    service_names,
)
from kvferry.settings import load_settings
from kvferry.v1 import generate_pb2, generate_pb2_grpc, pool_pb2, pool_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop of `--event-loop` (None: asyncio's own)."""
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise SystemExit("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def public_model_name(name: str) -> str:
    """A model name fit to show clients: a checkpoint's path becomes its directory's name."""
    if os.path.isabs(name) or name.startswith(("./", "../", "~")):
        return os.path.basename(os.path.normpath(os.path.expanduser(name))) or name
    return name


class Router(
    Admission, SloAdmission, PrefillDispatch, StreamRelay, Sequences, generate_pb2_grpc.GenerationServicer
):
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model, load_settings().models_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        names = cfg.served_model_name or (cfg.model,)
        self.served_model_name = public_model_name(names[0])
        self.model_names = {*names, self.served_model_name, cfg.model, str(self.model_dir)}
        self.sampling_defaults = generation_defaults(self.model_dir, cfg.generation_config)
        self._grammars = None  # structured outputs' compiler (Admission.grammars)
        self.credentials = Credentials(cluster_secret(), cfg.api_keys)
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self.directory = Directory(self.meta, cfg.refresh_s, colocated=cfg.colocated)
        self.metrics = RouterMetrics(self.served_model_name, self.directory)
        self.routing = PrefillRouting(RoutingConfig(mode=cfg.routing), self.directory)
        self.inflight: dict[str, Inflight] = {}
        self.ending: set[asyncio.Future] = set()  # releases that outlive their request's stream (`_end`)
        self.pool_channels: dict[str, grpc.aio.Channel] = {}
        self._init_slo()

    # -- Generate (admission: router.admission, router.slo; the prefill: router.dispatch; the stream:
    # router.relay; n sequences of one prompt: router.sequences) --
    async def Generate(self, request, context):
        """The gRPC face of `generate`: typed errors become status codes."""
        try:
            async with contextlib.aclosing(self.generate(request, context.time_remaining())) as stream:
                async for message in stream:
                    yield message
        except InvalidRequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except RequestRejected as err:
            trailer = (
                ()
                if err.retry_after_s is None
                else (("retry-after-ms", str(round(err.retry_after_s * 1e3))),)
            )
            await context.abort(err.code, str(err), trailing_metadata=trailer)

    async def generate(
        self, request: generate_pb2.GenerateRequest, timeout: float | None = None, api: str = "grpc"
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Serve one request, whichever API it came by: `admit`, then `run`'s messages."""
        handle = await self.admit(request, timeout, api)
        async with contextlib.aclosing(self.run(handle)) as stream:
            async for message in stream:
                yield message

    async def run(self, handle: Inflight) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The stream of an admitted request, the last message with `finished` (of each sequence, for
        n > 1: `router.sequences`). Raises RequestRejected when a worker fails it (its code says why).
        Closing the stream early (the client went away) releases everything the request holds in the
        workers and the pool."""
        stream = self._run_n(handle) if handle.params.n > 1 else self._run_one(handle)
        async with contextlib.aclosing(stream):
            async for message in stream:
                yield message

    async def _run_one(self, handle: Inflight) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """One sequence's stream (`run`)."""
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
        if handle.prompt_keys is None:  # (made at admission, except colocated and a request's siblings)
            await self._look_up(handle, handle.cache_salt)
        prompt_keys, pooled = handle.prompt_keys, handle.pooled
        cached = len(pooled) * model.block_size

        if handle.aborted:
            yield self._final(handle, req, state, "abort", (cached, cached), {}, t0)
            return
        if self.cfg.colocated:
            if handle.index:  # a sibling: once the leader's prompt is in its worker's prefix cache
                await handle.shared.started.wait()
            async for message in self._colocated(handle, req, state, params, prompt_keys, t0):
                yield message
            return
        t_prefill = time.perf_counter()
        prefill = await self._shared_or_own_prefill(handle, ids, prompt_keys, pooled)
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
        if handle.prediction is not None and handle.prediction.ttft_ms is not None:
            timings["predicted_ttft_ms"] = handle.prediction.ttft_ms
            self.first_token(handle, ttft * 1e3)
        if handle.prediction is not None and handle.prediction.tpot_ms is not None:
            timings["predicted_tpot_ms"] = handle.prediction.tpot_ms
        req.prompt_logprobs = [logprob_from_proto(x) for x in prefill.prompt_logprobs]
        first = logprob_from_proto(prefill.first_logprob) if prefill.HasField("first_logprob") else None
        status = state.add_token(prefill.first_token_id, first)
        if status is not None:
            req.status = status
            handle.release_pool = True  # no decode will pull the private tail: release it
            yield self._final(handle, req, state, None, cached_of(prefill), timings, t0)
            return
        yield response(rid, state.emit())

        if handle.aborted:  # Abort() came while the first token was on its way
            yield self._final(handle, req, state, "abort", cached_of(prefill), timings, t0)
            return
        decode_req = worker_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=ids,
            first_token_id=prefill.first_token_id,
            # stop strings are applied here; the prompt's logprobs came with the prefill
            sampling=sampling_to_proto(replace(params, stop=(), prompt_logprobs=None, n=1)),
            blocks=prefill.blocks,
            num_kv_tokens=prefill.num_kv_tokens,
            keys=prompt_keys,
            priority=handle.priority,
        )
        relay = Relay(req, state, timings, cached_of(prefill), t0)
        async for message in self._relay(handle, decode_req, relay):
            yield message

    async def _shared_or_own_prefill(self, handle: Inflight, ids, prompt_keys, pooled):
        """The prefill of a sequence: its own (one sequence, or a sibling whose leader's did not come),
        or, for the leader of n, one that samples every sequence's first token (router.sequences)."""
        shared = handle.shared
        if shared is not None and handle.index:
            prefill = await self._sibling_prefill(handle)
            if prefill is not None:
                return prefill
        sampling = sampling_to_proto(replace(handle.params, n=shared.n if shared and not handle.index else 1))
        try:
            prefill = await self._prefill(handle, ids, sampling, prompt_keys, pooled)
        except BaseException as err:
            if shared is not None and not handle.index and not shared.prefill.done():
                shared.prefill.set_exception(LeaderGone(str(err)))
            raise
        if shared is not None and not handle.index and not shared.prefill.done():
            shared.prefill.set_result(prefill)
        return prefill

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
        for one in (handle, *handle.siblings):  # every sequence of the request
            await self._abort(one)
        return generate_pb2.AbortResponse()

    async def _abort(self, handle: Inflight) -> None:
        handle.aborted = True
        if handle.decode is not None:
            try:
                await handle.decode.stub.Abort(
                    worker_pb2.WorkerAbortRequest(request_id=handle.request_id), timeout=5
                )
            except grpc.aio.AioRpcError as err:
                log.warning("abort of %s failed: %s", handle.request_id, err)
        else:
            for call in list(handle.calls):
                call.cancel()

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
        shown = None
        while True:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if router.directory.ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            if status != shown:  # set on a change only: watchers hear of changes, not of every tick
                for name in ("", *names):
                    await health_servicer.set(name, status)
                shown = status
            await asyncio.sleep(cfg.refresh_s)

    tracker = asyncio.create_task(track_health())
    # its traffic over the last window, for the planner (deploy.planner reads it from the registry)
    traffic = Heartbeat(
        router.meta,
        "router",
        uuid.uuid4().hex[:12],
        lambda: (
            router.metrics.traffic.summary()
            | {"addr": f"{cfg.host}:{port}", "inflight": len(router.inflight)}
        ),
        interval_s=1.0,
        ttl_s=5.0,
    )
    traffic.start()
    http = None
    if cfg.http_port is not None:
        http = await start_http(router, cfg.host, cfg.http_port, cfg.ssl_certfile, cfg.ssl_keyfile)
    if on_started is not None:
        on_started()
    await stop.wait()
    await asyncio.to_thread(traffic.stop)
    tracker.cancel()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if http is not None:
        await http.stop()
    await server.stop(grace=5)
    await router.directory.stop()


def parser() -> argparse.ArgumentParser:
    """The router's command line: RouterConfig's fields (`kvferry.flags`), and the Redis URL."""
    p = argparse.ArgumentParser(prog="python -m kvferry.router", description="run the kvferry router")
    add_config_args(p, RouterConfig)
    add_redis_url_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        p.error("--ssl-certfile and --ssl-keyfile go together")
    if args.request_timeout_s <= 0:
        p.error("--request-timeout-s must be > 0")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        try:
            check_default_target("--" + name.replace("_", "-"), getattr(args, name))
        except ValueError as err:
            p.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    cfg = config_from(args, RouterConfig, api_keys=(*(args.api_key or ()), *load_settings().api_keys))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop, on_started=settle_heap)

    with asyncio.Runner(loop_factory=loop_factory(cfg.event_loop)) as runner:
        runner.run(run())
    hard_exit(0)
