"""KV-aware prefill routing in a real cluster (redis, a pool node, 2 prefill workers, a decode worker, the
router as processes): a prompt sharing a long prefix with an earlier one goes to the prefill worker that
computed it and hits that worker's own cache, as predicted; when that worker falls behind (stopped with
SIGSTOP, so its calls pile up), a burst sharing the prefix spreads to the other one. Greedy output
equals transformers' throughout. (conftest's shared `cluster`: its other users' prompts share no prefix
with these, and the counts here are differences.)"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import greedy, metric, random_prompt, wait_for

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
