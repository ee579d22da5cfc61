"""The OpenAI-compatible HTTP API and /metrics of a real cluster, driven by the real `openai` client,
raw sockets and `kvferry loadtest sweep --target http://...`. (A shared cluster of conftest's: a router that
admits 4 requests at once and serves the model as kvferry-tiny; this module is its only user.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from cluster_helpers import ENGINE, assert_released, metric, metrics_text, post, wait_for
from cluster_helpers import random_prompt as prompt_ids

from kvferry.deploy.config import RouterConfig, WorkerGroupSettings
from kvferry.model.chat_template import ChatTemplate
from kvferry.model.tokenizer import Tokenizer
from kvferry.proc import free_port
from kvferry.router.client import Client, build_request

MAX_INFLIGHT = 4
BODY_TIMEOUT_S = 2.0
NAME = "kvferry-tiny"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.shared_cluster(
        router=RouterConfig(
            port=0,
            http_port=0,
            max_inflight=MAX_INFLIGHT,
            served_model_name=NAME,
            body_timeout_s=BODY_TIMEOUT_S,
        ),
        prefill=WorkerGroupSettings(replicas=2, engine=ENGINE),
    ),
]


@pytest.fixture(scope="module")
def api(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.router_addr) as c:
        yield c


def grpc_greedy(client: Client, ids: list[int], max_tokens: int) -> list[int]:
    request = build_request(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return client.generate(request, timeout=60).token_ids


GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def test_completion_tokens_equal_the_grpc_path(api, grpc_client):
    for seed, n in ((0, 7), (1, 40)):
        ids = prompt_ids(seed, n)
        want = grpc_greedy(grpc_client, ids, 12)
        got = api.completions.create(model=NAME, prompt=ids, max_tokens=12, **GREEDY)
        choice = got.choices[0]
        assert choice.token_ids == want and choice.finish_reason == "length"
        assert got.usage.prompt_tokens == n and got.usage.completion_tokens == 12
        assert got.model == NAME and got.object == "text_completion"


def test_streamed_completion_with_usage_and_timings(api, grpc_client, tiny_model_dir):
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    ids = Tokenizer(tiny_model_dir).encode(text)
    want = grpc_greedy(grpc_client, ids, 16)
    stream = api.completions.create(
        model=NAME,
        prompt=text,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    tokens = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert tokens == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    finish = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    timings = finish.model_extra["timings"]
    assert timings["ttft_ms"] > 0 and timings["e2e_ms"] >= timings["ttft_ms"] and timings["prefill_ms"] > 0
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 16 and usage.prompt_tokens == len(ids)
    assert usage.prompt_tokens_details.cached_tokens == timings["cached_tokens"]
    text_out = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text_out == Tokenizer(tiny_model_dir).decode(want)


def test_chat_completion_uses_the_chat_template(api, grpc_client, tiny_model_dir):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
    ]
    rendered = ChatTemplate.from_dir(tiny_model_dir).render(messages)
    assert rendered.endswith("<|im_start|>assistant\n")
    want = grpc_greedy(grpc_client, Tokenizer(tiny_model_dir).encode(rendered), 10)
    whole = api.chat.completions.create(model=NAME, messages=messages, max_tokens=10, **GREEDY)
    assert whole.choices[0].token_ids == want and whole.choices[0].message.role == "assistant"
    streamed = api.chat.completions.create(
        model=NAME, messages=messages, max_completion_tokens=10, stream=True, **GREEDY
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [t for c in chunks for t in c.choices[0].token_ids] == want
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_several_prompts_in_one_request(api, grpc_client):
    prompts = [prompt_ids(5, 9), prompt_ids(6, 20), prompt_ids(7, 33)]
    got = api.completions.create(model=NAME, prompt=prompts, max_tokens=6, **GREEDY)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, ids in zip(got.choices, prompts, strict=True):
        assert choice.token_ids == grpc_greedy(grpc_client, ids, 6)
    assert got.usage.prompt_tokens == 9 + 20 + 33 and got.usage.completion_tokens == 18


def test_models_and_health(cluster):
    with urllib.request.urlopen(cluster.http_url + "/v1/models", timeout=10) as reply:
        card = json.load(reply)["data"][0]
    assert card["id"] == NAME and card["max_model_len"] == 1024 and card["vocab_size"] == 8192
    assert "/" not in json.dumps(card)  # no checkpoint path
    with urllib.request.urlopen(cluster.http_url + "/health", timeout=10) as reply:
        assert reply.status == 200


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"prompt": "x", "temperature": -1}, 400, "temperature", "finite number >= 0"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
        ({"prompt": [1, 99999]}, 400, "prompt", "[0, 8192)"),
        ({"prompt": ""}, 400, "prompt", "must not be empty"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "max_model_len is 1024"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
        ({"prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
        ({"prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format.type", "json_schema"),
        ({"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias", "[0, 8192)"),
        ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens", "max_tokens=2"),
        ({"prompt": "x", "n": 65}, 400, "n", "[1, 64]"),
        ({"max_tokens": 3}, 400, "prompt", "Field required"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
        ({"prompt": "x", "stop": ["s"] * 17}, 400, "stop", "at most 16 stop strings"),
        ({"prompt": "x", "stop": ["s" * 300]}, 400, "stop[0]", "at most 256 characters"),
        ({"prompt": "x" * (1024 * 64 + 1)}, 400, "prompt", "at most 65536 characters"),
        (
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": "abc"}},
            400,
            "response_format.json_schema",
            "must be an object",
        ),
        ({"prompt": "a\ud800b"}, 400, "prompt", "lone surrogate"),
        ({"prompt": ["ok", "b\udfff"]}, 400, "prompt[1]", "lone surrogate"),
        ({"prompt": "\ud83d\ude00", "max_tokens": 0}, 400, "max_tokens", ">= 1"),  # a pair is valid text
        ({"prompt": "x", "reasoning_effort": "high"}, 400, "reasoning_effort", "not a field kvferry knows"),
        ({"prompt": "x", "prediction": {"type": "content"}}, 400, "prediction", "refused, not ignored"),
        ({"prompt": "x", "max_tokenz": 9}, 400, "max_tokenz", "not a field kvferry knows"),  # a typo
        ({"prompt": "x", "modalities": ["text", "audio"]}, 400, "modalities", "not supported"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(cluster, body, status, param, words):
    code, reply = post(cluster.http_url + "/v1/completions", body)
    assert code == status, reply
    error = reply["error"]
    assert error["param"] == param and words in error["message"] and error["code"] == status


def raw_request(sock: socket.socket, head: str, body: bytes = b"") -> tuple[int, dict]:
    """One request on an open keep-alive connection: (status, JSON reply); the connection stays usable."""
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, data
        data += piece
    top, rest = data.split(b"\r\n\r\n", 1)
    length = int(
        next(h for h in top.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1]
    )
    while len(rest) < length:
        piece = sock.recv(65536)
        assert piece, rest
        rest += piece
    return int(top.split(b" ")[1]), json.loads(rest[:length])


def test_every_error_is_counted_and_the_connection_stays_usable(cluster):
    url = cluster.http_url + "/v1/completions"
    errors = "kvferry:request_errors_total"
    before = {code: metric(cluster, errors, api="http", code=code) for code in ("400", "404")}
    host, port = cluster.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for body, want in (
            (b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400),  # refused by the gate
            (b'{"prompt": "x", "max_tokens": "many"}', 400),  # by the body's validation
            (b'{"model": "gpt-4", "prompt": "x"}', 404),  # by the route
            ('{"prompt": "a\\udfffb"}'.encode("utf-16"), 400),  # (JSON may come as UTF-16)
            (b'{"prompt": "x", "max_tokens": 2}', 200),  # and the same connection still serves
        ):
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            status, reply = raw_request(sock, f"{head}Content-Length: {len(body)}\r\n\r\n", body)
            assert status == want, reply
    assert metric(cluster, errors, api="http", code="400") == before["400"] + 3
    assert metric(cluster, errors, api="http", code="404") == before["404"] + 1
    code, _ = post(url, {"prompt": "x", "max_tokens": 2})
    assert code == 200


def test_duplicate_request_id_is_409_and_an_oversized_body_413(cluster, grpc_client, members):
    stream = grpc_client.stream(
        build_request(
            prompt_token_ids=prompt_ids(41, 10), max_tokens=900, ignore_eos=True, request_id="twice-0"
        ),
        timeout=120,
    )
    next(stream)  # admitted and streaming
    request = urllib.request.Request(
        cluster.http_url + "/v1/completions",
        data=json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json", "x-request-id": "twice"},  # -> request id twice-0
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 409 and "already in flight" in json.load(err.value)["error"]["message"]
    stream.cancel()
    wait_for(lambda: not any(s.active_request_ids for s in members.stats("decode").values()), what="release")
    # a body over the limit (4 MiB) is refused on its Content-Length, before a byte of it is read
    host, port = cluster.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {5 * 2**20}\r\n\r\n".encode())
        reply = b""
        while b"at most" not in reply:
            piece = sock.recv(65536)
            assert piece, reply
            reply += piece
    assert reply.startswith(b"HTTP/1.1 413 ")


def test_fields_that_change_nothing_are_accepted(cluster):
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    body = {"prompt": "x", "max_tokens": 2, "modalities": ["text"], **harmless}
    code, reply = post(cluster.http_url + "/v1/completions", body)
    assert code == 200 and reply["usage"]["completion_tokens"] == 2, reply
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "parallel_tool_calls": True}
    code, reply = post(cluster.http_url + "/v1/chat/completions", chat | harmless)
    assert code == 200, reply
    code, reply = post(cluster.http_url + "/v1/chat/completions", chat | {"audio": {"voice": "x"}})
    assert code == 400 and reply["error"]["param"] == "audio", reply


def test_malformed_json_and_bad_chat_messages(cluster):
    code, reply = post(cluster.http_url + "/v1/completions", b"{not json")
    assert code == 400 and "not valid JSON" in reply["error"]["message"]
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    code, reply = post(cluster.http_url + "/v1/chat/completions", {"messages": parts})
    assert code == 400 and "only text parts" in reply["error"]["message"]
    code, reply = post(cluster.http_url + "/v1/chat/completions", {"messages": []})
    assert code == 400 and reply["error"]["param"] == "messages"


def open_stream(http_url: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 client: send the request, return the socket (the caller reads or drops it)."""
    host, port = http_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until(sock: socket.socket, events: int) -> bytes:
    data = b""
    while data.count(b"data: ") < events:
        piece = sock.recv(65536)
        assert piece, f"the server closed the stream early: {data[-300:]!r}"
        data += piece
    return data


def held_stream(http_url: str, body: dict) -> socket.socket:
    """A stream that is admitted and streaming. Retried while the router still counts a request an
    earlier test let go (a hang-up's cleanup finishes in the background): that one is refused with 429."""

    def attempt() -> socket.socket | None:
        sock = open_stream(http_url, body)
        data = b""
        while b"data: " not in data:
            piece = sock.recv(65536)
            if not piece:
                sock.close()
                assert b" 429 " in data, f"the server closed the stream early: {data[-300:]!r}"
                return None
            data += piece
        return sock

    return wait_for(attempt, what="a stream to be admitted")


def test_client_disconnect_mid_stream_releases_the_request(cluster, members):
    def cancels() -> float:
        return metric(cluster.http_url, "kvferry:requests_total", api="http", code="CANCELLED")

    cancelled = cancels()
    body = {
        "prompt": prompt_ids(11, 40),
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sock = open_stream(cluster.http_url, body)
    assert b"200 OK" in read_until(sock, 3)
    active = wait_for(lambda: [i for s in members.stats("decode").values() for i in s.active_request_ids])
    sock.close()  # the client goes away mid-stream
    assert_released(members, active)
    wait_for(
        lambda: (
            metric(cluster.http_url, "kvferry:requests_total", api="http", code="CANCELLED") == cancelled + 1
        ),
        what="the cancel to be counted",
    )
    # not streamed: a client that hangs up while waiting for the whole body is released too
    body = dict(body, stream=False)
    sock = open_stream(cluster.http_url, body)
    active = wait_for(lambda: [i for s in members.stats("decode").values() for i in s.active_request_ids])
    sock.close()
    assert_released(members, active)


def test_overload_is_429_and_the_server_keeps_serving(cluster, members, api):
    body = {
        "prompt": prompt_ids(12, 20),
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    # 900 tokens take 0.5 s or more: the holders stay in flight while the next ones are refused
    holders = [held_stream(cluster.http_url, body) for _ in range(MAX_INFLIGHT)]
    try:
        url = cluster.http_url + "/v1/completions"
        code, headers, reply = post(url, {"prompt": "x", "max_tokens": 2}, with_headers=True)
        assert code == 429 and "--max-inflight" in reply["error"]["message"]
        assert headers["retry-after"] == "1"  # (a hint: when a slot may have come free)
        with pytest.raises(openai.RateLimitError):
            api.completions.create(model=NAME, prompt="x", max_tokens=2)
    finally:
        for sock in holders:
            sock.close()
    wait_for(lambda: not any(s.active_request_ids for s in members.stats("decode").values()), what="release")

    def served():  # the router frees a hung-up stream's slot after its release calls, in the background
        try:
            return api.completions.create(model=NAME, prompt="import os", max_tokens=3, temperature=0)
        except openai.RateLimitError:
            return None

    assert wait_for(served, what="a slot after the hang-ups").usage.completion_tokens == 3


def test_metrics_after_requests(cluster, api):
    shared = prompt_ids(21, 64)
    for suffix in (prompt_ids(22, 8), prompt_ids(23, 8), prompt_ids(24, 8)):  # the 64-token prefix repeats
        api.completions.create(model=NAME, prompt=shared + suffix, max_tokens=4, temperature=0)
    url, name = cluster.http_url, NAME
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "time_per_output_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_kv_transfer_time_seconds",
        "request_first_decode_time_seconds",
    ):
        assert metric(url, f"kvferry:{histogram}_count", model_name=name) > 0, histogram
        assert metric(url, f"kvferry:{histogram}_sum", model_name=name) > 0, histogram
    hits = sum(metric(url, "kvferry:prefix_cache_hits_total", source=s) for s in ("local", "pool"))
    assert hits >= 2 * 64  # the second and third requests find the shared prefix (locally or in the pool)
    assert metric(url, "kvferry:prefix_cache_queries_total") >= 3 * 72
    assert metric(url, "kvferry:request_success_total", finished_reason="length") >= 3
    assert metric(url, "kvferry:generation_tokens_total") >= 12
    assert metric(url, "kvferry:requests_total", api="http", code="INVALID_ARGUMENT") >= 1
    text = metrics_text(url)
    for gauge in (
        "kv_cache_usage_perc",
        "pool_slab_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
    ):
        assert f"kvferry:{gauge}{{" in text, gauge
    assert 'role="decode"' in text and 'node="pool-0"' in text


def test_grpc_requests_are_counted_too(cluster, grpc_client):
    before = metric(cluster.http_url, "kvferry:requests_total", api="grpc", code="OK")
    grpc_greedy(grpc_client, prompt_ids(30, 5), 3)
    assert metric(cluster.http_url, "kvferry:requests_total", api="grpc", code="OK") == before + 1


def test_loadtest_sweep_against_the_http_api(cluster, tmp_path):
    from kvferry.cli import main
    from kvferry.loadtest.metrics import read_records

    out = tmp_path / "sweep"
    argv = ["loadtest", "sweep", "--target", cluster.http_url, "--compare", cluster.router_addr]
    argv += ["--labels", "http,grpc", "--rates", "3", "--duration", "3", "--input-len", "40"]
    argv += ["--output-len", "8", "--slo-ttft", "2", "--slo-tpot", "0.5", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "summary.json").read_text())
    for label in ("http", "grpc"):
        records = read_records(out / label / "rate-3.jsonl")
        assert records and all(r.ok and r.output_tokens == 8 for r in records), label
        assert report["targets"][label]["rates"][0]["ttft_ms"]["p50"] > 0
    assert (out / "sweep.csv").exists() and (out / "attainment.png").read_bytes()[:4] == b"\x89PNG"


def test_router_without_workers_answers_503(redis_server, tiny_model_dir):
    port = free_port()
    router = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvferry.router", "--model", str(tiny_model_dir), "--port", "0"),
            *("--redis-url", redis_server.url, "--namespace", "test-openai-empty", "--http-port", str(port)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def health() -> int:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    return reply.status
            except urllib.error.HTTPError as err:
                return err.code
            except OSError:
                return 0

        assert wait_for(health, 60, "the router's HTTP API") == 503
        code, reply = post(url + "/v1/completions", {"prompt": "x"})
        assert code == 503 and "workers are ready yet" in reply["error"]["message"]
    finally:
        router.terminate()
        router.wait(30)
    assert router.returncode == 0


def test_many_concurrent_streams_all_complete(api):
    def one(i: int) -> list[str | None]:
        stream = api.completions.create(
            model=NAME, prompt=prompt_ids(40 + i, 10), max_tokens=5, temperature=0, stream=True
        )
        return [c.choices[0].finish_reason for c in stream]

    with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
        reasons = list(pool.map(one, range(3 * MAX_INFLIGHT)))
    assert all(r[-1] in ("length", "stop") and r[:-1] == [None] * (len(r) - 1) for r in reasons)


# -- logprobs, echo, the sampling controls, /tokenize (issue 28) -------------------------------------------
@pytest.fixture(scope="module")
def reference_logprobs(tiny_model_dir, hf_log_softmax):
    return lambda ids: hf_log_softmax(tiny_model_dir, ids)


LOGPROB_TOL = 2e-4


def test_echo_logprobs_are_transformers_loglikelihoods(cluster, reference_logprobs):
    """What lm-eval's loglikelihood asks: echo + logprobs + max_tokens 0, every prompt token scored."""
    ids = prompt_ids(60, 37)
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    code, reply = post(cluster.http_url + "/v1/completions", body)
    assert code == 200, reply
    choice = reply["choices"][0]
    got = choice["logprobs"]
    ref = reference_logprobs(ids)
    assert len(got["token_logprobs"]) == len(ids) and got["token_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert got["token_logprobs"][j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=LOGPROB_TOL)
    assert reply["usage"]["completion_tokens"] == 0
    # again: the prompt's blocks are cached now, and prompt logprobs still score every token
    code, again = post(cluster.http_url + "/v1/completions", body)
    assert again["choices"][0]["logprobs"]["token_logprobs"] == got["token_logprobs"]


def test_output_logprobs_through_prefill_and_decode(api, grpc_client, reference_logprobs):
    ids = prompt_ids(61, 21)
    out = api.completions.create(
        model=NAME,
        prompt=ids,
        max_tokens=6,
        logprobs=2,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = out.choices[0]
    tokens = choice.model_extra["token_ids"]
    ref = reference_logprobs(ids + tokens)
    assert len(choice.logprobs.token_logprobs) == 6
    for i, (token, value) in enumerate(zip(tokens, choice.logprobs.token_logprobs, strict=True)):
        assert value == pytest.approx(ref[len(ids) - 1 + i, token].item(), abs=LOGPROB_TOL)
        assert len(choice.logprobs.top_logprobs[i]) >= 2
    streamed = api.completions.create(
        model=NAME,
        prompt=ids,
        max_tokens=6,
        logprobs=2,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    values = [
        v
        for chunk in streamed
        for v in (chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else [])
    ]
    assert values == choice.logprobs.token_logprobs
    # gRPC: the same figures, and the prompt's
    request = build_request(
        prompt_token_ids=ids, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=0
    )
    messages = list(grpc_client.stream(request, timeout=60))
    lps = [lp for m in messages for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == tokens
    assert [pytest.approx(lp.logprob, abs=1e-6) for lp in lps] == choice.logprobs.token_logprobs
    assert len(messages[0].prompt_logprobs) == len(ids) - 1


def test_chat_logprobs_with_the_openai_client(api):
    out = api.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        temperature=0.0,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_penalties_and_min_tokens_through_the_cluster(api, hf_greedy, tiny_model_dir):
    ids = prompt_ids(62, 19)
    out = api.completions.create(
        model=NAME,
        prompt=ids,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.8, "return_token_ids": True},
    )
    (ref,) = hf_greedy(tiny_model_dir, [ids], 12, repetition_penalty=1.8)
    assert out.choices[0].model_extra["token_ids"] == ref
    # min_tokens: EOS pushed to the top is held back for 5 tokens (the first made by the prefill worker)
    eos = Tokenizer(tiny_model_dir).eos_token_id
    pushed = {"logit_bias": {str(eos): 100}, "return_token_ids": True}
    out = api.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0.0, extra_body=pushed)
    assert out.choices[0].model_extra["token_ids"] == [eos] and out.choices[0].finish_reason == "stop"
    out = api.completions.create(
        model=NAME, prompt=ids, max_tokens=12, temperature=0.0, extra_body={**pushed, "min_tokens": 5}
    )
    got = out.choices[0].model_extra["token_ids"]
    assert len(got) == 6 and got[-1] == eos and eos not in got[:5] and out.choices[0].finish_reason == "stop"
    out = api.completions.create(
        model=NAME,
        prompt=ids,
        max_tokens=16,
        temperature=1.0,
        seed=4,
        extra_body={"allowed_token_ids": [11, 12], "return_token_ids": True, "ignore_eos": True},
    )
    assert set(out.choices[0].model_extra["token_ids"]) <= {11, 12}


def test_tokenize_detokenize_and_bad_template_kwargs(cluster, tiny_model_dir):
    code, reply = post(cluster.http_url + "/tokenize", {"prompt": "hello there"})
    assert code == 200 and reply["tokens"] == Tokenizer(tiny_model_dir).encode("hello there")
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == 1024
    code, back = post(cluster.http_url + "/detokenize", {"tokens": reply["tokens"]})
    assert code == 200 and back["prompt"] == "hello there"
    code, chat = post(cluster.http_url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert code == 200 and chat["count"] > 2
    code, bad = post(cluster.http_url + "/detokenize", {"tokens": [1, 99999]})
    assert code == 400 and bad["error"]["param"] == "tokens"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}
    code, bad = post(cluster.http_url + "/v1/chat/completions", body)
    assert code == 400 and bad["error"]["param"] == "chat_template_kwargs", bad


def test_cache_salt_separates_tenants_cached_prefixes(cluster):
    """vLLM's cache_salt: the same prompt under one salt hits its own cached blocks; under another salt,
    or none, it finds nothing (its block keys differ)."""
    ids = prompt_ids(63, 70)
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0}

    def cached(**extra) -> int:
        code, reply = post(cluster.http_url + "/v1/completions", {**body, **extra})
        assert code == 200, reply
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == 64  # its 4 full blocks
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    assert cached() == 64
    code, reply = post(cluster.http_url + "/v1/completions", {**body, "cache_salt": "x" * 300})
    assert code == 400 and reply["error"]["param"] == "cache_salt"


def prefill_computed(members) -> int:
    return sum(s.prompt_tokens_computed for s in members.stats("prefill").values())


def test_n_sequences_prefill_the_prompt_once(cluster, api, grpc_client, members):
    ids = prompt_ids(64, 45)  # 2 full blocks and a tail
    before = prefill_computed(members)
    out = api.completions.create(model=NAME, prompt=ids, max_tokens=8, n=4, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("length", "stop") for c in out.choices)
    assert len({c.text for c in out.choices}) > 1  # four draws, not one answer four times
    assert prefill_computed(members) - before == len(ids)  # computed once for all four
    assert out.usage.prompt_tokens == 4 * len(ids)
    # streamed, and over gRPC: every message says its sequence; each sequence ends once
    chunks = list(
        api.completions.create(model=NAME, prompt=ids[:20], max_tokens=5, n=3, temperature=1.0, stream=True)
    )
    ends = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert ends == [0, 1, 2]
    request = build_request(prompt_token_ids=ids[:30], max_tokens=4, temperature=1.0, ignore_eos=True, n=3)
    messages = list(grpc_client.stream(request, timeout=60))
    done = sorted(m.index for m in messages if m.HasField("finished"))
    assert done == [0, 1, 2]
    assert all(sum(len(m.token_ids) for m in messages if m.index == i) == 4 for i in range(3))
    chat = api.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, temperature=1.0
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_best_of_answers_the_most_likely_sequences(cluster, api):
    ids = prompt_ids(65, 25)
    body = {"prompt": ids, "max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    code, reply = post(cluster.http_url + "/v1/completions", {**body, "n": 2, "best_of": 5, "logprobs": 0})
    assert code == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in reply["choices"]]
    assert sums[0] >= sums[1]
    assert reply["usage"]["completion_tokens"] == 5 * 6  # all five were made
    code, reply = post(cluster.http_url + "/v1/completions", {**body, "n": 2, "best_of": 5, "stream": True})
    assert code == 400 and "cannot be streamed" in reply["error"]["message"]
    code, reply = post(cluster.http_url + "/v1/completions", {**body, "n": 3, "best_of": 2})
    assert code == 400 and reply["error"]["param"] == "best_of"
