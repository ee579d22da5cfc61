"""A real pool node process with real Redis: puts, gets, leases, eviction, TP slices, Redis outages.

Every test runs twice: through the node's shared slab (this host: `shm`) and through the pair group
(`pair`, the client told not to map the slab), and checks which one moved the bytes."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import pytest
import torch
from cluster_helpers import wait_for

from kvferry.kvpool.client import PoolClient, wait_for_nodes
from kvferry.kvpool.dataplane import Put
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import BlockLayout

pytestmark = pytest.mark.slow

LAYOUT = BlockLayout(2, 4, 16, 8, "float32")
SLOTS = 8


@pytest.fixture(scope="module", params=["shm", "pair"])
def pool(redis_server, tmp_path_factory, request):
    namespace = f"pooltest-{request.param}"
    log = (tmp_path_factory.mktemp("pool") / "pool.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvferry.kvpool",
            "--node-id",
            "n0",
            "--redis-url",
            redis_server.url,
            "--namespace",
            namespace,
            "--layout",
            ",".join(map(str, LAYOUT.to_list())),
            "--num-slots",
            str(SLOTS),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    shm = request.param == "shm"
    client = PoolClient(MetadataStore(redis_server.url, namespace), LAYOUT, peer_id="tester", shm=shm)
    assert wait_for_nodes(client, 1, 60), "the pool node did not register"
    client.transport = request.param
    yield client
    client.close()
    proc.terminate()
    assert proc.wait(20) == 0


def blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, *LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


def key(i: int, tag: int = 0) -> bytes:
    return bytes([tag]) + i.to_bytes(15, "little")


def stats(client):
    return next(iter(client.stats().values()))


def test_the_transport_asked_for_moves_the_bytes(pool):
    data = blocks(2, 9)
    locations = pool.put("t", [key(0, 9), key(1, 9)], data)
    assert torch.equal(pool.get("t", locations), data)
    shm = pool.transport == "shm"
    assert (pool.nodes["n0"].shm is not None) == shm
    reader = PoolClient(pool.meta, LAYOUT, peer_id="reader", shm=shm)
    try:
        assert torch.equal(reader.get("t", locations), data)
        # a same-host get needs no pair group (nor any RPC); a put's commit is a header on it
        assert (reader.nodes["n0"].link.group is None) == shm
    finally:
        reader.close()


def test_put_then_get_round_trip_and_prefix_lookup(pool):
    data = blocks(3, 1)
    keys = [key(i, 1) for i in range(3)]
    locations = pool.put("r1", keys, data)
    assert all(loc is not None for loc in locations)
    wait_for(lambda: len(pool.lookup_prefix(keys)) == 3, 10, "publishing")  # published after the data landed
    assert len(pool.lookup_prefix([keys[0], key(99, 1), keys[2]])) == 1  # stops at the first miss
    assert torch.equal(pool.get("r2", locations), data)
    assert stats(pool).leases == {}
    # a second put of the same keys stores nothing new and answers the existing locations
    again = pool.put("r3", keys, data)
    assert [(x.slot, x.generation) for x in again] == [(x.slot, x.generation) for x in locations]


def test_private_tail_is_freed_after_its_get_or_release(pool):
    tail = blocks(1, 2)
    (loc,) = pool.put("tail-req", [key(0, 2)], tail, private=[True])
    assert pool.lookup_prefix([key(0, 2)]) == []  # never published
    assert stats(pool).private_blocks == 1
    assert torch.equal(pool.get("tail-req", [loc]), tail)
    assert stats(pool).private_blocks == 0
    assert pool.get("tail-req", [loc]).shape[0] == 0  # gone
    pool.put("other", [key(1, 2)], tail, private=[True])
    assert pool.release("other") == 1
    assert stats(pool).private_blocks == 0


def test_tp_slices_publish_only_when_every_head_arrived(pool):
    data = blocks(1, 3)
    keys = [key(0, 3)]
    # rank 0's slice: its put is answered only once the block is complete
    first = pool.put_async("tp", keys, data[:, :, :, :2].contiguous(), head_begin=0, head_end=2)
    # a complete block put after it: once that one is published, anything queued before it was too
    marker = [key(1, 3)]
    pool.put("tp", marker, data)
    wait_for(lambda: len(pool.lookup_prefix(marker)) == 1, 10, "publishing")
    assert pool.lookup_prefix(keys) == []
    assert not first.done()
    (loc,) = pool.put("tp", keys, data[:, :, :, 2:].contiguous(), head_begin=2, head_end=4)
    assert loc is not None and first.result(timeout=10) == [loc]  # both slices landed in one slot
    wait_for(lambda: len(pool.lookup_prefix(keys)) == 1, 10, "publishing")
    assert torch.equal(pool.get("tp-read", [loc]), data)
    assert torch.equal(pool.get("tp-read", [loc], head_begin=1, head_end=3), data[:, :, :, 1:3])


def test_layer_wise_puts_complete_a_block_when_every_layer_and_head_came(pool):
    """A prefill streaming its KV puts each layer of its blocks as it is computed (a TP rank: its KV
    heads of it): the blocks are published, and every one of those puts answered, only once the last
    slice is in; a private block assembles the same way; the bytes read back whole are bit-exact."""
    data = blocks(3, 5)
    keys = [key(0, 5), key(1, 5), key(2, 5)]
    private = [False, False, True]
    marker = [key(3, 5)]
    first = pool.put_async("lw", keys, data[:, :1].contiguous(), private, layers=(0, 1))
    pool.put("lw", marker, blocks(1, 6))  # published after it: the layer-0 put was handled before
    wait_for(lambda: len(pool.lookup_prefix(marker)) == 1, 10, "publishing")
    assert pool.lookup_prefix(keys[:2]) == [] and not first.done()
    # layer 1 in two KV-head halves (a TP group's two ranks)
    halves = [
        pool.put_async("lw", keys, data[:, 1:, :, hb:he].contiguous(), private, None, hb, he, (1, 2))
        for hb, he in ((0, 2), (2, 4))
    ]
    found = [f.result(timeout=10) for f in (first, *halves)]
    assert found[0] == found[1] == found[2] and all(loc is not None for loc in found[0])
    wait_for(lambda: len(pool.lookup_prefix(keys[:2])) == 2, 10, "publishing")
    assert torch.equal(pool.get("lw-read", found[0]), data)
    assert torch.equal(pool.get("lw-read", found[0][:2], head_begin=1, head_end=3), data[:2, :, :, 1:3])
    with pytest.raises(ValueError, match="layer slice"):
        pool.put_async("lw", keys[:1], data[:1], layers=(1, 3))
    pool.release("lw")


def test_eviction_makes_stale_locations_misses(pool):
    first = pool.put("e1", [key(0, 4)], blocks(1, 4))
    wait_for(lambda: len(pool.lookup_prefix([key(0, 4)])) == 1, 10, "publishing")
    before = stats(pool).evictions
    fill = [key(i, 5) for i in range(SLOTS)]
    pool.put("e2", fill, blocks(SLOTS, 5))  # more than the free slots: LRU blocks are evicted
    assert stats(pool).evictions > before
    assert pool.get("e3", first).shape[0] == 0  # the slot was reused: refused, never wrong data
    if pool.transport == "pair":  # a same-host read checks the generation itself, the node never sees it
        assert stats(pool).stale_gets >= 1
    wait_for(lambda: pool.lookup_prefix([key(0, 4)]) == [], 10, "its metadata to be removed")


def test_redis_outage_means_misses_not_errors(pool, redis_server):
    data = blocks(2, 6)
    redis_server.stop()
    try:
        locations = pool.put("o1", [key(0, 6), key(1, 6)], data)  # known node, no metadata writes
        assert pool.lookup_prefix([key(0, 6)]) == []
        assert torch.equal(pool.get("o2", locations), data)  # locations from the put still work
    finally:
        redis_server.start()
    wait_for(lambda: pool.refresh() != {} and "n0" in pool.meta.members("pool"), 15, "re-registration")


def test_a_put_landing_around_a_block_the_node_has_keeps_each_blocks_bytes(pool):
    """A put naming no slots whose middle block is already stored: the node drops that row and lands
    the others in the next free slots, which may be consecutive although the rows are not."""
    if pool.transport != "pair":
        pytest.skip("unnamed slots: a pair-group put (a same-host put always names its slots)")
    data = blocks(3, 21)
    keys = [key(i, 21) for i in range(3)]
    (middle,) = pool.put("dup0", keys[1:2], data[1:2])
    node = pool._node("n0")
    done: concurrent.futures.Future = concurrent.futures.Future()
    node.link.put(Put("dup1", keys, data, [False] * 3, [], 0, LAYOUT.num_kv_heads, done))
    locations = done.result(timeout=30)
    assert (locations[1].slot, locations[1].generation) == (middle.slot, middle.generation)
    assert torch.equal(pool.get("dup2", locations), data)  # C holds C's bytes, not the dropped B's
