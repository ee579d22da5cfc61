"""Replicas: a put's copies on distinct nodes, gets that fall back on a copy when a node is dead, hot
blocks copied by the node that serves them, and a cluster that keeps its prefix hits when a pool node
holding replicated blocks is killed."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from cluster_helpers import ENGINE, Members, greedy, make_cluster_config, wait_for

from kvferry.deploy.config import PoolConfig, RestartSettings, RouterConfig, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.engine.block_hash import block_keys
from kvferry.kvpool.client import PoolClient, from_proto, to_proto, wait_for_nodes
from kvferry.kvpool.metadata import DISK_SLOT, Location, MetadataStore
from kvferry.kvpool.transfer import BlockLayout
from kvferry.proc import dying_with_parent
from kvferry.router.client import Client
from kvferry.v1 import pool_pb2

LAYOUT = BlockLayout(2, 4, 16, 8, "float32")
TIMEOUT_S = 2.0
TTL_S = PoolConfig.ttl_s


def test_a_key_keeps_one_copy_per_node(redis_server):
    """The `b:` entry holds every node's copy: adding one replaces only that node's, a compare-and-delete
    removes only the exact copy, a restarted node's copies go alone; a lookup names one copy (the
    nearest by `prefer`, then the previous key's node) and the rest as replicas, a disk copy last."""
    meta = MetadataStore(redis_server.url, "copies")
    for node in ("a", "b", "c"):
        meta.register("pool", node, {}, 30)
    k1, k2 = b"\x01" * 16, b"\x02" * 16
    meta.publish([Location(k1, "a", 1, 1), Location(k2, "a", 2, 1)])
    meta.publish([Location(k1, "b", 5, 3), Location(k2, "b", 6, 3)])
    meta.publish([Location(k1, "b", 7, 4)])  # b's newer copy replaces its older one
    meta.publish([Location(k1, "c", 0, 9), Location(k1, "c", DISK_SLOT, 2)])
    first = meta.lookup([k1])[0]
    assert {c.node_id: (c.slot, c.generation) for c in first.copies() if c.slot != DISK_SLOT} == {
        "a": (1, 1),
        "b": (7, 4),
        "c": (0, 9),
    }
    assert first.copies()[-1] == Location(k1, "c", DISK_SLOT, 2)  # the disk copy comes last

    near = {"b": 0}.get
    found = meta.lookup([k1, k2], prefer=lambda n: near(n, 1))
    assert [loc.node_id for loc in found] == ["b", "b"]
    found = meta.lookup([k1, k2], prefer=lambda n: 0 if n == "c" else 1)
    assert [loc.node_id for loc in found] == ["c", "a"]  # k2 has no copy on c: a, b tie, c is not there

    meta.unpublish([Location(k1, "b", 5, 3)])  # stale (b holds it at 7/4 now): nothing changes
    assert len(meta.lookup([k1])[0].copies()) == 4
    meta.unpublish([Location(k1, "b", 7, 4)])
    assert {c.node_id for c in meta.lookup([k1])[0].copies()} == {"a", "c"}
    meta.forget_node_blocks([k1, k2], "a")
    assert [c.node_id for c in meta.lookup([k1])[0].copies()] == ["c", "c"]  # memory, then disk
    assert meta.lookup([k2])[0].copies() == (Location(k2, "b", 6, 3),)
    meta.unpublish([Location(k2, "b", 6, 3)])
    assert meta.client.get(meta._bkey(k2)) is None  # the last copy gone: the key goes

    meta.unregister("pool", "c")  # a dead node's copies are misses, and are deleted
    meta._live = None
    assert meta.lookup([k1]) == [None]
    assert meta.client.get(meta._bkey(k1)) is None


def test_replicas_travel_in_the_proto():
    loc = Location(b"k", "a", 1, 2, (Location(b"k", "b", 3, 4), Location(b"k", "c", DISK_SLOT, 5)))
    back = from_proto(pool_pb2.BlockLocation.FromString(to_proto(loc).SerializeToString()))
    assert back == loc and back.replicas == loc.replicas


def start_node(redis_url: str, namespace: str, node_id: str, log_path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvferry.kvpool", "--node-id", node_id, "--redis-url", redis_url]
    argv += ["--namespace", namespace, "--layout", ",".join(map(str, LAYOUT.to_list()))]
    argv += ["--num-slots", "32", "--transfer-timeout-s", str(TIMEOUT_S), *extra]
    with open(log_path, "wb") as log:
        return subprocess.Popen(dying_with_parent(argv, signal.SIGKILL), stdout=log, stderr=subprocess.STDOUT)


def client(redis_url: str, namespace: str, name: str, shm: bool, replicas: int = 1) -> PoolClient:
    meta = MetadataStore(redis_url, namespace)
    return PoolClient(meta, LAYOUT, peer_id=name, transfer_timeout_s=TIMEOUT_S, shm=shm, replicas=replicas)


def stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["pair", "shm"])
def test_killed_node_loses_no_replicated_block(redis_server, tmp_path, transport):
    """A put with replicas=2 stores a copy on each node and answers with both; kill -9 the node a get
    would read first: the get reads every block from the other copy, bit-exact, through the locations
    the put answered (the node still registered: the pair group fails, or the slab is found unmapped
    once the record lapsed) and through a fresh lookup."""
    shm = transport == "shm"
    ns = f"replicas-{transport}"
    procs = [start_node(redis_server.url, ns, n, tmp_path / f"{n}.log") for n in ("n0", "n1")]
    writer = client(redis_server.url, ns, "writer", shm, replicas=2)
    reader = client(redis_server.url, ns, "reader", shm)
    try:
        assert len(wait_for_nodes(writer, 2, 60)) == 2, "the pool nodes did not register"
        data = torch.randn(5, *LAYOUT.shape)
        keys = [bytes([3, i]) * 8 for i in range(4)] + [b"p" * 16]
        located = writer.put("w", keys, data, private=[False] * 4 + [True])
        assert all(loc is not None and len(loc.copies()) == 2 for loc in located)
        assert all({c.node_id for c in loc.copies()} == {"n0", "n1"} for loc in located)

        def both_published():  # each node publishes its own copy, in its own time
            found = reader.lookup_prefix(keys[:4])
            return len(found) == 4 and all(len(loc.copies()) == 2 for loc in found) and found

        found = wait_for(both_published, 10, "both copies to be published")
        assert torch.equal(reader.get("r0", found), data[:4])

        first = located[0].node_id
        victim = procs[["n0", "n1"].index(first)]
        victim.kill()  # kill -9 the node the put's locations name first
        victim.wait(10)
        if shm:  # the slab outlives the process: only once the node left the registry is it unmapped
            wait_for(lambda: first not in reader.refresh(), TTL_S + 3, "the dead node to leave")
        assert torch.equal(reader.get("r1", located), data)  # the private block too
        wait_for(lambda: {loc.node_id for loc in reader.lookup_prefix(keys[:4])} == ({"n0", "n1"} - {first}))
        assert torch.equal(reader.get("r2", reader.lookup_prefix(keys[:4])), data[:4])
    finally:
        stop(procs)
        writer.close()
        reader.close()


@pytest.mark.slow
def test_hot_blocks_are_copied_to_another_node(redis_server, tmp_path):
    """A block read over the network --hot-reads times is copied by its node to the other one: lookups
    then name both copies, and the blocks outlive the node they were written to."""
    ns = "hot"
    hot = ("--hot-reads", "3", "--hot-replicas", "2")
    procs = [start_node(redis_server.url, ns, n, tmp_path / f"{n}.log", *hot) for n in ("n0", "n1")]
    pool = client(redis_server.url, ns, "hot-reader", shm=False)  # the node counts pair-group reads only
    try:
        assert len(wait_for_nodes(pool, 2, 60)) == 2, "the pool nodes did not register"
        data = torch.randn(3, *LAYOUT.shape)
        keys = [bytes([5, i]) * 8 for i in range(3)]
        assert all(loc.node_id == "n0" for loc in pool.put("w", keys, data, node_id="n0"))
        found = wait_for(lambda: len(pool.lookup_prefix(keys)) == 3 and pool.lookup_prefix(keys))
        for i in range(2):
            assert torch.equal(pool.get(f"r{i}", found), data)
        assert all(len(loc.copies()) == 1 for loc in pool.lookup_prefix(keys))  # 2 reads: not hot yet
        assert torch.equal(pool.get("r2", found), data)
        wait_for(lambda: all(len(loc.copies()) == 2 for loc in pool.lookup_prefix(keys)), 10, "hot copies")
        assert pool.stats()["n0"].hot_copies == 3

        procs[0].kill()
        procs[0].wait(10)
        wait_for(lambda: {loc.node_id for loc in pool.lookup_prefix(keys)} == {"n1"}, TTL_S + 3, "n0 to go")
        assert torch.equal(pool.get("r3", pool.lookup_prefix(keys)), data)
    finally:
        stop(procs)
        pool.close()


@pytest.mark.slow
def test_cluster_keeps_its_prefix_hits_when_a_replica_node_dies(redis_server, tiny_model_dir, tmp_path):
    """pool.replicas 2 on two nodes: every block of a prompt has a copy on each. Kill -9 one node (left
    down): the same prompt again is answered with the reference tokens, its prefill hits the whole
    prefix in the pool (none recomputed but the last block's token), and a decode worker that never saw
    it pulls every block from the surviving copies (the other one hits its own cache)."""
    cfg = make_cluster_config(
        tiny_model_dir,
        redis_server.url,
        "test-pool-replicas",
        pool=PoolConfig(nodes=2, memory_gib=0.1, replicas=2),
        prefill=WorkerGroupSettings(replicas=2, engine=ENGINE),
        decode=WorkerGroupSettings(replicas=2, engine=ENGINE),
        restarts=RestartSettings(max=0),
        # round robin over the idle prefill workers: the one that never saw the prompt gets one of the
        # two requests after the kill (KV-aware routing would send both to the worker that did)
        router=RouterConfig(port=0, http_port=0, routing="least-load"),
    )
    with LocalCluster(cfg, log_dir=tmp_path, quiet=True) as cluster, Client(cluster.router_addr) as api:
        meta = MetadataStore(cluster.redis_url, cfg.namespace)
        members = Members(cluster)
        try:
            prompt = torch.randint(3, 8192, (64,), generator=torch.Generator().manual_seed(7)).tolist()
            expected = api.generate(greedy(prompt, 8), timeout=60)
            keys = block_keys(prompt, 16, bytes.fromhex(api.model_info().fingerprint))

            def on_both() -> list:  # each node publishes its own copy, in its own time
                found = meta.lookup_prefix(keys)
                nodes = [{c.node_id for c in loc.copies()} for loc in found]
                return len(found) == 4 and all(n == set(members.pool) for n in nodes) and found

            found = wait_for(on_both, 10, "a copy of every block on each node")

            victim = next(c.proc for c in cluster.children if c.name == found[0].node_id)
            victim.kill()
            victim.wait(10)
            wait_for(lambda: len(meta.members("pool")) == 1, TTL_S + 3, "the dead node to leave")

            def totals(role, field):
                return sum(getattr(s, field) for s in members.stats(role).values())

            prefill_hits, pulled = totals("prefill", "pool_hit_tokens"), totals("decode", "pool_hit_tokens")
            for _ in range(2):  # both prefill and both decode workers (round robin)
                again = api.generate(greedy(prompt, 8), timeout=60)
                assert again.token_ids == expected.token_ids
            assert totals("prefill", "pool_hit_tokens") - prefill_hits >= 48  # the prefix, from the pool
            assert totals("decode", "pool_hit_tokens") - pulled >= 64  # the new decode worker: all of it
            assert totals("decode", "recomputed_tokens") == 0
        finally:
            members.close()
