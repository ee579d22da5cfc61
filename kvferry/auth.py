"""Who may call a kvferry server: the cluster secret (internal plane) and the router's API keys.

Internal plane: every worker, pool node and router RPC carries the cluster secret in the
`x-kvferry-secret` metadata and every server refuses a call without it (UNAUTHENTICATED). `kvferry up`
generates the secret (or takes it from the config) and hands it to every process it starts in the
`KVFERRY_CLUSTER_SECRET` environment variable; a process started without one runs an open cluster (the
unit tests, a single developer's loopback cluster started by hand).

Internal TLS: when `kvferry up` turns it on (deploy.config `internal_tls`), every internal gRPC
connection is mutual TLS (kvferry.rpc). The launcher keeps the cluster CA's key (deploy.cluster_ca) and
hands each process the CA certificate and a leaf certificate and key of its own, as PEM text in
`KVFERRY_TLS_CA`, `KVFERRY_TLS_CERT` and `KVFERRY_TLS_KEY` (`tls_material`); every leaf names
`CLUSTER_NAME`, which clients check servers against whatever their address. A process without them
speaks plaintext; the secret travels in either case (inside TLS when it is on).

Public plane: the router's gRPC API asks for `authorization: Bearer <key>` when it is given API keys
(`--api-key`); the cluster secret is accepted there too (operators' tools).

The gRPC health service needs no secret, so load balancers and launchers can probe any port; it says
SERVING or not and nothing more. With internal TLS a probe of an internal port needs a cluster leaf
like any other call (the handshake comes first).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import grpc

from kvferry.settings import bare_keys

SECRET_ENV = "KVFERRY_CLUSTER_SECRET"
SECRET_HEADER = "x-kvferry-secret"
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV = "KVFERRY_TLS_CA", "KVFERRY_TLS_CERT", "KVFERRY_TLS_KEY"
TLS_ENVS = (TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV)
CLUSTER_NAME = "kvferry-cluster"  # the DNS name in every leaf; what clients verify a server against


class TlsSettingsError(ValueError):
    """The process has part of its TLS material: some of KVFERRY_TLS_CA / _CERT / _KEY but not all."""


@dataclass(frozen=True)
class TlsMaterial:
    """What one process holds for mutual TLS on the internal plane, as PEM bytes."""

    ca: bytes  # the cluster CA's certificate: the only root a peer's certificate may chain to
    cert: bytes  # this process's leaf certificate
    key: bytes = field(repr=False)  # ... and its private key

    def env(self) -> dict[str, str]:
        """The environment that hands this material to a child process (`tls_material` reads it)."""
        pems = (self.ca, self.cert, self.key)
        return {name: pem.decode() for name, pem in zip(TLS_ENVS, pems, strict=True)}


def tls_material() -> TlsMaterial | None:
    """This process's TLS material (from its environment); None: the internal plane is plaintext.
    Raises TlsSettingsError when only some of the three variables are set (never a silent plaintext)."""
    values = [os.environ.get(name) or "" for name in TLS_ENVS]
    if not any(values):
        return None
    if not all(values):
        missing = [name for name, value in zip(TLS_ENVS, values, strict=True) if not value]
        raise TlsSettingsError(f"internal TLS needs {', '.join(TLS_ENVS)}; missing {', '.join(missing)}")
    ca, cert, key = (value.encode() for value in values)
    return TlsMaterial(ca=ca, cert=cert, key=key)


def cluster_secret() -> str | None:
    """The secret this process uses (from its environment), None in an open cluster."""
    return os.environ.get(SECRET_ENV) or None


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def secret_metadata() -> tuple[tuple[str, str], ...]:
    secret = cluster_secret()
    return ((SECRET_HEADER, secret),) if secret else ()


class Credentials:
    """What a server accepts: the cluster secret in its header and/or a bearer API key."""

    def __init__(self, secret: str | None = None, api_keys: Sequence[str] = ()):
        self.secret = secret
        self.api_keys = bare_keys(api_keys)  # (a `KEY:options` spec: its key)

    @property
    def required(self) -> bool:
        return bool(self.secret or self.api_keys)

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when `metadata` carries an accepted credential, else what is wrong (for the status)."""
        if not self.required:
            return None
        md = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in (metadata or ())}
        if self.secret and hmac.compare_digest(md.get(SECRET_HEADER, "").encode(), self.secret.encode()):
            return None
        if self.api_keys:
            auth = md.get("authorization", "")
            if auth.lower().startswith("bearer ") and self.key_ok(auth[7:].strip()):
                return None
            return "missing or invalid API key (send the metadata 'authorization: Bearer <key>')"
        return f"missing or invalid cluster secret (the '{SECRET_HEADER}' metadata)"

    def key_ok(self, key: str) -> bool:
        ok = False
        for expected in self.api_keys:  # no early exit: the time taken does not tell which key is close
            ok |= hmac.compare_digest(key.encode(), expected.encode())
        return ok


def owner_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """Who made a request, as routers compare it (a resume, an abort): a digest of the bearer API key
    it came with ("" without one). The key itself never leaves the router."""
    for k, v in metadata or ():
        if k.lower() == "authorization":
            auth = v.decode() if isinstance(v, bytes) else v
            if auth.lower().startswith("bearer ") and auth[7:].strip():
                return owner_of_key(auth[7:].strip())
    return ""


def owner_of_key(key: str) -> str:
    """`owner_of` a request made with this API key."""
    return hashlib.sha256(b"kvferry-owner\0" + key.encode()).hexdigest()[:32]


def _id_tag(owner: str) -> str:
    """What a keyed request's id goes under inside the cluster ("" without a key)."""
    return f"k{owner[:12]}/" if owner else ""


def scoped_id(owner: str, request_id: str) -> str:
    """The id a request goes by inside the cluster (the routers' tables, the workers): a keyed client's
    own id under its key's tag, so two keys' ids never meet (none can take, or learn of, another's); a
    request without a key keeps its id. Every router scopes alike: any of them finds it."""
    return _id_tag(owner) + request_id


def unscoped_id(owner: str, request_id: str) -> str:
    """The id the client knows of a `scoped_id` (a sibling's `-i` suffix kept)."""
    return request_id.removeprefix(_id_tag(owner))


def may_act_for(caller: str, owner: str) -> bool:
    """Whether a caller (`owner_of` its metadata) may abort a request `owner` made: its own, or any when
    it came without a key (a cluster without keys, where nobody has one, or the cluster secret's holder:
    with keys, nobody else gets in)."""
    return not caller or hmac.compare_digest(caller.encode(), owner.encode())


def cluster_credentials() -> Credentials:
    return Credentials(cluster_secret())


def _wrap(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind (and serializers) that runs `behavior(request, context)`."""
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AuthInterceptor(grpc.ServerInterceptor):
    """A threaded server's gate: calls without an accepted credential end UNAUTHENTICATED."""

    def __init__(self, creds: Credentials):
        self.creds = creds

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        problem = self.creds.check(details.invocation_metadata)
        if problem is None:
            return handler

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        return _wrap(handler, refuse)


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    """The same gate for an asyncio server; `on_refuse(method)` is told of each call it refuses."""

    def __init__(self, creds: Credentials, on_refuse: Callable[[str], None] | None = None):
        self.creds = creds
        self.on_refuse = on_refuse

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS:
            return handler
        problem = self.creds.check(details.invocation_metadata)
        if problem is None:
            return handler

        async def refuse(request, context):
            if self.on_refuse is not None:
                self.on_refuse(details.method)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        return _wrap(handler, refuse)


def server_interceptors(
    creds: Credentials | None = None, aio: bool = False, on_refuse: Callable[[str], None] | None = None
) -> list:
    creds = creds if creds is not None else cluster_credentials()
    if not creds.required:
        return []
    return [AioAuthInterceptor(creds, on_refuse) if aio else AuthInterceptor(creds)]


# -- client side: every call on a kvferry channel carries the secret ------------------------------------
def _with_metadata(details, extra):
    """`details` (a namedtuple in both grpc and grpc.aio) with `extra` added to its metadata."""
    return details._replace(metadata=[*(details.metadata or ()), *extra])


class SecretClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, metadata: Sequence[tuple[str, str]]):
        self.metadata = tuple(metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_metadata(details, self.metadata), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with_metadata(details, self.metadata), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_with_metadata(details, self.metadata), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_with_metadata(details, self.metadata), request_iterator)


def _aio_interceptors(metadata: Sequence[tuple[str, str]]) -> list:
    md = tuple(metadata)

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(_with_metadata(details, md), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(_with_metadata(details, md), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, request_iterator):
            return await continuation(_with_metadata(details, md), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, request_iterator):
            return await continuation(_with_metadata(details, md), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


def client_interceptors(metadata: Sequence[tuple[str, str]] | None = None, aio: bool = False) -> list:
    """Interceptors that add `metadata` (default: the cluster secret) to every call; [] when none."""
    md = secret_metadata() if metadata is None else tuple(metadata)
    if not md:
        return []
    return _aio_interceptors(md) if aio else [SecretClientInterceptor(md)]
