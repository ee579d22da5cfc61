"""The disaggregated path end to end: real processes, real gRPC, real Redis, real gloo transfers. (conftest's
shared `cluster`: two prefill workers, one decode worker, one pool node; the other modules declaring it
send their own requests to it, so counts here are differences.)"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import (
    ENGINE,
    assert_released,
    greedy,
    make_cluster_config,
    metric,
    random_prompt,
    wait_for,
)

from kvferry.convert import sampling_to_proto
from kvferry.deploy.config import WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.engine.block_hash import block_keys
from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.engine.request import SamplingParams
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client, build_request
from kvferry.v1 import pool_pb2, worker_pb2

pytestmark = [pytest.mark.slow, pytest.mark.shared_cluster()]

NEW_TOKENS = 16
BLOCK = 16


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def offline(engine: LLMEngine, prompt_ids: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    for out in engine.stream(params=params, prompt_token_ids=prompt_ids):
        tokens += out.new_token_ids
    return tokens


def test_greedy_matches_engine_and_transformers(client, engine, tiny_model_dir, hf_greedy):
    prompts = [random_prompt(s, n) for s, n in enumerate((5, 16, 17, 31, 32, 48, 70, 9))]
    for ids, ref in zip(prompts, hf_greedy(tiny_model_dir, prompts, NEW_TOKENS), strict=True):
        got = client.generate(greedy(ids), timeout=60)
        assert got.finished.finish_reason == "length"
        assert got.finished.output_tokens == NEW_TOKENS
        assert got.token_ids == ref, f"cluster != transformers for a {len(ids)}-token prompt"
        assert offline(engine, ids) == ref, f"engine != transformers for a {len(ids)}-token prompt"


def test_text_prompt_streams_text(client, engine):
    got = client.generate(build_request("def fibonacci(n):", max_tokens=12, temperature=0.0), timeout=60)
    ref = engine.generate([{"prompt": "def fibonacci(n):"}], SamplingParams(max_tokens=12, temperature=0.0))[
        0
    ]
    assert got.token_ids == ref.output_token_ids
    assert got.text == ref.text
    assert got.messages >= 2  # the first token arrives on its own, from the prefill worker
    t = got.finished.timings
    assert t.ttft_ms > 0 and t.prefill_ms > 0 and t.e2e_ms >= t.ttft_ms


def test_sixteen_concurrent_streams(client, members):
    lengths = [8 + 3 * i for i in range(16)]

    def one(i):
        return client.generate(greedy(random_prompt(100 + i, 10 + 7 * i), max_tokens=lengths[i]), timeout=120)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, r in enumerate(results):
        assert r.finished.finish_reason == "length"
        assert r.finished.output_tokens == lengths[i] == len(r.token_ids)
    assert len({r.request_id for r in results}) == 16
    assert_released(members, [r.request_id for r in results])


def test_shared_prefix_hits_its_worker_or_comes_from_the_pool(client, members, engine):
    shared = random_prompt(7, 3 * BLOCK)
    first = shared + random_prompt(8, 10)
    second = shared + random_prompt(9, 13)
    client.generate(greedy(first), timeout=60)

    def counts():
        return {
            k: (s.local_hit_tokens, s.pool_hit_tokens, s.prompt_tokens_computed)
            for k, s in members.stats("prefill").items()
        }

    before = counts()
    got = client.generate(greedy(second), timeout=60)
    after = counts()
    delta = {k: tuple(a - b for a, b in zip(after[k], before[k], strict=True)) for k in after}
    # KV-aware routing (router.prefix_routing) sends it where the first one ran: its cache holds the prefix
    assert sorted(delta.values()) == [(0, 0, 0), (3 * BLOCK, 0, len(second) - 3 * BLOCK)], delta
    assert (got.finished.cached_tokens, got.finished.pool_cached_tokens) == (3 * BLOCK, 0)
    assert got.token_ids == offline(engine, second)
    # the other worker, asked directly, has never seen the prefix: it pulls it from the pool
    (other,) = [k for k, d in delta.items() if d == (0, 0, 0)]
    sampling = sampling_to_proto(SamplingParams(max_tokens=1, temperature=0.0))
    third = shared + random_prompt(10, 5)
    reply = members.prefill[other].Prefill(
        worker_pb2.PrefillRequest(request_id="pull-me", prompt_token_ids=third, sampling=sampling), timeout=60
    )
    assert (reply.cached_tokens, reply.pool_cached_tokens) == (3 * BLOCK, 3 * BLOCK)
    assert reply.first_token_id == offline(engine, third, max_tokens=1)[0]
    for pool in members.pool.values():  # drop its private tail block, as the router would
        pool.Release(pool_pb2.ReleaseRequest(request_id="pull-me"), timeout=10)
    assert_released(members, ["pull-me"])


def test_one_pool_lookup_per_request(client, members, cluster, engine):
    """The router hashes a prompt's blocks and looks them up in the pool once; the prefill worker
    uses both (no lookup of its own, none on its engine thread), and so does the decode worker. A
    direct Prefill call, which brings no lookup, gets one of its own."""
    lookups = lambda: sum(s.pool_lookups for s in members.stats("prefill").values())  # noqa: E731
    router_before, workers_before = metric(cluster, "kvferry:pool_lookups_total"), lookups()
    prompts = [random_prompt(700 + i, 20 + 23 * i) for i in range(6)]
    for ids in prompts:
        got = client.generate(greedy(ids), timeout=60)
        assert got.token_ids == offline(engine, ids)
    assert metric(cluster, "kvferry:pool_lookups_total") - router_before == len(prompts)
    assert lookups() == workers_before
    sampling = sampling_to_proto(SamplingParams(max_tokens=1, temperature=0.0))
    worker = next(iter(members.prefill.values()))
    request = worker_pb2.PrefillRequest(request_id="direct", prompt_token_ids=prompts[-1], sampling=sampling)
    reply = worker.Prefill(request, timeout=60)
    assert reply.first_token_id == offline(engine, prompts[-1], max_tokens=1)[0]
    assert lookups() == workers_before + 1
    for pool in members.pool.values():
        pool.Release(pool_pb2.ReleaseRequest(request_id="direct"), timeout=10)
    assert_released(members, ["direct"])


def test_abort_and_cancel_release_everything(client, members):
    # Abort RPC mid-stream
    stream = client.stream(greedy(random_prompt(20, 40), max_tokens=900, request_id="abort-me"), timeout=120)
    first = next(stream)
    assert first.request_id == "abort-me"
    next(stream)
    client.abort("abort-me")
    rest = list(stream)
    assert rest and rest[-1].finished.finish_reason == "abort"
    assert rest[-1].finished.output_tokens < 900
    # client cancel mid-stream
    call = client.stream(greedy(random_prompt(21, 40), max_tokens=900, request_id="cancel-me"), timeout=120)
    next(call)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    # deadline expiry: 900 tokens take ~0.5 s here (decode steps of the tiny model are ~0.2 ms), so a
    # 0.2 s deadline expires mid-generation
    with pytest.raises(grpc.RpcError) as err:
        client.generate(greedy(random_prompt(22, 40), max_tokens=900, request_id="deadline-me"), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_released(members, ["abort-me", "cancel-me", "deadline-me"])
    # and the cluster still serves
    assert (
        client.generate(greedy(random_prompt(23, 20), max_tokens=4), timeout=60).finished.output_tokens == 4
    )


BAD_REQUESTS = [
    (build_request(max_tokens=4), "prompt"),
    (build_request("", max_tokens=4), "prompt.text"),
    (build_request(prompt_token_ids=[], max_tokens=4), "prompt.token_ids"),
    (build_request(prompt_token_ids=[1, 8192], max_tokens=4), "prompt.token_ids"),
    (build_request(prompt_token_ids=[5] * 1024, max_tokens=4), "max_model_len"),
    (build_request("hi", max_tokens=0), "max_tokens"),
    (build_request("hi", max_tokens=-3), "max_tokens"),
    (build_request("hi", max_tokens=5000), "max_tokens"),
    (build_request("hi", temperature=-0.5), "temperature"),
    (build_request("hi", temperature=float("nan")), "temperature"),
    (build_request("hi", top_p=0.0), "top_p"),
    (build_request("hi", top_p=1.5), "top_p"),
    (build_request("hi", top_k=-1), "top_k"),
    (build_request("hi", stop=[""]), "stop"),
    (build_request("hi", stop_token_ids=[9000]), "stop_token_ids"),
    # the cheap limits (router.limits), checked before the prompt is tokenized
    (build_request("x" * (1024 * 64 + 1), max_tokens=4), "prompt.text: at most"),
    (build_request("hi", request_id="r" * 257), "request_id: at most 256"),
    (build_request("hi", stop=["s"] * 17), "sampling.stop: at most 16 stop strings"),
    (build_request("hi", stop=["s" * 257]), "sampling.stop[0]: at most 256"),
    (build_request("hi", stop_token_ids=[3] * 129), "sampling.stop_token_ids: at most 128"),
]


@pytest.mark.parametrize(("request_", "field"), BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_invalid_argument(client, request_, field):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ok = client.generate(build_request("hello", max_tokens=3, temperature=0.0, ignore_eos=True), timeout=60)
    assert ok.finished.output_tokens == 3


def test_message_over_the_receive_limit_is_refused_unread(client):
    with pytest.raises(grpc.RpcError) as err:  # 5 MiB: over the router's 4 MiB receive limit
        client.generate(build_request("x" * (5 * 2**20), max_tokens=4), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_abort_unknown_and_duplicate_ids(client, members):
    with pytest.raises(grpc.RpcError) as err:
        client.abort("no-such-request")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "request_id" in err.value.details()
    stream = client.stream(greedy(random_prompt(30, 20), max_tokens=900, request_id="dup"), timeout=120)
    next(stream)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(greedy([1, 2, 3], request_id="dup"), timeout=30)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in err.value.details()
    client.abort("dup")
    assert list(stream)[-1].finished.finish_reason == "abort"
    assert_released(members, ["dup"])


def test_model_info_and_health(client, cluster, tiny_model_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvferry.kernels import cpu

    info = client.model_info()
    assert info.model == tiny_model_dir.name  # the cluster was given the checkpoint's path: never shown
    assert (info.num_prefill_workers, info.num_decode_workers, info.num_pool_nodes) == (2, 1, 1)
    assert info.block_size == BLOCK and info.max_model_len == 1024 and info.vocab_size == 8192
    # the kernels each role runs (kernels.select): the C++ CPU kernels here, where they build
    backend = "cpu" if cpu.load() else "torch"
    assert list(info.kernels) == [f"decode: {backend}", f"prefill: {backend}"]
    health = health_pb2_grpc.HealthStub(client.channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )


def test_redis_restart_mid_run(client, engine, redis_server, cluster):
    prompt = random_prompt(40, 50)
    expected = offline(engine, prompt)
    assert client.generate(greedy(prompt), timeout=60).token_ids == expected
    redis_server.stop()
    # while Redis is down: lookups miss, publishing is skipped, requests still succeed
    during = client.generate(greedy(prompt), timeout=60)
    assert during.token_ids == expected
    redis_server.start()  # empty: every block key is gone
    results = []

    def later():
        results.append(client.generate(greedy(prompt), timeout=60))

    threads = [threading.Thread(target=later) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 3
    assert all(r.token_ids == expected for r in results)
    # the cluster re-registers itself in the new Redis within a heartbeat or two
    meta = MetadataStore(redis_server.url, cluster.cfg.namespace)
    wait_for(lambda: meta.members("pool") and meta.members("decode"), 15, "re-registration in the new Redis")
    # and the pool publishes again (its heartbeat sees the new server): the prompt's full blocks are
    # findable by key. A put's own republish may land before the node re-registered, and a reader then
    # drops it as a dead node's entry; the heartbeat's republish after registering stands.
    fingerprint = bytes.fromhex(client.model_info().fingerprint)
    keys = block_keys(prompt, BLOCK, fingerprint)
    wait_for(lambda: len(meta.lookup_prefix(keys)) == len(prompt) // BLOCK, 15, "the pool's republish")


def test_first_token_finish_releases_the_tail(client, members):
    # a 20-token prompt leaves a private tail block in the pool; max_tokens=1 means no decode pulls it
    got = client.generate(greedy(random_prompt(50, 20), max_tokens=1, request_id="one-token"), timeout=60)
    assert got.finished.finish_reason == "length" and got.finished.output_tokens == 1
    assert_released(members, ["one-token"])


def test_stream_interval_sends_tokens_in_groups(redis_server, tiny_model_dir, tmp_path, engine):
    """A decode worker with `stream_interval` 4: the first token and the first decode message go at
    once, then 4 tokens a message, the last message with what is left; the tokens are an unbatched
    stream's, and the router relays fewer messages."""
    interval, tokens = 4, 19
    decode = WorkerGroupSettings(engine={**ENGINE, "stream_interval": interval})
    cfg = make_cluster_config(tiny_model_dir, redis_server.url, "test-stream-interval", decode=decode)
    with LocalCluster(cfg, log_dir=tmp_path, quiet=True) as cluster, Client(cluster.router_addr) as client:
        for seed in range(3):
            ids = random_prompt(900 + seed, 20 + 9 * seed)
            got = client.generate(greedy(ids, max_tokens=tokens), timeout=60)
            assert got.token_ids == offline(engine, ids, max_tokens=tokens)
            # the prefill's token; the decode's first; then `interval` at a time; the rest, finished
            assert got.messages <= 1 + 1 + -(-(tokens - 2) // interval) + 1, got.messages
            assert got.messages < tokens // 2


def test_multi_step_decode_streams_each_burst_in_one_message(redis_server, tiny_model_dir, tmp_path, engine):
    """Decode workers with `num_scheduler_steps` 8 (multi-step decode): a request alone decodes in bursts
    of 8 steps, each burst's tokens one message; the tokens are the offline engine's (one step at a
    time)."""
    steps, tokens = 8, 27
    decode = WorkerGroupSettings(engine={**ENGINE, "num_scheduler_steps": steps})
    cfg = make_cluster_config(tiny_model_dir, redis_server.url, "test-multi-step", decode=decode)
    with LocalCluster(cfg, log_dir=tmp_path, quiet=True) as cluster, Client(cluster.router_addr) as client:
        for seed in range(2):
            ids = random_prompt(950 + seed, 20 + 9 * seed)
            got = client.generate(greedy(ids, max_tokens=tokens), timeout=60)
            assert got.token_ids == offline(engine, ids, max_tokens=tokens)
            # the prefill's token, then the decode's 26 in bursts of 8 (the last 2), and the finish
            assert got.messages <= 1 + -(-(tokens - 1) // steps) + 1, got.messages


@pytest.mark.parametrize(
    ("colocated", "proposer"),
    [(False, "ngram"), (True, "ngram"), (False, "draft")],
    ids=["disaggregated", "colocated", "disaggregated-draft-model"],
)
def test_speculative_decoding_gives_the_offline_greedy_tokens(
    redis_server, tiny_model_dir, tmp_path, engine, colocated, proposer
):
    """Decode workers with speculation (`kvferry up --speculative-config`'s path; n-gram, or a draft
    model: here the target itself, on its own KV cache in the worker): the greedy tokens of the offline
    engine without it, for prompts whose continuation repeats what came before (drafts accepted) and for
    plain ones."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    if proposer == "draft":
        spec = json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 3})
    cfg = make_cluster_config(
        tiny_model_dir, redis_server.url, f"test-spec-{colocated}-{proposer}", colocated=colocated
    ).with_overrides(speculative_config=spec)
    assert all(g.engine["speculative_config"] == spec for g in cfg.groups("decode"))
    bases = [random_prompt(700 + s, n) for s, n in enumerate((12, 30))]
    prompts = bases + [b + offline(engine, b, max_tokens=24) + b for b in bases]
    with LocalCluster(cfg, log_dir=tmp_path, quiet=True) as cluster, Client(cluster.router_addr) as client:
        for i, ids in enumerate(prompts):
            got = client.generate(greedy(ids, max_tokens=24), timeout=60)
            assert got.token_ids == offline(engine, ids, max_tokens=24)
            assert got.finished.output_tokens == 24
            if i >= len(bases):  # accepted drafts: a decode step streams several tokens in one message
                assert got.messages < 16, got.messages

        def rates():  # from the decode workers' heartbeats, as the router's /metrics reports them
            return [
                metric(cluster, f"kvferry:spec_decode_num_{k}_tokens_total") for k in ("draft", "accepted")
            ]

        wait_for(lambda: rates()[1] > 0, 15, "acceptance in /metrics")
        drafts, accepted = rates()
        assert 0 < accepted <= drafts


def test_int8_weights_and_kv_cache_through_the_pool(redis_server, tiny_model_dir, tmp_path):
    """`kvferry up --quantization int8 --kv-cache-dtype int8`: the prefill workers write int8 KV rows (values
    and scales) to the pool, the decode workers pull them as they are, and the tokens are the offline int8
    engine's, fresh and after a prefix hit."""
    from kvferry.deploy.config import cluster_layout

    cfg = make_cluster_config(tiny_model_dir, redis_server.url, "test-int8").with_overrides(
        quantization="int8", kv_cache_dtype="int8"
    )
    layout = cluster_layout(cfg, tiny_model_dir)
    offline_int8 = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            max_model_len=1024,
            num_kv_blocks=512,
            quantization="int8",
            kv_cache_dtype="int8",
        )
    )
    assert layout.dtype == "int8" and layout.head_dim == offline_int8.model.cfg.head_dim + 4
    base = random_prompt(1200, 40)
    prompts = [random_prompt(1201, 25), [*base, 7, 8, 9], [*base, 10, 11]]  # the third: a 32-token hit
    with LocalCluster(cfg, log_dir=tmp_path, quiet=True) as cluster, Client(cluster.router_addr) as client:
        for ids in prompts:
            got = client.generate(greedy(ids), timeout=60)
            assert got.token_ids == offline(offline_int8, ids)
        assert got.finished.cached_tokens == 32
