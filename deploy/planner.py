"""The planner: sets the number of prefill and decode groups of a running cluster from what it serves.

`kvferry up --autoscale` (locally and on Ray) runs an `Autoscaler` beside the launcher. Every
`interval_s` it reads the cluster's registry in Redis: each router's traffic over its last window
(`router.traffic`: arrivals per second, the mean prompt tokens a prefill computes after cache and pool
hits, the mean output tokens, TTFT and TPOT percentiles), summed over every router of the fleet
(`Traffic.merge`: rates and predicted misses added, means weighted by each router's share, the worst
router's percentile), and each worker's heartbeat (its fitted step cost, `engine.cost_model`, its token
budget, queue and KV use). From those it computes what each role needs (`needs`):

- **prefill** = arrivals/s x the prefill time of the mean uncached prompt, priced by the prefill workers'
  own step model in chunks of their token budget, over `utilization` (a queue kept below it);
- **decode** = output tokens/s asked for, over what one decode group streams while its step stays under
  `utilization` x the TPOT target (the largest batch whose step fits, its step time no shorter than its
  pacing), and no fewer groups than the ones holding the streams' KV blocks at `utilization`;
- and corrected by what is measured: a role needs at least one group more than it has (the model
  missed something) when its SLO percentile is over its target (TTFT p90 for prefill, while its
  workers queue work; TPOT p90 for decode) or when admission predicts misses of its target for more
  than 5% of the arrivals (refused or deprioritized: demand it could not take); and a role is never
  scaled down while either says it misses.

Counts are clamped to the role's bounds and, with `max_groups`, the total is split in proportion to the
two needs. The planner moves one group per decision (a role up or down by one, or with the total at
`max_groups`, one group from a role to the other, started before the other one drains) and waits
`cooldown_s` after every change, so each decision is measured before the next. A role scales down only
when `down_margin` x its need still fits in one group fewer. Decisions are logged by the launcher and
published in the registry (role `planner`), so the routers count them in `/metrics`
(`kvferry:planner_decisions_total{role,direction}`, `kvferry:planner_groups{role}`,
`kvferry:planner_need_groups{role}`).

`kvferry plan --trace FILE` runs the same `needs` over a recorded trace, a window at a time.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.engine.cost_model import StepCost
from kvferry.flags import meta

log = logging.getLogger(__name__)

PLANNER_ROLE = "planner"  # its registry record (decisions, for the routers' /metrics)
ROUTER_ROLE = "router"  # each router's traffic record (router.traffic)
DEFAULT_TTFT_MS = 1000.0  # SLO targets when neither the autoscale settings nor the router set one
DEFAULT_TPOT_MS = 100.0
DEFAULT_TOKEN_BUDGET = 512
MAX_BATCH = 1024  # the largest decode batch considered


@dataclass(frozen=True)
class Traffic:
    """What the routers saw over their window (several routers: summed rates, weighted means)."""

    arrival_rps: float = 0.0
    prompt_tokens: float = 0.0  # mean prompt tokens a request
    uncached_tokens: float = 0.0  # mean prompt tokens a prefill computed (after local and pool hits)
    output_tokens: float = 0.0  # mean output tokens of a finished request
    ttft_p90_ms: float | None = None
    tpot_p90_ms: float | None = None
    finished: int = 0
    miss_ttft_rps: float = 0.0  # requests admission predicted to miss their TTFT target (refused or last)
    miss_tpot_rps: float = 0.0

    @classmethod
    def merge(cls, records: list[dict]) -> Traffic:
        """Several routers' records (router.traffic.TrafficWindow.summary) as one."""
        records = [r for r in records if isinstance(r, dict)]
        rate = sum(_num(r.get("arrival_rps")) for r in records)
        finished = sum(int(_num(r.get("finished"))) for r in records)

        def mean(key: str, weight: str) -> float:
            total = sum(_num(r.get(weight)) for r in records)
            if total <= 0:
                return 0.0
            return sum(_num(r.get(key)) * _num(r.get(weight)) for r in records) / total

        def worst(key: str) -> float | None:
            values = [_num(r.get(key)) for r in records if r.get(key) is not None]
            return max(values) if values else None

        return cls(
            arrival_rps=rate,
            prompt_tokens=mean("prompt_tokens", "arrival_rps"),
            uncached_tokens=mean("uncached_tokens", "finished"),
            output_tokens=mean("output_tokens", "finished"),
            ttft_p90_ms=worst("ttft_p90_ms"),
            tpot_p90_ms=worst("tpot_p90_ms"),
            finished=finished,
            miss_ttft_rps=sum(_num(r.get("miss_ttft_rps")) for r in records),
            miss_tpot_rps=sum(_num(r.get("miss_tpot_rps")) for r in records),
        )


def _num(value) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0


@dataclass(frozen=True)
class RoleLoad:
    """A role's workers as their heartbeats say: a typical fitted cost (the median of each coefficient),
    the step token budget, the queued requests, KV use, pacing and seats."""

    cost: StepCost | None = None
    budget: int = DEFAULT_TOKEN_BUDGET
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # the mean fraction of KV blocks in use
    pace_ms: float = 0.0
    max_num_seqs: int = 256
    members: int = 0

    @classmethod
    def from_beats(cls, beats: list[dict]) -> RoleLoad:
        beats = [b for b in beats if isinstance(b, dict)]
        costs = [c for c in (StepCost.from_list(b.get("step_cost")) for b in beats) if c is not None]
        cost = None
        if costs:
            mid = len(costs) // 2
            cost = StepCost(*(sorted(getattr(c, f) for c in costs)[mid] for f in _COST_FIELDS))
        usage = [
            1.0 - _num(b.get("free_blocks")) / _num(b.get("total_blocks"))
            for b in beats
            if _num(b.get("total_blocks")) > 0
        ]
        budgets = [int(b["token_budget"]) for b in beats if isinstance(b.get("token_budget"), int)]
        seats = [int(b["max_num_seqs"]) for b in beats if isinstance(b.get("max_num_seqs"), int)]
        return cls(
            cost=cost,
            budget=min(budgets) if budgets else DEFAULT_TOKEN_BUDGET,
            waiting=sum(int(_num(b.get("waiting"))) for b in beats),
            running=sum(int(_num(b.get("running"))) for b in beats),
            kv_usage=sum(usage) / len(usage) if usage else 0.0,
            pace_ms=max((_num(b.get("pace_ms")) for b in beats), default=0.0),
            max_num_seqs=min(seats) if seats else 256,
            members=len(beats),
        )


_COST_FIELDS = ("fixed_ms", "per_token_ms", "per_kpair_ms")


@dataclass(frozen=True)
class PlanTargets:
    ttft_ms: float = DEFAULT_TTFT_MS
    tpot_ms: float = DEFAULT_TPOT_MS
    utilization: float = 0.8  # the busy fraction a role is planned for (queues stay short below it)


@dataclass(frozen=True)
class Needs:
    prefill: float  # groups, fractional
    decode: float
    why: tuple[str, ...] = ()
    model: tuple[float | None, float | None] = (None, None)  # the cost model's figures (None: no fit)
    short: tuple[bool, bool] = (False, False)  # a measured miss says the role lacks a group


def prefill_need(traffic: Traffic, load: RoleLoad, targets: PlanTargets) -> float | None:
    """Prefill groups the arrivals keep `targets.utilization` busy (None without a fitted cost)."""
    if load.cost is None:
        return None
    cached = max(0, round(traffic.prompt_tokens - traffic.uncached_tokens))
    own_ms = load.cost.prompt_ms(round(traffic.uncached_tokens), load.budget, cached)
    return traffic.arrival_rps * own_ms / 1e3 / targets.utilization


def decode_capacity(cost: StepCost, context: float, targets: PlanTargets, pace_ms: float, seats: int):
    """(batch, tokens/s) of one decode group at the largest batch whose step stays within
    utilization x the TPOT target (at least one stream)."""
    limit = targets.utilization * targets.tpot_ms

    def step(batch: int) -> float:
        return max(cost.step_ms(batch, batch * context), pace_ms)

    lo, hi = 1, max(1, min(seats, MAX_BATCH))
    while lo < hi:  # the step grows with the batch: the largest batch that fits
        mid = (lo + hi + 1) // 2
        if step(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo, lo / max(step(lo), 1e-3) * 1e3


def decode_need(traffic: Traffic, load: RoleLoad, targets: PlanTargets) -> float | None:
    """Decode groups for the output tokens/s asked for (None without a fitted cost)."""
    if load.cost is None:
        return None
    context = traffic.prompt_tokens + traffic.output_tokens / 2
    _, per_group = decode_capacity(load.cost, context, targets, load.pace_ms, load.max_num_seqs)
    return traffic.arrival_rps * traffic.output_tokens / per_group


def needs(
    traffic: Traffic,
    prefill: RoleLoad,
    decode: RoleLoad,
    current: tuple[int, int],
    targets: PlanTargets,
    scale: tuple[float, float] = (1.0, 1.0),
    measured: tuple[bool, bool] = (True, True),
) -> Needs:
    """What each role needs now: the cost model's figure times `scale` (what the planner learned from
    earlier misses, `Planner.learn`), raised by what is measured (module doc) where `measured` says the
    figures measure the role's present groups (not a window that began before its last change)."""
    p, d = current
    why = []
    model = (prefill_need(traffic, prefill, targets), decode_need(traffic, decode, targets))
    need = []
    for role, have, figure, factor in (("prefill", p, model[0], scale[0]), ("decode", d, model[1], scale[1])):
        if figure is None:
            need.append(float(have))
            why.append(f"{role} cost not fitted yet: {role} kept")
        else:
            need.append(figure * factor)
            if factor > 1.001:
                why.append(f"{role} model x{factor:.2f} (learned from misses)")
    p_need, d_need = need
    short_p = short_d = False
    if measured[0] and _over(traffic.ttft_p90_ms, targets.ttft_ms) and prefill.waiting > 0:
        why.append(f"TTFT p90 {traffic.ttft_p90_ms:.0f} ms > {targets.ttft_ms:.0f} ms with prefill queued")
        short_p = True
    if measured[0] and _missing(traffic.miss_ttft_rps, traffic.arrival_rps):
        why.append(f"{traffic.miss_ttft_rps:.2f} req/s predicted to miss TTFT")
        short_p = True
    if measured[1] and _over(traffic.tpot_p90_ms, targets.tpot_ms):
        why.append(f"TPOT p90 {traffic.tpot_p90_ms:.0f} ms > {targets.tpot_ms:.0f} ms")
        short_d = True
    if measured[1] and _missing(traffic.miss_tpot_rps, traffic.arrival_rps):
        why.append(f"{traffic.miss_tpot_rps:.2f} req/s predicted to miss TPOT")
        short_d = True
    if short_p:
        p_need = max(p_need, p + 1)
    if short_d:
        d_need = max(d_need, d + 1)
    if decode.kv_usage > targets.utilization:
        why.append(f"decode KV {decode.kv_usage:.0%} in use")
        d_need = max(d_need, d * decode.kv_usage / targets.utilization)
    return Needs(p_need, d_need, tuple(why), model, (short_p, short_d))


MAX_SCALE = 20.0  # the most a role's model figure is scaled up by what the planner learned (Planner.learn)
MISS_SHARE = 0.05  # predicted misses over this share of arrivals: the role is short of groups


def _missing(miss_rps: float, arrival_rps: float) -> bool:
    return miss_rps > 0 and miss_rps > MISS_SHARE * arrival_rps


@dataclass(frozen=True)
class Bounds:
    prefill: tuple[int, int] = (1, 4)
    decode: tuple[int, int] = (1, 4)
    max_groups: int | None = None  # prefill + decode groups at most (None: the two maxima)

    def validate(self) -> None:
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, role)
            if not 1 <= lo <= hi:
                raise ValueError(f"autoscale {role} bounds must satisfy 1 <= min <= max, got {lo}:{hi}")
        if self.max_groups is not None and self.max_groups < self.prefill[0] + self.decode[0]:
            raise ValueError(
                f"autoscale max_groups {self.max_groups} is below the minimum groups "
                f"{self.prefill[0]} + {self.decode[0]}"
            )


def desired(need: Needs, current: tuple[int, int], bounds: Bounds, down_margin: float) -> tuple[int, int]:
    """The counts each role's need asks for: up to ceil(need), down only when down_margin x need fits
    in fewer; clamped to the bounds; with max_groups, the total split in proportion to the needs."""

    def want(value: float, have: int, lo: int, hi: int) -> int:
        up = math.ceil(value - 1e-9)
        down = math.ceil(value * down_margin - 1e-9)
        n = up if up > have else (down if down < have else have)
        return min(hi, max(lo, n))

    p = want(need.prefill, current[0], *bounds.prefill)
    d = want(need.decode, current[1], *bounds.decode)
    if bounds.max_groups is not None and p + d > bounds.max_groups:
        total = bounds.max_groups
        share = need.prefill / max(need.prefill + need.decode, 1e-9)
        p = min(bounds.prefill[1], max(bounds.prefill[0], round(total * share)))
        p = min(p, total - bounds.decode[0])
        d = min(bounds.decode[1], max(bounds.decode[0], total - p))
    return p, d


def next_step(current: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """One group's move from `current` towards `target`: one from a role over its target to one under
    it (a move), else a role up by one (growth first), else a role down by one."""
    p, d = current
    dp, dd = target[0] - p, target[1] - d
    if dp > 0 and dd < 0:
        return p + 1, d - 1
    if dp < 0 and dd > 0:
        return p - 1, d + 1
    if dp > 0 or dd > 0:  # the role further below its target first
        return (p + 1, d) if dp >= dd else (p, d + 1)
    if dp < 0 or dd < 0:
        return (p - 1, d) if dp <= dd else (p, d - 1)
    return current


@dataclass
class Decision:
    at: float  # time.time()
    before: tuple[int, int]
    after: tuple[int, int]
    need: Needs
    ok: bool = True
    error: str = ""

    def text(self) -> str:
        (p0, d0), (p1, d1) = self.before, self.after
        moves = [f"{r} {a} -> {b}" for r, a, b in (("prefill", p0, p1), ("decode", d0, d1)) if a != b]
        why = "; ".join(self.need.why)
        need = f"need prefill {self.need.prefill:.2f}, decode {self.need.decode:.2f}"
        line = f"planner: {', '.join(moves)} ({need}"
        line += f"; {why})" if why else ")"
        return line if self.ok else f"{line} failed: {self.error}"

    def to_dict(self) -> dict:
        return {
            "at": round(self.at, 3),
            "before": list(self.before),
            "after": list(self.after),
            "need": {"prefill": round(self.need.prefill, 3), "decode": round(self.need.decode, 3)},
            "why": list(self.need.why),
            "ok": self.ok,
            "error": self.error,
        }


def bounds_of(value) -> tuple[int, int]:
    """A role's autoscale bounds from a flag's `MIN:MAX` or a cluster file's [min, max]."""
    if isinstance(value, str):
        value = value.split(":")
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise ValueError(f"bounds must be MIN:MAX (or [min, max]), got {value!r}") from None
    if isinstance(lo, bool) or isinstance(hi, bool):
        raise ValueError(f"bounds must be two integers (MIN:MAX), got {value!r}")
    try:
        return int(lo), int(hi)
    except ValueError:
        raise ValueError(f"bounds must be two integers (MIN:MAX), got {value!r}") from None


def _bounds(role: str, default: tuple[int, int]):
    return field(
        default=default,
        metadata=meta(
            f"{role} groups the planner keeps between",
            parse=bounds_of,
            spell="{0[0]}:{0[1]}".format,
            metavar="MIN:MAX",
        ),
    )


@dataclass(frozen=True)
class AutoscaleSettings:
    """The planner's settings: the cluster file's `autoscale:` section, `kvferry up --autoscale-*`."""

    enabled: bool = field(
        default=False,
        metadata=meta(
            "the planner sets the prefill / decode groups from live load (deploy.planner)", flag="--autoscale"
        ),
    )
    prefill: tuple[int, int] = _bounds("prefill", (1, 4))
    decode: tuple[int, int] = _bounds("decode", (1, 4))
    max_groups: int | None = field(
        default=None, metadata=meta("prefill + decode groups at most (default: the two maxima)")
    )
    interval_s: float = field(default=2.0, metadata=meta("how often the planner decides"))
    cooldown_s: float = field(default=30.0, metadata=meta("the planner's wait after each change"))
    ttft_ms: float | None = field(
        default=None,
        metadata=meta("the TTFT target planned for (default: the router's slo_ttft_ms, else 1000)"),
    )
    tpot_ms: float | None = field(
        default=None,
        metadata=meta("the TPOT target planned for (default: the router's slo_tpot_ms, else 100)"),
    )
    utilization: float = field(default=0.8, metadata=meta("the busy fraction planned for"))
    down_margin: float = field(
        default=1.25, metadata=meta("a role goes down only when this x its need fits in one group fewer")
    )
    scale_half_life_s: float = field(
        default=60.0,
        metadata=meta(
            "a role that missed while its model said it had enough: its model's figure is scaled up to what "
            "it took (at most MAX_SCALE x), the excess halving every this many seconds"
        ),
    )

    def bounds(self) -> Bounds:
        return Bounds(tuple(self.prefill), tuple(self.decode), self.max_groups)

    def validate(self) -> None:
        self.bounds().validate()
        if self.interval_s <= 0 or self.cooldown_s < 0:
            raise ValueError("autoscale interval_s must be > 0 and cooldown_s >= 0")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"autoscale utilization must be in (0, 1], got {self.utilization}")
        if self.down_margin < 1:
            raise ValueError(f"autoscale down_margin must be >= 1, got {self.down_margin}")
        if self.scale_half_life_s <= 0:
            raise ValueError(f"autoscale scale_half_life_s must be > 0, got {self.scale_half_life_s}")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"autoscale {name} must be > 0, got {value}")


@dataclass
class Planner:
    """Decides from the registry's records (`observe`) and asks `scale(prefill, decode)` to act."""

    settings: AutoscaleSettings
    targets: PlanTargets
    counts: Callable[[], tuple[int, int]]  # the groups the launcher runs now
    scale: Callable[[int, int], None]  # raises when the scale fails (the groups before serve on)
    say: Callable[[str], None] = print
    decisions: list[Decision] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)  # "prefill:up" ... -> decisions taken
    failures: int = 0
    last_change: float = -math.inf  # time.monotonic() of the last scale tried
    last_need: Needs | None = None
    model_scale: list[float] = field(default_factory=lambda: [1.0, 1.0])  # learned per role (`learn`)
    changed: list[float] = field(default_factory=lambda: [-math.inf, -math.inf])  # per role: last scale's end
    _last_tick: float | None = None

    def fade(self, now: float) -> None:
        """What `learn` taught fades: the excess of each scale over 1 halves every scale_half_life_s."""
        dt = 0.0 if self._last_tick is None else max(0.0, now - self._last_tick)
        self._last_tick = now
        decay = 0.5 ** (dt / max(self.settings.scale_half_life_s, 1e-3))
        self.model_scale = [1.0 + (x - 1.0) * decay for x in self.model_scale]

    def learn(self, need: Needs, current: tuple[int, int]) -> None:
        """A role short of a group while its model said it had enough teaches the model a scale (what
        the model misses: contention, a batch's expert spread, the hops), so the group added is kept once
        the misses stop, until the lesson fades (`fade`)."""
        for i in range(2):
            figure = need.model[i]
            if need.short[i] and figure is not None and figure > 0:
                self.model_scale[i] = min(MAX_SCALE, max(self.model_scale[i], (current[i] + 1) / figure))

    def decide(self, records: dict[str, dict[str, dict]], now: float) -> Decision | None:
        """One tick: the decision for `records` (role -> member -> record), or None (no change, or the
        cool-down). The scale is not run here (`tick` runs it)."""
        current = self.counts()
        traffic = Traffic.merge(list(records.get(ROUTER_ROLE, {}).values()))
        prefill = RoleLoad.from_beats(list(records.get("prefill", {}).values()))
        decode = RoleLoad.from_beats(list(records.get("decode", {}).values()))
        self.fade(now)
        scale = (self.model_scale[0], self.model_scale[1])
        # a role's measured figures count once the routers' window began after its last change
        window = max((_num(r.get("window_s")) for r in records.get(ROUTER_ROLE, {}).values()), default=0.0)
        settled = (now - self.changed[0] >= window, now - self.changed[1] >= window)
        need = needs(traffic, prefill, decode, current, self.targets, scale, settled)
        self.learn(need, current)
        self.last_need = need
        if now - self.last_change < self.settings.cooldown_s:
            return None
        target = desired(need, current, self.settings.bounds(), self.settings.down_margin)
        # never down while the role's own SLO percentile misses
        ttft_misses = _over(traffic.ttft_p90_ms, self.targets.ttft_ms) or _missing(
            traffic.miss_ttft_rps, traffic.arrival_rps
        )
        tpot_misses = _over(traffic.tpot_p90_ms, self.targets.tpot_ms) or _missing(
            traffic.miss_tpot_rps, traffic.arrival_rps
        )
        if target[0] < current[0] and ttft_misses:
            target = (current[0], target[1])
        if target[1] < current[1] and tpot_misses:
            target = (target[0], current[1])
        after = next_step(current, target)
        if after == current:
            return None
        return Decision(time.time(), current, after, need)

    def tick(self, records: dict[str, dict[str, dict]], now: float) -> Decision | None:
        decision = self.decide(records, now)
        if decision is None:
            return None
        self.last_change = now
        started = time.monotonic()
        self.say(decision.text())
        try:
            self.scale(*decision.after)
        except Exception as err:  # a failed scale: the groups before serve on, tried again after cool-down
            decision.ok, decision.error = False, str(err)
            self.failures += 1
            self.say(decision.text())
        ended = now + (time.monotonic() - started)
        if decision.ok:
            for i, role in enumerate(("prefill", "decode")):
                a, b = decision.before[i], decision.after[i]
                if a != b:
                    key = f"{role}:{'up' if b > a else 'down'}"
                    self.totals[key] = self.totals.get(key, 0) + 1
                    self.changed[i] = ended
        self.decisions.append(decision)
        del self.decisions[:-256]
        self.last_change = ended  # the cool-down runs from the scale's end
        return decision

    def record(self) -> dict:
        """The planner's registry record: its decisions (counted and the last ones), what it wants."""
        need = self.last_need
        return {
            "decisions": dict(self.totals),
            "failures": self.failures,
            "groups": list(self.counts()),
            "need": None
            if need is None
            else {"prefill": round(need.prefill, 3), "decode": round(need.decode, 3)},
            "model_scale": [round(x, 3) for x in self.model_scale],
            "last": [d.to_dict() for d in self.decisions[-8:]],
        }


def _over(value: float | None, target: float) -> bool:
    return value is not None and value > target


class Autoscaler(threading.Thread):
    """The planner's thread beside a launcher: reads the registry every interval, decides, scales, and
    publishes its record (role `planner`) for the routers' /metrics."""

    def __init__(self, meta, planner: Planner, interval_s: float, member_id: str = "launcher"):
        super().__init__(name="autoscaler", daemon=True)
        self.meta, self.planner, self.interval_s, self.member_id = meta, planner, interval_s, member_id
        self.stopped = threading.Event()

    def read(self) -> dict[str, dict[str, dict]] | None:
        records = {}
        for role in (ROUTER_ROLE, "prefill", "decode"):
            members = self.meta.members(role)
            if members is None:  # Redis unreadable: no decision on a partial view
                return None
            records[role] = members
        return records

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                records = self.read()
                if records is not None:
                    self.planner.tick(records, time.monotonic())
                self.meta.register(
                    PLANNER_ROLE, self.member_id, self.planner.record(), 4 * self.interval_s + 5
                )
            except Exception:  # the planner must never take the launcher down
                log.exception("autoscaler tick failed")

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)
        try:
            self.meta.unregister(PLANNER_ROLE, self.member_id)
        except Exception:
            log.exception("autoscaler: unregistering failed")


def start_autoscaler(cfg, redis_url: str, counts, scale, say) -> Autoscaler:
    """The planner of cluster `cfg` (deploy.config.ClusterConfig, its `autoscale` settings) on its Redis,
    scaling through `scale(prefill, decode)`; started."""
    from kvferry.kvpool.metadata import MetadataStore

    auto = cfg.autoscale
    targets = PlanTargets(
        ttft_ms=auto.ttft_ms or cfg.router.slo_ttft_ms or DEFAULT_TTFT_MS,
        tpot_ms=auto.tpot_ms or cfg.router.slo_tpot_ms or DEFAULT_TPOT_MS,
        utilization=auto.utilization,
    )
    planner = Planner(auto, targets, counts, scale, say)
    say(
        f"planner: on (prefill {auto.prefill[0]}-{auto.prefill[1]}, decode {auto.decode[0]}-{auto.decode[1]}"
        + (f", at most {auto.max_groups} groups" if auto.max_groups else "")
        + f"; TTFT {targets.ttft_ms:.0f} ms, TPOT {targets.tpot_ms:.0f} ms"
        + f"; cool-down {auto.cooldown_s:.0f} s)"
    )
    scaler = Autoscaler(MetadataStore(redis_url, cfg.namespace), planner, auto.interval_s)
    scaler.start()
    return scaler


# -- kvferry plan --trace: the same needs over a recorded trace ----------------------------------------
TRACE_KEYS = {
    "arrival_s": ("arrival_s", "timestamp", "arrival_time"),
    "prompt_tokens": ("prompt_tokens", "input_len", "input_length"),
    "output_tokens": ("output_tokens", "output_len", "output_length"),
}


def read_trace(lines) -> list[tuple[float, int, int, int]]:
    """(arrival s, prompt tokens, output tokens, cached tokens) per JSONL line, sorted by arrival. Each line
    is an object with `arrival_s` (or `timestamp`), `prompt_tokens` (or `input_len`) and `output_tokens`
    (or `output_len`), and optionally `cached_tokens` (prompt tokens a cache would hold). Raises
    ValueError naming the line that is wrong."""
    import json

    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise ValueError("not a JSON object")
            values = {}
            for key, names in TRACE_KEYS.items():
                found = [item[n] for n in names if n in item]
                if not found:
                    raise ValueError(f"no {key} (or {', '.join(names[1:])})")
                value = found[0]
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ValueError(f"{key} must be a number >= 0, got {value!r}")
                values[key] = value
            cached = item.get("cached_tokens", 0)
            if (
                isinstance(cached, bool)
                or not isinstance(cached, int)
                or not 0 <= cached <= values["prompt_tokens"]
            ):
                raise ValueError(f"cached_tokens must be an integer in [0, prompt_tokens], got {cached!r}")
        except ValueError as err:
            raise ValueError(f"trace line {number}: {err}") from None
        rows.append(
            (float(values["arrival_s"]), int(values["prompt_tokens"]), int(values["output_tokens"]), cached)
        )
    if not rows:
        raise ValueError("the trace has no requests")
    rows.sort()
    return rows


def plan_trace(
    rows: list[tuple[float, int, int, int]],
    prefill: RoleLoad,
    decode: RoleLoad,
    targets: PlanTargets,
    window_s: float = 60.0,
    max_groups: int | None = None,
) -> dict:
    """Groups each window of the trace needs (the planner's `needs`, without its measured corrections),
    and one fixed P:D for the whole trace: each role's peak, or with `max_groups` the split whose worst
    window has the most headroom (groups over need, of the role that has less)."""
    start, end = rows[0][0], rows[-1][0]
    count = max(1, math.ceil((end - start + 1e-9) / window_s))
    windows = []
    for i in range(count):
        lo, hi = start + i * window_s, start + (i + 1) * window_s
        inside = [r for r in rows if lo <= r[0] < hi or (i == count - 1 and r[0] == hi)]
        if not inside:
            continue
        n = len(inside)
        traffic = Traffic(
            arrival_rps=n / window_s,
            prompt_tokens=sum(r[1] for r in inside) / n,
            uncached_tokens=sum(r[1] - r[3] for r in inside) / n,
            output_tokens=sum(r[2] for r in inside) / n,
        )
        need = needs(traffic, prefill, decode, (1, 1), targets)
        windows.append(
            {
                "start_s": round(lo - start, 3),
                "requests": n,
                "arrival_rps": round(traffic.arrival_rps, 3),
                "prompt_tokens": round(traffic.prompt_tokens, 1),
                "output_tokens": round(traffic.output_tokens, 1),
                "prefill_need": round(need.prefill, 3),
                "decode_need": round(need.decode, 3),
                "prefill": max(1, math.ceil(need.prefill - 1e-9)),
                "decode": max(1, math.ceil(need.decode - 1e-9)),
            }
        )
    if max_groups is None:
        fixed = {"prefill": max(w["prefill"] for w in windows), "decode": max(w["decode"] for w in windows)}
    else:
        if max_groups < 2:
            raise ValueError(f"max_groups must be >= 2 (a prefill and a decode group), got {max_groups}")

        def headroom(p: int) -> float:
            return min(
                min(p / max(w["prefill_need"], 1e-9), (max_groups - p) / max(w["decode_need"], 1e-9))
                for w in windows
            )

        best = max(range(1, max_groups), key=headroom)
        fixed = {
            "prefill": best,
            "decode": max_groups - best,
            "worst_window_headroom": round(headroom(best), 3),
        }
    return {"windows": windows, "fixed": fixed, "window_s": window_s}


def calibrate(model: str, dtype: str = "auto", say=print) -> StepCost:
    """The step-cost fit of this host running `model` in one process (prefills of several sizes and
    decode batches): the engine's own model (engine.cost_model), as a worker fits it while serving."""
    from kvferry.engine.engine import EngineConfig, LLMEngine
    from kvferry.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_model_len=2304, max_num_batched_tokens=512))
    vocab = engine.model.cfg.vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]}

    say("plan: measuring step costs on this host (prefills of 64-2048 tokens, decode batches of 1-32)")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([prompt(n) for n in (64, 128, 256, 512, 1024, 2048)], params)  # prefill chunks
    for batch in (1, 8, 32):  # decode batches
        engine.generate(
            [prompt(64) for _ in range(batch)],
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        )
    fit = engine.step_costs.fit()
    if fit is None:
        raise RuntimeError("calibration recorded too few steps to fit a step cost")
    return fit
