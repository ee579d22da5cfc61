"""The planner on a real cluster (`kvferry up --autoscale`'s LocalCluster): a synthetic load makes it add
a prefill group through the scale path, the load's end makes it drain that group again, each decision
counted in the router's /metrics, and every request served during both scales has the offline engine's
greedy tokens (nothing lost or wrong while groups come and go)."""

from __future__ import annotations

import threading

import pytest
from cluster_helpers import greedy, make_cluster_config, metric, random_prompt, wait_for
from test_cluster import offline

from kvferry.deploy.local import LocalCluster
from kvferry.deploy.planner import AutoscaleSettings
from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.router.client import Client

pytestmark = pytest.mark.slow

DECISIONS = "kvferry:planner_decisions_total"
PROMPTS = [random_prompt(300 + i, 200) for i in range(4)]


def test_the_planner_scales_prefill_up_under_load_and_back_down(redis_server, tiny_model_dir, tmp_path):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=1024, num_kv_blocks=512)
    )
    # utilization 0.02: the tiny model's few-ms prefills at a few requests a second need a second group
    auto = AutoscaleSettings(
        enabled=True, prefill=(1, 2), decode=(1, 1), interval_s=0.5, cooldown_s=2.0, utilization=0.02
    )
    cfg = make_cluster_config(tiny_model_dir, redis_server.url, "test-autoscale", autoscale=auto)
    want = [offline(engine, ids, 8) for ids in PROMPTS]
    results, errors, stop = [], [], threading.Event()

    def load() -> None:
        with Client(cluster.router_addr) as client:
            i = 0
            while not stop.is_set():
                try:
                    got = client.generate(greedy(PROMPTS[i % 4], max_tokens=8), timeout=60)
                    results.append((i % 4, list(got.token_ids)))
                except Exception as err:  # every failure is reported by the assert below
                    errors.append(repr(err))
                i += 1
                stop.wait(0.1)  # pacing the load (and ending it at once)

    with LocalCluster(cfg, log_dir=tmp_path / "logs", quiet=True) as cluster:
        assert cluster.counts() == (1, 1)
        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            wait_for(
                lambda: cluster.counts() == (2, 1), timeout=120, what="the planner to add a prefill group"
            )
            wait_for(
                lambda: (
                    metric(cluster, "kvferry:planner_decisions_total", role="prefill", direction="up") >= 1
                ),
                timeout=20,
                what="/metrics to count the scale-up",
            )
            served_before = len(results)
            wait_for(lambda: len(results) > served_before + 10, timeout=60, what="requests on two groups")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        # no load: the routers' window empties, the need falls to 0, and the second group drains
        wait_for(lambda: cluster.counts() == (1, 1), timeout=120, what="the planner to drain a group")
        wait_for(
            lambda: metric(cluster, DECISIONS, role="prefill", direction="down") >= 1,
            timeout=20,
            what="/metrics to count the scale-down",
        )
        assert metric(cluster, "kvferry:planner_groups", role="prefill") == 1
        events = "\n".join(cluster.events)
        assert "planner: prefill 1 -> 2" in events and "planner: prefill 2 -> 1" in events
        with Client(cluster.router_addr) as client:  # the one group left serves on
            assert list(client.generate(greedy(PROMPTS[0], max_tokens=8), timeout=60).token_ids) == want[0]
    assert not errors, errors[:3]
    assert len(results) > 20
    assert all(tokens == want[i] for i, tokens in results)
