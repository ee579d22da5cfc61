"""The router's release of what a request leaves behind runs to its end even when the client goes away
while it runs: a cancel of the stream right after its last message (the fuzz scenario's client) used
to cut the pool Release short and leave the private tail block to the pool's TTL."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from kvferry.router.admission import Admission
from kvferry.router.config import RouterConfig
from kvferry.router.inflight import Inflight
from kvferry.router.release import Releases
from kvferry.router.server import Router
from kvferry.v1 import generate_pb2

FINISHED = generate_pb2.Finished(finish_reason="length")


class _Track:
    def __init__(self):
        self.codes: list[str] = []

    def message(self, message) -> None:
        pass

    def done(self, code: str) -> None:
        self.codes.append(code)


class _Releases(Releases):
    """The pool's release, held until the test lets it end."""

    def __init__(self, admission: Admission, started: asyncio.Event, may_end: asyncio.Event, released: list):
        super().__init__(directory=None, admission=admission)
        self.started, self.may_end, self.released = started, may_end, released

    async def release_pool(self, request_id: str) -> None:
        self.started.set()
        await self.may_end.wait()
        self.released.append(request_id)


def _router(release_started: asyncio.Event, release_may_end: asyncio.Event, released: list[str]) -> Router:
    router = Router.__new__(Router)  # only what run() touches: no model, Redis or workers
    router.admission = Admission(RouterConfig(), None, None, None, None, {}, None)
    router.releases = _Releases(router.admission, release_started, release_may_end, released)

    async def sequence(handle):
        handle.release_pool = True  # finished on the first token: the private tail is unread
        yield generate_pb2.GenerateResponse(request_id=handle.request_id, finished=FINISHED)

    router._sequence = sequence
    return router


@pytest.mark.parametrize("cancel_twice", [False, True])
def test_a_client_gone_during_the_release_does_not_cut_it_short(cancel_twice):
    async def scenario() -> tuple[list[str], dict]:
        started, may_end, released = asyncio.Event(), asyncio.Event(), []
        router = _router(started, may_end, released)
        handle = Inflight("r1", time.monotonic() + 10, time.perf_counter())
        router.admission.add(handle)
        handle.track = _Track()

        async def client() -> None:  # how Generate consumes run(): the stream closed when it ends
            async with contextlib.aclosing(router.run(handle)) as stream:
                async for _ in stream:
                    pass

        task = asyncio.ensure_future(client())
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()  # the client went away while the router released its tail
        if cancel_twice:
            await asyncio.sleep(0)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert router.admission.holds("r1")  # the id stays taken until the release ended
        may_end.set()
        await asyncio.wait_for(asyncio.gather(*router.releases.ending), 5)
        return released, router.admission.inflight

    released, inflight = asyncio.run(scenario())
    assert released == ["r1"] and inflight == {}


def test_a_request_with_nothing_to_release_frees_its_id_at_once():
    async def scenario() -> dict:
        router = _router(asyncio.Event(), asyncio.Event(), [])

        async def sequence(handle):
            yield generate_pb2.GenerateResponse(
                request_id=handle.request_id, finished=generate_pb2.Finished()
            )

        router._sequence = sequence
        handle = Inflight("r2", time.monotonic() + 10, time.perf_counter())
        router.admission.add(handle)
        handle.track = _Track()
        async for _ in router.run(handle):
            pass
        assert not router.releases.ending
        return router.admission.inflight

    assert asyncio.run(scenario()) == {}
