"""SLO-aware admission: a request's TTFT and TPOT predicted before any work, and a predicted miss refused
at once (or queued behind every other request) instead of taking prefill time from requests that would
make their targets.

Targets come per request (`GenerateRequest.slo`, the OpenAI body's `slo`), else from the cluster
(`--slo-ttft-ms`, `--slo-tpot-ms`); a request with neither is never refused for a prediction. The costs
come from the workers themselves: each engine fits its step time against the tokens and attention pairs
of its batches (`engine.cost_model`) and publishes the fit in its heartbeat. From those:

- **TTFT** on a prefill worker = the work queued ahead of the request there + its own prefill. The router
  knows every prefill it has in flight on each worker (`PrefillQueues`): their predicted cost, served
  in (priority, arrival) order as time passes, so only work of the same or a higher priority counts as
  ahead. Its own prefill is priced for the tokens that worker would compute (`PrefillRouting.preview`:
  pool hits and the worker's expected local hits taken off), in chunks of the worker's token budget. The
  prediction is the best worker's, plus a learned offset: the running mean of (actual - predicted) over
  the requests served (the hops, the KV write, what the step model misses). A request is admitted when
  its prediction times the 90th percentile of recent actual / predicted ratios makes its target, so the
  prediction's own error sends few admitted requests over it.
- **TPOT** on a decode worker = its step time with one more sequence in its batch (at the request's mean
  context), no less than its pacing interval when it paces, nor than the interval its running streams
  see now (`step_interval_ms`: with prefill on the same cores, what prefill leaves it); the best decode
  worker's.

`/metrics`: `predicted_ttft_seconds`, `ttft_prediction_ratio` (actual / predicted) and
`admission_predicted_misses_total{reason=ttft|tpot, action=reject|deprioritize}`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from kvferry.engine.cost_model import StepCost
from kvferry.engine.loop import PACE_MIN_RUNNING
from kvferry.engine.request import InvalidRequestError

ADMISSION_MODES = ("predictive", "cap")
MISS_ACTIONS = ("reject", "deprioritize")
DEPRIORITIZED = 2**31 - 1  # the priority a deprioritized request is queued at: behind every other
MAX_SLO_MS = 86_400_000.0  # a day
BIAS_WEIGHT = 0.05  # the learned offset's step towards each new (actual - predicted)
# A request is admitted when its predicted TTFT, times the MISS_QUANTILE of recent actual / predicted
# ratios (once there are MIN_RATIOS of them), makes the target: at most ~10% of the admitted miss by the
# prediction's own error, rather than half of those predicted just under it.
MISS_QUANTILE = 0.9
MIN_RATIOS = 20
RATIO_WINDOW = 256
DEFAULT_TOKEN_BUDGET = 512  # a worker whose heartbeat does not say its step's token budget
TPOT_OUTPUT_CAP = 512  # output tokens counted in a request's mean decode context at most


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
        TTFT is scaled by it first (the prediction's error, `SloAdmission.ttft_margin`)."""
        if (
            targets.ttft_ms is not None
            and self.ttft_ms is not None
            and self.ttft_ms * ttft_factor > targets.ttft_ms
        ):
            return "ttft"
        if targets.tpot_ms is not None and self.tpot_ms is not None and self.tpot_ms > targets.tpot_ms:
            return "tpot"
        return None


@dataclass
class _Queued:
    priority: int
    seq: int
    cost_ms: float  # predicted work
    left_ms: float  # of it, left

    @property
    def started(self) -> bool:
        return self.left_ms < self.cost_ms


@dataclass
class _WorkerQueue:
    entries: dict[str, _Queued] = field(default_factory=dict)
    updated: float = 0.0  # time.monotonic() the entries were last served to


class PrefillQueues:
    """The prefills the router has in flight on each prefill worker and their predicted work left. A
    worker is taken to serve its queue in (priority, arrival) order, one millisecond of work per
    millisecond of time: `wait_ms` is the work left ahead of a new request of a given priority — the same
    or a higher priority's, and a lower priority's already started (a running prefill keeps its chunks'
    token budget: engine.scheduler preempts for blocks and seats, not for budget)."""

    def __init__(self):
        self.workers: dict[str, _WorkerQueue] = {}
        self._seq = 0

    def _serve(self, worker: str, now: float) -> _WorkerQueue | None:
        q = self.workers.get(worker)
        if q is None:
            return None
        elapsed = max(0.0, (now - q.updated) * 1e3)
        q.updated = now
        for entry in sorted(q.entries.values(), key=lambda e: (e.priority, e.seq)):
            if elapsed <= 0:
                break
            done = min(entry.left_ms, elapsed)
            entry.left_ms -= done
            elapsed -= done
        return q

    def wait_ms(self, worker: str, priority: int, now: float | None = None) -> float:
        q = self._serve(worker, time.monotonic() if now is None else now)
        if q is None:
            return 0.0
        return sum(e.left_ms for e in q.entries.values() if e.priority <= priority or e.started)

    def add(
        self, worker: str, request_id: str, priority: int, cost_ms: float, now: float | None = None
    ) -> None:
        now = time.monotonic() if now is None else now
        q = self._serve(worker, now) or self.workers.setdefault(worker, _WorkerQueue(updated=now))
        self._seq += 1
        cost = max(0.0, cost_ms)
        q.entries[request_id] = _Queued(priority, self._seq, cost, cost)

    def remove(self, worker: str, request_id: str, now: float | None = None) -> None:
        q = self._serve(worker, time.monotonic() if now is None else now)
        if q is None:
            return
        q.entries.pop(request_id, None)
        if not q.entries:
            del self.workers[worker]


def member_cost(member) -> tuple[StepCost | None, int]:
    """A worker's fitted step cost and its step token budget, from its heartbeat record."""
    beat = member.beat
    budget = beat.get("token_budget")
    budget = int(budget) if isinstance(budget, int) and budget > 0 else DEFAULT_TOKEN_BUDGET
    return StepCost.from_list(beat.get("step_cost")), budget


class SloAdmission:
    """Router methods: predicting a request's TTFT and TPOT, and admitting it by its targets (after
    `router.admission`'s checks); the prefill queues kept as prefills are sent and answered."""

    def _init_slo(self) -> None:
        self.prefill_queues = PrefillQueues()
        self.ttft_bias_ms = 0.0  # learned: the mean of (actual - predicted) TTFT
        self._bias_samples = 0
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)  # recent actual / predicted TTFT

    def ttft_margin(self) -> float:
        """The MISS_QUANTILE of recent actual / predicted TTFT ratios (1 until there are enough)."""
        if len(self._ratios) < MIN_RATIOS:
            return 1.0
        ordered = sorted(self._ratios)
        return max(1.0, ordered[min(len(ordered) - 1, int(MISS_QUANTILE * len(ordered)))])

    def predict(self, handle) -> Prediction:
        """The TTFT (best prefill worker) and TPOT (best decode worker) predicted for `handle` now."""
        now = time.monotonic()
        best = None
        for member, compute in self.routing.preview(
            handle.prompt_keys.block_keys, handle.pooled, len(handle.ids)
        ):
            cost, budget = member_cost(member)
            if cost is None:
                continue
            own = cost.prompt_ms(compute, budget, len(handle.ids) - compute)
            wait = self.prefill_queues.wait_ms(member.member_id, handle.priority, now)
            if best is None or wait + own < best[0] + best[1]:
                best = (wait, own, member.member_id)
        # the mean context over its decode; max_tokens may be "as many as fit" (a chat request leaving it
        # unset), so the outputs it counts are capped
        tpot = self._predict_tpot(len(handle.ids) + min(handle.params.max_tokens, TPOT_OUTPUT_CAP) // 2)
        if best is None:
            return Prediction(None, tpot_ms=tpot)
        wait, own, worker = best
        return Prediction(max(0.0, wait + own + self.ttft_bias_ms), wait, own, worker, tpot)

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

    def admit_by_slo(self, handle, slo) -> None:
        """Resolve the request's targets, predict, and refuse (RequestRejected RESOURCE_EXHAUSTED with a
        retry-after) or deprioritize a predicted miss; a request without targets is only predicted."""
        from kvferry.router.admission import RequestRejected  # (admission imports this module's users)

        handle.targets = resolve_targets(slo, self.cfg.slo_ttft_ms, self.cfg.slo_tpot_ms)
        if self.cfg.admission != "predictive" or self.cfg.colocated:
            return
        handle.prediction = prediction = self.predict(handle)
        margin = self.ttft_margin()
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
                f" (queued work ahead {prediction.wait_ms:.0f} ms + its prefill"
                f" {prediction.prefill_ms:.0f} ms on {prediction.worker}"
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

    def prefill_sent(self, handle, member, compute_tokens: int) -> None:
        """A prefill went to `member`: its predicted work joins that worker's queue."""
        cost, budget = member_cost(member)
        own = (
            0.0 if cost is None else cost.prompt_ms(compute_tokens, budget, len(handle.ids) - compute_tokens)
        )
        self.prefill_queues.add(member.member_id, handle.request_id, handle.priority, own)

    def prefill_ended(self, handle, member) -> None:
        self.prefill_queues.remove(member.member_id, handle.request_id)

    def first_token(self, handle, ttft_ms: float) -> None:
        """The request's TTFT is known: learn the offset, and record prediction against actual."""
        prediction = getattr(handle, "prediction", None)
        if prediction is None or prediction.ttft_ms is None or handle.priority == DEPRIORITIZED:
            return  # (a deprioritized request waited at another priority than it was predicted at)
        predicted = prediction.ttft_ms
        self.metrics.predicted_ttft(predicted, ttft_ms)
        if predicted > 0:
            self._ratios.append(ttft_ms / predicted)
        unbiased = prediction.wait_ms + prediction.prefill_ms
        self._bias_samples += 1
        weight = max(BIAS_WEIGHT, 1.0 / self._bias_samples)  # a plain mean over the first samples
        self.ttft_bias_ms += weight * (ttft_ms - unbiased - self.ttft_bias_ms)
