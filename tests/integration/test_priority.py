"""Request priorities end to end (vLLM's `priority`: lower first) on a real disaggregated cluster: a
higher-priority request preempts a running lower-priority stream in a decode worker that seats one
stream at a time, finishes first, and both outputs stay exact; the OpenAI field is validated."""

from __future__ import annotations

import json
import threading

import pytest
from cluster_helpers import ENGINE, greedy, metric, post, random_prompt, wait_for

from kvferry.deploy.config import WorkerGroupSettings
from kvferry.router.client import Client

# a shared cluster of conftest's (this module is its only user): a decode worker that seats one stream
pytestmark = [
    pytest.mark.slow,
    pytest.mark.shared_cluster(decode=WorkerGroupSettings(replicas=1, engine={**ENGINE, "max_num_seqs": 1})),
]

LONG = 1000  # tokens of the low-priority stream: ~0.6 s of decode, so the urgent request lands inside it


def test_a_higher_priority_request_preempts_and_finishes_first_with_exact_outputs(
    cluster, tiny_model_dir, hf_greedy
):
    low_ids, urgent_ids = random_prompt(70, 20), random_prompt(71, 24)
    (want_low,) = hf_greedy(tiny_model_dir, [low_ids], LONG)
    (want_urgent,) = hf_greedy(tiny_model_dir, [urgent_ids], 8)
    order: list[str] = []
    preempted = metric(cluster, "kvferry:num_preemptions_total", reason="priority")
    with Client(cluster.router_addr) as client:
        low = greedy(low_ids, LONG, request_id="prio-low")
        low.priority = 5
        stream = client.stream(low, timeout=120)
        first = next(stream)  # decoding in the one seat
        got_low = list(first.token_ids)

        def drain():
            for message in stream:
                got_low.extend(message.token_ids)
            order.append("low")

        reader = threading.Thread(target=drain)
        reader.start()
        code, reply = post(
            cluster.http_url + "/v1/completions",
            {
                "prompt": urgent_ids,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "priority": -1,
            },
        )
        order.append("urgent")
        reader.join(120)
    assert code == 200, reply
    assert reply["choices"][0]["token_ids"] == want_urgent
    assert order == ["urgent", "low"], "the urgent request waited for the low-priority stream"
    assert got_low == want_low  # preempted, recomputed, and still exact
    wait_for(
        lambda: metric(cluster, "kvferry:num_preemptions_total", reason="priority") >= preempted + 1,
        30,
        "/metrics to count the priority preemption",
    )


def test_priority_must_be_a_32_bit_integer(cluster):
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    for bad in ("urgent", 2**40, None):
        code, reply = post(cluster.http_url + "/v1/completions", {**body, "priority": bad})
        assert code == 400 and "priority" in json.dumps(reply["error"]), reply
    code, _ = post(
        cluster.http_url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 3},
    )
    assert code == 200
