"""A worker's bounded bookkeeping: early aborts expire and are capped, and open calls are capped."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvferry.decode_worker.handoff import EarlyAborts
from kvferry.worker.service import EngineWorker, default_max_streams


def test_an_early_abort_is_used_up_by_its_decode_call():
    aborts = EarlyAborts(ttl_s=30)
    assert aborts.add("a", now=0.0)
    assert aborts.take("a", now=1.0)
    assert not aborts.take("a", now=2.0)  # used up: the id is served normally again


def test_an_early_abort_expires():
    aborts = EarlyAborts(ttl_s=30)
    aborts.add("a", now=0.0)
    assert not aborts.take("a", now=31.0)
    aborts.add("b", now=0.0)
    aborts.add("c", now=40.0)  # adding one drops the expired ones
    assert len(aborts) == 1


def test_early_aborts_are_capped_oldest_first():
    aborts = EarlyAborts(ttl_s=30, cap=3)
    for i in range(5):
        aborts.add(f"r{i}", now=float(i))
    assert len(aborts) == 3
    assert not aborts.take("r0", now=5.0)
    assert aborts.take("r4", now=5.0)


def test_an_abort_after_the_stream_finished_leaves_nothing():
    aborts = EarlyAborts(ttl_s=30)
    aborts.stream_finished("done", now=0.0)
    assert not aborts.add("done", now=0.5)  # late, not early
    assert not aborts.take("done", now=1.0)  # the id is free for a new request
    # once that memory expired, an unknown id's abort is early again
    assert aborts.add("done", now=40.0)


class Refused(Exception):
    pass


class Context:
    """What `stream_slot` uses of a grpc.aio ServicerContext."""

    def __init__(self):
        self.code = self.details = None

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Refused(details)


def test_calls_beyond_the_limit_are_resource_exhausted_and_the_message_names_it():
    worker = EngineWorker.__new__(EngineWorker)  # the slot bookkeeping only: no engine
    worker.role, worker.worker_id, worker.max_streams, worker.open_streams = "decode", "d0", 2, 0

    async def scenario():
        release = asyncio.Event()
        entered = []

        async def hold():
            async with worker.stream_slot(Context()):
                entered.append(1)
                await release.wait()

        held = [asyncio.create_task(hold()) for _ in range(2)]
        while len(entered) < 2:
            await asyncio.sleep(0)
        ctx = Context()
        with pytest.raises(Refused):
            async with worker.stream_slot(ctx):
                pass
        assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-concurrent-streams 2" in ctx.details
        release.set()
        await asyncio.gather(*held)
        assert worker.open_streams == 0
        async with worker.stream_slot(Context()):  # a slot is free again
            assert worker.open_streams == 1

    asyncio.run(scenario())


def test_the_default_limit_is_a_generous_multiple_of_the_batch():
    assert default_max_streams(256) == 1024
    assert default_max_streams(512) == 2048
