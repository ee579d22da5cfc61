"""A fleet of routers on one host (router.replicas = 3, one shared gRPC port and one shared HTTP port):
they serve a mixed gRPC + HTTP load with the offline engine's greedy output; `kill -9` of one under load
fails no request (kvferry's client resumes its streams with exact tokens; new requests reach the others)
and leaks nothing once the detach grace has passed; a router that did not admit a request aborts it; a
stream's resume is its owner's only."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import (
    ENGINE,
    Members,
    assert_released,
    greedy,
    make_cluster_config,
    post,
    random_prompt,
    wait_for,
)
from test_cluster import offline

from kvferry.auth import SECRET_ENV
from kvferry.deploy.config import WorkerGroupSettings
from kvferry.deploy.local import LocalCluster, redis_env, router_argv, wait_routers
from kvferry.kvpool.metadata import MetadataStore
from kvferry.proc import free_port, terminate
from kvferry.router.client import Client
from kvferry.router.config import RouterConfig
from kvferry.v1 import generate_pb2, generate_pb2_grpc, worker_pb2

pytestmark = pytest.mark.slow

ROUTERS = 3
GRACE_S = 4.0
LONG = 900  # tokens of the streams that lose their router: still running at the kill on a busy host


@pytest.fixture(scope="module")
def cluster(redis_server, tiny_model_dir, tmp_path_factory):
    cfg = make_cluster_config(
        tiny_model_dir,
        redis_server.url,
        "test-fleet",
        decode=WorkerGroupSettings(replicas=2, engine=ENGINE),
        router=RouterConfig(port=0, http_port=0, replicas=ROUTERS, detach_grace_s=GRACE_S, drain_s=5.0),
    )
    with LocalCluster(cfg, log_dir=tmp_path_factory.mktemp("fleet-logs"), quiet=True) as c:
        wait_routers(c.redis_url, cfg.namespace, {r.proc.pid for r in c.routers}, time.monotonic() + 60)
        yield c


@pytest.fixture(scope="module")
def members(cluster):
    m = Members(cluster)
    yield m
    m.close()


def routers(cluster) -> dict[str, dict]:
    """The registry records of the cluster's own routers (not the lone router's below)."""
    records = MetadataStore(cluster.redis_url, cluster.cfg.namespace).members("router") or {}
    pids = {c.proc.pid for c in cluster.routers}
    return {k: v for k, v in records.items() if v.get("pid") in pids}


def test_routers_share_one_port_and_serve_grpc_and_http_exactly(cluster, tiny_engine):
    assert len(cluster.live_routers()) == ROUTERS
    assert len({info["addr"] for info in routers(cluster).values()}) == 1  # one address, three processes
    prompts = [random_prompt(300 + i, 12 + 3 * i) for i in range(12)]
    want = [offline(tiny_engine, p, 12) for p in prompts]

    def over_grpc(i: int) -> tuple[list[int], str]:
        with Client(cluster.router_addr) as client:  # a connection of its own: the kernel picks a router
            got = client.generate(greedy(prompts[i], 12), timeout=120)
        assert got.finished.finish_reason == "length"
        return got.token_ids, got.text

    def over_http(i: int) -> str:
        body = {"model": cluster.cfg.model, "prompt": prompts[i], "max_tokens": 12, "temperature": 0}
        status, reply = post(f"{cluster.http_url}/v1/completions", {**body, "ignore_eos": True}, timeout=120)
        assert status == 200, reply
        return reply["choices"][0]["text"]

    with ThreadPoolExecutor(6) as pool:
        grpc_out = list(pool.map(over_grpc, range(12)))
        http_out = list(pool.map(over_http, range(12)))
    assert [tokens for tokens, _ in grpc_out] == want
    assert http_out == [text for _, text in grpc_out]
    # the kernel spread the connections: more than one router served (their 1 s heartbeats say so)
    served = lambda: [info.get("finished", 0) for info in routers(cluster).values()]  # noqa: E731
    wait_for(lambda: sum(1 for n in served() if n) >= 2, 10, "a second router to have served")


def _kill_a_busy_router(cluster) -> int:
    """SIGKILL a router that has requests in flight (its heartbeat says so); its pid."""

    def busy():
        return [info["pid"] for info in routers(cluster).values() if info.get("inflight")]

    pid = wait_for(busy, 20, "a router with streams in flight")[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def _sse_stream(cluster, prompt, resume: bool = False, last_event_id: str | None = None) -> tuple[str, str]:
    """An OpenAI-style streamed completion read raw: ('done', its text), or ('broken', ...) when the
    connection broke (a client that does not resume); never a hang (the socket timeout would raise).
    `resume`: a broken stream is resumed through another connection with SSE's Last-Event-ID."""
    host, port = cluster.http_url.removeprefix("http://").rsplit(":", 1)
    body = {"model": cluster.cfg.model, "prompt": prompt, "max_tokens": LONG, "temperature": 0}
    body = json.dumps({**body, "stream": True, "ignore_eos": True})
    text, last, tries = [], last_event_id, 0
    while True:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            headers = {"Content-Type": "application/json"} | ({} if last is None else {"Last-Event-ID": last})
            conn.request("POST", "/v1/completions", body, headers)
            reply = conn.getresponse()
            assert reply.status == 200, reply.read()
            for line in reply:
                if line.startswith(b"id: "):
                    last = line[4:].strip().decode()
                elif line.startswith(b"data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                elif line.strip() == b"data: [DONE]":
                    return "done", "".join(text)
            outcome = "broken"
        except (ConnectionError, http.client.IncompleteRead, http.client.RemoteDisconnected):
            outcome = "broken"
        finally:
            conn.close()
        tries += 1
        if not resume or last is None or tries > 3:
            return outcome, "".join(text)


def test_kill_one_router_under_load(cluster, members, tiny_engine):
    prompts = [random_prompt(400 + i, 20 + i) for i in range(6)]
    want = [offline(tiny_engine, p, LONG) for p in prompts]
    later = [random_prompt(500 + i, 15) for i in range(6)]
    want_later = [offline(tiny_engine, p, 16) for p in later]
    started = threading.Semaphore(0)

    def streamed(i: int):
        tokens, text, finished = [], [], None
        with Client(cluster.router_addr) as client:
            for msg in client.stream(greedy(prompts[i], LONG), timeout=240):
                if not tokens and msg.token_ids:
                    started.release()
                tokens += msg.token_ids
                text.append(msg.text)
                if msg.HasField("finished"):
                    finished = msg.finished.finish_reason
        return tokens, finished, "".join(text)

    def fresh(i: int):
        with Client(cluster.router_addr) as client:
            return client.generate(greedy(later[i], 16), timeout=120).token_ids

    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(streamed, i) for i in range(6)]
        raw = [pool.submit(_sse_stream, cluster, prompts[i], resume=i == 0) for i in range(4)]
        for _ in range(6):
            assert started.acquire(timeout=120), "a stream did not start"
        _kill_a_busy_router(cluster)
        fresh_results = [pool.submit(fresh, i) for i in range(6)]  # new requests while one is down
        results = [f.result(timeout=240) for f in streams]
        ends = [f.result(timeout=240) for f in raw]
        assert [f.result(timeout=240) for f in fresh_results] == want_later  # 0 new requests fail
    for i, (tokens, finished, _) in enumerate(results):
        assert finished == "length", f"stream {i} ended with {finished}"
        assert tokens == want[i], f"stream {i} differs from the uninterrupted run"
    # the SSE stream that resumes (Last-Event-ID) has the whole text; the others end cleanly
    assert ends[0] == ("done", results[0][2])
    assert {outcome for outcome, _ in ends} <= {"done", "broken"}
    decode = members.stats("decode").values()
    assert sum(s.resumed for s in decode) >= 1, "no stream was on the killed router"
    # nothing is left behind: no detached sequence, no block, no slot, once the grace has passed
    assert_released(members, timeout=GRACE_S + 30)
    assert all(s.detached == 0 for s in members.stats("decode").values())
    wait_for(lambda: len(routers(cluster)) == ROUTERS, 60, "the launcher to restart the router")


def _start_router(cluster, http_port: int | None = None) -> tuple[subprocess.Popen, str]:
    """One more router on ports of its own (gRPC, and HTTP when given); (its process, gRPC address)."""
    port = free_port("127.0.0.1")
    argv = router_argv(cluster.cfg, str(cluster.model_dir), "127.0.0.1", port, http_port)
    env = {**os.environ, SECRET_ENV: cluster.secret, **redis_env(cluster.redis_url)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with Client(f"127.0.0.1:{port}") as client:
        try:
            wait_for(lambda: _ready(client), 60, "the lone router to serve")
        except BaseException:
            terminate([proc], 15)
            raise
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def lone_router(cluster):
    """A router that did not admit what the fleet serves."""
    proc, addr = _start_router(cluster)
    try:
        with Client(addr) as client:
            yield client
    finally:
        terminate([proc], 15)


def _ready(client) -> bool:
    try:
        return client.model_info(timeout=2).num_decode_workers == 2
    except grpc.RpcError:
        return False


def test_abort_through_a_router_that_did_not_admit_it(cluster, members, lone_router):
    with Client(cluster.router_addr) as client:
        stream = client.stream(greedy(random_prompt(600, 20), 1000, request_id="abort-me"), timeout=120)
        first = next(stream)
        assert first.request_id == "abort-me"
        lone_router.abort("abort-me")  # the lone router admitted nothing: it passes the abort on
        finished = None
        for msg in stream:
            if msg.HasField("finished"):
                finished = msg.finished
    assert finished is not None and finished.finish_reason == "abort"
    assert finished.output_tokens < 1000
    with pytest.raises(grpc.RpcError) as err:
        lone_router.abort("never-made")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_released(members, ["abort-me"])


def test_any_router_reports_on_any_request(cluster, lone_router):
    """GetRequestStatus through a router that admitted nothing: the workers say where each stands."""
    with Client(cluster.router_addr) as client:
        stream = client.stream(greedy(random_prompt(601, 20), 1000, request_id="where-am-i"), timeout=120)
        got = len(next(stream).token_ids)
        got += len(next(stream).token_ids)
        status = lone_router.status("where-am-i")
        assert (status.request_id, status.admitted_here, status.prompt_tokens) == ("where-am-i", False, 20)
        # (the tiny model may have decoded all of it by now: the client reads behind the worker)
        assert status.state in ("decoding", "finished") and got <= status.output_tokens <= 1000
        assert status.state == "decoding" or status.output_tokens == 1000
        assert status.worker.startswith("decode")
        client.abort("where-am-i")
        assert any(msg.HasField("finished") for msg in stream)
        done = client.generate(greedy(random_prompt(602, 20), 12, request_id="done-here"))
    assert done.finished.output_tokens == 12
    status = lone_router.status("done-here")  # finished: kept by its decode worker for a resume a while
    assert (status.state, status.finish_reason, status.output_tokens) == ("finished", "length", 12)
    for rid in ("never-made", "where-am-i"):  # (an aborted stream is not kept)
        with pytest.raises(grpc.RpcError) as err:
            lone_router.status(rid)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_id_no_request_can_have_is_not_passed_on_to_the_workers(lone_router):
    """An id longer than Generate takes is NOT_FOUND at the router: neither Abort nor GetRequestStatus
    hands it to every worker (a decode worker would remember an early abort's id, 4 MiB ones too)."""
    huge = "x" * 1_000_000
    for call in (lone_router.abort, lone_router.status):
        with pytest.raises(grpc.RpcError) as err:
            call(huge)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details() == "request_id: no request in flight has one over 256 characters"


def _detached_stream(members, request_id: str, owner: str):
    """A stream a decode worker holds detached: its Decode call (detachable, of `owner`) broke."""
    stub = next(iter(members.decode.values()))
    request = worker_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=random_prompt(700, 24),
        sampling=greedy([1], 2000).sampling,
        prefill_here=True,
        detach_grace_s=30,
        resume=worker_pb2.ResumeInfo(owner=owner, client_sampling=greedy([1], 2000).sampling),
    )
    call = stub.Decode(request, timeout=60)
    made = list(next(call).token_ids)
    call.cancel()  # as a router's death breaks it
    wait_for(lambda: stub.GetStats(worker_pb2.WorkerStatsRequest(), timeout=5).detached == 1, 10, "detach")
    return stub, made


def test_only_the_owner_resumes_a_detached_stream(cluster, members, lone_router):
    stub, made = _detached_stream(members, "owned", "alice")
    for owner in ("bob", ""):
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Attach(worker_pb2.AttachRequest(request_id="owned", owner=owner), timeout=10))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # an abort passed on for another owner leaves it alone; the owner's goes through
    other = stub.Abort(worker_pb2.WorkerAbortRequest(request_id="owned", check_owner=True, owner="bob"))
    assert not other.found
    attached = stub.Attach(worker_pb2.AttachRequest(request_id="owned", owner="alice"), timeout=60)
    first = next(attached)
    assert first.attached.request_id == "owned"
    assert list(first.token_ids[: len(made)]) == made  # every token so far, the first call's included
    mine = stub.Abort(worker_pb2.WorkerAbortRequest(request_id="owned", check_owner=True, owner="alice"))
    assert mine.found
    assert [m.finish_reason for m in attached][-1] == "abort"
    # through a router: a resume by an id nobody holds is NOT_FOUND, never a hang
    with pytest.raises(grpc.RpcError) as err:
        list(
            lone_router.stub.Generate(
                generate_pb2.GenerateRequest(request_id="owned", resume=generate_pb2.Resume(tokens=3)),
                timeout=30,
            )
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_released(members, ["owned"])


def test_scale_routers_down_and_up(cluster):
    cluster.scale(routers=1)
    wait_for(lambda: len(routers(cluster)) == 1, 30, "the leaving routers to deregister")
    with Client(cluster.router_addr) as client:
        assert client.generate(greedy(random_prompt(800, 10), 4), timeout=60).finished.output_tokens == 4
    cluster.scale(routers=ROUTERS)
    assert len(routers(cluster)) == ROUTERS
    assert len(cluster.live_routers()) == ROUTERS


def test_streams_resume_through_another_router_grpc_and_http(cluster, members, tiny_engine):
    """Streams that a router (on its own ports) serves when it is killed go on through the fleet's
    ports: a gRPC stream by its resume field, an SSE stream by Last-Event-ID; both exact."""
    prompt = random_prompt(900, 30)
    want = offline(tiny_engine, prompt, LONG)
    http_port = free_port("127.0.0.1")
    proc, addr = _start_router(cluster, http_port)
    try:
        channel = grpc.insecure_channel(addr)
        stream = generate_pb2_grpc.GenerationStub(channel).Generate(
            greedy(prompt, LONG, request_id="grpc-resume"), timeout=120
        )
        got = []
        for msg in stream:
            got += msg.token_ids
            if len(got) >= 10:
                break
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
        body = {"model": cluster.cfg.model, "prompt": prompt, "max_tokens": LONG, "temperature": 0}
        body = json.dumps({**body, "stream": True, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        text, last = [], None
        for line in reply:
            if line.startswith(b"id: "):
                last = line[4:].strip().decode()
            elif line.startswith(b"data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
                if len(text) >= 10:
                    break
        proc.kill()  # SIGKILL: its streams' decodes are held for a resume
        proc.wait(10)
        channel.close()
        conn.close()
    finally:
        terminate([proc], 15)
    with Client(cluster.router_addr) as client:
        ask = generate_pb2.GenerateRequest(
            request_id="grpc-resume", resume=generate_pb2.Resume(tokens=len(got))
        )
        rest = list(client.stub.Generate(ask, timeout=120))
    assert got + [t for m in rest for t in m.token_ids] == want
    assert rest[-1].finished.finish_reason == "length"
    assert last is not None and last.endswith(f":{len(text)}")
    outcome, more = _sse_stream(cluster, prompt, last_event_id=last)
    assert outcome == "done"
    with Client(cluster.router_addr) as client:
        whole = client.generate(greedy(prompt, LONG), timeout=120).text
    assert "".join(text) + more == whole
    assert_released(members, ["grpc-resume"])


def test_relay_link_sends_one_message_per_step_for_all_streams(cluster, members):
    """Four streams started on one Relay link come back in one message per engine step, each message
    carrying every stream's new token (not one message per token per stream)."""
    stub = next(iter(members.decode.values()))
    steps_before = stub.GetStats(worker_pb2.WorkerStatsRequest(), timeout=10).steps
    n, tokens = 4, 64
    starts = [
        worker_pb2.RelayRequest(
            start=worker_pb2.DecodeRequest(
                request_id=f"linked-{i}",
                prompt_token_ids=random_prompt(950 + i, 12),
                sampling=greedy([1], tokens).sampling,
                prefill_here=True,
            )
        )
        for i in range(n)
    ]
    done = threading.Event()

    def requests():
        yield from starts
        done.wait(120)  # the link stays open until every stream has finished

    got: dict[str, int] = {f"linked-{i}": 0 for i in range(n)}
    batches, finished = 0, set()
    for batch in stub.Relay(requests(), timeout=120):
        batches += 1
        for item in batch.items:
            assert not item.error_code, item.error
            got[item.request_id] += len(item.response.token_ids)
            if item.response.finish_reason:
                finished.add(item.request_id)
        if len(finished) == n:
            done.set()
            break
    assert got == {rid: tokens for rid in got}
    steps = stub.GetStats(worker_pb2.WorkerStatsRequest(), timeout=10).steps - steps_before
    assert batches <= steps + 2, f"{batches} messages for {steps} engine steps"
    assert batches < n * tokens // 2, f"{batches} messages for {n * tokens} tokens: not batched"
