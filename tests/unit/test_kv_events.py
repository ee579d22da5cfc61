"""KV events (kvpool.kv_events) against a real redis-server started here: the block manager's change
queue, the publisher's batches and sequence numbers, the snapshot, and the readers' index (a late reader,
a gap, a restarted worker, a worker that leaves the registry)."""

from __future__ import annotations

import time

import pytest

from kvferry.engine.block_hash import model_fingerprint
from kvferry.engine.block_manager import CLEARED, REMOVED, STORED, BlockManager
from kvferry.engine.request import Request, SamplingParams
from kvferry.kvpool import kv_events
from kvferry.kvpool.kv_events import (
    GAP,
    KVEvent,
    KVEventPublisher,
    KVEventReader,
    KVIndex,
    Snapshot,
    batched,
    snapshot_key,
    stream_key,
)
from kvferry.kvpool.metadata import MetadataStore

BS = 4
FP = model_fingerprint("unit-test-model", "float32")


@pytest.fixture()
def meta(redis_url, request):
    store = MetadataStore(redis_url, namespace=request.node.name)
    yield store
    store.client.close()


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def register(meta: MetadataStore, worker: str, addr: str = "h:1", group: str = "") -> None:
    meta.register("prefill", worker, {"addr": addr, "group": group or worker}, ttl_s=30)


def computed(bm: BlockManager, rid: str, n: int, base: int = 0) -> Request:
    """A request of n tokens allocated, computed and committed."""
    req = Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=1))
    assert bm.allocate(req, n)
    req.num_computed_tokens = n
    bm.commit(req)
    return req


def test_block_manager_reports_each_cache_change_in_order():
    bm = BlockManager(4, BS, FP)
    assert bm.changes is None  # unwatched: nothing queued
    a = computed(bm, "a", 9)  # 2 full blocks + a private tail
    changes = bm.watch()
    assert list(changes) == [(CLEARED, None), *((STORED, k) for k in a.block_keys[:2])]
    changes.clear()
    bm.free(a)
    b = computed(bm, "b", 16, base=100)  # 4 blocks: the free ones first, then a's two cached ones go
    assert [kind for kind, _ in changes] == [REMOVED, REMOVED, STORED, STORED, STORED, STORED]
    assert {k for kind, k in changes if kind == REMOVED} == set(a.block_keys[:2])
    assert [k for kind, k in changes if kind == STORED] == b.block_keys
    changes.clear()
    bm.free(b)
    (block,) = bm.reserve(1)
    bm.register(block, key(7))  # a pulled block: its old key goes, the new one is stored
    assert changes[-1] == (STORED, key(7)) and changes[0][0] == REMOVED


def test_batches_keep_order_and_split_long_runs(monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_KEYS_PER_ENTRY", 2)
    changes = [(CLEARED, None), (STORED, key(1)), (STORED, key(2)), (STORED, key(3)), (REMOVED, key(1))]
    changes.append((STORED, key(1)))
    assert batched(changes) == [
        (CLEARED, []),
        (STORED, [key(1), key(2)]),
        (STORED, [key(3)]),
        (REMOVED, [key(1)]),
        (STORED, [key(1)]),
    ]


def entries(meta: MetadataStore) -> list[KVEvent]:
    return [KVEvent.parse(f) for _, f in meta.client.xrange(stream_key(meta.prefix))]


def test_publisher_batches_with_sequence_numbers_and_writes_the_snapshot(meta):
    bm = BlockManager(8, BS, FP)
    first = computed(bm, "a", 8)
    publisher = KVEventPublisher(meta, "p0", "g0", bm.watch(), snapshot_s=3600)
    assert publisher.flush() == 2  # cleared, then what the cache held
    second = computed(bm, "b", 12, base=50)
    assert publisher.flush() == 1 and publisher.flush() == 0  # one entry for three keys; then nothing
    got = entries(meta)
    assert [(e.seq, e.kind, e.keys) for e in got] == [
        (1, CLEARED, ()),
        (2, STORED, tuple(first.block_keys)),
        (3, STORED, tuple(second.block_keys)),
    ]
    assert {(e.worker, e.group, e.epoch) for e in got} == {("p0", "g0", publisher.epoch)}
    snap = Snapshot.parse("p0", meta.client.hgetall(snapshot_key(meta.prefix, "p0")))
    assert snap.seq == 2 and snap.keys == set(first.block_keys)  # written with the first flush only
    assert meta.client.pttl(snapshot_key(meta.prefix, "p0")) > 0
    publisher.snapshot_s = 0
    publisher.flush()
    snap = Snapshot.parse("p0", meta.client.hgetall(snapshot_key(meta.prefix, "p0")))
    assert (snap.seq, snap.keys) == (3, {*first.block_keys, *second.block_keys})
    publisher.stop()
    assert not meta.client.exists(snapshot_key(meta.prefix, "p0"))


def test_the_publisher_thread_flushes_in_the_background(meta):
    bm = BlockManager(8, BS, FP)
    publisher = KVEventPublisher(meta, "p0", "p0", bm.watch(), flush_s=0.01)
    publisher.start()
    try:
        req = computed(bm, "a", 8)
        deadline = time.monotonic() + 10
        while len(entries(meta)) < 2:
            assert time.monotonic() < deadline, "the publisher never flushed"
            time.sleep(0.01)
        assert entries(meta)[-1].keys == tuple(req.block_keys)
    finally:
        publisher.stop()


def follow(meta: MetadataStore) -> tuple[KVIndex, KVEventReader]:
    index = KVIndex(resync_s=0.0)
    return index, KVEventReader(meta, index)


def test_a_late_reader_starts_from_the_snapshot_and_follows_the_stream(meta):
    register(meta, "p0")
    bm = BlockManager(16, BS, FP)
    publisher = KVEventPublisher(meta, "p0", "p0", bm.watch(), snapshot_s=3600)
    early = computed(bm, "a", 8)
    publisher.flush()  # seq 1-2 (the snapshot: seq 2)
    late = computed(bm, "b", 8, base=40)
    publisher.flush()  # seq 3: after the snapshot, before the reader starts
    index, reader = follow(meta)
    reader.step(block_ms=0)  # snapshot + replay of what followed it
    assert index.workers["p0"].seq == 3 and index.workers["p0"].exact
    assert index.holds("p0") == {*early.block_keys, *late.block_keys}
    bm.free(early)
    bm.free(late)
    computed(bm, "c", 48, base=90)  # 12 blocks in 16: evicts 4 cached ones
    publisher.flush()
    reader.step(block_ms=0)
    assert index.holds("p0") == set(bm.cached) and index.workers["p0"].seq == publisher.seq


def test_a_gap_reloads_the_snapshot(meta):
    register(meta, "p0")
    bm = BlockManager(16, BS, FP)
    publisher = KVEventPublisher(meta, "p0", "p0", bm.watch(), snapshot_s=3600)
    publisher.flush()
    index, reader = follow(meta)
    reader.step(block_ms=0)
    computed(bm, "a", 8)
    publisher.seq += 5  # entries lost (as in an outage): the next one does not follow
    publisher.snapshot_due = True
    publisher.flush()
    event = entries(meta)[-1]
    assert index.apply(event, time.monotonic()) == GAP  # what the reader meets
    reader.step(block_ms=0)
    assert index.workers["p0"].seq == publisher.seq and index.workers["p0"].exact
    assert index.holds("p0") == set(bm.cached)


def test_a_restarted_worker_and_one_that_leaves_are_forgotten(meta):
    register(meta, "p0")
    register(meta, "p1", addr="h:2")
    bm = BlockManager(16, BS, FP)
    publisher = KVEventPublisher(meta, "p0", "p0", bm.watch())
    computed(bm, "a", 8)
    publisher.flush()
    index, reader = follow(meta)
    reader.step(block_ms=0)
    assert len(index.holds("p0")) == 2 and index.holds("p1") == set()
    # p0 comes back at another address: a new process, a new epoch, an empty cache
    register(meta, "p0", addr="h:9")
    fresh = BlockManager(16, BS, FP)
    KVEventPublisher(meta, "p0", "p0", fresh.watch()).flush()
    reader._registry_at = 0  # re-read the registry now
    reader.step(block_ms=0)
    assert index.workers["p0"].addr == "h:9" and index.holds("p0") == set()
    meta.unregister("prefill", "p1")
    reader._registry_at = 0
    reader.step(block_ms=0)
    assert "p1" not in index.workers


def test_entries_of_a_new_epoch_replace_the_old_view():
    index = KVIndex()
    index.retain({"p0": ("p0", "h:1")})
    index.load("p0", Snapshot("p0", "p0", "old", 7, "0-0", frozenset({key(1)})), time.monotonic())
    assert index.apply(KVEvent("p0", "p0", "old", 8, STORED, (key(2),)), time.monotonic()) == "applied"
    assert index.apply(KVEvent("p0", "p0", "new", 1, CLEARED), time.monotonic()) == "applied"
    assert index.apply(KVEvent("p0", "p0", "new", 2, STORED, (key(3),)), time.monotonic()) == "applied"
    assert index.holds("p0") == {key(3)} and index.workers["p0"].exact
    assert index.apply(KVEvent("p9", "p9", "x", 1, CLEARED), time.monotonic()) == "ignored"
