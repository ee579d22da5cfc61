"""gRPC plumbing shared by every kvferry server: health, reflection, registry heartbeats, errors.

Two kinds of server: `start_server`, a threaded one (the pool node: every call is short), and
`AioServer`, a grpc.aio server on its own event-loop thread (the workers: a streaming call holds no
thread, so the calls a worker can hold open are bounded by its own limit, not by a thread pool).

Transport: when the process has TLS material (kvferry.auth.tls_material), every server here binds
mutual TLS (a client must show a certificate of the cluster CA) and every channel here speaks TLS with
this process's leaf, checking the server against kvferry.auth.CLUSTER_NAME; without it, both are
plaintext. Either way every call carries the cluster secret.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvferry.auth import CLUSTER_NAME, TlsMaterial, client_interceptors, server_interceptors, tls_material

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20
KEEPALIVE_MS = 3000  # a ping this often, and a peer that does not answer one in as long is dead
_MESSAGE_SIZES = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Keepalive on every channel: a host that is lost (power, link) sends no RST, so without pings a call
# to it waits for its deadline; with them it fails UNAVAILABLE within 2 * KEEPALIVE_MS (and the caller
# fails over), during a call and between calls alike.
CHANNEL_OPTIONS = [
    *_MESSAGE_SIZES,
    # a peer that went away (a router or worker restarting, a fleet member gone) is tried again soon:
    # gRPC's default backoff reaches 10 s and more after a few failures, longer than a stream's resume
    # grace (RouterConfig.detach_grace_s)
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # gRPC reads this one as the time a single connection attempt may take (connect, TLS handshake,
    # HTTP/2 settings), not as a backoff: at 250 ms a mutual-TLS handshake on busy cores was cut short
    # ("tcp handshaker shutdown") and the first call to a pool node failed
    ("grpc.min_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# ... and servers that accept those pings (by default gRPC answers pings more often than every 5 min
# without data with GOAWAY "too_many_pings")
SERVER_KEEPALIVE = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
SERVER_OPTIONS = [*_MESSAGE_SIZES, *SERVER_KEEPALIVE]


def channel(target: str) -> grpc.Channel:
    """A channel to another kvferry process: every call carries the cluster secret (kvferry.auth), over
    mutual TLS when this process has TLS material."""
    tls = tls_material()
    if tls is None:
        ch = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    else:
        ch = grpc.secure_channel(target, _channel_credentials(tls), options=_tls_options())
    interceptors = client_interceptors()
    return grpc.intercept_channel(ch, *interceptors) if interceptors else ch


def aio_channel(target: str) -> grpc.aio.Channel:
    """`channel` for asyncio code."""
    interceptors = client_interceptors(aio=True)
    tls = tls_material()
    if tls is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)
    creds = _channel_credentials(tls)
    return grpc.aio.secure_channel(target, creds, options=_tls_options(), interceptors=interceptors)


def _channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )


def _tls_options() -> list[tuple[str, object]]:
    """Servers are checked against the cluster's name, not their address (any IP a node has)."""
    return [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", CLUSTER_NAME)]


def bind(server: grpc.Server | grpc.aio.Server, host: str, port: int) -> int:
    """Add host:port (0 = any free port) to `server`: mutual TLS when this process has TLS material
    (clients must show a certificate of the cluster CA), else plaintext. Returns the bound port."""
    tls = tls_material()
    addr = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(addr)
    else:
        creds = grpc.ssl_server_credentials(
            [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True
        )
        bound = server.add_secure_port(addr, creds)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {addr}")
    return bound


def service_names(*descriptors) -> list[str]:
    """Full service names of generated `DESCRIPTOR`s (for reflection)."""
    return [svc.full_name for d in descriptors for svc in d.services_by_name.values()]


def add_health_and_reflection(server, names: Sequence[str]) -> health.HealthServicer:
    """Register grpc.health.v1.Health and server reflection; every service starts NOT_SERVING."""
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, names: Sequence[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *names):
        health_servicer.set(name, status)


def start_server(
    add_servicers: Callable[[grpc.Server], None], names: Sequence[str], host: str, port: int, max_workers: int
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A threaded gRPC server on host:port (0 = any free port; TLS: see `bind`); returns it, the bound
    port, its health."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=SERVER_OPTIONS,
        interceptors=server_interceptors(),  # the cluster secret, when there is one (kvferry.auth)
    )
    add_servicers(server)
    health_servicer = add_health_and_reflection(server, names)
    bound = bind(server, host, port)
    server.start()
    return server, bound, health_servicer


class AioServer:
    """A grpc.aio server on host:port (0 = any free port) served by its own event-loop thread, with
    health (every service starts NOT_SERVING) and reflection. For a process whose main thread does
    other work: every method here is called from outside the loop and waits for it.

    Async handlers run on the loop; sync ones on `handler_threads` threads (grpc's
    migration_thread_pool), so a short unary call never queues behind the streams.
    """

    def __init__(
        self,
        add_servicers: Callable[[grpc.aio.Server], None],
        names: Sequence[str],
        host: str,
        port: int,
        handler_threads: int = 8,
    ):
        self.names = list(names)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self.thread.start()
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server = self.run(self._start(add_servicers, host, port, handler_threads))

    def run(self, coro, timeout_s: float | None = 30.0):
        """Run `coro` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self, add_servicers, host: str, port: int, handler_threads: int) -> grpc.aio.Server:
        server = grpc.aio.server(
            futures.ThreadPoolExecutor(handler_threads, thread_name_prefix="grpc-handler"),
            options=SERVER_OPTIONS,
            interceptors=server_interceptors(aio=True),  # the cluster secret (kvferry.auth)
        )
        add_servicers(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        await self._set(False)
        names = (*self.names, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        self.port = bind(server, host, port)
        await server.start()
        return server

    async def _set(self, serving: bool) -> None:
        codes = health_pb2.HealthCheckResponse
        status = codes.SERVING if serving else codes.NOT_SERVING
        for name in ("", *self.names):
            await self.health.set(name, status)

    def set_serving(self, serving: bool = True) -> None:
        self.run(self._set(serving))

    def stop(self, grace_s: float) -> None:
        """Stop taking calls, give the open ones `grace_s` to end (then cancel them), stop the loop."""
        try:
            self.run(self.server.stop(grace_s), grace_s + 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def check_health(target: str, timeout: float = 1.0) -> bool:
    try:
        with channel(target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Heartbeat(threading.Thread):
    """Re-registers `info()` under (role, member_id) every `interval_s` with a TTL of `ttl_s`.

    Re-sending the whole record (not just refreshing the TTL) is what lets a restarted Redis learn the
    cluster again within one interval. Liveness is progress, not a live thread: while `stalled()` says
    why the member is stuck (a string; None when it makes progress) it is not re-registered, so its
    record expires and the router stops sending it requests; it registers again once progress resumes.
    """

    def __init__(
        self,
        store,
        role: str,
        member_id: str,
        info: Callable[[], dict],
        interval_s: float,
        ttl_s: float,
        stalled: Callable[[], str | None] | None = None,
    ):
        super().__init__(name=f"heartbeat-{role}", daemon=True)
        self.store, self.role, self.member_id, self.info = store, role, member_id, info
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.stalled = stalled
        self.withheld = False  # the last beat skipped the registration (stalled)
        self.stopped = threading.Event()
        self.extra: list[Callable[[], None]] = []  # other periodic chores run on the same thread

    def beat(self) -> None:
        problem = self.stalled() if self.stalled is not None else None
        if problem is not None:
            if not self.withheld:
                log.error("%s %s stalled (%s): not re-registering", self.role, self.member_id, problem)
            self.withheld = True
        else:
            if self.withheld:
                log.warning("%s %s makes progress again: registering", self.role, self.member_id)
            self.withheld = False
            self.store.register(self.role, self.member_id, self.info(), self.ttl_s)
        for chore in self.extra:
            try:
                chore()
            except Exception:  # a chore must never stop the heartbeat
                log.exception("periodic chore failed")

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        self.stopped.set()
        self.store.unregister(self.role, self.member_id)


def hard_exit(code: int) -> None:
    """End a server process after its orderly shutdown, without joining threads that may still sit in a
    transfer to a peer that went away (gloo would hold them until its timeout)."""
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
