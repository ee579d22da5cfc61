"""The pieces of the decode side of a router fleet that need no cluster: an early abort passed on by
another router is its owner's only; a Relay link's messages of one engine step go out as one batch;
the router's stream on a link ends, fails and expires as its own call would have."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from kvferry.decode_worker.handoff import EarlyAborts, LinkOut, LinkSink
from kvferry.router.decode_link import LinkStream, call_error
from kvferry.v1 import worker_pb2


def test_an_early_abort_for_an_owner_aborts_only_that_owners_request():
    aborts = EarlyAborts()
    aborts.add("r1", now=0.0, owner="alice")
    assert not aborts.take("r1", now=1.0, owner="bob")  # another key's request of the same id runs
    aborts.add("r1", now=2.0, owner="alice")
    assert aborts.take("r1", now=3.0, owner="alice")
    aborts.add("r2", now=0.0)  # the router's own abort (no owner): whoever's request it is
    assert aborts.take("r2", now=1.0, owner="anyone")


def test_an_early_abort_expires_with_its_owner():
    aborts = EarlyAborts(ttl_s=5.0)
    aborts.add("r1", now=0.0, owner="alice")
    aborts.add("r2", now=10.0)  # expires r1's entry
    assert "r1" not in aborts.owners
    assert not aborts.take("r1", now=10.0, owner="alice")


def test_a_links_messages_put_without_waking_go_out_as_one_batch():
    async def main():
        link = LinkOut()
        sinks = [LinkSink(link, f"r{i}") for i in range(4)]

        def engine_step():  # the engine thread: one step's messages, then one wake-up
            for sink in sinks:
                link.put(sink.request_id, worker_pb2.DecodeResponse(token_ids=[7]), wake=False)
            link.wake()

        thread = threading.Thread(target=engine_step)
        thread.start()
        batch = await asyncio.wait_for(link.take(), 5)
        thread.join()
        assert [rid for rid, _ in batch] == ["r0", "r1", "r2", "r3"]
        sinks[0].put(worker_pb2.DecodeResponse(token_ids=[8]))  # wakes at once
        assert [rid for rid, _ in await asyncio.wait_for(link.take(), 5)] == ["r0"]

    asyncio.run(main())


class _Link:
    """What a LinkStream needs of its link."""

    def __init__(self):
        self.streams: dict = {}
        self.broken = False
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.links = None


def _item(tokens, finish="", error_code=0, error=""):
    return worker_pb2.RelayItem(
        request_id="r",
        response=worker_pb2.DecodeResponse(token_ids=tokens, finish_reason=finish),
        error_code=error_code,
        error=error,
    )


def test_a_link_stream_reads_like_its_call():
    async def main():
        link, queue = _Link(), asyncio.Queue()
        link.streams["r"] = queue
        stream = LinkStream(link, "r", queue, deadline=1e12)
        for item in (_item([1]), _item([2, 3]), _item([4], "length")):
            queue.put_nowait(item)
        got = [list(m.token_ids) async for m in stream]
        assert got == [[1], [2, 3], [4]]
        assert "r" not in link.streams  # the stream's end leaves nothing on the link
        stream.cancel()  # after its end: nothing is sent
        assert link.outgoing.empty()

    asyncio.run(main())


def test_a_link_stream_raises_its_error_and_a_cancel_reaches_the_worker():
    async def main():
        link, queue = _Link(), asyncio.Queue()
        link.streams["r"] = queue
        stream = LinkStream(link, "r", queue, deadline=1e12)
        queue.put_nowait(_item([], error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], error="bad"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.__anext__()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == "bad"

        queue2 = link.streams["s"] = asyncio.Queue()
        other = LinkStream(link, "s", queue2, deadline=1e12)
        other.cancel()
        assert (await link.outgoing.get()).cancel == "s"
        queue3 = link.streams["t"] = asyncio.Queue()
        broken = LinkStream(link, "t", queue3, deadline=1e12)
        queue3.put_nowait(call_error(grpc.StatusCode.UNAVAILABLE, "link broke"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await broken.__anext__()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_a_link_stream_past_its_deadline_fails_and_is_cancelled():
    async def main():
        link, queue = _Link(), asyncio.Queue()
        link.streams["r"] = queue
        loop = asyncio.get_running_loop()
        stream = LinkStream(link, "r", queue, deadline=time.monotonic() + 0.05)
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.__anext__()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - started < 2
        assert (await link.outgoing.get()).cancel == "r"  # the worker is told to stop

    asyncio.run(main())
