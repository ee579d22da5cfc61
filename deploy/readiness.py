"""Is the cluster up: a launcher polls the router until it serves and reports every member it started.

The probe carries the cluster secret (an API-key router accepts it too) and speaks TLS when the router
serves TLS; the health check it starts with is open on every kvferry server.
"""

from __future__ import annotations

import time

import grpc

from kvferry.auth import SECRET_HEADER, client_interceptors
from kvferry.deploy.redis_server import LaunchError
from kvferry.rpc import CHANNEL_OPTIONS


def reachable(host: str) -> str:
    """The address this host reaches a server bound to `host` at (a wildcard bind: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def router_channel(
    target: str, secret: str | None = None, root_certificates: bytes | None = None
) -> grpc.Channel:
    """A launcher's channel to the router: carries the cluster secret (`secret`, default this
    process's), over TLS with `root_certificates` when the router serves TLS."""
    if root_certificates is None:
        ch = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        ch = grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)
    interceptors = client_interceptors(((SECRET_HEADER, secret),) if secret else None)
    return grpc.intercept_channel(ch, *interceptors) if interceptors else ch


def wait_until_ready(
    router_addr: str,
    want,
    deadline: float,
    check=None,
    say=None,
    secret: str | None = None,
    root_certificates: bytes | None = None,
) -> None:
    """Poll the router until it serves and reports `want` = (prefill, decode, pool) members (a
    callable: re-read each time); `check()` between tries raises when a component died. `secret` and
    `root_certificates`: see router_channel (an API-key router accepts the cluster secret too)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvferry.v1 import generate_pb2, generate_pb2_grpc

    last = None
    with router_channel(router_addr, secret, root_certificates) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        stub = generate_pb2_grpc.GenerationStub(ch)
        while True:
            if check is not None:
                check()
            target = want() if callable(want) else want
            try:
                serving = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                serving = None
            if serving == health_pb2.HealthCheckResponse.SERVING:
                try:
                    info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=2)
                    have = (info.num_prefill_workers, info.num_decode_workers, info.num_pool_nodes)
                except grpc.RpcError:
                    have = None
                if have == target:
                    return
                if have != last and say is not None:
                    last = have
                    say(f"waiting: prefill/decode/pool {have} of {target}")
            if time.monotonic() > deadline:
                raise LaunchError(f"the cluster was not ready in time (router reports {last}, want {target})")
            time.sleep(0.2)
