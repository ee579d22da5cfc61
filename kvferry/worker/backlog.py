"""A prefill worker's backlog, published for the routers' SLO admission (`router.slo`).

With several routers, none of them sees every prefill a worker holds, so the worker says what it holds:
per priority, the prompt tokens it still has to compute, split into **queued** (in its prefix lookup or
pull, in the engine's waiting queue, or preempted) and **running** (in the engine's batch, chunks left),
each as `[tokens, requests, steps, kpairs]`: the steps are the chunks of the token budget the tokens take
and the kpairs their attention (query, key) pairs in thousands, so a router prices the figure with the
worker's own step model exactly as it prices one prompt (`engine.cost_model.StepCost.prompt_ms`, summed).
A request not in the engine's batch yet counts its prompt less the pool hits the router's lookup found
(what the worker will pull rather than compute); once in the batch, what the engine says it computed.

The record (compact JSON):

    {"b": boot, "s": seq, "t": unix time, "p": {"<priority>": {"q": [...], "r": [...]}}, "ids": [...]}

`b` is a random id of the publishing process, `s` counts its snapshots (a reader keeps the newest), and
`ids` are the CRC-32s of the request ids admitted in the last RECENT_S: a router counts a prefill it sent
on top of the figures until the prefill's id is in `ids` (from then on the figures hold it).

Where: the hash `kvf:{namespace}:prefill_backlog` (field: worker id), written by `BacklogPublisher`, a
thread of its own (never the engine thread), when the figure changed (an engine step or an admission
since the last write), at most every PUBLISH_INTERVAL_S, and every KEEPALIVE_S regardless (a reader takes
a record that stopped changing for a few seconds as stale); and the same record, refreshed each beat, as
the registry heartbeat's `prefill_backlog` field. The engine thread only adds an entry per admitted
request (`admitted`); the snapshot walks the requests the worker holds (a few hundred at most, read-only)
on the publishing thread, and only when a step or an admission happened since the last one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis

from kvferry.engine.request import Request, RequestStatus
from kvferry.kvpool.metadata import PREFILL_BACKLOG_KEY, request_digest

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.05  # at most one write this often
KEEPALIVE_S = 1.0  # a write this often even when nothing changed
KEY_TTL_S = 30.0  # the hash goes when no worker has written it for this long
RECENT_S = 3.0  # admitted request ids published this long (a router waits at most 2 s for its own)
MAX_RECENT = 4096
HOLD_GRACE_S = 1.0  # a request admitted but not (yet) held by the worker's call still counts this long
MAX_TRACKED = 8192  # past this many entries an admission drops the finished ones (no snapshot taken them)


@dataclass
class _Held:
    req: Request
    cached: int  # prompt tokens expected from the pool before the engine says (the router's lookup)
    at: float  # time.monotonic() of its admission


class BacklogTracker:
    """The prefill requests a worker holds, and snapshots of the work they still need.

    `holds(request_id)`: whether the worker still serves that call; `steps()`: the engine's step count
    (a change of either is what `changed` looks for). `admitted` runs on the engine thread; `changed` and
    `snapshot` on any other (a lock keeps two snapshots apart)."""

    def __init__(self, budget: int, holds: Callable[[str], bool], steps: Callable[[], int]):
        self.budget = max(1, budget)
        self.holds = holds
        self.steps = steps
        self.boot = uuid.uuid4().hex[:8]
        self.seq = 0
        self._held: dict[str, _Held] = {}
        self._recent: deque[tuple[float, int]] = deque(maxlen=MAX_RECENT)
        self._admissions = 0
        self._seen: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def admitted(self, req: Request, cached_tokens: int = 0) -> None:
        """Engine thread: the worker took `req` on (`cached_tokens`: its prompt tokens the pool holds)."""
        cached = max(0, min(cached_tokens, req.num_prompt_tokens - 1))
        if len(self._held) >= MAX_TRACKED:  # nobody snapshots (a worker without its publisher)
            for request_id, held in list(self._held.items()):
                if held.req.is_finished and self._held.get(request_id) is held:
                    del self._held[request_id]
        self._held[req.request_id] = _Held(req, cached, time.monotonic())
        self._recent.append((time.monotonic(), request_digest(req.request_id)))  # after: see `snapshot`
        self._admissions += 1

    def changed(self) -> bool:
        """Whether an engine step or an admission happened since the last call."""
        key = (self.steps(), self._admissions)
        if key == self._seen:
            return False
        self._seen = key
        return True

    def snapshot(self) -> dict:
        """The record (see the module's docstring), read now."""
        with self._lock:
            now = time.monotonic()
            # the ids first: an id read here had its entry added before, so the walk below counts it
            ids = [digest for at, digest in list(self._recent) if at >= now - RECENT_S]
            levels: dict[int, dict[str, list]] = {}
            for request_id, held in list(self._held.items()):
                req = held.req
                if req.is_finished or (not self.holds(request_id) and now - held.at > HOLD_GRACE_S):
                    if self._held.get(request_id) is held:
                        del self._held[request_id]
                    continue
                running = req.status == RequestStatus.RUNNING
                done = req.num_computed_tokens if running else max(req.num_computed_tokens, held.cached)
                tokens = req.num_prompt_tokens - done
                if tokens <= 0:
                    continue
                level = levels.setdefault(req.priority, {"q": [0, 0, 0, 0.0], "r": [0, 0, 0, 0.0]})
                work = level["r" if running else "q"]
                work[0] += tokens
                work[1] += 1
                work[2] += -(-tokens // self.budget)
                work[3] += (tokens * done + tokens * (tokens + 1) / 2) / 1e3
            self.seq += 1
            return {
                "b": self.boot,
                "s": self.seq,
                "t": round(time.time(), 3),
                "p": {
                    str(p): {k: [w[0], w[1], w[2], round(w[3], 3)] for k, w in level.items()}
                    for p, level in sorted(levels.items())
                },
                "ids": ids,
            }


class BacklogPublisher(threading.Thread):
    """Writes `tracker`'s snapshot to `kvf:{namespace}:prefill_backlog` (field `worker_id`) when it
    changed, at most every `interval_s`, and every `keepalive_s` regardless; `stop` removes the field."""

    def __init__(
        self,
        store,
        worker_id: str,
        tracker: BacklogTracker,
        interval_s: float = PUBLISH_INTERVAL_S,
        keepalive_s: float = KEEPALIVE_S,
    ):
        super().__init__(name="prefill-backlog", daemon=True)
        self.store, self.worker_id, self.tracker = store, worker_id, tracker
        self.key = f"{store.prefix}{PREFILL_BACKLOG_KEY}"
        self.interval_s, self.keepalive_s = interval_s, keepalive_s
        self.stopped = threading.Event()
        self.writes = 0
        self._body: dict | None = None  # the last record written, less its seq and time
        self._written = -float("inf")  # time.monotonic() of the last write
        self._failing = False

    def publish(self) -> bool:
        """One tick: write the snapshot if something changed or the keepalive is due (True: written)."""
        due = time.monotonic() - self._written >= self.keepalive_s
        if not self.tracker.changed() and not due:
            return False
        record = self.tracker.snapshot()
        body = {k: v for k, v in record.items() if k not in ("s", "t")}
        if body == self._body and not due:
            return False
        try:
            with self.store.client.pipeline(transaction=False) as pipe:
                pipe.hset(self.key, self.worker_id, json.dumps(record, separators=(",", ":")))
                pipe.pexpire(self.key, int(KEY_TTL_S * 1e3))
                pipe.execute()
        except redis.RedisError as err:
            if not self._failing:
                log.warning("publishing the prefill backlog failed (retrying): %s", err)
            self._failing = True
            return False
        if self._failing:
            log.info("publishing the prefill backlog again")
        self._failing = False
        self._body, self._written = body, time.monotonic()
        self.writes += 1
        return True

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.publish()
            except Exception:  # the publisher must never die: the routers would see a stale figure
                log.exception("prefill backlog snapshot failed")

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(2)
        try:
            self.store.client.hdel(self.key, self.worker_id)
        except redis.RedisError as err:
            log.warning("removing the prefill backlog record failed: %s", err)
