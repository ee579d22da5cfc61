"""The pool node's disk tier with a real node process and real Redis: evicted blocks spill to files and
come back on a get, a node killed -9 and started again on its directory serves them, and a damaged file
is a miss. Every test runs through the node's shared slab (`shm`) and through the pair group (`pair`)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch
from cluster_helpers import wait_for

from kvferry.kvpool.client import PoolClient
from kvferry.kvpool.metadata import DISK_SLOT, MetadataStore
from kvferry.kvpool.transfer import BlockLayout

pytestmark = pytest.mark.slow

LAYOUT = BlockLayout(2, 4, 16, 8, "float32")  # 16 KiB blocks
SLOTS = 16
CHAIN = 28  # puts of 4: the first 12 or more end up on disk only
HEAD = 12  # the leading blocks a get asks for (fewer than the slab: they are restored together)


class Node:
    """One pool node process on a fixed id and disk directory, restartable."""

    def __init__(self, redis_url: str, namespace: str, disk_dir, log_path):
        self.redis_url, self.namespace, self.disk_dir = redis_url, namespace, disk_dir
        self.log = open(log_path, "ab")  # noqa: SIM115 (closed by stop)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "kvferry.kvpool", "--node-id", "d0", "--redis-url", self.redis_url]
        argv += ["--namespace", self.namespace, "--layout", ",".join(map(str, LAYOUT.to_list()))]
        argv += ["--num-slots", str(SLOTS), "--disk-dir", str(self.disk_dir), "--disk-max-gib", "0.01"]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(20)
        self.log.close()
        return code


@pytest.fixture(params=["shm", "pair"])
def pool(redis_server, tmp_path, request):
    node = Node(
        redis_server.url, f"disktier-{uuid.uuid4().hex[:8]}", tmp_path / "disk", tmp_path / "node.log"
    )
    node.start()
    node.transport = request.param
    node.client = connect(node)
    yield node
    node.client.close()
    assert node.stop() == 0


def connect(node: Node, old_addr: str | None = None) -> PoolClient:
    """A client of the node's current process, once it registered (not `old_addr`: a killed one's
    record outlives it by a TTL)."""
    meta = MetadataStore(node.redis_url, node.namespace)
    client = PoolClient(meta, LAYOUT, peer_id=f"tester-{uuid.uuid4().hex[:6]}", shm=node.transport == "shm")
    wait_for(lambda: client.refresh().get("d0", {}).get("addr", old_addr) != old_addr, 60, "the new address")
    return client


def stats(client):
    return client.stats()["d0"]


def chain(seed: int) -> tuple[list[bytes], torch.Tensor]:
    keys = [bytes([seed]) + i.to_bytes(15, "little") for i in range(CHAIN)]
    return keys, torch.randn(CHAIN, *LAYOUT.shape, generator=torch.Generator().manual_seed(seed))


def put_chain(client: PoolClient, keys, data) -> None:
    """Put the chain 4 blocks at a time, each put's evictions written to disk before the next."""
    for first in range(0, CHAIN, 4):
        assert all(client.put("w", keys[first : first + 4], data[first : first + 4]))

        def settled():
            s = stats(client)
            return s.disk_spills + s.disk_spill_drops == s.evictions

        wait_for(settled, 20, "the puts to settle")
    s = stats(client)
    assert s.disk_spill_drops == 0 and s.disk_spills >= CHAIN - SLOTS
    assert s.disk_files == s.disk_spills


def head_on_disk(client: PoolClient, keys) -> list:
    """The chain's leading HEAD locations, once the lookup names them all on disk."""
    found = []

    def on_disk():
        found[:] = client.lookup_prefix(keys[:HEAD])
        return len(found) == HEAD and all(loc.slot == DISK_SLOT for loc in found)

    wait_for(on_disk, 20, "blocks on disk")
    return found


def test_evicted_blocks_come_back_from_disk(pool):
    client = pool.client
    keys, data = chain(1)
    put_chain(client, keys, data)
    assert len(client.lookup_prefix(keys)) == CHAIN  # in memory or on disk: every block is a hit
    locations = head_on_disk(client, keys)
    assert torch.equal(client.get("g", locations), data[:HEAD])
    s = stats(client)
    assert s.disk_hits == HEAD and s.disk_misses == 0 and s.disk_corrupt == 0
    # restored and published: the next lookup names the memory copies, and a get needs no disk read
    wait_for(
        lambda: all(loc.slot != DISK_SLOT for loc in client.lookup_prefix(keys[:HEAD])), 20, "restored blocks"
    )
    assert torch.equal(client.get("g2", client.lookup_prefix(keys[:HEAD])), data[:HEAD])
    assert stats(client).disk_hits == HEAD
    assert (client.nodes["d0"].shm is not None) == (pool.transport == "shm")


def test_a_restarted_node_republishes_and_serves_its_disk_blocks(pool, redis_server):
    client = pool.client
    keys, data = chain(2)
    put_chain(client, keys, data)
    # restored into the slab (memory entries that will be stale after the kill), still on disk
    assert torch.equal(client.get("g", head_on_disk(client, keys)), data[:HEAD])
    wait_for(
        lambda: all(loc.slot != DISK_SLOT for loc in client.lookup_prefix(keys[:HEAD])), 20, "restored blocks"
    )
    old_addr = client.refresh()["d0"]["addr"]
    client.close()
    pool.kill()
    redis = client.meta.client
    prefix = client.meta.prefix
    assert redis.delete(*(f"{prefix}d:{k.hex()}" for k in keys)) >= HEAD  # as if Redis lost them
    pool.start()
    pool.client = client = connect(pool, old_addr)
    locations = head_on_disk(client, keys)  # republished; the stale memory entries dropped
    assert torch.equal(client.get("g", locations), data[:HEAD])
    s = stats(client)
    assert s.disk_hits == HEAD and s.disk_corrupt == 0 and s.disk_files >= HEAD


def test_a_damaged_file_is_a_miss_and_is_dropped(pool):
    client = pool.client
    keys, data = chain(3)
    put_chain(client, keys, data)
    locations = head_on_disk(client, keys)
    bad = 5
    path = pool.disk_dir / f"{keys[bad].hex()}.kvb"
    with open(path, "r+b") as f:  # flip one payload byte
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    got = client.get("g", locations)
    assert got.shape[0] == bad and torch.equal(got, data[:bad])  # the caller recomputes from there
    s = stats(client)
    assert s.disk_corrupt == 1 and s.disk_hits == bad
    assert not path.exists()
    entry = f"{client.meta.prefix}d:{keys[bad].hex()}"
    wait_for(lambda: client.meta.client.get(entry) is None, 20, "the entry to go")
    assert len(client.lookup_prefix(keys[:HEAD])) == bad


def test_tp_ranks_restoring_the_same_blocks_load_each_once(pool):
    client = pool.client
    keys, data = chain(4)
    put_chain(client, keys, data)
    locations = head_on_disk(client, keys)
    half = LAYOUT.num_kv_heads // 2
    with concurrent.futures.ThreadPoolExecutor(2) as ex:  # two ranks, one KV-head slice each
        slices = [ex.submit(client.get, f"g{b}", locations, b, b + half) for b in (0, half)]
        got = torch.cat([f.result() for f in slices], dim=3)
    assert torch.equal(got, data[:HEAD])
    s = stats(client)
    assert s.disk_hits == HEAD and s.disk_misses == 0  # the second rank's restore found the first's copy
