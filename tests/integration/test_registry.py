"""The Redis registry and the router's Directory against the session's real redis-server: members are
read without SCAN, dead members expire, dead pool nodes' block entries become misses, malformed
records are skipped, and a Redis outage longer than the grace drops nobody."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import pytest
import redis
from cluster_helpers import wait_for

from kvferry.auth import server_interceptors
from kvferry.kvpool.metadata import Location, MetadataStore
from kvferry.router.directory import Directory
from kvferry.v1 import worker_pb2, worker_pb2_grpc


def store(redis_server, **kw) -> MetadataStore:
    return MetadataStore(redis_server.url, f"reg-{uuid.uuid4().hex[:8]}", **kw)


def scans(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("scan", "keys"))


def test_members_are_read_without_scanning_the_keyspace(redis_server):
    meta = store(redis_server)
    meta.publish([Location(i.to_bytes(16, "little"), "n0", i, 1) for i in range(500)])  # block keys
    for i in range(3):
        assert meta.register("decode", f"d{i}", {"addr": f"127.0.0.1:{9000 + i}"}, ttl_s=30)
    meta.register("pool", "n0", {"addr": "127.0.0.1:8000"}, ttl_s=30)
    before = scans(meta.client)
    for _ in range(20):
        assert sorted(meta.members("decode")) == ["d0", "d1", "d2"]
        assert meta.members("pool") == {"n0": {"addr": "127.0.0.1:8000"}}
        assert len(meta.lookup([i.to_bytes(16, "little") for i in range(5)])) == 5
    assert scans(meta.client) == before


def test_dead_members_expire_and_leave_the_index(redis_server):
    meta = store(redis_server)
    meta.register("prefill", "short", {"addr": "a:1"}, ttl_s=0.3)
    meta.register("prefill", "long", {"addr": "b:2"}, ttl_s=30)
    assert set(meta.members("prefill")) == {"short", "long"}
    wait_for(lambda: set(meta.members("prefill")) == {"long"}, 5, "the short-lived record to expire")
    index = f"{meta.prefix}m:prefill"
    assert meta.client.smembers(index) == {b"long"}  # the reader removed the expired id
    meta.register("prefill", "short", {"addr": "a:1"}, ttl_s=30)  # beats again: back in the index
    assert set(meta.members("prefill")) == {"short", "long"}
    meta.unregister("prefill", "long")
    assert set(meta.members("prefill")) == {"short"}
    assert meta.client.smembers(index) == {b"short"}


def test_entries_on_a_node_missing_from_the_registry_are_misses_and_deleted(redis_server):
    meta = store(redis_server, live_cache_s=0.05)
    meta.register("pool", "live", {"addr": "a:1"}, ttl_s=30)
    keys = [bytes([i]) * 16 for i in range(4)]
    meta.publish(
        [Location(keys[0], "live", 0, 1), Location(keys[1], "live", 1, 1), Location(keys[2], "dead", 0, 1)]
    )
    assert [loc and loc.node_id for loc in meta.lookup(keys)] == ["live", "live", None, None]
    assert len(meta.lookup_prefix(keys)) == 2
    assert meta.client.get(meta._bkey(keys[2])) is None  # removed (compare-and-delete)
    assert meta.client.get(meta._bkey(keys[0])) is not None
    # a node that registers after a reader cached the live set is re-checked, never dropped
    meta.lookup(keys[:1])
    meta.register("pool", "new", {"addr": "b:2"}, ttl_s=30)
    meta.publish([Location(keys[3], "new", 0, 1)])
    assert meta.lookup(keys[3:])[0].node_id == "new"
    assert meta.client.get(meta._bkey(keys[3])) is not None


def test_malformed_records_are_skipped_and_logged_once(redis_server, caplog):
    meta = store(redis_server)
    meta.register("pool", "good", {"addr": "127.0.0.1:1"}, ttl_s=30)
    meta.client.set(f"{meta.prefix}n:pool:junk", b"\xff not json")
    meta.client.sadd(f"{meta.prefix}m:pool", "junk")
    meta.register("pool", "n-bare", {"store": "x"}, ttl_s=30)
    meta.register("prefill", "p-list", [1, 2], ttl_s=30)  # JSON, but not an object
    meta.register("prefill", "p-noaddr", {"group": "g"}, ttl_s=30)
    meta.register("decode", "d-blocks", {"addr": "127.0.0.1:1", "free_blocks": "many"}, ttl_s=30)
    meta.register("decode", "d-group", {"addr": "127.0.0.1:1", "group": ["x"]}, ttl_s=30)
    assert set(meta.members("pool")) == {"good", "n-bare"}
    directory = Directory(meta, grace_s=60)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            asyncio.run(directory.refresh())
    assert directory.members == {"prefill": {}, "decode": {}}
    assert set(directory.pool_nodes) == {"good"}
    for name in ("junk", "n-bare", "p-list", "p-noaddr", "d-blocks", "d-group"):
        assert sum(name in r.getMessage() for r in caplog.records) == 1, name


class _Worker(worker_pb2_grpc.PrefillWorkerServicer, worker_pb2_grpc.DecodeWorkerServicer):
    """A real gRPC server that answers GetWorkerInfo: what the Directory asks a joining worker."""

    async def GetWorkerInfo(self, request, context):
        return worker_pb2.WorkerInfo(model="m", fingerprint="f", block_size=16, max_model_len=64)


async def _serve_worker() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=server_interceptors(aio=True))
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Worker(), server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _answers(member) -> bool:
    try:
        await member.stub.GetWorkerInfo(worker_pb2.WorkerInfoRequest(), timeout=5)
    except (grpc.RpcError, grpc.aio.UsageError, RuntimeError):
        return False
    return True


@pytest.mark.slow
def test_redis_outage_longer_than_the_grace_drops_nobody(redis_server):
    grace = 1.0

    async def scenario():
        server, addr = await _serve_worker()
        meta = store(redis_server, socket_timeout=0.5)

        def beat(roles=("prefill", "decode", "pool")):
            for role in roles:
                meta.register(role, f"{role}-0", {"addr": addr}, ttl_s=30)

        beat()
        directory = Directory(meta, refresh_s=0.1, grace_s=grace)
        await directory.refresh()
        assert directory.ready
        decode = directory.members["decode"]["decode-0"]
        decode.inflight = 1  # a stream the router relays
        redis_server.stop()
        try:
            deadline = time.monotonic() + 2 * grace
            while time.monotonic() < deadline:  # an outage twice the grace
                await directory.refresh()
                await asyncio.sleep(0.1)
            assert directory.ready  # the last known set is kept
        finally:
            redis_server.start()  # empty: every record is gone until the next heartbeat
        await directory.refresh()
        assert directory.ready, "an outage longer than the grace dropped the cluster"
        assert directory.members["decode"]["decode-0"] is decode
        beat(("prefill", "pool"))  # the decode worker never beats again
        await directory.refresh()
        assert directory.ready
        start = time.monotonic()
        while "decode-0" in directory.members["decode"]:
            assert time.monotonic() - start < 5 * grace, "a worker gone from the registry was kept"
            beat(("prefill", "pool"))
            await directory.refresh()
            await asyncio.sleep(0.1)
        assert time.monotonic() - start >= grace * 0.9
        assert not directory.ready  # no decode worker left
        assert await _answers(decode), "the channel was closed under a stream in flight"
        decode.inflight = 0  # its last call ended
        await directory.refresh()
        assert not await _answers(decode)
        assert "prefill-0" in directory.members["prefill"] and directory.pool_nodes
        await directory.stop()
        await server.stop(None)

    asyncio.run(scenario())
