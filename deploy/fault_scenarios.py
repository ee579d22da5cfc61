"""The fault-injection scenarios: each a function of (Context) -> ScenarioResult, run by the pytest suite
(tests/reliability/test_faults.py) and by `bench/reliability.py` (the table in docs/reliability.md).

Every scenario waits for the cluster's whole topology first (the launcher restarts what an earlier
scenario killed), so they run in any order on one cluster. A mid-load fault lands once a quarter of
the load's tokens have arrived; afterwards the scenario waits for the topology again, checks that
nothing is held anywhere (`FaultCluster.leaks`) and that the cluster serves correct requests.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

import kvferry.rpc as rpc
from kvferry.deploy.fault_harness import (
    PROMPT_LENS,
    FaultCluster,
    Job,
    Load,
    Outcome,
    ScenarioResult,
    wait_for,
)
from kvferry.settings import bare_keys
from kvferry.v1 import generate_pb2, generate_pb2_grpc

FAULT_REQUESTS = 32
FAULT_TOKENS = 48
CONCURRENCY = 8
MAX_INFLIGHT = 12  # the router's --max-inflight in these clusters (above CONCURRENCY)


@dataclass
class Context:
    cluster: FaultCluster
    prompts: list[list[int]]
    refs: list[list[int]]

    def load(self, concurrency: int = CONCURRENCY, resume: bool = False) -> Load:
        return Load(self.cluster.router_addr, self.prompts, self.refs, concurrency, resume)


def jobs(n: int, max_tokens: int = FAULT_TOKENS, **kw) -> list[Job]:
    return [Job(i % len(PROMPT_LENS), max_tokens, **kw) for i in range(n)]


@dataclass
class Begun:
    t0: float
    held: dict[str, int]  # what the members held at the start (0s, unless an earlier scenario leaked)


def begin(ctx: Context) -> Begun:
    """Wait for the whole topology (the launcher restarts what an earlier scenario killed)."""
    ctx.cluster.ensure()
    return Begun(time.monotonic(), ctx.cluster.held())


def finish(ctx: Context, result: ScenarioResult, begun: Begun) -> ScenarioResult:
    """Wait for the topology, check that nothing is held beyond what was at the start, then ask for
    one correct answer per prompt."""
    fc = ctx.cluster
    fc.ensure()
    result.leaked, result.leak_detail = fc.leaks(begun.held)
    if any(begun.held.values()):
        result.notes.append(f"held before the scenario: { {k: v for k, v in begun.held.items() if v} }")
    with ctx.load() as load:
        load.submit(jobs(len(PROMPT_LENS), 16))
        after = load.wait()
    bad = [o for o in after if o.kind != "ok"]
    result.wrong += sum(o.kind == "wrong" for o in after)
    result.hung += sum(o.kind == "hung" for o in after)
    result.expect(not bad, f"after the fault {len(bad)} of {len(after)} requests were not correct: {bad[:2]}")
    result.notes += fc.new_events()
    result.seconds = round(time.monotonic() - begun.t0, 1)
    return result


def mid_load(
    ctx: Context, name: str, expectation: str, fault: Callable[[], None], resume: bool = False
) -> ScenarioResult:
    """FAULT_REQUESTS greedy requests, CONCURRENCY at a time; `fault()` once a quarter of their tokens
    arrived. `resume`: the clients resume a stream their router dropped, as kvferry's client does."""
    begun = begin(ctx)
    with ctx.load(resume=resume) as load:
        load.submit(jobs(FAULT_REQUESTS))
        wait_for(lambda: load.tokens >= FAULT_REQUESTS * FAULT_TOKENS // 4, 60, "the load to get going")
        fault()
        outcomes = load.wait()
        resumed = load.resumed
    r = ScenarioResult(name, expectation).add(outcomes)
    r.resumed = resumed
    if resumed:
        r.notes.append(f"resumed: {resumed}")
    return finish(ctx, r, begun)


def clean_codes(result: ScenarioResult, allowed: tuple[str, ...]) -> None:
    other = {c: n for c, n in result.codes.items() if c not in allowed}
    result.expect(not other, f"failures other than {'/'.join(allowed)}: {other}")


# -- process faults ------------------------------------------------------------------------------------
# the router re-dispatches a request whose prefill or decode worker died (router.failover): every request
# of a worker-kill scenario completes correctly
def kill_prefill(ctx: Context) -> ScenarioResult:
    r = mid_load(ctx, "kill -9 prefill-0", "all correct (failover)", lambda: ctx.cluster.kill("prefill-0"))
    r.expect(r.ok == r.sent, f"{r.ok} of {r.sent} correct, want all (the router re-dispatches)")
    clean_codes(r, ("UNAVAILABLE", "abort"))
    return r


def kill_decode(ctx: Context) -> ScenarioResult:
    r = mid_load(ctx, "kill -9 decode-0", "all correct (failover)", lambda: ctx.cluster.kill("decode-0"))
    r.expect(r.ok == r.sent, f"{r.ok} of {r.sent} correct, want all (the router re-dispatches)")
    clean_codes(r, ("UNAVAILABLE", "abort"))
    return r


def kill_pool(ctx: Context) -> ScenarioResult:
    r = mid_load(
        ctx,
        "kill -9 pool-0",
        "requests complete (decode recomputes); clean failures allowed",
        lambda: ctx.cluster.kill("pool-0"),
    )
    r.expect(r.ok >= r.sent // 2, f"only {r.ok} of {r.sent} correct")
    clean_codes(r, ("UNAVAILABLE", "abort"))
    return r


def kill_redis(ctx: Context) -> ScenarioResult:
    r = mid_load(
        ctx,
        "kill -9 redis (launcher restarts it)",
        "all complete (lookups miss while it is down)",
        lambda: ctx.cluster.kill("redis"),
    )
    r.expect(r.ok == r.sent, f"{r.sent - r.ok} of {r.sent} did not complete")
    return r


def kill_router(ctx: Context) -> ScenarioResult:
    r = mid_load(
        ctx,
        "kill -9 router (launcher restarts it)",
        "all correct: clients resume their streams (decode held them); workers release",
        lambda: ctx.cluster.kill("router"),
        resume=True,
    )
    r.expect(r.ok == r.sent, f"{r.ok} of {r.sent} correct, want all (the clients resume)")
    r.expect(r.resumed > 0, "no stream was resumed: nothing was in flight when the router died")
    return r


def pause_decode(ctx: Context, seconds: float = 10.0) -> ScenarioResult:
    timers = []
    r = mid_load(
        ctx,
        f"SIGSTOP decode-0 {seconds:.0f} s, SIGCONT",
        "late or clean failures; none wrong or hung",
        lambda: timers.append(ctx.cluster.pause("decode-0", seconds)),
    )
    for timer in timers:
        timer.join()
    clean_codes(r, ("UNAVAILABLE", "abort", "DEADLINE_EXCEEDED"))
    return r


# -- overload --------------------------------------------------------------------------------------------
def overload(ctx: Context, factor: int, bursts: int = 3) -> ScenarioResult:
    """`bursts` bursts of factor x --max-inflight requests at once: the excess is refused
    RESOURCE_EXHAUSTED at once, what is admitted completes correctly."""
    begun = begin(ctx)
    burst = factor * MAX_INFLIGHT
    r = ScenarioResult(
        f"overload {factor}x (bursts of {burst})", "excess RESOURCE_EXHAUSTED fast, admitted correct"
    )
    with ctx.load(concurrency=burst) as load:
        for _ in range(bursts):
            load.submit(jobs(burst, 32))
            outcomes = load.wait()
            r.add(outcomes)
            refused = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
            slow = max((o.seconds for o in refused), default=0.0)
            r.expect(slow < 2.0, f"a refusal took {slow:.1f}s")
            r.expect(refused, f"a burst of {burst} over --max-inflight {MAX_INFLIGHT}: nothing refused")
    r.notes.append(f"admitted and correct: {r.ok}; refused: {r.codes.get('RESOURCE_EXHAUSTED', 0)}")
    r.expect(r.ok >= bursts * MAX_INFLIGHT // 2, f"only {r.ok} admitted and correct")
    clean_codes(r, ("RESOURCE_EXHAUSTED",))
    return finish(ctx, r, begun)


# -- cancellations -----------------------------------------------------------------------------------------
def cancellations(ctx: Context, n: int = 1000, seed: int = 7) -> ScenarioResult:
    """n requests, each ended early a different way: the client cancels the stream, calls the router's
    Abort RPC, or sets a short deadline, at a random 0-300 ms (some finish first)."""
    begun = begin(ctx)
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        at = rng.uniform(0.0, 0.3)
        job = Job(
            i % len(PROMPT_LENS), rng.choice((8, 32, 48)), request_id=f"cancel-{i}-{uuid.uuid4().hex[:6]}"
        )
        how = i % 3
        if how == 0:
            job.cancel_after_s = at
        elif how == 1:
            job.abort_after_s = at
        else:
            job.deadline_s, job.short_deadline = max(0.01, at), True
        plan.append(job)
    r = ScenarioResult(f"{n} cancels / Aborts / short deadlines", "nothing leaks; then a correct answer")
    with ctx.load(concurrency=CONCURRENCY) as load:
        load.submit(plan)
        r.add(load.wait())
    clean_codes(r, ("CANCELLED", "DEADLINE_EXCEEDED", "abort", "RESOURCE_EXHAUSTED"))
    return finish(ctx, r, begun)


# -- fuzz ------------------------------------------------------------------------------------------------
INT32_MAX = 2**31 - 1
FLOATS = (math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 1e-30, 0.5, 1.0, 1.5, 1e30)
INTS = (-(2**31), -1, 0, 1, 2, 16, 1023, 1024, 8191, 8192, INT32_MAX)


def _mutations(rng: random.Random, vocab: int) -> dict[str, Callable[[generate_pb2.GenerateRequest], None]]:
    """field -> a function that sets it (in place) to a random edge or ordinary value."""

    def ids(req):
        length = rng.choice((0, 1, 5, 40, 1022, 1023, 1024, 3000))
        values = [rng.randrange(vocab) for _ in range(length)]
        if values and rng.random() < 0.5:
            bad = rng.choice((-1, -(2**31), vocab, vocab + 1, INT32_MAX))
            values[rng.randrange(length)] = bad
        req.token_ids.CopyFrom(generate_pb2.TokenIds(ids=values))

    def text(req):
        req.text = rng.choice(
            ("", "hello", "\x00", "\U0001f642" * 50, " \n\t", "a" * rng.choice((5000, 70000)))
        )

    def unset_prompt(req):
        req.ClearField("token_ids")
        req.ClearField("text")

    s = lambda req: req.sampling  # noqa: E731
    return {
        "token_ids": ids,
        "text": text,
        "no prompt": unset_prompt,
        "temperature": lambda req: setattr(s(req), "temperature", rng.choice(FLOATS)),
        "top_k": lambda req: setattr(s(req), "top_k", rng.choice(INTS)),
        "top_p": lambda req: setattr(s(req), "top_p", rng.choice(FLOATS)),
        "seed": lambda req: setattr(s(req), "seed", rng.choice((0, 1, 2**63, 2**64 - 1))),
        "max_tokens": lambda req: setattr(s(req), "max_tokens", rng.choice(INTS)),
        "no max_tokens": lambda req: s(req).ClearField("max_tokens"),
        "stop": lambda req: s(req).stop.extend(
            rng.choice(([""], ["a"], ["x" * 257], ["s"] * 17, ["\x00"], ["\U0001f642"], ["e", " "]))
        ),
        "stop_token_ids": lambda req: s(req).stop_token_ids.extend(
            rng.choice(([-1], [vocab], [0], [INT32_MAX], list(range(129)), [5] * 3))
        ),
        "ignore_eos": lambda req: setattr(s(req), "ignore_eos", not s(req).ignore_eos),
        "request_id": lambda req: setattr(
            req,
            "request_id",
            rng.choice(("x" * 256, "x" * 257, "x" * 10000, "\U0001f642", "\x00", "a/b", " ")),
        ),
    }


def fuzz_request(rng: random.Random, vocab: int) -> tuple[generate_pb2.GenerateRequest, list[str]]:
    """A valid greedy request with 1-3 of its fields (see _mutations) set to random edge or ordinary
    values; returns it and the fields changed."""
    req = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]),
        sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )
    mutations = _mutations(rng, vocab)
    changed = rng.sample(sorted(mutations), rng.randint(1, 3))
    for name in changed:
        mutations[name](req)
    return req, changed


RELEASE_GRACE_S = 15.0  # how long after its cancel an id may still be held by its request's release


def fuzz(ctx: Context, n: int = 300, seed: int = 11) -> ScenarioResult:
    """n fuzzed requests, one at a time: each is accepted (its first message arrives; then the client
    cancels it) or refused INVALID_ARGUMENT; never another status, never a crash."""
    fc = ctx.cluster
    begun = begin(ctx)
    rng = random.Random(seed)
    stub = generate_pb2_grpc.GenerationStub(rpc.channel(fc.router_addr))
    vocab = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10).vocab_size
    r = ScenarioResult(
        f"fuzz: {n} GenerateRequests", "each accepted or INVALID_ARGUMENT; the router serves on"
    )
    # id -> when a request with it was last cancelled: the router keeps an id until that request's
    # release has ended (`Releases.end`), which on a busy host can outlast the next few requests
    cancelled_at: dict[str, float] = {}
    for _ in range(n):
        req, changed = fuzz_request(rng, vocab)
        what = f"{changed}: {str(req)[:160]!r}"
        started = time.monotonic()
        call = stub.Generate(req, timeout=30)
        try:
            next(call)
            outcome = Outcome("ok", "", 0, time.monotonic() - started)
        except StopIteration:
            outcome = Outcome("failed", "NO_FINISH", 0, time.monotonic() - started, what)
        except grpc.RpcError as err:
            code = err.code().name
            reused = time.monotonic() - cancelled_at.get(req.request_id, -1e9) < RELEASE_GRACE_S
            if code == "ALREADY_EXISTS" and not (req.request_id and reused):
                code = "ALREADY_EXISTS for an id not just used"  # a clean answer only for a reused id
            kind = "hung" if code == "DEADLINE_EXCEEDED" else "failed"
            outcome = Outcome(
                kind, code, 0, time.monotonic() - started, f"{err.details()} <- {str(req)[:200]}"
            )
        finally:
            call.cancel()
        if req.request_id and outcome.kind == "ok":
            cancelled_at[req.request_id] = time.monotonic()
        r.add([outcome])
    r.notes.append(f"accepted {r.ok}, refused INVALID_ARGUMENT {r.codes.get('INVALID_ARGUMENT', 0)}")
    clean_codes(r, ("INVALID_ARGUMENT", "ALREADY_EXISTS"))
    died = fc.new_events()
    r.notes += died
    r.expect(not died, "a process died during the fuzz")
    return finish(ctx, r, begun)


# -- authentication ---------------------------------------------------------------------------------------
def _probes(fc: FaultCluster) -> list[tuple]:
    """(address, method, request, server-streaming) of calls on every service of every port."""
    from kvferry.v1 import pool_pb2, worker_pb2

    calls = [
        (fc.router_addr, "/kvferry.v1.Generation/GetModelInfo", generate_pb2.GetModelInfoRequest(), False),
        (fc.router_addr, "/kvferry.v1.Generation/Generate", generate_pb2.GenerateRequest(text="hi"), True),
        (fc.router_addr, "/kvferry.v1.Generation/Abort", generate_pb2.AbortRequest(request_id="x"), False),
        (
            fc.router_addr,
            "/kvferry.v1.Generation/GetRequestStatus",
            generate_pb2.RequestStatusRequest(request_id="x"),
            False,
        ),
    ]
    members = fc.members()
    for addr in members["prefill"].values():
        calls += [
            (addr, "/kvferry.v1.PrefillWorker/GetStats", worker_pb2.WorkerStatsRequest(), False),
            (addr, "/kvferry.v1.PrefillWorker/GetWorkerInfo", worker_pb2.WorkerInfoRequest(), False),
            (addr, "/kvferry.v1.PrefillWorker/Prefill", worker_pb2.PrefillRequest(request_id="x"), False),
        ]
    for addr in members["decode"].values():
        calls += [
            (addr, "/kvferry.v1.DecodeWorker/GetStats", worker_pb2.WorkerStatsRequest(), False),
            (addr, "/kvferry.v1.DecodeWorker/Abort", worker_pb2.WorkerAbortRequest(request_id="x"), False),
            (addr, "/kvferry.v1.DecodeWorker/Decode", worker_pb2.DecodeRequest(request_id="x"), True),
            (
                addr,
                "/kvferry.v1.DecodeWorker/GetRequestStatus",
                worker_pb2.WorkerRequestStatusRequest(request_id="x"),
                False,
            ),
        ]
    for addr in members["pool"].values():
        calls += [
            (addr, "/kvferry.v1.KVPool/GetStats", pool_pb2.PoolStatsRequest(), False),
            (addr, "/kvferry.v1.KVPool/Release", pool_pb2.ReleaseRequest(request_id="x"), False),
            (addr, "/kvferry.v1.KVPool/Reserve", pool_pb2.ReserveRequest(peer_id="x", count=1), False),
        ]
    return calls


def _call(addr: str, method: str, request, streaming: bool, metadata=()) -> str:
    """The status code name of one call made on a bare channel (no cluster secret: this client stands
    for an outsider, so it does not use kvferry.rpc), or "OK"."""
    with grpc.insecure_channel(addr) as ch:
        make = ch.unary_stream if streaming else ch.unary_unary
        rpc_ = make(
            method, request_serializer=type(request).SerializeToString, response_deserializer=lambda b: b
        )
        try:
            answer = rpc_(request, timeout=10, metadata=metadata)
            if streaming:
                for _ in answer:
                    pass
        except grpc.RpcError as err:
            return err.code().name
    return "OK"


def unauthenticated(ctx: Context) -> ScenarioResult:
    """Every worker, pool node and router RPC refuses a call without the cluster secret (and with a wrong
    one); with API keys, the router refuses a client without a key or with a wrong one, and serves one
    with the key."""
    fc = ctx.cluster
    begun = begin(ctx)
    r = ScenarioResult("unauthenticated client, every port", "every call UNAUTHENTICATED")
    for addr, method, request, streaming in _probes(fc):
        for metadata in ((), (("x-kvferry-secret", "wrong"),), (("authorization", "Bearer wrong"),)):
            code = _call(addr, method, request, streaming, metadata)
            r.add([Outcome("failed", code, detail=f"{method} on {addr}")])
            r.expect(code == "UNAUTHENTICATED", f"{method} on {addr} with {metadata or 'nothing'}: {code}")
    if fc.api_keys:
        key_md = (("authorization", f"Bearer {bare_keys(fc.api_keys)[0]}"),)
        code = _call(
            fc.router_addr,
            "/kvferry.v1.Generation/GetModelInfo",
            generate_pb2.GetModelInfoRequest(),
            False,
            key_md,
        )
        r.expect(code == "OK", f"the router refused its API key: {code}")
        r.notes.append(f"router with API keys: no key / wrong key refused; the right key served ({code})")
    else:
        r.notes.append("SKIPPED the API-key half: the cluster was started without API keys")
    redis_note = _redis_refuses(fc)
    if redis_note:
        r.notes.append(redis_note)
    r.expect(r.failed > 0, "no probe ran")
    return finish(ctx, r, begun)


def _redis_refuses(fc: FaultCluster) -> str:
    """Whether the cluster's redis refuses a client without its password ("" when it has none)."""
    from urllib.parse import urlparse

    import redis

    url = urlparse(fc.local.redis_url)
    if not url.password:
        return "redis runs without a password"
    try:
        redis.Redis(host=url.hostname, port=url.port, socket_timeout=5).ping()
    except redis.AuthenticationError:
        return "redis refuses a client without its password"
    except redis.RedisError as err:
        return f"redis without its password: {type(err).__name__}"
    return "redis ANSWERS a client without its password"


SCENARIOS: dict[str, Callable[[Context], ScenarioResult]] = {
    "auth": unauthenticated,
    "fuzz": fuzz,
    "overload-2x": lambda ctx: overload(ctx, 2),
    "overload-4x": lambda ctx: overload(ctx, 4),
    "cancels": cancellations,
    "pause-decode": pause_decode,
    "kill-redis": kill_redis,
    "kill-router": kill_router,
    "kill-prefill": kill_prefill,
    "kill-decode": kill_decode,
    "kill-pool": kill_pool,
}
