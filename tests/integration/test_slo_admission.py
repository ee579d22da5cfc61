"""SLO-aware admission on a real cluster: once the workers have fitted their step costs, a request whose
predicted TTFT or TPOT misses its target is refused before any prefill (RESOURCE_EXHAUSTED with a
retry-after trailer on gRPC, 429 with Retry-After on HTTP), one that can make it is served exactly, and
/metrics counts both the misses and the predictions against what happened; every prefill worker
publishes its backlog, which the TTFT prediction reads (kvferry.worker.backlog). (conftest's shared
`cluster`: two prefill workers, one decode worker, the router's default predictive admission; its other
users' requests are counted too, so the counts here are differences.)"""

from __future__ import annotations

import json

import grpc
import pytest
from cluster_helpers import greedy, metric, post, random_prompt, wait_for

from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.backlog import PublishedBacklog
from kvferry.router.client import Client
from kvferry.v1 import generate_pb2

pytestmark = [pytest.mark.slow, pytest.mark.shared_cluster()]


def with_slo(request: generate_pb2.GenerateRequest, **targets) -> generate_pb2.GenerateRequest:
    request.slo.CopyFrom(generate_pb2.Slo(**targets))
    return request


def counts(cluster) -> tuple[float, float, float]:
    """(TTFT misses refused, TPOT misses refused, requests whose TTFT prediction was checked)."""
    misses = "kvferry:admission_predicted_misses_total"
    return (
        metric(cluster, misses, reason="ttft", action="reject"),
        metric(cluster, misses, reason="tpot", action="reject"),
        metric(cluster, "kvferry:ttft_prediction_ratio_count"),
    )


def test_a_doomed_request_is_refused_before_any_prefill(cluster, members, tiny_model_dir, hf_greedy):
    ids = random_prompt(90, 40)
    ttft_before, tpot_before, checked_before = counts(cluster)
    with Client(cluster.router_addr) as client:

        def predicted() -> bool:  # served with a loose target; the predictions it was admitted with
            reply = client.generate(with_slo(greedy(ids, 4), ttft_ms=60_000, tpot_ms=60_000), timeout=60)
            timings = reply.finished.timings
            return timings.predicted_ttft_ms > 0 and timings.predicted_tpot_ms > 0

        # the prefill and decode workers fit their step costs after a few steps each and publish them with
        # their heartbeats: until both have, one of the predictions below is not made
        wait_for(predicted, 60, "TTFT and TPOT predictions (fitted step costs in the heartbeats)")
        (want,) = hf_greedy(tiny_model_dir, [ids], 4)
        assert client.generate(with_slo(greedy(ids, 4), ttft_ms=60_000), timeout=60).token_ids == want

        before = sum(s.requests for s in members.stats("prefill").values())
        with pytest.raises(grpc.RpcError) as err:
            client.generate(with_slo(greedy(random_prompt(91, 200), 4), ttft_ms=0.01), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "predicted TTFT" in err.value.details() and "target of 0 ms" in err.value.details()
        trailer = dict(err.value.trailing_metadata())
        assert float(trailer["retry-after-ms"]) >= 1000
        with pytest.raises(grpc.RpcError) as err:
            client.generate(with_slo(greedy(ids, 4), tpot_ms=0.001), timeout=60)
        assert (
            err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "predicted TPOT" in err.value.details()
        )
        with pytest.raises(grpc.RpcError) as err:
            client.generate(with_slo(greedy(ids, 4), ttft_ms=-5), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "slo.ttft_ms" in err.value.details()
        assert sum(s.requests for s in members.stats("prefill").values()) == before  # no prefill ran

    body = {"prompt": ids, "max_tokens": 2, "temperature": 0}
    code, headers, reply = post(
        cluster.http_url + "/v1/completions", {**body, "slo": {"ttft_ms": 0.01}}, with_headers=True
    )
    assert code == 429 and int(headers["retry-after"]) >= 1 and "predicted TTFT" in reply["error"]["message"]
    code, reply = post(cluster.http_url + "/v1/completions", {**body, "slo": {"ttft_ms": -1}})
    assert code == 400 and "slo" in json.dumps(reply["error"]), reply
    code, reply = post(cluster.http_url + "/v1/completions", {**body, "slo": {"ttft_ms": 60_000}})
    assert code == 200 and reply["choices"][0]["timings"]["predicted_ttft_ms"] > 0

    ttft, tpot, checked = counts(cluster)
    assert ttft - ttft_before >= 2
    assert tpot - tpot_before >= 1
    assert checked - checked_before >= 3


def test_every_prefill_worker_publishes_its_backlog(cluster, members):
    """What the routers' TTFT prediction reads (kvferry.worker.backlog): a record per prefill worker in
    the fast hash, written again while idle (the keepalive), and the same record in its heartbeat."""
    meta = MetadataStore(cluster.redis_url, cluster.cfg.namespace)
    workers = set(members.prefill)

    def records() -> dict[str, PublishedBacklog] | None:
        raw = meta.client.hgetall(f"{meta.prefix}prefill_backlog")
        found = {k.decode(): PublishedBacklog.parse(json.loads(v)) for k, v in raw.items()}
        return found if workers <= set(found) else None

    first = wait_for(records, 30, "a backlog record of every prefill worker")

    def newer() -> bool:
        now = records()
        return now is not None and all(now[w].seq > first[w].seq for w in workers)

    wait_for(newer, 10, "newer backlog records")
    beats = meta.members("prefill")
    for w in workers:
        assert PublishedBacklog.parse(beats[w]["prefill_backlog"]).boot == first[w].boot
