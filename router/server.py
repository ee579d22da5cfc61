"""The router: the cluster's public gRPC front door (asyncio).

Generate: cheap limits (`router.limits`) -> admit (RESOURCE_EXHAUSTED past --max-inflight, counted
before any work) -> tokenize (off the event loop) and validate every field -> block keys -> ask the pool
how much of the prefix is cached (the request's one hash and one lookup, both sent on to the workers)
-> SLO check (`router.admission`, `router.slo`) -> the prefill worker whose own cache is expected to hold
most of the prompt's prefix, weighed against load (`router.dispatch`, `router.prefix_routing`; first
token + KV locations) -> least-loaded decode worker (pulls the KV, streams tokens) -> relay with
incremental detokenization and stop strings applied here (`router.relay`). A worker that dies or
refuses is replaced by another (`router.failover`): a prefill is sent again, a decode stream resumes
where it broke. Whatever ends a request early (client cancel, deadline, Abort, a stop string) is
propagated (`router.release`): the in-flight worker call is cancelled, the decode worker is told to
abort, and the pool drops the request's private blocks. Every worker call has a deadline: the client's,
else --request-timeout-s.

`Router` builds each part as an object of its own with what it needs, and `generate` runs a request
through them: `Admission.admit` -> `run` (n > 1: `Sequences.run`) -> per sequence `_sequence`
(`Sequences.prefill` -> `PrefillDispatch.prefill` -> first token -> `DecodeRelay.relay`), wrapped by
`_run_one` (metrics per message, then `Releases.end`). A resume: `Resumes.admit` -> `Resumes.stream`.

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

from kvferry.auth import (
    Credentials,
    cluster_secret,
    may_act_for,
    owner_of,
    scoped_id,
    server_interceptors,
)
from kvferry.convert import logprob_from_proto
from kvferry.engine.output import OutputState
from kvferry.engine.request import InvalidRequestError, Request
from kvferry.flags import add_config_args, config_from
from kvferry.kvpool.metadata import MetadataStore, add_redis_url_arg
from kvferry.model.config import generation_defaults
from kvferry.model.create import resolve_model
from kvferry.model.tokenizer import Tokenizer
from kvferry.proc import settle_heap
from kvferry.router.admission import Admission
from kvferry.router.config import RouterConfig
from kvferry.router.decode_link import DecodeLinks
from kvferry.router.directory import Directory
from kvferry.router.dispatch import PrefillDispatch, cached_of
from kvferry.router.failover import Failover
from kvferry.router.http_server import start_http
from kvferry.router.inflight import Inflight, RequestRejected, error_code
from kvferry.router.limits import MAX_REQUEST_ID_CHARS
from kvferry.router.metrics import RouterMetrics
from kvferry.router.prefix_routing import PrefillRouting, RoutingConfig
from kvferry.router.relay import DecodeRelay, Relay, response
from kvferry.router.release import Releases
from kvferry.router.resume import Resumes
from kvferry.router.sequences import Sequences
from kvferry.router.slo import SloPredictor, check_default_target
from kvferry.router.status import StatusLookup
from kvferry.rpc import MAX_MESSAGE_BYTES, SERVER_KEEPALIVE, Heartbeat, hard_exit, service_names
from kvferry.settings import load_settings
from kvferry.v1 import generate_pb2, generate_pb2_grpc, worker_pb2

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


class Router(generate_pb2_grpc.GenerationServicer):
    """The request path over its collaborators (each built here with what it needs): `admission` (the
    in-flight table; checks, tokenizing, block keys, pool lookup), `slo` (the SLO predictor), `dispatch`
    (the prefill), `relay` (the decode stream), `sequences` (n > 1), `resumes` (streams of a router that
    went away) and `releases` (what an ended request leaves behind; aborts). The gRPC methods delegate."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model, load_settings().models_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        names = cfg.served_model_name or (cfg.model,)
        self.served_model_name = public_model_name(names[0])
        self.model_names = {*names, self.served_model_name, cfg.model, str(self.model_dir)}
        self.credentials = Credentials(cluster_secret(), cfg.api_keys)
        self.meta = MetadataStore(cfg.redis_url, cfg.namespace)
        self.directory = Directory(self.meta, cfg.refresh_s, colocated=cfg.colocated)
        self.metrics = RouterMetrics(self.served_model_name, self.directory)
        self.routing = PrefillRouting(RoutingConfig(mode=cfg.routing), self.directory)
        self.links = DecodeLinks()  # one relay link per decode worker (router.decode_link)
        failover = Failover(self.directory, self.metrics)
        self.slo = SloPredictor(cfg, self.directory, self.routing, self.metrics)
        defaults = generation_defaults(self.model_dir, cfg.generation_config)
        self.admission = Admission(
            cfg, self.directory, self.metrics, self.meta, self.tokenizer, defaults, self.slo
        )
        self.dispatch = PrefillDispatch(self.routing, self.metrics, self.slo, failover)
        self.relay = DecodeRelay(self.directory, self.links, failover, cfg.detach_grace_s)
        self.sequences = Sequences(self.admission, self.dispatch, self.metrics)
        self.resumes = Resumes(self.admission, self.directory, self.metrics, self.tokenizer, self.relay)
        self.releases = Releases(self.directory, self.admission)
        self.statuses = StatusLookup(self.directory, self.admission)
        self.draining = False  # stopping: health says so, the streams in flight finish

    # -- the request path, whichever API it came by ---------------------------------------------------
    async def generate(
        self,
        request: generate_pb2.GenerateRequest,
        timeout: float | None = None,
        api: str = "grpc",
        owner: str = "",
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Serve one request: `open_stream`, then its messages. `owner`: who sent it
        (kvferry.auth.owner_of)."""
        stream = await self.open_stream(request, timeout, api, owner)
        async with contextlib.aclosing(stream):
            async for message in stream:
                yield message

    async def open_stream(
        self,
        request: generate_pb2.GenerateRequest,
        timeout: float | None = None,
        api: str = "grpc",
        owner: str = "",
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Admit a request (`admit`; a resume: `admit_resume`) and return its stream (`run`,
        `run_resumed`), not started yet: iterate it to the end, or close it to release the request."""
        if request.HasField("resume"):
            handle = await self.admit_resume(request, timeout, api, owner)
            return self.run_resumed(handle, request.resume.tokens)
        handle = await self.admit(request, timeout, api, owner=owner)
        return self.run(handle)

    async def admit(
        self,
        request: generate_pb2.GenerateRequest,
        timeout: float | None,
        api: str,
        fill_max_tokens: bool = False,
        owner: str = "",
    ) -> Inflight:
        """`Admission.admit`: the request is in flight from now on; `run` it, or `withdraw` it."""
        return await self.admission.admit(request, timeout, api, fill_max_tokens, owner)

    async def admit_resume(
        self, request: generate_pb2.GenerateRequest, timeout: float | None, api: str, owner: str
    ) -> Inflight:
        """`Resumes.admit`: the resume of a stream whose router went away; `run_resumed` it."""
        return await self.resumes.admit(request, timeout, api, owner)

    def withdraw(self, handle: Inflight) -> None:
        """Forget an admitted request that was never run."""
        self.admission.withdraw(handle)

    def run(self, handle: Inflight) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The stream of an admitted request, the last message with `finished` (of each sequence, for
        n > 1: `router.sequences`). Raises RequestRejected when a worker fails it (its code says why).
        Closing the stream early (the client went away) releases everything the request holds in the
        workers and the pool."""
        if handle.params.n > 1:
            return self.sequences.run(handle, self._run_sequence)
        return self._run_sequence(handle)

    def run_resumed(self, handle: Inflight, have: int) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """`run` for a resumed request (`admit_resume`): the client has `have` tokens of it."""
        return self._run_one(handle, self.resumes.stream(handle, have))

    def _run_sequence(self, handle: Inflight) -> AsyncIterator[generate_pb2.GenerateResponse]:
        return self._run_one(handle, self._sequence(handle))

    async def _run_one(
        self, handle: Inflight, source: AsyncIterator[generate_pb2.GenerateResponse]
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """One sequence's stream: `source`'s messages (each timed), and the release of what it holds."""
        code = grpc.StatusCode.CANCELLED
        completed = False
        seen = handle.track.message
        try:
            async for message in source:
                seen(message)
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
                await self.releases.end(handle, everything)
            else:
                self.admission.forget(handle.request_id)

    async def _sequence(self, handle: Inflight) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """One sequence: its prompt's keys and pool lookup (unless admission made them), its prefill, its
        first token, then its decode relayed (colocated: one worker's stream does both)."""
        model = self.directory.model
        req = Request(handle.request_id, handle.ids, handle.params)
        state = OutputState(req, self.tokenizer, tuple(model.eos_token_ids), model.max_model_len)
        if handle.prompt_keys is None:  # (made at admission, except colocated and a request's siblings)
            await self.admission.look_up(handle, handle.cache_salt)
        cached = len(handle.pooled) * model.block_size
        relay = Relay(req, state, {}, (cached, cached), handle.t0, handle.client_id)
        if handle.aborted:
            yield relay.final("abort")
            return
        if self.cfg.colocated:
            if handle.index:  # a sibling: once the leader's prompt is in its worker's prefix cache
                await handle.shared.started.wait()
            relay.cached = (0, 0)  # (the worker's first message says its own)
            async for message in self.relay.colocated(handle, relay):
                yield message
            return
        t_prefill = time.perf_counter()
        prefill = await self.sequences.prefill(handle)
        if prefill is None:
            yield relay.final("abort")
            return
        relay.timings = self._first_token_timings(handle, prefill, t_prefill)
        relay.cached = cached_of(prefill)
        req.prompt_logprobs = [logprob_from_proto(x) for x in prefill.prompt_logprobs]
        first = logprob_from_proto(prefill.first_logprob) if prefill.HasField("first_logprob") else None
        status = state.add_token(prefill.first_token_id, first)
        if status is not None:
            req.status = status
            handle.release_pool = True  # no decode will pull the private tail: release it
            yield relay.final()
            return
        yield response(handle.client_id, state.emit())
        if handle.aborted:  # Abort() came while the first token was on its way
            yield relay.final("abort")
            return
        decode_req = self.relay.decode_request(handle, prefill, relay.cached)
        async for message in self.relay.relay(handle, decode_req, relay):
            yield message

    def _first_token_timings(
        self, handle: Inflight, prefill: worker_pb2.PrefillResponse, t_prefill: float
    ) -> dict[str, float]:
        """The timings up to the first token (and the predictions made for it, which learn from it)."""
        ttft = time.perf_counter() - handle.t0
        timings = {
            "queue_ms": (t_prefill - handle.t0) * 1e3 + prefill.queue_ms,
            "prefill_ms": prefill.prefill_ms,
            "kv_transfer_ms": prefill.kv_put_ms,
            "ttft_ms": ttft * 1e3,
        }
        prediction = handle.prediction
        if prediction is not None and prediction.ttft_ms is not None:
            timings["predicted_ttft_ms"] = prediction.ttft_ms
            self.slo.first_token(handle, ttft * 1e3)
        if prediction is not None and prediction.tpot_ms is not None:
            timings["predicted_tpot_ms"] = prediction.tpot_ms
        return timings

    # -- the gRPC servicer ----------------------------------------------------------------------------
    async def Generate(self, request, context):
        """The gRPC face of `generate` (one async generator less per message): typed errors become
        status codes."""
        owner = owner_of(context.invocation_metadata())
        try:
            stream = await self.open_stream(request, context.time_remaining(), owner=owner)
            async with contextlib.aclosing(stream):
                async for message in stream:
                    yield message
        except InvalidRequestError as err:
            self.metrics.request_error("grpc", grpc.StatusCode.INVALID_ARGUMENT.name)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except RequestRejected as err:
            self.metrics.request_error("grpc", err.code.name)
            trailer = (
                ()
                if err.retry_after_s is None
                else (("retry-after-ms", str(round(err.retry_after_s * 1e3))),)
            )
            await context.abort(err.code, str(err), trailing_metadata=trailer)
        except Exception:  # (not CancelledError, a BaseException: a client that went away is no error)
            self.metrics.request_error("grpc", grpc.StatusCode.UNKNOWN.name)
            raise

    async def Abort(self, request, context):
        await _none_longer(context, request.request_id, self.metrics)
        owner = owner_of(context.invocation_metadata())
        rid = scoped_id(owner, request.request_id)  # (as Generate named it: another key's is another)
        handle = self.admission.get(rid)
        if handle is not None and not may_act_for(owner, handle.owner):
            handle = None  # another key's request: as if it were not here (nothing to learn from it)
        elif handle is None and await self.releases.abort_elsewhere(rid, owner):
            return generate_pb2.AbortResponse()  # admitted by another router of the fleet
        if handle is None:
            await _not_in_flight(context, request.request_id, self.metrics)
        for one in (handle, *handle.siblings):  # every sequence of the request
            await self.releases.abort(one)
        return generate_pb2.AbortResponse()

    async def GetRequestStatus(self, request, context):
        await _none_longer(context, request.request_id, self.metrics)
        owner = owner_of(context.invocation_metadata())
        status = await self.statuses.status(scoped_id(owner, request.request_id), owner)
        if status is None:
            await _not_in_flight(context, request.request_id, self.metrics)
        status.request_id = request.request_id  # (the id the caller knows, not the cluster's)
        return status

    async def GetModelInfo(self, request, context):
        model = self.directory.model
        if model is None:
            self.metrics.request_error("grpc", grpc.StatusCode.UNAVAILABLE.name)
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


async def _not_in_flight(context, request_id: str, metrics: RouterMetrics) -> None:
    metrics.request_error("grpc", grpc.StatusCode.NOT_FOUND.name)
    await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id {request_id!r} is not in flight")


async def _none_longer(context, request_id: str, metrics: RouterMetrics) -> None:
    """An id over the limit Generate takes is in flight nowhere: NOT_FOUND at once, before Abort or
    GetRequestStatus passes it on to every worker (a decode worker remembers an early abort's id)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        metrics.request_error("grpc", grpc.StatusCode.NOT_FOUND.name)
        await context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"request_id: no request in flight has one over {MAX_REQUEST_ID_CHARS} characters",
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


# What one client connection may hold of the router, beyond a message's size (--max-request-bytes):
# metadata (headers) of at most 16 KiB a call; at most 256 calls open at once; and a connection with
# no call open for 5 minutes is closed (GOAWAY), so idle connections do not pile up.
CLIENT_BOUNDS = [
    ("grpc.max_metadata_size", 16 * 1024),  # (gRPC's soft limit: past it, some calls are refused...)
    ("grpc.absolute_max_metadata_size", 16 * 1024),  # (...and past this one, every call)
    ("grpc.max_concurrent_streams", 256),
    ("grpc.max_connection_idle_ms", 5 * 60 * 1000),
]


async def serve(cfg: RouterConfig, stop: asyncio.Event, on_started: Callable[[], None] | None = None) -> None:
    router = Router(cfg)
    options = [  # a request is small (limits.py); only the receive side is bounded tighter
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", cfg.max_request_bytes),
        *SERVER_KEEPALIVE,  # clients' keepalive pings
        *CLIENT_BOUNDS,
    ]
    # API keys gate the public API (the cluster secret opens it too); without keys it is open, as HTTP is
    refused = lambda method: router.metrics.request_error("grpc", "UNAUTHENTICATED")  # noqa: E731
    gate = server_interceptors(router.credentials, aio=True, on_refuse=refused) if cfg.api_keys else []
    server = grpc.aio.server(options=options, interceptors=gate)
    generate_pb2_grpc.add_GenerationServicer_to_server(router, server)
    names = service_names(generate_pb2.DESCRIPTOR)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = _bind(server, cfg)
    await server.start()
    await router.directory.start()
    if router.routing.reader is not None:  # the workers' caches as their KV events say, before routing
        await asyncio.to_thread(router.routing.reader.ready.wait, 5)
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
            | {"addr": f"{cfg.host}:{port}", "inflight": router.admission.count(), "pid": os.getpid()}
        ),
        interval_s=1.0,
        ttl_s=5.0,
    )
    http = None
    if cfg.http_port is not None:
        http = await start_http(router, cfg.host, cfg.http_port, cfg.ssl_certfile, cfg.ssl_keyfile)
    traffic.start()  # registered once both ports serve (kvferry scale --routers waits for it)
    if on_started is not None:
        on_started()
    await stop.wait()
    router.draining = True
    await asyncio.to_thread(traffic.stop)
    tracker.cancel()
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    # the drain: neither port takes new connections (the host's other routers do), the streams in
    # flight get cfg.drain_s to finish; the ones still going then are cut, and left to their decode
    # workers (held for a resume through another router), not aborted
    stopping = asyncio.gather(*([http.stop()] if http is not None else []), server.stop(grace=cfg.drain_s))
    try:
        await asyncio.wait_for(asyncio.shield(stopping), max(0.0, cfg.drain_s - 0.25))
    except TimeoutError:
        router.links.stopping = router.releases.stopping = True
        await stopping
    router.links.close()
    await router.directory.stop()
    router.routing.close()


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
    try:  # the keys file's keys join the others: every part of the router sees one list
        cfg = replace(cfg, api_keys=cfg.key_specs(), api_keys_file=None)
    except ValueError as err:
        p.error(str(err))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop, on_started=settle_heap)

    with asyncio.Runner(loop_factory=loop_factory(cfg.event_loop)) as runner:
        runner.run(run())
    hard_exit(0)
