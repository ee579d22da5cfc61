"""SLO-aware admission: a request's TTFT and TPOT predicted before any work, and a predicted miss refused
at once (or queued behind every other request) instead of taking prefill time from requests that would
make their targets.

Targets come per request (`GenerateRequest.slo`, the OpenAI body's `slo`), else from the cluster
(`--slo-ttft-ms`, `--slo-tpot-ms`); a request with neither is never refused for a prediction. The costs
come from the workers themselves: each engine fits its step time against the tokens and attention pairs
of its batches (`engine.cost_model`) and publishes the fit in its heartbeat. From those:

- **TTFT** on a prefill worker = the work queued ahead of the request there + its own prefill. Every
  prefill worker publishes its backlog (`kvferry.worker.backlog`, read by `router.directory` every 50 ms):
  per priority, the prompt tokens it still has to compute, queued and running, in steps and attention
  pairs, so it is priced with the worker's step model as a prompt is. Work of the same or a higher
  priority counts as ahead, of a lower one only what is running (a running prefill keeps its chunks'
  token budget). Whichever router sent it, every prefill is in that figure, so N routers admit alike. On
  top of it, each prefill this router sent there that the record does not show yet (`PrefillQueues`: its
  id is not among the record's lately admitted ids, and it went out less than LOCAL_WINDOW_S ago), so a
  burst from this router between two records is not missed, and none is counted twice. A worker whose
  record is missing or stale (unchanged for `router.backlog.BACKLOG_STALE_S`) is priced from this
  router's own prefills in flight there alone (what one router sees of the backlog).
  Its own prefill is priced for the tokens that worker would compute (`PrefillRouting.preview`: pool hits
  and the worker's expected local hits taken off), in chunks of the worker's token budget. The
  prediction is the best worker's, times a learned scale: the median of actual / priced TTFT over the
  recent requests served at the same priority (the hops, the KV write, the cores prefill shares, what
  the step model misses). A request is admitted when its prediction times the 90th percentile of recent
  actual / predicted ratios at its priority makes its target, so the prediction's own error sends few
  admitted requests over it. Both forget samples after 10 s.
- **TPOT** on a decode worker = its step time with one more sequence in its batch (at the request's mean
  context), no less than its pacing interval when it paces, nor than the interval its running streams
  see now (`step_interval_ms`: with prefill on the same cores, what prefill leaves it); the best decode
  worker's.

`/metrics`: `predicted_ttft_seconds`, `ttft_prediction_ratio` (actual / predicted) and
`admission_predicted_misses_total{reason=ttft|tpot, action=reject|deprioritize}`.

`SloPredictor` holds what this router knows (its prefills in flight, what it learned) and offers the
verbs: `admit_by_slo` (from `router.admission`), `prefill_sent` / `prefill_ended` (from
`router.dispatch`) and `first_token` (when a request's first token comes).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from kvferry.engine.cost_model import StepCost
from kvferry.engine.loop import PACE_MIN_RUNNING
from kvferry.engine.request import InvalidRequestError
from kvferry.kvpool.metadata import request_digest
from kvferry.router.backlog import BACKLOG_STALE_S, PublishedBacklog, Work
from kvferry.router.inflight import Inflight, RequestRejected
from kvferry.v1 import generate_pb2

if TYPE_CHECKING:
    from kvferry.router.config import RouterConfig
    from kvferry.router.directory import Directory, Member
    from kvferry.router.metrics import RouterMetrics
    from kvferry.router.prefix_routing import PrefillRouting

DEPRIORITIZED = 2**31 - 1  # the priority a deprioritized request is queued at: behind every other
MAX_SLO_MS = 86_400_000.0  # a day
# What is learned from served requests, per priority (a lower priority's waits also stretch with later,
# higher-priority arrivals, which no prediction can see): the scale is the median of actual / priced TTFT,
# and a request is admitted when its predicted TTFT, times the MISS_QUANTILE of the actual / predicted
# ratios (once there are MIN_RATIOS of them), makes the target: at most ~10% of the admitted miss by the
# prediction's own error, rather than half of those predicted just under it. Samples older than
# SAMPLE_TTL_S are dropped, so a bad spell is forgotten soon even when it refused every request after it
# (and so taught nothing new).
MISS_QUANTILE = 0.9
MIN_RATIOS = 20
MIN_SCALES = 5
SAMPLE_WINDOW = 256
SAMPLE_TTL_S = 10.0
MAX_PRIORITY_LEVELS = 64  # priorities learned about at once (clients choose them: the memory is bounded)
DEFAULT_TOKEN_BUDGET = 512  # a worker whose heartbeat does not say its step's token budget
TPOT_OUTPUT_CAP = 512  # output tokens counted in a request's mean decode context at most
# this router's prefills sent to a worker count on top of its published backlog while the record does not
# show them, at most this long (the workers publish the ids they admitted over the last 3 s)
LOCAL_WINDOW_S = 2.0


@dataclass(frozen=True)
class Targets:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def any(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def check_default_target(name: str, value: float | None) -> None:
    """A cluster-wide target (`--slo-ttft-ms`, `--slo-tpot-ms`): None, or milliseconds in (0, a day]."""
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_SLO_MS):
        raise ValueError(f"{name} must be a number of milliseconds in (0, {MAX_SLO_MS:.0f}], got {value}")


def resolve_targets(slo, default_ttft_ms: float | None, default_tpot_ms: float | None) -> Targets:
    """A request's targets: its own (`GenerateRequest.slo`; 0 = unset) else the cluster's. Raises
    InvalidRequestError for a negative, non-finite or absurd one."""
    values = {}
    for name, default in (("ttft_ms", default_ttft_ms), ("tpot_ms", default_tpot_ms)):
        value = getattr(slo, name)
        if not math.isfinite(value) or not 0 <= value <= MAX_SLO_MS:
            raise InvalidRequestError(
                f"slo.{name} must be a number of milliseconds in [0, {MAX_SLO_MS:.0f}], got {value}"
            )
        values[name] = value if value > 0 else default
    return Targets(**values)


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float | None  # None: no prefill worker has a fitted cost model yet
    wait_ms: float = 0.0  # of ttft_ms, the work queued ahead on `worker`
    prefill_ms: float = 0.0  # of ttft_ms, the request's own prefill there
    worker: str = ""
    tpot_ms: float | None = None

    def miss(self, targets: Targets, ttft_factor: float = 1.0) -> str | None:
        """Which target the prediction misses ("ttft", "tpot"), or None; `ttft_factor`: the predicted
        TTFT is scaled by it first (the prediction's error, `SloPredictor.ttft_margin`)."""
        if (
            targets.ttft_ms is not None
            and self.ttft_ms is not None
            and self.ttft_ms * ttft_factor > targets.ttft_ms
        ):
            return "ttft"
        if targets.tpot_ms is not None and self.tpot_ms is not None and self.tpot_ms > targets.tpot_ms:
            return "tpot"
        return None


class PrefillQueues:
    """The prefills this router has in flight on each prefill worker, with their predicted cost and when
    they went out. An entry leaves when the worker answers.

    Alone (`wait_ms`: no record from the worker), a worker's entries are the backlog this router knows
    of: for a new request of a given priority, the cost of every entry of the same or a higher priority,
    plus the largest lower-priority one (which the worker may be running: engine.scheduler preempts for
    blocks and seats, not for budget). Beside a worker's published backlog (`unreflected_ms`), only the
    entries that record does not hold yet count: not among its lately admitted ids, and sent less than
    LOCAL_WINDOW_S ago (an older one has reached the worker, so its figures hold it while it computes)."""

    def __init__(self):
        # worker -> request -> (priority, cost, time.monotonic() sent, id digest)
        self.workers: dict[str, dict[str, tuple[int, float, float, int]]] = {}

    def wait_ms(self, worker: str, priority: int) -> float:
        entries = self.workers.get(worker, {}).values()
        ahead = sum(e[1] for e in entries if e[0] <= priority)
        return ahead + max((e[1] for e in entries if e[0] > priority), default=0.0)

    def unreflected_ms(self, worker: str, priority: int, published_ids: Collection[int]) -> float:
        """The cost of the entries of the same or a higher priority that a record with `published_ids`
        does not hold yet."""
        oldest = time.monotonic() - LOCAL_WINDOW_S
        return sum(
            cost
            for p, cost, sent, digest in self.workers.get(worker, {}).values()
            if p <= priority and sent >= oldest and digest not in published_ids
        )

    def add(self, worker: str, request_id: str, priority: int, cost_ms: float) -> None:
        entry = (priority, max(0.0, cost_ms), time.monotonic(), request_digest(request_id))
        self.workers.setdefault(worker, {})[request_id] = entry

    def remove(self, worker: str, request_id: str) -> None:
        entries = self.workers.get(worker)
        if entries is None:
            return
        entries.pop(request_id, None)
        if not entries:
            del self.workers[worker]


def backlog_ms(backlog: PublishedBacklog, cost: StepCost, priority: int) -> float:
    """A published backlog priced with the worker's step cost, as ahead of a request of `priority`: every
    level's work at the same or a higher priority, and what is running at a lower one."""

    def ms(work: Work) -> float:
        return cost.fixed_ms * work.steps + cost.per_token_ms * work.tokens + cost.per_kpair_ms * work.kpairs

    return sum(ms(q) + ms(r) if p <= priority else ms(r) for p, (q, r) in backlog.levels.items())


def fresh_backlog(member) -> PublishedBacklog | None:
    """A prefill worker's published backlog, None when it has none or it stopped changing (stale)."""
    backlog = getattr(member, "backlog", None)
    if backlog is None or time.monotonic() - member.backlog_at > BACKLOG_STALE_S:
        return None
    return backlog


def member_cost(member) -> tuple[StepCost | None, int]:
    """A worker's fitted step cost and its step token budget, from its heartbeat record."""
    beat = member.beat
    budget = beat.get("token_budget")
    budget = int(budget) if isinstance(budget, int) and budget > 0 else DEFAULT_TOKEN_BUDGET
    return StepCost.from_list(beat.get("step_cost")), budget


class SloPredictor:
    """Predicts a request's TTFT and TPOT and admits it by its targets (`admit_by_slo`, after
    `router.admission`'s checks); keeps this router's prefills in flight as they are sent and answered
    (`prefill_sent`, `prefill_ended`), and learns from each first token (`first_token`). `routing` prices
    a prompt on each prefill worker (`PrefillRouting.preview`)."""

    def __init__(
        self, cfg: RouterConfig, directory: Directory, routing: PrefillRouting, metrics: RouterMetrics
    ):
        self.cfg = cfg
        self.directory = directory
        self.routing = routing
        self.metrics = metrics
        self.prefill_queues = PrefillQueues()
        # per priority: (time.monotonic(), actual / priced TTFT, actual / predicted TTFT) of recent served
        # requests
        self._samples: dict[int, deque[tuple[float, float, float]]] = {}

    def _recent(self, priority: int) -> list[tuple[float, float, float]]:
        samples = self._samples.get(priority)
        if samples is None:
            return []
        oldest = time.monotonic() - SAMPLE_TTL_S
        while samples and samples[0][0] < oldest:
            samples.popleft()
        return list(samples)

    def ttft_scale(self, priority: int) -> float:
        """The median of recent actual / priced TTFT at this priority (1 until there are enough): how much
        slower than its priced steps a worker gets through its backlog (KV writes, hops, the cores it
        shares), less the head's work already done."""
        scales = sorted(s[1] for s in self._recent(priority))
        return scales[len(scales) // 2] if len(scales) >= MIN_SCALES else 1.0

    def ttft_margin(self, priority: int) -> float:
        """The MISS_QUANTILE of recent actual / predicted TTFT ratios at this priority (1 until there
        are enough)."""
        ratios = sorted(s[2] for s in self._recent(priority))
        if len(ratios) < MIN_RATIOS:
            return 1.0
        return max(1.0, ratios[min(len(ratios) - 1, int(MISS_QUANTILE * len(ratios)))])

    def predict(self, handle: Inflight) -> Prediction:
        """The TTFT (best prefill worker) and TPOT (best decode worker) predicted for `handle` now."""
        best = None
        for member, compute in self.routing.preview(
            handle.prompt_keys.block_keys, handle.pooled, len(handle.ids)
        ):
            cost, budget = member_cost(member)
            if cost is None:
                continue
            own = cost.prompt_ms(compute, budget, len(handle.ids) - compute)
            wait = self.prefill_wait_ms(member, cost, handle.priority)
            if best is None or wait + own < best[0] + best[1]:
                best = (wait, own, member.member_id)
        # the mean context over its decode; max_tokens may be "as many as fit" (a chat request leaving it
        # unset), so the outputs it counts are capped
        tpot = self._predict_tpot(len(handle.ids) + min(handle.params.max_tokens, TPOT_OUTPUT_CAP) // 2)
        if best is None:
            return Prediction(None, tpot_ms=tpot)
        wait, own, worker = best
        return Prediction((wait + own) * self.ttft_scale(handle.priority), wait, own, worker, tpot)

    def prefill_wait_ms(self, member: Member, cost: StepCost, priority: int) -> float:
        """The priced work ahead of a request of `priority` on prefill worker `member`: its published
        backlog and this router's prefills that record does not show yet; without a fresh record, this
        router's prefills in flight there."""
        backlog = fresh_backlog(member)
        if backlog is None:
            return self.prefill_queues.wait_ms(member.member_id, priority)
        local = self.prefill_queues.unreflected_ms(member.member_id, priority, backlog.ids)
        return backlog_ms(backlog, cost, priority) + local

    def _predict_tpot(self, context: int) -> float | None:
        best = None
        for member in self.directory.available("decode"):
            cost, _ = member_cost(member)
            if cost is None:
                continue
            running = int(member.beat.get("running") or 0)
            batch = max(running, member.inflight) + 1
            step = cost.step_ms(batch, batch * context)
            pace = member.beat.get("pace_ms")
            if isinstance(pace, (int, float)) and pace > 0 and batch >= PACE_MIN_RUNNING:
                step = max(step, float(pace))
            seen = member.beat.get("step_interval_ms")
            if running and isinstance(seen, (int, float)) and seen > 0:  # what its streams see now
                step = max(step, float(seen))
            best = step if best is None else min(best, step)
        return best

    def admit_by_slo(self, handle: Inflight, slo: generate_pb2.Slo) -> None:
        """Resolve the request's targets, predict, and refuse (RequestRejected RESOURCE_EXHAUSTED with a
        retry-after) or deprioritize a predicted miss; a request without targets is only predicted."""
        handle.targets = resolve_targets(slo, self.cfg.slo_ttft_ms, self.cfg.slo_tpot_ms)
        if self.cfg.admission != "predictive" or self.cfg.colocated:
            return
        handle.prediction = prediction = self.predict(handle)
        margin = self.ttft_margin(handle.priority)
        miss = prediction.miss(handle.targets, margin)
        if miss is None:
            return
        action = self.cfg.on_predicted_miss
        self.metrics.predicted_miss(miss, action)
        if action == "deprioritize":
            handle.priority = DEPRIORITIZED
            return
        if miss == "ttft":
            target = handle.targets.ttft_ms
            why = (
                f"predicted TTFT {prediction.ttft_ms:.0f} ms misses the request's target of {target:.0f} ms"
                f" (priced: queued work ahead {prediction.wait_ms:.0f} ms + its prefill"
                f" {prediction.prefill_ms:.0f} ms on {prediction.worker},"
                f" x{self.ttft_scale(handle.priority):.2f} as this cluster runs"
                + (f"; x{margin:.2f} for the prediction's recent error)" if margin > 1 else ")")
            )
            retry_s = max(1.0, (prediction.ttft_ms * margin - target) / 1e3)
        else:
            why = (
                f"predicted TPOT {prediction.tpot_ms:.1f} ms misses the request's target of "
                f"{handle.targets.tpot_ms:.1f} ms (the decode workers' batches are full)"
            )
            retry_s = 1.0
        raise RequestRejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED, why + "; retry later", retry_after_s=retry_s
        )

    def prefill_sent(self, handle: Inflight, member: Member, compute_tokens: int) -> None:
        """A prefill went to `member`: its predicted work counts there until the worker's published backlog
        shows it, or it is answered."""
        cost, budget = member_cost(member)
        own = (
            0.0 if cost is None else cost.prompt_ms(compute_tokens, budget, len(handle.ids) - compute_tokens)
        )
        self.prefill_queues.add(member.member_id, handle.request_id, handle.priority, own)

    def prefill_ended(self, handle: Inflight, member: Member) -> None:
        """The prefill sent to `member` was answered (or failed): it no longer counts there."""
        self.prefill_queues.remove(member.member_id, handle.request_id)

    def first_token(self, handle: Inflight, ttft_ms: float) -> None:
        """The request's TTFT is known: learn the scale and the error, and record prediction against
        actual."""
        prediction = handle.prediction
        if prediction is None or prediction.ttft_ms is None or handle.priority == DEPRIORITIZED:
            return  # (a deprioritized request waited at another priority than it was predicted at)
        predicted = prediction.ttft_ms
        self.metrics.predicted_ttft(predicted, ttft_ms)
        if predicted <= 0:
            return
        priced = prediction.wait_ms + prediction.prefill_ms
        if priced <= 0:
            return
        samples = self._samples.get(handle.priority)
        if samples is None:
            if len(self._samples) >= MAX_PRIORITY_LEVELS:  # forget the level heard from least recently
                stale = min(self._samples, key=lambda p: self._samples[p][-1][0] if self._samples[p] else 0.0)
                del self._samples[stale]
            samples = self._samples[handle.priority] = deque(maxlen=SAMPLE_WINDOW)
        samples.append((time.monotonic(), ttft_ms / priced, ttft_ms / predicted))
