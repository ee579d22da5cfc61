"""uvicorn serving the router's OpenAI-compatible API on the router's own asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvferry.router.server import Router

log = logging.getLogger(__name__)


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that the other routers of the host bind too (SO_REUSEPORT:
    the kernel spreads new connections among them), as gRPC's own port is."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


class HttpServer:
    """uvicorn serving the OpenAI API on the running loop (signals stay with the router's loop);
    HTTPS when given a certificate and key."""

    def __init__(
        self, router: Router, host: str, port: int, certfile: str | None = None, keyfile: str | None = None
    ):
        import uvicorn

        from kvferry.router.openai_api import build_app

        class _Server(uvicorn.Server):
            def install_signal_handlers(self) -> None:  # uvicorn < 0.29
                pass

            @contextlib.contextmanager
            def capture_signals(self):  # the router's own handlers stop everything
                yield

            async def main_loop(self) -> None:
                """uvicorn's, waking once a second for the Date header (its own wakes ten times: CPU an
                idle router spends), and at once when `stop` asks."""
                while not await self.on_tick(0):  # (tick 0: the Date header is renewed)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), 1.0)

        stopping = self.stopping = asyncio.Event()

        config = uvicorn.Config(
            build_app(router),
            host=host,
            port=port,
            lifespan="off",
            access_log=False,
            log_level=router.cfg.uvicorn_log_level,
            timeout_graceful_shutdown=max(1, round(router.cfg.drain_s)),
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
        )
        self.scheme = "https" if certfile else "http"
        self.server = _Server(config)
        self.task: asyncio.Task | None = None
        self.socket = shared_socket(host, port)

    async def start(self) -> int:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self.task.done():  # it could not bind (the error is in the task)
                self.task.result()
                raise OSError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.server.should_exit = True
        self.stopping.set()
        if self.task is not None:
            await self.task


async def start_http(
    router: Router, host: str, port: int, certfile: str | None = None, keyfile: str | None = None
) -> HttpServer:
    http = HttpServer(router, host, port, certfile, keyfile)
    bound = await http.start()
    log.info("OpenAI-compatible API on %s://%s:%d/v1 (metrics: /metrics)", http.scheme, host, bound)
    return http
