"""The router's release of what a request leaves behind runs to its end even when the client goes away
while it runs: a cancel of the stream right after its last message (the fuzz scenario's client) used
to cut the pool Release short and leave the private tail block to the pool's TTL."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from kvferry.router.server import Inflight, Router
from kvferry.v1 import generate_pb2

FINISHED = generate_pb2.Finished(finish_reason="length")


class _Track:
    def __init__(self):
        self.codes: list[str] = []

    def message(self, message) -> None:
        pass

    def done(self, code: str) -> None:
        self.codes.append(code)


def _router(release_started: asyncio.Event, release_may_end: asyncio.Event, released: list[str]) -> Router:
    router = Router.__new__(Router)  # only what run() touches: no model, Redis or workers
    router.inflight, router.ending = {}, set()

    async def generate(handle):
        handle.release_pool = True  # finished on the first token: the private tail is unread
        yield generate_pb2.GenerateResponse(request_id=handle.request_id, finished=FINISHED)

    async def release_pool(request_id: str) -> None:
        release_started.set()
        await release_may_end.wait()
        released.append(request_id)

    router._generate = generate
    router._release_pool = release_pool
    return router


@pytest.mark.parametrize("cancel_twice", [False, True])
def test_a_client_gone_during_the_release_does_not_cut_it_short(cancel_twice):
    async def scenario() -> tuple[list[str], dict]:
        started, may_end, released = asyncio.Event(), asyncio.Event(), []
        router = _router(started, may_end, released)
        handle = router.inflight["r1"] = Inflight("r1", time.monotonic() + 10, time.perf_counter())
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
        assert "r1" in router.inflight  # the id stays taken until the release ended
        may_end.set()
        await asyncio.wait_for(asyncio.gather(*router.ending), 5)
        return released, router.inflight

    released, inflight = asyncio.run(scenario())
    assert released == ["r1"] and inflight == {}


def test_a_request_with_nothing_to_release_frees_its_id_at_once():
    async def scenario() -> dict:
        router = _router(asyncio.Event(), asyncio.Event(), [])

        async def generate(handle):
            yield generate_pb2.GenerateResponse(
                request_id=handle.request_id, finished=generate_pb2.Finished()
            )

        router._generate = generate
        handle = router.inflight["r2"] = Inflight("r2", time.monotonic() + 10, time.perf_counter())
        handle.track = _Track()
        async for _ in router.run(handle):
            pass
        assert not router.ending
        return router.inflight

    assert asyncio.run(scenario()) == {}
