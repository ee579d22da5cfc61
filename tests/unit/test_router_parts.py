"""The router's collaborators, each alone with fakes around it (no network, no model): the decode relay's
choice of a worker and its failover mid-stream, the sequences of one request (their prefill shared from
the leader's, their streams run at once), the aborts and releases, the failover rules' verbs, and the
OpenAI routes' answers."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from kvferry.engine.output import OutputState
from kvferry.engine.request import Request, SamplingParams
from kvferry.router.admission import Admission
from kvferry.router.config import RouterConfig
from kvferry.router.directory import Directory, Member
from kvferry.router.failover import SUSPECT_S, Failover
from kvferry.router.inflight import Inflight, RequestRejected, WorkerFailed
from kvferry.router.openai_api import ApiError, OpenAIServing
from kvferry.router.relay import DecodeRelay, Relay
from kvferry.router.release import Releases
from kvferry.router.sequences import LeaderGone, Sequences, SharedPrefill
from kvferry.v1 import generate_pb2, pool_pb2, worker_pb2

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeMetrics:
    """What the collaborators tell the metrics, recorded."""

    def __init__(self):
        self.failovers: list[tuple[str, str]] = []
        self.rejections: list[tuple[str, str]] = []

    def failover(self, role: str, code: str) -> None:
        self.failovers.append((role, code))

    def rejected(self, api: str, code: str) -> None:
        self.rejections.append((api, code))

    def track(self, api: str, t0: float) -> SimpleNamespace:
        return SimpleNamespace(api=api, t0=t0, codes=[], done=lambda code: None)


def decode_member(directory: Directory, member_id: str, inflight: int = 0, stub=None) -> Member:
    member = Member("decode", member_id, f"{member_id}:1", None, stub, group=member_id, free_blocks=100)
    member.inflight = inflight
    directory.members["decode"][member_id] = member
    return member


def handle(request_id: str = "r", **fields) -> Inflight:
    return Inflight(request_id, time.monotonic() + 30, time.perf_counter(), **fields)


# -- the decode relay -----------------------------------------------------------------------------------
class FakeStream:
    """A decode stream as `DecodeLinks.open` returns it: scripted messages, then maybe an error."""

    def __init__(self, items: list):
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> worker_pb2.DecodeResponse:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeLinks:
    """`DecodeLinks` with one scripted stream per worker; the requests opened, in order."""

    def __init__(self, scripts: dict[str, list]):
        self.scripts = scripts
        self.opened: list[tuple[str, worker_pb2.DecodeRequest]] = []
        self.streams: list[FakeStream] = []

    def open(self, member: Member, request: worker_pb2.DecodeRequest, timeout: float) -> FakeStream:
        self.opened.append((member.member_id, request))
        stream = FakeStream(self.scripts[member.member_id])
        self.streams.append(stream)
        return stream


def decode_relay(directory: Directory, links, metrics=None) -> DecodeRelay:
    directory.model = worker_pb2.WorkerInfo(block_size=16, max_model_len=128, eos_token_ids=[2])
    return DecodeRelay(directory, links, Failover(directory, metrics or FakeMetrics()), detach_grace_s=0.0)


def test_a_decode_worker_is_picked_least_loaded_untried_and_a_sibling_follows_its_leader():
    directory = Directory(meta=None)
    a, b = decode_member(directory, "a"), decode_member(directory, "b", inflight=3)
    relay = decode_relay(directory, FakeLinks({}))
    ask = worker_pb2.DecodeRequest(
        prompt_token_ids=[1] * 20, sampling=generate_pb2.SamplingParams(max_tokens=12)
    )
    assert relay.pick_decode(ask, set(), None) is a and a.free_blocks == 98  # 32 tokens: 2 blocks
    assert relay.pick_decode(ask, set(), None, prefer=b) is b  # a colocated sibling: its leader's worker
    assert relay.pick_decode(ask, {"b"}, None, prefer=b) is a  # ... unless it was tried
    failed = WorkerFailed(Code.UNAVAILABLE, "decode worker a: gone", retry=True)
    with pytest.raises(WorkerFailed) as last:
        relay.pick_decode(ask, {"a", "b"}, failed)
    assert last.value is failed  # none left: the last failure is the answer
    with pytest.raises(RequestRejected) as none:
        relay.pick_decode(ask, {"a", "b"}, None)
    assert none.value.code == Code.UNAVAILABLE


def test_a_stream_that_breaks_resumes_on_another_worker_without_a_token_lost():
    prompt, first_token = [5, 6, 7], 40
    links = FakeLinks(
        {
            "a": [worker_pb2.DecodeResponse(token_ids=[41]), rpc_error(Code.UNAVAILABLE, "connection reset")],
            "b": [worker_pb2.DecodeResponse(token_ids=[42, 43], finish_reason="length")],
        }
    )
    directory, metrics = Directory(meta=None), FakeMetrics()
    a, b = decode_member(directory, "a"), decode_member(directory, "b", inflight=1)
    relay = decode_relay(directory, links, metrics)
    req = Request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    state = OutputState(req, None, (2,), 128)
    state.add_token(first_token)  # the prefill's
    state.emit()
    first = worker_pb2.DecodeRequest(
        request_id="r",
        prompt_token_ids=prompt,
        first_token_id=first_token,
        sampling=generate_pb2.SamplingParams(max_tokens=4),
    )
    h = handle()

    async def relayed() -> list[generate_pb2.GenerateResponse]:
        return [m async for m in relay.relay(h, first, Relay(req, state, {}, (16, 16), h.t0, h.client_id))]

    messages = asyncio.run(relayed())
    assert [list(m.token_ids) for m in messages] == [[41], [42, 43]]
    finished = messages[-1].finished
    assert (finished.finish_reason, finished.output_tokens, finished.cached_tokens) == ("length", 4, 16)
    assert [worker for worker, _ in links.opened] == ["a", "b"]
    resumed = links.opened[1][1]  # the tokens streamed so far are its prompt, the last its first token
    assert list(resumed.prompt_token_ids) == [*prompt, first_token] and resumed.first_token_id == 41
    assert resumed.output_offset == 1 and resumed.sampling.max_tokens == 3
    assert metrics.failovers == [("decode", "UNAVAILABLE")]
    assert a.suspect_until > time.monotonic() + SUSPECT_S / 2  # its connection broke
    assert h.release_pool and h.decode is b and h.calls == []
    assert all(s.cancelled for s in links.streams) and a.inflight == 0 and b.inflight == 1


# -- the failover rules' verbs --------------------------------------------------------------------------
def test_failover_retries_only_what_another_worker_may_serve_within_the_deadline():
    directory, metrics = Directory(meta=None), FakeMetrics()
    worker = decode_member(directory, "w")
    failover = Failover(directory, metrics)
    refused = failover.failed(worker, "prefill", rpc_error(Code.RESOURCE_EXHAUSTED, "queue full"))
    assert refused.retry and refused.code == Code.RESOURCE_EXHAUSTED and "prefill worker w" in str(refused)
    assert worker.suspect_until == 0.0  # it said no: its connection is fine
    bad = failover.failed(worker, "decode", rpc_error(Code.INVALID_ARGUMENT, "bad"))
    assert not bad.retry
    assert failover.retry(handle(), refused, "prefill", tries=1)
    assert not failover.retry(handle(), refused, "prefill", tries=3)  # MAX_RETRIES spent
    assert not failover.retry(handle(aborted=True), refused, "prefill", tries=1)
    assert not failover.retry(Inflight("late", time.monotonic() - 1, 0.0), refused, "prefill", tries=1)
    assert not failover.retry(handle(), bad, "decode", tries=1)
    assert metrics.failovers == [("prefill", "RESOURCE_EXHAUSTED")]
    failover.failed(worker, "decode", rpc_error(Code.UNAVAILABLE, "gone"))
    assert worker.suspect_until > time.monotonic()


# -- the sequences of one request ------------------------------------------------------------------------
class FakeDispatch:
    """`PrefillDispatch.prefill`, answered from a script (or failing), each call recorded."""

    def __init__(self, answer: worker_pb2.PrefillResponse | Exception):
        self.answer = answer
        self.calls: list[tuple[str, int]] = []

    async def prefill(self, handle, sampling, keys, pooled):
        self.calls.append((handle.request_id, max(sampling.n, 1)))  # (unset: one)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def sequences(dispatch=None) -> tuple[Sequences, Admission]:
    metrics = FakeMetrics()
    admission = Admission(RouterConfig(), None, metrics, None, None, {}, None)
    return Sequences(admission, dispatch or FakeDispatch(RuntimeError("no prefill")), metrics), admission


def test_the_leaders_prefill_gives_each_sibling_its_own_first_token():
    leader_answer = worker_pb2.PrefillResponse(
        first_token_id=10, sibling_first_token_ids=[11, 12], blocks=[pool_pb2.BlockLocation()]
    )
    dispatch = FakeDispatch(leader_answer)
    parts, _ = sequences(dispatch)

    async def scenario():
        shared = SharedPrefill(3)
        leader, sibling = handle("r", shared=shared), handle("r-2", shared=shared, index=2)
        mine = asyncio.ensure_future(parts.prefill(sibling))  # waits for the leader's
        await asyncio.sleep(0)
        assert not mine.done()
        return await parts.prefill(leader), await mine

    leader, sibling = asyncio.run(scenario())
    assert dispatch.calls == [("r", 3)]  # one prefill, sampling 3 first tokens
    assert leader.first_token_id == 10 and sibling.first_token_id == 12
    assert len(sibling.blocks) == 1  # the same KV


def test_a_sibling_whose_leader_failed_prefills_alone():
    dispatch = FakeDispatch(RequestRejected(Code.UNAVAILABLE, "no prefill worker is available"))
    parts, _ = sequences(dispatch)

    async def scenario():
        shared = SharedPrefill(2)
        with pytest.raises(RequestRejected):
            await parts.prefill(handle("r", shared=shared))
        with pytest.raises(LeaderGone):
            shared.prefill.result()
        with pytest.raises(RequestRejected):
            await parts.prefill(handle("r-1", shared=shared, index=1))

    asyncio.run(scenario())
    assert dispatch.calls == [("r", 2), ("r-1", 1)]


def test_n_sequences_run_at_once_each_in_flight_with_its_own_seed():
    parts, admission = sequences()
    leader = handle("r", params=SamplingParams(n=3, seed=7), ids=[1, 2])
    leader.track = FakeMetrics().track("http", leader.t0)
    admission.add(leader)
    seen: dict[str, int | None] = {}

    async def run_one(h: Inflight):
        seen[h.request_id] = h.params.seed
        assert admission.holds(h.request_id)
        assert h is leader or h.params.n == 1
        yield generate_pb2.GenerateResponse(request_id=h.request_id, finished=generate_pb2.Finished())

    async def scenario():
        return [(m.request_id, m.index) async for m in parts.run(leader, run_one)]

    got = asyncio.run(scenario())
    assert sorted(got) == [("r", 0), ("r-1", 1), ("r-2", 2)]
    assert seen == {"r": 7, "r-1": 8, "r-2": 9}
    assert [s.request_id for s in leader.siblings] == ["r-1", "r-2"]


def test_a_sibling_id_in_flight_refuses_the_request_and_withdraws_it():
    parts, admission = sequences()
    leader = handle("r", params=SamplingParams(n=3))
    leader.track = FakeMetrics().track("grpc", leader.t0)
    admission.add(leader)
    admission.add(handle("r-2"))  # another request took the id of sequence 2

    async def scenario():
        async for _ in parts.run(leader, run_one=None):
            pass

    with pytest.raises(RequestRejected) as taken:
        asyncio.run(scenario())
    assert taken.value.code == Code.ALREADY_EXISTS and "sequence 2" in str(taken.value)
    assert sorted(admission.inflight) == ["r-2"]  # the request and its first sibling withdrawn


# -- aborts and releases ---------------------------------------------------------------------------------
class FakeWorkerStub:
    def __init__(self, found: bool | Exception):
        self.found = found
        self.asked: list[worker_pb2.WorkerAbortRequest] = []

    async def Abort(self, request, timeout=None):
        self.asked.append(request)
        if isinstance(self.found, Exception):
            raise self.found
        return worker_pb2.WorkerAbortResponse(found=self.found)


def test_an_abort_for_a_request_held_elsewhere_asks_every_decode_worker_for_its_owner():
    directory = Directory(meta=None)
    holder, other, broken = (
        FakeWorkerStub(True),
        FakeWorkerStub(False),
        FakeWorkerStub(rpc_error(Code.UNAVAILABLE)),
    )
    for name, stub in (("a", holder), ("b", other), ("c", broken)):
        decode_member(directory, name, stub=stub)
    releases = Releases(directory, admission=None)
    assert asyncio.run(releases.abort_elsewhere("r", "owner-1"))
    asked = holder.asked[0]
    assert (asked.request_id, asked.check_owner, asked.owner) == ("r", True, "owner-1")
    assert other.asked and broken.asked
    holder.found = False
    assert not asyncio.run(releases.abort_elsewhere("r", "owner-1"))


def test_an_abort_before_the_decode_cancels_the_call_and_after_it_tells_the_worker():
    releases = Releases(Directory(meta=None), admission=None)
    early = handle("early")
    call = FakeStream([])
    early.calls.append(call)
    asyncio.run(releases.abort(early))
    assert early.aborted and call.cancelled
    stub = FakeWorkerStub(True)
    late = handle("late", decode=Member("decode", "d", "d:1", None, stub))
    asyncio.run(releases.abort(late))
    assert late.aborted and [a.request_id for a in stub.asked] == ["late"]


def test_a_release_frees_the_id_even_when_the_workers_cannot_be_reached():
    directory = Directory(meta=None)
    admission = Admission(RouterConfig(), directory, FakeMetrics(), None, None, {}, None)
    releases = Releases(directory, admission)
    stub = FakeWorkerStub(rpc_error(Code.UNAVAILABLE, "gone"))
    h = handle("r", decode=Member("decode", "d", "d:1", None, stub))
    call = FakeStream([])
    h.calls.append(call)
    admission.add(h)
    asyncio.run(releases.end(h, everything=True))
    assert call.cancelled and stub.asked and not admission.holds("r") and not releases.ending


# -- the OpenAI routes -----------------------------------------------------------------------------------
class FakeTokenizer:
    vocab_size = 100
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"t{i}" for i in ids)


def serving(tmp_path) -> OpenAIServing:
    directory = Directory(meta=None)
    router = SimpleNamespace(
        model_dir=tmp_path,  # no chat template there
        cfg=RouterConfig(),
        model_names={"m", "/ckpt/m"},
        served_model_name="m",
        directory=directory,
        tokenizer=FakeTokenizer(),
        draining=False,
    )
    return OpenAIServing(router)


def test_health_says_why_the_router_cannot_serve(tmp_path):
    routes = serving(tmp_path)
    assert asyncio.run(routes.health()).status_code == 503  # no workers yet
    directory = routes.router.directory
    directory.colocated = True
    decode_member(directory, "d")
    assert asyncio.run(routes.health()).status_code == 200
    routes.router.draining = True
    assert b"stopping" in asyncio.run(routes.health()).body


def test_models_detokenize_and_the_model_check(tmp_path):
    routes = serving(tmp_path)
    card = asyncio.run(routes.models())["data"][0]
    assert (card["id"], card["root"]) == ("m", "m") and "max_model_len" not in card
    routes.router.directory.model = worker_pb2.WorkerInfo(max_model_len=64, vocab_size=100)
    assert asyncio.run(routes.models())["data"][0]["max_model_len"] == 64
    body = SimpleNamespace(model="m", tokens=[1, 2])
    assert asyncio.run(routes.detokenize(body)) == {"prompt": "t1 t2"}
    with pytest.raises(ApiError) as bad:
        asyncio.run(routes.detokenize(SimpleNamespace(model=None, tokens=[1, 100])))
    assert (bad.value.status, bad.value.param) == (400, "tokens")
    with pytest.raises(ApiError) as unknown:
        asyncio.run(routes.detokenize(SimpleNamespace(model="other", tokens=[1])))
    assert (unknown.value.status, unknown.value.param) == (404, "model")


def _asgi_post(app, pieces: list[bytes]) -> tuple[list[dict], list[int]]:
    """Drive an ASGI app with one POST whose body comes in `pieces`: (messages it sent, statuses)."""
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)
    ]
    sent: list[dict] = []

    async def receive():
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)  # (the client waits for the answer)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(app(scope, receive, send))
    return sent, [m["status"] for m in sent if m["type"] == "http.response.start"]


def test_the_gate_bounds_the_body_answers_a_route_that_fails_and_counts_every_error():
    from kvferry.router.metrics import RouterMetrics
    from kvferry.router.openai_api import Gate

    seen: list[bytes] = []

    async def app(scope, receive, send):
        message = await receive()
        seen.append(message["body"])
        if message["body"] == b"boom":
            raise RuntimeError("a bug in a route")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    metrics = RouterMetrics("m", None)
    router = SimpleNamespace(cfg=RouterConfig(max_request_bytes=10, api_keys=()), metrics=metrics)
    gate = Gate(app, router)
    # a body in pieces reaches the route whole; one past the limit never does (413), whatever its framing
    assert _asgi_post(gate, [b"abc", b"def"])[1] == [200] and seen == [b"abcdef"]
    assert _asgi_post(gate, [b"0123456", b"789ab"])[1] == [413] and seen == [b"abcdef"]
    # a route that raises: a 500 with an OpenAI error body, not an exception out of the server
    sent, statuses = _asgi_post(gate, [b"boom"])
    assert statuses == [500] and b"internal error (RuntimeError)" in sent[-1]["body"]
    errors = {
        s.labels["code"]: s.value
        for metric in metrics.request_errors.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }
    assert errors == {"413": 1.0, "500": 1.0}
