"""Worker failover in a real cluster (2 prefill, 2 decode workers): a worker killed with SIGKILL while it
serves costs the client nothing. A prefill is sent again to the other prefill worker; a decode stream
resumes on the other decode worker with no token lost or repeated, equal to an uninterrupted run."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from cluster_helpers import ENGINE, greedy, make_cluster_config, metric, random_prompt, wait_for

from kvferry.deploy.config import WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client, build_request
from kvferry.rpc import channel
from kvferry.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

LONG = 900  # tokens of the stream that loses its decode worker: still running at the kill on a busy host


@pytest.fixture(scope="module")
def cluster(redis_server, tiny_model_dir, tmp_path_factory):
    cfg = make_cluster_config(
        tiny_model_dir,
        redis_server.url,
        "test-failover",
        prefill=WorkerGroupSettings(replicas=2, engine=ENGINE),
        decode=WorkerGroupSettings(replicas=2, engine=ENGINE),
    )
    with LocalCluster(cfg, log_dir=tmp_path_factory.mktemp("failover-logs"), quiet=True) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.router_addr) as c:
        yield c


def decoding(cluster, request_id: str) -> list[str]:
    """The decode workers that hold `request_id` (asked on kvferry channels: they carry the secret)."""
    members = MetadataStore(cluster.redis_url, cluster.cfg.namespace).members("decode") or {}
    holding = []
    for member_id, info in members.items():
        with channel(info["addr"]) as ch:
            stats = worker_pb2_grpc.DecodeWorkerStub(ch).GetStats(worker_pb2.WorkerStatsRequest(), timeout=10)
        if request_id in stats.active_request_ids:
            holding.append(member_id)
    return holding


def failovers(cluster, role: str) -> float:
    """kvferry:worker_failovers_total of `role`, summed over codes."""
    return metric(cluster, "kvferry:worker_failovers_total", role=role)


def kill(cluster, role: str, member_id: str) -> None:
    """SIGKILL the process of a worker (no drain, no goodbye: its connections just break)."""
    (child,) = [c for c in cluster.groups[role] if c.name == member_id]
    child.proc.kill()
    child.proc.wait(10)


def controlled(prompt, request_id: str = ""):
    """Greedy under every control that carries state across a resume: a repetition penalty (it counts
    the tokens made before), a structured output (its matcher is rebuilt by replaying them), min_tokens
    (EOS banned to the end), with logprobs."""
    request = build_request(
        prompt_token_ids=prompt,
        max_tokens=LONG,
        temperature=0.0,
        min_tokens=LONG,
        repetition_penalty=1.2,
        logprobs=1,
        request_id=request_id,
    )
    request.sampling.structured.regex = "[a-z ,.]*"
    return request


def test_decode_worker_killed_mid_stream_resumes_elsewhere(cluster, client):
    prompt = random_prompt(1, 37)  # 2 full blocks and a private tail: the resumed prompt reuses the pool's
    whole = list(client.stream(controlled(prompt), timeout=300))
    expected = [t for m in whole for t in m.token_ids]
    expected_logprobs = [lp.logprob for m in whole for lp in m.logprobs]
    assert len(expected) == LONG == len(expected_logprobs)
    assert re.fullmatch("[a-z ,.]*", "".join(m.text for m in whole))

    stream = client.stream(controlled(prompt, "resume-me"), timeout=300)
    tokens: list[int] = []
    logprobs: list[float] = []
    for msg in stream:
        tokens += msg.token_ids
        logprobs += [lp.logprob for lp in msg.logprobs]
        if len(tokens) >= 20:
            break
    serving = wait_for(lambda: decoding(cluster, "resume-me"), 10, "the decode worker serving the stream")
    kill(cluster, "decode", serving[0])
    finished = None
    for msg in stream:
        tokens += msg.token_ids
        logprobs += [lp.logprob for lp in msg.logprobs]
        if msg.HasField("finished"):
            finished = msg.finished
    assert finished is not None and finished.finish_reason == "length"
    assert finished.output_tokens == LONG
    assert tokens == expected, "the resumed stream differs from the uninterrupted one"
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert failovers(cluster, "decode") >= 1  # it did fail over (the kill came mid-stream)


def test_prefill_worker_killed_while_requests_arrive(cluster, client):
    prompts = [random_prompt(100 + i, 24 + 5 * i) for i in range(4)]
    expected = [client.generate(greedy(p, 8), timeout=120).token_ids for p in prompts]
    live = [c.name for c in cluster.groups["prefill"] if c.proc.poll() is None]
    assert len(live) == 2

    def one(i: int) -> list[int]:
        got = client.generate(greedy(prompts[i % 4], 8), timeout=120)
        assert got.finished.finish_reason == "length"
        return got.token_ids

    with ThreadPoolExecutor(4) as pool:
        first = [pool.submit(one, i) for i in range(8)]
        kill(cluster, "prefill", live[0])  # while those are in flight or queued
        later = [pool.submit(one, i) for i in range(8, 24)]
        results = [f.result() for f in first + later]  # every request finishes, none fails
    assert results == [expected[i % 4] for i in range(24)]
    assert failovers(cluster, "prefill") >= 1


def test_still_serving_with_one_worker_of_each_role(cluster, client):
    got = client.generate(greedy(random_prompt(9, 10), 5), timeout=120)
    assert got.finished.output_tokens == 5
