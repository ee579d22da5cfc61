"""KV-aware prefill routing in a real cluster (redis, a pool node, 2 prefill workers, a decode worker, the
router as processes): a prompt sharing a long prefix with an earlier one goes to the prefill worker that
computed it and hits that worker's own cache, as predicted; when that worker falls behind (stopped with
SIGSTOP, so its calls pile up), a burst sharing the prefix spreads to the other one. Greedy output
equals transformers' throughout. The routers learn the workers' caches from their KV events: a prefix a
worker computed without any router (a Prefill call straight to it) draws the prompts sharing it there,
and a second router started late routes every prompt where the first one does. (conftest's shared
`cluster`: its other users' prompts share no prefix with these, and the counts here are differences.)"""

from __future__ import annotations

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import greedy, metric, random_prompt, wait_for

from kvferry.auth import SECRET_ENV
from kvferry.deploy.local import redis_env, router_argv
from kvferry.engine.block_hash import block_keys
from kvferry.kvpool.kv_events import STORED, KVEvent, stream_key
from kvferry.kvpool.metadata import MetadataStore
from kvferry.proc import free_port, terminate
from kvferry.router.client import Client
from kvferry.router.prefix_routing import tie_rank
from kvferry.v1 import generate_pb2, worker_pb2

pytestmark = [pytest.mark.slow, pytest.mark.shared_cluster()]

PREFIX = 512  # 32 blocks, shared by every prompt
NEW_TOKENS = 8
BURST = 7


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    shared = random_prompt(1007, PREFIX)  # a seed no other user of the shared cluster prompts with
    return [shared + random_prompt(100 + i, 20) for i in range(3 + BURST)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts, hf_greedy) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)


def served(members) -> dict[str, int]:
    """Prefills each prefill worker has run."""
    return {k: s.requests for k, s in members.stats("prefill").items()}


def run_one(client, members, ids) -> tuple[str, object]:
    """Serve one prompt alone; (the prefill worker that ran it, the result)."""
    before = served(members)
    got = client.generate(greedy(ids, NEW_TOKENS), timeout=120)
    after = served(members)
    (worker,) = [k for k in after if after[k] != before[k]]
    return worker, got


def test_a_shared_prefix_returns_to_its_worker_and_hits_its_cache(
    cluster, client, members, prompts, reference
):
    holder, first = run_one(client, members, prompts[0])
    assert first.finished.cached_tokens == 0 and first.token_ids == reference[0]
    decided = metric(cluster, "kvferry:routing_decisions_total", reason="prefix")
    predicted = metric(cluster, "kvferry:routing_predicted_hit_tokens_sum", source="local")
    actual = metric(cluster, "kvferry:routing_actual_hit_tokens_sum", source="local")

    worker, second = run_one(client, members, prompts[1])
    assert worker == holder  # not the idle other worker, which would pull the prefix from the pool
    assert (second.finished.cached_tokens, second.finished.pool_cached_tokens) == (PREFIX, 0)
    assert second.token_ids == reference[1]
    assert metric(cluster, "kvferry:routing_decisions_total", reason="prefix") == decided + 1
    assert metric(cluster, "kvferry:routing_predicted_hit_tokens_sum", source="local") == predicted + PREFIX
    assert metric(cluster, "kvferry:routing_actual_hit_tokens_sum", source="local") == actual + PREFIX


def test_a_burst_spreads_when_the_holder_falls_behind(cluster, client, members, prompts, reference):
    holder, got = run_one(client, members, prompts[2])
    assert got.finished.cached_tokens >= PREFIX and got.token_ids == reference[2]
    (proc,) = [c.proc for c in cluster.groups["prefill"] if c.name == holder]
    before = served(members)
    decisions = metric(cluster, "kvferry:routing_decisions_total")
    by_load = metric(cluster, "kvferry:routing_decisions_total", reason="load")
    burst = prompts[3:]
    with ThreadPoolExecutor(BURST) as pool:
        os.kill(proc.pid, signal.SIGSTOP)  # its calls queue unanswered: its in-flight count grows
        try:
            futures = [pool.submit(client.generate, greedy(ids, NEW_TOKENS), 120) for ids in burst]
            wait_for(
                lambda: metric(cluster, "kvferry:routing_decisions_total") >= decisions + BURST,
                20,
                "the router to place the whole burst",
            )
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        results = [f.result() for f in futures]
    assert [r.token_ids for r in results] == reference[3:]
    after = served(members)
    spread = {k: after[k] - before[k] for k in after}
    assert sum(spread.values()) == BURST
    assert all(n >= 1 for n in spread.values()), spread  # the holder took some, then the other did
    assert metric(cluster, "kvferry:routing_decisions_total", reason="load") > by_load


def published(meta: MetadataStore, worker: str, key: bytes) -> bool:
    """Whether `worker` has published a KV event storing `key`."""
    for _, fields in meta.client.xrange(stream_key(meta.prefix)):
        event = KVEvent.parse(fields)
        if event is not None and event.worker == worker and event.kind == STORED and key in event.keys:
            return True
    return False


def plant(members, meta, worker: str, ids: list[int], keys: list[bytes]) -> None:
    """Prefill `ids` on `worker` itself, no router involved; wait until its KV events say so."""
    sampling = generate_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = worker_pb2.PrefillRequest(
        request_id=f"planted-{worker}", prompt_token_ids=ids, sampling=sampling
    )
    members.prefill[worker].Prefill(request, timeout=120)
    wait_for(lambda: published(meta, worker, keys[-1]), 20, f"{worker}'s KV events")


def start_router(cluster, log_path) -> tuple[subprocess.Popen, str]:
    """Another router process on the cluster's registry (gRPC on a free port, no HTTP)."""
    port = free_port()
    argv = router_argv(cluster.cfg, str(cluster.model_dir), "127.0.0.1", port, None)
    env = {**os.environ, SECRET_ENV: cluster.secret, **redis_env(cluster.redis_url)}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, f"127.0.0.1:{port}"


def test_routers_follow_the_workers_kv_events_and_a_late_one_routes_alike(cluster, client, members, tmp_path):
    meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
    info = client.model_info(timeout=30)
    fingerprint, bs = bytes.fromhex(info.fingerprint), info.block_size
    groups = {w: r.get("group") or w for w, r in meta.members("prefill").items()}
    assert len(groups) == 2

    def tie_winner(ids: list[int]) -> str:
        first = block_keys(ids[:bs], bs, fingerprint)[0]
        return min(groups, key=lambda w: tie_rank(first, groups[w]))

    # a prefix on each worker that the tie-break alone would send to the other one
    planted = {}
    candidates = (random_prompt(seed, PREFIX) for seed in range(3000, 3100))
    for worker in sorted(groups):
        ids = next(p for p in candidates if tie_winner(p) != worker)
        plant(members, meta, worker, ids, block_keys(ids, bs, fingerprint))
        planted[worker] = ids
    prompts = [ids + random_prompt(3200 + i, 20) for i, ids in enumerate(planted.values())]
    families = [random_prompt(3300 + f, PREFIX // 2) for f in range(2)]
    prompts += [
        family + random_prompt(3400 + 10 * f + i, 20) for f, family in enumerate(families) for i in range(2)
    ]

    placed = []
    for ids in prompts:  # the cluster's router, running since before the plants
        worker, got = run_one(client, members, ids)
        placed.append(worker)
        if len(placed) <= len(planted):  # sent where the prefix was planted, and found there
            assert (got.finished.cached_tokens, got.finished.pool_cached_tokens) == (PREFIX, 0)
    assert placed[: len(planted)] == list(planted), "the planted prefixes did not draw their prompts"

    proc, addr = start_router(cluster, tmp_path / "late-router.log")
    try:

        def late_ready() -> bool:
            assert proc.poll() is None, (tmp_path / "late-router.log").read_text()[-3000:]
            log = (tmp_path / "late-router.log").read_text()
            if "following the prefix caches of 2 prefill workers" not in log:
                return False
            try:
                with Client(addr) as c:
                    return c.model_info(timeout=5).num_prefill_workers == 2
            except grpc.RpcError:
                return False  # not serving yet

        wait_for(late_ready, 90, "the late router to follow both prefill workers")
        with Client(addr) as late:
            for ids, first in zip(prompts, placed, strict=True):
                worker, got = run_one(late, members, ids)
                assert worker == first
                assert got.finished.cached_tokens >= len(ids) // bs * bs - bs
                assert got.finished.pool_cached_tokens == 0  # all of it from that worker's own cache
    finally:
        terminate([proc], 10)
        meta.client.close()
