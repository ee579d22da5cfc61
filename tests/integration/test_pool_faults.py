"""Pool nodes that hang (SIGSTOP) or die (kill -9): waits are bounded by the transfer timeout, the dead
node's blocks stop being prefix hits within a heartbeat TTL, and requests still complete correctly."""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
import time

import pytest
import torch
from cluster_helpers import ENGINE, Members, greedy, make_cluster_config, wait_for

from kvferry.deploy.config import PoolConfig, RestartSettings, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.engine.block_hash import block_keys
from kvferry.kvpool.client import PoolClient, PoolError, wait_for_nodes
from kvferry.kvpool.metadata import MetadataStore
from kvferry.kvpool.transfer import BlockLayout
from kvferry.proc import dying_with_parent
from kvferry.router.client import Client

pytestmark = pytest.mark.slow

LAYOUT = BlockLayout(2, 4, 16, 8, "float32")
TIMEOUT_S = 2.0  # the transfer timeout of the node and the clients here
TTL_S = PoolConfig.ttl_s


def start_node(redis_url: str, namespace: str, log_path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvferry.kvpool", "--node-id", "n0", "--redis-url", redis_url]
    argv += ["--namespace", namespace, "--layout", ",".join(map(str, LAYOUT.to_list()))]
    argv += ["--num-slots", "16", "--transfer-timeout-s", str(TIMEOUT_S), *extra]
    with open(log_path, "wb") as log:  # SIGKILL with the test process: a stopped node must not outlive it
        return subprocess.Popen(dying_with_parent(argv, signal.SIGKILL), stdout=log, stderr=subprocess.STDOUT)


def client(redis_url: str, namespace: str, name: str, shm: bool = True) -> PoolClient:
    meta = MetadataStore(redis_url, namespace)
    return PoolClient(meta, LAYOUT, peer_id=name, transfer_timeout_s=TIMEOUT_S, shm=shm)


def timed(fn):
    start = time.monotonic()
    try:
        fn()
    except PoolError as err:
        return time.monotonic() - start, err
    return time.monotonic() - start, None


@pytest.mark.parametrize("transport", ["pair", "shm"])
def test_hung_then_dead_node_bounds_every_wait(redis_server, tmp_path, transport):
    """Through the pair group every wait on a hung or dead node is bounded. Through the shared slab a
    get needs no node at all (the slab still holds its blocks: bit-exact), puts are bounded, and once
    the dead node left the registry the client unmaps its slab and gets fail like the pair group's."""
    shm = transport == "shm"
    namespace = f"faults-{transport}"
    proc = start_node(redis_server.url, namespace, tmp_path / "pool.log")
    connected = client(redis_server.url, namespace, "connected", shm)  # talked to the node before it hangs
    fresh = client(redis_server.url, namespace, "fresh", shm)  # only after
    try:
        assert wait_for_nodes(connected, 1, 60), "the pool node did not register"
        data = torch.randn(3, *LAYOUT.shape)
        keys = [bytes([7, i]) * 8 for i in range(3)]
        locations = connected.put("w", keys, data)
        assert torch.equal(connected.get("r", locations), data)
        assert (connected.nodes["n0"].shm is not None) == shm
        wait_for(lambda: len(connected.lookup_prefix(keys)) == 3, 10, "publishing")

        proc.send_signal(signal.SIGSTOP)  # hangs: connections are accepted, nothing answers
        for who in (connected, fresh):
            if shm:
                assert torch.equal(who.get("r", locations), data)
            else:
                elapsed, err = timed(lambda c=who: c.get("r", locations))
                assert err is not None and elapsed < TIMEOUT_S + 3, (who.peer_id, elapsed, err)
        elapsed, err = timed(lambda: connected.put("w2", [b"x" * 16], data[:1]))
        assert err is not None and elapsed < TIMEOUT_S + 3, (elapsed, err)

        proc.kill()  # kill -9
        proc.wait(10)
        elapsed, err = timed(lambda: fresh.put("w3", [b"y" * 16], data[:1]))
        assert err is not None and elapsed < TIMEOUT_S + 3, (elapsed, err)
        # within a heartbeat TTL (+ the lookup's live-set cache) its entries are misses, then deleted
        meta = connected.meta
        wait_for(lambda: connected.lookup_prefix(keys) == [], TTL_S + 3, "the dead node's entries to go")
        assert meta.client.get(meta._bkey(keys[0])) is None
        for who in (connected, fresh):
            who.refresh()  # the node left the registry: its slab is unmapped
            assert who.nodes["n0"].shm is None
            elapsed, err = timed(lambda c=who: c.get("r", locations))
            assert err is not None and elapsed < TIMEOUT_S + 3, (who.peer_id, elapsed, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        connected.close()
        fresh.close()


def test_a_node_back_after_its_record_lapsed_publishes_again(redis_server, tmp_path):
    """A node that hung past its TTL loses its entries to readers; when it beats again it republishes."""
    proc = start_node(redis_server.url, "lapse", tmp_path / "pool.log")
    pool = client(redis_server.url, "lapse", "lapse")
    try:
        assert wait_for_nodes(pool, 1, 60), "the pool node did not register"
        keys = [bytes([9, i]) * 8 for i in range(2)]
        pool.put("w", keys, torch.randn(2, *LAYOUT.shape))
        wait_for(lambda: len(pool.lookup_prefix(keys)) == 2, 10, "publishing")
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: pool.lookup_prefix(keys) == [], TTL_S + 3, "the lapsed node's entries to go")
        assert pool.meta.client.get(pool.meta._bkey(keys[0])) is None
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: len(pool.lookup_prefix(keys)) == 2, 10, "the entries to be republished")
    finally:
        proc.kill()
        proc.wait(10)
        pool.close()


@pytest.mark.parametrize("transport", ["pair", "shm"])
def test_a_whole_tp_put_is_answered_while_others_wait_for_slices_that_never_come(
    redis_server, tmp_path, transport
):
    """Twenty puts of half a block's KV heads whose other halves never come wait out the assemble
    timeout; a block whose two halves both come meanwhile is answered at once, not behind them (no
    thread waits per put)."""
    ns = f"stuck-{transport}"
    proc = start_node(redis_server.url, ns, tmp_path / "pool.log", "--num-slots", "64")
    ranks = [client(redis_server.url, ns, f"rank{r}", transport == "shm") for r in range(2)]
    try:
        assert wait_for_nodes(ranks[0], 1, 60), "the pool node did not register"
        data = torch.randn(1, *LAYOUT.shape)
        half = LAYOUT.num_kv_heads // 2
        stuck = [
            ranks[0].put_async("stuck", [bytes([11, i]) * 8], data[:, :, :, :half].clone(), (), "n0", 0, half)
            for i in range(20)
        ]
        start = time.monotonic()
        whole = [
            ranks[r].put_async("whole", [b"w" * 16], data[:, :, :, hb:he].clone(), (), "n0", hb, he)
            for r, (hb, he) in enumerate([(0, half), (half, LAYOUT.num_kv_heads)])
        ]
        found = [f.result(timeout=10) for f in whole]
        assert time.monotonic() - start < 5, f"answered after {time.monotonic() - start:.1f}s"
        assert found[0] == found[1] and found[0][0] is not None
        assert torch.equal(ranks[0].get("r", found[0]), data)
        assert not any(f.done() for f in stuck)  # still waiting for their other halves
    finally:
        proc.kill()
        proc.wait(10)
        for c in ranks:
            c.close()


def test_cluster_survives_a_pool_node_that_hangs_then_dies(redis_server, tiny_model_dir, tmp_path):
    """Two pool nodes, two decode workers: the node holding a prompt's blocks hangs, a decode worker
    that never saw the prompt pulls from it (through the shared slab, on this host: served without
    the node; the pair-group path's bounded wait is `test_hung_then_dead_node_bounds_every_wait`), the
    node is killed, and after a TTL its blocks are misses and requests are served by the other node."""
    cfg = make_cluster_config(
        tiny_model_dir,
        redis_server.url,
        "test-pool-faults",
        pool=PoolConfig(nodes=2, memory_gib=0.1),
        decode=WorkerGroupSettings(replicas=2, engine=ENGINE),
        # the killed node stays down: restarted under its id it would be live again at once, and its
        # old entries would stay until a read found them stale (test_launcher_restarts covers that)
        restarts=RestartSettings(max=0),
    )
    transfer_timeout = inspect.signature(PoolClient).parameters["transfer_timeout_s"].default  # workers'
    with LocalCluster(cfg, log_dir=tmp_path, quiet=True) as cluster, Client(cluster.router_addr) as api:
        meta = MetadataStore(cluster.redis_url, cfg.namespace)
        members = Members(cluster)

        def decode_totals() -> tuple[int, int]:  # (prompt tokens pulled from the pool, recomputed)
            stats = members.stats("decode").values()
            return sum(s.pool_hit_tokens for s in stats), sum(s.recomputed_tokens for s in stats)

        prompt = torch.randint(3, 8192, (48,), generator=torch.Generator().manual_seed(5)).tolist()
        expected = api.generate(greedy(prompt, 8), timeout=60)  # decode worker A pulls the 3 blocks
        assert decode_totals() == (48, 0)
        keys = block_keys(prompt, 16, bytes.fromhex(api.model_info().fingerprint))
        (holder,) = {loc.node_id for loc in wait_for(lambda: meta.lookup_prefix(keys), 10, "publishing")}
        node = next(c.proc for c in cluster.children if c.name == holder)

        try:
            node.send_signal(signal.SIGSTOP)
            # the next request goes to decode worker B (round robin), which must pull from the hung node
            start = time.monotonic()
            hung = api.generate(greedy(prompt, 8), timeout=120)
            elapsed = time.monotonic() - start
            assert hung.token_ids == expected.token_ids
            # B is on the node's host: it reads the blocks from the node's shared slab, which needs no
            # answer from the node (the slab still holds them, checked by generation): no recompute
            assert decode_totals() == (96, 0)
            assert elapsed < transfer_timeout + 5, f"{elapsed:.1f}s with a hung pool node"
        finally:
            node.kill()  # kill -9 (also when the test failed while the node was stopped)
        node.wait(10)
        wait_for(lambda: meta.lookup_prefix(keys) == [], TTL_S + 3, "the dead node's entries to go")
        fresh = api.generate(greedy(prompt, 8), timeout=60)  # served; its blocks written to the live node
        assert fresh.token_ids == expected.token_ids
        hits = wait_for(lambda: meta.lookup_prefix(keys), 10, "the blocks on the live node")
        assert len(hits) == 3 and {loc.node_id for loc in hits} != {holder}
        members.close()
