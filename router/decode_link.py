"""The router's one link to each decode worker: every stream it relays from that worker rides one
long-lived `DecodeWorker.Relay` call, which brings one message per engine step with the new tokens of all
of them (gRPC's cost is per message: one per token per request was half the router's CPU).

`DecodeLinks.open` starts a stream (a `RelayRequest.start` on the worker's link, made on first use) and
returns a `LinkStream`, which reads like the call it replaces: iterate it for the stream's
`DecodeResponse`s, `cancel()` it to stop (the worker aborts the request). When the link breaks (the worker
died, its connection dropped) every stream on it fails as its own call would have (UNAVAILABLE), and the
next stream opens a new link. A stream's deadline is kept here (the link has none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from kvferry.router.directory import Member
from kvferry.v1 import worker_pb2

log = logging.getLogger(__name__)


def call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a stream's own call would have raised."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeLink:
    """One Relay call to one decode worker and the streams on it."""

    def __init__(self, member: Member, links: DecodeLinks | None = None):
        self.member = member
        self.links = links
        self.streams: dict[str, asyncio.Queue] = {}
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.broken = False
        self.call = member.stub.Relay(self._requests())
        self.reader = asyncio.create_task(self._read())

    async def _requests(self):
        while True:
            yield await self.outgoing.get()

    async def _read(self) -> None:
        err = call_error(grpc.StatusCode.UNAVAILABLE, "the decode worker ended its relay link")
        try:
            async for batch in self.call:
                for item in batch.items:
                    queue = self.streams.get(item.request_id)
                    if queue is not None:
                        queue.put_nowait(item)
        except grpc.aio.AioRpcError as e:
            err = e
        except asyncio.CancelledError:
            err = call_error(grpc.StatusCode.CANCELLED, "the router closed its relay link")
            raise
        finally:
            self.broken = True
            for queue in self.streams.values():
                queue.put_nowait(err)
            self.streams.clear()

    def open(self, request: worker_pb2.DecodeRequest, timeout: float) -> LinkStream:
        rid = request.request_id
        if rid in self.streams:  # (the router holds one stream of an id at a time)
            raise call_error(grpc.StatusCode.ALREADY_EXISTS, f"{rid} is already on this link")
        queue = self.streams[rid] = asyncio.Queue()
        self.outgoing.put_nowait(worker_pb2.RelayRequest(start=request))
        return LinkStream(self, rid, queue, time.monotonic() + timeout)

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


class LinkStream:
    """One stream on a link: an async iterator of its DecodeResponses, as a Decode call is."""

    def __init__(self, link: DecodeLink, request_id: str, queue: asyncio.Queue, deadline: float):
        self.link, self.request_id, self.queue = link, request_id, queue
        self.done = False
        # the deadline: one timer for the stream (not a wait_for per message: that is CPU per token)
        loop = asyncio.get_running_loop()
        self.timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self.queue.put_nowait(call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def __aiter__(self):
        return self

    async def __anext__(self) -> worker_pb2.DecodeResponse:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, grpc.aio.AioRpcError):  # the link broke, or the deadline passed
            if item.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.cancel()
            self.done = True
            self.timer.cancel()
            raise item
        if item.error_code:
            self._end()
            raise call_error(_CODES.get(item.error_code, grpc.StatusCode.INTERNAL), item.error)
        if item.response.finish_reason:
            self._end()
        return item.response

    def _end(self) -> None:
        self.done = True
        self.timer.cancel()
        if self.link.streams.get(self.request_id) is self.queue:
            del self.link.streams[self.request_id]

    def cancel(self) -> None:
        """Stop reading it: the worker aborts the request (a no-op once it ended). While the router
        stops, nothing is said: the link's close leaves the stream to the worker (held for a resume)."""
        if self.done:
            return
        self._end()
        stopping = getattr(self.link.links, "stopping", False)
        if not self.link.broken and not stopping:
            self.link.outgoing.put_nowait(worker_pb2.RelayRequest(cancel=self.request_id))


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class DecodeLinks:
    """The router's links, one per decode worker (a new one after a link broke, or the worker came back
    at another address)."""

    def __init__(self):
        self.links: dict[tuple[str, str], DecodeLink] = {}
        self.stopping = False  # the router's drain is over (LinkStream.cancel)

    def open(self, member: Member, request: worker_pb2.DecodeRequest, timeout: float) -> LinkStream:
        key = (member.member_id, member.addr)
        link = self.links.get(key)
        # a new link after a break, or for a new record of the worker (the registry dropped and re-added
        # it: the old record's channel closes once its calls end); the old link's streams go on there
        if link is None or link.broken or link.member is not member:
            link = self.links[key] = DecodeLink(member, self)
        return link.open(request, timeout)

    def close(self) -> None:
        for link in self.links.values():
            with contextlib.suppress(Exception):
                link.close()
        self.links.clear()
