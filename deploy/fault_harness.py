"""The fault-injection harness: a real local cluster, a load of greedy requests checked token by token
against a reference, and a leak check once the cluster is idle again.

Used by the pytest suite in tests/reliability/ and by `bench/reliability.py`, so a figure in
docs/reliability.md and a test failure come from the same code.

How one scenario reads: `FaultCluster.ensure(...)` the topology it needs -> `Load.submit(jobs)` ->
wait until requests are in flight -> inject the fault (`kill`, `pause`, ...) -> `Load.wait()` -> leak
check -> `ScenarioResult`. Every request is classified as exactly one of

- ok: finish_reason "length" with every token equal to the reference;
- failed (cleanly): a gRPC status, or finish_reason "abort", and no wrong token before it;
- wrong: a token that differs from the reference, or a finish that contradicts the request;
- hung: it ran past its deadline + slack, or a generous deadline (one the request was not meant to
  hit) ran out: without the deadline it would still be waiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
import torch

import kvferry.rpc as rpc
from kvferry.auth import SECRET_ENV
from kvferry.deploy.config import ClusterConfig, WorkerGroupSettings
from kvferry.deploy.local import LocalCluster
from kvferry.kvpool.config import PoolConfig
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import MAX_RESUMES, ResumingStream
from kvferry.router.config import RouterConfig
from kvferry.v1 import generate_pb2, generate_pb2_grpc, pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

ENGINE = {"max_model_len": 1024, "num_kv_blocks": 256, "max_num_batched_tokens": 512}
PROMPT_LENS = (5, 12, 17, 24, 31, 40, 50, 64)  # partial and full blocks of 16
MAX_TOKENS = 32
DEADLINE_S = 60.0  # generous: a request of <= 48 tokens that runs into it counts as hung
SLACK_S = 5.0
UNCLEAN = ("INTERNAL", "UNKNOWN", "DATA_LOSS", "NO_FINISH")  # failures that are not clean


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def process_alive(pid: int) -> bool:
    """The process runs: not gone, and not a zombie (dead, its parent not yet reaping it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- the reference -----------------------------------------------------------------------------------
def fixed_prompts(vocab_size: int = 8192) -> list[list[int]]:
    gen = torch.Generator().manual_seed(20240611)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def reference_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int = 48) -> list[list[int]]:
    """Greedy continuations (ignore_eos) of each prompt by the engine in this process, float32: a
    request for fewer tokens must equal a prefix of its prompt's reference."""
    from kvferry.engine.engine import EngineConfig, LLMEngine
    from kvferry.engine.request import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", max_model_len=1024, num_kv_blocks=64)
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    refs = []
    for ids in prompts:
        tokens = []
        for out in engine.stream(params=params, prompt_token_ids=ids):
            tokens += out.new_token_ids
        refs.append(tokens)
    return refs


# -- the cluster -------------------------------------------------------------------------------------
class FaultCluster:
    """A LocalCluster (its own redis, 1 pool node, `prefill` + `decode` single-rank workers, a router)
    that scenarios kill, pause and wait to come back. Runs with a cluster secret (this process's
    channels carry it too, until `stop`) and, when the launcher supports them, router API keys.

    The launcher restarts a unit that died (deploy.restarts), so a scenario kills and then waits for the
    topology it needs (`ensure`); it never starts processes itself."""

    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        prefill: int = 2,
        decode: int = 2,
        max_inflight: int = 256,
        secret: str = "reliability-secret",
        api_keys: tuple[str, ...] = (),
    ):
        self.workdir = workdir
        self.secret = secret
        self.api_keys = tuple(api_keys)
        router = RouterConfig(port=0, http_port=None, max_inflight=max_inflight, api_keys=self.api_keys)
        self.cfg = ClusterConfig(
            model=str(model_dir),
            dtype="float32",
            namespace="faults",
            pool=PoolConfig(nodes=1, memory_gib=0.25),
            prefill=WorkerGroupSettings(replicas=prefill, engine=ENGINE),
            decode=WorkerGroupSettings(replicas=decode, engine=ENGINE),
            router=router,
            startup_timeout_s=180.0,
            drain_timeout_s=5.0,
        )
        self.want = (prefill, decode, 1)
        self.local: LocalCluster | None = None
        self._events_seen = 0
        self._saved_env: str | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> FaultCluster:
        self._saved_env = os.environ.get(SECRET_ENV)
        os.environ[SECRET_ENV] = self.secret  # the children's (LocalCluster passes it on) and ours
        self.local = LocalCluster(self.cfg, log_dir=self.workdir / "logs", quiet=True)
        try:
            self.local.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop(timeout_s=5)
        if self._saved_env is None:
            os.environ.pop(SECRET_ENV, None)
        else:
            os.environ[SECRET_ENV] = self._saved_env

    def __enter__(self) -> FaultCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def router_addr(self) -> str:
        return self.local.router_addr

    @property
    def restarts_units(self) -> bool:
        """Whether the launcher restarts a unit that died (deploy.restarts)."""
        return hasattr(self.local, "tend")

    def new_events(self) -> list[str]:
        """The launcher's reports (restarts, units left down) since the last call."""
        events = getattr(self.local, "events", [])
        new, self._events_seen = events[self._events_seen :], len(events)
        return [e.removeprefix("kvferry: ") for e in new]

    # -- processes ----------------------------------------------------------------------------------
    def child(self, name: str):
        for child in self.local.children:
            if child.name == name:
                return child
        raise KeyError(f"no child process named {name!r}")

    def alive(self, role: str) -> list[str]:
        """Names of the running processes of a role (prefill, decode, pool, router, redis)."""
        return [c.name for c in self.local.children if _kind(c.name) == role and c.proc.poll() is None]

    def kill(self, name: str) -> None:
        """kill -9 one child and reap it (the launcher restarts it after its backoff)."""
        proc = self.child(name).proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def pause(self, name: str, seconds: float) -> threading.Timer:
        """SIGSTOP a child now and SIGCONT it `seconds` later (a timer thread, returned)."""
        pid = self.child(name).proc.pid
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
        timer.start()
        return timer

    def ensure(self, timeout: float = 120.0) -> None:
        """Wait until the router reports the cluster's whole topology again (after kills: the launcher
        restarts what died) and every process runs."""
        if not self.restarts_units:
            raise RuntimeError("this launcher does not restart dead units (deploy.restarts)")
        want = self.want

        def ready():
            if any(c.proc.poll() is not None for c in self.local.children):
                return False  # a unit waits for its restart
            try:
                info = self.router_stub().GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=2)
                addrs = [a for members in self.members().values() for a in members.values()]
            except (grpc.RpcError, redis.RedisError):
                return False
            have = (info.num_prefill_workers, info.num_decode_workers, info.num_pool_nodes)
            return have == want and len(addrs) == sum(want) and all(rpc.check_health(a) for a in addrs)

        wait_for(ready, timeout, f"the router to report prefill/decode/pool {want}")

    # -- stubs and stats ------------------------------------------------------------------------------
    def router_stub(self) -> generate_pb2_grpc.GenerationStub:
        return generate_pb2_grpc.GenerationStub(rpc.channel(self.router_addr))

    def members(self) -> dict[str, dict[str, str]]:
        """role -> {member id: address} of the registry's members whose process runs."""
        meta = MetadataStore(self.local.redis_url, self.cfg.namespace)
        out = {}
        for role in ("prefill", "decode", "pool"):
            live = set(self.alive(role))
            known = meta.members(role) or {}  # None: Redis is unreachable (restarting): none known yet
            out[role] = {k: v["addr"] for k, v in known.items() if k in live}
        return out

    def held(self) -> dict[str, int]:
        """What each live worker and pool node holds now, by "<member> <what>" (0 everywhere when idle):
        KV blocks in use and requests it knows (workers), private blocks and leased blocks (pool)."""
        held = {}
        for role, members in self.members().items():
            for member, addr in members.items():
                with rpc.channel(addr) as ch:
                    if role == "pool":
                        s = pool_pb2_grpc.KVPoolStub(ch).GetStats(pool_pb2.PoolStatsRequest(), timeout=10)
                        held[f"{member} private blocks"] = s.private_blocks
                        held[f"{member} leased blocks"] = sum(s.leases.values())
                        continue
                    s = STUBS[role](ch).GetStats(worker_pb2.WorkerStatsRequest(), timeout=10)
                    held[f"{member} kv blocks"] = s.total_blocks - s.free_blocks
                    held[f"{member} requests"] = max(
                        len(s.active_request_ids), s.running + s.waiting + s.waiting_for_kv
                    )
        return held

    def leaks(
        self, before: dict[str, int] | None = None, timeout: float = 30.0
    ) -> tuple[int, dict[str, int]]:
        """Wait (up to `timeout`) until no live member holds more than it did `before` (a snapshot of
        `held()`; None: nothing); returns what is still held beyond that."""
        before = before or {}
        deadline = time.monotonic() + timeout
        while True:
            try:
                held = self.held()
            except (grpc.RpcError, redis.RedisError) as err:  # a member restarting, a stale registry entry
                held = {f"unreachable: {err!r}"[:120]: 1}
            extra = {k: v - before.get(k, 0) for k, v in held.items() if v > before.get(k, 0)}
            if not extra or time.monotonic() > deadline:
                return sum(extra.values()), extra
            time.sleep(0.2)


STUBS = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub}


def _kind(name: str) -> str:
    """prefill-3 -> prefill, pool-0 -> pool, router -> router."""
    return name.rsplit("-", 1)[0]


# -- the load ------------------------------------------------------------------------------------------
@dataclass
class Job:
    prompt: int  # index into the prompt set
    max_tokens: int = MAX_TOKENS
    deadline_s: float = DEADLINE_S
    short_deadline: bool = False  # the deadline is meant to be hit (it is not a hang)
    cancel_after_s: float | None = None  # the client cancels the stream
    abort_after_s: float | None = None  # the client calls the router's Abort RPC
    request_id: str = ""


@dataclass
class Outcome:
    kind: str  # ok | failed | wrong | hung
    code: str = ""  # the gRPC status name, "abort", or "" when ok
    tokens: int = 0
    seconds: float = 0.0
    detail: str = ""


class Load:
    """Runs Jobs against the router, `concurrency` at a time, each on its own stream with a deadline."""

    def __init__(
        self,
        addr: str,
        prompts: list[list[int]],
        refs: list[list[int]],
        concurrency: int = 8,
        resume: bool = False,
    ):
        self.resume = resume  # a stream its router dropped is resumed (GenerateRequest.resume)
        self.resumed = 0  # streams resumed (or, broken before their decode, sent again)
        self.channel = rpc.channel(addr)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.prompts, self.refs = prompts, refs
        self.pool = ThreadPoolExecutor(concurrency)
        self.futures: list[Future] = []
        self.tokens = 0  # received so far, over every request (to inject a fault mid-load)
        self.started = 0
        self._lock = threading.Lock()

    def submit(self, jobs: list[Job], interval_s: float = 0.0) -> None:
        for job in jobs:
            self.futures.append(self.pool.submit(self.one, job))
            if interval_s:
                time.sleep(interval_s)  # pacing an open-loop arrival rate, not waiting for a state

    def wait(self) -> list[Outcome]:
        outcomes = [f.result() for f in self.futures]
        self.futures = []
        return outcomes

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.channel.close()

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def one(self, job: Job) -> Outcome:
        with self._lock:
            self.started += 1
        request = generate_pb2.GenerateRequest(
            request_id=job.request_id,
            token_ids=generate_pb2.TokenIds(ids=self.prompts[job.prompt]),
            sampling=generate_pb2.SamplingParams(temperature=0.0, max_tokens=job.max_tokens, ignore_eos=True),
        )
        ref = self.refs[job.prompt][: job.max_tokens]
        t0 = time.monotonic()
        got: list[int] = []
        reason = None
        # resumed (self.resume) by kvferry's own client code when its router goes away
        stream = ResumingStream(
            self.stub, self.channel, request, job.deadline_s, MAX_RESUMES if self.resume else 0
        )
        timers = []
        if job.cancel_after_s is not None:
            timers.append(threading.Timer(job.cancel_after_s, stream.cancel))
        if job.abort_after_s is not None:
            timers.append(threading.Timer(job.abort_after_s, self._abort, (job.request_id,)))
        for timer in timers:
            timer.start()
        try:
            for msg in stream:
                got += msg.token_ids
                with self._lock:
                    self.tokens += len(msg.token_ids)
                if got != ref[: len(got)]:
                    stream.cancel()
                    return Outcome("wrong", "", len(got), time.monotonic() - t0, f"{got} != {ref}")
                if msg.HasField("finished"):
                    reason = msg.finished.finish_reason
        except grpc.RpcError as err:
            return self._failed(job, err.code().name, len(got), time.monotonic() - t0, err.details() or "")
        finally:
            for timer in timers:
                timer.cancel()
            with self._lock:
                self.resumed += stream.resumes
        elapsed = time.monotonic() - t0
        if reason == "abort":
            return self._failed(job, "abort", len(got), elapsed, "")
        if reason is None:
            return Outcome("failed", "NO_FINISH", len(got), elapsed, "the stream ended without `finished`")
        if reason != "length" or got != ref:
            return Outcome("wrong", reason, len(got), elapsed, f"finish {reason!r} after {len(got)} tokens")
        return Outcome("ok", "", len(got), elapsed)

    def _failed(self, job: Job, code: str, tokens: int, seconds: float, detail: str) -> Outcome:
        overdue = seconds > job.deadline_s + SLACK_S
        if overdue or (code == "DEADLINE_EXCEEDED" and not job.short_deadline):
            return Outcome("hung", code, tokens, seconds, detail)
        return Outcome("failed", code, tokens, seconds, detail)

    def _abort(self, request_id: str) -> None:
        with contextlib.suppress(grpc.RpcError):  # it may have finished, or not be admitted yet
            self.stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=10)


# -- results ---------------------------------------------------------------------------------------------
@dataclass
class ScenarioResult:
    name: str
    expectation: str  # what the scenario expects, in words (the table's last column)
    sent: int = 0
    ok: int = 0
    failed: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    hung: int = 0
    leaked: int = 0
    leak_detail: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    resumed: int = 0  # streams the clients resumed (scenarios whose clients resume)
    examples: list[str] = field(default_factory=list)  # a few details of wrong / hung / unclean ones
    problems: list[str] = field(default_factory=list)  # scenario-specific expectations not met

    def add(self, outcomes: list[Outcome]) -> ScenarioResult:
        for o in outcomes:
            self.sent += 1
            if o.kind == "ok":
                self.ok += 1
            elif o.kind == "failed":
                self.failed += 1
            elif o.kind == "wrong":
                self.wrong += 1
            else:
                self.hung += 1
            if o.code:
                self.codes = dict(Counter(self.codes) + Counter({o.code: 1}))
            if (o.kind in ("wrong", "hung") or o.code in UNCLEAN) and len(self.examples) < 5:
                self.examples.append(
                    f"{o.kind} {o.code} after {o.tokens} tokens, {o.seconds:.1f}s: {o.detail}"
                )
        return self

    @property
    def unclean(self) -> int:
        return sum(n for code, n in self.codes.items() if code in UNCLEAN)

    def expect(self, condition: bool, problem: str) -> None:
        """Record a scenario-specific expectation that did not hold (the test asserts there are none)."""
        if not condition:
            self.problems.append(problem)

    @property
    def passed(self) -> bool:
        return not (self.wrong or self.hung or self.leaked or self.unclean or self.problems)
