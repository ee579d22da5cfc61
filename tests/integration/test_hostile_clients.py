"""The hostile-client suite: a router with API keys (read from a keys file) on conftest's shared
cluster, attacked as a client of a shared, multi-tenant deployment would, one numbered item of the
tenant-safety issue at a time:

1. grammars that cost seconds to build     5. input that used to be a 500
2. bodies, headers and calls without end   6. the prefix cache as a side channel
3. another key's requests                  7. the internal plane, without its credential
4. one key taking every slot               8. what the docs promise (fields, Retry-After)

Every case asserts the status and the message, then `served_and_bounded`: a plain request of another
key is still served within its SLO (TTFT), and the router's memory stayed within bounds. Real
processes throughout: the shared cluster's workers, pool node and Redis, and a router of its own.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

import grpc
import pytest
import redis
from cluster_helpers import ExtraRouter, greedy, metric, post, wait_for
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvferry.kvpool.metadata import redis_client
from kvferry.router.client import Client, build_request
from kvferry.v1 import generate_pb2

pytestmark = [pytest.mark.slow, pytest.mark.shared_cluster()]

A, B = "tenant-a-key", "tenant-b-key"  # two tenants, the router's defaults
GROUP_1, GROUP_2 = "group-key-1", "group-key-2"  # one tenant's two keys: they share cached prefixes
VIP = "vip-key"  # may preempt, and hold more
FLOOR = "floor-key"  # its requests are never more urgent than 5
METERED = "metered-key"  # 300 tokens a minute
KEYS_FILE = f"""# the hostile suite's keys: KEY[:option=value:...]
{A}
{B}
{GROUP_1}:cache_group=tenant-g
{GROUP_2}:cache_group=tenant-g
{VIP}:min_priority=-10:max_inflight=8
{FLOOR}:min_priority=5
{METERED}:tokens_per_min=300
"""
PER_KEY = 2  # --max-inflight-per-key
BODY_TIMEOUT_S = 2.0
SLO_TTFT_S = 2.0  # a plain request's TTFT, whatever another client does (alone it is ~50 ms here)
RSS_SLACK = 160 * 2**20  # the router's memory may grow this much over the whole suite, no more


@dataclass
class Hostile:
    router: ExtraRouter
    rss0: int  # the router's resident memory once warm

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.router.http_port}"


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def short(**kw) -> generate_pb2.GenerateRequest:
    return greedy([5, 6, 7, 8], 3, **kw)


def served(router: ExtraRouter, key: str) -> bool:
    assert router.proc.poll() is None, router.log.read_text()[-3000:]
    try:
        with Client(router.addr, api_key=key) as c:
            return c.generate(short(), timeout=30).finished.output_tokens == 3
    except grpc.RpcError:
        return False


@pytest.fixture(scope="module")
def hostile(cluster, tmp_path_factory):
    where = tmp_path_factory.mktemp("hostile")
    keys = where / "keys"
    keys.write_text(KEYS_FILE)
    keys.chmod(0o600)
    flags = ("--api-keys-file", str(keys), "--max-inflight-per-key", str(PER_KEY))
    router = ExtraRouter(cluster, where / "router.log", *flags, "--body-timeout-s", str(BODY_TIMEOUT_S))
    try:
        wait_for(lambda: served(router, A), 90, "the hostile suite's router")
        for _ in range(5):  # warm: the first requests allocate what every later one reuses
            assert served(router, B)
        yield Hostile(router, rss(router.proc.pid))
    finally:
        router.stop()


def served_and_bounded(h: Hostile) -> float:
    """A plain streamed request of tenant A: its first token within the SLO and all of it served; the
    router's memory within RSS_SLACK of where it started. Returns the TTFT."""
    ids = [random.randrange(100, 8000) for _ in range(24)]
    request = greedy(ids, 8)
    with Client(h.router.addr, api_key=A) as client:
        t0 = time.monotonic()
        stream = client.stream(request, timeout=60)
        first = next(stream)
        ttft = time.monotonic() - t0
        last = list(stream)[-1] if not first.HasField("finished") else first
    assert last.finished.output_tokens == 8 and last.finished.finish_reason == "length"
    assert ttft < SLO_TTFT_S, f"a plain request waited {ttft:.2f}s for its first token"
    grown = rss(h.router.proc.pid) - h.rss0
    assert grown < RSS_SLACK, f"the router grew by {grown / 2**20:.0f} MiB"
    return ttft


def completions(h: Hostile, body: dict, key: str = B, **kw):
    return post(h.http + "/v1/completions", {"prompt": "x", "max_tokens": 2} | body, key=key, **kw)


# -- 1. grammars ---------------------------------------------------------------------------------------
def test_1_grammars_that_cost_seconds_stall_no_one(hostile):
    """Six different regexes whose lexers explode, at once (distinct: no cache hit): each is a 400
    naming the grammar budget (or a 429 while the compile queue is full), while a plain request of
    another key keeps its TTFT."""
    heavy = [f"(a{{{1000 + i}}}){{1000}}" for i in range(6)]
    with ThreadPoolExecutor(len(heavy)) as pool:
        attacks = [pool.submit(completions, hostile, {"structured_outputs": {"regex": r}}) for r in heavy]
        ttfts = [served_and_bounded(hostile) for _ in range(3)]  # during the attack
        results = [attack.result(timeout=120) for attack in attacks]
    for code, reply in results:
        message = reply["error"]["message"]
        assert (code == 400 and "over the grammar budget" in message) or (code == 429 and "compil" in message)
    assert any(code == 400 for code, _ in results)
    assert max(ttfts) < SLO_TTFT_S
    served_and_bounded(hostile)


# -- 2. bodies, headers, calls ---------------------------------------------------------------------------
def http_head(h: Hostile, key: str = B) -> tuple[str, int, str]:
    host, port = "127.0.0.1", h.router.http_port
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\n"
    )
    return host, port, head


def read_reply(sock: socket.socket) -> bytes:
    reply = b""
    sock.settimeout(30)
    with contextlib.suppress(OSError):  # the router may close the connection on what it did not read
        while b"\r\n\r\n" not in reply or b"}" not in reply.split(b"\r\n\r\n", 1)[1]:
            piece = sock.recv(65536)
            if not piece:
                break
            reply += piece
    return reply


def test_2_bodies_headers_and_calls_are_bounded(hostile):
    host, port, head = http_head(hostile)
    # 64 MiB in 1 MiB chunks, no Content-Length: refused once 4 MiB came, the rest never read
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n" % 2**20 + b" " * 2**20 + b"\r\n"
        with contextlib.suppress(OSError):
            for _ in range(64):
                sock.sendall(chunk)
        reply = read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"at most 4194304" in reply, reply[:300]
    # a body that stops coming: 408 after --body-timeout-s, not a connection held forever
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f'{head}Content-Length: 100\r\n\r\n{{"prompt"'.encode())
        t0 = time.monotonic()
        reply = read_reply(sock)
        waited = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408 ") and b"stalled" in reply, reply[:300]
    assert BODY_TIMEOUT_S * 0.9 < waited < BODY_TIMEOUT_S + 10
    # headers without end: refused by the HTTP parser, not buffered
    with socket.create_connection((host, port), timeout=30) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(f"{head}X-Pad: {'p' * 256 * 1024}\r\n\r\n".encode())
        reply = read_reply(sock)
    assert reply == b"" or reply.split(b" ", 2)[1] in (b"400", b"413", b"431"), reply[:300]
    # gRPC: a message over --max-request-bytes, and metadata over 16 KiB
    with Client(hostile.router.addr, api_key=B) as client:
        huge = build_request(prompt_token_ids=[300] * (3 * 2**20), max_tokens=2)  # ~6 MiB
        with pytest.raises(grpc.RpcError) as err:
            client.generate(huge, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "message larger than max" in err.value.details().lower()
        padded = [("authorization", f"Bearer {B}"), ("x-pad", "p" * 32 * 1024)]
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(short(), metadata=padded, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "metadata" in err.value.details()
        assert client.generate(short(), timeout=30).finished.output_tokens == 3  # the channel serves on
    served_and_bounded(hostile)


# -- 3. requests belong to their key ---------------------------------------------------------------------
def test_3_no_key_can_abort_resume_look_up_or_squat_another_keys_request(hostile):
    long = dict(prompt_token_ids=[9, 10, 11], max_tokens=600, ignore_eos=True, temperature=0.0)
    router = hostile.router
    with Client(router.addr, api_key=A) as a, Client(router.addr, api_key=B) as b:
        stream = a.stream(build_request(**long, request_id="shared-id"), timeout=120)
        tokens = list(next(stream).token_ids)  # A's request is in flight under the id it chose
        try:
            out = b.generate(short(request_id="shared-id"), timeout=60)  # B takes the same id: no 409
            assert out.request_id == "shared-id" and out.finished.output_tokens == 3
            for call in (b.abort, b.status):  # B reaches A's request by its id in no way
                with pytest.raises(grpc.RpcError) as err:
                    call("shared-id")
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert "shared-id" in err.value.details() and "/" not in err.value.details()
            ask = generate_pb2.GenerateRequest(request_id="shared-id", resume=generate_pb2.Resume(tokens=0))
            with pytest.raises(grpc.RpcError) as err:
                list(b.stub.Generate(ask, metadata=[("authorization", f"Bearer {B}")], timeout=30))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            status = a.status("shared-id")  # A does, under the id it knows
            assert status.request_id == "shared-id" and status.state in ("decoding", "waiting_for_kv")
            with pytest.raises(grpc.RpcError) as err:  # A's own id, in use: A (and only A) is told
                a.generate(short(request_id="shared-id"), timeout=30)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            served_and_bounded(hostile)
            finished = None
            for msg in stream:  # A's stream runs to its end untouched
                tokens += msg.token_ids
                if msg.HasField("finished"):
                    finished = msg.finished
        finally:
            stream.cancel()
    assert finished is not None and finished.finish_reason == "length" and len(tokens) == 600
    # over HTTP the id is X-Request-Id: B's may equal A's
    for key in (A, B):
        request = urllib.request.Request(
            hostile.http + "/v1/completions",
            data=json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {key}",
                "X-Request-Id": "h",
            },
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200
    served_and_bounded(hostile)


# -- 4. fair share ----------------------------------------------------------------------------------------
def prioritized(priority: int) -> generate_pb2.GenerateRequest:
    request = short()
    request.priority = priority
    return request


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_4_no_key_takes_every_slot_jumps_the_queue_or_floods_tokens(hostile):
    router = hostile.router
    held = []
    with (
        Client(router.addr, api_key=B) as plain,
        Client(router.addr, api_key=VIP) as vip,
        Client(router.addr, api_key=FLOOR) as floor,
        Client(router.addr, api_key=METERED) as metered,
    ):
        try:
            # priority: no more urgent than the key's floor (0 by default; -2^31 was "preempt everyone")
            err = refusal(lambda: plain.generate(prioritized(-(2**31)), timeout=30))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "priority: at least 0 for this API key" in err.details()
            assert vip.generate(prioritized(-5), timeout=30).finished.output_tokens == 3
            err = refusal(lambda: floor.generate(prioritized(3), timeout=30))
            assert "priority: at least 5" in err.details()
            assert floor.generate(short(), timeout=30).finished.output_tokens == 3  # unset: raised to 5
            # slots: n counts each sequence, against the key's share (2) as well as --max-inflight
            many = build_request(prompt_token_ids=[5, 6, 7], max_tokens=4000, temperature=1.0, n=64)
            err = refusal(lambda: plain.generate(many, timeout=30))
            assert (
                err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and f"at most {PER_KEY} per key" in err.details()
            )
            assert float(dict(err.trailing_metadata() or ())["retry-after-ms"]) >= 1000
            long = dict(prompt_token_ids=[9, 10, 11], max_tokens=900, ignore_eos=True, temperature=1.0)
            stream = plain.stream(build_request(**long, n=2), timeout=120)
            next(stream)
            held.append(stream)  # the key's two slots are taken: its next request waits its turn...
            err = refusal(lambda: plain.generate(short(), timeout=30))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            code, headers, reply = completions(hostile, {}, with_headers=True)
            assert code == 429 and headers["retry-after"] == "1", reply
            assert f"at most {PER_KEY} per key" in reply["error"]["message"]
            assert vip.generate(short(), timeout=30).finished.output_tokens == 3  # ...no other key's does
            served_and_bounded(hostile)
            # tokens a minute (prompt + max_tokens of each sequence), over every router: in Redis; the
            # windows follow the wall clock, so begin where this minute has room for the whole check
            wait_for(lambda: time.time() % 60 < 40, 30, "a minute with 20 s left")
            big = build_request(prompt_token_ids=[5] * 10, max_tokens=200, temperature=0.0)
            assert metered.generate(big, timeout=60).finished.output_tokens >= 1  # 210 of 300
            err = refusal(lambda: metered.generate(big, timeout=60))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "more than its 300 tokens a minute" in err.details()
            wait_ms = float(dict(err.trailing_metadata() or ())["retry-after-ms"])
            assert 1000 <= wait_ms <= 60_000
            code, headers, reply = completions(hostile, {"max_tokens": 100}, key=METERED, with_headers=True)
            assert code == 429 and 1 <= int(headers["retry-after"]) <= 60, reply
            assert metered.generate(short(), timeout=30).finished.output_tokens == 3  # 7 more: within
        finally:
            for stream in held:
                stream.cancel()
    wait_for(lambda: served(router, B), 30, "the key's slots freed")
    served_and_bounded(hostile)


# -- 5. no 500 from input ---------------------------------------------------------------------------------
def errors_counted(h: Hostile, api: str, code: str) -> float:
    return metric(h.http, "kvferry:request_errors_total", api=api, code=code)


def test_5_malformed_input_is_a_400_naming_the_field_and_the_connection_serves_on(hostile):
    host, port, head = http_head(hostile)
    before = errors_counted(hostile, "http", "400")
    with socket.create_connection((host, port), timeout=30) as sock:
        for body, want, names in (
            (b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, b"prompt"),  # a lone surrogate
            ('{"prompt": "a\\udfffb"}'.encode("utf-16"), 400, b"prompt"),  # (JSON may come as UTF-16)
            (b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": "abc"}}', 400,
             b"response_format"),
            (b'{"prompt": "x", "max_tokens": 2}', 200, b""),  # and the same connection still serves
        ):  # fmt: skip
            sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            reply = read_reply(sock)
            assert reply.startswith(b"HTTP/1.1 %d " % want), reply[:300]
            assert names in reply.split(b"\r\n\r\n", 1)[1]
    assert errors_counted(hostile, "http", "400") == before + 3
    # a refused credential is counted too, on gRPC as on HTTP
    unauthenticated = errors_counted(hostile, "grpc", "UNAUTHENTICATED")
    with Client(hostile.router.addr, api_key="not-a-key") as stranger:
        assert (
            refusal(lambda: stranger.generate(short(), timeout=30)).code() == grpc.StatusCode.UNAUTHENTICATED
        )
    assert errors_counted(hostile, "grpc", "UNAUTHENTICATED") == unauthenticated + 1
    served_and_bounded(hostile)


# -- 6. the prefix cache ----------------------------------------------------------------------------------
def cached_tokens(h: Hostile, key: str, prompt: list[int]) -> int:
    request = build_request(prompt_token_ids=prompt, max_tokens=1, temperature=0.0)
    with Client(h.router.addr, api_key=key) as c:
        return c.generate(request, timeout=60).finished.cached_tokens


def test_6_no_key_learns_what_another_sent_unless_they_share_a_cache_group(hostile):
    rng = random.Random(6)
    prompt = [rng.randrange(100, 8000) for _ in range(96)]  # six blocks, sent nowhere before
    wait_for(lambda: cached_tokens(hostile, A, prompt) >= 16, 60, "A's prompt cached for A")
    assert cached_tokens(hostile, B, prompt) == 0  # B's first request of it finds nothing of A's
    grouped = [rng.randrange(100, 8000) for _ in range(96)]
    wait_for(lambda: cached_tokens(hostile, GROUP_1, grouped) >= 16, 60, "the group's prompt cached")
    assert cached_tokens(hostile, GROUP_2, grouped) >= 16  # the same tenant's other key shares it
    assert cached_tokens(hostile, A, grouped) == 0  # no one outside the group does
    served_and_bounded(hostile)


# -- 7. the internal plane --------------------------------------------------------------------------------
def test_7_the_internal_plane_answers_no_one_without_the_credential(hostile, cluster):
    """The groups rendezvous in the cluster's Redis, which asks for its password: there is no TCPStore
    to connect to, and without the password nothing of Redis can be read or written."""
    url = urlparse(cluster.redis_url)
    assert url.password
    no_retry = Retry(NoBackoff(), 0)  # (redis-py retries a refused connection with a backoff)
    stranger = redis.Redis(host=url.hostname, port=url.port, socket_timeout=5, retry=no_retry)
    for call in (lambda: stranger.keys("*"), lambda: stranger.get("x"), lambda: stranger.set("x", b"1")):
        with pytest.raises(redis.AuthenticationError):
            call()
    insider = redis_client(cluster.redis_url)  # with the password: the registry is there
    ns = cluster.cfg.namespace
    records = [json.loads(r) for r in insider.mget(insider.keys(f"kvf:{ns}:n:pool:*")) if r is not None]
    assert records and all("addr" in r and "store" not in r for r in records)  # no store address to dial
    served_and_bounded(hostile)


# -- 8. the docs' promises --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, field",
    [
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"made_up_field": 1}, "made_up_field"),
    ],
)
def test_8_fields_that_would_change_the_output_are_refused_by_name(hostile, body, field):
    code, reply = completions(hostile, body)
    assert code == 400 and field in reply["error"]["message"], reply
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "modalities": ["text"]}
    code, reply = completions(hostile, harmless)
    assert code == 200, reply
    served_and_bounded(hostile)
